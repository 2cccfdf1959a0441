"""CompactAdamW's update as one Triton kernel per batch on CUDA (``kernel="triton"``, and
``"auto"`` where Triton is installed).

[Note: the Triton kernel]
The C kernel's one pass ([Note: the C kernel] in ``_compact_kernel.py``) on the GPU: each
program decodes, updates and encodes a tile of quantization groups (or of elements, for
parameters of at most one dim) while they are in registers, and writes its groups' scales. A
batch's parameters go in one launch: a table of their addresses, shapes and bias corrections
is copied to the device (pinned, asynchronously: no host sync) and each program finds its
parameter in the table's running count of tiles by bisection. A step moves about 12 bytes
per element of a bfloat16 matrix (weight 2+2, error 1+1, gradient 2, codes 2+2, scales
1/8), against 28 for fused fp32 AdamW with bfloat16 gradients. A batch whose rows are whole
groups and whose tensors are all 16-byte aligned (checked at each step: the gradients are new
tensors, or views into FSDP2's reduce-scatter output) takes the kernels' ALIGNED form, whose
tiles are contiguous and move in 16-byte vectors; the general form moves each byte and
half-word alone (measured on an H200: a 1B model's shards in 7.1 ms against 10.1).

Its arithmetic is the C kernel's, op for op, so the bits are eager's: correctly rounded
float32 ``+ - * / sqrt`` (``tl.div_rn``, ``tl.sqrt_rn``: Triton's ``/`` is an approximate
division), no contraction into FMAs (``enable_fp_fusion=False``), and the rest in integer
arithmetic on the bit patterns: bfloat16 values are loaded and stored as their 16 bits,
rounded to nearest even by integer ops, as the C kernel's ``float_to_bf16``. Floating
constants that are not small integers (the hyperparameters, ``1/127``, the bias corrections)
are handed in the table as float32 bit patterns rounded to nearest on the host, as torch
rounds eager's scalars, so no constant is rounded by another compiler. Integer rounding of a
level adds and subtracts ``1.5 * 2**23`` (nearest even, exact below ``2**22`` in magnitude;
larger levels are clamped anyway). A NaN is split unrounded ([Note: 24-bit weights] in
``_compact_codes.py``).

``TRITON_INTERPRET=1`` (Triton's interpreter, numpy on the CPU) runs the same kernel on CPU
tensors: ``tests/test_compact_triton.py`` checks its bits against eager's there (in a process
of its own: Triton decides whether a kernel is interpreted when it is defined), and on CUDA
(marked ``gpu``).
"""

from __future__ import annotations

import functools
import os
from array import array
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from fused_optim_dist._compact_update import Hyper, Param, correction_factors

__all__ = ["TritonTable", "interpreting", "takes"]

HEADER = tl.constexpr(9)
"""float32 constants before the parameters' rows, as int64 (see ``_constants``)."""
FIELDS = tl.constexpr(11)
"""int64 fields per parameter: its tensors' addresses (weight, weight error or 0, the four
moment tensors, gradient), rows, row length, and its two bias corrections' float32 bits."""
TILE_GROUPS = 32
"""Quantization groups per program (1024 elements where rows are multiples of 32)."""
TILE_ELEMENTS = 1024
"""Elements per program for parameters of at most one dim."""
_GRAD_DTYPES = (torch.bfloat16, torch.float32)


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Read when the kernels below are defined, as Triton reads it for them."""


def interpreting() -> bool:
    """Whether Triton runs these kernels in its interpreter (``TRITON_INTERPRET=1``), on the
    CPU."""
    return _INTERPRETED


def takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel reads and writes ``tensors`` as they are: contiguous, on CUDA (on
    the CPU under Triton's interpreter)."""
    device = "cpu" if interpreting() else "cuda"
    return all(t.device.type == device and t.is_contiguous() for t in tensors)


# ------------------------------------------------------------------------------ device code


