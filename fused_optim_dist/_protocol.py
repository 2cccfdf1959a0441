"""The plain optimizer's step protocol, enforced on an optimizer that steps in backward.

[Note: the step protocol]
A plain optimizer consumes the gradients at ``step()``: whatever the loop did to them before
(a second backward added to them, ``zero_grad()`` dropped them, a step pre-hook changed them)
is what it steps. An in-backward optimizer consumes each gradient when it arrives, so those
loops would train differently without a word. Instead, the updates made in backward are
*pending* until the loop's next ``step()``, which commits them, and while they are pending:

* a parameter already updated must not receive another gradient (a second ``backward()``
  before ``step()``: two losses, plain-style accumulation, a GAN generator's loss flowing into
  the discriminator): the hook raises before anything else of that parameter moves, naming
  ``accumulate()``;
* ``zero_grad()`` would discard gradients whose update already happened (the loop meant to
  throw them away, as the GAN loop and a caught failing backward do): it raises, since an update
  cannot be undone. ``step()`` first accepts them;
* ``load_state_dict()`` replaces the state those updates were made from: ``step()`` then
  raises (the plain optimizer would step the loaded state with the gradients), and
  ``zero_grad()`` discards the updates only once every updated parameter was written too (the
  model restored with the optimizer: a rollback, equal to the plain loop's load and
  ``zero_grad()``; generators a jointly stepped class drew from are set back, see [Note:
  random numbers drawn jointly] in ``_engine.py``);
* at ``step()``, a parameter whose version counter, or whose state's, moved since its update
  (``model.load_state_dict``, an in-place write) would be stepped by the plain optimizer from the
  written values: ``step()`` raises, as it does when the loop dropped the gradients it would
  step (see [Note: freed gradients]). A write through ``.data`` moves no version counter and
  goes unseen;
* at ``step()``, a parameter whose storage was swapped since its update for other values
  (``p.data = backup``: SAM's second step, an adversarial perturbation of the weights undone,
  ``module.half()``) would be stepped by the plain optimizer from the new data; the update
  was written to the old: ``step()`` raises (see [Note: data swapped by assignment] in
  ``_torch_internals.py``). A swap for equal values (``model.to(memory_format=
  torch.channels_last)``, ``p.data = p.data.clone()``, a device round trip) carries the
  update: the plain optimizer steps the same values, converted, and the update is
  elementwise;
* at ``step()``, a value of a group (``lr``, betas) changed since the updates were made (an LR
  set by hand between backward and ``step()``, in place or by replacing the group's dict, or a
  parameter moved to a group with other values) would be stepped with by the plain optimizer,
  and a parameter removed from ``param_groups`` not stepped at all: ``step()`` raises;
* a forward of a module holding an updated parameter (an evaluation, a logged loss, a second
  micro-batch's forward) would read the updated weights where the plain loop's reads those of
  before ``step()``: it raises before it starts (see [Note: a forward between backward and
  step()]);
* an FSDP2 unit holding updates that was sharded when they were made and holds all-gathered
  weights at ``step()`` (``model.unshard()`` between backward and ``step()``): see [Note:
  copies gathered before step()];
* at ``step()``, a generator that a jointly stepped class's step drew from at the end of
  backward and that was drawn from again since: the plain ``step()`` would draw after the
  loop's draws, here the class drew before them: ``step()`` raises (see [Note: random
  numbers drawn jointly] in ``_engine.py``).

A second ``step()`` with no backward and no ``zero_grad()`` since the first would step the
held gradients again in the plain optimizer: refused, seeing the freed gradients.

Updates made by ``step()`` itself are committed at once. Parameters are held strongly, and only
until the next ``step()``: their identity, never a recycled ``id()``, names them.
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fused_optim_dist._generators import GeneratorStates
from fused_optim_dist._torch_internals import (
    FSDPUnit,
    current_backward_id,
    fsdp_units_of,
    held_values,
    holds_values,
    local_tensor,
    storages,
)

__all__ = [
    "PendingUpdates",
    "StaleCopies",
    "describe",
    "params_read_by",
    "refuse_committed_again",
    "refuse_stepping_again",
]


def describe(param: torch.Tensor) -> str:
    return f"a parameter of shape {tuple(param.shape)}"


def params_read_by(
    module: nn.Module, wanted: Collection[int], gathered_then: Collection[int]
) -> list[torch.Tensor]:
    """The parameters (by ``id``, of ``wanted``) a forward of ``module`` is about to read: its
    own, and for a module given to ``fully_shard`` its units' sharded ones, before FSDP2
    gathers them; not those of a unit that held all-gathered weights when it was updated (the
    ``id`` of its param group in ``gathered_then``) and still holds them: that copy is of
    before the update, as the plain loop's is. See [Note: a forward between backward and
    step()]."""
    read = [p for p in module._parameters.values() if p is not None and id(p) in wanted]
    if isinstance(module, FSDPModule):
        for unit in fsdp_units_of(module):
            if id(unit.group) not in gathered_then or not unit.holds_gathered_copy():
                read += [p for p in unit.params if id(p) in wanted]
    return read


def refuse_stepping_again(freed: list[torch.Tensor]) -> None:
    """Raise for a ``step()`` with no backward since the last one, where ``freed`` still hold
    the gradients that step committed (see [Note: freed gradients])."""
    more = f" (and {len(freed) - 1} more)" if len(freed) > 1 else ""
    raise RuntimeError(
        f"step() called again with no backward since the last step(), while {describe(freed[0])}"
        f"{more} still holds the gradient that step committed (no zero_grad() in between). A "
        "plain optimizer would step that gradient a second time; here it was stepped once, in "
        "backward, and freed. Call step() once per backward and zero_grad() after it."
    )


def refuse_committed_again(held: list[torch.Tensor], when: str) -> None:
    """Raise at ``when`` (``"backward()"``, where a stepping backward starts, before anything
    moves; or ``"step()"``, after backwards that stepped nothing, run under ``accumulate()``)
    where ``held`` still hold the gradients an earlier ``step()`` committed. See [Note:
    gradients a step() already committed] in ``_freed.py``."""
    more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    if when == "backward()":
        again = (
            "A plain optimizer's next step() would step it again: a second time where this "
            "backward does not reach the parameter (a critic's gradient stepped again with "
            "the actor's loss), or added to this backward's"
        )
        now = " (nothing was stepped now)"
    else:
        again = (
            "A plain optimizer would step it again here, a second time, beside the gradients "
            "the backwards since gave"
        )
        now = ""
    raise RuntimeError(
        f"{when}: {describe(held[0])}{more} still holds the gradient an earlier step() "
        f"committed (no zero_grad() since). {again}; here it was stepped once, in backward, "
        f"and freed{now}. Call zero_grad() after each step(), or drop that gradient "
        "(p.grad = None) before the next backward."
    )


_MISSING = object()


def _changed_keys(
    then: dict[str, Any], now: dict[str, Any], known: Collection[str] | None
) -> list[str]:
    """The keys of a group's values (:func:`_values`) that differ between ``then`` and
    ``now``, among ``known`` (``None``: all of them)."""
    keys = then.keys() | now.keys()
    return [
        key
        for key in sorted(keys if known is None else keys & set(known))
        if _differ(then.get(key, _MISSING), now.get(key, _MISSING))
    ]


def _changed_group_error(where: str) -> RuntimeError:
    return RuntimeError(
        f"step(): {where} between backward and step(). A plain optimizer steps with "
        "the new value; here this step's update was made in backward, with the old "
        "one. Set group values and move parameters before backward (at the top of "
        "the loop, or after step(), where LR schedulers set them). The updates cannot "
        "be undone: restart from the last checkpoint."
    )


def _values(group: dict[str, Any]) -> dict[str, Any]:
    """A group's values but its params, each as :func:`_noted`."""
    return {key: _noted(value) for key, value in group.items() if key != "params"}


