"""PyTorch Lightning with ``OptimizerInBackward``: ``accumulate_grad_batches``, and clipping and
loss scaling refused before anything moves.

``configure_optimizers`` returns ``OptimizerInBackward`` unchanged: Lightning's automatic
optimization calls ``optimizer.step(closure)``, which runs the closure's backward (stepping the
parameters in it) and commits. Three Trainer options act outside ``step()``; the callback here
makes the first exact and refuses the other two at the start of ``fit``::

    from fused_optim_dist.integrations.lightning import InBackward

    trainer = lightning.Trainer(accumulate_grad_batches=4, callbacks=[InBackward()])

* ``accumulate_grad_batches``: Lightning runs the backward of each micro-batch but the last of
  a window with no ``step()``; a plain optimizer steps their sum. The callback runs those
  backwards under :meth:`OptimizerInBackward.accumulate`, so the last one steps the sum.
  Without it the second micro-batch is refused (a second gradient before ``step()``), after
  the first one's backward stepped.
* ``gradient_clip_val`` reads the gradients after the closure, which here were stepped and
  freed in backward (the read raises, after the first backward moved the parameters). The
  callback refuses it in ``on_fit_start``, before any step: set ``max_grad_norm=`` (Lightning's
  default ``gradient_clip_algorithm="norm"``) or ``clip_grad_value=`` (``"value"``) on the
  optimizer instead.
* ``precision="16-mixed"`` (on GPUs; on the CPU Lightning runs ``"bf16-mixed"`` instead) scales
  the loss with a ``GradScaler``, which unscales and checks the gradients after the closure:
  its ``unscale_`` raises, after the first backward stepped scaled gradients. The callback
  refuses an enabled scaler in ``on_fit_start``, naming ``"bf16-mixed"`` and
  ``skip_nonfinite=True``.

A fit's optimizers step its parameters in backward only while that fit runs: the callback
detaches them when the fit ends, however it ends (:meth:`OptimizerInBackward.detach`, state
kept), and attaches them again when a fit starts. Lightning builds a new optimizer at every
fit (``configure_optimizers``); the last fit's, still referenced by the Trainer, held the
parameters' hooks, and the next fit on the same module (``Tuner(trainer).lr_find(...)`` then
``trainer.fit(...)``, the same Trainer's ``fit`` again, a second Trainer) was refused as a
second optimizer in backward, where the plain ones train.

Which micro-batch ends a window is Lightning's to decide (every ``accumulate_grad_batches``-th
batch, and the epoch's last). The callback accumulates every batch but the
``accumulate_grad_batches``-th ones and the epoch's last where Lightning knows it
(``trainer.num_training_batches``): where Lightning steps after a backward the callback
accumulated (an epoch of unknown length ending inside a window), ``step()`` steps the held sum,
exactly as the plain optimizer, only without releasing those gradients early; the other way
round cannot happen but would be refused, never stepped twice.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import lightning

from fused_optim_dist.integrations._loss_scaling import refuse_loss_scaling
from fused_optim_dist.optimizer import OptimizerInBackward


def _in_backward(trainer: lightning.Trainer) -> list[OptimizerInBackward]:
    return [o for o in trainer.optimizers if isinstance(o, OptimizerInBackward)]


class InBackward(lightning.Callback):
    """Run Lightning's accumulation micro-batches under ``optim.accumulate()`` and refuse
    ``gradient_clip_val`` and loss scaling for ``OptimizerInBackward`` (see the module's
    docstring)."""

    def __init__(self) -> None:
        self._accumulating = False
        self._contexts = contextlib.ExitStack()

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        optims = _in_backward(trainer)
        if not optims:
            return
        for optim in optims:
            optim.attach()  # detached by the fit before that used it (see the module's docstring)
        refuse_loss_scaling(trainer.precision_plugin, "Trainer")
        if trainer.gradient_clip_val:
            raise ValueError(
                "Trainer(gradient_clip_val=...) clips gradients after the backward, but "
                "OptimizerInBackward steps and frees them during it: set "
                "max_grad_norm=... (gradient_clip_algorithm='norm') or clip_grad_value=... "
                "('value') on OptimizerInBackward and leave gradient_clip_val unset"
            )

    def on_train_batch_start(
        self, trainer: lightning.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._contexts.close()  # left open by a backward that raised
        window = trainer.accumulate_grad_batches
        last = trainer.num_training_batches
        ends_window = (batch_idx + 1) % window == 0
        ends_epoch = not math.isinf(last) and batch_idx + 1 == last
        self._accumulating = window > 1 and not (ends_window or ends_epoch)

    def on_before_backward(self, trainer: lightning.Trainer, pl_module: Any, loss: Any) -> None:
        if self._accumulating:
            for optim in _in_backward(trainer):
                self._contexts.enter_context(optim.accumulate())

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        self._contexts.close()

    def teardown(self, trainer: lightning.Trainer, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._detach(trainer)

    def on_exception(
        self, trainer: lightning.Trainer, pl_module: Any, exception: BaseException
    ) -> None:
        self._contexts.close()
        self._detach(trainer)

    def _detach(self, trainer: lightning.Trainer) -> None:
        for optim in _in_backward(trainer):
            optim.detach()
