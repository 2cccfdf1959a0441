"""Hugging Face ``Trainer`` (and its subclasses, TRL's included) stepping in backward.

One line switches a Trainer, or any subclass of it, to an in-backward optimizer::

    from fused_optim_dist.integrations.transformers import in_backward_trainer

    trainer = in_backward_trainer(SFTTrainer)(model=model, args=args, train_dataset=data)

or, for a Trainer subclass of your own, put :class:`InBackwardTrainerMixin` first among its
bases. Everything else is configured as usual, in ``TrainingArguments``:

* The optimizer Trainer would build (``args.optim``, ``optimizer_cls_and_kwargs``, with its
  weight-decay groups) is built as an :class:`~fused_optim_dist.OptimizerInBackward`; one passed
  in ``optimizers=`` must already be one. An optimizer factory in ``optimizer_cls_and_kwargs``
  (Trainer's protocol for Muon and Dion) builds its optimizer, which is built again in backward
  from its class, param groups and what it keeps on itself (:func:`_in_backward_rebuild`); one
  with hooks registered on it is refused.
* ``gradient_accumulation_steps``: the backward of every micro-batch but the last of a step
  runs under :meth:`~fused_optim_dist.OptimizerInBackward.accumulate`, so each step updates
  once, on the summed gradients. The Trainer's ``accelerator.backward`` does this, so a
  subclass's own ``training_step`` calling it accumulates alike.
* ``max_grad_norm`` is the optimizer's in-backward clipping (one value; ``0`` or ``inf``, as
  for Trainer, turns it off),
  and the logged ``grad_norm`` is :meth:`~fused_optim_dist.OptimizerInBackward.grad_norm`:
  Trainer's own clipping would run after the gradients were stepped and freed. With several
  FSDP units clipping follows [Note: clipping inside one backward] in
  ``fused_optim_dist/_gradients.py``.
* Checkpoints hold the optimizer state as Trainer saves it and, beside it, the clipping history
  (:meth:`~fused_optim_dist.OptimizerInBackward.gradient_state_dict`); resuming restores both.
  Saving the model between backward and ``optimizer.step()`` (transformers' JIT checkpoint) is
  refused: see [Note: saving between backward and step()].
* The optimizer must hold exactly the model's trainable parameters: Trainer clips and logs the
  norm over the model's, the optimizer over its own. A trainable parameter of the model left
  out of it (freeze it, or add it), or one it holds outside the model (make it the model's,
  or freeze it), is refused before the backward.
* Data parallel: FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2}``, or a model transformers
  sharded at load with ``distributed_config``) is supported; DistributedDataParallel, Trainer's
  default under ``torchrun``, is refused when the Trainer is built, before any update.
* ``fp16=True`` off the CPU (accelerate's GradScaler, which would scale the gradients stepped in
  backward) is refused when the Trainer is built; use ``bf16=True``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_optimizer import is_optimizer_factory

from fused_optim_dist import InBackwardOptions
from fused_optim_dist._class_state import instance_attrs, same_value
from fused_optim_dist._options import _accepted_arguments
from fused_optim_dist._torch_internals import OPTIMIZER_HOOKS
from fused_optim_dist.integrations.accelerate import (
    _refuse_other_parameters,
    _unless_syncing,
    check_accelerator,
    in_backward_optimizer,
)
from fused_optim_dist.optimizer import OptimizerInBackward, in_backward

__all__ = ["GRADIENT_STATE_NAME", "InBackwardTrainerMixin", "in_backward_trainer"]

GRADIENT_STATE_NAME = "in_backward_gradients.json"
"""The file in a Trainer checkpoint holding the clipping history (written by process 0)."""

logger = logging.getLogger(__name__)


def _clip_norm(max_grad_norm: float | None) -> float | None:
    """The optimizer's ``max_grad_norm`` for Trainer's: a finite value above 0, or ``None``.

    Trainer clips when ``max_grad_norm > 0``; ``inf`` is its own way to measure the norm and
    never clip (``clip_grad_norm_(params, inf)`` scales by 1, and Trainer still logs the
    norm), which the optimizer spells ``None``: ``grad_norm()`` is measured either way."""
    if max_grad_norm is None or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        return None
    return float(max_grad_norm)


def _same_groups(ours: list[dict[str, Any]], built: list[dict[str, Any]]) -> bool:
    """The same parameters, in the same order, with the same values, group by group."""

    def values(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    return len(ours) == len(built) and all(
        list(map(id, mine["params"])) == list(map(id, theirs["params"]))
        and same_value(values(mine), values(theirs))
        for mine, theirs in zip(ours, built, strict=True)
    )


_DATA = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Tensor,
    type,
)
"""Values an attribute may hold, alone or in containers, to be carried to the optimizer built
again (a tensor unless it is the state of the one built)."""


def _refers_to_none_of(value: Any, held: set[int]) -> bool:
    """Whether ``value`` is data that reaches none of the objects ``held`` (by id): plain
    values, tensors, classes, and containers and plain objects (through their ``__dict__``)
    of such data. Anything else (a function or bound method, which may hold the optimizer in
    its closure or ``__self__``; an object without a ``__dict__``) cannot be checked."""
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if id(item) in held:
            return False
        if id(item) in seen or isinstance(item, _DATA):
            continue
        seen.add(id(item))
        if isinstance(item, list | tuple | set | frozenset):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif hasattr(item, "__dict__") and (isinstance(item, nn.Module) or not callable(item)):
            pending.extend(vars(item).values())
        else:
            return False
    return True


def _carry_instance_attrs(built: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> list[str]:
    """Give ``inner`` (the class's instance an :class:`OptimizerInBackward` steps with, built
    from ``built``'s groups and defaults) what ``built`` keeps on itself and ``inner`` does
    not: an argument its constructor kept outside the groups (bitsandbytes keeps
    ``min_8bit_size`` in ``self.args``), or an attribute the factory set. Carried as they are
    (the same objects), where they refer to nothing of ``built``'s own (itself, its groups,
    its state), which the one stepping does not hold. Returns the names of those that cannot
    be carried, nothing changed then."""
    ours, theirs = instance_attrs(inner), instance_attrs(built)
    changed = {k: v for k, v in theirs.items() if k not in ours or not same_value(ours[k], v)}
    held = {id(built), id(built.param_groups), id(built.state)}
    held.update(map(id, built.param_groups))
    for entry in built.state.values():
        held.add(id(entry))
        held.update(id(v) for v in entry.values() if isinstance(v, torch.Tensor))
    refused = sorted(k for k, v in changed.items() if not _refers_to_none_of(v, held))
    if refused:
        return refused
    for name in ours.keys() - theirs.keys():
        delattr(inner, name)
    for name, value in changed.items():
        setattr(inner, name, value)
    return []


def _in_backward_rebuild(
    built: torch.optim.Optimizer, max_grad_norm: float | None
) -> OptimizerInBackward:
    """The optimizer a factory ``built``, built again as an :class:`OptimizerInBackward` of its
    class clipping at ``max_grad_norm``: on its param groups (every value each holds), with its
    defaults that the class's constructor takes (for groups added later), the attributes it
    keeps on itself (:func:`_carry_instance_attrs`), and its state (a class making state when
    built, e.g. Adagrad's sums; the rebuilt one makes the same).

    A factory's optimizer is a built object, and stepping in backward needs the class and the
    groups: what the class makes of its groups is checked to be the groups ``built`` holds, so
    the updates are the ones ``built`` would make. An ``OptimizerInBackward`` is returned as it
    is (a factory mixing classes per group builds one itself).

    Raises:
        TypeError: if the class cannot be built from the groups, or builds other ones (a class
            built from two parameter lists, or from the model); if ``built`` has hooks (a
            step post-hook of the object built would not run on the one built again, and a
            step pre-hook cannot run in backward); or if it keeps on itself, outside its
            groups, an attribute that cannot be carried (one referring to its groups or state,
            or a function, which may hold the object built).
    """
    if isinstance(built, OptimizerInBackward):
        return built
    cls = type(built)
    refusal = (
        f"Trainer's optimizer factory built a {cls.__qualname__}, which cannot be built again "
        f"as OptimizerInBackward({cls.__qualname__}) from its param groups"
    )
    advice = (
        ". Make the factory return an OptimizerInBackward (param groups may name their own "
        "class under 'optimizer_cls', see docs/whole_tensor.md), with max_grad_norm="
        f"{max_grad_norm} (TrainingArguments.max_grad_norm), or pass optimizers=(...)"
    )
    hooks = [
        name.removeprefix("_optimizer_") for name in OPTIMIZER_HOOKS if getattr(built, name, None)
    ]
    if hooks:
        raise TypeError(
            f"{refusal}: hooks registered on it ({', '.join(hooks)}) would not run on the one "
            "built again (a step post-hook registered on an OptimizerInBackward runs at step(), "
            "after the backward's updates; a step pre-hook cannot run in backward, where the "
            f"updates are made before step() is called){advice}"
        )
    accepted = _accepted_arguments(cls)
    defaults = {
        k: v
        for k, v in built.defaults.items()
        if k != "params" and (accepted is None or k in accepted)
    }
    groups = [dict(group) for group in built.param_groups]
    options = InBackwardOptions(max_grad_norm=max_grad_norm)
    try:
        rebuilt = OptimizerInBackward(groups, cls, options=options, **defaults)
    except TypeError as e:
        raise TypeError(f"{refusal} ({e}){advice}") from e
    if not _same_groups(rebuilt.param_groups, built.param_groups):
        rebuilt.detach()
        raise TypeError(f"{refusal}: its constructor made other groups of them{advice}")
    refused = _carry_instance_attrs(built, rebuilt._stepper.steppers[None].optimizer)
    if refused:
        rebuilt.detach()
        raise TypeError(
            f"{refusal}: it keeps {', '.join(refused)} on itself, outside its param groups, "
            "referring to its groups, its state or itself, or holding a function, which "
            f"cannot be carried to the one built again{advice}"
        )
    if built.state:
        rebuilt.load_state_dict(built.state_dict())
    return rebuilt


class _InBackwardFactory:
    """Trainer's optimizer-factory protocol around ``factory``: Trainer builds
    ``_InBackwardFactory(factory, ...)()(model, **kwargs)``, which is
    ``factory()(model, **kwargs)`` built again in backward (:func:`_in_backward_rebuild`)."""

    def __init__(self, factory: Any, max_grad_norm: float | None) -> None:
        self.factory = factory
        self.max_grad_norm = max_grad_norm

    def __repr__(self) -> str:
        # Trainer reads str(optimizer_cls) (a bitsandbytes check): the factory's name stays in.
        return f"_InBackwardFactory({self.factory!r})"

    def __call__(self) -> Callable[..., OptimizerInBackward]:
        build = self.factory()

        def build_in_backward(model: nn.Module, **kwargs: Any) -> OptimizerInBackward:
            return _in_backward_rebuild(build(model, **kwargs), self.max_grad_norm)

        return build_in_backward


def _in_backward_cls_and_kwargs(
    optimizer_cls: Any, kwargs: dict[str, Any], max_grad_norm: float | None
) -> tuple[Any, dict[str, Any]]:
    """Trainer's optimizer class (or factory) and arguments, as an in-backward class (or a
    factory building one) clipping at ``max_grad_norm``. A class that is already one keeps the
    options it was given (checked against ``max_grad_norm`` once built)."""
    # A dotted path (a string) names a class here, as in_backward() takes it; Trainer's own
    # check would take it for a factory.
    if not isinstance(optimizer_cls, str) and is_optimizer_factory(optimizer_cls):
        return _InBackwardFactory(optimizer_cls, max_grad_norm), kwargs
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, OptimizerInBackward):
        if "options" in kwargs or "max_grad_norm" in kwargs:
            return optimizer_cls, kwargs
        return optimizer_cls, {**kwargs, "max_grad_norm": max_grad_norm}
    # Every keyword Trainer passes is the class's own, so ours go in `options`: that keeps them
    # apart even for a class taking an argument named max_grad_norm.
    options = InBackwardOptions(max_grad_norm=max_grad_norm)
    return in_backward(optimizer_cls), {**kwargs, "options": options}


_TRAINER_CLIPS = (
    "Trainer clips and logs the gradient norm over the model's parameters "
    "(accelerator.clip_grad_norm_(model.parameters(), ...))"
)
"""Who clips over the model's parameters, in ``_refuse_other_parameters``' message."""

_TRAINER_OUTSIDE_FIX = (
    "Make them parameters of the model (an attribute of one of its modules: Trainer's "
    "clipping then covers them too), or freeze them (requires_grad_(False))"
)
"""What to do with an optimizer's parameters outside the model, in the same message."""


