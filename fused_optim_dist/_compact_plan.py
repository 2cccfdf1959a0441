"""CompactAdamW's plans: what a param group's step makes (the C or Triton kernel's tables of
addresses, or the eager path's flat batches), reused from step to step. See [Note: the C kernel] in
``_compact_kernel.py`` and [Note: reused plans] below."""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fused_optim_dist import _compact_kernel
from fused_optim_dist._compact_update import FlatBatch, FlatUpdate, Hyper, Param
from fused_optim_dist._state_identity import StateEntries
from fused_optim_dist._torch_internals import holds_values

if TYPE_CHECKING:
    from fused_optim_dist._compact_triton import TritonTable

_GRAD_DTYPES = (torch.bfloat16, torch.float32)
"""Gradient dtypes the kernel reads."""


class KernelTable(NamedTuple):
    """A batch's arguments to the C kernel: ``_compact_kernel.FIELDS`` int64 per parameter
    (its tensors' addresses, shape and flags) and its gradients' addresses."""

    fields: ctypes.Array
    grads: ctypes.Array

    def run(self, weights: list[torch.Tensor], group: dict[str, Any]) -> None:
        h = Hyper.of(group)
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
_shape = operator.attrgetter("shape")
_is_cpu = operator.attrgetter("is_cpu")
_PLAIN = {torch.Tensor}


class Plan:
    """What a param group's step made, reused at the next step while nothing it points to has
    changed.

    [Note: reused plans]
    Finding a group's batches, checking and reading each parameter's state, and making what a
    batch's update takes (the C kernel's table of addresses, the eager path's flat views and
    groups) cost more in Python than the update itself on small tensors. A plan keeps them for
    the whole group and is reused while the group holds the same parameters at the same
    addresses, of the same shapes and dtypes and contiguous, their state entries hold the same
    tensors in the same order ([Note: checking state by identity] in ``_state_identity.py``:
    ``load_state_dict``, state created or converted, a tensor replaced, added or removed, an
    entry dropped: the step takes the full path and makes a new plan), at the same addresses
    (a tensor's storage swapped through ``.data =``, as helpers moving optimizer state between
    devices do, would leave the kernel writing freed memory and the flat views updating the
    old storage), its options are the same, and every parameter has a gradient its batch
    takes (the checks of :meth:`grads` and a subclass's ``step``); otherwise nothing is
    stepped through it, and the full path checks (and refuses) what changed. A parameter
    given another shape or layout at the same address (``p.data = p.data[:4]``, rows
    pruned; ``p.data = p.data.t()``) would be stepped with the plan's: the kernel reading
    its new, shorter gradient past its end and writing rows no longer part of it. The
    checks are C-level ``map``s over the parameters (a Python loop cost about 3 us per
    parameter); those of the parameters' shapes, dtypes and contiguity cost about 0.2 us per
    parameter. The state tensors' dtypes and shapes are not compared (about 0.05 us per
    tensor each, six tensors to a parameter): a state tensor of the same object at the same
    address has them unless ``.data =`` pointed it at a view of its own storage of another
    dtype or shape. A plan holds the tensors it points to, so none is freed while it is kept
    (nor its address reused), and there is one plan per parameter
    (``CompactAdamW._remember``). Plans of DTensor parameters are not kept: their local
    tensors are not the group's tensors.
    """

    __slots__ = (
        "addresses",
        "dtypes",
        "entries",
        "options",
        "params",
        "shapes",
        "state_addresses",
        "state_tensors",
        "weight_dtypes",
    )

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        items: Sequence[Param],
        options: tuple[bool, int],
    ) -> None:
        self.params = tuple(params)
        self.options = options
        self.addresses = list(map(_data_ptr, params))
        self.shapes = list(map(_shape, params))
        self.weight_dtypes = list(map(_dtype, params))
        self.entries = StateEntries(params, state)
        self.state_tensors = [v for v in self.entries.values if isinstance(v, torch.Tensor)]
        self.state_addresses = list(map(_data_ptr, self.state_tensors))
        self.dtypes = [item.grad.dtype for item in items]
        if any(item.param is not item.weight for item in items):
            self.params = ()  # DTensors: their local tensors are not the group's tensors

    @staticmethod
    def options_of(group: dict[str, Any]) -> tuple[bool, int]:
        """The group's options a plan was made for, ``weight_correction`` and
        ``variance_bits``: a change sends the step to the full path (which refuses a state of
        another ``variance_bits``)."""
        return group["weight_correction"], group["variance_bits"]

    def grads(
        self, state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]
    ) -> list[torch.Tensor] | None:
        """The gradients of the group's parameters if the plan still holds for it (see [Note:
        reused plans]; each gradient present, of the dtype it had), else ``None``."""
        params = group["params"]
        if not (
            self.options_of(group) == self.options
            and len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and self.entries.match(state)
            and list(map(_data_ptr, params)) == self.addresses
            and list(map(_shape, params)) == self.shapes
            and all(map(operator.is_, map(_dtype, params), self.weight_dtypes))
            and all(map(_is_contiguous, params))
            and list(map(_data_ptr, self.state_tensors)) == self.state_addresses
        ):
            return None
        grads = list(map(_grad, params))
        if not (
            set(map(type, grads)) == _PLAIN  # none missing
            and all(map(operator.is_, map(_dtype, grads), self.dtypes))
        ):
            return None
        return grads


