"""Updates made in backward that no ``step()`` will commit: their optimizer was collected, or
detached, after a backward.

[Note: updates left uncommitted]
A loop that leaves an optimizer after a backward with no ``step()`` (a step budget checked
after backward, then an evaluation, a save, or a new optimizer for the next phase; the old
one deleted, or detached) never applies that backward's gradients with a plain optimizer: its
weights stay those of before that backward, and a next ``zero_grad()`` drops the gradients.
Here they were applied in backward. While the optimizer lives, its pending updates refuse
what would read them ([Note: the step protocol] in ``_protocol.py``); once it is collected or
detached, the parameters whose updates still stand are noted here, weakly, with what a write
into them changes (their version counter, and their values' storage), and:

* an ``OptimizerInBackward`` built over one of them (or given it in a group, or attached to
  it) is refused before it steps anything (the next phase trained on from other weights
  before: AdamW 1.9e-2 apart after three more steps, RMSprop 0.16, no error);
* a module's forward reading one of them (an evaluation, once the loop's function returned
  and its optimizer was collected) is refused before it runs, by a global forward pre-hook
  registered while any is noted, as a forward between backward and ``step()`` is refused
  while the optimizer lives ([Note: a forward between backward and step()] in
  ``_protocol.py``): it read the updated weights before, a validation loss of 0.886 where
  the plain loop's is 0.888, with a warning at the optimizer's collection all there was.

The hook costs a module holding none of them a dictionary lookup per parameter. Traced by
Dynamo (a ``torch.compile``d forward) it reads one flag (``_armed``), set while any is noted,
and while it is set calls the same check outside the graph (``torch.compiler.disable``): a
compiled evaluation is refused as an eager one is, and a module compiled meanwhile breaks its
graph at each module's hook (it runs, its results the same) until none is noted. Dynamo
guards on the flag's value, so a model compiles again when it changes, and must guard on
nothing else here: reading the records in the traced hook made it guard on them, and the
garbage collector drops a record as its parameter goes, at any time, a compilation's
included (torch 2.13 then failed the compilation: an ``InternalTorchDynamoError``, a
``KeyError`` for the record, seen in a full run). The flag is set when a parameter is noted,
and cleared by the loop's calls and the eager checks once none is; the hook is removed only
from the loop's calls (Dynamo guards on the hooks it traced: removed from a collector's
callback while a model compiled, it failed the compilation the same way). As with any
global hook, a model compiled before it came, or before it went, compiles again.

A parameter written since is forgotten: the weights of before that backward loaded (in place
or through ``.data``), the plain loop's, or the weights loaded as they are, to keep the
update. So is one whose optimizer's ``step()`` committed the update (a detached optimizer's
``step()`` still does) or that it drives again (``attach()``), and one that was collected.
Once none is noted, the hook goes at the loop's next ``step()`` or construction of an
``OptimizerInBackward``; until then it finds nothing to refuse. This library's saves of them
(``checkpoint.save``, ``export_weights``) are refused too (``uncommitted_weights_error`` in
``optimizer.py``); other reads outside a module's forward (``torch.save(model.state_dict())``)
go unseen, and the warning at the optimizer's collection names them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fused_optim_dist._protocol import PendingUpdates, describe, params_read_by
from fused_optim_dist._torch_internals import current_backward_id, holds_values, local_tensor

__all__ = ["LEFT_UPDATES", "LeftUpdates"]


def _written_state(param: torch.Tensor) -> tuple[int, int]:
    """What a write into ``param`` changes: its version counter (in-place writes,
    ``load_state_dict``) or its storage (``p.data = saved``)."""
    local = local_tensor(param)
    address = local.untyped_storage().data_ptr() if holds_values(local) else 0
    return param._version, address


class _Left(NamedTuple):
    param: weakref.ref[torch.Tensor]
    written: tuple[int, int]


class LeftUpdates:
    """The parameters holding updates left uncommitted. See [Note: updates left
    uncommitted]."""

    def __init__(self) -> None:
        # id(param) -> the parameter, weakly (a model must not be kept alive for this), and its
        # written state when it was left.
        self._left: dict[int, _Left] = {}
        # The FSDP2 units (by id of their param group) that held all-gathered weights when the
        # left updates were made: their copies are of before them.
        self._gathered: set[int] = set()
        self._handle: RemovableHandle | None = None
        # Whether a compiled forward's hook checks, outside its graph: see the note.
        self._armed = False
        self._check_outside_graph = torch.compiler.disable(
            self._check,
            reason="fused_optim_dist: parameters alive in this process hold updates made in "
            "backward that no step() committed (a loop that stopped after a backward); forwards "
            "are checked outside the graph until those parameters are loaded or collected",
        )

    def leave(self, pending: PendingUpdates) -> None:
        """Note the parameters of ``pending`` whose updates still stand."""
        for param in pending.standing():
            key = id(param)
            self._left[key] = _Left(
                weakref.ref(param, functools.partial(self._collected, key)),
                _written_state(param),
            )
        self._gathered |= pending.gathered_when_updated()
        if self._left and self._handle is None:
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._refuse_read)
        self._armed = bool(self._left)

    def forget(self, pending: PendingUpdates) -> None:
        """The updates of ``pending`` are committed, rolled back, or driven again."""
        if self._left:
            for param in pending.params():
                self._left.pop(id(param), None)
        self._remove_hook_if_idle()

    def refuse_driven(self, params: Iterable[torch.Tensor]) -> None:
        """Raise if one of ``params`` still holds an update left uncommitted: an
        ``OptimizerInBackward`` is about to drive it."""
        for param in params:
            if self.holds(param):
                raise ValueError(
                    f"{describe(param)} holds an update another OptimizerInBackward made in "
                    "backward that no step() committed: that optimizer was left after a "
                    "backward (deleted or detached; a step budget checked after backward?). A "
                    "plain optimizer never applies those gradients (the next zero_grad() drops "
                    "them), so training on from these weights would differ from the plain "
                    "loop. Call step() on that optimizer before leaving it to keep the update, "
                    "or load the weights of before that backward; end a phase before its "
                    "backward, not after it."
                )
        self._remove_hook_if_idle()

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` holds an update left uncommitted, unwritten since."""
        left = self._left.get(id(param))
        if left is None:
            return False
        if left.param() is param and _written_state(param) == left.written:
            return True
        del self._left[id(param)]
        return False

    def _collected(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        left = self._left.get(key)
        if left is not None and left.param is ref:
            del self._left[key]

    def _remove_hook_if_idle(self) -> None:
        """Forget the parameters written since, and remove the hook once nothing is noted:
        from the loop's own calls only (``step()``, a construction), never from a garbage
        collector's callback (a parameter collected), which may run while Dynamo compiles a
        module whose guards name the hook (torch 2.13: an ``InternalTorchDynamoError``, a
        ``KeyError`` for the hook removed, seen in a full run); nor while compiling."""
        for left in list(self._left.values()):
            param = left.param()
            if param is not None:
                self.holds(param)
        self._armed = bool(self._left)
        if self._handle is not None and not self._left and not torch.compiler.is_compiling():
            self._handle.remove()
            self._handle = None
            self._gathered.clear()

    def _refuse_read(self, module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():  # Dynamo guards on the flag alone: see the note
            if self._armed:
                self._check_outside_graph(module)
            return
        self._check(module)

    def _check(self, module: nn.Module) -> None:
        read = [p for p in params_read_by(module, self._left, self._gathered) if self.holds(p)]
        self._armed = bool(self._left)
        if not read or current_backward_id() != -1:  # none, or a forward recomputed in backward
            return
        more = f" (and {len(read) - 1} more)" if len(read) > 1 else ""
        raise RuntimeError(
            f"this forward of {type(module).__name__} reads {describe(read[0])}{more}, which "
            "holds an update an OptimizerInBackward made in backward that no step() "
            "committed: that optimizer was collected or detached after a backward (a loop "
            "that stopped after a backward: a step budget checked after backward?). A plain "
            "optimizer never applies that backward's gradients, so the plain loop's forward "
            "here reads the weights of before it; this one would read the updated weights. The "
            "forward was not run. Load the weights of before that backward (the last "
            "checkpoint) to go on as the plain loop would, or load these weights as they are "
            "(model.load_state_dict(model.state_dict())) to keep the update; end a loop before "
            "a backward, or call step() after it."
        )


LEFT_UPDATES = LeftUpdates()
