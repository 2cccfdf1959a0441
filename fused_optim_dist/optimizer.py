"""``OptimizerInBackward``: a drop-in ``torch.optim.Optimizer`` that steps during backward."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from fused_optim_dist._buckets import Bucket, plan_buckets
from fused_optim_dist._gradients import GradientProcessor
from fused_optim_dist._stepping import (
    ELEMENTWISE_OPTIMIZERS,
    Batch,
    BucketStepper,
    place_grad_like_param,
)
from fused_optim_dist._torch_internals import (
    current_backward_id,
    ddp_modules_holding,
    queue_end_of_backward,
)
from fused_optim_dist._validation import (
    check_options,
    check_param_groups,
    resolve_optimizer_class,
)

__all__ = ["OptimizerInBackward", "in_backward"]

DEFAULT_BUCKET_NUMEL = 1 << 24
"""Elements per bucket for parameters outside FSDP units (64 MiB of fp32 gradients)."""

# Parameter -> weak reference to the OptimizerInBackward whose hooks step it. Both sides are
# weak: a model must not keep an optimizer alive, nor an optimizer a parameter.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _owner(param: torch.Tensor) -> OptimizerInBackward | None:
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


def _grad_ready_hook(optimizer: OptimizerInBackward) -> Callable[[torch.Tensor], None]:
    # The hook holds the optimizer weakly: a parameter must not keep an optimizer alive, and
    # hooks of a collected optimizer must not step anything.
    ref = weakref.ref(optimizer)

    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)

    return hook


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class OptimizerInBackward(Optimizer):
    """Step ``optimizer_cls`` on each parameter as soon as its gradient is ready, in backward.

    Built on the parameters of a model after ``fully_shard``, it registers a post-accumulate-grad
    hook on every trainable parameter. FSDP2 calls these hooks right after it reduce-scatters a
    unit's gradients; when the last gradient of a unit arrives, each rank steps its local shards
    of the whole unit in one call per param group and frees the gradients. Gradients of the whole
    model are therefore never held at once. See [Note: why buckets follow FSDP units].

    The object is a ``torch.optim.Optimizer``: ``param_groups`` hold the user's parameters and
    every key ``optimizer_cls`` puts in its groups (values written there, e.g. by an LR
    scheduler, apply from the next backward on), and ``state``, ``state_dict()`` and
    ``load_state_dict()`` are those ``optimizer_cls`` would have on the same parameters, so
    ``torch.distributed.checkpoint`` saves and reshards them like any optimizer's.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. Frozen parameters
            may be included; they get no hook and no state.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, or its dotted import path.
        elementwise: whether ``optimizer_cls``'s update is elementwise, so that local shards can
            be stepped as plain tensors (fast). Default: true for the torch.optim classes in
            ``ELEMENTWISE_OPTIMIZERS``, false otherwise (the step runs on the DTensors).
        bucket_numel: elements per bucket for parameters no ``fully_shard`` manages.
        max_grad_norm: clip gradients by norm while stepping in backward, with the semantics
            of [Note: clipping inside one backward] (``fused_optim_dist._gradients``).
        clip_grad_value: clamp every gradient element to ``[-clip_grad_value, clip_grad_value]``
            (exactly ``torch.nn.utils.clip_grad_value_``). Not combined with ``max_grad_norm``.
        skip_nonfinite: when a bucket's gradient holds inf/NaN on any rank, no rank updates that
            bucket; counted in ``nonfinite_steps``. Costs a host sync per bucket.
        track_grad_norm: compute the total gradient norm reported by :meth:`grad_norm` (one
            all-reduce of a scalar per step).
        **optimizer_kwargs: passed to ``optimizer_cls``.

    Raises:
        ValueError: for an empty parameter list, a parameter listed twice, no trainable
            parameter, an optimizer that needs a closure or sparse gradients, parameters trained
            by ``DistributedDataParallel`` or already driven by another live
            ``OptimizerInBackward``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer] | str,
        *,
        elementwise: bool | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        max_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        skip_nonfinite: bool = False,
        track_grad_norm: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        optimizer_cls = resolve_optimizer_class(optimizer_cls)
        params = list(params)
        if not params:
            raise ValueError("OptimizerInBackward got an empty parameter list")
        check_options(
            bucket_numel=bucket_numel, max_grad_norm=max_grad_norm, clip_grad_value=clip_grad_value
        )
        # Built on the user's parameters so that groups get exactly optimizer_cls's keys and
        # defaults (and any state its constructor creates, as Adagrad's).
        inner = optimizer_cls(params, **optimizer_kwargs)
        check_param_groups(inner.param_groups)
        trainable = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
        self._check_not_driven_elsewhere(trainable)

        if elementwise is None:
            elementwise = optimizer_cls in ELEMENTWISE_OPTIMIZERS
        # Optimizer.__setstate__ initialises the base class (hook dicts, profiled step) around
        # the wrapped optimizer's groups and state, without re-validating them.
        super().__setstate__(
            {"defaults": inner.defaults, "state": inner.state, "param_groups": inner.param_groups}
        )
        self.optimizer_cls = optimizer_cls
        # The wrapped class's step code, run on one bucket at a time.
        self._stepper = BucketStepper(inner, local_shards=elementwise)
        self._bucket_numel = bucket_numel
        # Norm, non-finite check and clipping of each bucket's gradients before its step.
        self._gradients = GradientProcessor(
            max_grad_norm=max_grad_norm,
            clip_grad_value=clip_grad_value,
            skip_nonfinite=skip_nonfinite,
            track_grad_norm=track_grad_norm,
        )
        # Hooks on the trainable parameters; removed when this object is collected.
        self._hook_handles: list[RemovableHandle] = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        # Bucket (index, bucket) of each parameter (by id), and param group index of each.
        self._bucket_of: dict[int, tuple[int, Bucket]] = {}
        self._group_of: dict[int, int] = {}
        self._buckets: list[Bucket] = []
        # Backward-pass bookkeeping: whether any gradient arrived since the last step(), the
        # backward whose end-of-backward callback is queued, and the parameters it stepped.
        self._grads_arrived = False
        self._callback_backward = -1
        self._stepped_in_backward: set[int] = set()
        self._accumulate_depth = 0
        self._attach(trainable)

    # ------------------------------------------------------------------ construction helpers

    def _check_not_driven_elsewhere(self, trainable: list[torch.Tensor]) -> None:
        for param in trainable:
            owner = _owner(param)
            if owner is not None and owner is not self and owner._hook_handles:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is already stepped in backward "
                    "by another live OptimizerInBackward; call .detach() on that one first (its "
                    "state is kept) or pass disjoint parameters"
                )
        if ddp_modules_holding(trainable):
            raise ValueError(
                "these parameters are trained by DistributedDataParallel, whose gradient "
                "all-reduce runs after the post-accumulate-grad hooks, so stepping in backward "
                "would use unreduced gradients; shard the model with fully_shard instead"
            )

    def _attach(self, new_params: list[torch.Tensor]) -> None:
        hook = _grad_ready_hook(self)
        for param in new_params:
            self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))
            _OWNERS[param] = weakref.ref(self)
        self._plan()

    def _plan(self) -> None:
        self._group_of = {
            id(p): index
            for index, group in enumerate(self.param_groups)
            for p in group["params"]
            if p.requires_grad
        }
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._buckets = plan_buckets(trainable, self._bucket_numel)
        self._bucket_of = {
            id(p): (index, bucket)
            for index, bucket in enumerate(self._buckets)
            for p in bucket.params
        }

    # ------------------------------------------------------------------ torch.optim.Optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim.Optimizer.add_param_group``) and hook its params."""
        candidate = [*self.param_groups, {**param_group, "params": list(param_group["params"])}]
        check_param_groups(candidate)
        new = [p for p in candidate[-1]["params"] if p.requires_grad]
        self._check_not_driven_elsewhere(new)
        super().add_param_group(param_group)
        self._attach(new)

    def __setstate__(self, state: dict[str, Any]) -> None:
        stepper = self.__dict__.get("_stepper")
        if stepper is not None:
            # load_state_dict: let the wrapped class fill in group keys and convert state
            # written by older releases, as its own __setstate__ does.
            inner = stepper.optimizer
            inner.__setstate__(dict(state))
            state = {**state, "state": inner.state, "param_groups": inner.param_groups}
            inner.state, inner.param_groups = type(inner.state)(), []
        super().__setstate__(state)

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Step the parameters that still hold a gradient; usually there are none.

        In the usual loop every gradient was consumed during backward and this does nothing.
        Parameters holding a gradient (set by hand, accumulated under :meth:`accumulate`, or
        the zero gradients ``torch.distributed.checkpoint`` sets to create state) are stepped
        and their gradients freed.

        Raises:
            TypeError: if a closure is passed.
            RuntimeError: if no gradient reached this optimizer since the last ``step()``.
        """
        if closure is not None:
            raise TypeError(
                "OptimizerInBackward.step() takes no closure: parameters are stepped during "
                "backward, so call loss.backward() yourself before step()"
            )
        ready = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if ready:
            self._step_now(ready)
            self._gradients.end_of_step()
        elif not self._grads_arrived:
            raise RuntimeError(
                "no gradient reached OptimizerInBackward since the last step(), so nothing was "
                "trained. The usual cause is building the optimizer before fully_shard(): "
                "fully_shard replaces every parameter, so hooks on the old ones never fire. "
                "Build the optimizer from model.parameters() after fully_shard(), and call "
                "backward() before step()."
            )
        self._grads_arrived = False

    # ------------------------------------------------------------------ accumulation

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside this context accumulate gradients and step nothing.

        The next backward outside it adds its gradients and steps with the sum. With FSDP2 the
        sum is kept in the sharded gradients (1/N of the memory). Scale the loss as for a plain
        optimizer (e.g. divide by the number of micro-batches).
        """
        self._accumulate_depth += 1
        try:
            yield
        finally:
            self._accumulate_depth -= 1

    # ------------------------------------------------------------------ gradient statistics

    def grad_norm(self) -> torch.Tensor:
        """The total L2 norm of the gradients the last stepping backward consumed.

        Measured before clipping, over all parameters and ranks: the value
        ``torch.nn.utils.clip_grad_norm_`` would return for the same gradients. Computed during
        backward, so calling it is local (it never blocks on other ranks); a 0-dim tensor on
        the gradients' device, inf/NaN if a gradient was not finite.

        Raises:
            RuntimeError: before the first stepping backward, or with ``track_grad_norm=False``.
        """
        return self._gradients.grad_norm()

    @property
    def max_grad_norm(self) -> float | None:
        """The norm gradients are clipped to in backward (``None``: no clipping by norm)."""
        return self._gradients.max_grad_norm

    @property
    def nonfinite_steps(self) -> int:
        """How many bucket updates ``skip_nonfinite`` skipped so far."""
        return self._gradients.nonfinite_steps

    def gradient_state_dict(self) -> dict[str, Any]:
        """State of the in-backward gradient handling that ``state_dict()`` leaves out.

        ``state_dict()`` stays exactly the wrapped optimizer's, so checkpoints remain
        interchangeable with the plain optimizer. This holds the clipping history of
        ``max_grad_norm`` (see [Note: clipping inside one backward]) and ``nonfinite_steps``,
        the same on every rank; ``fused_optim_dist.checkpoint`` saves and restores it. Without
        it a resumed run clips its first step as a first step (no history).
        """
        return self._gradients.state_dict()

    def load_gradient_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`gradient_state_dict` returned."""
        self._gradients.load_state_dict(state)

    # ------------------------------------------------------------------ detaching

    def detach(self) -> None:
        """Remove the hooks; state and param groups are kept.

        Afterwards backward leaves gradients in place, as with no optimizer, and ``step()``
        steps them like the plain optimizer. Use it to hand the parameters to another optimizer
        (e.g. a new ``OptimizerInBackward`` loading this one's ``state_dict()``).
        """
        _remove_hooks(self._hook_handles)
        for group in self.param_groups:
            for param in group["params"]:
                if _owner(param) is self:
                    del _OWNERS[param]

    # ------------------------------------------------------------------ the backward path

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._grads_arrived = True
        if self._accumulate_depth:
            return
        if id(param) in self._stepped_in_backward:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a second gradient after "
                "it was stepped in this backward (reentrant activation checkpointing does "
                "this); use torch.utils.checkpoint with use_reentrant=False"
            )
        backward = current_backward_id()
        if backward != -1 and backward != self._callback_backward:
            self._callback_backward = backward
            queue_end_of_backward(self._end_of_backward)
        index, bucket = self._bucket_of[id(param)]
        if bucket.arrive(param):
            self._step_bucket(index, bucket.take())
            if backward != -1:
                self._stepped_in_backward.update(id(p) for p in bucket.params)
        if backward == -1:
            self._gradients.end_of_step()

    def _end_of_backward(self) -> None:
        """Step the buckets that did not complete (parameters unused in this forward)."""
        self._callback_backward = -1
        try:
            for index, bucket in enumerate(self._buckets):
                if bucket.pending:
                    self._step_bucket(index, bucket.take())
            self._gradients.end_of_step()
        finally:
            self._stepped_in_backward.clear()

    def _step_now(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` outside backward, bucket by bucket, in bucket order."""
        ready = {id(p) for p in params}
        for index, bucket in enumerate(self._buckets):
            bucket.take()
            members = [p for p in bucket.params if id(p) in ready]
            if members:
                self._step_bucket(index, members)

    @torch.no_grad()
    def _step_bucket(self, index: int, params: list[torch.Tensor]) -> None:
        """Clip and step one bucket's parameters, then free their gradients."""
        try:
            for param in params:
                if param.grad.is_sparse:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(param.shape)} has a sparse gradient, "
                        "which the in-backward step does not support; use dense gradients "
                        "(e.g. nn.Embedding(sparse=False))"
                    )
                place_grad_like_param(param)
            if self._gradients.before_step(index, params):
                self._stepper.step(self._batches(params), self.state)
        finally:
            for param in params:
                param.grad = None

    def _batches(self, params: list[torch.Tensor]) -> list[Batch]:
        by_group: dict[int, list[torch.Tensor]] = {}
        for param in params:
            by_group.setdefault(self._group_of[id(param)], []).append(param)
        return [(self.param_groups[index], by_group[index]) for index in sorted(by_group)]


def in_backward(optimizer_cls: type[Optimizer] | str) -> type[OptimizerInBackward]:
    """Return a class ``C`` with ``C(params, **kw) == OptimizerInBackward(params, cls, **kw)``.

    For code that builds ``optimizer_cls(params, **config)`` from a configuration.
    """
    resolved = resolve_optimizer_class(optimizer_cls)

    class _InBackward(OptimizerInBackward):
        def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
            super().__init__(params, resolved, **kwargs)

    _InBackward.__name__ = _InBackward.__qualname__ = f"{resolved.__name__}InBackward"
    return _InBackward
