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

The encodings' notes ([Note: 24-bit weights],
[Note: 8-bit moments], [Note: 4-bit variance]) are in ``_compact_codes.py``, the update's
([Note: layout-independent arithmetic]) in ``_compact_update.py``, the C kernel's in
``_compact_kernel.py`` and ``_compact_plan.py``, and the Triton kernel's in
``_compact_triton.py``.

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

import functools
import math
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fused_optim_dist import _compact_compiled, _compact_kernel
from fused_optim_dist._compact_codes import (
    GROUP_SIZE,
    VARIANCE_BITS,
    Groups,
    decode_momentum,
    decode_root,
    encode_momentum,
    encode_root,
    join24,
    packed_row_bytes,
    row_groups,
    split24,
    sqrt_rn,
)
from fused_optim_dist._compact_plan import (
    FlatPlan,
    KernelPlan,
    KernelTable,
    Plan,
    TritonPlan,
    kernel_table,
)
from fused_optim_dist._compact_update import FlatBatch, FlatUpdate, Hyper, Param, update_flat
from fused_optim_dist._kinds import (
    checks_groups,
    declare_stepping,
    instance_caches,
    per_parameter_state,
)
from fused_optim_dist._stepping import _placed_like
from fused_optim_dist._torch_internals import holds_values

if TYPE_CHECKING:
    from fused_optim_dist._compact_triton import TritonTable

__all__ = [
    "GROUP_SIZE",
    "VARIANCE_BITS",
    "CompactAdamW",
    "load_master_weight",
    "master_weight",
    "to_adamw_state_dict",
]

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


# ------------------------------------------------------------------------------ state


def _root_code_shape(weight_shape: torch.Size, bits: int) -> tuple[int, ...]:
    """The shape of ``exp_avg_sq_root_code`` for a local tensor of ``weight_shape``: the
    weight's with 8 bits, rows of packed bytes with 4."""
    if bits == 8:
        return tuple(weight_shape)
    return weight_shape[0], packed_row_bytes(math.prod(weight_shape[1:]))


def _new_state(
    weight: torch.Tensor, correction: bool, variance_bits: int
) -> dict[str, torch.Tensor]:
    """Zero state for the local tensor ``weight``; ``step`` as torch.optim.AdamW keeps it."""
    state = {"step": torch.tensor(0.0, dtype=torch.float32)}
    if weight.dtype == torch.bfloat16 and correction:
        state["weight_error"] = torch.zeros_like(weight, dtype=torch.int8)
    if weight.dim() >= 2:
        scales = (weight.shape[0], row_groups(math.prod(weight.shape[1:])))
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


def _check_shapes(param: torch.Tensor, entry: dict[str, Any]) -> None:
    """Raise if a state tensor of ``param``'s ``entry`` (this layout's or AdamW's) is not
    shaped for ``param``'s local tensor: state saved for a parameter of another shape, which
    the C kernel, reading lengths from the weight, would step past its end. The second-moment
    code may have either ``variance_bits``' shape (the other one is refused at the step,
    saying so)."""
    shape = tuple(_local(param).shape)
    codes: tuple[tuple[int, ...], ...] = ()
    scales = None
    if len(shape) >= 2:
        scales = (shape[0], row_groups(math.prod(shape[1:])))
        codes = (_root_code_shape(shape, 8), _root_code_shape(shape, 4))
    for key, value in entry.items():
        if key == "step" or not isinstance(value, torch.Tensor):
            continue
        found = tuple(_local(value).shape)
        if key.endswith("_scale"):
            expected_ok = found == scales
        elif key == "exp_avg_sq_root_code":
            expected_ok = found in codes
        else:  # the weight's error, one-dim moments, AdamW's moments, 8-bit momentum codes
            expected_ok = found == shape
        if not expected_ok:
            raise ValueError(
                f"CompactAdamW: the state of a parameter of shape {tuple(param.shape)} holds "
                f"{key!r} of shape {found} on this rank, where its local tensor is {shape}: "
                "it was saved for a parameter of another shape (a resized head or "
                "vocabulary?), or the parameter was reshaped since (rows pruned through "
                "p.data =). Load state that matches the model, or drop this parameter's "
                "entry (del optimizer.state[param]) to start its state afresh"
            )


