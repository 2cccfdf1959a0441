"""An ``accelerate`` loop with ``OptimizerInBackward``: accumulation, clipping, data parallel.

The loop differs from the plain one in two places, both here::

    from fused_optim_dist.integrations.accelerate import in_backward_optimizer, prepare

    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                max_grad_norm=1.0)  # clipping is configured here, once
    model, optim, loader = prepare(accelerator, model, optim, loader)  # refuses DDP
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))  # steps when sync_gradients
            if accelerator.sync_gradients:
                grad_norm = in_backward_optimizer(optim).grad_norm()  # no clip_grad_norm_
            optim.step()
            optim.zero_grad()

Why each piece: :func:`prepare` is ``accelerator.prepare``, then :func:`check_accelerator`
(DDP would step unreduced gradients, fp16's GradScaler scaled ones) and
:func:`hook_swapped_parameters` (FSDP2's prepare replaces the optimizer's parameters).
``accelerator.accumulate`` decides per micro-batch whether the optimizer steps
(``accelerator.sync_gradients``) and skips ``optim.step()`` otherwise, but an in-backward
optimizer steps in backward, before ``step()``: :func:`prepare` makes ``accelerator.backward``
run a non-stepping micro-batch's backward under :meth:`OptimizerInBackward.accumulate`
(:func:`backward` does the same for an accelerator prepared otherwise). The gradients are freed
once stepped, so ``accelerator.clip_grad_norm_`` would clip nothing (it raises: see
[Note: freed gradients]): clip with ``max_grad_norm`` at construction and read the norm with
``grad_norm()``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.optim import Optimizer

from fused_optim_dist.optimizer import OptimizerInBackward
from fused_optim_dist.training import in_backward_of

__all__ = [
    "backward",
    "check_accelerator",
    "hook_swapped_parameters",
    "in_backward_optimizer",
    "prepare",
]

DDP_REFUSAL = (
    "OptimizerInBackward cannot step in backward under accelerate's distributed type {found}: "
    "DistributedDataParallel (the multi-process default) all-reduces gradients after the hooks "
    "that step them, so every rank would step its own unreduced gradients and the replicas "
    "would drift apart (FSDP1 and DeepSpeed handle gradients in their own flat buffers). Use "
    "fsdp with fsdp_version: 2 (FSDP2; accelerate config `fsdp_config: {{fsdp_version: 2}}`, "
    "Trainer `fsdp=True, fsdp_config={{'version': 2}}`), or, for plain data parallel in your "
    "own loop, torch.distributed._composable.replicate_with_fsdp.replicate on the model."
)
"""The refusal of every multi-process type but FSDP2 (formatted with the type found)."""

GRAD_SCALER_REFUSAL = (
    "OptimizerInBackward cannot step in backward with accelerate's GradScaler "
    "(accelerator.scaler: {found}), which accelerate builds for mixed_precision='fp16' (Trainer "
    "fp16=True) off the CPU: accelerator.backward scales the loss, and each gradient would be "
    "stepped in backward, scaled, before the GradScaler could unscale it or skip a step with "
    "inf/NaN gradients. Use mixed_precision='bf16' (Trainer bf16=True), which needs no loss "
    "scaling, with skip_nonfinite=True in the OptimizerInBackward to skip non-finite buckets; "
    "or the plain optimizer with fp16."
)
"""The refusal of an accelerator holding a GradScaler (formatted with its type)."""


def in_backward_optimizer(optimizer: Optimizer) -> OptimizerInBackward:
    """The :class:`OptimizerInBackward` inside ``optimizer`` (accelerate's
    ``AcceleratedOptimizer`` wraps it in ``.optimizer``), for its ``accumulate()`` and
    ``grad_norm()``, which the wrapper does not forward.

    Raises:
        TypeError: if ``optimizer`` neither is nor wraps an :class:`OptimizerInBackward`.
    """
    inner = in_backward_of(optimizer)
    if inner is None:
        raise TypeError(
            f"expected an OptimizerInBackward (or accelerate's wrapper of one), got "
            f"{type(optimizer).__name__}; build it with "
            "OptimizerInBackward(model.parameters(), torch.optim.AdamW, ...) (with a Trainer: "
            "in its create_optimizer, if a subclass overrides it, or in optimizers=(...))"
        )
    return inner


def check_accelerator(accelerator: Accelerator, *, wraps_model: bool = True) -> None:
    """Refuse a set-up in which stepping in backward would be wrong.

    One process, and FSDP2 (``fsdp_version: 2``), are accepted. Every other multi-process type
    wraps the model in ``DistributedDataParallel`` (or FSDP1's flat parameters, or DeepSpeed's
    own optimizer), whose gradients are not final when the parameters' hooks run. A GradScaler
    (``accelerator.scaler``, which accelerate builds for ``fp16`` off the CPU) is refused
    whatever the type: ``accelerator.backward`` scales the loss, so the gradients stepped in
    backward would be scaled, and the GradScaler unscales and checks them only at the step
    (``OptimizerInBackward`` then raises, after the update). Call it before the first
    backward, so that nothing has been updated when it raises.

    Args:
        accelerator: the accelerator that prepares the model and runs its backward.
        wraps_model: whether ``accelerator.prepare`` will wrap the model for its distributed
            type. ``False`` for a model transformers sharded at load
            (``from_pretrained(..., distributed_config=...)``), which Trainer prepares
            without wrapping (``prepare_model(..., evaluation_mode=True)``): its gradients are
            reduced by FSDP2 before the hooks, whatever accelerate's type says
            (``MULTI_CPU``/``MULTI_GPU``); only the GradScaler is checked then.

    Raises:
        ValueError: for a GradScaler on the accelerator, naming bf16; for any distributed type
            but ``NO`` and FSDP2 (when ``wraps_model``), naming what to use instead.
    """
    _refuse_grad_scaler(accelerator)
    if not wraps_model:
        return
    state = accelerator.state
    if state.distributed_type == DistributedType.NO:
        return
    if state.distributed_type == DistributedType.FSDP and state.fsdp_plugin.fsdp_version == 2:
        return
    found = state.distributed_type.value
    if state.distributed_type == DistributedType.FSDP:
        found = f"FSDP with fsdp_version {state.fsdp_plugin.fsdp_version}"
    raise ValueError(DDP_REFUSAL.format(found=found))


def _refuse_grad_scaler(accelerator: Accelerator) -> None:
    """Raise :data:`GRAD_SCALER_REFUSAL` if ``accelerator`` holds a GradScaler."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        raise ValueError(GRAD_SCALER_REFUSAL.format(found=type(scaler).__name__))