@triton.jit
def _param_of(starts_ptr, count, pid):
    """The parameter whose tiles hold program ``pid``: the last ``i`` with ``starts[i] <=
    pid`` (a parameter with no tile, an empty local shard, shares its start with the next)."""
    low = 0
    high = count
    while high - low > 1:
        mid = (low + high) // 2
        below = tl.load(starts_ptr + mid) <= pid
        low = tl.where(below, mid, low)
        high = tl.where(below, high, mid)
    return low


@triton.jit
def _f32(table_ptr, index):
    """The float32 whose bits are the int64 at ``index``."""
    return tl.load(table_ptr + index).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(value):
    """Nearest even, a NaN as 0xFFFF (the C kernel's ``float_to_bf16``)."""
    u = value.to(tl.uint32, bitcast=True)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
    return tl.where(value != value, 0xFFFF, rounded).to(tl.uint16)


@triton.jit
def _join24(high, error):
    """[Note: 24-bit weights]: a zero with a negative error is zero."""
    kept = tl.where(((high.to(tl.uint32) & 0x7FFF) == 0) & (error < 0), 0, error.to(tl.int32))
    bits = (high.to(tl.uint32) << 16) + (kept << 8).to(tl.uint32, bitcast=True)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split24(value):
    """A NaN unrounded, its upper half quiet, no error (see [Note: 24-bit weights])."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x80) & 0xFFFFFF00
    high = (rounded + 0x8000) >> 16
    error = (rounded - (high << 16)).to(tl.int32, bitcast=True) >> 8
    nan = value != value
    high = tl.where(nan, (bits >> 16) | 0x40, high)
    return high.to(tl.uint16), tl.where(nan, 0, error).to(tl.int8)


@triton.jit
def _rint(value):
    """Nearest even integer below 2**22 in magnitude (larger values are clamped after)."""
    shifted = (value + 12582912.0) - 12582912.0
    return tl.where(tl.abs(value) < 4194304.0, shifted, value)


@triton.jit
def _larger(a, b):
    return tl.where(a > b, a, b)


@triton.jit
def _pointer(row, field, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in ``row[field]`` as a pointer to ``dtype``, 16-byte aligned if ALIGNED
    (what lets Triton move 16 bytes per load and store)."""
    pointer = tl.load(row + field).to(tl.pointer_type(dtype))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _weights(
    row, index, mask, WEIGHT_BF16: tl.constexpr, ERROR: tl.constexpr, ALIGNED: tl.constexpr
):
    """The weights at ``index`` as float32."""
    if WEIGHT_BF16:
        high = tl.load(_pointer(row, 0, tl.uint16, ALIGNED) + index, mask=mask, other=0)
        if ERROR:
            error = tl.load(_pointer(row, 1, tl.int8, ALIGNED) + index, mask=mask, other=0)
            x = _join24(high, error)
        else:
            x = _bf16_to_f32(high)
    else:
        x = tl.load(_pointer(row, 0, tl.float32, ALIGNED) + index, mask=mask, other=0.0)
    return x


@triton.jit
def _store_weights(
    row, index, mask, x, WEIGHT_BF16: tl.constexpr, ERROR: tl.constexpr, ALIGNED: tl.constexpr
):
    if WEIGHT_BF16:
        if ERROR:
            high, error = _split24(x)
            tl.store(_pointer(row, 1, tl.int8, ALIGNED) + index, error, mask=mask)
        else:
            high = _f32_to_bf16(x)
        tl.store(_pointer(row, 0, tl.uint16, ALIGNED) + index, high, mask=mask)
    else:
        tl.store(_pointer(row, 0, tl.float32, ALIGNED) + index, x, mask=mask)


@triton.jit
def _grads(row, index, mask, GRAD_BF16: tl.constexpr, ALIGNED: tl.constexpr):
    if GRAD_BF16:
        bits = tl.load(_pointer(row, 6, tl.uint16, ALIGNED) + index, mask=mask, other=0)
        return _bf16_to_f32(bits)
    return tl.load(_pointer(row, 6, tl.float32, ALIGNED) + index, mask=mask, other=0.0)