def _check_dtypes(param: torch.Tensor, entry: dict[str, Any]) -> None:
    """Raise if a state tensor of ``param``'s ``entry`` is not of the dtype this layout keeps
    it in (replaced by hand: the C kernel, taking the dtype from the layout, would write a
    uint8 ``exp_avg_scale`` two bytes an element, past its end; the eager path would convert
    the values into it)."""
    for key, value in entry.items():
        expected = _CODE_DTYPES.get(key)
        if expected is None and f"{key}_error" in entry:  # a 24-bit moment's upper half
            expected = torch.bfloat16
        found = _local(value).dtype if isinstance(value, torch.Tensor) else None
        if expected is not None and found != expected:
            raise TypeError(
                f"CompactAdamW: the state of a parameter of shape {tuple(param.shape)} holds "
                f"{key!r} as {found}, where CompactAdamW keeps it as {expected} (replaced by "
                "hand?). Load state through load_state_dict (it converts each tensor to its "
                "dtype), or drop this parameter's entry (del optimizer.state[param]) to start "
                "its state afresh"
            )


def _check_width(param: torch.Tensor, entry: dict[str, Any], bits: int) -> None:
    """Raise if ``param``'s ``entry`` holds second-moment codes of another ``variance_bits``
    than ``bits`` (read with the wrong width, they would decode to garbage)."""
    code = entry.get("exp_avg_sq_root_code")
    if code is not None and tuple(_local(code).shape) != _root_code_shape(
        _local(param).shape, bits
    ):
        raise ValueError(
            f"CompactAdamW: the state of a parameter of shape {tuple(param.shape)} holds "
            f"a second-moment code of shape {tuple(code.shape)}, written with another "
            f"variance_bits than its group's ({bits}); variance_bits is fixed for a run "
            "(convert with to_adamw_state_dict and load that to change it)"
        )


def _check_group_width(group: dict[str, Any], state: dict[torch.Tensor, Any]) -> None:
    """Raise if ``group``'s ``variance_bits`` is not the width its matrices' state was
    written with: the option changed since. Its first matrix holding state tells (a group's
    matrices are written with one width); each parameter's own is checked again when it is
    stepped, so one replaced by hand with the other width is refused then."""
    bits = group["variance_bits"]
    for param in group["params"]:
        if param.dim() >= 2:
            entry = state.get(param)
            if entry and "exp_avg_sq_root_code" in entry:
                _check_width(param, entry, bits)
                return


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
        groups = Groups([weight.shape], bits == 4).to(weight.device)
        flat = {k: out[k].view(-1) for k in _ROW_KEYS}
        encode_momentum(
            groups.view(m), groups, flat["exp_avg_code"], flat["exp_avg_scale"], compand
        )
        root = groups.view(sqrt_rn(v))
        encode_root(root, groups, flat["exp_avg_sq_root_code"], flat["exp_avg_sq_root_scale"], bits)
    else:
        for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
            high, error = split24(value)
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
        groups = Groups([weight_shape], bits == 4).to(entry["exp_avg_code"].device)
        flat = {k: entry[k].reshape(-1) for k in _ROW_KEYS}
        m = decode_momentum(flat["exp_avg_code"], flat["exp_avg_scale"], groups, compand)
        root = decode_root(
            flat["exp_avg_sq_root_code"], flat["exp_avg_sq_root_scale"], groups, bits
        )
        out["exp_avg"] = m.reshape(weight_shape)
        out["exp_avg_sq"] = root.mul_(root).reshape(weight_shape)
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            high, error = entry[key].reshape(-1), entry[f"{key}_error"].reshape(-1)
            out[key] = join24(high, error).view(weight_shape)
    return out


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _on_local(fn: Any, param: torch.Tensor, entry: dict[str, Any], *args: Any) -> dict[str, Any]:
    """``fn(local weight, local entry, *args)``, its tensors placed back like ``param``."""
    local_param = _local(param)
    out = fn(local_param, {k: _local(v) for k, v in entry.items()}, *args)
    return {k: _placed_like(v, param, local_param) for k, v in out.items()}