def _noted(value: Any) -> Any:
    """A group's value as it is now: a tensor by its identity and version counter (an in-place
    write to a tensor lr changes it), a list, tuple, dict or set by a copy of its items noted
    alike (an in-place edit of NAdam's ``betas`` list, or of a tensor held in Adam's ``betas``
    tuple, changes it); any other value as itself."""
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, id(value), value._version)
    if isinstance(value, list | tuple):
        return (type(value), tuple(map(_noted, value)))
    if isinstance(value, dict):
        return (dict, {key: _noted(item) for key, item in value.items()})
    if isinstance(value, set | frozenset):
        return copy.copy(value)
    return value


def _differ(then: Any, now: Any) -> bool:
    """Whether a group's value changed: not the same object, and not equal (a NaN kept in a
    group is itself, though unequal to itself)."""
    if then is now:
        return False
    try:
        return bool(then != now)
    except (RuntimeError, TypeError, ValueError):  # no truth value (an array)
        return True


class _Written:
    """The version counters of parameters and of their optimizer state at one moment, to find
    the ones written since: a parameter's own counter, its state entry (identity, size) and
    each value in it (identity; a tensor's counter too). Compared list against list, in C, at
    every ``step()``; the parameters are named only when something differs."""

    __slots__ = ("_entries", "_keys", "_owners", "_params", "_tensors", "_values", "_versions")

    def __init__(self, params: list[torch.Tensor], state: dict[torch.Tensor, dict]) -> None:
        self._params = params
        self._entries = _entries(params, state)
        self._keys = [(e, k) for e in self._entries if e for k in e]
        self._owners = [i for i, e in enumerate(self._entries) if e for _ in e]
        self._values = [entry[key] for entry, key in self._keys]
        self._tensors = [v for v in self._values if isinstance(v, torch.Tensor)]
        self._versions = self._read_versions()

    def _read_versions(self) -> list[int]:
        return [p._version for p in self._params] + [t._version for t in self._tensors]

    def __len__(self) -> int:
        return len(self._params)

    def rewritten(self) -> list[bool]:
        """Whether each parameter was written in place since (a model restored)."""
        return list(map(operator.ne, [p._version for p in self._params], self._versions))

    def written(self, state: dict[torch.Tensor, dict]) -> list[torch.Tensor]:
        entries = _entries(self._params, state)
        values = [entry.get(key, _MISSING) for entry, key in self._keys]
        if (
            not any(map(operator.is_not, entries, self._entries))
            and [len(e) for e in entries if e] == [len(e) for e in self._entries if e]
            and not any(map(operator.is_not, values, self._values))
            and self._read_versions() == self._versions
        ):
            return []
        # Something was written: name the parameters.
        written = {
            i
            for i, (now, then) in enumerate(zip(entries, self._entries, strict=True))
            if now is not then or (now and len(now) != len(then))
        }
        # self._versions holds the parameters' counters, then the tensors'.
        written.update(
            i
            for i, (param, version) in enumerate(zip(self._params, self._versions, strict=False))
            if param._version != version
        )
        counters = dict(
            zip(map(id, self._tensors), self._versions[len(self._params) :], strict=True)
        )
        for owner, now, then in zip(self._owners, values, self._values, strict=True):
            if now is not then or (
                isinstance(then, torch.Tensor) and then._version != counters[id(then)]
            ):
                written.add(owner)
        return [self._params[i] for i in sorted(written)]


