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
  cannot be undone. ``step()`` first accepts them.

Updates made by ``step()`` itself are committed at once. Parameters are held strongly, and only
until the next ``step()``: their identity, never a recycled ``id()``, names them.

[Note: gradients kept as zeros]
``zero_grad(set_to_none=False)`` leaves every gradient the plain optimizer holds in place, as
zeros, and its next ``step()`` steps each of them, gradient or not: a parameter that got no
gradient in the backward between (a branch not taken, an unrouted expert, a frozen layer that
once trained) is stepped with zeros, which still moves it under weight decay, momentum or
Adam's moments. Here its gradient was consumed in backward, so it holds none and would not
move. So once ``zero_grad(set_to_none=False)`` was called, ``step()`` refuses, before it steps
anything itself, when a parameter stepped since the last ``zero_grad()`` that dropped the
gradients got none since the last ``step()``.
A module's ``zero_grad(set_to_none=False)`` meets the freed gradients and is refused there
(see [Note: freed gradients]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["KeptGradients", "PendingUpdates", "describe"]


def describe(param: torch.Tensor) -> str:
    return f"a parameter of shape {tuple(param.shape)}"


class PendingUpdates:
    """The parameters updated in backward since the last ``step()``. See [Note: the step
    protocol]."""

    __slots__ = ("_ids", "_params", "_unfinished")

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        # id -> held in _params, so the ids cannot be recycled while they are here.
        self._ids: set[int] = set()
        # Whether an update belongs to a backward that raised before it finished.
        self._unfinished = False

    def __bool__(self) -> bool:
        return bool(self._ids)

    def add(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            if id(param) not in self._ids:
                self._ids.add(id(param))
                self._params.append(param)

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._ids

    def params(self) -> list[torch.Tensor]:
        return list(self._params)

    def mark_unfinished(self, unfinished: bool) -> None:
        self._unfinished = unfinished

    def commit(self) -> None:
        """``step()``: the pending updates are the step's, as the plain optimizer's would be."""
        self._params.clear()
        self._ids.clear()
        self._unfinished = False

    def refuse_second_gradient(self, param: torch.Tensor) -> None:
        """Raise for a gradient arriving at ``param``, updated in backward since ``step()``."""
        raise RuntimeError(
            f"{describe(param)} received a gradient after it was already updated in an earlier "
            "backward, with no optimizer.step() in between. A plain optimizer would step the "
            "sum of both gradients at step(); this one updates each parameter as its gradient "
            "arrives, so it stops here instead of updating twice. Run every backward but the "
            "last of a step under `with optim.accumulate():` (two losses, micro-batches), or "
            "sum the losses and call backward() once, and call optim.step() once per step. If "
            "this gradient comes from another model's loss (a GAN generator's loss flowing "
            "through the discriminator), freeze these parameters for that backward "
            "(requires_grad_(False)) or run it under this optimizer's accumulate() and drop "
            "the gradients with zero_grad()."
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

    def refuse_discard(self) -> None:
        """Raise for ``zero_grad()`` while updates are pending."""
        count = len(self._ids)
        if self._unfinished:
            cause = (
                "A backward raised after updating them: a plain optimizer would discard that "
                "backward's gradients, but these updates cannot be undone. Call optim.step() to "
                "keep them and step the gradients that arrived but were not stepped yet (the "
                "plain optimizer stepping the partial gradients), then zero_grad(); or restore "
                "the last checkpoint."
            )
        else:
            cause = (
                "A plain optimizer would discard their gradients here, but they were already "
                "stepped in backward. Call optim.step() after the backward whose gradients "
                "should train; if a backward's gradients must not train these parameters (a "
                "GAN generator's loss flowing through the discriminator), freeze them for it "
                "(requires_grad_(False)) or run it under this optimizer's accumulate()."
            )
        raise RuntimeError(
            f"zero_grad() called while {count} parameter(s) hold updates made in backward "
            f"with no optimizer.step() since. {cause}"
        )


class KeptGradients:
    """The parameters the plain optimizer holds a gradient for: those stepped since the last
    ``zero_grad()`` that set the gradients to ``None``; and whether ``zero_grad`` has kept them
    as zeros since. See [Note: gradients kept as zeros]."""

    __slots__ = ("_kept", "_params")

    def __init__(self) -> None:
        # id -> parameter, held so that the ids cannot be recycled.
        self._params: dict[int, torch.Tensor] = {}
        self._kept = False

    def stepped(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            self._params.setdefault(id(param), param)

    def zeroed(self, set_to_none: bool) -> None:
        """``zero_grad(set_to_none)``: the gradients kept as zeros, or dropped."""
        if set_to_none:
            self._params.clear()
        self._kept = not set_to_none

    def refuse_unstepped(self, stepping: Callable[[torch.Tensor], bool]) -> None:
        """Raise if gradients were kept as zeros and one of them would be stepped by the plain
        optimizer but not here (``stepping(param)``: whether this step updates ``param``)."""
        if not self._kept:
            return
        missing = [param for param in self._params.values() if not stepping(param)]
        if not missing:
            return
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RuntimeError(
            f"{describe(missing[0])}{more} got no gradient since the last step(), but "
            "zero_grad(set_to_none=False) kept a zero gradient on it, which a plain optimizer "
            "steps: weight decay, momentum and Adam's moments still move it. This optimizer "
            "consumed its gradient in backward, so it cannot. Call zero_grad() "
            "(set_to_none=True, torch's default) instead: then a parameter without a gradient "
            "is skipped by both. The updates this backward made cannot be undone: fix the "
            "loop and restart from the last checkpoint."
        )
