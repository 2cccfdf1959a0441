"""``CompactAdamW``: AdamW in about five bytes per parameter, stepped on local shards.

Persistent state per element of a bfloat16 parameter of two or more dims:

============================  ======  ===================================================
what                          bytes   held as
============================  ======  ===================================================
weight                        2       the parameter itself (bfloat16)
``weight_error``              1       int8: the weight's rounding error in 1/256 bf16 ULP
``exp_avg_code``              1       int8: momentum, companded, per group of 32
``exp_avg_sq_root_code``      1       uint8: square root of the variance, per group of 32
                              (0.5)   (``variance_bits=4``: two 4-bit codes to a byte)
``exp_avg_scale`` and         2 x 2   bfloat16: one scale per group of 32 (0.125 B/param)
``exp_avg_sq_root_scale``     / 32
============================  ======  ===================================================

5.125 bytes per parameter where rows are multiples of 32 elements (a short last group per row
otherwise), against 12 for fp32 AdamW (fp32 weight and two fp32 moments); 4.625 with
``variance_bits=4`` (``exp_avg_sq_root_code`` in half a byte: see [Note: 4-bit variance]).
Parameters of at most one dim (norm weights, biases) keep each moment as a bfloat16 value plus
an int8 error (3 bytes each): see [Note: groups never cross a row].

[Note: groups never cross a row]
FSDP2 shards every parameter along dim 0, so each rank holds whole rows. A quantization group
is 32 consecutive elements of one row (the last group of a row is shorter when the row length is
not a multiple of 32), and the scales are shaped ``(rows, groups_per_row)``. So each local shard
holds whole groups, the update of a shard needs nothing from another rank (the class is declared
elementwise: ``OptimizerInBackward`` steps local shards with it), and resharding along dim 0
(DCP, N ranks to M) moves rows of codes and rows of scales together: the state is the same
bit for bit on any number of ranks. A one-dim parameter is sharded along its only dim, where a
group would cross shards, so its moments are not grouped: each element keeps its own 24-bit
value (bfloat16 and an int8 error, as the weights). Parameters sharded along another dim
(tensor parallelism's ``Shard(1)``) are not supported: their local rows are not whole rows.

[Note: 24-bit weights]
A bfloat16 weight holds 8 significant bits; an AdamW update smaller than half its ULP is lost.
``weight_error`` keeps the rounding error of the last update in units of 1/256 of the weight's
ULP, so that the pair holds 16 significant bits. It is computed on the float32 bit pattern:
``bits(x)`` is rounded to a multiple of 2**8 (nearest, ties up: the 24 bits the pair keeps);
a bfloat16 is the upper half of a float32, so the weight is the upper 16 bits of that rounded
to nearest (add half of bit 16, shift), and the error is the rest, ``rounded - bits(w) <<
16``, a multiple of 2**8 in [-2**15, 2**15), stored divided by it (-128..127). Decoding is
``bits(x) = bits(w) << 16 + error << 8``: exact integer arithmetic, the same on every device,
within half of 2**8 float32 ULPs of ``x``, which is 1/512 of the weight's bfloat16 ULP. Each
step decodes ``x``, updates it in float32 and splits it again. Without the error
(``weight_correction=False``) the weights are plain bfloat16 and small updates are lost
(``tests/test_compact_adamw.py`` shows it; ``benchmarks/results/compact_adamw_quality.md``
measures what it costs in training).

[Note: 8-bit moments]
The momentum of a group is divided by the group's largest magnitude (its scale), companded with
``z = 2y / (1 + |y|)`` (slope 2 at zero: twice the resolution for small values, where most of
them are) and rounded to ``round(127 z)``. Decoding inverts it exactly:
``y = code / (254 - |code|)``. The variance is kept as its square root (the value the update
divides by, with half the dynamic range of the variance), divided by the group's largest root
and rounded to ``round(255 r)``, but never to 0 unless it is 0: a second moment rounded to 0
under a nonzero momentum would divide the update by ``eps`` alone. Scales are bfloat16 (the
range of float32; their rounding is part of the encoding, codes are computed against the
rounded scale).

[Note: 4-bit variance]
With ``variance_bits=4`` the root of the variance takes 16 levels per group instead of 256.
Linear levels would put every root below 1/30 of its group's largest on the first level, so
the code is the square root of the ratio instead, ``round(15 * sqrt(r / scale))`` (computed as
``sqrt(r * (225 / scale))``, correctly rounded), decoded as ``scale * code**2 / 225``: the
smallest nonzero root is 1/225 of the scale (8 bits, linear: 1/255), and a root is within half
a level of its square root, a relative error of 7% near the scale and more below it. As with 8
bits, a positive root never gets code 0. The codes are packed two to a byte, group by group:
in a group of ``n`` elements, byte ``k`` holds element ``k`` in its low nibble and element
``k + ceil(n / 2)`` in its high one (a group of odd length ends in a zero nibble), so a whole
group is 16 bytes whose low nibbles are its first 16 codes and high nibbles its last 16: two
vector ops to unpack or pack, where adjacent pairs would need an interleave. A row holds
``ceil(row length / 2)`` bytes: ``exp_avg_sq_root_code`` is a uint8 tensor of shape ``(rows,
ceil(row length / 2))``, so it reshards along dim 0 with its rows as the 8-bit codes do. The
eager and compiled paths unpack a batch's codes into one per element (through an index of
their nibbles where some group is short) and pack them back. ``variance_bits`` is fixed for a
run: a state written with the other width is refused at the next step (its codes would be
read as garbage).
``benchmarks/results/compact_adamw_quality.md`` measures what the 4 bits cost in training.

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

[Note: state dtypes across load_state_dict]
``torch.optim.Optimizer.load_state_dict`` casts every state tensor except ``step`` to its
parameter's floating dtype. Every value here survives the cast to bfloat16 or float32 exactly
(int8 and uint8 codes are integers of at most 8 bits; scales and 24-bit moments are bfloat16),
and ``__setstate__``, which ``load_state_dict`` calls last (``OptimizerInBackward`` too, on the
class it wraps), casts each back to its dtype by key. It also converts an AdamW entry
(``exp_avg``, ``exp_avg_sq`` as float tensors) into this layout, quantizing; see
:func:`to_adamw_state_dict` for the reverse.
"""

from __future__ import annotations