def _carries(held: torch.Tensor, param: torch.Tensor, converted: bool) -> bool:
    """Whether ``param``'s values (its local shard's) are those of ``held``, the alias of the
    data its update was written into; with ``converted``, also where they are ``held``'s
    converted to another dtype (``model.double()``: the update is in them, rounded)."""
    local = local_tensor(param)
    if converted and held.dtype != local.dtype and holds_values(held):
        held = held.to(local.dtype)
    return (
        held.dtype == local.dtype
        and held.shape == local.shape
        and held.device == local.device
        and holds_values(held)
        and holds_values(local)
        and torch.equal(held, local)
    )


def _entries(params: list[torch.Tensor], state: dict[torch.Tensor, dict]) -> list[dict | None]:
    """Each parameter's state entry, or None; found by id, read off the state's keys (looking a
    parameter up hashes it in Python)."""
    by_id = {id(key): entry for key, entry in state.items()}
    return [by_id.get(id(param)) for param in params]


class PendingUpdates:
    """The parameters updated in backward since the last ``step()``. See [Note: the step
    protocol]."""

    __slots__ = (
        "__weakref__",
        "_added",
        "_buffers",
        "_draws",
        "_gathered",
        "_groups",
        "_held",
        "_ids",
        "_loaded",
        "_params",
        "_unfinished",
        "_unsettled",
        "_written",
    )

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        # Each parameter's version counter when its update was made (before settle(), as a
        # backward that raised never settles).
        self._added: list[int] = []
        # An alias of each parameter's values when its update was made, holding the storage
        # the update was written into. See [Note: data swapped by assignment] in
        # ``_torch_internals.py``.
        self._held: list[torch.Tensor] = []
        # id -> held in _params, so the ids cannot be recycled while they are here.
        self._ids: set[int] = set()
        # Whether an update belongs to a backward that raised before it finished.
        self._unfinished = False
        # The parameters' and their state's version counters once the updates were made.
        self._written: _Written | None = None
        # id(param) -> the index and values (not the params) of the group holding it, once
        # the updates were made.
        self._groups: dict[int, tuple[int, dict[str, Any]]] = {}
        # Each group's values when the first update not yet settled was made: the values a
        # backward that raised made its updates with, as it never settles.
        self._unsettled: list[dict[str, Any]] | None = None
        # Whether the optimizer's state was loaded since the updates were made.
        self._loaded = False
        # The FSDP2 units holding all-gathered weights once the updates were made.
        self._gathered: list[FSDPUnit] = []
        # id -> [a tensor the stepped gradients were views of, its version counter once the
        # updates were made]. See [Note: gradients in a flat buffer].
        self._buffers: dict[int, list[Any]] = {}
        # The generators a jointly stepped class drew from, as they were before and after its
        # step. See [Note: random numbers drawn jointly] in ``_engine.py``.
        self._draws: tuple[GeneratorStates, GeneratorStates] | None = None

    def __bool__(self) -> bool:
        return bool(self._ids)

    def add(self, params: Iterable[torch.Tensor]) -> None:
        if not self._ids:
            _FORWARD_READS.watch(self)
        new = []
        for param in params:
            if id(param) not in self._ids:
                self._ids.add(id(param))
                new.append(param)
        self._params += new
        self._added += [param._version for param in new]
        self._held += held_values(new)

    def note_group_values(self, param_groups: list[dict[str, Any]]) -> None:
        """As an update is recorded: note the groups' values, unless noted since the last
        settle (once per backward)."""
        if self._unsettled is None:
            self._unsettled = list(map(_values, param_groups))

    def settle(
        self,
        param_groups: list[dict[str, Any]],
        state: dict[torch.Tensor, dict],
        gathered: list[FSDPUnit],
    ) -> None:
        """Note the version counters (of the parameters and their state) and the groups'
        values once a backward's updates are all applied (the whole-tensor path writes some at
        its end, a class tracked for group state its groups): a later change is the loop's.
        Add ``gathered``, the FSDP2 units that held all-gathered weights when this backward
        updated them, to those of earlier backwards since ``step()``."""
        self._written = _Written(list(self._params), state)
        self._groups = self._holding_groups(param_groups)
        self._unsettled = None
        self._gathered += gathered
        for entry in self._buffers.values():
            entry[1] = entry[0]._version

    def note_gradient_buffer(self, base: torch.Tensor) -> None:
        """A stepped gradient is a view of ``base``, a larger tensor. See [Note: gradients in
        a flat buffer]."""
        self._buffers.setdefault(id(base), [base, None])

    def refuse_written_buffers(self) -> None:
        """Raise for ``step()`` if a tensor the stepped gradients were views of was written
        since the updates were made. See [Note: gradients in a flat buffer].

        [Note: gradients in a flat buffer]
        Hand-written data parallelism keeps every ``.grad`` as a view of one flat buffer and
        reduces the buffer after backward (``dist.all_reduce(flat); flat /= world``): the
        plain optimizer steps the reduced gradients, this one stepped each rank's own in
        backward (8.0e-2 apart on 2 ranks, the replicas apart by 1.6e-1, no error). A view's
        version counter is its base's, so a write into the buffer after backward shows in
        it; refused at ``step()``, where the write is known. A gradient being a view of a
        larger tensor is not enough to refuse: ``torch.autograd.grad`` returns narrow views
        of a concatenation's gradient (a fused QKV weight built with ``torch.cat``), and
        such gradients set as ``.grad`` train as the plain optimizer does."""
        for base, version in self._buffers.values():
            if version is not None and base._version != version:
                raise RuntimeError(
                    "step(): the gradients stepped in backward are views of a larger tensor "
                    f"(a flat gradient buffer of {base.numel()} elements) that was written "
                    "after backward (an all-reduce, a scaling): a plain optimizer steps the "
                    "written gradients, this one stepped them in backward, before the write. "
                    "Let each gradient be its own tensor (optim.zero_grad(), "
                    "set_to_none=True, drops the views), and use fully_shard or replicate "
                    "for data parallelism. Restart from the last checkpoint."
                )

    def _holding_groups(
        self, param_groups: list[dict[str, Any]]
    ) -> dict[int, tuple[int, dict[str, Any]]]:
        """Each updated parameter's group: its index and values, by the parameter's id."""
        holding = {}
        for index, group in enumerate(param_groups):
            ids = [id(p) for p in group["params"] if id(p) in self._ids]
            if ids:
                values = _values(group)
                holding.update((i, (index, values)) for i in ids)
        return holding

    def note_draws(self, before: GeneratorStates, after: GeneratorStates) -> None:
        """A jointly stepped class's step drew from generators at the end of backward: their
        states ``before`` and ``after`` it."""
        self._draws = before, after

    def undo_draws(self) -> None:
        """For a rollback (see :meth:`rolled_back`): set the generators a jointly stepped class
        drew from at the end of backward back to their states before, unless they changed
        since (the plain optimizer, its step never run, drew nothing). See [Note: random
        numbers drawn jointly] in ``_engine.py``."""
        if self._draws is not None and not self._draws[1].advanced():
            self._draws[0].restore()

    def refuse_draws(self) -> None:
        """Raise for ``step()`` when a generator a jointly stepped class drew from at the end
        of backward was drawn from since. See [Note: random numbers drawn jointly] in
        ``_engine.py``."""
        if self._draws is None:
            return
        advanced = self._draws[1].advanced()
        if not advanced:
            return
        raise RuntimeError(
            "step(): the wrapped optimizer's step draws random numbers (SGLD's noise) from "
            f"{' and '.join(advanced)}; stepped jointly (its class is not declared), it drew "
            "them at the end of backward, and the loop drew from the same generator between "
            "backward and step() (a torch.rand for a decision, an augmentation, a dropout "
            "forward for logging or an evaluation in train mode). A plain optimizer's step() "
            "draws after the loop's draws; here the class drew before them, so the update's "
            "random numbers and the loop's both differ from the plain loop's. Draw after "
            "step() or before backward (an evaluation forward under model.eval() draws "
            "nothing), or give the loop's draws a torch.Generator of their own "
            "(torch.rand(..., generator=g)); or use the plain optimizer. This step's update "
            "is made: restart from the last checkpoint."
        )

    def _replaced(self, converted: bool = False) -> list[bool]:
        """Whether each parameter's storage was swapped since its update for other values
        (``p.data = backup``). A swap for the values the update was written into (a layout
        conversion, ``p.data = p.data.clone()``, a device round trip) carries the update; with
        ``converted``, so does a dtype conversion (see :func:`_carries`).
        Values are compared only where a storage was swapped (a host sync on an
        accelerator); a meta or fake tensor's, which cannot be read, count as other. See
        [Note: data swapped by assignment] in ``_torch_internals.py``."""
        swapped = list(map(operator.is_not, storages(self._params), storages(self._held)))
        if not any(swapped):
            return swapped
        return [
            was_swapped and not _carries(held, param, converted)
            for was_swapped, held, param in zip(swapped, self._held, self._params, strict=True)
        ]

    def refuse_swapped(self) -> None:
        """Raise for ``step()`` when a parameter updated in backward had its storage swapped
        since for other values (``p.data = backup``); see :meth:`_replaced`."""
        replaced = self._replaced()
        if not any(replaced):
            return
        swapped = [param for param, r in zip(self._params, replaced, strict=True) if r]
        more = f" (and {len(swapped) - 1} more)" if len(swapped) > 1 else ""
        raise RuntimeError(
            f"step(): {describe(swapped[0])}{more} was updated in backward, and its data was "
            "replaced since by other values (p.data = backup, a module conversion such as "
            ".half(), or load_state_dict() under "
            "torch.__future__.set_swap_module_params_on_conversion(True), between backward "
            "and step()). A plain optimizer would step the new data "
            "with the gradient; here the gradient was stepped in backward into the data that was "
            "replaced, so that update is lost. Replace parameters' data before backward or "
            "after step(). A loop that takes the gradient at perturbed weights and steps the "
            "restored ones (SAM's second step, AWP or FGM restoring the weights) needs the "
            "gradient held until step(): run that backward under optim.accumulate() too, "
            "restore the weights, then call step(), which steps the held gradients (or use "
            "the plain optimizer). Restart from the last checkpoint."
        )

    def changed(self, state: dict[torch.Tensor, dict]) -> list[torch.Tensor]:
        """The parameters written in place since their update, or whose optimizer state was
        (``model.load_state_dict``, an in-place edit between backward and ``step()``).
        Updates of a backward that raised (never settled) by the parameters' own counters
        only, as they were when each update was made."""
        written = [] if self._written is None else self._written.written(state)
        settled = 0 if self._written is None else len(self._written)
        moved = self._unsettled_written(settled)
        return written + [p for p, w in zip(self._params[settled:], moved, strict=True) if w]

    def _unsettled_written(self, settled: int) -> list[bool]:
        """Whether each parameter after the first ``settled`` (updated by a backward that
        raised, never settled) was written in place since its update was recorded."""
        return list(
            map(operator.ne, [p._version for p in self._params[settled:]], self._added[settled:])
        )

    def wrote_after(self, address: int, version: int) -> bool:
        """Whether an update here wrote into the memory at ``address`` (a storage's
        ``data_ptr()``) after that memory's version counter read ``version``: each update is
        noted with its parameter's version once written (``add``), and the alias held then
        holds the storage it was written into."""
        return any(
            written > version and storage.data_ptr() == address
            for storage, written in zip(storages(self._held), self._added, strict=True)
        )

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._ids

    def standing(self) -> list[torch.Tensor]:
        """The parameters whose update still stands: neither written in place since nor
        their data replaced for other values (a model restored, as :meth:`rolled_back`
        tells)."""
        undone = self._overwritten()
        return [param for param, gone in zip(self._params, undone, strict=True) if not gone]

    def _overwritten(self, converted: bool = False) -> list[bool]:
        """Whether each parameter was written in place since its update, or its data replaced
        for other values (with ``converted``, a dtype conversion is not other values)."""
        settled = [] if self._written is None else self._written.rewritten()
        written = settled + self._unsettled_written(len(settled))
        return list(map(operator.or_, written, self._replaced(converted=converted)))

    def params(self) -> list[torch.Tensor]:
        return list(self._params)

    def mark_unfinished(self, unfinished: bool) -> None:
        self._unfinished = unfinished

    def commit(self) -> None:
        """``step()``: the pending updates are the step's, as the plain optimizer's would be."""
        _FORWARD_READS.unwatch(self)
        self._params.clear()
        self._added.clear()
        self._held.clear()
        self._ids.clear()
        self._written = None
        self._groups.clear()
        self._unsettled = None
        self._loaded = False
        self._unfinished = False
        self._gathered = []
        self._buffers.clear()
        self._draws = None

    def refused_reads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` whose update awaits ``step()``, unless a rollback (the
        optimizer's state loaded too) restored them: what a forward or a save must not read."""
        read = [param for param in params if id(param) in self._ids]
        if read and self._loaded:  # a rollback: the restored weights are the plain loop's
            restored = self._overwritten(converted=True)
            gone = {id(p) for p, undone in zip(self._params, restored, strict=True) if undone}
            read = [param for param in read if id(param) not in gone]
        return read

    def refuse_read(self, module: nn.Module) -> None:
        """Raise for a forward of ``module`` (outside backward) that reads a parameter whose
        update stands. See [Note: a forward between backward and step()]."""
        read = self.refused_reads(params_read_by(module, self._ids, self.gathered_when_updated()))
        if not read:
            return
        standing = {id(p) for p in self.standing()}
        written = [p for p in read if id(p) not in standing]
        if written:
            raise RuntimeError(
                f"this forward of {type(module).__name__} reads {describe(written[0])}, which was "
                "updated in backward with no optimizer.step() since and then written (a "
                "load, an in-place edit, its data replaced or converted). A plain loop's "
                "forward here reads the written weights of before the update; this one "
                "would read them written over the update, unless the write restored them. "
                "The forward was not run. To roll the backward back, load the optimizer's "
                "state too (model and optimizer from one checkpoint), then run this forward "
                "and zero_grad(); otherwise write parameters before backward or after step()."
            )
        more = f" (and {len(read) - 1} more)" if len(read) > 1 else ""
        raise RuntimeError(
            f"this forward of {type(module).__name__} reads {describe(read[0])}{more}, which "
            "was updated in backward with no optimizer.step() since. A plain optimizer "
            "updates it at step(), so the plain loop's forward here reads the weights of "
            "before the update; this one would read the updated weights. The forward was "
            "not run. Call optim.step() first: evaluate, log, or update an EMA teacher after "
            "step() (after a loop that stopped after a backward too). If that backward was "
            "not meant to update these parameters yet, it already did: change the loop and "
            "restart from the last checkpoint. Run every backward but the last of a step "
            "under `with optim.accumulate():` (micro-batches of plain-style accumulation, a "
            "second loss; a torch.distributed.pipelining schedule: schedule.step() under "
            "it); freeze the parameters another model's loss flows through for its backward "
            "(a GAN's discriminator under the generator's loss: requires_grad_(False)); take "
            "an input's gradient (an adversarial example) with torch.autograd.grad(loss, "
            "inputs) or backward(inputs=[...]), which leave the parameters alone."
        )

    def gathered_since(self, gathered: list[FSDPUnit]) -> list[FSDPUnit]:
        """The units of ``gathered`` (those holding all-gathered weights now) that hold updates
        and did not hold such weights when they were updated. See [Note: copies gathered
        before step()]."""
        then = self.gathered_when_updated()
        return [unit for unit in gathered if id(unit.group) not in then and self._updated(unit)]

    def gathered_when_updated(self) -> set[int]:
        """The FSDP2 units (by ``id`` of their group) that held all-gathered weights when the
        backwards since ``step()`` updated them: their copies hold the weights of before."""
        return {id(unit.group) for unit in self._gathered}

    def _updated(self, unit: FSDPUnit) -> bool:
        """Whether ``unit`` holds a parameter updated in backward since ``step()``."""
        return any(id(p) in self._ids for p in unit.params)

    def refuse_unreduced(self, units: list[FSDPUnit]) -> None:
        """Raise for ``step()`` when an FSDP2 unit of ``units`` holds gradients it has not
        reduced: a backward with gradient sync off ran after the backward whose updates were
        made, on the updated weights, where the plain loop's ran on those of before
        ``step()``."""
        # A unit holding no update has nothing to refuse: its unreduced gradients (an HSDP
        # branch used in an early micro-batch only) wait for its next reducing backward, in
        # the plain loop too.
        unreduced = [u for u in units if self._updated(u) and u.holds_unreduced_gradients()]
        if unreduced:
            raise RuntimeError(
                "step(): a backward with FSDP2 gradient sync off "
                "(set_requires_gradient_sync(False), or HSDP's set_requires_all_reduce(False)) "
                "ran after a backward whose updates were "
                f"made (the unit holding {describe(unreduced[0].params[0])} holds its "
                "unreduced gradients): its forward ran on the updated weights, where a plain "
                "optimizer's ran on those of before step(). Turn sync off for the micro-batches "
                "before the last of a step, not after it "
                "(set_requires_gradient_sync(i == last)). Restart from the last checkpoint. "
                "(After a backward that raised, FSDP2's reset_iter_state() keeps the gradients "
                "a unit had not reduced, which its next reduction adds in: restart from the "
                "last checkpoint there too.)"
            )

    def refuse_second_gradient(self, param: torch.Tensor) -> None:
        """Raise for a gradient arriving at ``param``, updated in backward since ``step()``."""
        raise RuntimeError(
            f"{describe(param)} received a gradient after it was already updated in an earlier "
            "backward, with no optimizer.step() in between. A plain optimizer would step the "
            "sum of both gradients at step(); this one updates each parameter as its gradient "
            "arrives, so it stops here instead of updating twice. Run every backward but the "
            "last of a step under `with optim.accumulate():` (two losses, micro-batches), or "
            "sum the losses and call backward() once, and call optim.step() once per step. A "
            "torch.distributed.pipelining schedule runs a backward per micro-batch: call "
            "schedule.step() under `with optim.accumulate():` (or shard the stages with "
            "fully_shard, whose gradients the schedule reduces after its last backward). If "
            "this gradient comes from another model's loss (a GAN generator's loss flowing "
            "through the discriminator), freeze these parameters for that backward "
            "(requires_grad_(False)) or run it under this optimizer's accumulate() and drop "
            "the gradients with zero_grad(). If the earlier backward only wanted an input's "
            "gradient (an adversarial example, its parameter gradients then dropped), it "
            "already updated the parameters: take that gradient with "
            "torch.autograd.grad(loss, inputs) or backward(inputs=[...]), which leave the "
            "parameters alone."
        )

    def refuse_changed_groups(
        self,
        param_groups: list[dict[str, Any]],
        read: Callable[[dict[str, Any]], Collection[str] | None],
    ) -> None:
        """Raise for ``step()`` when a parameter updated in backward would now be stepped with
        other group values than its update was made with: a value of its group (``lr``,
        betas, ...) changed, in place or by replacing the group's dict; the parameter moved to
        a group with other values; or it left ``param_groups``, where the plain optimizer
        would not step it at all. ``read(group)``: the keys the group's class reads, or
        ``None`` if unknown (every key is compared then). After a backward that raised
        (never settled), every group's values are compared with those noted at its first
        update."""
        now = self._holding_groups(param_groups)
        for param in self._params:
            then = self._groups.get(id(param))
            if then is None:
                continue
            if id(param) not in now:
                raise RuntimeError(
                    f"step(): {describe(param)} was updated in backward and removed from "
                    "param_groups before this step(). A plain optimizer would not step it; "
                    "here its update was made in backward and cannot be undone. Change "
                    "param_groups before backward or after step(), and restart from the last "
                    "checkpoint."
                )
            (index, values), (index_now, values_now) = then, now[id(param)]
            changed = _changed_keys(values, values_now, read(param_groups[index_now]))
            if not changed:
                continue
            raise _changed_group_error(
                f"param_groups[{index}][{changed[0]!r}] was changed"
                if index == index_now
                else f"{describe(param)} moved from param_groups[{index}] to "
                f"param_groups[{index_now}], whose {changed[0]!r} differs,"
            )
        if self._unsettled is not None:
            # A backward that raised also holds the buckets of a class stepped jointly, with
            # the values of its start, to be stepped when it is finished: every group counts.
            for index, then_values in enumerate(self._unsettled[: len(param_groups)]):
                group = param_groups[index]
                changed = _changed_keys(then_values, _values(group), read(group))
                if changed:
                    raise _changed_group_error(f"param_groups[{index}][{changed[0]!r}] was changed")

    def refuse_changed(self, changed: list[torch.Tensor]) -> None:
        """Raise for ``step()`` when ``changed``, updated in backward, were written since."""
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise RuntimeError(
            f"step(): {describe(changed[0])}{more} was updated in backward, and it or its "
            "optimizer state was written in place since (model.load_state_dict(), a "
            "checkpoint load, an in-place edit of the parameter or of optimizer.state between "
            "backward and step()?). A plain optimizer would step the written values with the "
            "gradient; here the gradient was stepped in backward, before the write, which "
            "replaced or changed its update. Load checkpoints and edit parameters or state "
            "before backward or after step(). Restart from the last checkpoint."
        )

    def loaded(self) -> None:
        """``load_state_dict()`` while updates are pending: ``step()`` will refuse, and
        ``zero_grad()`` discard them only once the model was restored too (a rollback)."""
        self._loaded = True

    def rolled_back(self) -> bool:
        """Whether the pending updates were overwritten: the optimizer's state loaded and
        every updated parameter written since, in place or by replacing its data for other
        values (the checkpoint the plain loop would restore and then drop its gradients, as
        ``zero_grad()`` here; data converted, which still holds the update, is not
        restored)."""
        # A dtype conversion keeps the update (rounded): not a restore. (At step() it is
        # refused all the same, as the plain optimizer steps the converted data.)
        return self._loaded and all(self._overwritten(converted=True))

    def refuse_snapshot(self, what: str) -> None:
        """Raise for ``state_dict()``, a deep copy or a pickle of the optimizer (``what``)
        while updates made in backward await ``step()``, unless the state was loaded since
        (a rollback: the state is then the loaded one, as the plain optimizer's)."""
        if self._loaded:
            return
        raise RuntimeError(
            f"{what}: {len(self._ids)} parameter(s) hold updates made in backward that await "
            f"step(). A plain optimizer's {what} here would hold the state before this step's "
            "update (and the model its weights before it); here both already hold the "
            "update, so a checkpoint or copy taken now would resume from another point than "
            "the plain loop's. Take it after step() (or before backward)."
        )

    def refuse_loaded(self) -> None:
        """Raise for ``step()`` when the optimizer's state was loaded since the updates."""
        if self._loaded:
            raise RuntimeError(
                f"step(): the optimizer state was loaded while {len(self._ids)} parameter(s) "
                "held updates made in backward. A plain optimizer would step the loaded state "
                "with this backward's gradients; here they were already stepped with the state "
                "before. Load before backward or after step(); to roll this backward back, "
                "load the checkpoint into both the model and the optimizer, then zero_grad()."
            )

    def refuse_dropped(self, dropped: list[torch.Tensor]) -> None:
        """Raise for ``step()`` when the gradients of ``dropped``, updated in backward, were
        dropped or replaced since (see [Note: freed gradients])."""
        more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
        raise RuntimeError(
            f"step(): {describe(dropped[0])}{more} was updated in backward, and its gradient "
            "was dropped or replaced before this step() (model.zero_grad() between backward "
            "and step()?). A plain optimizer would step no gradient there, or the new one, "
            "but the update already happened in backward and cannot be undone. Drop "
            "gradients only after step(); if a backward must not train these parameters, "
            "freeze them for it (requires_grad_(False)) or run it under this optimizer's "
            "accumulate(). Restart from the last checkpoint."
        )

    def refuse_discard(self, skip_nonfinite: bool) -> None:
        """Raise for ``zero_grad()`` while updates are pending (``skip_nonfinite``: the
        optimizer's option, whose skips are not read back to tell a skipped update)."""
        count = len(self._ids)
        if self._unfinished:
            cause = (
                "A backward raised after updating them: a plain optimizer would discard that "
                "backward's gradients, but these updates cannot be undone. Call optim.step() to "
                "keep them and step the gradients that arrived but were not stepped yet (the "
                "plain optimizer stepping the partial gradients), then zero_grad(); or, to roll "
                "back, load the last checkpoint into both the model and the optimizer, then "
                "zero_grad()."
            )
        else:
            cause = (
                "A plain optimizer would discard their gradients here, but they were already "
                "stepped in backward. Call optim.step() after the backward whose gradients "
                "should train; if a backward's gradients must not train these parameters (a "
                "GAN generator's loss flowing through the discriminator), freeze them for it "
                "(requires_grad_(False)) or run it under this optimizer's accumulate()."
            )
            if skip_nonfinite:
                cause += (
                    " With skip_nonfinite, a batch whose gradients were not finite was skipped "
                    "where it was stepped (on the device, not read back): call step() after "
                    "it too, which moves nothing more."
                )
        raise RuntimeError(
            f"zero_grad() called while {count} parameter(s) hold updates made in backward "
            f"with no optimizer.step() since. {cause}"
        )


class _ForwardReads:
    """Refuses a forward that reads a parameter updated in backward before ``step()``.

    [Note: a forward between backward and step()]
    The plain loop's parameters move at ``step()``; a forward between backward and ``step()``
    (an evaluation or a logged loss, a second micro-batch's forward in plain-style accumulation,
    a discriminator's forward after a generator's backward stepped it, and the BatchNorm
    statistics or pruning mask such a forward leaves behind) computes with the weights of before
    it. Here the update was made in backward, and that forward would read the updated weights:
    another result, no error (an evaluation after a loop that stopped after a backward too). A
    module's forward is marked: while an optimizer holds updates awaiting ``step()``, a global
    forward pre-hook (``register_module_forward_pre_hook``, registered only then, about 2.5 us a
    step to add and remove, measured on the CPU: the usual loop runs no forward there) raises
    before the forward of a module holding such a parameter starts, or written since its update
    (an in-place edit, a load, its data replaced: the plain loop's forward reads the write over
    the weights of before the update, this one the write over the update, the same only where
    the write restored them), unless the optimizer's state was loaded too: a rollback, whose
    restored weights are the plain loop's. An FSDP2 module is checked for the parameters of its
    units, as its forward gathers them; a unit that held all-gathered weights when it was
    updated (``set_reshard_after_backward(False)``) and still holds them is read as the plain
    loop reads it, from before the update. A forward in backward (activation checkpointing's
    recomputation) reads parameters whose gradients have not arrived yet, and is not checked.
    A ``torch.compile``d forward runs the same check outside its graph (which breaks at each
    module's hook while the hook is registered, between backward and ``step()``).
    Reads outside a module's forward (``p.detach()``, ``torch._foreach_lerp_`` over the
    parameters: most EMA updates) are not marked and go unseen (docs/differences.md). Once the
    optimizer is collected or detached holding updates, a forward reading them is refused
    by the same kind of hook: see [Note: updates left uncommitted] in ``_left_updates.py``.
    """

    def __init__(self) -> None:
        # id -> a weak reference to each PendingUpdates holding updates: one whose optimizer
        # was collected is dropped as it goes, and the hook with the last one.
        self._watched: dict[int, weakref.ref[PendingUpdates]] = {}
        self._handle: RemovableHandle | None = None
        # Traced by Dynamo, the check runs outside the graph: Dynamo would guard on the
        # watched optimizers, which their collection changes at any time (see [Note: updates
        # left uncommitted] in ``_left_updates.py``).
        self._check_outside_graph = torch.compiler.disable(
            self._check,
            reason="fused_optim_dist: updates made in backward await step(); forwards are "
            "checked outside the graph until then",
        )

    def watch(self, pending: PendingUpdates) -> None:
        key = id(pending)
        self._watched[key] = weakref.ref(pending, lambda _ref: self._drop(key))
        if self._handle is None:
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._refuse_read)

    def unwatch(self, pending: PendingUpdates) -> None:
        self._drop(id(pending))

    def _drop(self, key: int) -> None:
        self._watched.pop(key, None)
        if not self._watched and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _refuse_read(self, module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            self._check_outside_graph(module)
        else:
            self._check(module)

    def _check(self, module: nn.Module) -> None:
        if current_backward_id() != -1:
            return
        for ref in list(self._watched.values()):
            pending = ref()
            if pending is not None:
                pending.refuse_read(module)


_FORWARD_READS = _ForwardReads()


class StaleCopies:
    """Refuses a forward that would run on weights FSDP2 gathered before ``step()``.

    [Note: copies gathered before step()]
    An all-gather between backward and ``step()`` (``model.unshard()``, a forward) reads the
    plain optimizer's weights before its update; FSDP2 does not gather an unsharded unit
    again, so the plain loop's next forward runs on that copy, unless the unit is resharded
    first (``model.reshard()``, ``model.state_dict()``). Here the update was made in backward
    and the copy holds it. Whether the copy is used is known only at the unit's next
    forward: ``step()`` hands the units gathered since their updates to :meth:`watch`, and a
    forward pre-hook on each unit's modules raises at that forward if the unit still holds a
    gathered copy (nothing has read it yet), and otherwise removes itself. A unit that held
    gathered weights when it was updated (``set_reshard_after_backward(False)``) holds the
    weights of before the update in both loops, and is not watched; one gathered later in
    backward (``unshard()`` from a hook that runs after the unit was reduced) holds the
    updated weights, and is, as for a gather after backward. So is a unit FSDP2 prefetches in
    backward by the order of an earlier forward, which it keeps when the backwards before
    ``step()`` are marked ``set_is_last_backward(False)`` (its final callback clears it only
    after a last backward): the plain loop's next forward runs on a copy of the weights
    before the last step (measured, a 6-unit MLP on 2 ranks: 2.0e-3 from the loop with the
    flag left on).
    """

    def __init__(self) -> None:
        self._handles: dict[int, list[RemovableHandle]] = {}

    def watch(self, units: list[FSDPUnit]) -> None:
        for unit in units:
            if id(unit.group) in self._handles:
                continue
            hook = functools.partial(self._check, unit)
            self._handles[id(unit.group)] = [
                module.register_forward_pre_hook(hook, prepend=True) for module in unit.modules
            ]

    def _check(self, unit: FSDPUnit, _module: nn.Module, _args: Any) -> None:
        for handle in self._handles.pop(id(unit.group), []):
            handle.remove()
        if unit.holds_gathered_copy():
            raise RuntimeError(
                f"this forward would run on the weights FSDP2 all-gathered for the unit holding "
                f"{describe(unit.params[0])} after its update in backward and before "
                "optim.step() (model.unshard(), or a forward, between backward and step(); "
                "unshard() from a hook in backward; FSDP2's backward prefetch by the order of "
                "an earlier forward, kept by set_is_last_backward(False) before a backward "
                "that step() follows): a plain optimizer's copy holds the "
                "weights of before step(), on which its forward would run (FSDP2 does not "
                "gather an unsharded unit again); here it holds the updated ones. Call "
                "model.unshard() and run forwards after step(), or model.reshard() before "
                "step(). Restart from the last checkpoint."
            )
