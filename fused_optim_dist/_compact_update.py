"""CompactAdamW's update in whole-tensor ops (the eager path; compiled by ``kernel="compile"``).

[Note: layout-independent arithmetic]
A step concatenates the parameters of a param group (of one kind, dtype and device: a batch)
into flat buffers, weights and gradients converted to float32 as they are copied and each state
key in one copy, updates them with whole-tensor ops, one call each for the whole batch (eager
on the CPU: for each chunk of about 2**18 elements, [Note: chunked updates]), and copies
weights and state back (one ``_foreach_copy_`` per key): per-parameter ops cost more in
dispatch than in arithmetic for small tensors, and a third of a per-tensor implementation's
time went to dtype conversions of each small tensor. The state tensors are not made views of
one buffer, which would save the copies: DCP's asynchronous staging (torch 2.13) fails on
DTensors that share a storage.

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
    packed_row_bytes,
    row_groups,
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
    """The update of a batch (or a chunk of it) in whole-tensor ops: float32 weights ``x``
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
    state gathered into flat buffers, one ``torch.cat`` per key, updated (eager on the CPU:
    ``chunked``, chunk by chunk; [Note: chunked updates]), and copied back, one
    ``torch._foreach_copy_`` per key. See [Note: layout-independent arithmetic].

    [Note: kept flat views]
    Flattening a tensor and splitting the flat buffer back into views shaped like it cost one
    C++ call per tensor and key at every step, which on small tensors is most of the step
    (measured, 24 bfloat16 tensors of 32 elements: 16 us to flatten them with
    ``_flatten_dense_tensors`` and 45 us to copy back through ``_unflatten_dense_tensors``'
    views, against 6.5 and 11 us through views kept). A batch keeps a flat view of each of its
    contiguous weights and state tensors, and its chunks' :class:`Groups`, so that its group's
    plan steps it again at the next step without making them (``FlatPlan`` in
    ``_compact_plan.py``). A tensor that is not contiguous has no flat view: it is gathered
    through a copy and written back through a view of the buffer shaped like it, and such a
    batch is not kept (``reusable``).
    """

    __slots__ = ("chunks", "numels", "reusable", "sizes", "sources", "targets")

    def __init__(
        self, params: Sequence[Param], keys: Sequence[str], groups: Groups | None, chunked: bool
    ) -> None:
        tensors = {
            "weight": [p.weight for p in params],
            **{key: [p.state[key] for p in params] for key in ("step", *keys)},
        }
        self.numels = [p.weight.numel() for p in params]
        weight = params[0].weight
        self.chunks = (  # See [Note: chunked updates].
            chunks([p.weight.shape for p in params], groups, weight.device)
            if chunked and weight.device.type == "cpu" and holds_values(weight)
            else [Chunk.whole(groups)]
        )
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
        highs = [chunk.update(x, g, buffers, h, corrections, update_flat) for chunk in self.chunks]
        high = highs[0] if len(highs) == 1 else torch.cat(highs)

        def write() -> None:
            for key, flat in (("weight", high), *buffers.items()):
                pieces = flat.split_with_sizes(self.sizes[key])
                targets = self.targets[key]
                if not self.reusable:
                    pieces = [piece.view(t.shape) for piece, t in zip(pieces, targets, strict=True)]
                torch._foreach_copy_(targets, pieces)

        return write


CHUNK_NUMEL = 2**18
"""About the most elements of a batch :func:`update_flat` is called on at once. See [Note:
chunked updates]."""


class Chunk(NamedTuple):
    """Whole rows of a batch (any elements of a batch of vectors), updated in one call of
    :func:`update_flat`.

    [Note: chunked updates]
    The flat update makes about fifty whole-tensor ops, most of them writing a new float32
    tensor as large as their input. Called on a whole batch, those temporaries outgrow the
    caches, and every op reads and writes main memory; large ones are fresh pages from the
    operating system at every step as well. In chunks of about ``CHUNK_NUMEL`` elements (1 MiB
    per float32 temporary) they stay in the L2 and L3 caches while a chunk is updated: measured
    on the CPU (eager ops, one thread, a batch of matrices with rows of 256, each call with cold
    caches, medians of 5), 4.8M elements took 130-263 ms in one call and 84-87 ms in chunks
    of 2**18, 20M elements 1835 and 386 ms. Chunks of 2**16 elements took 107-109 ms (each
    op's cost per call), 2**17 93, 2**19 88 and 2**20 102. The scratch memory of an update is
    bounded by the chunk rather than by the batch. Chunks hold whole rows, so that every
    quantization group is in one of them, and every op is elementwise or per group: the bits
    are those of one call on the whole batch.

    Only the eager path, only on the CPU (``chunked`` of :class:`FlatBatch`). The compiled
    path fuses its ops into a few loops with few temporaries, and each of its calls costs
    Dynamo's guards and Inductor's wrappers (about 0.7 ms with cold caches): on a 1B Llama's
    shards at 8 ranks (17 units, 122M elements) its step took 1.49-1.83 s in chunks of
    2**18 and 1.27-1.45 s in one call per batch (alternated in one process). On CUDA an op
    on a chunk would cost its launch, microseconds, more than its arithmetic (chunking there
    is not measured). Nor are fake tensors chunked: the memory estimator simulates a GPU's
    step with them.
    """

    elements: slice
    """Its elements, in the batch's tensors of one value per element."""
    scales: slice
    """Its groups, in the batch's scales."""
    codes: slice
    """Its bytes of root codes (``elements`` but for 4-bit codes, two to a byte)."""
    groups: Groups | None
    """Its groups; ``None`` for a batch of vectors."""

    @classmethod
    def whole(cls, groups: Groups | None) -> Chunk:
        """The whole batch, quantized in ``groups``, as one chunk."""
        everything = slice(None)
        return cls(everything, everything, everything, groups)

    def update(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        buffers: dict[str, torch.Tensor],
        h: Hyper,
        corrections: tuple[Factor, Factor],
        update_flat: FlatUpdate,
    ) -> torch.Tensor:
        """:func:`update_flat` on this chunk of the batch's flat weights ``x``, gradients ``g``
        and state ``buffers``, shaped as it takes them (see [Note: rows of one group]); the
        state is updated in place, the new weights returned."""
        shaped = {}
        for key, flat in buffers.items():
            if key == "step":
                continue
            if self.groups is None or key in PER_ELEMENT:
                piece = flat[self.codes if key == "exp_avg_sq_root_code" else self.elements]
                shaped[key] = piece if self.groups is None else self.groups.rows(piece)
            else:
                shaped[key] = flat[self.scales]
        x, g = x[self.elements], g[self.elements]
        if self.groups is not None:
            x, g = self.groups.rows(x), self.groups.rows(g)
        corrections = tuple(  # type: ignore[assignment]
            c if isinstance(c, float) else c[self.elements] for c in corrections
        )
        return update_flat(x, g, shaped, self.groups, h, corrections)


def chunks(
    shapes: Sequence[torch.Size], groups: Groups | None, device: torch.device
) -> list[Chunk]:
    """A batch of tensors shaped ``shapes`` (quantized in ``groups``, on ``device``) cut into
    chunks of whole rows of at most ``CHUNK_NUMEL`` elements, or of one row where a row is
    longer. See [Note: chunked updates]."""
    numel = sum(math.prod(shape) for shape in shapes)
    if numel <= CHUNK_NUMEL:
        return [Chunk.whole(groups)]
    if groups is None:
        return [
            Chunk(part, slice(None), part, None)
            for start in range(0, numel, CHUNK_NUMEL)
            for part in (slice(start, min(start + CHUNK_NUMEL, numel)),)
        ]
    runs: list[list[torch.Size]] = [[]]  # each chunk's row runs as (rows, row length)
    filled = 0
    for shape in shapes:
        rows, length = shape[0], math.prod(shape[1:])
        while rows and length:
            room = (CHUNK_NUMEL - filled) // length
            if room <= 0 and filled:
                runs.append([])
                filled = 0
                continue
            take = min(rows, max(room, 1))
            runs[-1].append(torch.Size((take, length)))
            filled += take * length
            rows -= take
    result = []
    offsets = (0, 0, 0)  # elements, groups, root code bytes
    for run in runs:
        sizes = [
            (rows * length, rows * row_groups(length), rows * packed_row_bytes(length))
            for rows, length in run
        ]
        elements, scales, code_bytes = (sum(column) for column in zip(*sizes, strict=True))
        ends = (offsets[0] + elements, offsets[1] + scales, offsets[2] + code_bytes)
        part = slice(offsets[0], ends[0])
        codes = slice(offsets[2], ends[2]) if groups.packed else part
        chunk_groups = Groups(run, groups.packed).to(device)
        result.append(Chunk(part, slice(offsets[1], ends[1]), codes, chunk_groups))
        offsets = ends
    return result


def _step_counts(steps: torch.Tensor) -> list[float]:
    """Host values of the step counts (CPU scalars, read without a device sync).

    Under ``FakeTensorMode`` (the memory estimator) there are no values to read; memory does
    not depend on them, so every count is taken as 1."""
    if not holds_values(steps):
        return [1.0] * steps.numel()
    return steps.tolist()