@per_parameter_state
@instance_caches("_plans", "_plan_of")
@checks_groups("_check_groups")
@declare_stepping("elementwise")
class CompactAdamW(Optimizer):
    """AdamW with bfloat16 weights, an int8 error of their rounding and 8-bit moments.

    About 5.1 bytes of persistent state per parameter (weights included) instead of 12, on
    CPU (a C kernel, see ``kernel``) and CUDA (a Triton kernel, or eager PyTorch ops without
    Triton). See the module's notes for
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
            it); ``"eager"`` always takes the eager path. ``"auto"`` steps CUDA tensors with
            a Triton kernel where Triton is installed (see [Note: the Triton kernel] in
            ``_compact_triton.py``), and ``"triton"`` requires it. All give the same bits.

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
        if kernel == "triton" and _triton_module() is None:
            raise RuntimeError(
                f"CompactAdamW(kernel='triton'): {_TRITON_MISSING}; install it (it comes with "
                "torch's CUDA builds), or use kernel='auto' to fall back to the eager path"
            )
        self.kernel = kernel
        # Plans by the id of their group's ``params`` list, and that id by parameter id.
        self._plans: dict[int, Plan] = {}
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``, refusing parameters this class cannot step (at
        construction too, which adds the first groups through it)."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # a set: Optimizer's own error
            params = param_group["params"] = list(params)
        seen: set[int] = set()
        for param in params:
            if isinstance(param, tuple):  # (name, parameter), as Optimizer takes them
                param = param[1]
            _refuse_weight_dtype(param)
            if id(param) in seen:
                # torch.optim warns and steps it once per listing; the flat update would
                # step it once: refused, as OptimizerInBackward refuses it.
                raise ValueError(
                    f"CompactAdamW: a parameter of shape {tuple(param.shape)} is listed twice "
                    "in one param group; list each parameter once"
                )
            seen.add(id(param))
            if isinstance(param, DTensor) and any(
                p.is_shard() and not p.is_shard(0) for p in param.placements
            ):
                raise ValueError(
                    f"CompactAdamW needs parameters sharded along dim 0 only (FSDP2), not "
                    f"{param.placements} (shape {tuple(param.shape)}): its quantization "
                    "groups lie within rows"
                )
            local = _local(param)
            if self.kernel == "c" and local.device.type == "cpu" and not local.is_contiguous():
                # Refused here rather than at a step: in backward, other buckets would have
                # been stepped before this one's.
                raise ValueError(
                    f"CompactAdamW(kernel='c') cannot step a parameter that is not contiguous "
                    f"(shape {tuple(param.shape)}, strides {local.stride()}: channels_last?); "
                    "make it contiguous, or use kernel='auto' to step it with the eager path"
                )
        _refuse_unsupported({**self.defaults, **param_group}, len(self.param_groups), "add")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore state dtypes by key and convert AdamW entries. See [Note: state dtypes
        across load_state_dict].

        Param groups without this class's options (``torch.optim.AdamW``'s, or
        :func:`to_adamw_state_dict`'s) take them from this optimizer's groups as they were,
        else from its defaults: loading such a state dict into an optimizer built with other
        options (``variance_bits=4``, say) keeps them. Groups asking for an update this class
        does not make (``maximize``, ``amsgrad``, ``torch.optim.Adam``'s weight decay added to
        the gradient) are refused before anything is loaded, as is state shaped for
        parameters of other shapes."""
        groups = state["param_groups"]
        for index, group in enumerate(groups):
            _refuse_unsupported(group, index)
        previous = self.__dict__.get("param_groups") or []
        defaults = {**_OPTIONS, **self.__dict__.get("defaults", {})}
        group_of = {}
        for index, group in enumerate(groups):
            fallback = previous[index] if len(previous) == len(groups) else {}
            for option in _OPTIONS:
                group.setdefault(option, fallback.get(option, defaults[option]))
            for param in group["params"]:
                group_of[param] = group
        for param, entry in state["state"].items():
            if isinstance(param, torch.Tensor) and entry and param in group_of:
                _check_shapes(param, entry)
        super().__setstate__(state)
        self.__dict__.setdefault("kernel", "auto")
        self._plans, self._plan_of = {}, {}
        for param, entry in list(self.state.items()):
            if not isinstance(param, torch.Tensor) or not entry:
                continue
            if "step" in entry and not isinstance(entry["step"], torch.Tensor):
                # torch.optim.AdamW's state before torch 1.12: a Python number, as AdamW loads it
                entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every parameter holding a gradient; state is created at its first step.
        ``closure``, as torch.optim's AdamW takes it, is called first, with gradients enabled,
        and its value returned.

        The parameters of a param group are stepped together, one batch per kind (matrices,
        vectors), dtype and device, each by the C kernel or in one pass of whole-tensor ops. A
        group goes through the plan its previous step made while it holds ([Note: reused
        plans] in ``_compact_plan.py``): the C kernel's table, which runs no torch op, or the
        flat update's kept views; the rest under ``no_grad``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups(enumerate(self.param_groups), self.state)
        for group in self.param_groups:
            plan = self._plans.get(id(group["params"]))
            if isinstance(plan, (KernelPlan, TritonPlan)) and plan.step(self.state, group):
                continue
            if isinstance(plan, FlatPlan) and plan.step(self.state, group, self._update_flat()):
                continue
            with torch.no_grad():
                self._step_group(group)
        return loss

    def _check_groups(
        self,
        groups: Iterable[tuple[int, dict[str, Any]]],
        state: dict[torch.Tensor, dict[str, Any]],
    ) -> None:
        """Raise, before anything moves, if one of ``groups`` (pairs of a param group's index
        and the group) cannot be stepped as it is now: an option set on it since it was added
        asks for an update this class does not make, or its ``variance_bits`` is not the
        width its matrices' state in ``state`` was written with.

        :meth:`step` checks its groups so before it steps the first. ``OptimizerInBackward``
        calls it with every group of this class when a backward (or its ``step()``) starts
        stepping: there this class's ``step`` sees one bucket's groups at a time, and a
        bucket of vectors, whose state has no width, would move before the first bucket of
        matrices refused. A group this class stepped through a plan made with its options is
        not looked at again; else its first matrix holding state is (about 1 us a group).
        Plans are kept by the group's ``params`` list, and the groups ``OptimizerInBackward``
        checks are the user's, whose lists its buckets never hand to ``step``: there every
        group is looked at, at each backward."""
        for index, group in groups:
            _refuse_unsupported(group, index, "step")
            plan = self._plans.get(id(group["params"]))
            if plan is None or plan.options != Plan.options_of(group):
                _check_group_width(group, state)

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
        batches: dict[tuple[bool, torch.dtype, torch.device], list[Param]] = {}
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
        flat = [
            (indices[kind], self._flat_batch(batch, kind[0], group), batch)
            for kind, batch in batches.items()
            if chosen[kind] is None
        ]
        h = Hyper.of(group)
        writes = [
            flat_batch.update([p.grad for p in batch], h, self._update_flat())
            for _, flat_batch, batch in flat
        ]
        for write in writes:
            write()
        tables = []
        for kind, batch in batches.items():
            table = chosen[kind]
            if table is not None:
                table.run([p.weight for p in batch], group)
                tables.append((indices[kind], table, batch))
        if (
            not params
            or sum(map(len, indices.values())) < len(params)
            or (tables and flat)
            or len({type(table) for _, table, _ in tables}) > 1  # CPU and CUDA tensors
            or not holds_values(params[0])  # fake tensors (the memory estimator): no addresses
        ):
            return
        options = Plan.options_of(group)
        if not tables:
            plan: Plan = FlatPlan(params, self.state, flat, options)
        elif isinstance(tables[0][1], KernelTable):
            plan = KernelPlan(params, self.state, tables, options)
        else:
            plan = TritonPlan(params, self.state, tables, options)
        if plan.params:
            self._remember(id(params), plan)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "kernel": self.kernel}

    def _remember(self, key: int, plan: Plan) -> None:
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
        params: list[Param],
        kind: tuple[bool, torch.dtype, torch.device],
        group: dict[str, Any],
    ) -> KernelTable | TritonTable | None:
        """The table of a batch for the C kernel (CPU) or the Triton kernel (CUDA), or
        ``None`` where the eager path steps it (the eager or compiled path chosen, or a
        kernel unavailable or not taking the batch's tensors: then ``kernel="c"`` and
        ``kernel="triton"`` raise). See [Note: the C kernel] in ``_compact_kernel.py`` and
        [Note: the Triton kernel] in ``_compact_triton.py``."""
        grouped, _, device = kind
        which = self.kernel
        if which == "auto":
            which = "c" if device.type == "cpu" else "triton" if device.type == "cuda" else None
        elif which == "c" and device.type != "cpu":
            return None  # "c" asks for the C kernel for CPU tensors only
        keys = _batch_keys(grouped, group, params[0].weight)
        if which == "c":
            available = _compact_kernel.kernel() is not None
            reason = _compact_kernel.unavailable_reason()
            table = (
                kernel_table(params, keys, grouped, group["variance_bits"]) if available else None
            )
        elif which == "triton":
            triton_kernel = _triton_module()
            reason = _TRITON_MISSING if triton_kernel is None else None
            table = (
                None
                if triton_kernel is None
                else triton_kernel.TritonTable.of(params, keys, grouped, group)
            )
        else:
            return None
        if table is None and self.kernel == which:
            raise RuntimeError(
                f"CompactAdamW(kernel={which!r}) cannot step these tensors with its kernel "
                f"({reason or _KERNEL_LAYOUT[which]}); use kernel='auto' to fall back to the "
                "eager path"
            )
        return table

    def _param(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> Param:
        """``param`` with its local tensors and state, the state created if missing; raises
        if its state is not shaped or typed for it, or was written with another
        ``variance_bits`` than its group's."""
        _refuse_weight_dtype(param)  # converted since it was added (module.half())
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
        _check_shapes(param, entry)
        _check_dtypes(param, entry)
        _check_width(param, entry, bits)
        if type(param) is DTensor:
            if grad.placements != param.placements:
                grad = grad.redistribute(param.device_mesh, param.placements)
            return Param(param, local, grad._local_tensor, {k: _local(v) for k, v in entry.items()})
        return Param(param, local, grad, dict(entry))

    def _flat_batch(self, params: list[Param], grouped: bool, group: dict[str, Any]) -> FlatBatch:
        """A batch the flat update steps (eager, or compiled with ``kernel="compile"``)."""
        groups = None
        if grouped:
            shapes = [p.weight.shape for p in params]
            groups = Groups(shapes, group["variance_bits"] == 4).to(params[0].weight.device)
        keys = _batch_keys(grouped, group, params[0].weight)
        return FlatBatch(params, keys, groups, chunked=self.kernel != "compile")

    def _update_flat(self) -> FlatUpdate:
        """The flat update: eager, or compiled with ``kernel="compile"``."""
        if self.kernel == "compile":
            return _compact_compiled.compiled(update_flat)
        return update_flat


def _refuse_weight_dtype(param: torch.Tensor) -> None:
    if param.dtype not in _WEIGHT_DTYPES:
        raise TypeError(
            f"CompactAdamW takes bfloat16 or float32 parameters, not {param.dtype} "
            f"(shape {tuple(param.shape)}); convert the model with .to(torch.bfloat16)"
        )


def _refuse_unsupported(group: dict[str, Any], index: int, action: str = "load") -> None:
    """Raise if a param group asks for an update CompactAdamW does not make (``action``: what
    was being done with it, "load", "add" or "step")."""
    fix = (
        "load it into the optimizer it came from"
        if action == "load"
        else "remove the option from the group, or use torch.optim.AdamW"
    )
    for option in ("maximize", "amsgrad"):
        if group.get(option):
            raise ValueError(
                f"CompactAdamW cannot {action} param group {index}: it has {option}=True, "
                f"which CompactAdamW does not implement; {fix}"
            )
    if group.get("decoupled_weight_decay") is False and group.get("weight_decay"):
        raise ValueError(
            f"CompactAdamW cannot {action} param group {index}: its weight decay "
            f"({group['weight_decay']}) is added to the gradient (torch.optim.Adam's L2), "
            "where CompactAdamW decays the weights as AdamW does; set the group's "
            "weight_decay to the AdamW value you want, or use torch.optim.Adam"
        )


@functools.cache
def _triton_module() -> ModuleType | None:
    """``_compact_triton``, or ``None`` where Triton is not installed."""
    try:
        from fused_optim_dist import _compact_triton
    except ImportError:
        return None
    return _compact_triton


_TRITON_MISSING = "Triton is not installed"


def _batch_keys(grouped: bool, group: dict[str, Any], weight: torch.Tensor) -> tuple[str, ...]:
    """The state keys a batch's update reads and writes (``step`` aside): its moments', and
    ``weight_error`` where its bfloat16 weights keep one."""
    keys = _ROW_KEYS if grouped else _FLAT_KEYS
    if group["weight_correction"] and weight.dtype == torch.bfloat16:
        keys = ("weight_error", *keys)
    return keys


_OPTIONS = {"weight_correction": True, "compand": True, "variance_bits": 8}
"""CompactAdamW's param-group options that torch.optim.AdamW does not have, with defaults."""

_KERNELS = ("auto", "c", "triton", "compile", "eager")
_KERNEL_LAYOUT = {
    "c": "it takes contiguous CPU tensors, bfloat16 or float32 gradients and float32 CPU step "
    "counters",
    "triton": "it takes contiguous CUDA tensors (CPU ones under TRITON_INTERPRET=1), gradients "
    "of one dtype, bfloat16 or float32, in a batch, and float32 CPU step counters",
}


def master_weight(param: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """The float32 weights of ``param`` (bfloat16 weight plus its ``weight_error``); a DTensor
    placed like ``param`` for a DTensor."""
    if "weight_error" not in entry or param.dtype != torch.bfloat16:
        return param.detach().float()  # float32 weights are their own master weights
    local = _local(param).detach()
    value = join24(local.reshape(-1), _local(entry["weight_error"]).reshape(-1))
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
    high, error = split24(_local(value).to(torch.float32).reshape(-1).contiguous())
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
