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
(DDP would step unreduced gradients, fp16's GradScaler scaled ones),
:func:`hook_swapped_parameters` (FSDP2's prepare replaces the optimizer's parameters), and a
check that the optimizer holds exactly the trainable parameters of the model it trains, whose
norm it then sums in the model's order, prepared in one call or in several (the loop's
``clip_grad_norm_(model.parameters())`` clips over them; see [Note: an optimizer meets its
model]). ``accelerator.accumulate`` decides per micro-batch whether the optimizer steps
(``accelerator.sync_gradients``) and skips ``optim.step()`` otherwise, but an in-backward
optimizer steps in backward, before ``step()``: :func:`prepare` makes ``accelerator.backward``,
and any backward inside ``accelerator.accumulate``, run a non-stepping micro-batch's backward
under :meth:`OptimizerInBackward.accumulate` (:func:`backward` does the same for an
accelerator prepared otherwise). The gradients are freed
once stepped, so ``accelerator.clip_grad_norm_`` would clip nothing (it raises: see
[Note: freed gradients]): clip with ``max_grad_norm`` at construction and read the norm with
``grad_norm()``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.optim import Optimizer

from fused_optim_dist._torch_internals import fsdp_units
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

_LOOP_CLIPS = (
    "accelerate's loop clips and measures the gradient norm over the model's parameters "
    "(accelerator.clip_grad_norm_(model.parameters(), ...))"
)
"""Who clips over the model's parameters, in :func:`_refuse_other_parameters`' message."""

_LOOP_OUTSIDE_FIX = (
    "Make them parameters of the model (the loop's clipping then covers them too), give them "
    "an OptimizerInBackward of their own (without max_grad_norm where the loop steps them "
    "unclipped), or freeze them (requires_grad_(False))"
)
"""What to do with an optimizer's parameters outside the model, in the same message."""


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


def _held(optimizer: OptimizerInBackward) -> set[int]:
    """Ids of the parameters ``optimizer`` holds and of every tensor FSDP2 registers for them:
    an FSDP2 unit left unsharded (the root after a forward, any unit after an evaluation
    forward under ``no_grad``) exposes its unsharded parameters on the model, which stand for
    the sharded ones the optimizer holds."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = {id(p) for p in params}
    for aliases in _unit_aliases(params):
        held |= aliases
    return held


def _unit_aliases(params: list[torch.Tensor]) -> list[set[int]]:
    """For each FSDP2 unit of ``params``, the ids of every tensor FSDP2 registers for its
    parameters (see :func:`_held`)."""
    return [{id(t) for t in unit.aliases()} for unit in fsdp_units(params)]


def _refuse_other_parameters(
    optimizer: OptimizerInBackward, model: nn.Module, clips: str, outside_fix: str
) -> None:
    """Refuse, before a backward, an optimizer that does not hold exactly the trainable
    parameters of ``model``, whose gradient norm the loop clips and logs.

    The loop clips by the norm over ``model.parameters()`` (``clip_grad_norm_``), the
    optimizer in backward by the norm over its own: a trainable parameter of the model left
    out of the optimizer ("train all but the embedding" by leaving it out), or a trainable
    parameter the optimizer holds outside the model (a learnable logit bias or temperature
    kept beside the model for the loss), puts another norm, so another coefficient, in every
    update, and another norm in the log, without an error. Frozen parameters count for
    neither: they get no gradient. An FSDP2 parameter counts as the model's when the model
    exposes any of its tensors (see :func:`_held`).

    Args:
        optimizer: the in-backward optimizer.
        model: the model it trains.
        clips: who clips over the model's parameters, for the message.
        outside_fix: what to do with parameters outside the model, for the message.

    Raises:
        ValueError: naming the parameters and what to do.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = _held(optimizer)
    in_model = {id(p) for p in model.parameters()}
    for aliases in _unit_aliases(params):
        if not aliases.isdisjoint(in_model):
            in_model |= aliases
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left_out:
        more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
        raise ValueError(
            f"{', '.join(left_out[:3])}{more} require grad but are not in the optimizer. "
            f"{clips}, while the OptimizerInBackward clips and measures the norm over its own, "
            "in backward. Freeze them (requires_grad_(False)) or add them to the optimizer "
            "(one OptimizerInBackward for the whole model: its param groups may each name "
            "their class under 'optimizer_cls', see docs/whole_tensor.md)"
        )
    outside = [tuple(p.shape) for p in params if p.requires_grad and id(p) not in in_model]
    if outside:
        shapes = ", ".join(map(str, outside[:3])) + (" ..." if len(outside) > 3 else "")
        raise ValueError(
            f"the optimizer holds {len(outside)} trainable parameter(s) that are not the "
            f"model's (shapes {shapes}). {clips}, while the OptimizerInBackward clips and "
            f"measures the norm over its own, these included, in backward. {outside_fix}"
        )


