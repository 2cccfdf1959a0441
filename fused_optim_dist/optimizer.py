"""``OptimizerInBackward``: a drop-in ``torch.optim.Optimizer`` that steps during backward."""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import warnings
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, NoReturn

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from fused_optim_dist._class_state import instance_attrs
from fused_optim_dist._classes import GROUP_CLASS_KEY, ClassSteppers, class_path
from fused_optim_dist._engine import BackwardPass, autocast_enabled
from fused_optim_dist._freed import FreedGradients, Refusal, is_freed, keep_as_zeros, refuse_freed
from fused_optim_dist._gradients import GradientProcessor, all_zero
from fused_optim_dist._kinds import Stepping, keeps_state_per_parameter, stepping_of
from fused_optim_dist._left_updates import LEFT_UPDATES
from fused_optim_dist._options import InBackwardOptions, split_options
from fused_optim_dist._plan import BucketPlan
from fused_optim_dist._protocol import (
    PendingUpdates,
    StaleCopies,
    describe,
    refuse_committed_again,
    refuse_stepping_again,
)
from fused_optim_dist._sharing import refuse_shared_memory, refuse_shared_state
from fused_optim_dist._stepping import BucketStepper, Stepper, local_gradients
from fused_optim_dist._torch_internals import (
    OPTIMIZER_HOOKS,
    current_backward_id,
    drop_grads,
    enclosing_backward,
    fsdp_sync_off,
    global_step_pre_hooks,
    holds_hook,
    hooked_after,
    impl_address,
    in_scaled_backward,
    observes_only,
    read_grads,
    read_requires_grad,
    register_post_accumulate_grad_hook,
    watch_loss_scaling,
    watch_saved_tensors_hooks,
    watch_wrappers,
    when_node_returns,
    will_get_gradient,
    wrapped_by,
    wrappers_holding,
)
from fused_optim_dist._validation import check_param_groups, resolve_optimizer_class
from fused_optim_dist._whole_tensor import WholeTensorStepper

__all__ = ["OptimizerInBackward", "in_backward"]

# id(parameter) -> weak reference to the OptimizerInBackward whose hooks step it: a model
# must not keep an optimizer alive, nor this table a parameter, and a weak reference to a
# parameter would make swap_tensors refuse it (see [Note: tensors swapped whole] in
# _torch_internals.py). The owner's plan, which holds its parameters, tells a recycled id.
_OWNERS: dict[int, weakref.ref[OptimizerInBackward]] = {}


# The live optimizers clipping by norm, for _refuse_clipping_beside.
_CLIPPING_BY_NORM: weakref.WeakSet = weakref.WeakSet()


class _Hook(NamedTuple):
    """This optimizer's hook on a parameter: its handle's id, and the C++ tensor it was
    registered on (see [Note: tensors swapped whole] in ``_torch_internals.py``)."""

    handle_id: int
    impl: int


def _owner(param: torch.Tensor) -> OptimizerInBackward | None:
    ref = _OWNERS.get(id(param))
    owner = None if ref is None else ref()
    if owner is None or owner._plan is None or not owner._plan.holds(param):
        return None
    return owner


def uncommitted_weights_error(model: nn.Module, what: str) -> RuntimeError | None:
    """The refusal of ``what``, a save of ``model``'s weights, where one of them holds an update
    made in backward that no ``step()`` committed: awaiting its optimizer's ``step()`` (written
    since or not, as a forward there: [Note: a forward between backward and step()] in
    ``_protocol.py``), or left by an optimizer collected or detached after a backward ([Note:
    updates left uncommitted]). The plain loop's weights there are those of before that
    backward, so the file would hold weights the plain loop's does not. ``None`` where none
    does."""
    params = list(model.parameters())
    owners = {id(owner): owner for owner in map(_owner, params) if owner is not None}
    for owner in owners.values():
        read = owner._pending.refused_reads(params)
        if read:
            return RuntimeError(
                f"{what} would save {describe(read[0])}, updated in backward with no "
                "optimizer.step() since. A plain optimizer updates it at step(), so the plain "
                f"loop's {what} here saves the weights of before the update (or a write over "
                "them). Nothing was saved. Call optim.step() first, and save after it; to roll "
                "the backward back, load the model and the optimizer's state first."
            )
    left = [param for param in params if LEFT_UPDATES.holds(param)]
    if left:
        return RuntimeError(
            f"{what} would save {describe(left[0])}, which holds an update an "
            "OptimizerInBackward made in backward that no step() committed: that optimizer was "
            "collected or detached after a backward (a loop that stopped after a backward: a "
            "step budget checked after backward?). A plain optimizer never applies that "
            f"backward's gradients, so the plain loop's {what} saves the weights of before it. "
            "Nothing was saved. Load the weights of before that backward (the last checkpoint) "
            "to save what the plain loop would, or load these weights as they are "
            "(model.load_state_dict(model.state_dict())) to keep the update; end a loop before "
            "a backward, or call step() after it."
        )
    return None


def _forget_owner(ids: set[int]) -> None:
    """Drop the entries of ``ids`` whose owner is gone (the optimizer was collected)."""
    for key in ids:
        ref = _OWNERS.get(key)
        if ref is not None and ref() is None:
            del _OWNERS[key]


def _grad_ready_hook(optimizer: OptimizerInBackward) -> Callable[[torch.Tensor], None]:
    # The hook holds the optimizer weakly: a parameter must not keep an optimizer alive, and
    # hooks of a collected optimizer must not step anything.
    ref = weakref.ref(optimizer)

    # Never traced: a backward called inside a torch.compile'd function runs its hooks while
    # Dynamo evaluates frames, and a traced update would round otherwise than the eager kernel
    # the plain optimizer's step() runs (9.5e-7 apart after 20 AdamW steps).
    @torch.compiler.disable
    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)

    return hook


def _freed_refusal(optimizer: OptimizerInBackward) -> Refusal:
    """What a freed gradient of ``optimizer`` calls to raise; holds it weakly (a parameter's
    ``.grad`` must not keep an optimizer alive). See [Note: freed gradients]."""
    ref = weakref.ref(optimizer)

    def refuse(param_id: int, operation: str, func: Any) -> NoReturn:
        owner = ref()
        param = None
        if owner is not None:  # an error path: a pass over the groups is no cost
            listed = (p for group in owner.param_groups for p in group["params"])
            param = next((p for p in listed if id(p) == param_id), None)
        if owner is not None and param is not None and operation == "accumulate":
            # A second gradient before step(): the protocol's cases, named as such.
            if owner._pass is not None:
                owner._pass.refuse_if_stepped(param)
            if owner._pending.holds(param):
                owner._pending.refuse_second_gradient(param)
        refuse_freed(param, operation, func)

    return refuse


def _wrapper_error(module: nn.Module, kind: type[Exception] = RuntimeError) -> Exception:
    """DDP and FSDP1 reduce gradients outside the post-accumulate-grad hooks this optimizer
    steps in; FSDP2 (``fully_shard``) and ``replicate`` reduce them before calling those hooks."""
    if issubclass(type(module), nn.parallel.DistributedDataParallel):
        return kind(
            "these parameters are trained by DistributedDataParallel, whose gradient all-reduce "
            "runs after the post-accumulate-grad hooks, so stepping in backward would use "
            "unreduced gradients (and DDP's own step after backward would update them twice). "
            "Shard the model with fully_shard, or for data parallel use replicate from "
            "torch.distributed._composable.replicate_with_fsdp (FSDP2's all-reduce twin), "
            "before building the optimizer."
        )
    return kind(
        "these parameters are trained by FullyShardedDataParallel (FSDP1), which reduces "
        "gradients outside the post-accumulate-grad hooks this optimizer steps in: with "
        "use_orig_params=False the hooks see each unit's unreduced, unsharded gradient, and "
        "with use_orig_params=True no hook runs in backward and each rank holds flat slices of "
        "the parameters, which max_grad_norm and skip_nonfinite would measure as whole local "
        "tensors. Shard the model with fully_shard (FSDP2; accelerate and Hugging Face's "
        "Trainer: fsdp_version 2) before building the optimizer, or keep the plain optimizer "
        "with FSDP1."
    )


def _nested_in_hook_error() -> RuntimeError:
    """A backward run from a hook of another backward (GradCache's surrogate backwards, as in
    sentence-transformers' ``Cached*`` losses, run from a tensor hook of the returned loss).
    The plain optimizer sums the gradients of all of them and steps once at ``step()``; here
    each would be a pass of its own, stepped when it ends, and the next one's gradients would
    reach updated weights. A backward nested in a Function's ``backward`` (reentrant
    checkpointing) joins the outer pass, finished from a post hook of that Function's node
    ([Note: one backward, one BackwardPass] in ``_engine.py``); a hook offers no such node, so
    this is refused at the nested backward's first gradient, before anything moves."""
    return RuntimeError(
        "a backward run from a hook of another backward (a tensor hook calling backward(), "
        "as GradCache does in sentence-transformers' Cached* losses) would be stepped on its "
        "own when it ends, where the plain optimizer sums the gradients of every such "
        "backward and steps once at optimizer.step(). Run the nested backwards under "
        "`with optim.accumulate():` and call optim.step() after the outer backward, or use "
        "the plain optimizer (with Hugging Face's Trainer, which reads the norm of a "
        "stepping backward before step()). Nothing was stepped by this backward."
    )


def _note_saved_through_hooks(tensor: torch.Tensor) -> None:
    """``tensor`` was saved for backward through saved-tensor hooks: where it is a parameter
    of an optimizer, a second pass of that optimizer before its ``step()`` is refused (see
    ``_refuse_second_pass``)."""
    owner = _owner(tensor)
    if owner is not None:
        owner._saved_through_hooks = True


