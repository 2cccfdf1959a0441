"""Hugging Face ``Trainer`` (and its subclasses, TRL's included) stepping in backward.

One line switches a Trainer, or any subclass of it, to an in-backward optimizer::

    from fused_optim_dist.integrations.transformers import in_backward_trainer

    trainer = in_backward_trainer(SFTTrainer)(model=model, args=args, train_dataset=data)

or, for a Trainer subclass of your own, put :class:`InBackwardTrainerMixin` first among its
bases. Everything else is configured as usual, in ``TrainingArguments``:

* The optimizer Trainer would build (``args.optim``, ``optimizer_cls_and_kwargs``, with its
  weight-decay groups) is built as an :class:`~fused_optim_dist.OptimizerInBackward`; one passed
  in ``optimizers=`` must already be one.
* ``gradient_accumulation_steps``: the backward of every micro-batch but the last of a step
  runs under :meth:`~fused_optim_dist.OptimizerInBackward.accumulate`, so each step updates
  once, on the summed gradients.
* ``max_grad_norm`` is the optimizer's in-backward clipping (one value; ``0`` turns it off),
  and the logged ``grad_norm`` is :meth:`~fused_optim_dist.OptimizerInBackward.grad_norm`:
  Trainer's own clipping would run after the gradients were stepped and freed. With several
  FSDP units clipping follows [Note: clipping inside one backward] in
  ``fused_optim_dist/_gradients.py``.
* Checkpoints hold the optimizer state as Trainer saves it and, beside it, the clipping history
  (:meth:`~fused_optim_dist.OptimizerInBackward.gradient_state_dict`); resuming restores both.
* Every trainable parameter of the model must be in the optimizer: Trainer clips and logs the
  norm over all of them, the optimizer over its own. Others are refused before the backward
  (freeze them, or add them to the optimizer).
* Data parallel: FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2}``) is supported;
  DistributedDataParallel, Trainer's default under ``torchrun``, is refused when the Trainer is
  built, before any update.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from fused_optim_dist import InBackwardOptions
from fused_optim_dist._torch_internals import fsdp_units
from fused_optim_dist.integrations.accelerate import (
    check_accelerator,
    hook_swapped_parameters,
    in_backward_optimizer,
)
from fused_optim_dist.optimizer import OptimizerInBackward, in_backward

__all__ = ["GRADIENT_STATE_NAME", "InBackwardTrainerMixin", "in_backward_trainer"]

GRADIENT_STATE_NAME = "in_backward_gradients.json"
"""The file in a Trainer checkpoint holding the clipping history (written by process 0)."""

logger = logging.getLogger(__name__)


def _clip_norm(max_grad_norm: float | None) -> float | None:
    """Trainer clips when ``max_grad_norm > 0``; the optimizer's value for the same meaning."""
    return float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None


def _in_backward_cls_and_kwargs(
    optimizer_cls: Any, kwargs: dict[str, Any], max_grad_norm: float | None
) -> tuple[type[OptimizerInBackward], dict[str, Any]]:
    """Trainer's optimizer class and arguments, as an in-backward class clipping at
    ``max_grad_norm``. A class that is already one keeps the options it was given (checked
    against ``max_grad_norm`` once built)."""
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, OptimizerInBackward):
        if "options" in kwargs or "max_grad_norm" in kwargs:
            return optimizer_cls, kwargs
        return optimizer_cls, {**kwargs, "max_grad_norm": max_grad_norm}
    # Every keyword Trainer passes is the class's own, so ours go in `options`: that keeps them
    # apart even for a class taking an argument named max_grad_norm.
    options = InBackwardOptions(max_grad_norm=max_grad_norm)
    return in_backward(optimizer_cls), {**kwargs, "options": options}


def _check_holds_trainable(optimizer: OptimizerInBackward, model: nn.Module) -> None:
    """Refuse, before the backward, trainable parameters of ``model`` that ``optimizer`` does
    not hold. Trainer clips and logs the norm over all of them, the optimizer (clipping in
    backward) over its own: the coefficient, so the update, would differ without an error. An
    FSDP2 unit left unsharded (by an evaluation forward) exposes FSDP2's unsharded parameters,
    which stand for the sharded ones the optimizer holds."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = {id(p) for p in params}
    held.update(id(t) for unit in fsdp_units(params) for t in unit.aliases())
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside:
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        raise ValueError(
            f"{', '.join(outside[:3])}{more} require grad but are not in the optimizer. "
            "Trainer clips and logs the gradient norm over every trainable parameter of the "
            "model, while the OptimizerInBackward clips and measures its own, in backward. "
            "Freeze them (requires_grad_(False)) or add them to the optimizer"
        )


class _HookSwappedParameters(TrainerCallback):
    """Trainer builds the optimizer before ``accelerator.prepare``, whose FSDP2 path replaces
    its parameters: hook the new ones before step 1 (Trainer has zeroed the gradients)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hook_swapped_parameters(kwargs["optimizer"])
        # Trainer clips over model.parameters(): its norm, bit for bit, where one bucket.
        in_backward_optimizer(kwargs["optimizer"]).set_norm_order(kwargs["model"].parameters())