def _checked_model(accelerator: Accelerator, optimizer: OptimizerInBackward) -> nn.Module | None:
    """The model ``accelerator`` prepared (by any ``prepare`` call) that shares a trainable
    parameter with ``optimizer``, the one the loop clips with it, after checking, where the
    optimizer clips (``max_grad_norm``), that it holds exactly the model's trainable
    parameters (:func:`_refuse_other_parameters`); ``None`` with none prepared yet, or several
    and no clipping, where there is nothing to check. See [Note: an optimizer meets its
    model].

    Raises:
        ValueError: for an optimizer with ``max_grad_norm`` sharing parameters with several
            prepared modules (a model and a criterion with learnable parameters): the loop
            clips over one module's parameters, or over some of them, which it does not say;
            ours over all it holds.
    """
    held = _held(optimizer)
    # Modules sharing trainable parameters with it (a frozen encoder prepared on its own
    # shares none that count), one per set of parameters (accelerate keeps both a module and
    # the compiled module wrapping it when the model is prepared twice).
    by_parameters: dict[frozenset[int], nn.Module] = {}
    for module in accelerator._models:
        trainable = frozenset(id(p) for p in module.parameters() if p.requires_grad)
        if not held.isdisjoint(trainable):
            by_parameters.setdefault(trainable, module)
    models = list(by_parameters.values())
    clipped = optimizer.max_grad_norm is not None
    # Unclipped, every update is the plain one whatever the optimizer holds: nothing to refuse.
    if len(models) > 1 and clipped:
        names = ", ".join(type(m).__name__ for m in models)
        raise ValueError(
            f"the OptimizerInBackward holds parameters of {len(models)} prepared modules "
            f"({names}). accelerate's loop clips and measures the gradient norm over the "
            "parameters it gives accelerator.clip_grad_norm_ (model.parameters() of one "
            "module, or of several), while the OptimizerInBackward clips and measures the "
            "norm over all it holds, in backward. "
            "Give each module an OptimizerInBackward of its own, with max_grad_norm only "
            "where the loop clips that module (a criterion whose parameters the loop steps "
            "unclipped: none), or, where the loop clips the modules together, prepare them "
            "as one module (torch.nn.ModuleDict)"
        )
    if len(models) != 1:
        return None
    if clipped:
        _refuse_other_parameters(optimizer, models[0], _LOOP_CLIPS, _LOOP_OUTSIDE_FIX)
    return models[0]


def backward(
    accelerator: Accelerator, loss: torch.Tensor, optimizer: Optimizer, **kwargs: Any
) -> None:
    """``accelerator.backward(loss, **kwargs)``, stepping in backward only on a sync step.

    When ``accelerator.sync_gradients`` is false (a micro-batch that ``accelerator.accumulate``
    does not step on) the backward runs under :meth:`OptimizerInBackward.accumulate`, so the
    gradients are summed and the next syncing backward steps once on the sum, exactly as
    the plain optimizer's ``step()`` on that sync step would. Checks the accelerator first
    (:func:`check_accelerator`), and that the optimizer holds exactly the trainable parameters
    of the prepared model it shares a parameter with (:func:`_checked_model`).
    """
    check_accelerator(accelerator)
    inner = in_backward_optimizer(optimizer)
    _checked_model(accelerator, inner)
    with _unless_syncing(accelerator, inner):
        accelerator.backward(loss, **kwargs)


@contextlib.contextmanager
def _unless_syncing(accelerator: Accelerator, *optimizers: OptimizerInBackward) -> Iterator[None]:
    """``accumulate()`` of each of ``optimizers`` on a micro-batch ``accelerator.accumulate``
    does not step on (``accelerator.sync_gradients`` false when the context is entered)."""
    with contextlib.ExitStack() as stack:
        if not accelerator.sync_gradients:
            for optimizer in optimizers:
                stack.enter_context(optimizer.accumulate())
        yield


def _in_backward_optimizers(accelerator: Accelerator) -> list[OptimizerInBackward]:
    """The in-backward optimizers ``accelerator`` holds now (``accelerator._optimizers``, which
    ``free_memory()`` empties)."""
    return [in_backward_optimizer(o) for o in accelerator._optimizers if _wraps_in_backward(o)]