def backward(
    accelerator: Accelerator, loss: torch.Tensor, optimizer: Optimizer, **kwargs: Any
) -> None:
    """``accelerator.backward(loss, **kwargs)``, stepping in backward only on a sync step.

    When ``accelerator.sync_gradients`` is false (a micro-batch that ``accelerator.accumulate``
    does not step on) the backward runs under :meth:`OptimizerInBackward.accumulate`, so the
    gradients are summed and the next syncing backward steps once on the sum, exactly as
    the plain optimizer's ``step()`` on that sync step would. Checks the accelerator first
    (:func:`check_accelerator`).
    """
    check_accelerator(accelerator)
    with _unless_syncing(accelerator, in_backward_optimizer(optimizer)):
        accelerator.backward(loss, **kwargs)


def _unless_syncing(
    accelerator: Accelerator, optimizer: OptimizerInBackward
) -> contextlib.AbstractContextManager[None]:
    """``optimizer.accumulate()`` on a micro-batch ``accelerator.accumulate`` does not step on."""
    return contextlib.nullcontext() if accelerator.sync_gradients else optimizer.accumulate()


def _step_on_sync_only(accelerator: Accelerator, optimizer: OptimizerInBackward) -> None:
    """Make ``accelerator.backward`` (this instance's) run under ``optimizer.accumulate()`` on
    micro-batches it does not step on, as :func:`backward` does: the accelerate loop written for
    a plain optimizer, ``accelerator.backward(loss)`` inside ``accelerator.accumulate(model)``,
    then sums them, where it stepped the first micro-batch in backward (1.0e-2 moved before
    the second was refused)."""
    original = accelerator.backward

    @functools.wraps(original)
    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        # A GradScaler put on the accelerator after prepare() would scale this backward's
        # gradients before they are stepped: refused before it runs.
        _refuse_grad_scaler(accelerator)
        with _unless_syncing(accelerator, optimizer):
            original(loss, **kwargs)

    accelerator.backward = backward  # type: ignore[method-assign]


def hook_swapped_parameters(optimizer: Optimizer) -> None:
    """Hook the parameters accelerate's FSDP2 prepare put in ``optimizer``, before the first
    backward.

    ``accelerator.prepare`` shards the model after the optimizer was built and replaces the
    tensors in its ``param_groups`` (``fsdp2_switch_optimizer_parameters``); the hooks are on
    the tensors it replaced. :meth:`OptimizerInBackward.hook_parameters` re-derives the bucket
    plan from ``param_groups``, which hooks the new parameters, and steps nothing (a
    ``step()`` would run the class's step on every group: a class counting steps in its groups
    would start one step ahead). Without this the first step would still be exact, but stepped
    in ``step()`` with every gradient held.
    """
    in_backward_optimizer(optimizer).hook_parameters()


def prepare(accelerator: Accelerator, *args: Any) -> Any:
    """``accelerator.prepare(*args)`` for a loop with an :class:`OptimizerInBackward`.

    Refuses a distributed type other than one process or FSDP2, and a GradScaler
    (:func:`check_accelerator`), before preparing anything, then hooks the parameters FSDP2's
    prepare swapped into each in-backward optimizer among ``args``
    (:func:`hook_swapped_parameters`), makes ``accelerator.backward`` accumulate on the
    micro-batches it does not step on (so that ``accelerator.backward(loss)`` works as
    :func:`backward`; it also refuses a GradScaler put on the accelerator later, before the
    backward runs), and, with one model among ``args``, takes the optimizers' gradient norm in
    its parameter order, as the loop's ``clip_grad_norm_(model.parameters())`` takes it
    (:meth:`~fused_optim_dist.OptimizerInBackward.set_norm_order`). Returns what
    ``accelerator.prepare`` returns.
    """
    check_accelerator(accelerator)
    prepared = accelerator.prepare(*args)
    # One object back for one passed; else a tuple, or a list on the FSDP2 path.
    objects = prepared if len(args) > 1 else (prepared,)
    models = [obj for obj in objects if isinstance(obj, nn.Module)]
    for obj in objects:
        if isinstance(obj, Optimizer) and _wraps_in_backward(obj):
            hook_swapped_parameters(obj)
            _step_on_sync_only(accelerator, in_backward_optimizer(obj))
            if len(models) == 1:
                # The loop clips over model.parameters(): that norm, bit for bit, where one
                # bucket (see OptimizerInBackward.set_norm_order).
                in_backward_optimizer(obj).set_norm_order(models[0].parameters())
    return prepared


def _wraps_in_backward(optimizer: Optimizer) -> bool:
    try:
        in_backward_optimizer(optimizer)
    except TypeError:
        return False
    return True