import ctypes
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fused_optim_dist import _compact_compiled, _compact_kernel
from fused_optim_dist._kinds import declare_stepping, per_parameter_state
from fused_optim_dist._state_identity import StateEntries
from fused_optim_dist._stepping import _placed_like
from fused_optim_dist._torch_internals import holds_values

__all__ = [
    "GROUP_SIZE",
    "VARIANCE_BITS",
    "CompactAdamW",
    "load_master_weight",
    "master_weight",
    "to_adamw_state_dict",
]

GROUP_SIZE = 32
"""Elements per quantization group (within one row)."""

_MOMENTUM_LEVELS = 127  # int8 codes -127..127
_ROOT_LEVELS = 255  # uint8 codes 0..255
_ROOT4_LEVELS = 15  # 4-bit codes 0..15, two to a byte
VARIANCE_BITS = (8, 4)
"""Bits of a second moment's code (``variance_bits``). See [Note: 4-bit variance]."""
_HALF_BF16_BIT = 0x8000  # float32 bits: half of the lowest bit a bfloat16 keeps
_HALF_ERROR_BIT = 0x80  # half of the lowest bit the error keeps (bit 8 of the float32)
_ERROR_BITS = ~0xFF  # the float32 bits the pair keeps: all but the lowest 8

_CODE_DTYPES = {
    "weight_error": torch.int8,
    "exp_avg_code": torch.int8,
    "exp_avg_scale": torch.bfloat16,
    "exp_avg_sq_root_code": torch.uint8,
    "exp_avg_sq_root_scale": torch.bfloat16,
    "exp_avg_error": torch.int8,
    "exp_avg_sq_error": torch.int8,
}
"""State dtypes by key. ``exp_avg``/``exp_avg_sq`` are bfloat16 where an ``_error`` pairs them
(parameters of at most one dim), AdamW's own float tensors otherwise (converted on load)."""

_ROW_KEYS = ("exp_avg_code", "exp_avg_scale", "exp_avg_sq_root_code", "exp_avg_sq_root_scale")
_FLAT_KEYS = ("exp_avg", "exp_avg_error", "exp_avg_sq", "exp_avg_sq_error")
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------ the encodings


