"""The stepping engine: runs the wrapped optimizer's own update on a subset of parameters.

The wrapped optimizer class is instantiated once, on the user's parameters, and used only as a
vehicle for its ``step`` code: before each call its ``param_groups`` are set to the bucket's
parameters (with the hyperparameters the facade's groups hold *now*, so schedulers take effect)
and its ``state`` to the matching state. Its step/profiling hooks are bypassed, so global
optimizer hooks fire once per ``OptimizerInBackward.step``, not once per bucket.

Two ways to step a DTensor parameter:

* **local shards** (elementwise optimizers): the update of every element depends only on that
  element's parameter, gradient and state, so each rank can step its local shards as plain
  tensors. This skips DTensor dispatch, which costs far more CPU time than the math for small
  parameters, and lets ``foreach``/``fused`` kernels run over the whole bucket.
* **DTensor** (anything else, e.g. optimizers that take a norm of the whole parameter): the step
  runs on the DTensor parameters, and DTensor makes reductions global.

[Note: cached local views]
The facade's ``state`` (DTensor values placed like their parameter, exactly as the plain
optimizer would hold them) is the one source of truth; the local shards and the local views of
their state are derived from it. Deriving them costs microseconds per parameter (an alias of
each shard, ``to_local`` of each state value), as much as the update itself for small tensors,
so they are kept per set of parameters stepped together (``_LocalViews``) and re-derived only
when a source changed. Before every step each cached parameter is checked, by identity only:

* its local tensor is still FSDP2's (FSDP2 replaces it when it re-creates the shard);
* its state entry and every value in it are the objects the views were taken from, and each
  DTensor value still wraps the same local tensor (``load_state_dict``, DCP's
  ``set_state_dict`` and a state entry written by hand all replace objects).

The sources of a whole set are kept as flat lists (``_Sources``, the entries and their values
as ``_state_identity.StateEntries``) and compared with ``map(operator.is_, ...)``: a few
C-level maps per bucket, not a Python loop with a dozen steps per parameter.

Anything that changes which parameters are stepped together (a group added, ``requires_grad``
flipped, a parameter that got no gradient) gives another set, hence other views; a set's views
replace those of every set sharing a parameter with it, so at most one set per parameter is kept.
When a step creates or replaces state (lazy initialisation on the first step), the new values
are placed back into the facade's state and the views are re-derived at the next step.

The ``params`` list of each group handed to the wrapped step is the views' own list, the same
object at every step while they are kept, so that a class keeping its own derived data per
``params`` list finds it again (``CompactAdamW``'s plans: [Note: reused plans] in
``_compact_plan.py``; a new list at every step made them miss at every bucket). Should the
step change a list in place, it is restored from the views before the next step.

[Note: the plain optimizer's own kernel]
The local shards are plain tensors on one device, so a ``fused=True`` kernel could run over a
whole bucket where the user left ``foreach`` and ``fused`` unset (torch.optim then picks the
per-tensor loop on the CPU, ``foreach`` on CUDA). It is not substituted: the fused kernels
round differently from the per-tensor and ``foreach`` ones (an FMA, another order of ops), and
a last-bit difference does not stay one. Measured while it was substituted: a Hugging Face
Trainer run with ``bf16=True`` (autocast rounds the weights to bfloat16 in every forward, so a
one-ulp difference in a weight can flip a rounding) ended 4e-5 from the plain run after four
steps, without an error. So the wrapped step receives the group as the user wrote it and runs
the kernel the plain optimizer runs: bit for bit the plain update of each element, whatever the
bucket (the kernels are elementwise, and ``foreach`` over a bucket computes what it computes
over every parameter). ``fused=True`` set by the user runs the fused kernel, bit for bit the
plain ``fused=True`` optimizer's; on the CPU it is several times faster than the per-tensor
loop over a bucket of small tensors.

[Note: the update without the class's per-parameter loop]
``Adam.step`` (AdamW's too) walks the parameters in Python before its kernel runs: it gathers
each gradient and state value into lists and creates missing state (``_init_group``). For a
bucket of small tensors that loop costs several times the fused kernel. Once every parameter of
a set has its state, the lists are part of the cached views (the same state tensors, in the same
order) and each step calls the functional ``torch.optim.adam.adam`` with them and the group's
current hyperparameters, exactly the call ``Adam.step`` makes. With the fused kernel on one
device and dtype, it calls the kernel itself, doing what ``adam``'s fused path does around it
(count the step, undo the count of a step ``found_inf`` skipped), except that the count is one
``add_``: the set's ``step`` values are made views of one tensor when the lists are built (still
0-dim tensors of the plain optimizer's dtype and device, in the facade's state too), where one
increment per 0-dim tensor would cost more than the update of small tensors. The class's own
step still runs whenever something is out of the ordinary: state missing (it creates it),
``differentiable``, a tensor ``lr``, complex parameters, or a subclass (which may change the
update).
"""