class KernelPlan(Plan):
    """A group stepped by the C kernel: one table for the whole group (the kernel takes every
    layout in one call), in the group's order; only the gradients' addresses are written at
    each step. See [Note: reused plans]."""

    __slots__ = ("table", "weights")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        tables: Sequence[tuple[list[int], KernelTable, list[Param]]],
        options: tuple[bool, int],
    ) -> None:
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
        items = [item for _, _, item in rows]
        super().__init__(params, state, items, options)
        fields = [field for _, row, _ in rows for field in row]
        self.table = KernelTable(
            (ctypes.c_int64 * len(fields))(*fields), (ctypes.c_int64 * len(rows))()
        )
        self.weights = [item.weight for item in items]

    def step(self, state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> bool:
        """Step the group through this plan; ``False`` (nothing done) if it no longer holds."""
        grads = self.grads(state, group)
        if grads is None or not (all(map(_is_cpu, grads)) and all(map(_is_contiguous, grads))):
            return False
        self.table.grads[:] = list(map(_data_ptr, grads))
        self.table.run(self.weights, group)
        return True


def _in_group_order(batches: Sequence[tuple[list[int], Any, list[Param]]]) -> list[Param]:
    """The parameters of a group's batches (each with their indices in the group), back in
    the group's order."""
    order = sorted(
        (index, item)
        for indices, _, batch in batches
        for index, item in zip(indices, batch, strict=True)
    )
    return [item for _, item in order]


class TritonPlan(Plan):
    """A group stepped by the Triton kernel: its batches' tables, each with its parameters'
    indices in the group; only the gradients' addresses are written at each step. See
    [Note: reused plans] and [Note: the Triton kernel] in ``_compact_triton.py``."""

    __slots__ = ("tables", "weights")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        tables: Sequence[tuple[list[int], TritonTable, list[Param]]],
        options: tuple[bool, int],
    ) -> None:
        super().__init__(params, state, _in_group_order(tables), options)
        self.tables = [(indices, table) for indices, table, _ in tables]
        self.weights = [[item.weight for item in batch] for _, _, batch in tables]

    def step(self, state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> bool:
        """Step the group through this plan; ``False`` (nothing done) if it no longer holds."""
        grads = self.grads(state, group)
        if grads is None:
            return False
        for indices, table in self.tables:
            batch = [grads[i] for i in indices]
            if not table.takes_grads(batch):
                return False
        for (indices, table), weights in zip(self.tables, self.weights, strict=True):
            table.grads = [grads[i].data_ptr() for i in indices]
            table.run(weights, group)
        return True


class FlatPlan(Plan):
    """A group stepped by the flat update (eager or compiled): its batches, each with its
    parameters' indices in the group, kept with their flat views ([Note: kept flat views] in
    ``_compact_update.py``). See [Note: reused plans]."""

    __slots__ = ("batches",)

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        batches: Sequence[tuple[list[int], FlatBatch, list[Param]]],
        options: tuple[bool, int],
    ) -> None:
        super().__init__(params, state, _in_group_order(batches), options)
        self.batches = [(indices, batch) for indices, batch, _ in batches]
        if not all(batch.reusable for _, batch in self.batches):
            self.params = ()

    def step(
        self,
        state: dict[torch.Tensor, dict[str, Any]],
        group: dict[str, Any],
        update_flat: FlatUpdate,
    ) -> bool:
        """Step the group through this plan; ``False`` (nothing done) if it no longer holds.
        See [Note: a group moves whole or not at all] in ``compact_adamw.py``."""
        grads = self.grads(state, group)
        if grads is None:
            return False
        h = Hyper.of(group)
        with torch.no_grad():
            writes = [
                batch.update([grads[i] for i in indices], h, update_flat)
                for indices, batch in self.batches
            ]
            for write in writes:
                write()
        return True


def kernel_table(
    params: Sequence[Param], keys: Sequence[str], grouped: bool, variance_bits: int
) -> KernelTable | None:
    """The C kernel's table of ``params``, or ``None`` if it cannot take one of them."""
    correction = "weight_error" in keys
    fields: list[int] = []
    for p in params:
        weight, grad, step = p.weight, p.grad, p.state["step"]
        state = [p.state[k] for k in keys]
        if not (
            grad.dtype in _GRAD_DTYPES
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
    return KernelTable(
        (ctypes.c_int64 * len(fields))(*fields), (ctypes.c_int64 * len(grads))(*grads)
    )