def _refuse_updated_read(tensor: torch.Tensor, version: int) -> None:
    """Raise if ``tensor``, saved for backward through saved-tensor hooks when its version
    counter read ``version`` and written in place since, holds the memory of a parameter an
    update in backward wrote after that (not yet committed by ``step()``): the node reading
    it would compute with the updated weight, where the plain optimizer's backward reads the
    old one (a parameter read through ``.detach()`` under non-reentrant checkpointing or
    ``save_on_cpu``). Without such hooks autograd refuses the same read ("modified by an
    inplace operation"). A write of the loop's own is left to autograd's rules, as in the
    plain loop. Only called where a tensor's memory changed under a saved tensor."""
    address = tensor.untyped_storage().data_ptr()
    owners = {id(o): o for o in (ref() for ref in list(_OWNERS.values())) if o is not None}
    if any(owner._pending.wrote_after(address, version) for owner in owners.values()):
        raise RuntimeError(
            "a tensor saved for backward through saved-tensor hooks (activation "
            "checkpointing with use_reentrant=False, torch.autograd.graph.save_on_cpu, "
            "activation offloading) holds the memory of a parameter this backward already "
            "updated (read through .detach() in the forward?): the node reading it would "
            "compute with the updated weight, where the plain optimizer's backward reads "
            "the old one (without such hooks autograd refuses it: 'modified by an "
            "inplace operation'). Read the parameter with its gradient, or outside the "
            "hooks; the buckets stepped before this node moved."
        )


def _clipped_apart_error(other: OptimizerInBackward, moved: bool) -> RuntimeError:
    """Two optimizers clipping by norm get gradients from one backward. See [Note: clipping
    inside one backward] in ``_gradients.py``."""
    what_moved = (
        "Buckets completed before this gradient arrived were stepped"
        if moved
        else "Nothing was stepped"
    )
    return RuntimeError(
        "this backward gives gradients to two OptimizerInBackward clipping by norm (this one "
        f"and one over {other.optimizer_cls.__name__}): each would clip its own parameters by "
        "their own norm, where a plain loop's clip_grad_norm_(model.parameters(), ...) clips "
        "all of them by their joint norm. Hold the parameters in one OptimizerInBackward "
        "(param groups may name their classes: {'params': matrices, 'optimizer_cls': "
        "torch.optim.Muon}), which clips them together; or, to clip each optimizer's "
        "parameters apart (clip_grad_norm_ called on each one's parameters), pass "
        f"clip_alone=True to both. {what_moved}."
    )


def _loss_scaling_error(what: str) -> RuntimeError:
    """``torch.amp.GradScaler`` driving this optimizer: each gradient of the scaled loss would
    be stepped in backward as it arrives, before GradScaler could unscale it or skip a step
    with inf/NaN gradients. ``what`` says where it was found."""
    return RuntimeError(
        f"torch.amp.GradScaler cannot drive OptimizerInBackward: {what}. Train with bf16 "
        "autocast (torch.autocast(device_type, "
        "dtype=torch.bfloat16)), which needs no loss scaling, and use skip_nonfinite=True to "
        "skip non-finite buckets; or use the plain optimizer with GradScaler."
    )


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _warn_uncommitted(pending: PendingUpdates) -> None:
    """Warn, as the optimizer is collected or the process exits, if updates made in backward
    never had their ``step()``; a forward reading those parameters, and an optimizer built over
    them, are refused from then on (see [Note: updates left uncommitted] in
    ``_left_updates.py``)."""
    if pending:
        LEFT_UPDATES.leave(pending)
        warnings.warn(
            f"OptimizerInBackward ended with {len(pending.params())} parameter(s) holding "
            "updates made in backward that no step() followed: the loop stopped after a "
            "backward (a step budget checked after backward?), where a plain optimizer would "
            "not have applied that backward's gradients. A forward reading those weights is "
            "refused from now on, and so are an OptimizerInBackward built over them and "
            "fused_optim_dist's saves of them; torch.save of them holds the update. Until "
            "they are loaded or collected, a torch.compile'd forward runs that check outside "
            "its graph, breaking the graph at each module. Call step() after every backward "
            "whose gradients train, and stop the loop before the backward otherwise.",
            RuntimeWarning,
            stacklevel=1,
        )