def _join24(high: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """float32 of a bfloat16 ``high`` and its int8 ``error``. See [Note: 24-bit weights]."""
    bits = high.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    bits += error.to(torch.int32).bitwise_left_shift_(8)
    return bits.view(torch.float32)


def _split24(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32) rounded to bfloat16, and the int8 error of that rounding. See
    [Note: 24-bit weights]."""
    rounded = value.view(torch.int32).add(_HALF_ERROR_BIT).bitwise_and_(_ERROR_BITS)
    high = rounded.add(_HALF_BF16_BIT).bitwise_right_shift_(16)
    error = rounded.sub_(high.bitwise_left_shift(16)).bitwise_right_shift_(8)  # -128..127
    return high.to(torch.int16).view(torch.bfloat16), error.to(torch.int8)


class _Groups:
    """The quantization groups of a flat batch: 32 consecutive elements of a row, the last
    group of a row shorter where the row length is not a multiple of 32. See [Note: groups
    never cross a row].

    ``lengths``: each group's length (int32), or ``None`` when every row is a multiple of 32
    elements long (the groups are then ``flat.view(-1, 32)``, without an index). ``slots``,
    for 4-bit codes packed by group (``packed``): where each element's code lies among the
    nibbles (two per byte, low first), or ``None`` where every group is whole (then the
    groups' 16 bytes hold their first 16 codes in the low nibbles and the last 16 in the high
    ones, without an index). See [Note: 4-bit variance].
    """

    __slots__ = ("count", "lengths", "numel", "slots")

    def __init__(self, shapes: Sequence[torch.Size], packed: bool = False) -> None:
        self.numel = sum(math.prod(shape) for shape in shapes)
        rows = [(shape[0], math.prod(shape[1:])) for shape in shapes]
        self.lengths = self.slots = None
        self.count = self.numel // GROUP_SIZE
        if all(length % GROUP_SIZE == 0 for _, length in rows):
            return
        # Every group is 32 long but the last of each row with a remainder: computed per row,
        # with a handful of ops whatever the number of parameters.
        counts = torch.tensor([count for count, _ in rows])
        row_lengths = torch.tensor([length for _, length in rows]).repeat_interleave(counts)
        row_groups = -(-row_lengths // GROUP_SIZE)
        row_rest = row_lengths % GROUP_SIZE
        lengths = torch.full((int(row_groups.sum()),), GROUP_SIZE, dtype=torch.int32)
        short = row_rest > 0
        lengths[(row_groups.cumsum(0) - 1)[short]] = row_rest[short].to(torch.int32)
        self.lengths = lengths
        self.count = self.lengths.numel()
        if packed:
            self.slots = self._slots(lengths.long())

    def _slots(self, lengths: torch.Tensor) -> torch.Tensor:
        """Each element's nibble: in a group of ``n``, byte ``k`` holds elements ``k`` (low)
        and ``k + ceil(n / 2)`` (high)."""
        half = (lengths + 1) // 2
        group = torch.arange(self.count).repeat_interleave(lengths, output_size=self.numel)
        offset = torch.arange(self.numel) - (lengths.cumsum(0) - lengths)[group]
        high = offset >= half[group]
        byte = (half.cumsum(0) - half)[group] + offset - high * half[group]
        return 2 * byte + high

    def to(self, device: torch.device) -> _Groups:
        if self.lengths is not None and self.lengths.device != device:
            self.lengths = self.lengths.to(device)
        if self.slots is not None and self.slots.device != device:
            self.slots = self.slots.to(device)
        return self

    def unpack4(self, packed: torch.Tensor) -> torch.Tensor:
        """The 4-bit codes of every element (uint8, flat) of the packed groups ``packed``."""
        if self.slots is None:
            halves = packed.view(-1, GROUP_SIZE // 2)
            return torch.cat((halves & 0xF, halves >> 4), dim=1).view(-1)
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(-1)[self.slots]

    def pack4(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Write 4-bit ``codes`` (uint8, one per element, flat) into the packed groups ``out``
        (a group of odd length ends in a zero nibble)."""
        if self.slots is None:
            low, high = codes.view(-1, GROUP_SIZE).split(GROUP_SIZE // 2, dim=1)
            pairs = torch.stack((low, high), dim=-1)
        else:
            nibbles = codes.new_zeros(2 * out.numel()).index_copy_(0, self.slots, codes)
            pairs = nibbles.view(-1, 2)
        torch.bitwise_or(
            pairs[..., 0], pairs[..., 1].bitwise_left_shift(4), out=out.view(pairs.shape[:-1])
        )

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (one value per element) shaped for per-group broadcasting."""
        return flat if self.lengths is not None else flat.view(-1, GROUP_SIZE)

    def amax(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Each group's largest value of ``magnitude`` (as :meth:`view` shapes it)."""
        if self.lengths is None:
            return magnitude.amax(dim=1)
        return torch.segment_reduce(magnitude, "max", lengths=self.lengths)

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """``per_group`` (one value per group), broadcastable against :meth:`view`."""
        if self.lengths is None:
            return per_group.view(-1, 1)
        return per_group.repeat_interleave(self.lengths, output_size=self.numel)


def _group_scale(
    magnitude: torch.Tensor, groups: _Groups, out: torch.Tensor, numerator: float
) -> torch.Tensor:
    """Each group's largest ``magnitude`` rounded into the bfloat16 ``out``; returns
    ``numerator`` divided by it (by 1 for an all-zero group), one float32 factor per group,
    broadcastable: codes are computed against the rounded scale."""
    out.copy_(groups.amax(magnitude))
    divisor = out.float()
    divisor.masked_fill_(divisor == 0, 1.0)
    return groups.expand(torch.full_like(divisor, numerator).div_(divisor))


def _encode_momentum(
    m: torch.Tensor, groups: _Groups, code: torch.Tensor, scale: torch.Tensor, compand: bool
) -> None:
    """Write ``m`` (float32, as ``groups.view`` shapes it) into int8 ``code`` and bfloat16
    ``scale`` (flat). See [Note: 8-bit moments]."""
    y = m.mul(_group_scale(m.abs(), groups, scale, 1.0))
    if compand:  # 127 * 2y / (1 + |y|)
        level = y.div(y.abs().add_(1.0)).mul_(2 * _MOMENTUM_LEVELS)
    else:
        level = y.mul_(_MOMENTUM_LEVELS)
    level = level.round_().clamp_(-_MOMENTUM_LEVELS, _MOMENTUM_LEVELS)
    code.copy_(level.view(-1))


def _decode_momentum(
    code: torch.Tensor, scale: torch.Tensor, groups: _Groups, compand: bool
) -> torch.Tensor:
    """float32 momentum (as ``groups.view`` shapes it) of flat int8 ``code`` and ``scale``."""
    value = groups.view(code.float())
    if compand:
        value = value.div_(value.abs().neg_().add_(2 * _MOMENTUM_LEVELS))
    else:
        value = value.mul_(1 / _MOMENTUM_LEVELS)
    return value.mul_(groups.expand(scale.float()))


def _encode_root(
    root: torch.Tensor, groups: _Groups, code: torch.Tensor, scale: torch.Tensor, bits: int
) -> None:
    """Write a non-negative ``root`` into uint8 ``code`` and bfloat16 ``scale``: nearest
    rounding, but at least 1 where ``root`` is positive. 8 bits: linear, one code per byte; 4
    bits: the square root of the ratio to the scale, packed (see [Note: 4-bit variance])."""
    if bits == 8:
        level = root.mul(_group_scale(root, groups, scale, _ROOT_LEVELS))
    else:
        level = _sqrt(root.mul(_group_scale(root, groups, scale, _ROOT4_LEVELS**2)))
    floor_one = level.clamp(max=1.0).ceil_()
    level = level.round_().maximum(floor_one).clamp_(max=2**bits - 1)
    if bits == 8:
        code.copy_(level.view(-1))
    else:
        groups.pack4(level.view(-1).to(torch.uint8), code)


def _decode_root(
    code: torch.Tensor, scale: torch.Tensor, groups: _Groups, bits: int
) -> torch.Tensor:
    """The root (float32, as ``groups.view`` shapes it) of ``code`` and ``scale`` (flat)."""
    if bits == 8:
        level = groups.view(code.float())
        return level.mul_(groups.expand(scale.float().mul_(1 / _ROOT_LEVELS)))
    level = groups.view(groups.unpack4(code).float())
    return level.mul_(level).mul_(groups.expand(scale.float().mul_(1 / _ROOT4_LEVELS**2)))


# ------------------------------------------------------------------------------ the update


class _Hyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    compand: bool
    variance_bits: int

    @classmethod
    def of(cls, group: dict[str, Any]) -> _Hyper:
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


_Factor = float | torch.Tensor
"""A float, or a float32 tensor with one value per element of a batch."""


def _bias_corrections(
    params: Sequence[_Param], counts: list[float], h: _Hyper
) -> tuple[_Factor, _Factor]:
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


def _adamw(
    x: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: _Hyper,
    corrections: tuple[_Factor, _Factor],
) -> torch.Tensor:
    """AdamW on float32 weights ``x``, gradient ``g``, moments ``m``, ``v``, all in place; the
    arithmetic of ``torch.optim.AdamW`` in unfused ops, the bias corrections multiplied by
    (:func:`_bias_corrections`). Returns the square root of the new ``v``. See [Note:
    layout-independent arithmetic]."""
    inverse_sqrt_correction2, step_size = corrections
    m.mul_(h.beta1).add_(g.mul(1 - h.beta1))
    v.mul_(h.beta2).add_(g.mul(g).mul_(1 - h.beta2))
    root = _sqrt(v)
    denom = root.mul(inverse_sqrt_correction2).add_(h.eps)
    x.mul_(1 - h.lr * h.weight_decay)
    x.sub_(m.div(denom).mul_(step_size))
    return root


def _sqrt(value: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of ``value``.

    torch's float32 ``sqrt`` on the CPU is MKL's vectorised one, which is not correctly
    rounded (measured: 4.3746367 for the root of 19.137444, where 4.3746362 is nearest), so the
    C kernel's ``sqrtf`` could not give its bits. The float64 root rounded to float32 is
    correctly rounded: the exact root of a float32 lies at least 2**-51 (relative) from every
    float32 rounding boundary, farther than a float64 root's error.

    Elsewhere the float32 ``sqrt`` is taken directly, where it is correctly rounded: on CUDA
    (``sqrtf`` without fast math, as torch builds it: IEEE round to nearest) and inside the
    compiled update (``kernel="compile"``), which Inductor lowers to correctly rounded
    instructions on both of its backends (torch 2.13: ``std::sqrt`` and ``Vectorized::sqrt``,
    AVX ``sqrtps``, in its C++; ``tl.sqrt_rn`` in its Triton). It gives the float64 route's
    bits without its three passes, which took 30% of the compiled loops' time on the CPU.
    ``tests/test_compact_compiled.py`` checks the bits (on CUDA, marked ``gpu``). Traced by
    Dynamo for a backend other than Inductor (its debugging ``eager`` and ``aot_eager``), the
    CPU's root would be MKL's, a float32 rounding off on some elements."""
    if value.is_cuda or torch.compiler.is_compiling():
        return value.sqrt()
    return value.double().sqrt_().float()


class _Param(NamedTuple):
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


def _flat_float32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new float32 tensor holding ``tensors`` flattened one after the other (one copy,
    converting as it goes)."""
    out = torch.empty(sum(t.numel() for t in tensors), device=tensors[0].device)
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def _update(
    params: Sequence[_Param],
    buffers: dict[str, torch.Tensor],
    groups: _Groups | None,
    h: _Hyper,
    corrections: tuple[_Factor, _Factor],
    update_flat: _FlatUpdate,
) -> torch.Tensor:
    """The new weights of ``params`` (one kind and dtype), flat, and their new state in the flat
    ``buffers``: the weights and gradients gathered into float32 buffers, ``update_flat``
    (:func:`_update_flat`, eager or compiled) on them. Nothing of ``params`` is written."""
    g = _flat_float32([p.grad for p in params])
    x = _flat_float32([p.weight for p in params])
    return update_flat(x, g, buffers, groups, h, corrections)


def _update_flat(
    x: torch.Tensor,
    g: torch.Tensor,
    buffers: dict[str, torch.Tensor],
    groups: _Groups | None,
    h: _Hyper,
    corrections: tuple[_Factor, _Factor],
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
        m = _join24(buffers["exp_avg"], buffers["exp_avg_error"])
        v = _join24(buffers["exp_avg_sq"], buffers["exp_avg_sq_error"])
    else:
        x, g = groups.view(x), groups.view(g)
        m = _decode_momentum(buffers["exp_avg_code"], buffers["exp_avg_scale"], groups, h.compand)
        root = _decode_root(
            buffers["exp_avg_sq_root_code"],
            buffers["exp_avg_sq_root_scale"],
            groups,
            h.variance_bits,
        )
        v = root.mul_(root)
        corrections = tuple(  # type: ignore[assignment]
            c if isinstance(c, float) else groups.view(c) for c in corrections
        )
    root = _adamw(x, g, m, v, h, corrections)
    high = x.view(-1)
    if split:
        high, error = _split24(high)
        buffers["weight_error"].copy_(error)
    if groups is None:
        for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
            moment, error = _split24(value)
            buffers[key].copy_(moment)
            buffers[f"{key}_error"].copy_(error)
    else:
        _encode_momentum(m, groups, buffers["exp_avg_code"], buffers["exp_avg_scale"], h.compand)
        _encode_root(
            root,
            groups,
            buffers["exp_avg_sq_root_code"],
            buffers["exp_avg_sq_root_scale"],
            h.variance_bits,
        )
    return high


_FlatUpdate = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        dict[str, torch.Tensor],
        "_Groups | None",
        _Hyper,
        tuple[_Factor, _Factor],
    ],
    torch.Tensor,
]


# ------------------------------------------------------------------------------ flat state


def _gather_state(params: Sequence[_Param], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each of ``keys``' state of ``params``, flattened into one new tensor (one copy per key,
    a copy even for one parameter: the update writes into it). See [Note: layout-independent
    arithmetic]."""
    buffers = {key: _flatten_dense_tensors([p.state[key] for p in params]) for key in keys}
    if len(params) == 1:  # then each is a view of the parameter's state tensor
        buffers = {key: flat.clone() for key, flat in buffers.items()}
    return buffers


def _scatter_state(params: Sequence[_Param], buffers: dict[str, torch.Tensor]) -> None:
    """Copy the flat ``buffers`` back into each parameter's state tensors (one call per key)."""
    for key, flat in buffers.items():
        values = [p.state[key] for p in params]
        torch._foreach_copy_(values, _unflatten_dense_tensors(flat, values))


# ------------------------------------------------------------------------------ state


def _root_code_shape(weight_shape: torch.Size, bits: int) -> tuple[int, ...]:
    """The shape of ``exp_avg_sq_root_code`` for a local tensor of ``weight_shape``: the
    weight's with 8 bits, rows of packed bytes with 4."""
    if bits == 8:
        return tuple(weight_shape)
    return weight_shape[0], -(-math.prod(weight_shape[1:]) // 2)


def _new_state(
    weight: torch.Tensor, correction: bool, variance_bits: int
) -> dict[str, torch.Tensor]:
    """Zero state for the local tensor ``weight``; ``step`` as torch.optim.AdamW keeps it."""
    state = {"step": torch.tensor(0.0, dtype=torch.float32)}
    if weight.dtype == torch.bfloat16 and correction:
        state["weight_error"] = torch.zeros_like(weight, dtype=torch.int8)
    if weight.dim() >= 2:
        scales = (weight.shape[0], -(-math.prod(weight.shape[1:]) // GROUP_SIZE))
        root_code = _root_code_shape(weight.shape, variance_bits)
        state["exp_avg_code"] = torch.zeros_like(weight, dtype=torch.int8)
        state["exp_avg_scale"] = weight.new_zeros(scales, dtype=torch.bfloat16)
        state["exp_avg_sq_root_code"] = weight.new_zeros(root_code, dtype=torch.uint8)
        state["exp_avg_sq_root_scale"] = weight.new_zeros(scales, dtype=torch.bfloat16)
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(weight, dtype=torch.bfloat16)
            state[f"{key}_error"] = torch.zeros_like(weight, dtype=torch.int8)
    return state


def _codes_of(group: dict[str, Any]) -> tuple[bool, int]:
    """``compand`` and ``variance_bits`` of a param group (a state dict's too, which may
    predate an option: then its default)."""
    options = {**_OPTIONS, **group}
    return options["compand"], options["variance_bits"]


def _is_adamw_entry(entry: dict[str, Any]) -> bool:
    """Whether ``entry`` is torch.optim.AdamW's (float ``exp_avg``/``exp_avg_sq``)."""
    return "exp_avg" in entry and "exp_avg_error" not in entry


def _from_adamw(
    weight: torch.Tensor, entry: dict[str, Any], group: dict[str, Any]
) -> dict[str, Any]:
    """This layout of an AdamW state entry for the local tensor ``weight`` (quantizing), as
    ``group`` (its param group's options) says."""
    compand, bits = _codes_of(group)
    out = _new_state(weight, correction=False, variance_bits=bits)
    out["step"] = entry["step"]
    if "weight_error" in entry:
        out["weight_error"] = entry["weight_error"]
    m, v = entry["exp_avg"].float().reshape(-1), entry["exp_avg_sq"].float().reshape(-1)
    if weight.dim() >= 2:
        groups = _Groups([weight.shape], bits == 4).to(weight.device)
        flat = {k: out[k].view(-1) for k in _ROW_KEYS}
        _encode_momentum(
            groups.view(m), groups, flat["exp_avg_code"], flat["exp_avg_scale"], compand
        )
        root = groups.view(_sqrt(v))
        _encode_root(
            root, groups, flat["exp_avg_sq_root_code"], flat["exp_avg_sq_root_scale"], bits
        )
    else:
        for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
            high, error = _split24(value)
            out[key], out[f"{key}_error"] = high.view(weight.shape), error.view(weight.shape)
    return out


def _to_adamw(
    weight_shape: torch.Size, entry: dict[str, Any], group: dict[str, Any]
) -> dict[str, Any]:
    """torch.optim.AdamW's state entry (float32 moments) of an entry of this layout, for a
    local tensor of ``weight_shape`` (dequantizing), as ``group`` (its param group's options)
    says."""
    compand, bits = _codes_of(group)
    out: dict[str, Any] = {"step": entry["step"]}
    if "exp_avg_code" in entry:
        groups = _Groups([weight_shape], bits == 4).to(entry["exp_avg_code"].device)
        flat = {k: entry[k].reshape(-1) for k in _ROW_KEYS}
        m = _decode_momentum(flat["exp_avg_code"], flat["exp_avg_scale"], groups, compand)
        root = _decode_root(
            flat["exp_avg_sq_root_code"], flat["exp_avg_sq_root_scale"], groups, bits
        )
        out["exp_avg"] = m.reshape(weight_shape)
        out["exp_avg_sq"] = root.mul_(root).reshape(weight_shape)
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            high, error = entry[key].reshape(-1), entry[f"{key}_error"].reshape(-1)
            out[key] = _join24(high, error).view(weight_shape)
    return out


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _on_local(fn: Any, param: torch.Tensor, entry: dict[str, Any], *args: Any) -> dict[str, Any]:
    """``fn(local weight, local entry, *args)``, its tensors placed back like ``param``."""
    local_param = _local(param)
    out = fn(local_param, {k: _local(v) for k, v in entry.items()}, *args)
    return {k: _placed_like(v, param, local_param) for k, v in out.items()}


class _KernelTable(NamedTuple):
    """A batch's arguments to the C kernel: ``_compact_kernel.FIELDS`` int64 per parameter
    (its tensors' addresses, shape and flags) and its gradients' addresses."""

    fields: ctypes.Array
    grads: ctypes.Array

    def run(self, weights: list[torch.Tensor], group: dict[str, Any]) -> None:
        h = _Hyper.of(group)
        _compact_kernel.kernel()(  # type: ignore[misc]
            self.fields,
            self.grads,
            len(self.grads),
            h.lr,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            int(h.compand),
        )
        # Written through pointers: tell autograd the weights changed, as an in-place op does.
        torch.autograd.graph.increment_version(weights)


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")
_PLAIN = {torch.Tensor}


class _KernelPlan:
    """A param group's C-kernel table, reused at the next step while nothing it points to has
    changed.

    [Note: reused kernel tables]
    Reading eight data pointers and checking eight tensors per parameter costs more in Python
    than the kernel spends on a small tensor. A plan keeps one table for the whole group (the
    kernel takes every layout in one call), in the group's order; only the gradients'
    addresses are written at each step. It is reused while the group holds the same
    parameters at the same addresses, their state entries hold the same tensors in the same
    order ([Note: checking state by identity] in ``_state_identity.py``: ``load_state_dict``,
    state created or converted, a tensor replaced, added or removed, an entry dropped: the step
    takes the full path and makes a new plan), and every parameter has a contiguous CPU
    gradient of the dtype its table row says; otherwise nothing is stepped through it. The
    checks are C-level ``map``s over the parameters (a Python loop cost about 3 us per
    parameter). A plan holds the tensors it points to, so none is freed while it is kept (nor
    its address reused), and there is one plan per parameter (``CompactAdamW._remember``).
    """

    __slots__ = ("addresses", "dtypes", "entries", "options", "params", "table", "weights")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        tables: Sequence[tuple[list[int], _KernelTable, list[_Param]]],
        options: tuple[bool, int],
    ) -> None:
        self.params = tuple(params)
        self.options = options
        self.addresses = list(map(_data_ptr, params))
        self.entries = StateEntries(params, state)
        # The batches' rows, back in the group's order.
        width = _compact_kernel.FIELDS
        rows = sorted(
            (
                (index, table.fields[row * width : (row + 1) * width], item)
                for indices, table, batch in tables
                for row, (index, item) in enumerate(zip(indices, batch, strict=True))
            ),
            key=operator.itemgetter(0),
        )
        fields = [field for _, row, _ in rows for field in row]
        self.table = _KernelTable(
            (ctypes.c_int64 * len(fields))(*fields), (ctypes.c_int64 * len(rows))()
        )
        items = [item for _, _, item in rows]
        self.weights = [item.weight for item in items]
        self.dtypes = [item.grad.dtype for item in items]
        if any(item.param is not item.weight for item in items):
            self.params = ()  # DTensors: their local tensors are not the group's tensors

    @staticmethod
    def options_of(group: dict[str, Any]) -> tuple[bool, int]:
        """The group's options a plan's tables were built for, ``weight_correction`` and
        ``variance_bits``: a change sends the step to the full path (which refuses a state of
        another ``variance_bits``)."""
        return group["weight_correction"], group["variance_bits"]

    def step(self, state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> bool:
        """Step the group through this plan; ``False`` (nothing done) if it no longer holds."""
        params = group["params"]
        if not (
            self.options_of(group) == self.options
            and len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and self.entries.match(state)
            and list(map(_data_ptr, params)) == self.addresses
        ):
            return False
        grads = list(map(_grad, params))
        if not (
            set(map(type, grads)) == _PLAIN  # none missing
            and all(map(operator.is_, map(_dtype, grads), self.dtypes))
            and all(map(_is_cpu, grads))
            and all(map(_is_contiguous, grads))
        ):
            return False
        self.table.grads[:] = list(map(_data_ptr, grads))
        self.table.run(self.weights, group)
        return True


@per_parameter_state
@declare_stepping("elementwise")
class CompactAdamW(Optimizer):
    """AdamW with bfloat16 weights, an int8 error of their rounding and 8-bit moments.

    About 5.1 bytes of persistent state per parameter (weights included) instead of 12, on
    CPU (a C kernel, see ``kernel``) and CUDA (eager PyTorch ops). See the module's notes for
    the layout. The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias
    corrections) on the decoded values.

    Works alone on plain tensors and on DTensors sharded along dim 0 (it steps their local
    shards), and as the class ``OptimizerInBackward`` steps on FSDP2's local shards: it is
    declared elementwise, each shard holding whole quantization groups ([Note: groups never
    cross a row]).

    Args:
        params: bfloat16 or float32 parameters (float32 ones are their own master weights and
            get no ``weight_error``), or param-group dicts.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        weight_correction: keep the int8 error of bfloat16 weights (``False``: plain bfloat16
            weights, for ablations). Fixed for a run; state loaded from AdamW (no error yet)
            starts from a zero error.
        compand: compand the momentum before quantizing (``False``: linear 8-bit, for
            ablations). Fixed for a run: the codes are read as they were written.
        variance_bits: 8, or 4 for the second moment in 4-bit codes (4.625 instead of 5.125
            bytes per parameter; see [Note: 4-bit variance]). Fixed for a run (a state of the
            other width is refused at the step).
        kernel: ``"auto"`` steps CPU tensors with the C kernel (built on first use, see
            [Note: the C kernel] in ``_compact_kernel.py``) when it is available and takes
            them, with the eager path otherwise; ``"c"`` requires the C kernel for CPU tensors
            (raises here if it cannot be built); ``"compile"`` steps every batch, on any device,
            with the eager path's update compiled by ``torch.compile`` (optional, see [Note:
            compiling the flat update] in ``_compact_compiled.py``; the first steps compile
            it); ``"eager"`` always takes the eager path. All give the same bits.

    ``state[p]`` holds ``step`` (a float32 CPU scalar, as AdamW's) and the tensors named in the
    module's table, created at ``p``'s first step. ``load_state_dict`` also takes a
    ``torch.optim.AdamW`` state dict (quantizing its moments); :func:`to_adamw_state_dict`
    converts the other way.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        weight_correction: bool = True,
        compand: bool = True,
        variance_bits: int = 8,
        kernel: str = "auto",
    ) -> None:
        if variance_bits not in VARIANCE_BITS:
            raise ValueError(f"variance_bits must be one of {VARIANCE_BITS}, not {variance_bits!r}")
        if kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {_KERNELS}, not {kernel!r}")
        if kernel == "c" and _compact_kernel.kernel() is None:
            raise RuntimeError(
                f"CompactAdamW(kernel='c'): the C kernel is unavailable: "
                f"{_compact_kernel.unavailable_reason()}; use kernel='auto' to fall back to "
                "the eager path"
            )
        self.kernel = kernel
        # Kernel plans by the id of their group's ``params`` list, and that id by parameter id.
        self._plans: dict[int, _KernelPlan] = {}
        self._plan_of: dict[int, int] = {}
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            weight_correction=weight_correction,
            compand=compand,
            variance_bits=variance_bits,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype not in _WEIGHT_DTYPES:
                    raise TypeError(
                        f"CompactAdamW takes bfloat16 or float32 parameters, not {param.dtype} "
                        f"(shape {tuple(param.shape)}); convert the model with .to(torch.bfloat16)"
                    )
                if isinstance(param, DTensor) and any(
                    p.is_shard() and not p.is_shard(0) for p in param.placements
                ):
                    raise ValueError(
                        f"CompactAdamW needs parameters sharded along dim 0 only (FSDP2), not "
                        f"{param.placements} (shape {tuple(param.shape)}): its quantization "
                        "groups lie within rows"
                    )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore state dtypes by key and convert AdamW entries. See [Note: state dtypes
        across load_state_dict]."""
        super().__setstate__(state)
        self.__dict__.setdefault("kernel", "auto")
        self._plans, self._plan_of = {}, {}
        group_of = {}
        for group in self.param_groups:
            for option, default in _OPTIONS.items():
                group.setdefault(option, default)
            for param in group["params"]:
                group_of[param] = group
        for param, entry in list(self.state.items()):
            if not isinstance(param, torch.Tensor) or not entry:
                continue
            for key, dtype in _CODE_DTYPES.items():
                if key in entry and entry[key].dtype != dtype:
                    entry[key] = entry[key].to(dtype)
            if _is_adamw_entry(entry):
                entry = self.state[param] = _on_local(
                    _from_adamw, param, entry, group_of.get(param, _OPTIONS)
                )
            for key in ("exp_avg", "exp_avg_sq"):
                if f"{key}_error" in entry and entry[key].dtype != torch.bfloat16:
                    entry[key] = entry[key].to(torch.bfloat16)

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Step every parameter holding a gradient; state is created at its first step.

        The parameters of a param group are stepped together, one batch per kind (matrices,
        vectors), dtype and device, each in one pass of whole-tensor ops. A group stepped by
        the C kernel at its previous step goes through its reused table, which runs no torch
        op ([Note: reused kernel tables]); the rest under ``no_grad``.
        """
        if closure is not None:
            raise TypeError("CompactAdamW.step takes no closure")
        for group in self.param_groups:
            if self.kernel in _C_KERNELS:
                plan = self._plans.get(id(group["params"]))
                if plan is not None and plan.step(self.state, group):
                    continue
            with torch.no_grad():
                self._step_group(group)

    def _step_group(self, group: dict[str, Any]) -> None:
        """Step ``group`` batch by batch, and keep a plan of its tables if the C kernel took
        every parameter.

        [Note: a group moves whole or not at all]
        A step that raises leaves the group as it was, so that the cause can be fixed and the
        step run again without a parameter stepped twice. The C kernel cannot fail once its
        tables are built, and every batch's table is built (or refused, with ``kernel="c"``)
        before any batch is updated. An eager or compiled update can fail (the first steps
        compile: a missing compiler, an Inductor error), so each such batch is updated into
        new flat tensors first, and written into the weights and state only once every batch
        of the group has been: the group's batches hold their flat copies at the same time,
        where each batch's were freed before the next one's were made. State entries created
        at a parameter's first step are created before, zero: the state of a parameter never
        stepped.
        """
        params = group["params"]
        self._forget(id(params))
        batches: dict[tuple[bool, torch.dtype, torch.device], list[_Param]] = {}
        indices: dict[tuple[bool, torch.dtype, torch.device], list[int]] = {}
        for index, param in enumerate(params):
            grad = param.grad
            if grad is None:
                continue
            item = self._param(param, grad, group)
            weight = item.weight
            kind = (weight.dim() >= 2, weight.dtype, weight.device)
            batches.setdefault(kind, []).append(item)
            indices.setdefault(kind, []).append(index)
        # See [Note: a group moves whole or not at all].
        chosen = {
            kind: self._kernel_table_of(batch, kind, group) for kind, batch in batches.items()
        }
        writes = [
            self._step_batch(batch, kind[0], group)
            for kind, batch in batches.items()
            if chosen[kind] is None
        ]
        for write in writes:
            write()
        tables = []
        for kind, batch in batches.items():
            table = chosen[kind]
            if table is not None:
                table.run([p.weight for p in batch], group)
                tables.append((indices[kind], table, batch))
        if len(tables) == len(batches) and sum(map(len, indices.values())) == len(params):
            plan = _KernelPlan(params, self.state, tables, _KernelPlan.options_of(group))
            if plan.params:
                self._remember(id(params), plan)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "kernel": self.kernel}

    def _remember(self, key: int, plan: _KernelPlan) -> None:
        """Keep ``plan`` for the group whose ``params`` list has id ``key``, dropping any other
        plan of one of its parameters (one per parameter, so plans of parameter sets no longer
        stepped do not keep their tensors alive)."""
        for other_key in {self._plan_of.get(id(param)) for param in plan.params} - {None}:
            self._forget(other_key)
        for param in plan.params:
            self._plan_of[id(param)] = key
        self._plans[key] = plan

    def _forget(self, key: int) -> None:
        """Drop the plan kept under ``key``, if any."""
        plan = self._plans.pop(key, None)
        if plan is not None:
            for param in plan.params:
                self._plan_of.pop(id(param), None)

    def _kernel_table_of(
        self,
        params: list[_Param],
        kind: tuple[bool, torch.dtype, torch.device],
        group: dict[str, Any],
    ) -> _KernelTable | None:
        """The C kernel's table of a batch, or ``None`` where the eager path steps it (the
        eager kernel chosen, another device, or a layout the kernel does not take: then
        ``kernel="c"`` raises). See [Note: the C kernel] in ``_compact_kernel.py``."""
        grouped, _, device = kind
        if self.kernel not in _C_KERNELS or device.type != "cpu":
            return None
        keys = _batch_keys(grouped, group, params[0].weight)
        table = (
            _kernel_table(params, keys, grouped, group["variance_bits"])
            if _compact_kernel.kernel()
            else None
        )
        if table is None and self.kernel == "c":
            raise RuntimeError(
                "CompactAdamW(kernel='c') cannot step these tensors with the C kernel "
                f"({_compact_kernel.unavailable_reason() or _KERNEL_LAYOUT}); use "
                "kernel='auto' to fall back to the eager path"
            )
        return table

    def _param(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> _Param:
        """``param`` with its local tensors and state, the state created if missing; raises
        if its state was written with another ``variance_bits`` than its group's."""
        local = _local(param)
        entry = self.state.get(param)
        correction, bits = group["weight_correction"], group["variance_bits"]
        if not entry or "step" not in entry:  # no state yet, or only a loaded weight error
            new = _new_state(local, correction, bits)
            new = {k: _placed_like(v, param, local) for k, v in new.items()}
            entry = self.state[param] = {**new, **(entry or {})}
        elif correction and param.dtype == torch.bfloat16 and "weight_error" not in entry:
            error = _placed_like(torch.zeros_like(local, dtype=torch.int8), param, local)
            entry = self.state[param] = {**entry, "weight_error": error}
        code = entry.get("exp_avg_sq_root_code")
        if code is not None and tuple(_local(code).shape) != _root_code_shape(local.shape, bits):
            raise ValueError(
                f"CompactAdamW: the state of a parameter of shape {tuple(param.shape)} holds "
                f"a second-moment code of shape {tuple(code.shape)}, written with another "
                f"variance_bits than its group's ({bits}); variance_bits is fixed for a run "
                "(convert with to_adamw_state_dict and load that to change it)"
            )
        if type(param) is DTensor:
            if grad.placements != param.placements:
                grad = grad.redistribute(param.device_mesh, param.placements)
            return _Param(
                param, local, grad._local_tensor, {k: _local(v) for k, v in entry.items()}
            )
        return _Param(param, local, grad, dict(entry))

    def _step_batch(
        self, params: list[_Param], grouped: bool, group: dict[str, Any]
    ) -> Callable[[], None]:
        """Update a batch into new tensors; returns what writes them into its weights and
        state. See [Note: a group moves whole or not at all]."""
        keys = _batch_keys(grouped, group, params[0].weight)
        buffers = _gather_state(params, ("step", *keys))
        h = _Hyper.of(group)
        shapes = [p.weight.shape for p in params]
        groups = _Groups(shapes, group["variance_bits"] == 4) if grouped else None
        if groups is not None:
            groups.to(params[0].weight.device)
        buffers["step"] += 1
        corrections = _bias_corrections(params, _step_counts(buffers["step"]), h)
        update_flat = _update_flat
        if self.kernel == "compile":
            update_flat = _compact_compiled.compiled(_update_flat)
        high = _update(params, buffers, groups, h, corrections, update_flat)

        def write() -> None:
            weights = [p.weight for p in params]
            torch._foreach_copy_(weights, _unflatten_dense_tensors(high, weights))
            _scatter_state(params, buffers)

        return write


def _batch_keys(grouped: bool, group: dict[str, Any], weight: torch.Tensor) -> tuple[str, ...]:
    """The state keys a batch's update reads and writes (``step`` aside): its moments', and
    ``weight_error`` where its bfloat16 weights keep one."""
    keys = _ROW_KEYS if grouped else _FLAT_KEYS
    if group["weight_correction"] and weight.dtype == torch.bfloat16:
        keys = ("weight_error", *keys)
    return keys


def _step_counts(steps: torch.Tensor) -> list[float]:
    """Host values of the step counts (CPU scalars, read without a device sync).

    Under ``FakeTensorMode`` (the memory estimator) there are no values to read; memory does
    not depend on them, so every count is taken as 1."""
    if not holds_values(steps):
        return [1.0] * steps.numel()
    return steps.tolist()


_OPTIONS = {"weight_correction": True, "compand": True, "variance_bits": 8}
"""CompactAdamW's param-group options that torch.optim.AdamW does not have, with defaults."""

_KERNELS = ("auto", "c", "compile", "eager")
_C_KERNELS = ("auto", "c")
_KERNEL_LAYOUT = (
    "it takes contiguous CPU tensors, bfloat16 or float32 gradients and float32 CPU step counters"
)


def _kernel_table(
    params: Sequence[_Param], keys: Sequence[str], grouped: bool, variance_bits: int
) -> _KernelTable | None:
    """The C kernel's table of ``params``, or ``None`` if it cannot take one of them."""
    correction = "weight_error" in keys
    fields: list[int] = []
    for p in params:
        weight, grad, step = p.weight, p.grad, p.state["step"]
        state = [p.state[k] for k in keys]
        if not (
            grad.dtype in _WEIGHT_DTYPES
            and step.dtype == torch.float32
            and step.device.type == "cpu"
            and holds_values(weight)
            and _compact_kernel.takes([weight, grad, *state])
        ):
            return None
        flags = _compact_kernel.FLAG_GROUPED if grouped else 0
        if grouped and variance_bits == 4:
            flags |= _compact_kernel.FLAG_ROOT4
        if weight.dtype == torch.bfloat16:
            flags |= _compact_kernel.FLAG_WEIGHT_BF16
        if grad.dtype == torch.bfloat16:
            flags |= _compact_kernel.FLAG_GRAD_BF16
        rows = len(weight) if grouped else 1
        length = weight.numel() // max(rows, 1) if grouped else weight.numel()
        pointers = [t.data_ptr() for t in state]
        if not correction:
            pointers.insert(0, 0)
        fields += [weight.data_ptr(), *pointers, step.data_ptr(), rows, length, flags]
    grads = [p.grad.data_ptr() for p in params]
    return _KernelTable(
        (ctypes.c_int64 * len(fields))(*fields), (ctypes.c_int64 * len(grads))(*grads)
    )


def master_weight(param: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """The float32 weights of ``param`` (bfloat16 weight plus its ``weight_error``); a DTensor
    placed like ``param`` for a DTensor."""
    if "weight_error" not in entry:
        return param.detach().float()
    local = _local(param).detach()
    value = _join24(local.reshape(-1), _local(entry["weight_error"]).reshape(-1))
    return _placed_like(value.view(local.shape), param, local)


@torch.no_grad()
def load_master_weight(optimizer: Optimizer, param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param`` from the float32 weights ``value`` (a float32 run's, e.g. next to a
    ``torch.optim.AdamW`` state dict loaded with ``load_state_dict``), keeping 16 significant
    bits: the bfloat16 weight and its ``weight_error`` in ``optimizer.state[param]``, the
    inverse of :func:`master_weight` to within 1/512 of a bfloat16 ULP. A plain copy for a
    float32 ``param``.

    ``optimizer``: ``CompactAdamW``, or ``OptimizerInBackward`` wrapping it; ``value``: the
    shape of ``param``, placed like it if a DTensor. Call it before the step that should start
    from these weights, outside backward.
    """
    if param.dtype != torch.bfloat16:
        param.copy_(value)
        return
    local = _local(param)
    high, error = _split24(_local(value).to(torch.float32).reshape(-1).contiguous())
    local.copy_(high.view(local.shape))
    entry = optimizer.state[param]
    if "weight_error" in entry:
        _local(entry["weight_error"]).copy_(error.view(local.shape))
    else:
        entry["weight_error"] = _placed_like(error.view(local.shape), param, local)


def to_adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim.AdamW`` state dict (float32 moments) of a ``CompactAdamW`` one.

    ``state_dict``: ``optimizer.state_dict()`` of ``CompactAdamW`` or of
    ``OptimizerInBackward`` wrapping it; DTensor values are converted shard by shard (a row's
    groups are on one rank). Decoding error: the momentum to within half a code step of its
    group's scale (the largest magnitude of its 32 elements; a step is 1/127 of it linear,
    finer near zero when companded), the variance's root to within half of 1/255 of its
    group's largest root (with ``variance_bits=4``, to within half a step of its 16 levels,
    see [Note: 4-bit variance]), scales rounded to bfloat16; the 24-bit moments of one-dim
    parameters to about 2**-16 relative. The weights are not part of an optimizer state
    dict: read them with :func:`master_weight`.
    """
    groups = state_dict["param_groups"]
    group_of = {pid: g for g in groups for pid in g["params"]}
    state = {}
    for pid, entry in state_dict["state"].items():
        if "exp_avg_code" not in entry and "exp_avg_error" not in entry:
            state[pid] = dict(entry)
            continue
        like = entry["exp_avg_code"] if "exp_avg_code" in entry else entry["exp_avg"]
        local = {k: _local(v) for k, v in entry.items()}
        out = _to_adamw(_local(like).shape, local, group_of.get(pid, {}))
        state[pid] = {k: _placed_like(v, like, _local(like)) for k, v in out.items()}
    adamw_keys = dict(amsgrad=False, maximize=False, foreach=None, capturable=False)
    adamw_keys.update(differentiable=False, fused=None, decoupled_weight_decay=True)
    param_groups = [
        {
            **{k: v for k, v in g.items() if k not in _OPTIONS},
            **adamw_keys,
        }
        for g in groups
    ]
    return {"state": state, "param_groups": param_groups}