class _HookSwappedParameters(TrainerCallback):
    """Hook the optimizer's parameters before step 1 (Trainer has zeroed the gradients): again
    after the last ``train()`` detached them (see [Note: an idle Trainer holds no hooks]), and
    the new ones where ``accelerator.prepare``'s FSDP2 path replaced them (Trainer builds the
    optimizer before it)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        in_backward_optimizer(kwargs["optimizer"]).attach()
        # Trainer clips over model.parameters(): its norm, bit for bit, where one bucket.
        in_backward_optimizer(kwargs["optimizer"]).set_norm_order(kwargs["model"].parameters())


class InBackwardTrainerMixin:
    """Make a ``transformers.Trainer`` (subclass) step its optimizer in backward.

    Put it first among the bases, ``class MyTrainer(InBackwardTrainerMixin, SFTTrainer)``, or
    use :func:`in_backward_trainer`. See the module docstring for what changes.

    Raises (when the Trainer is built, before anything is updated):
        ValueError: under DistributedDataParallel, FSDP1 or DeepSpeed (use ``fsdp`` with
            ``fsdp_config={"version": 2}``); with a GradScaler on the accelerator (``fp16``:
            use ``bf16``; one put there later is refused before the next backward); or an
            optimizer passed in ``optimizers=`` whose ``max_grad_norm`` differs from
            ``args.max_grad_norm``. Before each backward: an optimizer that does not hold
            exactly the model's trainable parameters (see [Note: Trainer's backward]).
        TypeError: an optimizer passed in ``optimizers=`` that is not an
            :class:`~fused_optim_dist.OptimizerInBackward` (and, when the optimizer is built, a
            factory's optimizer that cannot be built again in backward).
        RuntimeError: the model saved between backward and ``optimizer.step()``
            (:meth:`save_model`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_backward_check_accelerator()
        if self.optimizer is not None:
            self._in_backward_optimizer(self.optimizer)
        self.add_callback(_HookSwappedParameters())
        # See [Note: auto_find_batch_size's retry].
        self._in_backward_attempt = 0
        self._in_backward_step_error: Exception | None = None

    # Names prefixed `_in_backward_`: the mixin shares the namespace of any Trainer subclass.
    def _in_backward_check_accelerator(self) -> None:
        """:func:`check_accelerator` on this Trainer's accelerator. A model transformers sharded
        at load (``from_pretrained(..., distributed_config=...)``, FSDP2 DTensors) is prepared
        without a DDP wrap (Trainer's ``is_distributed_loading_by_transformers`` path), though
        accelerate's type is ``MULTI_CPU``/``MULTI_GPU``: FSDP2 reduces its gradients before
        the hooks. Gradient hooks transformers adds there (tensor parallel, replicated
        adapters) are refused by the optimizer at the first backward, before any update."""
        sharded_at_load = bool(getattr(self, "is_distributed_loading_by_transformers", False))
        check_accelerator(self.accelerator, wraps_model=not sharded_at_load)

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
                "(for no clipping: max_grad_norm=0 or inf in the arguments, None in the optimizer)"
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

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train()``, its optimizer detached from the parameters when it ends.

        [Note: an idle Trainer holds no hooks]
        A Trainer's optimizer steps its parameters in backward only while that Trainer trains:
        ``train()`` detaches it (:meth:`~fused_optim_dist.OptimizerInBackward.detach`, state
        kept) however it ends, and the next ``train()`` attaches it again at
        ``on_train_begin``. A second Trainer on the same model (two-stage fine-tuning: the
        head with the body frozen, then everything), built while the first is still
        referenced, was refused at its ``train()`` as a second optimizer in backward on the
        head's parameters, which the plain Trainer runs.
        """
        self._in_backward_attempt = 0
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.optimizer is not None:
                in_backward_optimizer(self.optimizer).detach()

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Trainer's step, under :meth:`~fused_optim_dist.OptimizerInBackward.accumulate` on a
        micro-batch that does not end an optimizer step: a subclass's ``training_step`` that
        calls ``loss.backward()`` itself, not ``accelerator.backward``, accumulates too (see
        [Note: Trainer's backward])."""
        with _unless_syncing(self.accelerator, self._in_backward_optimizer(self.optimizer)):
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            except Exception as e:
                self._in_backward_step_error = e  # for the message of a retry's refusal
                raise

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Trainer's (or the subclass's) ``compute_loss``, under
        :meth:`~fused_optim_dist.OptimizerInBackward.accumulate` while training.

        [Note: backwards inside compute_loss]
        A ``compute_loss`` may run a backward of its own, an auxiliary loss's with
        ``retain_graph=True``, and return the main loss for Trainer's backward; the plain
        Trainer steps the sum of both. On a micro-batch that ends a step, that own backward
        stepped every bucket it completed, and Trainer's then failed in autograd's check of
        the weights the main loss saved ("modified by an inplace operation"), after they had
        moved. Under ``accumulate()`` it only adds its gradients, and Trainer's backward
        steps the sum: equal. Without a backward of its own (the usual case) it changes
        nothing; evaluation calls it with no optimizer, or under ``no_grad``.
        """
        if self.optimizer is None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        with in_backward_optimizer(self.optimizer).accumulate():
            return super().compute_loss(model, inputs, *args, **kwargs)

    def _update_auto_batch_size(self, batch_size: int) -> None:
        """Trainer's set-up of each attempt of ``auto_find_batch_size``, refused on a retry
        after updates were made in backward.

        [Note: auto_find_batch_size's retry]
        accelerate's ``find_executable_batch_size`` runs Trainer's training loop again with a
        smaller batch after an out-of-memory error; the plain Trainer then starts from the
        weights it had (the failed step's gradients are discarded by ``model.zero_grad()``).
        An error in backward comes after the buckets whose gradients were complete were
        stepped (the layers above the one that ran out, every FSDP2 unit reduced before it):
        those updates cannot be undone, and the retry would train from other weights (it
        raised at its first backward, naming a missing ``step()``; 1.0e-2 moved). Refused
        here, before the retry trains. An error in forward, or in a backward that stepped
        nothing yet (one bucket: stepped at its end), leaves no update, and the retry runs.

        Raises:
            RuntimeError: on a retry while updates made in backward await ``step()``.
        """
        retry = self._in_backward_attempt > 0
        self._in_backward_attempt += 1
        if retry and self.optimizer is not None:
            pending = in_backward_optimizer(self.optimizer)._pending
            if pending:
                # The error's type only: its message (" out of memory.") in this one would make
                # find_executable_batch_size take it for another out-of-memory error and retry.
                error = self._in_backward_step_error
                raise RuntimeError(
                    "auto_find_batch_size would retry with batch size "
                    f"{batch_size} after an out-of-memory error ({type(error).__name__}) in "
                    f"step {self.state.global_step + 1}'s backward, but that backward had already "
                    f"updated {len(pending.params())} parameter(s), and these updates "
                    "cannot be undone: the plain Trainer retries from the weights of before "
                    "that step, this one would train from others. The retry was not started. "
                    "Restart from the last checkpoint (or from the start), with "
                    "per_device_train_batch_size set to a size that fits (find it with the "
                    "plain optimizer and auto_find_batch_size, or by trying smaller sizes)"
                ) from error
        super()._update_auto_batch_size(batch_size)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator (built in ``__init__``, again for each hyperparameter-search
        trial), whose ``backward`` then steps in backward only when it ends an optimizer step
        (:meth:`_in_backward_backward`)."""
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._in_backward_backward(self.accelerator)

    def _in_backward_backward(self, accelerator: Accelerator) -> Callable[..., None]:
        """``accelerator.backward`` for Trainer's micro-batches: one that does not end an
        optimizer step (``accelerator.sync_gradients`` false, set by Trainer before each) runs
        under :meth:`~fused_optim_dist.OptimizerInBackward.accumulate`, so it only adds its
        gradients; each runs after the checks that stepping in backward needs.

        [Note: Trainer's backward]
        The wrap is on the accelerator as well as on ``training_step``: a subclass
        overriding ``training_step`` with its own ``self.accelerator.backward(loss)`` (not
        calling Trainer's) accumulates as Trainer's does (with only Trainer's
        ``training_step`` wrapped, its first micro-batch was stepped in backward and the
        second refused, after 1.0e-2 moved), and so does one of the mixin's subclasses whose
        ``training_step`` calls ``loss.backward()`` itself (with only the accelerator
        wrapped, likewise). Before each backward, so before anything of it moves: the
        optimizer's ``max_grad_norm`` is still ``args.max_grad_norm``; no GradScaler was put
        on the accelerator since construction (it would scale the gradients stepped in this
        backward); and the optimizer holds exactly the model's trainable parameters
        (``_refuse_other_parameters``: Trainer clips and logs over the model's, the
        optimizer over its own, in backward).
        """
        original = accelerator.backward

        @functools.wraps(original)
        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            optimizer = self._in_backward_optimizer(self.optimizer)
            self._in_backward_check_accelerator()
            _refuse_other_parameters(
                optimizer, self.model_wrapped, _TRAINER_CLIPS, _TRAINER_OUTSIDE_FIX
            )
            with _unless_syncing(accelerator, optimizer):
                original(loss, **kwargs)

        return backward

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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model`` (its checkpoints save the model with it, first), refused
        between backward and ``optimizer.step()``.

        [Note: saving between backward and step()]
        transformers' just-in-time checkpoint (``enable_jit_checkpoint=True``) saves at the
        first callback event after SIGTERM's grace period; when that falls in a step's
        forward or backward, the event is ``on_pre_optimizer_step``, between backward and
        ``optimizer.step()``. The plain Trainer saves there the weights of before the step's
        update, as ``checkpoint-N`` for N steps done; here the backward has already applied
        it, so the checkpoint would hold step N+1's weights under step N's name (5.0e-3 apart
        with ``save_only_model=True``, no error; without it the optimizer's ``state_dict()``
        refused, after the weights were written). So the save is refused, before anything of
        the model is written: the weights of before the update are gone.

        Raises:
            RuntimeError: when called while updates made in backward await ``step()``.
        """
        if self.optimizer is not None:
            pending = in_backward_optimizer(self.optimizer)._pending
            if pending:
                step = self.state.global_step + 1
                raise RuntimeError(
                    f"Trainer saves the model between step {step}'s backward and its "
                    "optimizer.step() (transformers' JIT checkpoint does, when SIGTERM's request "
                    f"comes during a step's forward or backward): {len(pending.params())} "
                    "parameter(s) already hold that step's update, made in backward, where the "
                    "plain Trainer saves the weights of before it, so the checkpoint would hold "
                    f"step {step}'s weights under step {step - 1}'s name. The model was not "
                    "saved. Save after optimizer.step() (save_strategy='steps' with save_steps, "
                    "or from a callback's on_step_end), or train without enable_jit_checkpoint"
                )
        super().save_model(output_dir, _internal_call)

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
