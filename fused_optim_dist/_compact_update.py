"""CompactAdamW's update in whole-tensor ops (the eager path; compiled by ``kernel="compile"``).

[Note: layout-independent arithmetic]
A step concatenates the parameters of a param group (of one kind, dtype and device: a batch)
into flat buffers, weights and gradients converted to float32 as they are copied and each state
key in one copy, updates them with whole-tensor ops, one call each for the whole batch, and
copies weights and state back (one ``_foreach_copy_`` per key): per-parameter ops cost more in
dispatch than in arithmetic for small tensors, and a third of a per-tensor implementation's time
went to dtype conversions of each small tensor. The state tensors are not made views of one
buffer, which would save the copies: DCP's asynchronous staging (torch 2.13) fails on DTensors
that share a storage.

For the results to be the same bit for bit whatever else is in the batch (one FSDP unit in
backward, every parameter after it, another number of ranks), only correctly rounded single ops
are used (add, mul, div, sqrt, round, casts, maxima, integer ops), and never a division by a
scalar (which the CPU kernel turns into a multiplication by its reciprocal): the bias
corrections are multiplied by, as float32 factors, one per element where the parameters of a
batch have different step counts. Fused forms (``addcmul``, ``lerp``, ``add`` with ``alpha``,
the fused AdamW kernel) may use an FMA in vectorised loops and not in their scalar remainders:
measured, ``torch._fused_adamw_`` gives other bits for the same element at another offset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch._utils import _unflatten_dense_tensors

from fused_optim_dist._compact_codes import (
    Groups,
    decode_momentum,
    decode_root,
    encode_momentum,
    encode_root,
    join24,
    split24,
    sqrt_rn,
)
from fused_optim_dist._torch_internals import flatten


class Hyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    compand: bool
    variance_bits: int

    @classmethod
    def of(cls, group: dict[str, Any]) -> Hyper:
        """A param group's hyperparameters as Python numbers (``torch.optim.AdamW`` also takes
        tensors for them), read the same way by every path."""
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            compand=group["compand"],
            variance_bits=group["variance_bits"],
        )


Factor = float | torch.Tensor
"""A float, or a float32 tensor with one value per element of a batch."""


def bias_corrections(
    params: Sequence[Param], counts: list[float], h: Hyper
) -> tuple[Factor, Factor]:
    """``1 / sqrt(1 - beta2**t)`` and ``lr / (1 - beta1**t)`` for each parameter's step count
    ``t``: floats when the batch shares one count (the usual case), else float32 tensors with
    one value per element (parameters that missed steps). Either way each element is multiplied
    by the float32 rounding of its parameter's factor, so the result does not depend on which
    parameters share the batch."""

    def factors(t: float) -> tuple[float, float]:
        return 1 / math.sqrt(1 - h.beta2**t), h.lr / (1 - h.beta1**t)

    if min(counts) == max(counts):
        return factors(counts[0])
    per_param = torch.tensor([factors(t) for t in counts], dtype=torch.float32)
    numels = torch.tensor([p.weight.numel() for p in params])
    total = int(numels.sum())
    device = params[0].weight.device
    return tuple(  # type: ignore[return-value]
        column.repeat_interleave(numels, output_size=total).to(device)
        for column in per_param.unbind(1)
    )


def adamw(
    x: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: Hyper,
    corrections: tuple[Factor, Factor],
) -> torch.Tensor:
    """AdamW on float32 weights ``x``, gradient ``g``, moments ``m``, ``v``, all in place; the
    arithmetic of ``torch.optim.AdamW`` in unfused ops, the bias corrections multiplied by
    (:func:`bias_corrections`). Returns the square root of the new ``v``. See [Note:
    layout-independent arithmetic]."""
    inverse_sqrt_correction2, step_size = corrections
    m.mul_(h.beta1).add_(g.mul(1 - h.beta1))
    v.mul_(h.beta2).add_(g.mul(g).mul_(1 - h.beta2))
    root = sqrt_rn(v)
    denom = root.mul(inverse_sqrt_correction2).add_(h.eps)
    x.mul_(1 - h.lr * h.weight_decay)
    x.sub_(m.div(denom).mul_(step_size))
    return root


class Param(NamedTuple):
    """One parameter in a step."""

    param: torch.Tensor
    """As the optimizer holds it (a DTensor, or the local shard ``OptimizerInBackward`` hands
    in)."""
    weight: torch.Tensor
    """Its local tensor."""
    grad: torch.Tensor
    """The local tensor of its gradient."""
    state: dict[str, torch.Tensor]
    """The local tensors of its state entry (a dict of this step's own)."""


def flat_float32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new float32 tensor holding ``tensors`` flattened one after the other.

    Concatenated in their own dtype, then converted: ``torch.cat`` into a float32 ``out``
    converts as it copies but takes a slow path per tensor (measured on the CPU: 144 us for
    48 small bfloat16 tensors, against 27 us), and its input views cost one Python call each.
    """
    flat = flatten(list(tensors))
    if flat.dtype != torch.float32:
        return flat.float()
    return flat if len(tensors) > 1 else flat.clone()  # one tensor: a view of it


def update(
    params: Sequence[Param],
    buffers: dict[str, torch.Tensor],
    groups: Groups | None,
    h: Hyper,
    corrections: tuple[Factor, Factor],
    update_flat: FlatUpdate,
) -> torch.Tensor:
    """The new weights of ``params`` (one kind and dtype), flat, and their new state in the flat
    ``buffers``: the weights and gradients gathered into float32 buffers, ``update_flat``
    (:func:`update_flat`, eager or compiled) on them. Nothing of ``params`` is written."""
    g = flat_float32([p.grad for p in params])
    x = flat_float32([p.weight for p in params])
    return update_flat(x, g, buffers, groups, h, corrections)


def update_flat(
    x: torch.Tensor,
    g: torch.Tensor,
    buffers: dict[str, torch.Tensor],
    groups: Groups | None,
    h: Hyper,
    corrections: tuple[Factor, Factor],
) -> torch.Tensor:
    """The update of a whole batch in whole-tensor ops, one call each: float32 weights ``x``
    (bfloat16 values, their error in ``buffers["weight_error"]`` where it is there) and
    gradients ``g``, flat; the state ``buffers`` decoded, updated and encoded in place. Returns
    the new weights, flat (bfloat16 where they keep an error)."""
    split = "weight_error" in buffers
    if split:
        # x holds the bfloat16 bits in its upper half: add the error below them.
        x.view(torch.int32).add_(buffers["weight_error"].to(torch.int32).bitwise_left_shift_(8))
    if groups is None:  # parameters of at most one dim: 24-bit moments
        m = join24(buffers["exp_avg"], buffers["exp_avg_error"])
        v = join24(buffers["exp_avg_sq"], buffers["exp_avg_sq_error"])
    else:
        x, g = groups.view(x), groups.view(g)
        m = decode_momentum(buffers["exp_avg_code"], buffers["exp_avg_scale"], groups, h.compand)
        root = decode_root(
            buffers["exp_avg_sq_root_code"],
            buffers["exp_avg_sq_root_scale"],
            groups,
            h.variance_bits,
        )
        v = root.mul_(root)
        corrections = tuple(  # type: ignore[assignment]
            c if isinstance(c, float) else groups.view(c) for c in corrections
        )
    root = adamw(x, g, m, v, h, corrections)
    high = x.view(-1)
    if split:
        high, error = split24(high)
        buffers["weight_error"].copy_(error)
    if groups is None:
        for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
            moment, error = split24(value)
            buffers[key].copy_(moment)
            buffers[f"{key}_error"].copy_(error)
    else:
        encode_momentum(m, groups, buffers["exp_avg_code"], buffers["exp_avg_scale"], h.compand)
        encode_root(
            root,
            groups,
            buffers["exp_avg_sq_root_code"],
            buffers["exp_avg_sq_root_scale"],
            h.variance_bits,
        )
    return high


FlatUpdate = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        dict[str, torch.Tensor],
        "Groups | None",
        Hyper,
        tuple[Factor, Factor],
    ],
    torch.Tensor,
]


# ------------------------------------------------------------------------------ flat state


def gather_state(params: Sequence[Param], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each of ``keys``' state of ``params``, flattened into one new tensor (one copy per key,
    a copy even for one parameter: the update writes into it). See [Note: layout-independent
    arithmetic]."""
    buffers = {key: flatten([p.state[key] for p in params]) for key in keys}
    if len(params) == 1:  # then each is a view of the parameter's state tensor
        buffers = {key: flat.clone() for key, flat in buffers.items()}
    return buffers


def copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` (``tensors``' elements one after the other) into ``tensors`` (one call)."""
    torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))


def scatter_state(params: Sequence[Param], buffers: dict[str, torch.Tensor]) -> None:
    """Copy the flat ``buffers`` back into each parameter's state tensors (one call per key)."""
    for key, flat in buffers.items():
        copy_back(flat, [p.state[key] for p in params])
