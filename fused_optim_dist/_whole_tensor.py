"""Whole-tensor stepping: each parameter's update runs on its owner rank, on the full tensor.

[Note: whole-tensor stepping]
Muon orthogonalizes the whole momentum matrix, Adafactor factors the second moment over rows
and columns, LAMB scales by the norm of the whole parameter: none of them can step a shard
alone, and stepping the DTensors makes every reduction a collective (Muon's Newton-Schulz on a
sharded matrix costs one per matmul, and Adafactor does not run on FSDP2 at all). So each
sharded parameter of a unit gets an owner rank (see [Note: owners balance every unit]); when
the unit's gradients are ready, the shards the update needs go to the owners in one
all-to-all, each owner steps its parameters on full tensors, and a second all-to-all brings
every rank its rows of the results. Two routes, both exact:

* **the class's own step** (any class declared ``whole_tensor``, ``torch.optim.Adafactor``):
  the owner receives the gradient, the parameter and the state shaped like the parameter's
  rows, runs the wrapped class's ``step`` on the full tensors with the full state, and sends
  back every rank's rows of the parameter and the state, and all other state whole. The owner
  computes exactly what the class computes in one process.
* **Muon** (exactly ``torch.optim.Muon``): momentum, Nesterov and the update of the parameter
  are elementwise, so every rank does them on its shards, with the very ops ``Muon.step``
  uses; only the Nesterov momentum goes to the owner, and only its orthogonalization
  (``torch.optim``'s own Newton-Schulz function) runs there. One matrix each way instead of
  gradient, parameter and momentum, and the same values, bit for bit.

State keeps the plain optimizer's layout on the same sharded parameters (see
[Note: where whole-tensor state lives]), so checkpoints reshard and interchange.

[Note: where whole-tensor state lives]
A state tensor with the parameter's number of dimensions and rows (Muon's ``momentum_buffer``,
Adafactor's ``row_var`` and 1-D ``variance``, LAMB's moments) is a DTensor placed like the
parameter, as the plain optimizer on FSDP2 holds it; 0-dim tensors (``step``) are plain tensors
on every rank, as torch.optim keeps them; any other tensor (Adafactor's ``col_var``) is a DTensor
replicated on the parameter's mesh. All are DTensors or plain tensors that DCP saves and
reshards. Every rank holds the same values, so a checkpoint does not depend on who owned what.

[Note: whole-tensor work in flight]
A unit's exchange to the owners is asynchronous: the hook that steps unit U packs U's shards,
launches the all-to-all and returns, so backward computes the next layers while U's shards
travel. U is completed (orthogonalized, results sent back and applied) when the next unit
arrives, before that unit's own exchange is launched, or by ``flush()``, which the
``BackwardPass`` calls when it finishes (the end of backward, or of ``step()``), like every other
end-of-backward work and in the same order on every rank. So at most one unit's gathered tensors
are alive on an owner at any time, and an update is applied before the next forward reads its
parameter.

[Note: whole-tensor classes keep their state per parameter]
An owner runs the class's step on its own parameters of a unit, on groups handed to that call:
a value the step writes into a group (``group["step"] += 1``, as timm's LAMB counts) is lost
with the copy, one it writes on the instance (``self.t += 1``) advances once per owner and
unit, on the owner only, and numbers it draws come in another order, on one rank, than the
plain ``step()`` draws them. Measured on a LAMB counting its steps in its group, 1, 2 and 3
ranks: 1.3e-4 from the plain LAMB after three steps; counting on the instance, 3.7e-3; no
error. So a class declared ``whole_tensor`` (not torch.optim's, whose state is all in
``state[p]``) is watched at each owner's step (``OutsideState``: its groups and instance
taken before, compared after, the generators too). What an owner saw travels with the
results: in the first step's gathered layouts, then as a one-byte flag before each owner's
results (read on the host: one synchronization per unit for such classes on GPUs), so every
rank raises together, before any rank writes its rows of the unit back; the owner's step ran
on copies (the gathered tensors, its replicated state cloned), so nothing of the unit has
moved. A step that raises on an owner (a class rejecting a shape) is raised there after the
others learn of it through the same paths (before, they went on alone to the next
collective). Parameters whole on every rank are stepped by every rank: their first step runs
on copies first. The first step on each rank also runs ``BesideOthers``: each owner hands the
step its own parameters, each in a group of its own, so a class whose update of a parameter
reads the others (a norm of all gradients clipping inside ``step()``, their number, a
parameter's position in its group) is refused through the same codes (``_READS_OTHERS``).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from fused_optim_dist._class_state import BesideOthers, OutsideState
from fused_optim_dist._kinds import keeps_state_per_parameter
from fused_optim_dist._owners import Exchange, TensorSpec, assign_owners, chunk_rows
from fused_optim_dist._protocol import describe
from fused_optim_dist._sharing import SharedStateCheck
from fused_optim_dist._stepping import Batch, BucketStepper
from fused_optim_dist._torch_internals import dtensor_from_local

__all__ = ["WholeTensorStepper", "check_whole_tensor_params"]

_ORTHO_DTYPE = torch.bfloat16
"""The dtype ``torch.optim.Muon``'s Newton-Schulz iteration returns."""