_WRAPPED = "_fused_optim_dist_step_on_sync_only"
"""Marks the ``accelerator.backward`` :func:`_step_on_sync_only` installed."""


def _step_on_sync_only(accelerator: Accelerator) -> None:
    """Make this instance's ``accelerator.backward``, and any backward inside its
    ``accelerator.accumulate(...)``, run under ``accumulate()`` of every in-backward optimizer
    the accelerator holds on a micro-batch it does not step on, as :func:`backward` does: the
    accelerate loop written for a plain optimizer, ``accelerator.backward(loss)`` (or
    accelerate's own example, ``loss.backward()``) inside ``accelerator.accumulate(model)``,
    then sums them, where it stepped the first micro-batch in backward (1.0e-2 moved before
    the second was refused). Any backward inside ``accelerator.no_sync(model)`` (accelerate's
    manual accumulation: ``with accelerator.no_sync(model): accelerator.backward(loss_a)``,
    then ``accelerator.backward(loss_b); optim.step()``) runs under ``accumulate()`` too: on
    one process ``no_sync`` does nothing and ``sync_gradients`` stays true, so the first
    micro-batch was stepped in backward and the second refused after every parameter had
    moved 1.0e-2.

    [Note: accelerate's no_sync]
    Every backward inside ``accelerator.no_sync(model)`` only accumulates. Under DDP a
    forward inside it decides that its backward, wherever it runs, does not synchronize:
    ``trigger_sync_in_backward``'s example runs two forwards inside ``no_sync``, then
    ``accelerator.backward(loss_a)`` outside it, then ``accelerator.backward(loss_b)`` inside
    ``trigger_sync_in_backward(model)``, then ``optim.step()``. So after a ``no_sync`` context
    in which ``accelerator.backward`` did not run (forwards only), the backwards accumulate
    until one inside ``trigger_sync_in_backward``, which steps (the next ``no_sync`` or
    ``accumulate`` ends this too). A backward that only accumulates where the plain loop
    would have stepped is still exact: ``step()`` steps the gradients it left (a
    ``loss.backward()`` inside ``no_sync``, not seen here, costs that saving, nothing more).
    A ``loss.backward()`` after such a context is not seen either: it steps, and the next
    backward of the step is refused, after that update.

    The optimizers are looked up at each call, not kept: after ``accelerator.free_memory()``
    an optimizer the loop deleted is gone (kept, it stayed live, and a new one on the same
    parameters was refused as a second in-backward optimizer). Wraps once per accelerator."""
    if getattr(accelerator.backward, _WRAPPED, False):
        return
    original_backward = accelerator.backward
    original_accumulate = accelerator.accumulate
    original_no_sync = accelerator.no_sync
    original_trigger = accelerator.trigger_sync_in_backward
    # See [Note: accelerate's no_sync]: inside a no_sync context, whether
    # accelerator.backward ran in it, and whether the last one ran none (forwards only).
    in_no_sync = backward_in_no_sync = forwards_only = False

    @functools.wraps(original_backward)
    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        nonlocal backward_in_no_sync
        # A GradScaler put on the accelerator after prepare() would scale this backward's
        # gradients before they are stepped, and a parameter unfrozen since would be left out
        # of the optimizer's norm or the loop's: both refused before it runs.
        _refuse_grad_scaler(accelerator)
        optimizers = _in_backward_optimizers(accelerator)
        for optimizer in optimizers:
            _checked_model(accelerator, optimizer)
        backward_in_no_sync |= in_no_sync
        with contextlib.ExitStack() as stack:
            stack.enter_context(_unless_syncing(accelerator, *optimizers))
            if forwards_only:
                for optimizer in optimizers:
                    stack.enter_context(optimizer.accumulate())
            original_backward(loss, **kwargs)

    @functools.wraps(original_accumulate)
    @contextlib.contextmanager
    def accumulate(*models: nn.Module) -> Iterator[None]:
        nonlocal forwards_only
        forwards_only = False
        # accelerate sets sync_gradients on entering its context, before the second reads it.
        with (
            original_accumulate(*models),
            _unless_syncing(accelerator, *_in_backward_optimizers(accelerator)),
        ):
            yield

    @functools.wraps(original_no_sync)
    @contextlib.contextmanager
    def no_sync(model: nn.Module) -> Iterator[None]:
        nonlocal in_no_sync, backward_in_no_sync, forwards_only
        outer = in_no_sync, backward_in_no_sync  # a no_sync context this one is nested in
        in_no_sync, backward_in_no_sync, forwards_only = True, False, False
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(original_no_sync(model))
                for optimizer in _in_backward_optimizers(accelerator):
                    stack.enter_context(optimizer.accumulate())
                yield
        finally:
            forwards_only = not backward_in_no_sync
            # This context's backwards ran in the outer one too.
            in_no_sync, backward_in_no_sync = outer[0], outer[1] or backward_in_no_sync

    @functools.wraps(original_trigger)
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: nn.Module) -> Iterator[None]:
        nonlocal forwards_only
        forwards_only = False
        with original_trigger(model):
            yield

    setattr(backward, _WRAPPED, True)
    accelerator.backward = backward  # type: ignore[method-assign]
    accelerator.accumulate = accumulate  # type: ignore[method-assign]
    accelerator.no_sync = no_sync  # type: ignore[method-assign]
    accelerator.trigger_sync_in_backward = trigger_sync_in_backward  # type: ignore[method-assign]


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
    (:func:`hook_swapped_parameters`) and makes ``accelerator.backward``, and any backward
    inside ``accelerator.accumulate(...)``, accumulate on the micro-batches it does not step on
    (so that ``accelerator.backward(loss)`` or ``loss.backward()`` works as :func:`backward`;
    ``accelerator.backward`` also refuses a GradScaler put on the accelerator later, before
    the backward runs; :func:`_step_on_sync_only`). Each in-backward optimizer then meets the
    model the accelerator prepared that shares a parameter with it, in this call or an
    earlier one, in either order (see [Note: an optimizer meets its model]). Returns what
    ``accelerator.prepare`` returns.

    Raises:
        ValueError: for the set-ups :func:`check_accelerator` refuses (before preparing), and
            for an optimizer that does not hold exactly the trainable parameters of the one
            prepared module it shares parameters with (:func:`_checked_model`; after
            preparing, before any backward).
    """
    check_accelerator(accelerator)
    prepared = accelerator.prepare(*args)
    # One object back for one passed; else a tuple, or a list on the FSDP2 path.
    objects = prepared if len(args) > 1 else (prepared,)
    for obj in objects:
        if isinstance(obj, Optimizer) and _wraps_in_backward(obj):
            hook_swapped_parameters(obj)
            _step_on_sync_only(accelerator)
    _meet_models(accelerator, {id(obj) for obj in objects})
    return prepared


def _meet_models(accelerator: Accelerator, new: set[int]) -> None:
    """Check each in-backward optimizer ``accelerator`` prepared against its model
    (:func:`_checked_model`), and sum its norm in the model's parameter order where the
    optimizer or the model is among the objects just prepared (ids in ``new``; an order set
    by hand after an earlier ``prepare`` stays).

    [Note: an optimizer meets its model]
    The loop clips over ``model.parameters()`` (``accelerator.clip_grad_norm_``), the
    optimizer in backward over its own parameters, summing the per-tensor norms in its
    groups' order. Its model is the module the accelerator has prepared
    (``accelerator._models``: by this ``prepare``, accelerate's own, or ``prepare_model``)
    that shares a trainable parameter with it (one per set of parameters: a module and the
    compiled wrapper accelerate keeps beside it are one), so a model prepared in another call
    than its optimizer, before or after it, is found as in one call, and a second model with
    an optimizer of its own (a GAN's generator and discriminator) is kept apart. Where the
    optimizer clips (``max_grad_norm``) it must hold exactly the model's trainable parameters
    (:func:`_refuse_other_parameters`; again before every backward of the wrapped
    ``accelerator.backward``, for a parameter unfrozen since); unclipped, every update is the
    plain one whatever it holds. It sums its
    norm in the model's parameter order (:meth:`~fused_optim_dist.OptimizerInBackward
    .set_norm_order`): ``clip_grad_norm_``'s norm bit for bit where one bucket (prepared in
    two calls, the order was not set: CompactAdamW ended 1.9e-5 apart after 40 clipped
    steps). A clipping optimizer sharing parameters with several prepared modules (a model
    and a criterion with learnable parameters) is refused: which of them the loop clips is not
    known here (the plain loop clipped the model alone, and ours clipped all by their joint
    norm: 9.7e-3 apart after eight steps).
    """
    for wrapper in accelerator._optimizers:
        if not _wraps_in_backward(wrapper):
            continue
        optimizer = in_backward_optimizer(wrapper)
        model = _checked_model(accelerator, optimizer)
        if model is not None and not new.isdisjoint((id(wrapper), id(model))):
            optimizer.set_norm_order(model.parameters())


def _wraps_in_backward(optimizer: Optimizer) -> bool:
    try:
        in_backward_optimizer(optimizer)
    except TypeError:
        return False
    return True
