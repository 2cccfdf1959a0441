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

from fused_optim_dist._compact_codes import (
    Groups,
    decode_momentum,
    decode_root,
    encode_momentum,
    encode_root,
    error_bits,
    join24,
    split24,
    sqrt_rn,
)
from fused_optim_dist._torch_internals import flatten, holds_values


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


def correction_factors(t: float, h: Hyper) -> tuple[float, float]:
    """``1 / sqrt(1 - beta2**t)`` and ``lr / (1 - beta1**t)`` for step count ``t``, in
    Python's double precision (every path rounds them to float32 the same way)."""
    return 1 / math.sqrt(1 - h.beta2**t), h.lr / (1 - h.beta1**t)


def bias_corrections(
    numels: Sequence[int], counts: list[float], h: Hyper, device: torch.device
) -> tuple[Factor, Factor]:
    """``1 / sqrt(1 - beta2**t)`` and ``lr / (1 - beta1**t)`` for each parameter's step count
    ``t`` (parameters of ``numels`` elements, one after the other): floats when the batch
    shares one count (the usual case), else float32 tensors on ``device`` with one value per
    element (parameters that missed steps). Either way each element is multiplied by the
    float32 rounding of its parameter's factor, so the result does not depend on which
    parameters share the batch."""

    if min(counts) == max(counts):
        return correction_factors(counts[0], h)
    per_param = torch.tensor([correction_factors(t, h) for t in counts], dtype=torch.float32)
    return tuple(  # type: ignore[return-value]
        column.repeat_interleave(torch.tensor(numels), output_size=sum(numels)).to(device)
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
    gradients ``g``; the state ``buffers`` decoded, updated and encoded in place. ``x``, ``g``
    and the buffers of one value per element (``PER_ELEMENT``) come as :meth:`Groups.rows`
    shapes them (flat for vectors). Returns the new weights, flat (bfloat16 where they keep an
    error)."""
    split = "weight_error" in buffers
    if split:
        # x holds the bfloat16 bits in its upper half: add the error below them.
        bits = x.view(torch.int32)
        bits.add_(error_bits(bits, buffers["weight_error"]))
    if groups is None:  # parameters of at most one dim: 24-bit moments
        m = join24(buffers["exp_avg"], buffers["exp_avg_error"])
        v = join24(buffers["exp_avg_sq"], buffers["exp_avg_sq_error"])
    else:
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
    high = x
    if split:
        high, error = split24(x)
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
    return high.view(-1)


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


# ------------------------------------------------------------------------------ flat batches

PER_ELEMENT = ("weight_error", "exp_avg_code", "exp_avg_sq_root_code")
"""The state of one value per element (a 4-bit code: half a byte) of a matrix's batch."""


class FlatBatch:
    """A batch stepped by :func:`update_flat` (eager or compiled): its weights, gradients and
    state gathered into flat buffers, one ``torch.cat`` per key, updated, and copied back, one
    ``torch._foreach_copy_`` per key. See [Note: layout-independent arithmetic].

    [Note: kept flat views]
    Flattening a tensor and splitting the flat buffer back into views shaped like it cost one
    C++ call per tensor and key at every step, which on small tensors is most of the step
    (measured, 24 bfloat16 tensors of 32 elements: 16 us to flatten them with
    ``_flatten_dense_tensors`` and 45 us to copy back through ``_unflatten_dense_tensors``'
    views, against 6.5 and 11 us through views kept). A batch keeps a flat view of each of its
    contiguous weights and state tensors, and its :class:`Groups`, so that its group's plan
    steps it again at the next step without making them (``FlatPlan`` in
    ``_compact_plan.py``). A tensor that is not contiguous has no flat view: it is gathered
    through a copy and written back through a view of the buffer shaped like it, and such a
    batch is not kept (``reusable``).
    """

    __slots__ = ("groups", "numels", "reusable", "sizes", "sources", "targets")

    def __init__(self, params: Sequence[Param], keys: Sequence[str], groups: Groups | None) -> None:
        tensors = {
            "weight": [p.weight for p in params],
            **{key: [p.state[key] for p in params] for key in ("step", *keys)},
        }
        self.groups = groups
        self.numels = [p.weight.numel() for p in params]
        self.reusable = all(t.is_contiguous() for ts in tensors.values() for t in ts)
        self.sources = {key: [t.reshape(-1) for t in ts] for key, ts in tensors.items()}
        self.targets = self.sources if self.reusable else tensors
        self.sizes = {key: [t.numel() for t in ts] for key, ts in tensors.items()}

    def update(
        self, grads: Sequence[torch.Tensor], h: Hyper, update_flat: FlatUpdate
    ) -> Callable[[], None]:
        """Update the batch, with gradients ``grads`` (its parameters' local tensors, in
        order), into new flat tensors; returns what writes them into its weights and state.
        See [Note: a group moves whole or not at all] in ``compact_adamw.py``."""
        buffers = {key: torch.cat(views) for key, views in self.sources.items() if key != "weight"}
        buffers["step"] += 1
        x = torch.cat(self.sources["weight"])
        corrections = bias_corrections(self.numels, _step_counts(buffers["step"]), h, x.device)
        x = x.float() if x.dtype != torch.float32 else x
        g = flat_float32(grads)
        if self.groups is not None:  # See [Note: rows of one group].
            x, g = self.groups.rows(x), self.groups.rows(g)
            shaped = {
                key: self.groups.rows(flat) if key in PER_ELEMENT else flat
                for key, flat in buffers.items()
            }
        else:
            shaped = buffers
        high = update_flat(x, g, shaped, self.groups, h, corrections)

        def write() -> None:
            for key, flat in (("weight", high), *buffers.items()):
                pieces = flat.split_with_sizes(self.sizes[key])
                targets = self.targets[key]
                if not self.reusable:
                    pieces = [piece.view(t.shape) for piece, t in zip(pieces, targets, strict=True)]
                torch._foreach_copy_(targets, pieces)

        return write


def _step_counts(steps: torch.Tensor) -> list[float]:
    """Host values of the step counts (CPU scalars, read without a device sync).

    Under ``FakeTensorMode`` (the memory estimator) there are no values to read; memory does
    not depend on them, so every count is taken as 1."""
    if not holds_values(steps):
        return [1.0] * steps.numel()
    return steps.tolist()