def _held_by_a_module(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is registered on a live ``nn.Module`` (scans the heap)."""
    wanted = {id(p) for p in params}
    return any(
        issubclass(type(obj), nn.Module)
        and any(id(p) in wanted for p in obj._parameters.values() if p is not None)
        for obj in gc.get_objects()
    )


def _overrides(optimizer: Optimizer, name: str) -> bool:
    """Whether the class of ``optimizer`` overrides ``torch.optim.Optimizer``'s ``name``."""
    return getattr(type(optimizer), name) is not getattr(Optimizer, name)


def _groups_by_class(
    params: list[Any], default: type[Optimizer]
) -> dict[type[Optimizer], list[Any]]:
    """The user's groups by optimizer class, classes in order of first appearance (plain
    tensors: all the default class's). See [Note: groups of several classes]."""
    if not all(isinstance(p, dict) for p in params):
        return {default: params}
    by_class: dict[type[Optimizer], list[Any]] = {}
    for group in params:
        cls = resolve_optimizer_class(group.get(GROUP_CLASS_KEY, default))
        by_class.setdefault(cls, []).append(group)
    return by_class


def _in_user_order(
    params: list[Any], default: type[Optimizer], inners: dict[str | None, Optimizer]
) -> list[dict[str, Any]]:
    """The groups the classes built, in the order the user listed them."""
    if not all(isinstance(p, dict) for p in params):
        return inners[None].param_groups
    built = {key: iter(inner.param_groups) for key, inner in inners.items()}
    groups = []
    for group in params:
        cls = resolve_optimizer_class(group.get(GROUP_CLASS_KEY, default))
        groups.append(next(built[None if cls is default else class_path(cls)]))
    return groups


def _steppers(
    inners: dict[str | None, Optimizer], default: type[Optimizer], override: str | None
) -> ClassSteppers:
    """One stepper per class, stepping as the class is declared (``override``: the
    default class's ``stepping`` option)."""
    steppers: dict[str | None, Stepper] = {}
    joint: set[str | None] = set()
    for key, inner in inners.items():
        stepping = stepping_of(type(inner), override if key is None else None)
        if stepping is Stepping.JOINT:
            joint.add(key)
            warnings.warn(
                f"{type(inner).__name__} is not declared to OptimizerInBackward, so it is "
                "stepped jointly: its gradients are held to the end of backward and its step() "
                "runs once there on all of them, exactly as the plain optimizer's, but without "
                "releasing gradients early. If its update of a parameter reads no other "
                "parameter, declare it (fused_optim_dist.declare_stepping('elementwise' or "
                "'dtensor')) or pass stepping=... to step it in backward, bucket by bucket.",
                stacklevel=3,
            )
        steppers[key] = (
            WholeTensorStepper(inner)
            if stepping is Stepping.WHOLE_TENSOR
            else BucketStepper(inner, local_shards=stepping is Stepping.ELEMENTWISE)
        )
    trackable = {k: not isinstance(s, WholeTensorStepper) for k, s in steppers.items()}
    return ClassSteppers(steppers, trackable, joint)


def _as_group(param_group: dict[str, Any]) -> dict[str, Any]:
    """``param_group`` with its ``params`` materialised once, as torch.optim does.

    A generator (``model.head.parameters()``) can be read only once: reading it for our checks
    and again in ``Optimizer.add_param_group`` would store an empty group.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, not {type(param_group).__name__}")
    params = param_group.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    elif params is None:
        raise ValueError("param_group has no 'params' entry")
    else:
        params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named):  # (name, parameter) pairs, as torch.optim takes them
        if not all(named):
            raise ValueError(
                "all optimizer params should be with/without names. Some param names are missing"
            )
        return {
            **param_group,
            "params": [p for _, p in params],
            "param_names": [n for n, _ in params],
        }
    return {**param_group, "params": params}


_REATTACHED = frozenset(
    {
        "_hook_handles",
        "_hooked",
        "_claimed",
        "_detached",
        "_plan",
        "_pass",
        "_freed",
        "_stale_copies",
    }
)
"""What ``_attach_hooks`` builds anew for a copy: never copied or pickled."""

_LEFT_OUT = frozenset({*OPTIMIZER_HOOKS, "step", "_opt_called"})
"""What ``torch.optim.Optimizer.__getstate__`` leaves out of a copy or pickle, so a copy here
leaves it out too: the hooks (a copy starts without any), and an LR scheduler's wrapper of
``step`` with its flag, which would step the optimizer it was built on, not the copy."""


class OptimizerInBackward(Optimizer):
    """Step ``optimizer_cls`` on each parameter as soon as its gradient is ready, in backward.

    Built on the parameters of a model after ``fully_shard``, it hooks every trainable
    parameter. FSDP2 calls these hooks right after it reduce-scatters a unit's gradients; when
    the last gradient of a unit arrives, each rank steps its local shards of the whole unit in
    one call per param group and frees the gradients. Gradients of the whole model are never
    held at once. See [Note: why buckets follow FSDP units]. Until ``zero_grad()``, a stepped
    parameter's ``.grad`` holds a freed gradient (no memory), which raises when a loop reads
    it, keeps it as zeros in place or adds the next backward to it: see [Note: freed
    gradients].

    The object is a ``torch.optim.Optimizer``: ``param_groups`` hold the user's parameters and
    every key ``optimizer_cls`` puts in its groups (values written there, e.g. by an LR
    scheduler, apply from the next backward on), and ``state``, ``state_dict()`` and
    ``load_state_dict()`` are those ``optimizer_cls`` would have on the same parameters, so
    ``torch.distributed.checkpoint`` saves and reshards them like any optimizer's.

    Which parameters are stepped together is derived from ``param_groups`` and each
    parameter's ``requires_grad`` and rebuilt when either changes (groups added, a block frozen
    or unfrozen): see [Note: a plan is derived, never patched]. The state of one backward lives
    in a ``BackwardPass``: see [Note: one backward, one BackwardPass].

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. Frozen parameters
            may be included; they are stepped from the first backward after they are unfrozen.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, or its dotted import path.
        options: this class's own options (:class:`InBackwardOptions`). Its fields may instead
            be given as keyword arguments, unless ``optimizer_cls`` takes one of the same name.
        **kwargs: ``optimizer_cls``'s keyword arguments (and :class:`InBackwardOptions`
            fields, when ``options`` is not given).

    Raises:
        ValueError: for an empty parameter list, a parameter listed twice, two parameters
            over one memory (see [Note: parameters sharing memory]), no trainable parameter,
            an optimizer that needs a closure or sparse gradients, parameters trained by
            ``DistributedDataParallel`` or FSDP1's ``FullyShardedDataParallel``, or already
            driven by another live ``OptimizerInBackward``.
        TypeError: for an option given both ways, or a keyword both we and the class take.
    """

    # torch.amp.GradScaler then hands step() its scale instead of unscaling gradients that
    # are gone: step() recognises it and raises a clear error.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer] | str,
        *,
        options: InBackwardOptions | None = None,
        **kwargs: Any,
    ) -> None:
        watch_wrappers()
        watch_loss_scaling()
        watch_saved_tensors_hooks(_note_saved_through_hooks, _refuse_updated_read)
        optimizer_cls = resolve_optimizer_class(optimizer_cls)
        options, optimizer_kwargs = split_options(optimizer_cls, options, kwargs)
        params = list(params)
        if not params:
            raise ValueError("OptimizerInBackward got an empty parameter list")
        # Each class built on its own groups (see [Note: groups of several classes]), so that
        # groups get exactly its keys and defaults (and any state its constructor creates, as
        # Adagrad's).
        by_class = _groups_by_class(params, optimizer_cls)
        inners: dict[str | None, Optimizer] = {}
        for cls, groups in by_class.items():
            key = None if cls is optimizer_cls else class_path(cls)
            inners[key] = cls(
                [{k: v for k, v in g.items() if k != GROUP_CLASS_KEY} for g in groups]
                if key is not None or isinstance(groups[0], dict)
                else groups,
                **(optimizer_kwargs if key is None else {}),
            )
            if key is not None:
                for group in inners[key].param_groups:
                    group[GROUP_CLASS_KEY] = key
        param_groups = _in_user_order(params, optimizer_cls, inners)
        check_param_groups(param_groups)
        self._check_not_driven_elsewhere(
            [p for g in param_groups for p in g["params"] if p.requires_grad]
        )
        state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for inner in inners.values():
            state.update(inner.state)
        first = inners.get(None, next(iter(inners.values())))
        # Optimizer.__setstate__ initialises the base class (hook dicts, profiled step) around
        # the wrapped optimizer's groups and state, without re-validating them.
        # (It also adds "differentiable" to the defaults it is given, which the wrapped class's
        # own defaults may lack: groups added later must get exactly the class's keys.)
        super().__setstate__(
            {"defaults": dict(first.defaults), "state": state, "param_groups": param_groups}
        )
        self.defaults = first.defaults
        self.optimizer_cls = optimizer_cls
        self.options = options
        # Each class's step code, run on one bucket at a time.
        self._stepper = _steppers(inners, optimizer_cls, options.stepping)
        # Norm, non-finite check and clipping, and their history across steps.
        self._gradients = GradientProcessor(options)
        # Whether a gradient ever reached this object's params (or they were found live).
        self._ever_arrived = False
        # Updates made in backward since the last step(). See [Note: the step protocol].
        self._pending = PendingUpdates()
        # Whether a backward stepped since the last step().
        self._stepped_since_step = False
        # Whether a parameter was saved for backward through saved-tensor hooks since the last
        # step(): see _refuse_second_pass.
        self._saved_through_hooks = False
        # Whether a gradient reached a parameter since the last step() or zero_grad(). See
        # [Note: gradients held for step()].
        self._arrived_since_step = False
        # The state's keys when the first pass since the last step() (or a discarded
        # backward) began (see _order_new_state); None before one.
        self._keys_before: set[int] | None = None
        self._accumulate_depth = 0
        # The backward whose gradients are held for step(), if the last one was: taken as a
        # micro-batch (see [Note: FSDP2's micro-batches]), or with a group a class cannot step
        # as it is now (see [Note: a backward held for step()]).
        self._held_backward: int | None = None
        self._attach_hooks()

    def _attach_hooks(self) -> None:
        """Start the hook bookkeeping (at construction, and for a deep copy)."""
        if self.options.max_grad_norm is not None:
            _CLIPPING_BY_NORM.add(self)
        # When clipping by norm, the backwards that gave a gradient here (stepped or held)
        # since the last step(), and those they ran nested in: see _refuse_clipping_beside.
        self._clipped_backwards: set[int] = set()
        # Hooks on the trainable parameters; removed when this object is collected.
        self._hook_handles: list[RemovableHandle] = []
        # Each hooked parameter's hook, by id(param) (looked up for the parameters of the
        # current plan only, which holds them): see _hook_new.
        self._hooked: dict[int, _Hook] = {}
        # The ids this optimizer claimed in _OWNERS, dropped there once it is collected.
        self._claimed: set[int] = set()
        self._detached = False
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        weakref.finalize(self, _forget_owner, self._claimed)
        weakref.finalize(self, _warn_uncommitted, self._pending)
        # The bucket plan, rebuilt when stale, and the backward pass in progress (or the last).
        self._plan: BucketPlan | None = None
        self._pass: BackwardPass | None = None
        # Forward hooks on FSDP2 units gathered before step(): see [Note: copies gathered
        # before step()].
        self._stale_copies = StaleCopies()
        # What stepped parameters' .grad holds until zero_grad(). See [Note: freed gradients].
        self._freed = FreedGradients(_freed_refusal(self))
        self._current_plan()

    # ------------------------------------------------------------------ the plan and hooks

    def _check_not_driven_elsewhere(self, trainable: list[torch.Tensor]) -> None:
        LEFT_UPDATES.refuse_driven(trainable)
        for param in trainable:
            owner = _owner(param)
            if owner is not None and owner is not self and owner._hook_handles:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is already stepped in backward "
                    "by another live OptimizerInBackward; call .detach() on that one first (its "
                    "state is kept; after its step() if a backward since its last step() "
                    "updated them) or pass disjoint parameters"
                )
        wrappers = wrappers_holding(trainable)
        if wrappers:
            raise _wrapper_error(wrappers[0], ValueError)

    def _current_plan(self) -> BucketPlan:
        """The bucket plan of the param groups as they are now; hooks on every param (frozen too).

        Rebuilt when a group was added or loaded, or a ``requires_grad`` flipped: see
        [Note: a plan is derived, never patched]. Costs one pass over the parameters.
        """
        plan = self._plan
        if plan is not None and plan.is_current(self.param_groups):
            plan.refuse_registered_since(self.param_groups)
            return plan
        plan = self._plan = BucketPlan(self.param_groups, self.options.plain_bucket_numel)
        # History of buckets this plan no longer has must not be predicted to come.
        self._gradients.keep_history_of([bucket.key for bucket in plan.buckets])
        self._hook_new(plan)
        return plan

    def _hook_new(self, plan: BucketPlan) -> None:
        """Hook the parameters of ``plan`` not hooked yet, frozen ones too, unless detached,
        and claim the trainable ones (see ``_check_not_driven_elsewhere``).

        A frozen parameter is hooked now so that, unfrozen later, its own gradient runs the
        hook. Hooked only when it became trainable, it would be hooked by the plan's rebuild at
        the backward's first hooked gradient, which may come after its own (an output head's
        is the first of a backward): that gradient was held to ``step()``, and a backward
        retried after that one failed stepped it with both gradients before being refused at a
        parameter the failed one had updated. A frozen parameter's hook runs only where
        autograd runs a leaf's hooks without a gradient (``BucketPlan.delivers_nothing``).
        Parameters of other dtypes (integer) can neither require grad nor take a hook."""
        if self._detached:
            return
        claimed = [p for p in plan.trainable if _owner(p) is not self]
        if claimed:
            self._check_not_driven_elsewhere(claimed)
            ref = weakref.ref(self)
            for param in claimed:
                _OWNERS[id(param)] = ref
                self._claimed.add(id(param))
        hook = None
        for param in (*plan.trainable, *plan.frozen):
            if not (param.is_floating_point() or param.is_complex()):
                continue
            hooked = self._hooked.get(id(param))
            # Our hook is in the parameter's dict (a handle's id is unique in the process:
            # never a recycled id) ...
            listed = hooked is not None and holds_hook(param, hooked.handle_id)
            # ... and that dict is run: by FSDP2's reduction, or registered on the C++ tensor
            # the parameter has now (see [Note: tensors swapped whole]).
            if listed and (
                plan.unit_of(id(param)) is not None or hooked.impl == impl_address(param)
            ):
                continue
            hook = hook or _grad_ready_hook(self)
            # Swapped whole since: a new dict, the old one left with the hooks that no longer
            # run, as they would not in the plain loop.
            handle = register_post_accumulate_grad_hook(param, hook, afresh=listed)
            self._hook_handles.append(handle)
            self._hooked[id(param)] = _Hook(handle.id, impl_address(param))

    def _new_pass(self, backward_id: int | None, *, record: bool = True) -> BackwardPass:
        if self._keys_before is None or not self._stepped_since_step:
            # The first pass since step(), or since a backward was discarded (rolled back, or
            # raised having stepped nothing): what the state holds now was not made by a pass.
            self._keys_before = set(map(id, self.state))
        return BackwardPass(
            backward_id,
            self._current_plan(),
            self._stepper,
            self._gradients,
            self.param_groups,
            self.state,
            self._pending,
            self._freed,
            record=record,
        )

    # ------------------------------------------------------------------ torch.optim.Optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim.Optimizer.add_param_group``) and hook its params.

        ``params`` may be any iterable, a generator included. Checked before anything changes.
        """
        param_group = _as_group(param_group)
        check_param_groups([*self.param_groups, param_group])
        if self.param_groups and ("param_names" in param_group) != (
            "param_names" in self.param_groups[0]
        ):
            # torch.optim's own check, which the wrapped class cannot make: it holds no
            # groups between steps.
            raise ValueError(
                "all optimizer param groups should be with/without names. "
                f"cannot add param group {'with' if 'param_names' in param_group else 'without'}"
                " names to the optimizer"
            )
        self._check_not_driven_elsewhere([p for p in param_group["params"] if p.requires_grad])
        groups = [*self.param_groups, param_group]
        params = [p for group in groups for p in group["params"]]
        refuse_shared_memory(groups, params, read_requires_grad(params))
        key = param_group.pop(GROUP_CLASS_KEY, None)
        if key is not None:
            key = class_path(resolve_optimizer_class(key))
            if key == class_path(self.optimizer_cls):
                key = None
        if key not in self._stepper.steppers:
            raise ValueError(
                f"add_param_group: optimizer_cls {key} is not one of this optimizer's classes; "
                "name every class in the param groups given at construction"
            )
        # Filled with the class's defaults and checked, by the class itself (CompactAdamW
        # refuses parameters it cannot step).
        inner = self._stepper.steppers[key].optimizer
        inner.add_param_group(param_group)
        group = inner.param_groups.pop()
        if key is not None:
            group[GROUP_CLASS_KEY] = key
        self.state.update(inner.state)
        inner.state = type(inner.state)()
        self.param_groups.append(group)
        self._current_plan()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Refused: a step pre-hook runs before the update, and here the updates happen in
        backward, before ``step()`` is called. Post-hooks (:meth:`register_step_post_hook`)
        run at ``step()`` as for a plain optimizer. The observers of torch's memory trackers
        (``torch.distributed._tools``, e.g. ``FSDPMemTracker``), which only note that the
        optimizer phase begins, are accepted.

        Raises:
            RuntimeError: for any other hook.
        """
        if not observes_only(hook):
            raise RuntimeError(
                "OptimizerInBackward cannot run a step pre-hook: it updates each parameter in "
                "backward, before step() is called, so the hook would see gradients that are "
                "already stepped and freed. Do the hook's work before backward (on the loss, "
                "or in a module backward hook) or use register_step_post_hook."
            )
        return super().register_step_pre_hook(hook)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the hooks and what hangs on them, as :meth:`__deepcopy__` copies:
        unpickled, the optimizer hooks the unpickled parameters (pickle the model in the
        same call, ``pickle.dumps((model, optim))``, for it to step the unpickled model)."""
        if self._pending:
            self._pending.refuse_snapshot("pickling")
        return {k: v for k, v in self.__dict__.items() if k not in _REATTACHED | _LEFT_OUT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_stepper" in state:
            # Unpickling what __getstate__ returned.
            self.__dict__.update(state)
            self._start_copy()
            return
        steppers = self.__dict__.get("_stepper")
        if steppers is not None:
            # load_state_dict: let each wrapped class fill in its groups' keys and convert
            # state written by older releases, as its own __setstate__ does.
            groups, entries = state["param_groups"], state["state"]
            filled: dict[int, dict[str, Any]] = {}
            merged: defaultdict[torch.Tensor, dict] = defaultdict(dict)
            for key, stepper in steppers.steppers.items():
                mine = [i for i, g in enumerate(groups) if g.get(GROUP_CLASS_KEY) == key]
                params = {p for i in mine for p in groups[i]["params"]}
                inner = stepper.optimizer
                if len(self.param_groups) == len(groups):
                    # The groups as they are, for a class that keeps their values where the
                    # loaded ones lack them (CompactAdamW's options in AdamW's state dict).
                    inner.param_groups = [self.param_groups[i] for i in mine]
                inner.__setstate__(
                    {
                        **state,
                        "param_groups": [groups[i] for i in mine],
                        "state": defaultdict(
                            dict, {p: v for p, v in entries.items() if p in params}
                        ),
                    }
                )
                filled.update(zip(mine, inner.param_groups, strict=True))
                merged.update(inner.state)
                inner.state, inner.param_groups = type(inner.state)(), []
            # In the loaded order, not class by class.
            ordered: defaultdict[torch.Tensor, dict] = defaultdict(dict)
            for param in entries:
                if param in merged:
                    ordered[param] = merged.pop(param)
            ordered.update(merged)
            state = {
                **state,
                "state": ordered,
                "param_groups": [filled[i] for i in range(len(groups))],
            }
        super().__setstate__(state)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``; refused while updates made in backward
        await ``step()``, where the plain optimizer's would not hold them yet (see [Note: the
        step protocol])."""
        if self._pending:
            self._pending.refuse_snapshot("state_dict()")
        self._refuse_overridden("state_dict", "save")
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``. While updates made in backward await
        ``step()``, that ``step()`` then refuses, and ``zero_grad()`` discards the updates once
        the model was restored too (see [Note: the step protocol]).

        Raises:
            ValueError: before anything is loaded, for a state dict holding one tensor in the
                state of two parameters: see [Note: state shared between parameters].
        """
        self._refuse_overridden("load_state_dict", "load")
        self._refuse_shared_state(state_dict)
        super().load_state_dict(state_dict)
        if self._pending:
            self._pending.loaded()

    def _refuse_shared_state(self, state_dict: dict[str, Any]) -> None:
        """Raise if ``state_dict`` holds one tensor in the state of two parameters of classes
        that keep all their state per parameter. See [Note: state shared between parameters].
        (Groups that do not match are left to ``torch.optim.Optimizer.load_state_dict``, which
        refuses them.)"""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            return
        entries = state_dict.get("state", {})
        per_bucket = [
            (key, entries[key])
            for saved, group in zip(groups, self.param_groups, strict=True)
            if keeps_state_per_parameter(type(self._stepper.optimizer_of(group)))
            for key in saved["params"]
            if key in entries
        ]
        refuse_shared_state(per_bucket, lambda key: f"parameter {key!r} of the state dict")

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizerInBackward:
        """A working copy on the copied parameters (hooked), as ``copy.deepcopy`` of a plain
        optimizer copies its parameters and state. Deep-copy the model in the same call
        (``copy.deepcopy((model, optim))``) for the copy to step the copied model."""
        if self._pending:
            self._pending.refuse_snapshot("copy.deepcopy()")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in _REATTACHED | _LEFT_OUT:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._start_copy()
        return new

    def _start_copy(self) -> None:
        """Make a copy or an unpickled optimizer work: its hooks on the parameters attached,
        and torch's optimizer hooks empty, as ``torch.optim.Optimizer.__setstate__`` leaves
        them (not called: it would add ``differentiable`` to the wrapped class's defaults)."""
        for name in OPTIMIZER_HOOKS:
            setattr(self, name, OrderedDict())
        self._attach_hooks()
        if self._keys_before is not None:
            # Ids of the original's keys. Copied between passes that only held gradients
            # (those that stepped refuse a copy), none created an entry since they began.
            self._keys_before = set(map(id, self.state))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; with ``set_to_none`` (the default), without
        its per-parameter ``__torch_function__`` lookups. Freed gradients (see [Note: freed
        gradients]) are dropped, or, with ``set_to_none=False``, replaced by the zero
        gradients the plain optimizer keeps, which hold the memory it holds (see [Note:
        gradients kept as zeros])."""
        if self._pending:
            # See [Note: the step protocol].
            if self._pending.rolled_back():
                self._pending.undo_draws()
                if self._pass is not None:
                    self._pass.undo_class_state()
                LEFT_UPDATES.forget(self._pending)
                self._pending.commit()
                self._pass = None
                self._stepped_since_step = False  # the rolled-back backward is undone
            else:
                self._pending.mark_unfinished(self._pass is not None and self._pass.abandoned)
                self._pending.refuse_discard(self.options.skip_nonfinite)
        # The step's gradients are dropped (a batch skipped without step()): the next pass's
        # norm is the next step's.
        self._gradients.end_of_step()
        self._arrived_since_step = False
        if self._pass is not None and self._pass.raised:
            # A backward that raised having stepped nothing, or only held buckets (to check
            # their class, or to step it jointly): nothing moved, and the loop drops the
            # gradients, as the plain loop skipping the batch does; step() must not step
            # them, and steps as after no backward (a class counting steps in its groups
            # counts this one).
            self._pass = None
            self._stepped_since_step = False
        params = [p for group in self.param_groups for p in group["params"]]
        if not set_to_none:
            # Freed gradients become the zero gradients the plain optimizer keeps: see [Note:
            # gradients kept as zeros].
            keep_as_zeros(params, read_grads(params))
            super().zero_grad(set_to_none=False)
        else:
            drop_grads(
                [p for p, grad in zip(params, read_grads(params), strict=True) if grad is not None]
            )
        self._freed.cleared()
        self._class_zero_grad(set_to_none)

    def _class_zero_grad(self, set_to_none: bool) -> None:
        """Run each wrapped class's own ``zero_grad`` (resetting a value its step reads, on
        itself or per parameter in ``state``) as the plain optimizer's runs: on its groups and
        the state, called as the loop called ours (no argument for the default)."""
        for key, stepper in self._stepper.steppers.items():
            instance = stepper.optimizer
            if not _overrides(instance, "zero_grad"):
                continue
            groups = [g for g in self.param_groups if g.get(GROUP_CLASS_KEY) == key]
            instance.param_groups, instance.state = groups, self.state
            try:
                if set_to_none:
                    instance.zero_grad()
                else:
                    instance.zero_grad(set_to_none=False)
            finally:
                instance.param_groups, instance.state = [], defaultdict(dict)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Commit the updates made in backward, and step the parameters that still hold a
        gradient (usually none).

        ``closure``, as torch.optim's classes take it (PyTorch Lightning passes one at every
        step: the training step, ``zero_grad()`` and the backward), is called first, with
        gradients enabled, and its value returned: its backward steps the parameters as any
        backward does, and ``step()`` then commits them. This is what the plain classes that
        evaluate a closure once do (SGD, Adam, AdamW, ...): call it, then update from the
        gradients it left. Classes that evaluate it several times (LBFGS) are refused when
        built.

        In the usual loop every gradient was consumed during backward; ``step()`` then ends the
        step: the updates are committed (see [Note: the step protocol]: until then a second
        gradient to an updated parameter, or a ``zero_grad()``, raises), post-hooks run, and a
        class that counts steps in its groups sees one step. Parameters holding a gradient (set
        by hand, accumulated under :meth:`accumulate`, left by a backward that raised, or the
        zero gradients ``torch.distributed.checkpoint`` sets to create state) are stepped,
        bucket by bucket, and their gradients freed: clipped by their global norm and checked
        for non-finite values together, all known before any moves (see [Note: what step()
        steps] in ``_gradients.py``), except those a backward that raised left, which complete
        that backward's clipping. Only DCP's state creation (no state, every
        gradient exactly zero, lr 0 in every group) leaves :meth:`grad_norm` and the clipping
        history as they were; any other step at lr 0 is an ordinary step.

        Raises:
            RuntimeError: if ``torch.amp.GradScaler`` called it (the gradients were stepped
                scaled, in backward); if a parameter holding a gradient was already updated in
                backward since the last ``step()``; if, since the updates made in backward,
                their gradients were dropped or their parameters, state or group values
                written (the plain optimizer would step differently: see [Note: the step
                protocol]); if called again with no backward since the last while the
                gradients it committed are held (see [Note: freed gradients]); or if no
                gradient ever reached this
                optimizer and none of its parameters is registered on a live module: it was
                built on parameters that ``fully_shard`` replaced, so nothing would ever train.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._commit_step()
        return loss

    def _commit_step(self) -> None:
        """:meth:`step` after its closure: the checks, the gradients still held, the commit."""
        self._refuse_grad_scaler()
        if self._pending:
            # See [Note: freed gradients]: the loop dropped gradients the plain optimizer
            # would step here, or wrote parameters it would step from.
            self._pending.refuse_loaded()
            # Writes first: swap_tensors (load_state_dict under the swap flag) drops the
            # gradient with the tensor it replaces, and the write is what the loop meant.
            self._pending.refuse_swapped()
            changed = self._pending.changed(self.state)
            if changed:
                self._pending.refuse_changed(changed)
            dropped = self._freed.dropped(self._pending.params())
            if dropped:
                self._pending.refuse_dropped(dropped)
            self._pending.refuse_written_buffers()
            self._pending.refuse_changed_groups(self.param_groups, self._keys_read)
            self._pending.refuse_draws()
            self._refuse_step_under_autocast()
        if self._pass is not None and self._pass.abandoned:
            if self._pass.updated:
                # A backward raised after updating some buckets: step() accepts it, finishing
                # it as its end-of-backward callback would have (the gradients that arrived
                # are stepped, the norm completed, group and instance state committed). After
                # the checks above: finishing notes the values and counters it leaves as the
                # updates' own.
                self._pass.finish()
            else:
                # It only held buckets (a class stepped jointly, or checked first), with the
                # group values of its start: nothing moved, and their gradients are stepped
                # below as gradients set by hand, with the values the plain step() reads.
                self._pass = None
        plan = self._current_plan()
        if self._pending:
            self._pending.refuse_unreduced(plan.units)
            # See [Note: copies gathered before step()].
            self._stale_copies.watch(self._pending.gathered_since(plan.gathered_units()))
        self._refuse_frozen_holding_gradients(plan, "step()")
        grads = read_grads(plan.trainable)
        if not (self._stepped_since_step or self._arrived_since_step):
            freed = [p for p, g in zip(plan.trainable, grads, strict=True) if is_freed(g)]
            if freed:
                refuse_stepping_again(freed)
        else:
            self._refuse_committed_again(plan, "step()")
        ready = [
            p
            for p, grad in zip(plan.trainable, grads, strict=True)
            if grad is not None and not is_freed(grad)
        ]
        if ready:
            self._ever_arrived = True
            if self._creates_state_only(plan, ready):
                step = self._new_pass(None, record=False)
                step.step_all(ready)
                step.finish()
                self._order_new_state()
                return
            self._refuse_second_pass()
            self._stepper.check_groups(self.param_groups, self.state)
            self._check_first_backward()
            self._gradients.refuse_mixed_before(ready, local_gradients(ready))
            step = self._new_pass(None)
            step.step_all(ready)
            step.finish()
        else:
            if not self._ever_arrived:
                self._check_alive(plan)
            if not self._stepped_since_step:
                # A step() with no backward since the last: the class's step still visits
                # every group, so state it keeps there advances as the plain optimizer's does.
                # See [Note: group and instance state].
                self._new_pass(None).finish()
        self._gradients.refuse_partly_skipped()
        LEFT_UPDATES.forget(self._pending)
        self._pending.commit()
        self._gradients.end_of_step()
        self._freed.stepped()
        self._stepped_since_step = self._arrived_since_step = False
        self._saved_through_hooks = False
        self._clipped_backwards.clear()
        self._order_new_state()

    def _order_new_state(self) -> None:
        """Move the state entries this step's passes created to the end in ``param_groups``'
        order, the order the plain optimizer's ``step()`` creates them in (here they were created in
        backward's): ``state_dict()`` then lists them as the plain one does, for code that
        finds an entry by its position (a state dict trimmed or edited by index, 4.5e-2
        apart with entries in backward's order). The entries created are those under keys
        that were not in the state when the first pass since the last ``step()`` began
        (parameters, held by the groups, so their ids are not reused): entries re-created
        after ``state.clear()`` or a key deleted by the loop are created too; an entry the
        loop replaced under its key before that (``optim.state[p] = {}`` to reset a
        parameter's moments) keeps its place, in the plain optimizer's dict too."""
        before, self._keys_before = self._keys_before, None
        if before is None or before.issuperset(map(id, self.state)):
            return  # no pass, or no key it did not find (a C-level check)
        new = [p for p in self.state if id(p) not in before]
        if len(new) > 1:
            params = (p for group in self.param_groups for p in group["params"])
            position = {id(p): i for i, p in enumerate(params)}
            for param in sorted(new, key=lambda p: position.get(id(p), len(position))):
                self.state[param] = self.state.pop(param)

    def _creates_state_only(self, plan: BucketPlan, ready: list[torch.Tensor]) -> bool:
        """Whether this ``step()`` is the one ``torch.distributed.checkpoint`` runs to create
        state: no state yet, lr 0 in every group, and every trainable parameter holding a
        gradient that is exactly zero on every rank (collective, one value read back; only
        when the first three hold). Any other step, a warmup's lr-0 first step included, is
        an ordinary one: clipped, checked for non-finite values, counted in the norm."""
        lrs = [group["lr"] for group in self.param_groups if "lr" in group]
        if not lrs or any(float(lr) != 0.0 for lr in lrs):
            return False
        if self.state or len(ready) != len(plan.trainable):
            return False
        return all_zero(ready, local_gradients(ready))

    def _refuse_grad_scaler(self) -> None:
        """Raise if ``torch.amp.GradScaler.step`` called this ``step()``.

        GradScaler hands an optimizer that declares ``_step_supports_amp_scaling`` its scale
        and inf flag as attributes and expects it to unscale; here the scaled gradients were
        stepped in backward already."""
        if "found_inf" in self.__dict__ or "grad_scale" in self.__dict__:
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise _loss_scaling_error(
                "GradScaler.step() called optimizer.step() on the gradients of a scaled loss, "
                "which it expects the optimizer to unscale, where the gradients of a backward "
                "are stepped in it as they arrive (held under accumulate(), they are not "
                "stepped now)"
            )

    def set_norm_order(self, params: Iterable[torch.Tensor]) -> None:
        """Take the gradient norm over this optimizer's parameters in the order of ``params``
        (``model.parameters()``), as ``torch.nn.utils.clip_grad_norm_(params)`` takes it.

        A model clipped by norm as one bucket reproduces the plain loop's ``clip_grad_norm_``
        bit for bit when the per-tensor norms are summed in the same order (see [Note:
        clip_grad_norm_'s own norm] in ``_gradients.py``). By default that is the order of
        the param groups, which is not the model's where the groups split it (weight decay on
        the matrices only): one rounding of the coefficient apart, which an optimizer with
        quantized state turns into whole code steps. The Hugging Face Trainer integration
        sets the model's order; parameters ``params`` does not name keep their group order,
        after those it does."""
        self._gradients.norm_order = {id(p): i for i, p in enumerate(params)}

    def hook_parameters(self) -> None:
        """Hook the trainable parameters ``param_groups`` holds now, stepping nothing.

        For a wrapper that replaced the tensors in ``param_groups`` after this optimizer was
        built (accelerate's FSDP2 ``prepare``): the next backward then steps them in backward.
        (Left alone, the new parameters are hooked at the next ``step()``, which steps the
        gradients they then hold, exactly.)"""
        self._current_plan()

    def _keys_read(self, group: dict[str, Any]) -> set[str] | None:
        """The keys of ``group`` its class's step reads: its defaults' for torch.optim's classes
        and this library's (never a key of the loop's own), and the group's class; ``None``
        (all of them) for any other class."""
        inner = self._stepper.optimizer_of(group)
        if not keeps_state_per_parameter(type(inner)):
            return None
        return {*inner.defaults, GROUP_CLASS_KEY}

    def _note_clipped_backward(self, backward_id: int, param: torch.Tensor) -> None:
        """Note the first gradient here (stepped or held) of backward ``backward_id``, and
        refuse it where it feeds another optimizer clipping by norm too (see
        :meth:`_refuse_clipping_beside`); where it runs nested in a Function's ``backward``
        (reentrant checkpointing), note and check the enclosing backward too, once that node
        returns, since the two optimizers may get their first gradients in different nested
        backwards of one outer backward."""
        self._refuse_clipping_beside(backward_id)
        self._clipped_backwards.add(backward_id)
        node = enclosing_backward(param.device).node
        if node is not None:
            ref = weakref.ref(self)  # a graph must not keep an optimizer alive

            def enclosing_returned() -> None:
                optimizer = ref()
                if optimizer is not None:
                    optimizer._note_enclosing_backward(current_backward_id())

            when_node_returns(node, enclosing_returned)

    def _note_enclosing_backward(self, backward_id: int) -> None:
        if backward_id not in self._clipped_backwards:
            self._clipped_backwards.add(backward_id)
            self._refuse_clipping_beside(backward_id, nested=True)

    def _refuse_clipping_beside(self, backward_id: int, nested: bool = False) -> None:
        """Raise if backward ``backward_id`` gives gradients to this optimizer and to another
        one clipping by norm, unless both clip alone: each would clip by its own norm (in
        backward, or at ``step()`` for gradients held under ``accumulate()``). Either the
        other got a gradient of it (or of a backward nested in it) first, or the engine tells
        that it will reach the other's parameters, before either moves: their
        ``AccumulateGrad`` nodes, or for FSDP2's sharded parameters those of the unsharded
        ones their unit reduces from. ``nested``: checked as a nested backward's enclosing
        one, when the node that ran it returned (the optimizers may have moved by then). See
        [Note: clipping inside one backward] in ``_gradients.py``."""
        for other in list(_CLIPPING_BY_NORM):
            if (
                other is self
                or other._detached  # it steps nothing in backward (see detach())
                or (self.options.clip_alone and other.options.clip_alone)
            ):
                continue
            if backward_id in other._clipped_backwards:
                moved = any(o._pass is not None and o._pass.unfinished for o in (self, other))
                raise _clipped_apart_error(other, moved)
            if nested:
                continue
            params = [p for group in other.param_groups for p in group["params"]]
            units = other._plan.units if other._plan is not None else []
            if any(
                p.requires_grad and not isinstance(p, DTensor) and will_get_gradient(p)
                for p in params
            ) or any(unit.will_get_gradients() for unit in units):
                raise _clipped_apart_error(other, False)

    def _refuse_second_pass(self) -> None:
        """Raise before a second pass (a backward, or ``step()`` stepping gradients set by
        hand) with no ``step()`` since a pass that made updates, where one ``step()`` of the
        plain optimizer depends on all the step's gradients: clipping by their norm
        (``max_grad_norm``; ``skip_nonfinite`` decides bucket by bucket, the same in one pass
        or several), or a class stepped jointly that the earlier pass updated, whose one
        call reads them all (one the earlier pass did not update steps this pass's gradients
        alone, as the plain call does); or since a pass that advanced state a class keeps in
        its groups or on itself: the plain optimizer's one ``step()`` advances it once, each
        pass here would advance it again. See [Note: group and instance state]. Also after a
        pass that made updates where a parameter was saved for backward through saved-tensor
        hooks since the last ``step()`` (non-reentrant checkpointing, ``save_on_cpu``):
        autograd checks no tensor saved through them, so this pass's graph could read weights
        the earlier pass updated (without hooks autograd refuses that: "modified by an inplace
        operation")."""
        clipped = self.options.max_grad_norm is not None
        if self._pending and (clipped or self._pending_in_joint_class()):
            reason = (
                "with max_grad_norm: the plain loop clips by the norm of all the step's gradients"
                if clipped
                else "with a class stepped jointly (undeclared) that it updated, whose one "
                "step() of the plain loop reads all the step's gradients at once (a norm over "
                "them, for one)"
            )
            raise RuntimeError(
                "a second backward (or a step() stepping gradients set by hand) before "
                f"optim.step(), after a backward whose updates were made, {reason}, where the "
                "earlier backward's updates used its gradients alone. Run the earlier "
                "backwards of the step under `with optim.accumulate():` (two losses, an actor "
                "and a critic), or sum the losses and call backward once. Nothing was stepped "
                "by this one."
            )
        if self._pending and self._saved_through_hooks:
            raise RuntimeError(
                "a second backward (or a step() stepping gradients set by hand) before "
                "optim.step(), after a backward whose updates were made, with parameters saved "
                "for backward through saved-tensor hooks since the last step() (activation "
                "checkpointing with use_reentrant=False, torch.autograd.graph.save_on_cpu, "
                "activation offloading): autograd does not check a tensor saved through them for "
                "in-place changes, so this backward could read weights the earlier one "
                "updated, where the plain optimizer's reads them unchanged. Run the earlier "
                "backwards of the step under `with optim.accumulate():` (two losses, an actor "
                "and a critic), or sum the losses and call backward once. Nothing was stepped "
                "by this one."
            )
        if self._stepped_since_step and self._pass is not None and self._pass.wrote_class_state():
            raise RuntimeError(
                "a second backward (or a step() stepping gradients set by hand) before "
                "optim.step(), after a backward whose update advanced state the wrapped "
                "optimizer keeps in its param groups or on itself (a step counter, as timm's "
                "Lamb keeps): a plain optimizer's one step() advances it once, here each pass "
                "would advance it. Run the earlier backwards of the step under "
                "`with optim.accumulate():` (two losses, an actor and a critic), or call "
                "optim.step() after each. Nothing was stepped by this one."
            )

    def _pending_in_joint_class(self) -> bool:
        """Whether an update made since the last ``step()`` is of a class stepped jointly."""
        return any(
            self._pending.holds(param)
            for group in self.param_groups
            if self._stepper.is_joint(group)
            for param in group["params"]
        )

    def _groups_steppable(self) -> bool:
        """Whether each class can step its groups as they are now (``check_groups``), checked
        when a backward starts stepping.

        [Note: a backward held for step()]
        A class's step sees one bucket's groups at a time, so its groups are checked before
        the first bucket: an option set on a group since its state was made that the class
        cannot step (AdamW's ``amsgrad`` without ``max_exp_avg_sq``: [Note: options turned on
        after the first step] in ``_first_step_state.py``; CompactAdamW's ``variance_bits``).
        The plain optimizer raises at ``step()``, its backward complete and its gradients
        held. Raised from the first gradient's hook, the error would leave FSDP2's units
        mid-backward, unsharded and not reducing: a loop that catches it and goes on (the
        option set back, the entry added) would step no gradient again, with no error, until
        ``reset_iter_state()``. So such a backward steps nothing and holds its gradients, as
        under :meth:`accumulate`, and ``step()`` checks the groups again and raises there,
        before anything moves, as the plain step does; fixed, ``step()`` steps them all.
        """
        try:
            self._stepper.check_groups(self.param_groups, self.state)
        except Exception:  # raised again at step(), where the plain optimizer raises it
            return False
        return True

    def _check_first_backward(self) -> BucketPlan:
        """Checks run when a backward (or ``step()``) starts stepping, before anything moves:
        what can have changed since construction. Returns the plan checked."""
        if global_step_pre_hooks():
            raise RuntimeError(
                "a step pre-hook is registered (register_step_pre_hook or "
                "torch.optim.optimizer.register_optimizer_step_pre_hook), but OptimizerInBackward "
                "updates parameters in backward, before step() could run it. Do its work before "
                "backward (or in a backward hook), or remove it."
            )
        plan = self._current_plan()
        wrapper = wrapped_by(plan.plain_trainable) if plan.plain_trainable else None
        if wrapper is not None:
            raise _wrapper_error(wrapper)
        if not self._detached:
            hooked = self._hooked
            later = [p for p in plan.trainable if hooked_after(p, hooked[id(p)].handle_id)]
            if later:
                more = f" (and {len(later) - 1} more)" if len(later) > 1 else ""
                raise RuntimeError(
                    f"{describe(later[0])}{more} has a post-accumulate-grad hook registered "
                    "after OptimizerInBackward's own: hooks run in the order they were "
                    "registered, so it would run after this optimizer stepped the gradient "
                    "and freed it, where a plain optimizer's step() comes after every hook. "
                    "Register it before building the optimizer (it then runs first, and the "
                    "step uses the gradient it leaves), or do its work on the loss."
                )
        return plan

    def _refuse_frozen_holding_gradients(
        self, plan: BucketPlan, when: str, reducing: bool = False
    ) -> None:
        """Raise if a frozen parameter of ``plan`` holds a gradient: the plain ``step()``
        steps every parameter holding one, this optimizer the trainable ones only. Checked at
        ``step()`` and where a stepping backward starts (``when``), before it moves anything:
        a gradient kept from before the parameter was frozen (a layer frozen between
        micro-batches under :meth:`accumulate`) is known there, before the other
        parameters' updates. ``reducing``: in a backward that reduces FSDP2's units, which
        hands them the gradients they accumulated with sync off; those count too."""
        frozen = [
            p
            for p, grad in zip(plan.frozen, read_grads(plan.frozen), strict=True)
            if grad is not None and not is_freed(grad)
        ]
        # FSDP2's micro-batches with gradient sync off hold theirs unsharded, handed to the
        # parameter by the backward that reduces its unit, after the units reduced before it.
        if reducing and plan.frozen:
            frozen_ids = {id(p) for p in plan.frozen}
            frozen += [p for unit in plan.units for p in unit.unreduced() if id(p) in frozen_ids]
        if frozen:
            raise RuntimeError(
                f"{when}: {describe(frozen[0])} is frozen (requires_grad=False) but holds a "
                "gradient (set by hand, kept as zeros by zero_grad(set_to_none=False), or kept "
                "from before it was frozen or added: a layer frozen between micro-batches, "
                "under accumulate() or FSDP2's with gradient sync off, holds the earlier ones'; "
                "on FSDP2, also a layer unfrozen by requires_grad_(True) while its unit was "
                "unsharded, after a forward with no backward such as an evaluation, which "
                "reached only FSDP2's all-gathered copies until the next all-gather reset them "
                "from the frozen parameter): a plain optimizer steps every parameter holding "
                "one; this one steps the trainable parameters only. Drop it (optim.zero_grad() "
                "with set_to_none=True, torch's default, or p.grad = None) or unfreeze the "
                f"parameter before {when}; freeze layers after step(), and call "
                "model.reshard() before requires_grad_() on an unsharded FSDP2 unit."
            )

    def _refuse_committed_again(self, plan: BucketPlan, when: str) -> None:
        """Raise if a parameter of ``plan`` still holds the freed gradient of an update an
        earlier ``step()`` committed. See [Note: gradients a step() already committed] in
        ``_freed.py``."""
        held = self._freed.committed(plan.trainable, plan.frozen)
        if held:
            refuse_committed_again(held, when)

    def _check_alive(self, plan: BucketPlan) -> None:
        # Only module parameters (nn.Parameter) are replaced by fully_shard: free tensors
        # (SAC's log_alpha, latent codes) never belong to a module.
        # FSDP2's sharded parameters are live while their unit is, though its modules list
        # the all-gathered copies while it is unsharded (after a forward without backward).
        replaceable = [p for p in plan.trainable if isinstance(p, nn.Parameter)]
        if replaceable and not plan.units and not _held_by_a_module(replaceable):
            raise RuntimeError(
                "no gradient has reached OptimizerInBackward, and none of its parameters "
                "belongs to a live module, so nothing would ever train. The usual cause is "
                "building the optimizer before fully_shard(): fully_shard replaces every "
                "parameter, so hooks on the old ones never fire. Build the optimizer from "
                "model.parameters() after fully_shard()."
            )
        self._ever_arrived = True  # checked once: the parameters are live

    # ------------------------------------------------------------------ accumulation

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside this context accumulate gradients and step nothing.

        The next backward outside it adds its gradients and steps with the sum. With FSDP2 the
        sum is kept in the sharded gradients (1/N of the memory). Scale the loss as for a plain
        optimizer (e.g. divide by the number of micro-batches).

        [Note: FSDP2's micro-batches]
        A backward while an FSDP2 unit does not reduce its gradients
        (``set_requires_gradient_sync(False)``, FSDP2's own accumulation) is a micro-batch and
        runs as if inside this context: FSDP2 keeps that unit's gradients unsharded until a
        backward that reduces them, and a plain optimizer steps the sum. Units still
        reducing (sync turned off for the root alone with ``recurse=False``, or for some
        children) add their gradients to their sharded ones each micro-batch, and autograd
        those of parameters outside ``fully_shard``, which the plain optimizer also steps
        summed: stepped as they arrived, they would have moved before the next
        micro-batch's gradients came. Any unit of the process counts, not only this
        optimizer's (which units a backward reaches is known only as it reaches them), and
        a frozen one too (sync off for a frozen unit alone still marks a micro-batch for the
        units reducing beside it): another optimizer's unit with sync off makes the backward
        a micro-batch for the model's other parameters too, and a model left with sync off
        makes every backward one, whose gradients ``step()`` then steps (equal, without the
        saving of stepping in backward).

        [Note: gradients reduced outside backward]
        A gradient whose hook runs outside any backward is held on its parameter, as one set
        by hand, and ``step()`` steps it. ``torch.distributed.pipelining`` does this with
        FSDP2 stages (torch 2.13, ``_PipelineStageBase.perform_reduce_grad``): every
        micro-batch's backward runs with gradient sync off, and after the last one the
        schedule calls the units' post-backward itself, which reduce-scatters the sums and
        calls the hooks, then divides the gradients by the number of micro-batches
        (``scale_grads=True``, the default). Stepped at the hooks, the update came before
        that division, each parameter a pass of its own (its own norm and clipping), and
        ``step()`` then found no backward since the last one. Held, the division applies to
        them as to the plain optimizer's, and ``step()`` steps them all as one pass: one
        norm, one clipping, one non-finite verdict. What that costs is the overlap of the
        update with the rest of the schedule; the gradients' memory is the plain loop's,
        reduced at the same point.
        """
        self._accumulate_depth += 1
        try:
            yield
        finally:
            self._accumulate_depth -= 1

    # ------------------------------------------------------------------ gradient statistics

    def grad_norm(self) -> torch.Tensor:
        """The total L2 norm of the gradients stepped since the last ``step()``: those the last
        stepping backward consumed, or, where several stepped before one ``step()`` (two
        backwards on disjoint parameters, gradients set by hand after a backward), all of them.

        Measured before clipping, over all parameters and ranks: the value
        ``torch.nn.utils.clip_grad_norm_`` would return for the same gradients. Computed during
        backward, so calling it is local (it never blocks on other ranks); a 0-dim tensor on
        the gradients' device, inf/NaN if a gradient was not finite.

        Raises:
            RuntimeError: before the first stepping backward, or with ``track_grad_norm=False``
                and neither clipping by norm nor ``skip_nonfinite``, or while this step's
                gradients arrived through the hooks are held for ``step()``
                (:meth:`gradients_held_for_step`), or after a backward that raised having
                stepped some parameters, until ``step()`` completes its norm.
        """
        if self._pass is not None and self._pass.unfinished:
            raise RuntimeError(
                "grad_norm() after a backward that raised having stepped some of its "
                "parameters: step() completes its norm (and steps the gradients that did "
                "arrive, as the plain optimizer steps them); until then it would return the "
                "last step's. Read it after step()."
            )
        if self._arrived_since_step and not self._pending:
            raise RuntimeError(
                "grad_norm() before step(), while this step's gradients are held for step() "
                "(every backward since the last step() ran under accumulate(), a pipeline "
                "schedule reduced them outside backward, or a backward raised before it "
                "stepped any): step() measures and clips them, and "
                "grad_norm() returns their norm after it; until then it would return the last "
                "step's. Read it after step(), or measure them now as clip_grad_norm_ does "
                "with fused_optim_dist.clip_grad_norm_(optim, max_norm)."
            )
        return self._gradients.grad_norm()

    def gradients_held_for_step(self) -> bool:
        """Whether ``step()`` will step gradients and no backward stepped any since the last
        ``step()``: gradients that reached the parameters under ``accumulate()``, from a
        pipeline schedule's reduction or in a backward that raised before it stepped any, set
        by hand, or kept as zeros by ``zero_grad(set_to_none=False)``.

        [Note: gradients held for step()]
        A step whose gradients all arrive under ``accumulate()``, or from a pipeline
        schedule's reduction outside backward ([Note: gradients reduced outside backward]),
        or are set by hand, is measured, clipped and stepped by ``step()``. Before it,
        ``grad_norm()`` still holds the last step's norm, which a loop measuring this step's
        (``clip_grad_norm_`` between the last backward and ``step()``, as the plain loop does)
        would have taken for this one's, silently. Where the gradients arrived through the
        hooks, ``grad_norm()`` raises there; gradients set by hand reach no hook, so it cannot
        tell them from the last step's (a loop may read that norm after ``zero_grad()``), but
        this method finds them on the parameters: once stepped, in backward or by ``step()``,
        a gradient is a freed one ([Note: freed gradients]), so every other gradient there is
        one ``step()`` will step. ``fused_optim_dist.clip_grad_norm_`` measures them as
        ``clip_grad_norm_`` does. One pass over the parameters where no backward stepped since
        the last ``step()`` and no gradient arrived through a hook. After a backward that
        raised having stepped some parameters, ``grad_norm()`` raises until ``step()``
        completes that backward's norm."""
        if self._pending:
            return False
        return self._arrived_since_step or bool(self.unstepped_gradients())

    def unstepped_gradients(self) -> list[torch.Tensor]:
        """The parameters holding a gradient that was not stepped (in backward or by
        ``step()``), in ``param_groups``' order: those ``step()`` will step. See [Note:
        gradients held for step()]."""
        params = [p for group in self.param_groups for p in group["params"]]
        grads = read_grads(params)
        return [p for p, g in zip(params, grads, strict=True) if g is not None and not is_freed(g)]

    @property
    def max_grad_norm(self) -> float | None:
        """The norm gradients are clipped to in backward (``None``: no clipping by norm)."""
        return self.options.max_grad_norm

    @property
    def nonfinite_steps(self) -> int:
        """How many bucket updates ``skip_nonfinite`` skipped so far (reads a device counter)."""
        return self._gradients.nonfinite_steps

    def gradient_state_dict(self) -> dict[str, Any]:
        """State of the in-backward gradient handling that ``state_dict()`` leaves out.

        ``state_dict()`` stays exactly the wrapped optimizer's, so checkpoints remain
        interchangeable with the plain optimizer. This holds the clipping history of
        ``max_grad_norm`` (see [Note: clipping inside one backward]), keyed by bucket, and
        ``nonfinite_steps``, the same on every rank; ``fused_optim_dist.checkpoint`` saves and
        restores it. Without it a resumed run clips its first step as a first step.
        """
        return self._gradients.state_dict()

    def load_gradient_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`gradient_state_dict` returned. History of buckets this run does
        not have (the model wrapped differently) is dropped, never applied to another bucket."""
        plan = self._current_plan()
        self._gradients.load_state_dict(state, [bucket.key for bucket in plan.buckets])

    # ------------------------------------------------------------------ the wrapped class's own API

    @property
    def train(self) -> Callable[[], None]:
        """The wrapped classes' ``train()``, run on this optimizer's groups and state.

        [Note: the wrapped class's own methods]
        Schedule-free optimizers keep the weights at the point gradients are taken at while
        training, and move them to the averaged point for evaluation: a loop calls
        ``optimizer.train()`` before training and ``optimizer.eval()`` before evaluating, and
        Hugging Face Trainer and accelerate's ``AcceleratedOptimizer`` call them where the
        optimizer has them (``hasattr``). So ``train`` and ``eval`` exist here exactly when a
        class of the param groups defines them, and run it as the plain optimizer's method:
        on that class's groups and ``state`` (the parameters themselves, DTensors included),
        where the class's step reads them. Without them the frameworks skipped the calls
        silently: evaluated at the training point, the class's mode flag never switched (1.1e-2
        apart after 12 steps of accelerate's loop). Likewise a static or class method of the
        class is reached through the optimizer (:meth:`__getattr__`): transformers'
        ``AdafactorSchedule`` calls ``optimizer._get_lr(group, state)``. And a public attribute
        the class keeps on its instance (an annealed ``temperature`` its step reads) is read and
        set through the optimizer (:meth:`__setattr__`): set here, it stayed here while the
        wrapped instance's step read the old value (7.9e-2 apart after five steps, no error).
        """
        return self._class_method("train")

    @property
    def eval(self) -> Callable[[], None]:
        """The wrapped classes' ``eval()``. See [Note: the wrapped class's own methods]."""
        return self._class_method("eval")

    def _class_method(self, name: str) -> Callable[[], None]:
        """``name()`` of every class of the groups that defines it, each on its own groups and
        the state; ``AttributeError`` if none does, as for the plain optimizer."""
        inners = [
            (key, stepper.optimizer)
            for key, stepper in self._stepper.steppers.items()
            if callable(getattr(type(stepper.optimizer), name, None))
        ]
        if not inners:
            # Python then asks __getattr__, whose AttributeError is the one raised.
            raise AttributeError(name)

        def run() -> None:
            for key, inner in inners:
                groups = [g for g in self.param_groups if g.get(GROUP_CLASS_KEY) == key]
                inner.param_groups, inner.state = groups, self.state
                try:
                    getattr(type(inner), name)(inner)
                finally:
                    inner.param_groups, inner.state = [], defaultdict(dict)

        return run

    def __getattr__(self, name: str) -> Any:
        """A static or class method of the default class, a public attribute a wrapped class
        keeps on its instance, or a public property or value of the default class, reached
        through the optimizer as through the plain one. See [Note: the wrapped class's own
        methods]."""
        stepper = self.__dict__.get("_stepper")
        if stepper is not None and not name.startswith("__"):
            cls = type(stepper.steppers[None].optimizer)
            if isinstance(inspect.getattr_static(cls, name, None), staticmethod | classmethod):
                return getattr(cls, name)
            owners = self._wrapped_holding(name)
            if owners:
                return getattr(owners[0], name)
            static = inspect.getattr_static(cls, name, None)
            if not name.startswith("_") and (
                isinstance(static, property) or (static is not None and not callable(static))
            ):
                # A flag the class declares (timm's ``is_second_order``, which its training
                # script reads to call backward(create_graph=True)).
                return getattr(stepper.steppers[None].optimizer, name)
        missing = f"{type(self).__name__!r} object has no attribute {name!r}"
        if name in ("train", "eval"):
            missing += f": no optimizer class of its param groups defines {name}()"
        raise AttributeError(missing)

    def __setattr__(self, name: str, value: Any) -> None:
        """Set ``name`` on the wrapped instances keeping a public attribute of that name (see
        [Note: the wrapped class's own methods]); else on this optimizer.

        Raises:
            RuntimeError: for such an attribute set between backward and ``step()``: the
                class read it in backward, where the plain ``step()`` reads the new value.
        """
        owners = (
            self._wrapped_holding(name)
            if name not in self.__dict__ and not hasattr(type(self), name)
            else []
        )
        if not owners:
            super().__setattr__(name, value)
            return
        if self._pending:
            raise RuntimeError(
                f"optimizer.{name} was set between backward and step(): "
                f"{type(owners[0]).__name__} read it when it stepped in backward, where a plain "
                "optimizer's step() reads the new value. Set it before the backward (after "
                "step(), where a scheduler sets a learning rate)"
            )
        for owner in owners:
            setattr(owner, name, value)

    def _refuse_step_under_autocast(self) -> None:
        """Raise in a ``step()`` called inside an autocast region after updates made in
        backward, where a class that is not elementwise is wrapped. See [Note: updates outside
        autocast] in ``_engine.py``."""
        if not autocast_enabled():
            return
        for stepper in self._stepper.steppers.values():
            if not (isinstance(stepper, BucketStepper) and stepper.local_shards):
                raise RuntimeError(
                    "step() was called inside a torch.autocast region: the plain "
                    f"{type(stepper.optimizer).__name__}.step() would run there under autocast "
                    "(a matmul of its update in bfloat16), while this optimizer made the "
                    "update in backward without it. Call step() after the autocast block, "
                    "as usual, or keep the plain optimizer for this loop"
                )

    def _overriding(self, name: str) -> list[Optimizer]:
        """The wrapped class instances whose class overrides ``torch.optim.Optimizer``'s
        method ``name``."""
        return [o for o in self._wrapped() if _overrides(o, name)]

    def _refuse_overridden(self, name: str, verb: str) -> None:
        """Raise if a wrapped class overrides ``name`` (``state_dict``, ``load_state_dict``):
        this optimizer's is torch.optim.Optimizer's, over its own groups and state, and would
        not run the class's (which saves or loads values of its own: a counter on itself),
        so a run resumed from the checkpoint would differ from the plain one, silently."""
        for instance in self._overriding(name):
            raise RuntimeError(
                f"{type(instance).__name__} overrides {name}() (to {verb} values of its own, "
                "such as a counter kept on itself): OptimizerInBackward's is "
                "torch.optim.Optimizer's, over its param groups and state, and would leave "
                "them out, so a run resumed from the checkpoint would differ from the plain "
                "one. Keep such values in the param groups or in state[p], or checkpoint with "
                "the plain optimizer"
            )

    def _wrapped_holding(self, name: str) -> list[Optimizer]:
        """The wrapped class instances that keep a public attribute ``name`` of their own."""
        if name.startswith("_"):
            return []
        return [o for o in self._wrapped() if name in instance_attrs(o)]

    def _wrapped(self) -> list[Optimizer]:
        """The wrapped class instances, once each (none while construction has not made
        them)."""
        stepper = self.__dict__.get("_stepper")
        if stepper is None:
            return []
        return list({id(s.optimizer): s.optimizer for s in stepper.steppers.values()}.values())

    # ------------------------------------------------------------------ detaching

    def detach(self) -> None:
        """Remove the hooks; state and param groups are kept.

        Afterwards backward leaves gradients in place, as with no optimizer, and ``step()``
        steps them like the plain optimizer. Use it to hand the parameters to another optimizer
        (e.g. a new ``OptimizerInBackward`` loading this one's ``state_dict()``).
        """
        _remove_hooks(self._hook_handles)
        self._hooked.clear()
        self._detached = True
        if self._pending:
            LEFT_UPDATES.leave(self._pending)
        for group in self.param_groups:
            for param in group["params"]:
                if _owner(param) is self:
                    del _OWNERS[id(param)]

    def attach(self) -> None:
        """Hook the parameters again after :meth:`detach`, stepping nothing: backward steps
        them in backward again from the next backward on. For an owner that hands its
        parameters back and forth (a Trainer detaches its optimizer when ``train()`` returns,
        so that an idle Trainer does not hold them, and attaches it when training begins).

        Raises:
            ValueError: if another live ``OptimizerInBackward`` steps one of them in backward
                (it stays detached then).
        """
        LEFT_UPDATES.forget(self._pending)
        plan = self._current_plan()
        self._detached = False
        try:
            self._hook_new(plan)
        except ValueError:
            self._detached = True
            raise

    # ------------------------------------------------------------------ the backward path

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._ever_arrived = self._arrived_since_step = True
        if self._pending and self._pending.holds(param):
            # See [Note: the step protocol]. Refused even when this backward gave it no
            # gradient (frozen after its forward): that forward read the updated weights.
            self._pending.refuse_second_gradient(param)
        backward_id = current_backward_id()
        if (
            self.options.max_grad_norm is not None
            and backward_id != -1
            and backward_id not in self._clipped_backwards
        ):
            self._note_clipped_backward(backward_id, param)
        if self._accumulate_depth:
            return
        if backward_id == self._held_backward:
            return
        current = self._pass
        if backward_id == -1:
            # See [Note: gradients reduced outside backward].
            return
        if current is None or not (current.owns(backward_id) or current.adopt(backward_id)):
            # The first gradient of a new backward. See [Note: one backward, one BackwardPass].
            if fsdp_sync_off():
                # See [Note: FSDP2's micro-batches].
                self._held_backward = backward_id
                return
            enclosing = enclosing_backward(param.device)
            if enclosing.from_hook:
                raise _nested_in_hook_error()
            if in_scaled_backward():
                # See watch_loss_scaling in _torch_internals.py.
                raise _loss_scaling_error(
                    "this backward started from a loss that GradScaler.scale() scaled, and "
                    "OptimizerInBackward would step each gradient as it arrives, scaled, "
                    "before GradScaler could unscale it or skip a step with inf/NaN gradients "
                    "(nothing was stepped)"
                )
            self._refuse_second_pass()
            if not self._groups_steppable():
                # See [Note: a backward held for step()].
                self._held_backward = backward_id
                return
            plan = self._check_first_backward()
            self._refuse_frozen_holding_gradients(plan, "backward()", reducing=True)
            self._refuse_committed_again(plan, "backward()")
            current = self._pass = self._new_pass(backward_id)
            current.queue_finish(enclosing.node)
            self._stepped_since_step = True
        current.arrive(param)


def in_backward(optimizer_cls: type[Optimizer] | str) -> type[OptimizerInBackward]:
    """Return a class ``C`` with ``C(params, **kw) == OptimizerInBackward(params, cls, **kw)``.

    For code that builds ``optimizer_cls(params, **config)`` from a configuration. ``C`` is
    named ``f"{cls.__name__}InBackward"``; its ``str()`` names ``cls`` by its import path,
    ``<class 'fused_optim_dist.optimizer.in_backward(torch.optim.adamw.AdamW)'>``, for code
    that decides by it: Hugging Face Trainer keeps embeddings in 32-bit optimizer state when
    ``str(optimizer_cls)`` names ``bitsandbytes`` (an 8-bit class of it, without the override,
    trained them otherwise, no error).
    """
    resolved = resolve_optimizer_class(optimizer_cls)

    class _InBackward(OptimizerInBackward):
        def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
            super().__init__(params, resolved, **kwargs)

    _InBackward.__name__ = f"{resolved.__name__}InBackward"
    _InBackward.__qualname__ = f"in_backward({class_path(resolved)})"
    return _InBackward
