"""Shard a decoder with FSDP2: one ``fully_shard`` unit per block plus the root."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp"]


def apply_fsdp(
    model: nn.Module,
    *,
    blocks: Iterable[nn.Module] | None = None,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each block, then to ``model`` (the root); return ``model``.

    Each block becomes one FSDP unit, so an ``OptimizerInBackward`` built afterwards steps one
    block's shards at a time; embeddings, final norm and head belong to the root unit.
    ``fully_shard`` replaces every parameter: build optimizers only after this call.

    Args:
        model: the model to shard in place.
        blocks: the repeated blocks; default ``model.layers``.
        mesh: 1-D mesh to shard over; default the whole default process group.
        mp_policy: FSDP2 mixed-precision policy; default full precision.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them
            until backward (ZeRO-2 style).
        activation_checkpointing: recompute each block's activations in backward
            (non-reentrant, and parameter names are unchanged, so checkpoints written with
            and without it are interchangeable).

    Raises:
        ValueError: if ``blocks`` is not given and ``model`` has no ``layers`` attribute, or
            there are no blocks.
    """
    if blocks is None:
        if not hasattr(model, "layers"):
            raise ValueError(
                f"{type(model).__name__} has no 'layers' attribute; pass blocks= with the "
                "modules to shard one by one"
            )
        blocks = model.layers
    blocks = list(blocks)
    if not blocks:
        raise ValueError("apply_fsdp got no blocks to shard; pass the model's repeated blocks")
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        fsdp_kwargs["mp_policy"] = mp_policy
    for block in blocks:
        if activation_checkpointing:
            checkpoint(block)
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model