class InBackwardTrainerMixin:
    """Make a ``transformers.Trainer`` (subclass) step its optimizer in backward.

    Put it first among the bases, ``class MyTrainer(InBackwardTrainerMixin, SFTTrainer)``, or
    use :func:`in_backward_trainer`. See the module docstring for what changes.

    Raises (when the Trainer is built, before anything is updated):
        ValueError: under DistributedDataParallel, FSDP1 or DeepSpeed (use ``fsdp`` with
            ``fsdp_config={"version": 2}``); or an optimizer passed in ``optimizers=`` whose
            ``max_grad_norm`` differs from ``args.max_grad_norm``.
        TypeError: an optimizer passed in ``optimizers=`` that is not an
            :class:`~fused_optim_dist.OptimizerInBackward`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_accelerator(self.accelerator)
        if self.optimizer is not None:
            self._in_backward_optimizer(self.optimizer)
        self.add_callback(_HookSwappedParameters())

    # Names prefixed `_in_backward_`: the mixin shares the namespace of any Trainer subclass.
    @property
    def _in_backward_max_grad_norm(self) -> float | None:
        return _clip_norm(self.args.max_grad_norm)

    def _in_backward_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerInBackward:
        """The in-backward optimizer of this Trainer, clipping at ``args.max_grad_norm``."""
        inner = in_backward_optimizer(optimizer)
        if inner.max_grad_norm != self._in_backward_max_grad_norm:
            raise ValueError(
                f"TrainingArguments.max_grad_norm={self.args.max_grad_norm} but the "
                f"OptimizerInBackward clips at max_grad_norm={inner.max_grad_norm}. Clipping "
                "happens in backward with the optimizer's value, so give both the same value "
                "(for no clipping: max_grad_norm=0 in the arguments, None in the optimizer)"
            )
        return inner

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (``args.optim`` or ``optimizer_cls_and_kwargs``, its param
        groups), built as an :class:`~fused_optim_dist.OptimizerInBackward` clipping at
        ``args.max_grad_norm``."""
        if self.optimizer is None:
            given = self.optimizer_cls_and_kwargs
            if given is None:
                opt_model = self.model if model is None else model
                given_cls, given_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            else:
                given_cls, given_kwargs = given
            self.optimizer_cls_and_kwargs = _in_backward_cls_and_kwargs(
                given_cls, given_kwargs, self._in_backward_max_grad_norm
            )
            try:
                super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = given
        self._in_backward_optimizer(self.optimizer)
        return self.optimizer

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Trainer's step; a micro-batch that does not end an optimizer step
        (``accelerator.sync_gradients`` false, set by Trainer before each one) only
        accumulates its gradients."""
        optimizer = self._in_backward_optimizer(self.optimizer)
        _check_holds_trainable(optimizer, model)
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with optimizer.accumulate():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # Trainer clips here, after backward: the gradients were clipped with the same value
        # and freed in backward, so only the norm (before clipping) is left to report.
        return self._in_backward_optimizer(self.optimizer).grad_norm()

    def _get_grad_norm(
        self, model: nn.Module, grad_norm: torch.Tensor | float | None = None
    ) -> torch.Tensor | float:
        # Without clipping Trainer takes the norm of the freed gradients here: report ours.
        if grad_norm is None:
            return self._in_backward_optimizer(self.optimizer).grad_norm()
        return grad_norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        # The same on every rank; read back to the host on every rank, written by one.
        gradient_state = self._in_backward_optimizer(self.optimizer).gradient_state_dict()
        if self.args.should_save:
            with open(os.path.join(output_dir, GRADIENT_STATE_NAME), "w") as f:
                json.dump(gradient_state, f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, GRADIENT_STATE_NAME)
        if not os.path.isfile(path):
            logger.warning(
                "%s has no %s (written by a Trainer without in-backward stepping): the first "
                "resumed step clips as a first step, without the clipping history",
                checkpoint,
                GRADIENT_STATE_NAME,
            )
            return
        with open(path) as f:
            self._in_backward_optimizer(self.optimizer).load_gradient_state_dict(json.load(f))


def in_backward_trainer(trainer_cls: type[Trainer]) -> type[Trainer]:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``SFTTrainer``) with
    :class:`InBackwardTrainerMixin`: the same constructor, stepping in backward."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"expected a transformers.Trainer subclass, got {trainer_cls!r}")
    name = f"{trainer_cls.__name__}InBackward"
    return type(name, (InBackwardTrainerMixin, trainer_cls), {"__qualname__": name})
