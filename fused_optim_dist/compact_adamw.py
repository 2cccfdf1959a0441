"""``CompactAdamW``: AdamW in about five bytes per parameter, stepped on local shards.

Persistent state per element of a bfloat16 parameter of two or more dims:

============================  ======  ===================================================
what                          bytes   held as
============================  ======  ===================================================
weight                        2       the parameter itself (bfloat16)
``weight_error``              1       int8: the weight's rounding error in 1/256 bf16 ULP
``exp_avg_code``              1       int8: momentum, companded, per group of 32
``exp_avg_sq_root_code``      1       uint8: square root of the variance, per group of 32
``exp_avg_scale`` and         2 x 2   bfloat16: one scale per group of 32 (0.125 B/param)
``exp_avg_sq_root_scale``     / 32
============================  ======  ===================================================

5.125 bytes per parameter where rows are multiples of 32 elements (a short last group per row
otherwise), against 12 for fp32 AdamW (fp32 weight and two fp32 moments). Parameters of at most
one dim (norm weights, biases) keep each moment as a bfloat16 value plus an int8 error (3 bytes
each): see [Note: groups never cross a row].

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
``weight_error`` keeps the rounding error of the last update, ``x - bf16(x)``, in units of
1/256 of the bf16 value's ULP (ULP of its binade, a power of two read from the exponent bits):
``x = w + weight_error * ulp(w) / 256``, 16 significant bits. Each step decodes ``x``,
updates it in float32 and rounds it again. Without the error (``weight_correction=False``) the
weights are plain bfloat16 and small updates are lost, which the ablation in
``benchmarks/results/compact_adamw.md`` shows.

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

[Note: layout-independent arithmetic]
A step gathers every parameter of a param group into one flat float32 buffer and updates it with
whole-tensor ops, one call each for the whole group: per-parameter ops cost more in dispatch
than in arithmetic for small tensors, and a third of a per-tensor implementation's time went to
dtype conversions of each small tensor. For the results to be the same bit for bit whatever
else is in the buffer (one FSDP unit in backward, every parameter after it, another number of
ranks), only correctly rounded single ops are used (add, mul, div, sqrt, round, casts, maxima):
fused forms (``addcmul``, ``lerp``, ``add`` with ``alpha``) may use an FMA in vectorised loops
and not in their scalar remainders, so an element's result would depend on its offset.

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

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.optim import Optimizer

from fused_optim_dist._kinds import declare_stepping
from fused_optim_dist._stepping import _placed_like

__all__ = ["GROUP_SIZE", "CompactAdamW", "master_weight", "to_adamw_state_dict"]

GROUP_SIZE = 32
"""Elements per quantization group (within one row)."""

_MOMENTUM_LEVELS = 127  # int8 codes -127..127
_ROOT_LEVELS = 255  # uint8 codes 0..255
_ERROR_LEVELS = 127  # int8 weight (or 1-dim moment) errors, -127..127 of 1/256 ULP
_ERROR_UNIT = 2.0**-15  # 1/256 of a bf16 ULP, relative to the power of two of its binade
_EXPONENT_MASK = 0x7F800000  # float32 exponent bits
_SMALLEST_NORMAL_BITS = 0x00800000  # float32 2**-126: the binade of bf16 zero and subnormals

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


def _binade(value: torch.Tensor) -> torch.Tensor:
    """The power of two of each float32 ``value``'s binade (2**-126 for zero and subnormals)."""
    bits = value.view(torch.int32) & _EXPONENT_MASK
    return bits.clamp_(min=_SMALLEST_NORMAL_BITS).view(torch.float32)