# (key, rows: whether sharded like the parameter's rows, global shape, dtype) per state entry.
_Layout = tuple[tuple[str, bool, torch.Size, torch.dtype], ...]


def _shard_dim(param: torch.Tensor) -> int | None:
    """The mesh dimension ``param`` is row-sharded on; ``None`` if it is whole on every rank.

    Raises ``ValueError`` for other layouts (tensor-parallel shards, several sharded dims).
    """
    if not isinstance(param, DTensor):
        return None
    sharded = [d for d, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return None
    if len(sharded) == 1 and param.placements[sharded[0]] == Shard(0):
        return sharded[0]
    raise ValueError(
        f"whole-tensor stepping supports parameters sharded on dim 0 over one mesh dimension "
        f"(FSDP2, HSDP), not a parameter of shape {tuple(param.shape)} placed "
        f"{param.placements}; use stepping='dtensor' for this model"
    )


def check_whole_tensor_params(param_groups: Sequence[dict[str, Any]]) -> None:
    """Raise ``ValueError`` for a parameter whole-tensor stepping cannot own."""
    for group in param_groups:
        for param in group["params"]:
            _shard_dim(param)


def _is_rows(shape: torch.Size, param: torch.Tensor) -> bool:
    """Whether a state tensor of ``shape`` is sharded like ``param``'s rows."""
    return len(shape) == param.dim() and len(shape) > 0 and shape[0] == param.shape[0]


def _layout(entry: dict[str, Any], param: torch.Tensor) -> _Layout:
    layout = []
    for key in sorted(entry):
        value = entry[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"whole-tensor stepping keeps optimizer state in tensors, but the state of a "
                f"parameter of shape {tuple(param.shape)} holds a {type(value).__name__} under "
                f"{key!r}; store it as a tensor"
            )
        layout.append((key, _is_rows(value.shape, param), value.shape, value.dtype))
    return tuple(layout)


def _stored(value: torch.Tensor, rows: bool, param: DTensor, shape: torch.Size) -> torch.Tensor:
    """A state value as it is kept: see [Note: where whole-tensor state lives]."""
    if rows:
        placements = param.placements
    elif value.dim() == 0:
        return value
    else:
        placements = tuple(Replicate() for _ in param.placements)
    stride = torch.empty(shape, device="meta").stride()
    return dtensor_from_local(value, param.device_mesh, placements, shape, stride)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


_MOVED = {
    False: "No parameter of this unit has moved.",
    True: "This bucket's parameters have moved.",
}

_LAYOUT_CHANGED = 8
"""An owner's step changed a parameter's state layout (besides ``OutsideState``'s codes)."""
_RAISED = 16
"""An owner's step raised (its exception is raised on that rank, this code's error on the
others)."""
_READS_OTHERS = 32
"""An owner's step moved a parameter otherwise beside others than alone (``BesideOthers``)."""


def _outside_state_error(cls: type[Optimizer], code: int, moved: bool = False) -> RuntimeError:
    """The refusal of a class declared ``whole_tensor`` whose step did ``code`` (see [Note:
    whole-tensor classes keep their state per parameter]); ``moved``: the parameters it
    stepped have moved (whole on every rank, watched after their first step)."""
    if code & _RAISED:
        return RuntimeError(
            f"{cls.__name__}'s step raised on another rank, the owner of parameters of this "
            "unit (that rank's error says why). No parameter of this unit has moved."
        )
    done = [
        text
        for bit, text in (
            (
                OutsideState.WROTE_GROUPS,
                "wrote values into its param groups (each call is handed copies of them: the "
                "values are lost)",
            ),
            (
                OutsideState.WROTE_INSTANCE,
                "set attributes on the optimizer instance (advanced once per owner and unit, "
                "on the owner only)",
            ),
            (
                OutsideState.DREW,
                "drew random numbers (on the owners, in another order than the plain step() "
                "draws them)",
            ),
            (
                _LAYOUT_CHANGED,
                "changed the keys, shapes or dtypes of its state (its rows are exchanged in "
                "the layout the first step created)",
            ),
            (
                _READS_OTHERS,
                "moved a parameter otherwise beside others than alone (its update reads other "
                "parameters: a norm over several clipping inside step(), their number, a "
                "parameter's position in its group; an owner is handed only its own)",
            ),
        )
        if code & bit
    ]
    return RuntimeError(
        f"{cls.__name__} is declared 'whole_tensor', but its step {'; and '.join(done)}. Each "
        "owner rank runs that step on its own parameters of a unit, so it would train "
        f"differently from the plain step() with nothing to tell. {_MOVED[moved]} Keep every "
        "value the step advances in self.state[p], as tensors of fixed keys and shapes (as "
        "torch.optim's classes do), declare the class 'dtensor' (stepped on the DTensors, its "
        "groups and instance tracked), or leave it undeclared (stepped jointly, once per "
        "backward, as the plain step())."
    )


class _Owned:
    """The sharded parameters of one unit on one mesh dimension, with their owners."""

    def __init__(
        self,
        params: list[DTensor],
        groups: list[dict[str, Any]],
        dim: int,
        state: defaultdict[torch.Tensor, dict],
    ) -> None:
        mesh = params[0].device_mesh
        self.params = params
        self.groups = groups
        # The optimizer's state, which the step reads and updates.
        self.state = state
        self.process_group = mesh.get_group(dim)
        self.size = mesh.size(dim)
        self.rank = mesh.get_local_rank(dim)
        self.owners = assign_owners([p.numel() for p in params], self.size)
        self.rows = [chunk_rows(p.shape[0], self.size) for p in params]
        self.mine = [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def rows_shape(self, index: int, shape: torch.Size, rank: int) -> torch.Size:
        start, end = self.rows[index][rank]
        return torch.Size((end - start, *shape[1:]))

    def slice(self, index: int, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        start, end = self.rows[index][rank]
        return tensor[start:end]


class _InFlight:
    """A unit whose shards are on their way to the owners; completed by ``complete``."""

    def __init__(self, owned: _Owned, exchange: Exchange, complete: Callable[..., None]) -> None:
        self.owned = owned
        self.exchange = exchange
        self._complete = complete

    def complete(self) -> None:
        self._complete(self.owned, self.exchange.wait())


class WholeTensorStepper:
    """Steps batches of parameters with ``optimizer``'s update, each on its owner's full tensor.

    A ``Stepper``, as ``BucketStepper`` is. See [Note: whole-tensor stepping]; a step launched in
    backward completes by the end of that backward ([Note: whole-tensor work in flight]).

    Args:
        optimizer: an instance of the wrapped class, built on the user's parameters.

    Raises:
        ValueError: for a parameter not sharded on dim 0 over one mesh dimension.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        check_whole_tensor_params(optimizer.param_groups)
        self.optimizer = optimizer
        # Steps full tensors (owners' gathered ones, and parameters whole on every rank).
        self._whole = BucketStepper(optimizer, local_shards=False)
        self._muon = type(optimizer) is torch.optim.Muon
        # See [Note: state shared between parameters] in ``_sharing.py``.
        self._refuse_shared = (
            SharedStateCheck() if keeps_state_per_parameter(type(optimizer)) else None
        )
        # A class of the user's: watched for state kept outside state[p]. See [Note:
        # whole-tensor classes keep their state per parameter].
        self._watch = not keeps_state_per_parameter(type(optimizer))
        self._probed = False
        # Whether this rank's owner steps were checked with ``BesideOthers``.
        self._beside_checked = False
        # The unit whose exchange is in flight, completed by the next step() or flush().
        self._pending: _InFlight | None = None

    def takes_found_inf(self, batches: Sequence[Batch]) -> bool:
        """Never: a non-finite bucket is skipped before its step is called."""
        return False

    @torch.no_grad()
    def step(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step every parameter of ``batches`` (a unit) using its ``.grad``; a collective.

        Returns nothing: the class's step runs on owner ranks only, each on its own
        parameters, so group and instance state cannot be tracked here (see
        ``WholeTensorStepper.__init__``).

        Gradients are read before this returns, so the caller may free them. The update is
        applied by the next call or by :meth:`flush`, which the ``BackwardPass`` calls when it
        finishes (at the end of backward, or of ``step()``).
        """
        assert found_inf is None, "takes_found_inf() is False"
        self.flush()
        if self._refuse_shared is not None:
            self._refuse_shared([p for batch in batches for p in batch.params], state, describe)
        whole: list[Batch] = []
        by_dim: dict[int, tuple[list[DTensor], list[dict[str, Any]]]] = {}
        for group, params, grads in batches:
            rest, rest_grads = [], []
            for param, grad in zip(params, grads, strict=True):
                dim = _shard_dim(param)
                if dim is None:
                    rest.append(param)
                    rest_grads.append(grad)
                else:
                    members, groups = by_dim.setdefault(dim, ([], []))
                    members.append(param)
                    groups.append(group)
            if rest:
                whole.append(Batch(group, rest, rest_grads))
        if whole:
            self._step_everywhere(whole, state)
        for dim, (params, groups) in by_dim.items():
            # Every unit is on one mesh: one dimension, hence one exchange, in practice.
            self.flush()
            owned = _Owned(params, groups, dim, state)
            self._pending = (self._launch_muon if self._muon else self._launch_class)(owned)

    def _step_everywhere(
        self, batches: list[Batch], state: defaultdict[torch.Tensor, dict]
    ) -> None:
        """Step parameters whole on every rank, on every rank; a class of the user's is
        watched, on copies before its first real update (see [Note: whole-tensor classes keep
        their state per parameter])."""
        if not self._watch:
            self._whole.step(batches, state)
            return
        groups = [batch.group for batch in batches]
        if not self._probed:
            watch = OutsideState(self.optimizer, groups, state)
            beside = BesideOthers(self.optimizer, self._whole, batches, state)
            handed, _ = self._whole.step_copies(batches, state)
            code = watch.undo(handed) | (_READS_OTHERS if beside.disagrees() else 0)
            if code:
                raise _outside_state_error(type(self.optimizer), code)
            self._probed = True
        watch = OutsideState(self.optimizer, groups, state)
        handed = self._whole.step(batches, state)
        assert handed is not None, "a step on whole tensors hands the class its groups"
        code = watch.undo(handed)
        if code:
            raise _outside_state_error(type(self.optimizer), code, moved=True)

    def flush(self) -> None:
        """Complete the unit in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.complete()

    # ------------------------------------------------------------------ Muon

    def _launch_muon(self, owned: _Owned) -> _InFlight:
        """Momentum on the shards, exactly as ``Muon.step``; the Nesterov momentum to owners."""
        sends: list[list[torch.Tensor]] = [[] for _ in range(owned.size)]
        for index, (param, group) in enumerate(zip(owned.params, owned.groups, strict=True)):
            if torch.is_complex(param):
                raise RuntimeError("Muon does not support complex parameters")
            grad = param.grad.to_local()
            entry = owned.state[param]
            if "momentum_buffer" not in entry:
                entry["momentum_buffer"] = _stored(
                    torch.zeros_like(grad, memory_format=torch.preserve_format),
                    True,
                    param,
                    param.shape,
                )
            buf = entry["momentum_buffer"].to_local()
            momentum = group["momentum"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            sends[owned.owners[index]].append(update)
        expects = [
            [
                (owned.rows_shape(i, owned.params[i].shape, s), owned.params[i].dtype)
                for i in owned.mine
            ]
            for s in range(owned.size)
        ]
        device = owned.params[0].to_local().device
        return _InFlight(
            owned, Exchange(sends, expects, owned.process_group, device), self._complete_muon
        )

    def _complete_muon(self, owned: _Owned, received: list[list[torch.Tensor]]) -> None:
        """Orthogonalize the owned matrices; every rank updates its rows as ``Muon.step``."""
        sends: list[list[torch.Tensor]] = [[] for _ in range(owned.size)]
        for k, index in enumerate(owned.mine):
            group = owned.groups[index]
            update = torch.cat([pieces[k] for pieces in received])
            ortho = _zeropower_via_newtonschulz(
                update, group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            assert ortho.dtype == _ORTHO_DTYPE, ortho.dtype
            for rank in range(owned.size):
                sends[rank].append(owned.slice(index, ortho, rank))
        del received
        expects = [
            [
                (owned.rows_shape(i, owned.params[i].shape, owned.rank), _ORTHO_DTYPE)
                for i, o in enumerate(owned.owners)
                if o == source
            ]
            for source in range(owned.size)
        ]
        device = owned.params[0].to_local().device
        back = Exchange(sends, expects, owned.process_group, device).wait()
        del sends
        for source, pieces in enumerate(back):
            indices = [i for i, o in enumerate(owned.owners) if o == source]
            for index, ortho in zip(indices, pieces, strict=True):
                param, group = owned.params[index], owned.groups[index]
                lr = _to_scalar(group["lr"])
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                local = param.to_local()
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(ortho, alpha=-adjusted_lr)

    # ------------------------------------------------------------------ the class's own step

    def _launch_class(self, owned: _Owned) -> _InFlight:
        """Gradient, parameter and row-sharded state to the owners."""
        # The state layout of each parameter before the step; None: no state yet.
        layouts: list[_Layout | None] = []
        sends: list[list[torch.Tensor]] = [[] for _ in range(owned.size)]
        for index, param in enumerate(owned.params):
            grad = param.grad.to_local()
            if grad.dtype != param.dtype:
                raise TypeError(
                    f"a parameter of shape {tuple(param.shape)} is {param.dtype} but its "
                    f"gradient is {grad.dtype}; whole-tensor stepping needs them alike"
                )
            entry = owned.state.get(param)
            layout = _layout(entry, param) if entry else None
            layouts.append(layout)
            shards = [grad, param.to_local()]
            for key, rows, _, _ in layout or ():
                if rows:
                    value = entry[key]
                    if not (isinstance(value, DTensor) and value.placements == param.placements):
                        raise ValueError(
                            f"state {key!r} of a parameter of shape {tuple(param.shape)} must "
                            f"be a DTensor placed like it ({param.placements}); "
                            "see [Note: where whole-tensor state lives]"
                        )
                    shards.append(value.to_local())
            sends[owned.owners[index]].extend(shards)
        expects = [
            [spec for i in owned.mine for spec in self._shard_specs(owned, i, layouts[i], source)]
            for source in range(owned.size)
        ]
        device = owned.params[0].to_local().device
        exchange = Exchange(sends, expects, owned.process_group, device)

        def complete(owned: _Owned, received: list[list[torch.Tensor]]) -> None:
            self._complete_class(owned, received, layouts)

        return _InFlight(owned, exchange, complete)

    @staticmethod
    def _shard_specs(
        owned: _Owned, index: int, layout: _Layout | None, rank: int
    ) -> list[TensorSpec]:
        """What ``rank`` sends the owner of parameter ``index``: gradient, parameter, rows."""
        param = owned.params[index]
        rows_shape = owned.rows_shape(index, param.shape, rank)
        specs = [(rows_shape, param.dtype), (rows_shape, param.dtype)]
        for _, rows, shape, dtype in layout or ():
            if rows:
                specs.append((owned.rows_shape(index, shape, rank), dtype))
        return specs

    def _complete_class(
        self,
        owned: _Owned,
        received: list[list[torch.Tensor]],
        layouts: list[_Layout | None],
    ) -> None:
        """Owners run the class's step on full tensors; every rank gets its rows back."""
        results, code, raised = self._step_owned(owned, received, layouts)
        del received
        if any(layout is None for layout in layouts):
            # First step of some parameter: only its owner knows the state the step created.
            # What each owner's step did and a state it cannot keep travel with them, so
            # that every rank raises.
            mine, error = {}, None
            try:
                if not code:
                    mine = {
                        index: _layout(entry, owned.params[index])
                        for index, (_, entry) in results.items()
                    }
            except TypeError as e:
                error = str(e)
            gathered: list[Any] = [None] * owned.size
            dist.all_gather_object(gathered, (mine, code, error), group=owned.process_group)
            layouts = [None] * len(owned.params)
            for part, part_code, part_error in gathered:
                code |= part_code
                error = error or part_error
                for index, layout in part.items():
                    layouts[index] = layout
            if error is not None:
                raise TypeError(error)
            if code:
                raise raised or _outside_state_error(type(self.optimizer), code)
        sends: list[list[torch.Tensor]] = [[] for _ in range(owned.size)]
        for index, (full, entry) in results.items() if not code else ():
            layout = _layout(entry, owned.params[index])
            if layout != layouts[index]:
                if self._watch:
                    code |= _LAYOUT_CHANGED
                    break
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} changed the state layout of a parameter "
                    f"of shape {tuple(full.shape)} from {layouts[index]} to {layout}; "
                    "whole-tensor stepping needs the keys, shapes and dtypes the first step "
                    "creates to stay"
                )
            for rank in range(owned.size):
                sends[rank].append(owned.slice(index, full, rank))
                for key, rows, _, _ in layout:
                    value = entry[key]
                    sends[rank].append(owned.slice(index, value, rank) if rows else value)
        del results
        device = owned.params[0].to_local().device
        flagged = self._watch  # each owner's code ahead of its results
        if code:
            # Refused: results of the sizes every rank expects, never written back.
            sends = [
                [
                    torch.zeros(shape, dtype=dtype, device=device)
                    for index in owned.mine
                    for shape, dtype in self._result_specs(owned, index, layouts[index], rank)
                ]
                for rank in range(owned.size)
            ]
        if flagged and owned.mine:
            flag = torch.tensor([code], dtype=torch.uint8, device=device)
            for pieces in sends:
                pieces.insert(0, flag)
        expects = [
            [(torch.Size([1]), torch.uint8)] * (flagged and source in owned.owners)
            + [
                spec
                for index, owner in enumerate(owned.owners)
                if owner == source
                for spec in self._result_specs(owned, index, layouts[index], owned.rank)
            ]
            for source in range(owned.size)
        ]
        back = Exchange(sends, expects, owned.process_group, device).wait()
        del sends
        if flagged:
            flags = [pieces.pop(0) for pieces in back if pieces]
            code = functools.reduce(operator.or_, torch.cat(flags).tolist(), 0)
            if code:
                raise raised or _outside_state_error(type(self.optimizer), code)
        for source, pieces in enumerate(back):
            it = iter(pieces)
            for index, owner in enumerate(owned.owners):
                if owner != source:
                    continue
                param = owned.params[index]
                param.to_local().copy_(next(it))
                entry = owned.state[param]
                for key, rows, shape, _ in layouts[index]:
                    value = next(it)
                    current = entry.get(key)
                    if current is not None and _local(current).shape == value.shape:
                        _local(current).copy_(value)
                    else:
                        entry[key] = _stored(value.clone(), rows, param, shape)

    @staticmethod
    def _result_specs(
        owned: _Owned, index: int, layout: _Layout | None, rank: int
    ) -> list[TensorSpec]:
        """What the owner of parameter ``index`` sends ``rank``: its rows and the state."""
        assert layout is not None, "every layout is known once the first step is gathered"
        param = owned.params[index]
        specs = [(owned.rows_shape(index, param.shape, rank), param.dtype)]
        for _, rows, shape, dtype in layout:
            specs.append((owned.rows_shape(index, shape, rank) if rows else shape, dtype))
        return specs

    def _step_owned(
        self,
        owned: _Owned,
        received: list[list[torch.Tensor]],
        layouts: list[_Layout | None],
    ) -> tuple[dict[int, tuple[torch.Tensor, dict[str, Any]]], int, Exception | None]:
        """Assemble the owned parameters and step them: index -> (full parameter, its state),
        what the step did outside ``state[p]`` (``OutsideState``'s codes; 0 for a class not
        watched), and the exception it raised (``_RAISED``), which this rank raises once every
        rank has learnt of it."""
        sources = [iter(pieces) for pieces in received]
        full_state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        batches: list[Batch] = []
        results: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        for index in owned.mine:
            param, layout = owned.params[index], layouts[index]
            grads, params, rows = [], [], []
            for source in sources:
                grads.append(next(source))
                params.append(next(source))
                rows.append([next(source) for _, is_rows, _, _ in layout or () if is_rows])
            full = torch.cat(params)
            full.grad = torch.cat(grads)
            entry = full_state[full]
            row_values = iter(zip(*rows, strict=True))
            for key, is_rows, _, _ in layout or ():
                if is_rows:
                    entry[key] = torch.cat(next(row_values))
                else:
                    # Whole on every rank: a copy of the owner's, which a refused step must
                    # leave as it was ([Note: whole-tensor classes keep their state per
                    # parameter]).
                    entry[key] = _local(owned.state[param][key]).clone()
            if not entry:
                del full_state[full]
            batches.append(Batch(owned.groups[index], [full], [full.grad]))
            results[index] = (full, entry)
        code = 0
        if batches:
            watch = (
                OutsideState(self.optimizer, [batch.group for batch in batches], full_state)
                if self._watch
                else None
            )
            beside = None
            try:
                if watch is not None and not self._beside_checked:
                    beside = BesideOthers(self.optimizer, self._whole, batches, full_state)
                handed = self._whole.step(batches, full_state)
            except Exception as e:
                if watch is None:
                    raise
                # Raised after the other ranks learn of it. See [Note: whole-tensor classes
                # keep their state per parameter].
                watch.undo(None)
                return {}, _RAISED, e
            if watch is not None:
                assert handed is not None, "a step on whole tensors hands the class its groups"
                code = watch.undo(handed)
                if beside is not None:
                    self._beside_checked = True
                    code |= _READS_OTHERS if beside.disagrees() else 0
        for index, (full, _) in list(results.items()):
            full.grad = None
            results[index] = (full, full_state[full])
        return results, code, None
