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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["PendingUpdates", "describe"]


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