from __future__ import annotations

import copy
import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.adam import adam
from torch.utils._pytree import tree_map_only

from fused_optim_dist._freed import freed_hidden
from fused_optim_dist._kinds import keeps_state_per_parameter
from fused_optim_dist._protocol import describe
from fused_optim_dist._sharing import refuse_shared_state
from fused_optim_dist._state_identity import StateEntries
from fused_optim_dist._torch_internals import (
    dtensor_from_local,
    local_tensor,
    placed_alike,
    read_grads,
    traced,
)

__all__ = ["Batch", "BucketStepper", "Stepper", "has_rows", "local_gradients"]

# Classes whose fused kernels skip the update (parameters, state and step count) on the device
# when ``found_inf`` is nonzero, as ``torch.amp.GradScaler`` uses them. Fused SGD with momentum
# is left out: a skipped first step leaves its momentum buffer uninitialised (``empty_like``).
_FOUND_INF_CLASSES = (torch.optim.Adam, torch.optim.AdamW)

# Classes whose step is ``Adam.step``, run through the cached lists. See [Note: the update
# without the class's per-parameter loop].
_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})


class Batch(NamedTuple):
    """Parameters of one param group to step now."""

    group: dict[str, Any]
    """The facade's param group (its hyperparameters as they are now)."""
    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    """The local tensors of the parameters' gradients (``local_gradients``), in order."""


_Key = tuple[tuple[int, ...], ...]
"""The parameters of a step by id, per batch."""


_CONTAINERS = (list, tuple, dict)
"""State values holding tensors inside them, which the step sees local and the facade placed."""


def _local_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A facade state entry as the local step sees it, a dict of its own: each DTensor value
    its local tensor, also inside a list, tuple or dict."""
    return {
        key: tree_map_only(DTensor, local_tensor, value)
        if isinstance(value, _CONTAINERS)
        else local_tensor(value)
        for key, value in entry.items()
    }


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, float32 where it is a narrower floating type."""
    if tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < 32:
        return tensor.float()
    return tensor.clone()


LOUD = 1e4
"""The magnitude of the largest gradient element in a check's loud copies (:func:`loud_copy`)."""


