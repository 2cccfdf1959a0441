"""Peak memory of one training step, by kind, and its analytic lower bound.

The tracker is the fine-tuning application's ``StepMemoryTracker``
(:mod:`fused_optim_dist_recipes.memory_tracking`): PyTorch's ``FSDPMemTracker``, a
``TorchDispatchMode`` that sees every allocation whatever runs it (our hooks, the per-parameter
hooks, a plain step), with optimizer state labelled by identity and what the loop runs after
backward labelled temporary. The benchmarks add two readings: the peak of one device type
only (on CUDA, host tensors such as optimizers' ``step`` counters are tracked apart and left
out), and the largest activation memory seen at once.

On CUDA the allocator's peak (``max_memory_allocated`` above what was allocated before the
method was built) is recorded next to the tracker's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fused_optim_dist_recipes.memory_tracking import KINDS, StepMemoryTracker

__all__ = ["KINDS", "StepTracker", "lower_bound"]


_TOTAL = "Total"


class StepTracker(StepMemoryTracker):
    """``StepMemoryTracker`` read on one device type, with the activation peak.

    Args:
        model: the root ``fully_shard`` module.
        state: the optimizer state tensors that exist on entry.
        device: the device type to report (on CUDA, host tensors such as optimizers' ``step``
            counters are tracked apart and left out).
    """

    def __init__(self, model: nn.Module, state: Iterable[torch.Tensor], device: str) -> None:
        super().__init__(model, state)
        self._device = device
        self.activation_peak = 0
        """Largest activation memory (activations and inputs) seen at once, in bytes."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        for device, snap in self._curr_mem_snap.items():
            if device.type == self._device:
                active = sum(snap.get(ref, 0) for ref in KINDS["activations"])
                self.activation_peak = max(self.activation_peak, active)

    def peak(self) -> tuple[int, dict[str, int], dict[str, int]]:  # type: ignore[override]
        """The peak total in bytes and, at that moment, the bytes of each of ``KINDS`` and of
        each of the tracker's own categories."""
        snaps = [s for d, s in self.get_tracker_snapshot("peak").items() if d.type == self._device]
        if len(snaps) != 1:
            raise RuntimeError(
                f"expected one {self._device} device in the tracker, found {len(snaps)}"
            )
        snap = snaps[0]
        by_kind = {kind: sum(snap.get(ref, 0) for ref in refs) for kind, refs in KINDS.items()}
        by_category = {ref.value: snap.get(ref, 0) for ref in _FSDPRefType}
        return snap[_TOTAL], by_kind, by_category


def _local_nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _unit_params(unit: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters ``unit``'s own ``fully_shard`` manages (not those of nested units)."""
    nested = {
        id(p)
        for m in unit.modules()
        if m is not unit and isinstance(m, FSDPModule)
        for p in m.parameters()
    }
    return (p for p in unit.parameters() if id(p) not in nested)


def lower_bound(
    model: nn.Module,
    state: Iterable[torch.Tensor],
    activations: int,
    compute_dtype: torch.dtype | None,
) -> dict[str, int]:
    """This rank's floor: sharded params + optimizer state + the largest unit unsharded
    (params and grads, in ``compute_dtype`` or the params' dtype) + the next-largest unit's
    unsharded params (FSDP2's prefetch) + ``activations`` bytes.

    Returns the terms and their sum (``"total"``), in bytes.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def unsharded_params(unit: nn.Module) -> int:
        return sum(p.numel() * (compute_dtype or p.dtype).itemsize for p in _unit_params(unit))

    # Params and grads of the unit in backward, plus the params of the next one, which FSDP2
    # all-gathers ahead (backward prefetch) while the current one computes.
    sizes = sorted(map(unsharded_params, units), reverse=True) + [0, 0]

    terms = {
        "sharded_params": sum(_local_nbytes(p) for p in model.parameters()),
        "optimizer_state": sum(_local_nbytes(t) for t in state),
        "largest_unit_unsharded": 2 * sizes[0],
        "prefetched_next_unit": sizes[1],
        "activations": activations,
    }
    return {**terms, "total": sum(terms.values())}
