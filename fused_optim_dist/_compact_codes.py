"""CompactAdamW's encodings: 24-bit values in a bfloat16 and an int8 error, and 8-bit (or 4-bit)
codes of 32-element groups with bfloat16 scales. See ``compact_adamw.py`` for the state they
make up.

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
step decodes ``x``, updates it in float32 and splits it again. A NaN is not rounded: the
carry would run from a NaN whose payload fills its low bits (``0x7FFFFFFF``, the NaN CUDA's
arithmetic makes) through the exponent into the sign, a ``-0.0``, so the weight (or moment)
would silently start again from zero where AdamW's stays NaN (found on a GPU; on the CPU too
for such a NaN in a gradient). Its weight is its upper 16 bits with the quiet bit set (a
NaN whatever its payload) and its error 0. A split never pairs a zero
(either sign) with a negative error, which decoded would cross zero into a NaN; such a pair
is a value written since the split (a pruned weight zeroed in place, a moment reset), and is
decoded as the zero it holds: the error is stale. Without the error
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
rounded scale). A scale below ``2**-120`` is stored as 0, and its group decodes to zero: the
factor the codes are computed with, up to 255 over the scale, would overflow for a smaller
one (an infinity, whose codes the C kernel and eager ops would write differently), and such a
momentum or root is far below anything an update can show.

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

[Note: non-finite values]
Where an update meets a non-finite value (a NaN or infinite gradient without
``skip_nonfinite``, a gradient whose square overflows float32), the weights and moments it
reaches turn NaN or infinite, the same values on the C kernel and the eager path, and their
codes and scales the same bits: a float32 NaN is converted to bfloat16 as 0xFFFF (torch's
vectorised conversion writes it so, which eager's tensors take; the C kernel's
``float_to_bf16`` too, where c10's scalar conversion writes 0x7FC0), and a momentum level
that is NaN (its group's scale is NaN or infinite) is coded 0 (eager's float-to-integer
conversion writes it so; the C kernel recodes such a group, where its clamp put the level
beyond a bound: 127 or -127, decoded as an infinity where eager's 0 decodes as a NaN). Not
the same are the bits of a NaN weight (float32, or a bfloat16 and its error): which NaN an
op returns depends on the order of its operands and on whether it propagates one or makes
one (``0 * inf``), which the C compiler and torch's kernels choose apart (the kernel's
0xFFC00000 where eager has 0xFFFF0000, for the same elements). Writing one NaN everywhere
made the kernel 15-20% slower (measured), for weights that no longer train. The compiled
path's NaN scales are 0x7FC0 (measured on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import torch

GROUP_SIZE = 32
"""Elements per quantization group (within one row)."""

MOMENTUM_LEVELS = 127  # int8 codes -127..127
ROOT_LEVELS = 255  # uint8 codes 0..255
ROOT4_LEVELS = 15  # 4-bit codes 0..15, two to a byte
VARIANCE_BITS = (8, 4)
"""Bits of a second moment's code (``variance_bits``). See [Note: 4-bit variance]."""
SMALLEST_SCALE = 2.0**-120
"""A group whose bfloat16 scale is below this is stored as zero. See [Note: 8-bit moments]."""
HALF_BF16_BIT = 0x8000  # float32 bits: half of the lowest bit a bfloat16 keeps
HALF_ERROR_BIT = 0x80  # half of the lowest bit the error keeps (bit 8 of the float32)
ERROR_BITS = ~0xFF  # the float32 bits the pair keeps: all but the lowest 8
QUIET_BIT = 0x40  # a bfloat16 NaN's quiet bit: set, the upper half of any NaN is a NaN


Length = TypeVar("Length", int, torch.Tensor)