def loud_copy(grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` (float32 where narrower) scaled so that its largest element's
    magnitude is ``LOUD``: for checks that must see what a class's step does above a
    threshold (a clipping by the norm of the gradients, ``max_grad_norm=1.0`` as in timm's and
    apex's LAMB) which the first real gradients may not reach. A DTensor's local values are
    scaled by their own largest (each rank's shard by its own factor: still a gradient), with
    no collective and no host sync."""
    loud = _widened(grad)
    local = local_tensor(loud)
    if local.numel():
        local.mul_(LOUD / local.abs().amax().clamp_min(torch.finfo(local.dtype).tiny))
    return loud


def has_rows(value: Any, shard: torch.Tensor) -> bool:
    """Whether a state value is a tensor with one entry per row of ``shard`` (dim 0 its rows)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and shard.dim() > 0
        and value.shape[0] == shard.shape[0]
    )


def _placed_like(value: Any, param: torch.Tensor, local_param: torch.Tensor) -> Any:
    """Return a local state value as the plain optimizer would hold it for ``param``.

    State tensors shaped like the local shard become DTensors placed like ``param``; scalars
    (e.g. Adam's ``step``) stay plain tensors, as torch.optim creates them. FSDP2 shards dim 0
    unevenly (the last ranks may hold fewer rows, or none), so the DTensor is given the global
    shape and stride instead of inferring them from the local shard, and keeps the local
    value's device (host memory under FSDP2's CPU offload, as the plain optimizer's state).

    A state tensor with one entry per row of the shard (dim 0 the shard's rows, other dims its
    own, e.g. ``CompactAdamW``'s per-row quantization scales) is placed like ``param`` too,
    with ``param``'s row count as its global dim 0, when ``param`` is sharded along dim 0 only.
    Tensors in a list, tuple or dict (a class keeping its last gradients in a list) are placed
    one by one.
    """
    if isinstance(value, _CONTAINERS):
        return tree_map_only(torch.Tensor, lambda v: _placed_like(v, param, local_param), value)
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
        return value
    if value.shape == local_param.shape:
        shape, stride = param.shape, param.stride()
    elif has_rows(value, local_param) and all(
        not p.is_shard() or p.is_shard(0) for p in param.placements
    ):
        shape = torch.Size((param.shape[0], *value.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
    else:
        return value
    return dtensor_from_local(value, param.device_mesh, param.placements, shape, stride)


class Stepper(Protocol):
    """What a ``BackwardPass`` steps buckets with: ``BucketStepper``, or ``WholeTensorStepper``
    for optimizers whose update needs each parameter whole."""

    optimizer: Optimizer
    """An instance of the wrapped class, built on the user's parameters."""

    def takes_found_inf(self, batches: Sequence[Batch]) -> bool:
        """Whether a ``found_inf`` flag makes :meth:`step` skip the update on the device."""
        ...

    def step(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None = None,
    ) -> list[dict[str, Any]] | None:
        """Step every parameter of ``batches``, updating ``state`` in place; gradients are left
        in place, the caller frees them. Returns the group dicts the class's own ``step``
        received, one per batch (``None`` where it did not run: torch.optim's classes only)."""
        ...

    def flush(self) -> None:
        """Apply every update still in flight (called when a backward or ``step()`` ends)."""
        ...


def local_gradients(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local tensors of ``params``' gradients, each DTensor gradient placed like its
    parameter first (nothing to do for FSDP2's gradients).

    A gradient placed differently, e.g. the ``Partial`` gradient of a replicated
    tensor-parallel parameter, is redistributed (a collective, run by every rank in the same
    bucket order).

    Raises:
        TypeError: for a plain gradient on a DTensor parameter.
        RuntimeError: for a sparse gradient.
    """
    local_grads = []
    for param, grad in zip(params, read_grads(params), strict=True):
        if type(grad) is DTensor and grad._spec is param._spec:  # FSDP2's, the usual case
            local = grad._local_tensor
        elif isinstance(param, DTensor):
            if not isinstance(grad, DTensor):
                raise TypeError(
                    f"parameter of shape {tuple(param.shape)} is a DTensor but its gradient is "
                    f"a {type(grad).__name__}; set DTensor gradients on DTensor parameters"
                )
            if not placed_alike(grad, param):
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            local = grad._local_tensor
        else:
            local = grad
        if local.is_sparse:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} has a sparse gradient, which the "
                "in-backward step does not support; use dense gradients (e.g. "
                "nn.Embedding(sparse=False))"
            )
        local_grads.append(local)
    return local_grads


class _ParamView:
    """One parameter's local shard and the local views of its state."""

    __slots__ = ("dtensor", "entry", "local", "param", "shard", "state")

    def __init__(self, param: torch.Tensor, entry: dict[str, Any] | None) -> None:
        self.param = param
        self.dtensor = isinstance(param, DTensor)
        # FSDP2's local tensor (checked by identity) and our alias of it: setting the alias's
        # .grad leaves FSDP2's own tensor untouched. A plain parameter is its own shard.
        self.local = local_tensor(param)
        self.shard = self.local.detach() if self.dtensor else param
        # The facade's state entry, and the state the step sees: the same dict for a plain
        # parameter (the step updates the facade's entry directly), a dict of local tensors
        # otherwise, its own even where the entry is empty (``optim.state[p] = {}``): the
        # step fills it with local tensors, which the facade holds placed like ``param``.
        self.entry = entry
        if not self.dtensor or entry is None:
            self.state = entry
        else:
            self.state = _local_entry(entry)

    def replace(self, key: str, value: torch.Tensor) -> None:
        """Hold the plain tensor ``value`` as state ``key``, in the facade's entry too."""
        assert self.entry is not None and self.state is not None
        self.entry[key] = self.state[key] = value


class _Sources:
    """The objects a set of views was derived from, compared by identity before every step.

    Each DTensor parameter's local tensor, each state entry and its values ([Note: checking
    state by identity] in ``_state_identity.py``), and each DTensor value's local tensor. Kept
    as flat lists so that the check of a whole bucket is a few C-level ``map``s, not a Python
    loop per parameter. See [Note: cached local views].
    """

    __slots__ = ("_dtensor_params", "_dtensor_values", "_entries", "_locals", "_value_locals")

    def __init__(self, views: Sequence[_ParamView], state: dict[torch.Tensor, dict]) -> None:
        self._dtensor_params = [view.param for view in views if view.dtensor]
        self._locals = [view.local for view in views if view.dtensor]
        self._entries = StateEntries([view.param for view in views], state)
        self._dtensor_values = [v for v in self._entries.values if isinstance(v, DTensor)]
        self._value_locals = [v._local_tensor for v in self._dtensor_values]

    def match(self, state: dict[torch.Tensor, dict]) -> bool:
        is_ = operator.is_
        return (
            all(map(is_, [p._local_tensor for p in self._dtensor_params], self._locals))
            and self._entries.match(state)
            and all(map(is_, [v._local_tensor for v in self._dtensor_values], self._value_locals))
        )


class _AdamLists:
    """One batch's shards and Adam state as the lists ``torch.optim.adam.adam`` takes, in the
    batch's order. See [Note: the update without the class's per-parameter loop].

    ``steps``: when the batch's ``step`` values are views of this one tensor, so that one
    ``add_`` counts every parameter's step (the per-tensor increment of 0-dim CPU tensors costs
    several times the fused update of small tensors). ``None`` where they cannot be: the
    ``step`` values differ in dtype or device, or the parameters do (the fused kernel then runs
    through ``torch.optim.adam.adam``, which groups them).
    """

    __slots__ = ("exp_avg_sqs", "exp_avgs", "max_exp_avg_sqs", "params", "state_steps", "steps")

    def __init__(self, views: Sequence[_ParamView]) -> None:
        states = [view.state for view in views]
        self.params = [view.shard for view in views]
        self.exp_avgs = [state["exp_avg"] for state in states]
        self.exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        # Only when every entry has one, as amsgrad creates them all at once.
        self.max_exp_avg_sqs = (
            [state["max_exp_avg_sq"] for state in states]
            if all("max_exp_avg_sq" in state for state in states)
            else None
        )
        steps = [state["step"] for state in states]
        self.steps: torch.Tensor | None = None
        if _one_kind(steps) and _one_kind(self.params) and steps[0].dim() == 0:
            # The same values, now views of one tensor, in the facade's state too: they stay
            # 0-dim tensors of the same dtype and device, as the plain optimizer holds them.
            self.steps = torch.stack(steps)
            steps = list(self.steps.unbind())
            for view, step in zip(views, steps, strict=True):
                view.replace("step", step)
        self.state_steps = steps

    @classmethod
    def of(cls, views: Sequence[_ParamView]) -> _AdamLists | None:
        """The lists of ``views``, or ``None`` while a state entry is missing or incomplete,
        or a parameter is complex (``Adam.step`` then handles it)."""
        for view in views:
            if view.state is None or not view.state.keys() >= _ADAM_STATE:
                return None
            if torch.is_complex(view.shard):
                return None
        return cls(views)


def _one_kind(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain tensors of one dtype on one device."""
    first = tensors[0]
    return all(
        type(t) is torch.Tensor and t.dtype == first.dtype and t.device == first.device
        for t in tensors
    )


class _LocalViews:
    """The local views of one set of parameters stepped together. See [Note: cached local
    views]."""

    __slots__ = ("_shard_tuples", "_sources", "adam", "params", "shards", "state_dict")

    def __init__(
        self,
        batches: Sequence[Batch],
        state: dict[torch.Tensor, dict],
        *,
        adam: bool,
        refuse_shared: bool,
    ) -> None:
        self.params = [_ParamView(p, state.get(p)) for batch in batches for p in batch.params]
        if refuse_shared:
            # Before anything is derived (Adam's lists replace the ``step`` values): see [Note:
            # state shared between parameters] in ``_sharing.py``.
            refuse_shared_state([(view.param, view.entry) for view in self.params], describe, state)
        views = iter(self.params)
        per_batch = [[next(views) for _ in batch.params] for batch in batches]
        # Each batch's shards: the ``params`` list of the group handed to the wrapped step.
        self._shard_tuples = [tuple(view.shard for view in batch) for batch in per_batch]
        self.shards = list(map(list, self._shard_tuples))
        # The state the wrapped step sees, keyed by shard; entries it creates land here.
        self.state_dict: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for view in self.params:
            if view.state is not None:
                self.state_dict[view.shard] = view.state
        # Per batch, Adam's lists; None while any batch's state is incomplete.
        lists = [_AdamLists.of(batch) for batch in per_batch] if adam else [None]
        self.adam: list[_AdamLists] | None = None if None in lists else lists
        # Taken last: building Adam's lists replaces the ``step`` values.
        self._sources = _Sources(self.params, state)

    def is_current(self, state: dict[torch.Tensor, dict]) -> bool:
        return self._sources.match(state)

    def handed_shards(self) -> list[list[torch.Tensor]]:
        """Each batch's ``params`` list for the wrapped step: the same lists at every step,
        restored where a step changed one. See [Note: cached local views]."""
        for shards, kept in zip(self.shards, self._shard_tuples, strict=True):
            if len(shards) != len(kept) or not all(map(operator.is_, shards, kept)):
                shards[:] = kept
        return self.shards


class BucketStepper:
    """Steps batches of parameters with ``optimizer``'s update code.

    Args:
        optimizer: an instance of the wrapped class, built on the user's parameters; only its
            ``step`` code and ``defaults`` are used.
        local_shards: step DTensor parameters through their local shards (exact only for
            elementwise optimizers) instead of as DTensors.
    """

    def __init__(self, optimizer: Optimizer, *, local_shards: bool) -> None:
        self.optimizer = optimizer
        self.local_shards = local_shards
        step = type(optimizer).step
        # Optimizer._patch_step_function wraps ``step`` with profiling and the global hooks.
        self._step = step.__wrapped__ if getattr(step, "hooked", False) else step
        # Whether the step may run through cached lists (not for a subclass, which may change
        # the update). See [Note: the update without the class's per-parameter loop].
        self._adam = local_shards and type(optimizer) in _ADAM_CLASSES
        # Whether a state tensor shared between parameters is refused: see [Note: state shared
        # between parameters] in ``_sharing.py``.
        self._refuse_shared = keeps_state_per_parameter(type(optimizer))
        # Cached local views by parameter set, and the set each parameter was last seen in.
        self._views: dict[_Key, _LocalViews] = {}
        self._key_of: dict[int, _Key] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> BucketStepper:
        """A copy of the wrapped optimizer, without cached views: views copied apart from the
        copied parameters would no longer alias them."""
        return type(self)(copy.deepcopy(self.optimizer, memo), local_shards=self.local_shards)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as what it was built from: the cached views would not alias the unpickled
        parameters, and the unwrapped ``step`` is no importable object."""
        return {"optimizer": self.optimizer, "local_shards": self.local_shards}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizer"], local_shards=state["local_shards"])

    def takes_found_inf(self, batches: Sequence[Batch]) -> bool:
        """Whether a ``found_inf`` flag makes this step skip the update on the device."""
        optimizer = self.optimizer
        if isinstance(optimizer, _FOUND_INF_CLASSES):
            return all(group.get("fused") for group, _, _ in batches)
        if type(optimizer) is torch.optim.SGD:
            return all(group.get("fused") and group["momentum"] == 0 for group, _, _ in batches)
        return False

    def flush(self) -> None:
        """Apply updates still in flight: none, every update is applied in :meth:`step`."""

    def step_without_gradients(self, groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the class's ``step`` on ``groups``, none of whose parameters holds a gradient,
        with a scratch state (as the plain optimizer's step skips parameters without one, but
        may read a group's parameters, e.g. ``params[0].device``); the groups it received."""
        groups = [dict(group) for group in groups]
        with freed_hidden([p for group in groups for p in group["params"]]):
            return self._run(groups, defaultdict(dict), None)

    @torch.no_grad()
    def step_copies(
        self, batches: Sequence[Batch], state: dict, *, loud: bool = False
    ) -> tuple[list[dict[str, Any]], dict[torch.Tensor, dict]]:
        """Run the class's ``step`` on copies of ``batches``' parameters (local shards, or the
        DTensors), their gradients and their ``state`` entries, never the originals; the
        groups it received (their ``params`` the copies) and the copies' state. For checks
        made before a class's first real update, which compare copies with copies: bfloat16
        and float16 tensors are copied to float32, as :meth:`step_rows` copies them, so that a
        small move is not rounded away. ``loud``: each gradient is a :func:`loud_copy`."""
        copies: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        groups = []
        widened = loud_copy if loud else _widened
        for batch in batches:
            params = []
            for param, grad in zip(batch.params, batch.grads, strict=True):
                source = local_tensor(param) if self.local_shards else param
                clone = _widened(source.detach())
                clone.grad = widened(grad if self.local_shards else param.grad)
                entry = state.get(param)
                if entry is not None:
                    if self.local_shards:  # as the real step sees it: local values
                        entry = _local_entry(entry)
                    copies[clone] = {
                        key: _widened(value)
                        if isinstance(value, torch.Tensor)
                        else copy.deepcopy(value)
                        for key, value in entry.items()
                    }
                params.append(clone)
            groups.append(_handed(batch.group, params, batch.params))
        return self._run(groups, copies, None), copies

    @torch.no_grad()
    def step_rows(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        grad: torch.Tensor,
        rows: slice,
        state: dict,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Run the class's ``step`` on a copy of ``rows`` of ``param``'s local shard alone (its
        gradient ``grad``, the local tensor), with copies of those rows of its state (state
        tensors with the shard's rows; any other value copied whole), never the originals:
        the stepped copy and its state. Copies of bfloat16 and float16 tensors are float32:
        rounding a small move to 8 bits would hide a difference, and torch's fused SGD with
        momentum rounds a few bfloat16 elements otherwise at another offset (0.12 on 16 of
        21K elements, measured), which is no reading of other elements. For the check that a
        class declared ``"elementwise"`` steps rows apart as it steps them together
        (``ClassState.check``)."""
        shard = local_tensor(param)
        clone = _widened(shard[rows])
        clone.grad = _widened(grad[rows])
        copies: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for key, value in _local_entry(state.get(param, {})).items():
            if has_rows(value, shard):
                copies[clone][key] = _widened(value[rows])
            else:
                copies[clone][key] = copy.deepcopy(value)
        self._run([_handed(group, [clone], [param])], copies, None)
        return clone, copies.get(clone, {})

    @torch.no_grad()
    def step(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None = None,
    ) -> list[dict[str, Any]] | None:
        """Step every parameter of ``batches`` with its gradient, updating ``state`` in place.

        The local-shard step reads the batches' ``grads``, the DTensor step each parameter's
        ``.grad`` (placed like its parameter). Gradients are left in place; the caller frees
        them. ``found_inf`` (only where
        :meth:`takes_found_inf`): a 0-dim float tensor, nonzero to skip the update on the device.
        """
        if self.local_shards:
            return self._step_local(batches, state, found_inf)
        groups = [_handed(group, params, params) for group, params, _ in batches]
        return self._run(groups, state, found_inf)

    def _local_views(self, batches: Sequence[Batch], state: dict) -> tuple[_Key, _LocalViews]:
        """The cached views of ``batches``' parameters, re-derived if a source changed."""
        key = tuple(tuple(map(id, batch.params)) for batch in batches)
        views = self._views.get(key)
        if views is not None and views.is_current(state):
            return key, views
        with traced("fused_optim_dist::derive_local_views"):
            views = self._views[key] = _LocalViews(
                batches, state, adam=self._adam, refuse_shared=self._refuse_shared
            )
            # At most one cached set per parameter. See [Note: cached local views].
            for ids in key:
                for pid in ids:
                    previous = self._key_of.get(pid)
                    if previous is not None and previous != key:
                        self._views.pop(previous, None)
                    self._key_of[pid] = key
        return key, views

    def _step_local(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None,
    ) -> list[dict[str, Any]] | None:
        key, views = self._local_views(batches, state)
        groups = [batch.group for batch in batches]
        adam = views.adam
        if adam is not None and all(map(_adam_lists_apply, groups, adam)):
            with traced("fused_optim_dist::update"):
                for batch, lists in zip(batches, adam, strict=True):
                    self._adam_update(batch.group, lists, batch.grads, found_inf)
            return None
        local_groups = [
            _handed(batch.group, shards, batch.params, new_list=False)
            for batch, shards in zip(batches, views.handed_shards(), strict=True)
        ]
        grads = [grad for batch in batches for grad in batch.grads]
        dtensor_views = []
        for view, grad in zip(views.params, grads, strict=True):
            if view.shard is not view.param:
                view.shard.grad = grad
                dtensor_views.append(view)
        try:
            handed = self._run(local_groups, views.state_dict, found_inf)
        finally:
            for view in dtensor_views:
                view.shard.grad = None
        if self._write_back(views, state):
            # New or replaced state: the views are re-derived from it at the next step.
            del self._views[key]
        return handed

    def _adam_update(
        self,
        group: dict[str, Any],
        lists: _AdamLists,
        grads: Sequence[torch.Tensor],
        found_inf: torch.Tensor | None,
    ) -> None:
        """``Adam.step`` of one group, on the cached lists. See [Note: the update without the
        class's per-parameter loop]."""
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        beta1, beta2 = group["betas"]
        max_exp_avg_sqs = lists.max_exp_avg_sqs if group["amsgrad"] else []
        direct = group["fused"] and lists.steps is not None and _numbers(group["lr"], beta1, beta2)
        if direct:
            # What torch.optim.adam._fused_adam does for tensors of one device and dtype,
            # with the step count incremented (and restored when skipped) in one op.
            device = lists.steps.device
            if found_inf is not None:
                found_inf = found_inf.to(device, non_blocking=True)
            if grad_scale is not None:
                grad_scale = grad_scale.to(device, non_blocking=True)
        tensors = (
            lists.params,
            grads,
            lists.exp_avgs,
            lists.exp_avg_sqs,
            max_exp_avg_sqs,
            lists.state_steps,
        )
        # The arguments the fused kernels and the functional adam() share.
        hyperparameters = dict(
            amsgrad=group["amsgrad"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if direct:
            lists.steps.add_(1)
            kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
            kernel(*tensors, **hyperparameters)
            if found_inf is not None:
                lists.steps.sub_(found_inf)
            return
        adam(
            *tensors,
            **hyperparameters,
            has_complex=False,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            fused=group["fused"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    @staticmethod
    def _write_back(views: _LocalViews, state: defaultdict[torch.Tensor, dict]) -> bool:
        """Bring state the step created, replaced, added or removed into the facade's
        ``state``; whether any.

        The step may change the local dict it was handed in place (``state[p]["buf"] = buf *
        beta + grad``, a key added at a later step, an entry left empty by hand filled), so
        each local value is compared with what the facade holds, not with the dict."""
        changed = False
        local_state = views.state_dict
        for view in views.params:
            after = local_state.get(view.shard)
            if after is None:  # never looked up (one looked up and left empty is kept, as plain's)
                continue
            if view.shard is view.param:  # a plain parameter: ``after`` is its state entry
                if state.get(view.param) is not after:
                    state[view.param] = after
                    changed = True
                continue
            # The facade's entry the views were checked against before this step (no lookup:
            # hashing a DTensor is a Python call); a new one where there was none.
            entry = view.entry if view.entry is not None else state[view.param]
            same_keys = after.keys() == entry.keys()
            if same_keys and all(map(_holds, map(entry.__getitem__, after), after.values())):
                continue
            for k, value in after.items():
                if k not in entry or not _holds(entry[k], value):
                    entry[k] = _placed_like(value, view.param, view.shard)
            for k in entry.keys() - after.keys():
                del entry[k]
            changed = True
        return changed

    def _run(
        self,
        groups: list[dict[str, Any]],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None,
    ) -> list[dict[str, Any]]:
        """Run the class's own step on ``groups`` (returned: what the step left in them)."""
        optimizer = self.optimizer
        optimizer.param_groups, optimizer.state = groups, state
        optimizer.found_inf = found_inf
        try:
            with traced("fused_optim_dist::update"):
                self._step(optimizer)
            return groups
        finally:
            # Drop the references so the stepper never keeps a bucket's tensors alive.
            optimizer.param_groups, optimizer.state = [], defaultdict(dict)
            optimizer.found_inf = None


def _holds(facade_value: Any, local_value: Any) -> bool:
    """Whether the facade's state value is ``local_value``, or a DTensor over it."""
    return local_tensor(facade_value) is local_value


def _handed(
    group: dict[str, Any],
    params: Sequence[torch.Tensor],
    members: Sequence[torch.Tensor],
    *,
    new_list: bool = True,
) -> dict[str, Any]:
    """``group`` as the class's step gets it for a batch: its ``params`` (``members``, or
    their local shards or copies; a new list, or with ``new_list=False`` the list ``params``
    itself), and for a group of named parameters (an optimizer built on
    ``model.named_parameters()``) the names of ``members``, in their order, as the class would
    zip ``param_names`` with ``params``."""
    handed = {**group, "params": list(params) if new_list else params}
    names = group.get("param_names")
    if names is not None:
        by_id = dict(zip(map(id, group["params"]), names, strict=True))
        if all(id(p) in by_id for p in members):
            handed["param_names"] = [by_id[id(p)] for p in members]
        else:  # not the group's own tensors (an owner rank's full copies): no names to give
            del handed["param_names"]
    return handed


def _numbers(*values: Any) -> bool:
    return not any(isinstance(v, torch.Tensor) for v in values)


def _adam_lists_apply(group: dict[str, Any], lists: _AdamLists) -> bool:
    """Whether ``Adam.step`` on ``group`` is exactly the functional call on ``lists``."""
    return (
        not group["differentiable"]
        and not isinstance(group["lr"], torch.Tensor)
        and (lists.max_exp_avg_sqs is not None or not group["amsgrad"])
    )