def _join24(high: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """float32 ``high + error * ulp(high) / 256`` of a bfloat16 ``high``. See [Note: 24-bit
    weights]."""
    value = high.float()
    return value.add_(error.float().mul_(_ERROR_UNIT).mul_(_binade(value)))


def _split24(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32) as bfloat16 and the int8 error of that rounding, in 1/256 ULP."""
    high = value.to(torch.bfloat16)
    rounded = high.float()
    error = value.sub(rounded).div_(_binade(rounded)).mul_(1 / _ERROR_UNIT)
    return high, error.round_().clamp_(-_ERROR_LEVELS, _ERROR_LEVELS).to(torch.int8)


def _group_scale(magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's largest ``magnitude`` (``(groups, GROUP_SIZE)``) as a bfloat16 scale, and
    the float32 divisor codes are computed against (1 for an all-zero group)."""
    scale = magnitude.amax(dim=1, keepdim=True).to(torch.bfloat16)
    divisor = scale.float()
    return scale, divisor.masked_fill_(divisor == 0, 1.0)


def _encode_momentum(m: torch.Tensor, compand: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and bfloat16 scales of ``m`` (``(groups, GROUP_SIZE)``, float32). See
    [Note: 8-bit moments]."""
    magnitude = m.abs()
    scale, divisor = _group_scale(magnitude)
    if compand:
        # 127 * 2y / (1 + |y|), y = m / scale.
        ratio = m.div(divisor)
        code = ratio.div_(magnitude.div_(divisor).add_(1.0)).mul_(2 * _MOMENTUM_LEVELS)
    else:
        code = m.div(divisor).mul_(_MOMENTUM_LEVELS)
    code = code.round_().clamp_(-_MOMENTUM_LEVELS, _MOMENTUM_LEVELS).to(torch.int8)
    return code, scale


def _decode_momentum(code: torch.Tensor, scale: torch.Tensor, compand: bool) -> torch.Tensor:
    value = code.float()
    if compand:
        value = value.div_(value.abs().neg_().add_(2 * _MOMENTUM_LEVELS))
    else:
        value = value.div_(_MOMENTUM_LEVELS)
    return value.mul_(scale.float())


def _encode_root(root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes and bfloat16 scales of a non-negative ``root`` (``(groups, GROUP_SIZE)``):
    nearest rounding, but at least 1 where ``root`` is positive."""
    scale, divisor = _group_scale(root)
    level = root.div(divisor).mul_(_ROOT_LEVELS)
    floor_one = level.clamp(max=1.0).ceil_()
    code = level.round_().maximum(floor_one).clamp_(max=_ROOT_LEVELS)
    return code.to(torch.uint8), scale


def _decode_root(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return code.float().mul_(scale.float().div_(_ROOT_LEVELS))


# ------------------------------------------------------------------------------ flat batches


class _Rows(NamedTuple):
    """How a tensor of ``rows`` rows of ``length`` elements lies in a flat batch: each row
    padded with zeros to ``padded`` (a multiple of GROUP_SIZE) elements."""

    rows: int
    length: int
    padded: int

    @classmethod
    def of(cls, tensor: torch.Tensor, grouped: bool) -> _Rows:
        numel = tensor.numel()
        if not grouped:
            return cls(1, numel, numel)
        # From the shape, not the element count: an empty shard (0 rows) has whole rows too.
        rows, length = tensor.shape[0], math.prod(tensor.shape[1:])
        return cls(rows, length, -(-length // GROUP_SIZE) * GROUP_SIZE)

    @property
    def groups(self) -> int:
        return self.padded // GROUP_SIZE


def _gather(tensors: Sequence[torch.Tensor], layouts: Sequence[_Rows]) -> torch.Tensor:
    """The flat concatenation of ``tensors``, each row padded as its layout says."""
    pieces = []
    for tensor, layout in zip(tensors, layouts, strict=True):
        piece = tensor.reshape(layout.rows, layout.length)
        if layout.padded != layout.length:
            piece = F.pad(piece, (0, layout.padded - layout.length))
        pieces.append(piece.reshape(-1))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor], layouts: Sequence[_Rows]) -> None:
    """Copy ``flat`` (laid out as :func:`_gather` lays it) into ``tensors``, padding dropped."""
    sizes = [layout.rows * layout.padded for layout in layouts]
    sources = [
        piece.view(layout.rows, layout.padded)[:, : layout.length]
        for piece, layout in zip(flat.split(sizes), layouts, strict=True)
    ]
    targets = [
        t.view(layout.rows, layout.length) for t, layout in zip(tensors, layouts, strict=True)
    ]
    torch._foreach_copy_(targets, sources)


def _gather_scales(scales: Sequence[torch.Tensor]) -> torch.Tensor:
    """Scales ``(rows, groups)`` of each tensor, as a column ``(all groups, 1)``."""
    return torch.cat([s.reshape(-1) for s in scales]).unsqueeze(1)


def _scatter_scales(column: torch.Tensor, scales: Sequence[torch.Tensor]) -> None:
    pieces = column.view(-1).split([s.numel() for s in scales])
    torch._foreach_copy_([s.view(-1) for s in scales], list(pieces))


# ------------------------------------------------------------------------------ the update


class _Hyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


def _adamw(x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: _Hyper) -> None:
    """AdamW on float32 weights ``x``, gradient ``g``, moments ``m``, ``v``, all in place; the
    arithmetic of ``torch.optim.AdamW`` (single-tensor), in unfused ops. See [Note:
    layout-independent arithmetic]."""
    m.mul_(h.beta1).add_(g.mul(1 - h.beta1))
    v.mul_(h.beta2).add_(g.mul(g).mul_(1 - h.beta2))
    bias_correction1 = 1 - h.beta1**h.step
    bias_correction2_sqrt = math.sqrt(1 - h.beta2**h.step)
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(h.eps)
    x.mul_(1 - h.lr * h.weight_decay)
    x.sub_(m.div(denom).mul_(h.lr / bias_correction1))


class _Param(NamedTuple):
    """One parameter's local tensors in a step."""

    weight: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]


def _step_grouped(params: Sequence[_Param], h: _Hyper, correction: bool, compand: bool) -> None:
    """Step parameters of two or more dims (8-bit moments in row groups), all at once."""
    layouts = [_Rows.of(p.weight, grouped=True) for p in params]
    weights = [p.weight for p in params]
    g = _gather([p.grad for p in params], layouts).float()
    x = _weights_in(params, layouts, correction)
    m = _decode_momentum(
        _gather([p.state["exp_avg_code"] for p in params], layouts).view(-1, GROUP_SIZE),
        _gather_scales([p.state["exp_avg_scale"] for p in params]),
        compand,
    ).view(-1)
    root = _decode_root(
        _gather([p.state["exp_avg_sq_root_code"] for p in params], layouts).view(-1, GROUP_SIZE),
        _gather_scales([p.state["exp_avg_sq_root_scale"] for p in params]),
    ).view(-1)
    v = root.mul_(root)
    _adamw(x, g, m, v, h)
    _weights_out(x, params, weights, layouts, correction)
    code, scale = _encode_momentum(m.view(-1, GROUP_SIZE), compand)
    _scatter(code.view(-1), [p.state["exp_avg_code"] for p in params], layouts)
    _scatter_scales(scale, [p.state["exp_avg_scale"] for p in params])
    code, scale = _encode_root(v.sqrt_().view(-1, GROUP_SIZE))
    _scatter(code.view(-1), [p.state["exp_avg_sq_root_code"] for p in params], layouts)
    _scatter_scales(scale, [p.state["exp_avg_sq_root_scale"] for p in params])


def _step_flat(params: Sequence[_Param], h: _Hyper, correction: bool) -> None:
    """Step parameters of at most one dim (24-bit moments), all at once."""
    layouts = [_Rows.of(p.weight, grouped=False) for p in params]
    weights = [p.weight for p in params]
    g = _gather([p.grad for p in params], layouts).float()
    x = _weights_in(params, layouts, correction)
    moments = []
    for key in ("exp_avg", "exp_avg_sq"):
        high = _gather([p.state[key] for p in params], layouts)
        error = _gather([p.state[f"{key}_error"] for p in params], layouts)
        moments.append(_join24(high, error))
    m, v = moments
    _adamw(x, g, m, v, h)
    _weights_out(x, params, weights, layouts, correction)
    for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
        high, error = _split24(value)
        _scatter(high, [p.state[key] for p in params], layouts)
        _scatter(error, [p.state[f"{key}_error"] for p in params], layouts)


def _weights_in(
    params: Sequence[_Param], layouts: Sequence[_Rows], correction: bool
) -> torch.Tensor:
    """The float32 weights of ``params`` (flat, padded as ``layouts``)."""
    weight = _gather([p.weight for p in params], layouts)
    if weight.dtype == torch.bfloat16 and correction:
        return _join24(weight, _gather([p.state["weight_error"] for p in params], layouts))
    return weight.float()


def _weights_out(
    x: torch.Tensor,
    params: Sequence[_Param],
    weights: Sequence[torch.Tensor],
    layouts: Sequence[_Rows],
    correction: bool,
) -> None:
    if weights[0].dtype == torch.bfloat16 and correction:
        high, error = _split24(x)
        _scatter(high, weights, layouts)
        _scatter(error, [p.state["weight_error"] for p in params], layouts)
    else:
        _scatter(x, weights, layouts)


# ------------------------------------------------------------------------------ state


def _new_state(weight: torch.Tensor, correction: bool) -> dict[str, torch.Tensor]:
    """Zero state for the local tensor ``weight``; ``step`` as torch.optim.AdamW keeps it."""
    state = {"step": torch.tensor(0.0, dtype=torch.float32)}
    if weight.dtype == torch.bfloat16 and correction:
        state["weight_error"] = torch.zeros_like(weight, dtype=torch.int8)
    if weight.dim() >= 2:
        layout = _Rows.of(weight, grouped=True)
        scales = (layout.rows, layout.groups)
        state["exp_avg_code"] = torch.zeros_like(weight, dtype=torch.int8)
        state["exp_avg_scale"] = weight.new_zeros(scales, dtype=torch.bfloat16)
        state["exp_avg_sq_root_code"] = torch.zeros_like(weight, dtype=torch.uint8)
        state["exp_avg_sq_root_scale"] = weight.new_zeros(scales, dtype=torch.bfloat16)
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(weight, dtype=torch.bfloat16)
            state[f"{key}_error"] = torch.zeros_like(weight, dtype=torch.int8)
    return state


def _is_adamw_entry(entry: dict[str, Any]) -> bool:
    """Whether ``entry`` is torch.optim.AdamW's (float ``exp_avg``/``exp_avg_sq``)."""
    return "exp_avg" in entry and "exp_avg_error" not in entry


def _from_adamw(weight: torch.Tensor, entry: dict[str, Any], compand: bool) -> dict[str, Any]:
    """This layout of an AdamW state entry for the local tensor ``weight`` (quantizing)."""
    out: dict[str, Any] = {"step": entry["step"]}
    if "weight_error" in entry:
        out["weight_error"] = entry["weight_error"]
    m, v = entry["exp_avg"].float(), entry["exp_avg_sq"].float()
    if weight.dim() >= 2:
        layout = _Rows.of(weight, grouped=True)
        target = _new_state(weight, correction=False)
        codes = [target["exp_avg_code"]], [target["exp_avg_sq_root_code"]]
        code, scale = _encode_momentum(_gather([m], [layout]).view(-1, GROUP_SIZE), compand)
        _scatter(code.view(-1), codes[0], [layout])
        _scatter_scales(scale, [target["exp_avg_scale"]])
        code, scale = _encode_root(_gather([v], [layout]).sqrt_().view(-1, GROUP_SIZE))
        _scatter(code.view(-1), codes[1], [layout])
        _scatter_scales(scale, [target["exp_avg_sq_root_scale"]])
        out.update({key: target[key] for key in _ROW_KEYS})
    else:
        for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
            out[key], out[f"{key}_error"] = _split24(value)
    return out


def _to_adamw(weight_shape: torch.Size, entry: dict[str, Any], compand: bool) -> dict[str, Any]:
    """torch.optim.AdamW's state entry (float32 moments) of an entry of this layout, for a
    local tensor of ``weight_shape`` (dequantizing)."""
    out: dict[str, Any] = {"step": entry["step"]}
    if "exp_avg_code" in entry:
        probe = torch.empty(weight_shape, device="meta")
        layout = _Rows.of(probe, grouped=True)
        m = _decode_momentum(
            _gather([entry["exp_avg_code"]], [layout]).view(-1, GROUP_SIZE),
            _gather_scales([entry["exp_avg_scale"]]),
            compand,
        )
        root = _decode_root(
            _gather([entry["exp_avg_sq_root_code"]], [layout]).view(-1, GROUP_SIZE),
            _gather_scales([entry["exp_avg_sq_root_scale"]]),
        )
        for key, value in (("exp_avg", m), ("exp_avg_sq", root.mul_(root))):
            moment = torch.empty(weight_shape, dtype=torch.float32, device=value.device)
            _scatter(value.view(-1), [moment], [layout])
            out[key] = moment
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = _join24(entry[key], entry[f"{key}_error"]).view(weight_shape)
    return out


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _on_local(fn: Any, param: torch.Tensor, entry: dict[str, Any], *args: Any) -> dict[str, Any]:
    """``fn(local weight, local entry, *args)``, its tensors placed back like ``param``."""
    local_param = _local(param)
    out = fn(local_param, {k: _local(v) for k, v in entry.items()}, *args)
    return {k: _placed_like(v, param, local_param) for k, v in out.items()}


@declare_stepping("elementwise")
class CompactAdamW(Optimizer):
    """AdamW with bfloat16 weights, an int8 error of their rounding and 8-bit moments.

    About 5.1 bytes of persistent state per parameter (weights included) instead of 12, on
    CPU and CUDA with eager PyTorch ops. See the module's notes for the layout. The update is
    ``torch.optim.AdamW``'s (decoupled weight decay, bias corrections) on the decoded values.

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
    ) -> None:
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
        compand = {}
        for group in self.param_groups:
            group.setdefault("weight_correction", True)
            group.setdefault("compand", True)
            for param in group["params"]:
                compand[param] = group["compand"]
        for param, entry in list(self.state.items()):
            if not isinstance(param, torch.Tensor) or not entry:
                continue
            for key, dtype in _CODE_DTYPES.items():
                if key in entry and entry[key].dtype != dtype:
                    entry[key] = entry[key].to(dtype)
            if _is_adamw_entry(entry):
                entry = self.state[param] = _on_local(
                    _from_adamw, param, entry, compand.get(param, True)
                )
            for key in ("exp_avg", "exp_avg_sq"):
                if f"{key}_error" in entry and entry[key].dtype != torch.bfloat16:
                    entry[key] = entry[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Step every parameter holding a gradient; state is created at its first step."""
        if closure is not None:
            raise TypeError("CompactAdamW.step takes no closure")
        for group in self.param_groups:
            batches: dict[tuple[bool, torch.dtype, torch.device, int], list[_Param]] = {}
            steps = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                entry = self.state.get(param)
                local = _local(param)
                if not entry:
                    entry = self.state[param] = {
                        k: _placed_like(v, param, local)
                        for k, v in _new_state(local, group["weight_correction"]).items()
                    }
                elif (
                    group["weight_correction"]
                    and param.dtype == torch.bfloat16
                    and "weight_error" not in entry
                ):
                    error = torch.zeros_like(local, dtype=torch.int8)
                    entry["weight_error"] = _placed_like(error, param, local)
                steps.append(entry["step"])
                if local.numel() == 0:
                    continue
                grad = param.grad
                if isinstance(param, DTensor):
                    if grad.placements != param.placements:
                        grad = grad.redistribute(param.device_mesh, param.placements)
                    grad = grad._local_tensor
                state = {k: _local(v) for k, v in entry.items()}
                key = (local.dim() >= 2, local.dtype, local.device, int(entry["step"]) + 1)
                batches.setdefault(key, []).append(_Param(local, grad, state))
            if not steps:
                continue
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            for (grouped, _, _, step), params in batches.items():
                h = _Hyper(
                    float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], step
                )
                if grouped:
                    _step_grouped(params, h, group["weight_correction"], group["compand"])
                else:
                    _step_flat(params, h, group["weight_correction"])


def master_weight(param: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """The float32 weights of ``param`` (bfloat16 weight plus its ``weight_error``); a DTensor
    placed like ``param`` for a DTensor."""
    if "weight_error" not in entry:
        return param.detach().float()
    local = _local(param).detach()
    value = _join24(local.reshape(-1), _local(entry["weight_error"]).reshape(-1))
    return _placed_like(value.view(local.shape), param, local)


def to_adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim.AdamW`` state dict (float32 moments) of a ``CompactAdamW`` one.

    ``state_dict``: ``optimizer.state_dict()`` of ``CompactAdamW`` or of
    ``OptimizerInBackward`` wrapping it; DTensor values are converted shard by shard (a row's
    groups are on one rank). Decoding error: the momentum to within half a code step of its
    group's scale (the largest magnitude of its 32 elements; a step is 1/127 of it linear,
    finer near zero when companded), the variance's root to within half of 1/255 of its
    group's largest root, scales rounded to bfloat16; the 24-bit moments of one-dim
    parameters to about 2**-16 relative. The weights are not part of an optimizer state
    dict: read them with :func:`master_weight`.
    """
    groups = state_dict["param_groups"]
    compand = {pid: g.get("compand", True) for g in groups for pid in g["params"]}
    state = {}
    for pid, entry in state_dict["state"].items():
        if "exp_avg_code" not in entry and "exp_avg_error" not in entry:
            state[pid] = dict(entry)
            continue
        like = entry["exp_avg_code"] if "exp_avg_code" in entry else entry["exp_avg"]
        local = {k: _local(v) for k, v in entry.items()}
        out = _to_adamw(_local(like).shape, local, compand.get(pid, True))
        state[pid] = {k: _placed_like(v, like, _local(like)) for k, v in out.items()}
    adamw_keys = dict(amsgrad=False, maximize=False, foreach=None, capturable=False)
    adamw_keys.update(differentiable=False, fused=None, decoupled_weight_decay=True)
    param_groups = [
        {
            **{k: v for k, v in g.items() if k not in ("weight_correction", "compand")},
            **adamw_keys,
        }
        for g in groups
    ]
    return {"state": state, "param_groups": param_groups}