def row_groups(length: Length) -> Length:
    """Quantization groups in a row of ``length`` elements (the last one short unless 32
    divides it): the row's scales. ``length`` may be a tensor of row lengths."""
    return -(-length // GROUP_SIZE)


def packed_row_bytes(length: int) -> int:
    """Bytes of a row of ``length`` 4-bit codes, two to a byte. See [Note: 4-bit variance]."""
    return -(-length // 2)


def join24(high: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """float32 of a bfloat16 ``high`` and its int8 ``error``. See [Note: 24-bit weights]."""
    bits = high.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(error_bits(bits, error)).view(torch.float32)


def error_bits(bits: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """What ``error`` adds to the float32 bits ``bits`` of its bfloat16 value: ``error << 8``,
    but nothing below a zero. See [Note: 24-bit weights]."""
    shifted = error.to(torch.int32).bitwise_left_shift_(8)
    crossing = (bits.bitwise_and(0x7FFFFFFF) == 0) & (shifted < 0)
    return shifted.masked_fill_(crossing, 0)


def split24(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32) rounded to bfloat16, and the int8 error of that rounding. See
    [Note: 24-bit weights]."""
    bits = value.view(torch.int32)
    rounded = bits.add(HALF_ERROR_BIT).bitwise_and_(ERROR_BITS)
    high = rounded.add(HALF_BF16_BIT).bitwise_right_shift_(16)
    error = rounded.sub_(high.bitwise_left_shift(16)).bitwise_right_shift_(8)  # -128..127
    nan = value.isnan()
    high = torch.where(nan, bits.bitwise_right_shift(16).bitwise_or_(QUIET_BIT), high)
    return high.to(torch.int16).view(torch.bfloat16), error.masked_fill_(nan, 0).to(torch.int8)


class Groups:
    """The quantization groups of a flat batch: 32 consecutive elements of a row, the last
    group of a row shorter where the row length is not a multiple of 32. See [Note: groups
    never cross a row] in ``compact_adamw.py``.

    ``packed``: whether the root codes are 4-bit, two to a byte. ``lengths``: each group's
    length (int32), or ``None`` when every row is a multiple of 32
    elements long (the groups are then ``flat.view(-1, 32)``, without an index). ``slots``,
    for 4-bit codes packed by group (``packed``): where each element's code lies among the
    nibbles (two per byte, low first), or ``None`` where every group is whole (then the
    groups' 16 bytes hold their first 16 codes in the low nibbles and the last 16 in the high
    ones, without an index). See [Note: 4-bit variance].
    """

    __slots__ = ("count", "lengths", "numel", "packed", "slots")

    def __init__(self, shapes: Sequence[torch.Size], packed: bool = False) -> None:
        self.numel = sum(math.prod(shape) for shape in shapes)
        self.packed = packed
        rows = [(shape[0], math.prod(shape[1:])) for shape in shapes]
        self.lengths = self.slots = None
        self.count = self.numel // GROUP_SIZE
        if all(length % GROUP_SIZE == 0 for _, length in rows):
            return
        # Every group is 32 long but the last of each row with a remainder: computed per row,
        # with a handful of ops whatever the number of parameters.
        counts = torch.tensor([count for count, _ in rows])
        row_lengths = torch.tensor([length for _, length in rows]).repeat_interleave(counts)
        groups_of_row = row_groups(row_lengths)
        row_rest = row_lengths % GROUP_SIZE
        lengths = torch.full((int(groups_of_row.sum()),), GROUP_SIZE, dtype=torch.int32)
        short = row_rest > 0
        lengths[(groups_of_row.cumsum(0) - 1)[short]] = row_rest[short].to(torch.int32)
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

    def to(self, device: torch.device) -> Groups:
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

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (one value per element, or a 4-bit code packed) in rows of one group where
        every group is whole; else ``flat``.

        [Note: rows of one group]
        The flat update's inputs are shaped so before it is called, not inside it, for its
        compiled graph (``_compact_compiled.py``): compiled with dynamic sizes, a flat input of
        ``n`` elements viewed as ``(-1, 32)`` inside the graph has ``n // 32`` rows, and
        Inductor cannot tell that ``32 * (n // 32)`` is ``n``; its loops then index the flat
        buffers through ``x % (32 * (n // 32))``, a 64-bit division per vector. Given the rows,
        the sizes are ``32 * rows`` and the loops index them directly. The arithmetic is the
        same, element for element."""
        if self.lengths is not None:
            return flat
        return flat.view(-1, GROUP_SIZE if flat.numel() == self.numel else GROUP_SIZE // 2)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (one value per element) shaped for per-group broadcasting."""
        return flat if self.lengths is not None else flat.view(-1, GROUP_SIZE)

    def amax(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Each group's largest value of ``magnitude`` (as :meth:`view` shapes it)."""
        if self.lengths is None:
            return magnitude.amax(dim=1)
        if self.count == 0:  # only empty local shards (FSDP2 on more ranks than rows)
            return magnitude.new_empty(0)
        return torch.segment_reduce(magnitude, "max", lengths=self.lengths)

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """``per_group`` (one value per group), broadcastable against :meth:`view`."""
        if self.lengths is None:
            return per_group.view(-1, 1)
        return per_group.repeat_interleave(self.lengths, output_size=self.numel)


def sqrt_rn(value: torch.Tensor) -> torch.Tensor:
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


def group_scale(
    magnitude: torch.Tensor, groups: Groups, out: torch.Tensor, numerator: float
) -> torch.Tensor:
    """Each group's largest ``magnitude`` rounded into the bfloat16 ``out`` (0 below
    ``SMALLEST_SCALE``); returns ``numerator`` divided by it (by 1 for a zero scale), one
    float32 factor per group, broadcastable: codes are computed against the rounded scale."""
    out.copy_(groups.amax(magnitude))
    tiny = out < SMALLEST_SCALE  # 0 too; a NaN is kept
    out.masked_fill_(tiny, 0.0)
    divisor = out.float().masked_fill_(tiny, 1.0)
    return groups.expand(torch.full_like(divisor, numerator).div_(divisor))


def encode_momentum(
    m: torch.Tensor, groups: Groups, code: torch.Tensor, scale: torch.Tensor, compand: bool
) -> None:
    """Write ``m`` (float32, as ``groups.view`` shapes it) into int8 ``code`` and bfloat16
    ``scale`` (flat). See [Note: 8-bit moments]."""
    y = m.mul(group_scale(m.abs(), groups, scale, 1.0))
    if compand:  # 127 * 2y / (1 + |y|)
        level = y.div(y.abs().add_(1.0)).mul_(2 * MOMENTUM_LEVELS)
    else:
        level = y.mul_(MOMENTUM_LEVELS)
    level = level.round_().clamp_(-MOMENTUM_LEVELS, MOMENTUM_LEVELS)
    code.copy_(level.view_as(code))


def decode_momentum(
    code: torch.Tensor, scale: torch.Tensor, groups: Groups, compand: bool
) -> torch.Tensor:
    """float32 momentum (as ``groups.view`` shapes it) of flat int8 ``code`` and ``scale``."""
    value = groups.view(code.float())
    if compand:
        value = value.div_(value.abs().neg_().add_(2 * MOMENTUM_LEVELS))
    else:
        value = value.mul_(1 / MOMENTUM_LEVELS)
    return value.mul_(groups.expand(scale.float()))


def encode_root(
    root: torch.Tensor, groups: Groups, code: torch.Tensor, scale: torch.Tensor, bits: int
) -> None:
    """Write a non-negative ``root`` into uint8 ``code`` and bfloat16 ``scale``: nearest
    rounding, but at least 1 where ``root`` is positive. 8 bits: linear, one code per byte; 4
    bits: the square root of the ratio to the scale, packed (see [Note: 4-bit variance])."""
    if bits == 8:
        level = root.mul(group_scale(root, groups, scale, ROOT_LEVELS))
    else:
        level = sqrt_rn(root.mul(group_scale(root, groups, scale, ROOT4_LEVELS**2)))
    floor_one = level.clamp(max=1.0).ceil_()
    level = level.round_().maximum(floor_one).clamp_(max=2**bits - 1)
    if bits == 8:
        code.copy_(level.view_as(code))
    else:
        groups.pack4(level.view(-1).to(torch.uint8), code)


def decode_root(code: torch.Tensor, scale: torch.Tensor, groups: Groups, bits: int) -> torch.Tensor:
    """The root (float32, as ``groups.view`` shapes it) of ``code`` and ``scale`` (flat)."""
    if bits == 8:
        level = groups.view(code.float())
        return level.mul_(groups.expand(scale.float().mul_(1 / ROOT_LEVELS)))
    level = groups.view(groups.unpack4(code).float())
    return level.mul_(level).mul_(groups.expand(scale.float().mul_(1 / ROOT4_LEVELS**2)))