@triton.jit
def _adamw(table_ptr, row, x, g, m, v):
    """AdamW on one element, in eager's order of single ops; returns the new weight, m, v and
    the root of v."""
    beta1 = _f32(table_ptr, 0)
    one_minus_beta1 = _f32(table_ptr, 1)
    beta2 = _f32(table_ptr, 2)
    one_minus_beta2 = _f32(table_ptr, 3)
    eps = _f32(table_ptr, 4)
    decay = _f32(table_ptr, 5)
    ic2 = tl.load(row + 9).to(tl.int32).to(tl.float32, bitcast=True)
    step_size = tl.load(row + 10).to(tl.int32).to(tl.float32, bitcast=True)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    root = tl.sqrt_rn(v)
    denom = root * ic2 + eps
    x = x * decay - tl.div_rn(m, denom) * step_size
    return x, m, v, root


@triton.jit
def _grouped_kernel(
    table_ptr,
    count,
    WEIGHT_BF16: tl.constexpr,
    ERROR: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    COMPAND: tl.constexpr,
    ROOT4: tl.constexpr,
    ALIGNED: tl.constexpr,
    TILE: tl.constexpr,
):
    """Matrices: a tile of TILE groups of one parameter, each a row of 32 lanes. ALIGNED: every
    row a multiple of 32 long (the groups are consecutive 32-element chunks) and every tensor
    16-byte aligned, so the tile is contiguous in each tensor and moves in vectors."""
    pid = tl.program_id(0)
    starts = table_ptr + HEADER + count * FIELDS
    k = _param_of(starts, count, pid)
    row = table_ptr + HEADER + k * FIELDS
    rows = tl.load(row + 7)
    length = tl.load(row + 8)
    per_row = (length + 31) // 32
    group = (pid - tl.load(starts + k)) * TILE + tl.arange(0, TILE).to(tl.int64)
    in_param = group < rows * per_row
    lane = tl.arange(0, 32)[None, :]
    if ALIGNED:
        size = tl.full((TILE,), 32, tl.int64)
        index = (group * 32)[:, None] + lane
        code_start = group * 16
    else:
        r = group // per_row
        within = group - r * per_row
        size = tl.minimum(length - within * 32, 32)
        index = (r * length + within * 32)[:, None] + lane
        code_start = r * ((length + 1) // 2) + within * 16
    mask = in_param[:, None] & (lane < size[:, None])

    m_codes = _pointer(row, 2, tl.int8, ALIGNED)
    m_scales = tl.load(row + 3).to(tl.pointer_type(tl.uint16))
    r_codes = _pointer(row, 4, tl.uint8, ALIGNED)
    r_scales = tl.load(row + 5).to(tl.pointer_type(tl.uint16))
    m_scale = tl.load(m_scales + group, mask=in_param, other=0)
    r_scale = tl.load(r_scales + group, mask=in_param, other=0)

    c = tl.load(m_codes + index, mask=mask, other=0).to(tl.float32)
    m_factor = _bf16_to_f32(m_scale)[:, None]
    if COMPAND:
        m = tl.div_rn(c, -tl.abs(c) + 254.0) * m_factor
    else:
        m = c * _f32(table_ptr, 6) * m_factor
    nibble = tl.arange(0, 16)[None, :]
    half = ((size + 1) // 2)[:, None]
    if ROOT4:
        if ALIGNED:
            # A whole group's 16 bytes: its first 16 codes in the low nibbles, the last 16 in
            # the high ones.
            packed = tl.load(
                r_codes + code_start[:, None] + nibble, mask=in_param[:, None], other=0
            ).to(tl.int32)
            halves = tl.permute(tl.join(packed & 0xF, packed >> 4), (0, 2, 1))
            level = tl.reshape(halves, (TILE, 32)).to(tl.float32)
        else:
            upper = lane >= half
            byte = code_start[:, None] + tl.where(upper, lane - half, lane)
            packed = tl.load(r_codes + byte, mask=mask, other=0).to(tl.int32)
            level = (tl.where(upper, packed >> 4, packed) & 0xF).to(tl.float32)
        old_root = (level * level) * (_bf16_to_f32(r_scale) * _f32(table_ptr, 8))[:, None]
    else:
        level = tl.load(r_codes + index, mask=mask, other=0).to(tl.float32)
        old_root = level * (_bf16_to_f32(r_scale) * _f32(table_ptr, 7))[:, None]
    v = old_root * old_root

    x = _weights(row, index, mask, WEIGHT_BF16, ERROR, ALIGNED)
    g = _grads(row, index, mask, GRAD_BF16, ALIGNED)
    x, m, v, root = _adamw(table_ptr, row, x, g, m, v)
    _store_weights(row, index, mask, x, WEIGHT_BF16, ERROR, ALIGNED)

    # The groups' scales: their largest magnitudes (NaN above everything, as bits), rounded to
    # bfloat16, 0 below 2**-120; the codes are computed against the rounded scales.
    m_most = tl.max(tl.where(mask, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
    r_most = tl.max(tl.where(mask, root.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1)
    m_scale = _f32_to_bf16(m_most.to(tl.float32, bitcast=True))
    r_scale = _f32_to_bf16(r_most.to(tl.float32, bitcast=True))
    m_scale = tl.where(m_scale < 0x0380, 0, m_scale).to(tl.uint16)
    r_scale = tl.where(r_scale < 0x0380, 0, r_scale).to(tl.uint16)
    tl.store(m_scales + group, m_scale, mask=in_param)
    tl.store(r_scales + group, r_scale, mask=in_param)
    m_factor = tl.div_rn(1.0, tl.where(m_scale == 0, 1.0, _bf16_to_f32(m_scale)))[:, None]
    r_levels = 225.0 if ROOT4 else 255.0
    r_factor = tl.div_rn(r_levels, tl.where(r_scale == 0, 1.0, _bf16_to_f32(r_scale)))[:, None]

    y = m * m_factor
    if COMPAND:  # noqa: SIM108 (an if on a constexpr: Triton compiles one branch)
        m_level = _rint(tl.div_rn(y, tl.abs(y) + 1.0) * 254.0)
    else:
        m_level = _rint(y * 127.0)
    m_code = tl.minimum(tl.maximum(m_level, -127.0), 127.0)
    m_code = tl.where(m_level != m_level, 0.0, m_code)  # a NaN level: 0, as eager codes it
    tl.store(m_codes + index, m_code.to(tl.int32).to(tl.int8), mask=mask)

    r_level = root * r_factor
    if ROOT4:
        r_level = tl.sqrt_rn(r_level)
    rounded = _larger(_rint(r_level), tl.where(r_level > 0.0, 1.0, 0.0))
    code = tl.minimum(rounded, 15.0 if ROOT4 else 255.0).to(tl.int32)
    if ROOT4:
        # Byte k of a group: code k (low nibble) and code k + half (high), where k < half.
        if ALIGNED:
            low, high = tl.split(tl.permute(tl.reshape(code, (TILE, 2, 16)), (0, 2, 1)))
        else:
            low = tl.gather(code, nibble + tl.zeros_like(half), 1)
            high = tl.gather(code, tl.minimum(nibble + half, 31), 1)
            high = tl.where(nibble + half < size[:, None], high, 0)
        tl.store(
            r_codes + code_start[:, None] + nibble,
            (low | (high << 4)).to(tl.uint8),
            mask=in_param[:, None] & (nibble < half),
        )
    else:
        tl.store(r_codes + index, code.to(tl.uint8), mask=mask)


@triton.jit
def _flat_kernel(
    table_ptr,
    count,
    WEIGHT_BF16: tl.constexpr,
    ERROR: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    TILE: tl.constexpr,
):
    """Parameters of at most one dim: each moment a 24-bit value (bfloat16 and int8 error).
    ALIGNED: every tensor 16-byte aligned."""
    pid = tl.program_id(0)
    starts = table_ptr + HEADER + count * FIELDS
    k = _param_of(starts, count, pid)
    row = table_ptr + HEADER + k * FIELDS
    numel = tl.load(row + 7) * tl.load(row + 8)
    index = (pid - tl.load(starts + k)) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = index < numel
    m_high = _pointer(row, 2, tl.uint16, ALIGNED)
    m_error = _pointer(row, 3, tl.int8, ALIGNED)
    v_high = _pointer(row, 4, tl.uint16, ALIGNED)
    v_error = _pointer(row, 5, tl.int8, ALIGNED)
    m = _join24(
        tl.load(m_high + index, mask=mask, other=0), tl.load(m_error + index, mask=mask, other=0)
    )
    v = _join24(
        tl.load(v_high + index, mask=mask, other=0), tl.load(v_error + index, mask=mask, other=0)
    )
    x = _weights(row, index, mask, WEIGHT_BF16, ERROR, ALIGNED)
    g = _grads(row, index, mask, GRAD_BF16, ALIGNED)
    x, m, v, _root = _adamw(table_ptr, row, x, g, m, v)
    _store_weights(row, index, mask, x, WEIGHT_BF16, ERROR, ALIGNED)
    high, error = _split24(m)
    tl.store(m_high + index, high, mask=mask)
    tl.store(m_error + index, error, mask=mask)
    high, error = _split24(v)
    tl.store(v_high + index, high, mask=mask)
    tl.store(v_error + index, error, mask=mask)


# ------------------------------------------------------------------------------ host side


def _float32_bits(values: Sequence[float]) -> list[int]:
    """Python floats rounded to float32 (to nearest, as torch rounds eager's scalars), as
    their bits: ``array``'s conversion, without a torch op."""
    return array("i", array("f", values).tobytes()).tolist()


@functools.lru_cache(maxsize=64)
def _constants(h: Hyper) -> tuple[int, ...]:
    """The table's header: see ``_adamw`` and ``_grouped_kernel`` for where each is read."""
    return tuple(
        _float32_bits(
            [
                h.beta1,
                1 - h.beta1,
                h.beta2,
                1 - h.beta2,
                h.eps,
                1 - h.lr * h.weight_decay,
                1 / 127,
                1 / 255,
                1 / 225,
            ]
        )
    )


class TritonTable:
    """A batch stepped by the Triton kernel: its tensors' addresses, kept from the table's
    making to its run. See [Note: the Triton kernel].

    Making the table compiles the kernel for the batch's layout (Triton compiles on first
    use, which can fail: no toolchain, a Triton error), so that a group's step raises before
    any of its batches moves, as the C kernel's tables ([Note: a group moves whole or not at
    all] in ``compact_adamw.py``)."""

    __slots__ = ("alignable", "device", "fields", "grads", "grouped", "layout", "numels", "steps")

    def __init__(
        self, params: Sequence[Param], keys: Sequence[str], grouped: bool, group: dict[str, Any]
    ) -> None:
        first = params[0]
        correction = "weight_error" in keys
        self.grouped = grouped
        self.device = first.weight.device
        self.layout: dict[str, bool] = {
            "WEIGHT_BF16": first.weight.dtype == torch.bfloat16,
            "ERROR": correction,
            "GRAD_BF16": first.grad.dtype == torch.bfloat16,
        }
        if grouped:
            self.layout.update(COMPAND=group["compand"], ROOT4=group["variance_bits"] == 4)
        self.fields: list[list[int]] = []
        self.numels: list[tuple[int, int]] = []
        for p in params:
            weight = p.weight
            rows = len(weight) if grouped else 1
            length = weight.numel() // max(rows, 1) if grouped else weight.numel()
            moments = [p.state[k].data_ptr() for k in keys if k != "weight_error"]
            error = p.state["weight_error"].data_ptr() if correction else 0
            self.fields.append([weight.data_ptr(), error, *moments])
            self.numels.append((rows, length))
        self.grads = [p.grad.data_ptr() for p in params]
        """The gradients' addresses, the one field that changes from step to step (a plan
        writes them before each run)."""
        self.steps = [p.state["step"] for p in params]
        self.alignable = all(length % 32 == 0 for _, length in self.numels) or not grouped
        """Whether the kernel's ALIGNED form may take the batch, as far as its shapes and
        addresses other than the gradients' tell (:meth:`_aligned`)."""
        self.alignable &= all(address % 16 == 0 for fields in self.fields for address in fields)
        if not interpreting():
            # Both forms, where the gradients' addresses decide between them at each step.
            for aligned in {False, self.alignable}:
                self._launch(torch.int64, 1, aligned, warmup=True)

    @staticmethod
    def of(
        params: Sequence[Param], keys: Sequence[str], grouped: bool, group: dict[str, Any]
    ) -> TritonTable | None:
        """The table of ``params``, or ``None`` if the kernel cannot take one of them."""
        dtypes = {p.grad.dtype for p in params}
        if len(dtypes) != 1 or dtypes.pop() not in _GRAD_DTYPES:
            return None
        for p in params:
            step = p.state["step"]
            if not (
                step.dtype == torch.float32
                and step.device.type == "cpu"
                and takes([p.weight, p.grad, *(p.state[k] for k in keys)])
            ):
                return None
        return TritonTable(params, keys, grouped, group)

    @staticmethod
    def takes_grads(grads: Sequence[torch.Tensor]) -> bool:
        """Whether the kernel reads ``grads`` as they are (a plan's check at each step)."""
        return takes(grads)

    def _tiles(self, rows: int, length: int) -> int:
        if self.grouped:
            return -(-rows * -(-length // 32) // TILE_GROUPS)
        return -(-rows * length // TILE_ELEMENTS)

    def _aligned(self) -> bool:
        """Whether the kernel's ALIGNED form takes this step: rows of whole groups, and every
        tensor, this step's gradients included, 16-byte aligned (views into a flat buffer,
        such as FSDP2's gradient shards, need not be)."""
        return self.alignable and all(address % 16 == 0 for address in self.grads)

    def _launch(self, table: Any, programs: int, aligned: bool, warmup: bool = False) -> None:
        """Launch (or, with ``warmup``, compile) the kernel over ``programs`` tiles."""
        kernel = _grouped_kernel if self.grouped else _flat_kernel
        tile = TILE_GROUPS if self.grouped else TILE_ELEMENTS
        options = {} if interpreting() else {"enable_fp_fusion": False}
        args = (table, len(self.fields))
        constants = {"TILE": tile, "ALIGNED": aligned, **self.layout}
        if warmup:
            kernel.warmup(*args, **constants, num_warps=4, grid=(1,), **options)
        else:
            kernel[(programs,)](*args, **constants, num_warps=4, **options)

    def run(self, weights: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Step the batch: one launch, then its step counters (host scalars) counted up."""
        h = Hyper.of(group)
        counts = torch.stack(self.steps).add_(1).tolist()
        bits = _float32_bits([f for t in counts for f in correction_factors(t, h)])
        starts, total = [], 0
        table = list(_constants(h))
        for i, fields in enumerate(self.fields):
            table += [*fields, self.grads[i], *self.numels[i], bits[2 * i], bits[2 * i + 1]]
            starts.append(total)
            total += self._tiles(*self.numels[i])
        if total:
            host = torch.tensor(
                table + starts, dtype=torch.int64, pin_memory=self.device.type == "cuda"
            )
            self._launch(host.to(self.device, non_blocking=True), total, self._aligned())
        torch._foreach_add_(self.steps, 1.0)
        # Written through pointers: tell autograd the weights changed, as an in-place op does.
        torch.autograd.graph.increment_version(weights)
