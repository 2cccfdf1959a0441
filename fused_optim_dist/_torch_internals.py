"""The one module that reads torch internals (FSDP2, DDP and the autograd engine).

Everything else in the package uses public APIs. What this module relies on, for torch 2.13:

* ``torch.distributed._composable_state._module_state_mapping`` maps every module managed by a
  composable API (``fully_shard`` among them) to its state object.
* ``FSDPState._fsdp_param_groups`` lists the state's ``FSDPParamGroup`` objects (torch 2.11,
  on which GPU checks run, keeps its one group, or ``None``, as ``_fsdp_param_group``), and
  each group's ``fsdp_params[i].sharded_param`` is the DTensor ``nn.Parameter`` registered on
  the module. One
  group is one FSDP unit: its gradients are reduce-scattered together into one flat buffer, and
  ``foreach_reduce`` (``_fsdp_collectives.py``) then calls each sharded parameter's
  post-accumulate-grad hooks, one after the other.
* ``DistributedDataParallel`` and FSDP1's ``FullyShardedDataParallel`` keep no registry of
  their instances, so finding one built before the optimizer means scanning the garbage
  collector's objects; this is done once per optimizer, and only for plain-tensor parameters
  in a multi-process job. One built later (Hugging Face's Trainer and accelerate wrap the
  model after the optimizer is built) assigns its wrapped module (``self.module = module``,
  ``self._fsdp_wrapped_module = module``) in its ``__init__``, which runs the global module
  registration hooks (``torch.nn.modules.module.register_module_module_registration_hook``):
  ``watch_wrappers`` installs one that keeps every such instance in a weak set. FSDP1's
  ``parameters()`` are its ``FlatParameter`` (``use_orig_params=False``) or the original
  ``nn.Parameter`` objects, each rank's flat slice of them (``use_orig_params=True``).
* A backward that runs inside another one (reentrant activation checkpointing:
  ``CheckpointFunction.backward`` calls ``torch.autograd.backward``) runs while the outer graph
  task executes a Python autograd Function's node, whose Python frame is
  ``BackwardCFunction.apply(self, ...)`` in ``torch/autograd/function.py`` with ``self`` the
  node itself. A post hook registered on that node (``Node.register_hook``) while it runs is
  called when it returns, in the outer graph task, where ``queue_callback`` queues on the outer
  task (checked on torch 2.13).
* A backward run from a hook of another backward (a tensor hook, a node's or a module's backward
  hook: GradCache's surrogate backwards) runs as a graph task of its own inside the outer one,
  with no autograd Function's frame between them. Every backward called from Python runs
  ``_engine_run_backward`` (``torch/autograd/graph.py``), which calls the engine: on the thread
  that called it, the engine runs the CPU's nodes and their hooks, so a hook there sees the
  backward's own frame, and a nested backward's above it (two frames, checked on torch 2.13);
  the nodes of an accelerator run on a thread of the engine's own, which Python did not start
  (``threading.current_thread()`` is a dummy thread), where a hook sees no frame of the
  backward that called it, and any ``_engine_run_backward`` frame is a nested backward's. A
  Function's node calling a nested backward (reentrant checkpointing) has its ``apply`` frame
  between the two backwards' frames (or, on an accelerator's thread, below the nested one's);
  a hook has none there. ``apply`` frames above a backward's own frame (FSDP2's
  ``RegisterPostBackwardFunction``, whose node calls the hooks) run inside that backward and
  do not count. The accelerator's case is read from the engine's design, not checked on one.
* ``torch.amp.GradScaler.scale`` (and FSDP1's ``ShardedGradScaler.scale``, which overrides
  it) multiplies its outputs by the scale and offers no hook: ``watch_loss_scaling`` replaces
  the class attributes with wrappers that register a tensor hook on each scaled output that
  requires grad. Autograd calls a tensor's hooks when that tensor's gradient is computed, so a
  backward from a scaled loss (or from anything computed from it) calls it before any
  parameter's gradient that flows through it, in that backward's graph task, where
  ``queue_callback`` queues on that task. A scaler built from a subclass of its own that
  overrides ``scale`` is not seen (``step()`` still refuses it: ``_refuse_grad_scaler`` in
  ``optimizer.py``).
* ``torch.autograd.graph.saved_tensors_hooks`` (the base of ``save_on_cpu`` and of the hooks
  non-reentrant activation checkpointing installs, ``torch.utils.checkpoint``'s
  ``_checkpoint_hook`` and ``_recomputation_hook``) takes its pack and unpack hooks in
  ``__init__``, and offers no way to be told what they save: ``watch_saved_tensors_hooks``
  wraps ``__init__``. A tensor saved through such hooks is not checked against its version
  counter when unpacked (autograd checks only the tensors it saves itself; checked on torch
  2.13), so an in-place write between forward and backward goes unseen; the pack hook gets
  the tensor autograd saves, a parameter itself or an alias that shares its memory and
  version counter (``.detach()``), and the unpack hook returns what the node reads (the same
  tensor, a copy, or one recomputed). Hooks installed by calling
  ``torch._C._autograd._push_saved_tensors_default_hooks`` directly are not seen.
* ``torch.distributed.destroy_process_group`` offers no hook: ``before_teardown`` replaces the
  module attribute (``torch.distributed`` re-exports ``distributed_c10d``'s function) with a
  wrapper that runs the callbacks first when the default group is destroyed (not a subgroup,
  which only its members destroy); code that imported the function by name earlier keeps the
  original, so the callbacks also run at interpreter exit (``atexit``).
* ``torch.optim.optimizer._global_optimizer_pre_hooks`` holds the hooks
  ``register_optimizer_step_pre_hook`` registered for every optimizer, and an optimizer keeps
  its own hooks in the instance attributes ``OPTIMIZER_HOOKS`` names (which
  ``Optimizer.__getstate__`` leaves out of a copy and ``__setstate__`` creates empty).
* The autograd engine runs callbacks queued with ``Variable._execution_engine.queue_callback``
  once the current backward has finished, in the order they were queued, including callbacks
  queued by a running callback (``exec_post_processing`` in ``engine.cpp`` loops until the list
  is exhausted). FSDP2 queues its final callback at the root's first pre-backward hook, and may
  still reduce a unit (and call our hooks) inside it; a parameter outside every ``fully_shard``
  can get its gradient before that hook, so ours may be queued first. ``queue_end_of_backward``
  therefore queues a callback that queues ours: it runs after every callback queued during the
  backward. ``torch._C._current_graph_task_id()`` is ``-1`` outside a backward and stays the
  backward's id while its callbacks run.
* ``DTensor._local_tensor`` is the local shard itself: ``to_local()`` returns it through an
  autograd Function (microseconds per call, which adds up over hundreds of small parameters).
  FSDP2 keeps the same local tensor object across steps and replaces it only when it re-creates
  the shard (``FSDPParam.reset_sharded_param`` at lazy init, e.g. after ``to_empty``), so an
  identity check of ``_local_tensor`` tells a cached alias of the shard is still the shard.
* FSDP2 inserts ``RegisterPostBackwardFunction`` (``_fsdp_param_group.py``) on a unit's forward
  inputs; its node, ``RegisterPostBackwardFunctionBackward`` by ``Node.name()``, runs the
  unit's ``post_backward``, which reduce-scatters the gradients and calls the sharded
  parameters' post-accumulate-grad hooks in ``foreach_reduce``, every one of them before it
  returns. ``torch._C._current_autograd_node()`` is that node inside those hooks, and a post
  hook registered on it while it runs (``Node.register_hook``) is called when it returns:
  after the last gradient of that reduction, whichever parameters got one. A unit the forward
  applied twice is reduced twice in one backward (the second time in its first application's
  node or in the end-of-backward callback). A unit whose node did not run (no input required
  grad) is reduced in FSDP2's end-of-backward callback, where there is no current node. Under
  compiled autograd ``foreach_reduce`` calls no hook (compiled autograd runs them), so there is
  no such node either.
* FSDP2 builds each sharded gradient (``FSDPParam.to_sharded_dtensor``) on its parameter's
  own ``DTensorSpec`` object, so an identity check of ``_spec`` tells they are placed alike
  without comparing placements.
* ``torch._utils._flatten_dense_tensors`` concatenates tensors of any shapes into one flat
  tensor in one C++ call (DDP and FSDP1 bucket with it), with type promotion as ``torch.cat``.
* Reading or writing ``.grad`` or ``.requires_grad`` of a tensor subclass (every FSDP2
  parameter is a DTensor) first looks for a ``__torch_function__`` override, which costs a few
  hundred nanoseconds per access, repeated for every parameter in every backward. DTensor and
  ``nn.Parameter`` disable ``__torch_function__``, so under
  ``torch._C.DisableTorchFunctionSubclass`` the same fields are read and written directly.
* ``torch.profiler.record_function`` calls into the dispatcher even when no profiler runs (about
  ten microseconds per range on the CPU); ``torch.autograd._profiler_enabled()`` tells whether
  a profiler is recording on this thread, and the autograd engine propagates that state to its
  device threads.
* A tensor's post-accumulate-grad hooks are kept in ``tensor._post_accumulate_grad_hooks``, an
  ordered dict by the id of each hook's ``RemovableHandle``, and run in that order; so the hook
  registered last is its last key.
* [Note: FSDP2's copies and flags] ``FSDPParamGroup`` records whether a unit holds
  all-gathered weights (``is_sharded``, ``is_unsharded``; ``_all_gather_result`` is set from
  the issue of an all-gather, whose copy-in reads the shards at once, until it is waited for;
  on a one-rank FSDP mesh, or a mesh without one, ``unshard`` records an empty result and
  ``wait_for_unshard`` copies the shards then, so a pending result holds no copy)
  and whether it reduces its gradients (``reduce_grads``, which
  ``set_requires_gradient_sync`` sets; on a mesh with a replicate dimension,
  ``mesh_info`` a ``DDPMeshInfo``, also ``all_reduce_grads``, which
  ``set_requires_all_reduce`` sets: off, the reduce-scatter's output is kept in
  ``_partial_reduce_output`` and no gradient is handed out until a backward that all-reduces).
  While a unit is unsharded its modules hold FSDP2's
  unsharded parameters (``FSDPParam.unsharded_param``); each all-gather copies the sharded
  parameter's ``requires_grad`` to the unsharded one (``FSDPParam.to_unsharded``), never back.
  A root unit stays unsharded after a forward that gets no backward (an evaluation under
  ``torch.no_grad()``; so does any unit with ``reshard_after_forward=False``), so a
  ``requires_grad_()`` on its modules then reaches only the unsharded parameters, and decides
  whether autograd computes their gradient, which FSDP2 reduces into the sharded parameter;
  and ``parameters()`` of its modules lists the unsharded parameters (or, resharded after
  forward to a smaller world, ``FSDPParam._sharded_post_forward_param``), which an optimizer
  given them would hold in place of the sharded ones (``fsdp_gathered_copies``).
  A unit's ``_training_state`` is ``PRE_BACKWARD`` or ``POST_BACKWARD`` from its unshard in
  backward until FSDP2's final callback; its post-backward reshards it before handing out the
  gradients. FSDP2 runs a sharded parameter's post-accumulate-grad hooks whatever its
  ``requires_grad``, but torch refuses to register one on a tensor that does not require
  grad.
* [Note: checkpoint staging in flight] DCP's asynchronous staging (``DefaultStager`` with
  ``StagingOptions(use_async_staging=True)``, torchtitan's ``async_with_pinned_mem``) copies
  the state dict's tensors in ``DefaultStager._stage``, run by the stager's one-worker
  ``ThreadPoolExecutor`` after ``async_save`` returns; torch lets the state change once
  ``staging_completion`` is done, and a plain loop waits for it before ``optimizer.step()``.
  This optimizer changes the weights and its state in backward, before that wait, so
  ``wait_for_checkpoint_staging`` waits, before the first update of a backward, until no other
  thread's stack holds a frame of ``DefaultStager._stage`` (``sys._current_frames``). A
  staging submitted but not yet started by its worker is not seen: the worker is woken when
  the task is submitted, a forward before.
* [Note: data swapped by assignment] ``p.data = other`` (``Tensor.set_data``) gives ``p``
  ``other``'s storage and moves no version counter; ``untyped_storage()`` returns one Python
  object per storage (and a held one keeps it, so its address cannot be reused), so an
  identity check of the held object against ``p``'s tells the swap. On a DTensor it changes
  only the wrapper's metadata: the local shard, which DTensor's ops read and write, keeps its
  object, storage and values, for the plain optimizer alike. A write through ``.data``
  (``p.data.copy_(other)``) keeps the storage, and ``.data`` has a version counter of its
  own: it is not seen. The swapped-out storage lives on while something holds it, but
  ``set_data`` rewrites ``p``'s dtype, sizes, strides and offset in place: what it held can
  be read only through an alias taken before (``detach()``, which keeps them). One alias per
  updated parameter per backward: about 0.6 us each on the CPU (200 parameters, measured).
* ``torch._C._will_engine_execute_node(node)`` (what ``register_multi_grad_hook`` asks) tells,
  inside a backward, whether that backward's graph task runs ``node``: one of the nodes
  ``backward(inputs=...)`` asked for, or any node of the graph without ``inputs``. A plain
  leaf's gradient edge (``torch.autograd.graph.get_gradient_edge``) is its ``AccumulateGrad``
  node, so it tells whether the backward running will give that leaf a gradient, before any
  node of it runs. FSDP2's sharded parameters get theirs from FSDP2's reduction, not from a
  node of the graph; the unsharded parameters their unit's forward read are leaves of the
  graph, and FSDP2 keeps those objects from one all-gather to the next
  (``FSDPParam.init_unsharded_param`` returns early once ``_unsharded_param`` exists), so
  their nodes tell it for the unit (``FSDPUnit.will_get_gradients``).
* [Note: tensors swapped whole] ``torch.utils.swap_tensors(p, new)`` keeps ``p``'s Python
  object but gives it ``new``'s C++ tensor: ``Module.to()`` and ``_apply`` call it for DTensor
  parameters (FSDP2's sharded ones, tensor-parallel ones), and for every parameter under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``, as ``load_state_dict`` does
  there. It refuses a tensor that has a weak reference, so nothing in this package holds one to
  a parameter (a plain optimizer holds none either). ``p._cdata``, the address of the C++
  tensor the object points to, changes with the swap (the old one is alive while the new is
  given). A post-accumulate-grad hook lives in two places: the Python dict
  ``p._post_accumulate_grad_hooks``, which stays with the object, and a registration of that
  dict on the C++ tensor's autograd metadata, made when the attribute is set, which stays with
  the old tensor. Autograd runs a leaf's hooks through the registration, so after a swap
  ``p``'s hooks no longer run, and a hook registered again goes into the old dict, unregistered
  (checked on torch 2.13); setting the attribute to a new dict registers that one. FSDP2 runs a
  sharded parameter's hooks from the dict itself (``foreach_reduce``), so they still run.
* ``torch._subclasses.fake_tensor.is_fake`` tells a ``FakeTensor`` (``FakeTensorMode``, what the
  memory estimator runs under), which has no values to read, from a real tensor.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import operator
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = [
    "OPTIMIZER_HOOKS",
    "Enclosing",
    "FSDPUnit",
    "GraphTaskToken",
    "before_teardown",
    "current_backward_id",
    "drop_grads",
    "enclosing_backward",
    "flatten",
    "fsdp_gathered_copies",
    "fsdp_post_backward_node",
    "fsdp_reduced_params",
    "fsdp_sync_off",
    "fsdp_units",
    "fsdp_units_of",
    "global_step_pre_hooks",
    "held_values",
    "holds_hook",
    "holds_values",
    "impl_address",
    "in_scaled_backward",
    "local_tensor",
    "observes_only",
    "placed_alike",
    "queue_end_of_backward",
    "read_grads",
    "read_requires_grad",
    "register_post_accumulate_grad_hook",
    "storages",
    "traced",
    "wait_for_checkpoint_staging",
    "watch_loss_scaling",
    "watch_saved_tensors_hooks",
    "watch_wrappers",
    "when_node_returns",
    "will_get_gradient",
    "wrapped_by",
    "wrappers_holding",
]


OPTIMIZER_HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The instance attributes in which ``torch.optim.Optimizer`` keeps an optimizer's hooks."""


class FSDPUnit(NamedTuple):
    """One FSDP2 unit (its ``FSDPParamGroup``) and FSDP2's records (``FSDPParam``) of the
    parameters asked about that it manages, in the unit's own order."""

    group: Any
    records: list[Any]

    @property
    def params(self) -> list[torch.Tensor]:
        return [record.sharded_param for record in self.records]

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules of the ``fully_shard`` call that made the unit."""
        return tuple(self.group.modules)

    def holds_gathered_copy(self) -> bool:
        """Whether the unit holds all-gathered weights: unsharded, resharded after forward to a
        smaller world, or with an all-gather issued and not yet waited for (its copy-in has
        read the shards: not on a one-rank mesh, where the copy is made at the wait). See
        [Note: FSDP2's copies and flags]."""
        group = self.group
        if not group.is_sharded:
            return True
        return group._all_gather_result is not None and _gather_world_size(group) > 1

    def module_requires_grad(self) -> list[bool] | None:
        """Each parameter's ``requires_grad`` as autograd sees it while the unit is unsharded
        or in backward (the unsharded parameters': after the unit's post-backward reshard, as
        its gradients are handed out, still the flags they were computed with), or ``None``
        otherwise (the sharded parameters' own flags hold: the next all-gather copies them).
        See [Note: FSDP2's copies and flags]."""
        group = self.group
        if not (group.is_unsharded or group._training_state in _in_backward_states()):
            return None
        return [record.unsharded_param.requires_grad for record in self.records]

    def unreduced(self) -> list[torch.Tensor]:
        """The parameters of which FSDP2 holds a gradient accumulated unsharded (micro-batches
        with gradient sync off), which the next backward that reduces the unit hands to
        them, whatever their ``requires_grad`` then."""
        return [r.sharded_param for r in self.records if _holds_unreduced_gradient(r)]

    def holds_unreduced_gradients(self) -> bool:
        """Whether FSDP2 holds gradients of the unit it has not reduced (accumulated unsharded
        by backwards with gradient sync off, or reduce-scattered but not all-reduced across
        HSDP's replicas, all-reduce off)."""
        if self.group._partial_reduce_output is not None:  # HSDP, all-reduce off
            return True
        return any(map(_holds_unreduced_gradient, self.records))

    def will_get_gradients(self) -> bool:
        """Whether the backward running will give these parameters gradients to reduce: the
        unit's forward read its unsharded parameters, whose ``AccumulateGrad`` nodes that
        backward runs (FSDP2 keeps the unsharded parameter objects from one all-gather to the
        next: [Note: FSDP2's copies and flags]). Call only in backward."""
        for record in self.records:
            unsharded = getattr(record, "_unsharded_param", None)
            if unsharded is not None and unsharded.requires_grad and will_get_gradient(unsharded):
                return True
        return False

    def aliases(self) -> list[torch.Tensor]:
        """Every tensor FSDP2 registers on the unit's modules for these parameters, whatever
        the unit's state: the sharded parameters, and the unsharded ones (and those resharded
        after forward to a smaller world) where made."""
        tensors = []
        for record in self.records:
            tensors.append(record.sharded_param)
            for name in ("_unsharded_param", "_sharded_post_forward_param"):
                alias = getattr(record, name, None)
                if alias is not None:
                    tensors.append(alias)
        return tensors


def _holds_unreduced_gradient(record: Any) -> bool:
    """Whether FSDP2 holds a gradient of the parameter of ``record`` (an ``FSDPParam``)
    accumulated unsharded, not reduced yet."""
    if record.unsharded_accumulated_grad is not None:
        return True
    unsharded = getattr(record, "_unsharded_param", None)
    return unsharded is not None and unsharded.grad is not None


@functools.cache
def _in_backward_states() -> tuple[Any, ...]:
    """FSDP2's training states of a unit from its unshard in backward to its final callback."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD


def dtensor_from_local(
    local: torch.Tensor,
    mesh: Any,
    placements: Sequence[Any],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
    stride=stride)``, with ``local`` kept on its device: ``from_local`` moves a local tensor
    to the mesh's device type, but FSDP2's CPU offload keeps the shards of parameters and
    gradients, and so torch.optim's state made from them, in host memory on a CUDA mesh. Such
    a tensor is wrapped as FSDP2 wraps its sharded parameters
    (``_fsdp_common._from_local_no_grad``: the DTensor constructor with a ``DTensorSpec``);
    any other goes through ``from_local``."""
    if local.device.type == mesh.device_type or local.is_meta:
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _gather_world_size(group: Any) -> int:
    """The ranks a unit's all-gather spans, as ``FSDPParamGroup.unshard`` counts them (1 on a
    mesh without an FSDP dimension)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    if not isinstance(group.mesh_info, FSDPMeshInfo):
        return 1
    return group._all_gather_process_group.size()


impl_address: Callable[[torch.Tensor], int] = operator.attrgetter("_cdata")
"""The address of the C++ tensor a tensor points to, which ``swap_tensors`` replaces (read
at C level: the plan compares it for every parameter at every backward and ``step()``). See
[Note: tensors swapped whole]."""


def holds_hook(param: torch.Tensor, handle_id: int | None) -> bool:
    """Whether ``param``'s post-accumulate-grad hooks list the one whose handle has
    ``handle_id`` (handle ids are unique in the process)."""
    return handle_id in (param._post_accumulate_grad_hooks or ())


def register_post_accumulate_grad_hook(
    param: torch.Tensor, hook: Callable[[torch.Tensor], None], *, afresh: bool = False
) -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)``, also on an FSDP2 sharded parameter
    that does not require grad while its unsharded one does (FSDP2 runs the hook all the
    same): registered with the flag set for the call. See [Note: FSDP2's copies and flags].

    ``afresh``: into a new dict of hooks registered on ``param``'s C++ tensor, for a parameter
    swapped whole since its hooks were registered, whose old dict autograd no longer runs (nor
    would a plain loop's: its hooks are left there). See [Note: tensors swapped whole]."""
    if afresh:
        param._post_accumulate_grad_hooks = OrderedDict()
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)
    param.requires_grad_(True)
    try:
        return param.register_post_accumulate_grad_hook(hook)
    finally:
        param.requires_grad_(False)


def _state_param_groups(state_ref: Any) -> list[Any]:
    """The FSDP2 units (``FSDPParamGroup``) of the state ``state_ref`` refers to (none where it
    is not ``fully_shard``'s)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    state = state_ref() if state_ref is not None else None
    if not isinstance(state, FSDPState):
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.11: one group or None, as ``_fsdp_param_group``
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def _fsdp_param_groups() -> Iterator[Any]:
    """Every FSDP2 unit (``FSDPParamGroup``) of the process, once each."""
    from torch.distributed._composable_state import _module_state_mapping

    seen: set[int] = set()
    for state_ref in list(_module_state_mapping.values()):
        for param_group in _state_param_groups(state_ref):
            if id(param_group) not in seen:
                seen.add(id(param_group))
                yield param_group


def fsdp_units_of(module: nn.Module) -> list[FSDPUnit]:
    """The FSDP2 units ``fully_shard(module)`` made, with all their parameters (none where
    ``module`` was not given to ``fully_shard``)."""
    from torch.distributed._composable_state import _module_state_mapping

    return [
        FSDPUnit(param_group, list(param_group.fsdp_params))
        for param_group in _state_param_groups(_module_state_mapping.get(module))
    ]


def fsdp_units(params: Iterable[torch.Tensor]) -> list[FSDPUnit]:
    """Group ``params`` by the FSDP2 unit (``FSDPParamGroup``) that reduces their gradients.

    Returns one unit per ``FSDPParamGroup`` that holds at least one of ``params``, its members
    in the unit's own parameter order; parameters that no ``fully_shard`` manages are left out.
    """
    wanted = {id(p) for p in params}
    units: list[FSDPUnit] = []
    for param_group in _fsdp_param_groups():
        records = [r for r in param_group.fsdp_params if id(r.sharded_param) in wanted]
        if records:
            units.append(FSDPUnit(param_group, records))
    return units


def fsdp_gathered_copies(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, FSDPUnit]]:
    """Those of ``params`` that are FSDP2's all-gathered copies of a sharded parameter (what a
    unit's modules list while it is unsharded, or resharded after forward to a smaller world),
    each with its unit (its record the copy's). See [Note: FSDP2's copies and flags]."""
    wanted = {id(p) for p in params}
    copies = []
    for param_group in _fsdp_param_groups():
        for record in param_group.fsdp_params:
            for name in ("_unsharded_param", "_sharded_post_forward_param"):
                alias = getattr(record, name, None)
                if alias is not None and id(alias) in wanted:
                    copies.append((alias, FSDPUnit(param_group, [record])))
    return copies


def fsdp_sync_off() -> bool:
    """Whether an FSDP2 unit of the process does not reduce its gradients fully:
    ``set_requires_gradient_sync(False)`` (FSDP2 accumulates them unsharded) or, on a mesh
    with a replicate dimension (HSDP), ``set_requires_all_reduce(False)`` (FSDP2 keeps the
    reduce-scatter's output and hands out no gradient). A frozen unit's flags count too: the
    flag is how a loop says more micro-batches follow, and a loop turning sync off for some
    units only (a frozen one among them) steps the other units' summed gradients."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    return any(
        not param_group.reduce_grads
        or (not param_group.all_reduce_grads and isinstance(param_group.mesh_info, DDPMeshInfo))
        for param_group in _fsdp_param_groups()
    )


def fsdp_reduced_params(params: Iterable[torch.Tensor]) -> set[int]:
    """Ids of the ``params`` whose gradient FSDP2 reduces and hands to the post-accumulate-grad
    hooks from its unit's post-backward node: those in a ``fully_shard`` unit (offloaded to
    the CPU too: FSDP2 then copies each gradient to the host before its hooks, synchronously
    when a hook is registered)."""
    wanted = {id(p) for p in params}
    return {
        id(record.sharded_param)
        for param_group in _fsdp_param_groups()
        for record in param_group.fsdp_params
        if id(record.sharded_param) in wanted
    }


def fsdp_post_backward_node() -> torch.autograd.graph.Node | None:
    """The autograd node running FSDP2's post-backward of a unit, when called from inside it.

    torch 2.13: FSDP2 inserts ``RegisterPostBackwardFunction`` on a unit's forward inputs; its
    backward runs ``FSDPParamGroup.post_backward``, which reduce-scatters the unit's gradients
    and calls the sharded parameters' post-accumulate-grad hooks, one after the other, before
    it returns. ``None`` from a hook that autograd's ``AccumulateGrad`` called, or one FSDP2
    calls from its end-of-backward callback (a unit whose post-backward node did not run)."""
    node = torch._C._current_autograd_node()
    if node is not None and node.name() == "RegisterPostBackwardFunctionBackward":
        return node
    return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor object itself, not an alias); ``tensor``
    otherwise."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def held_values(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A detached alias of each tensor's values (its local shard's, for a DTensor): it holds
    the storage, so that :func:`storages` of the aliases against the tensors' tells later
    whether ``.data =`` swapped it, and reads what the swapped-out storage holds. See [Note:
    data swapped by assignment]. The tensor itself for one that has no storage (a wrapper
    subclass), which is then never found swapped."""
    return [t.detach() if torch._C._has_storage(t) else t for t in map(local_tensor, tensors)]


def storages(tensors: Sequence[torch.Tensor]) -> list[object]:
    """The storage holding each tensor's values (its local shard's, for a DTensor), to find
    later whether ``.data =`` swapped it (see [Note: data swapped by assignment]), or whether
    two share memory. The tensor itself for one that has none (a wrapper subclass), which is
    then never found swapped nor sharing."""
    local = list(map(local_tensor, tensors))
    try:
        return list(map(torch.Tensor.untyped_storage, local))
    except RuntimeError:  # a tensor without storage
        return [t.untyped_storage() if torch._C._has_storage(t) else t for t in local]


def read_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``[p.grad for p in params]``, without the per-access ``__torch_function__`` lookup."""
    with torch._C.DisableTorchFunctionSubclass():
        return [p.grad for p in params]


def read_requires_grad(params: Sequence[torch.Tensor]) -> list[bool]:
    """``[p.requires_grad for p in params]``, without the ``__torch_function__`` lookup."""
    with torch._C.DisableTorchFunctionSubclass():
        return [p.requires_grad for p in params]


def drop_grads(params: Iterable[torch.Tensor]) -> None:
    """Set ``p.grad = None`` for each of ``params``, without the ``__torch_function__`` lookup."""
    with torch._C.DisableTorchFunctionSubclass():
        for param in params:
            param.grad = None


def traced(name: str) -> AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records, else nothing (it costs then)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def placed_alike(tensor: DTensor, other: DTensor) -> bool:
    """Whether two DTensors have the same placements (identical specs checked first)."""
    return tensor._spec is other._spec or tensor.placements == other.placements


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D copy of ``tensors``' elements, in order (one call, not one per tensor)."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


_WRAPPERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WRAPPERS_WATCH: list[RemovableHandle] = []


@functools.cache
def _wrapper_classes() -> tuple[type[nn.Module], ...]:
    """The data-parallel wrappers whose gradient collectives run outside the post-accumulate-grad
    hooks: ``DistributedDataParallel`` and FSDP1's ``FullyShardedDataParallel``."""
    if not dist.is_available():
        return ()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return (nn.parallel.DistributedDataParallel, FullyShardedDataParallel)


def _note_wrapper(module: nn.Module, _name: str, _submodule: nn.Module) -> None:
    if issubclass(type(module), _wrapper_classes()):
        _WRAPPERS.add(module)


def watch_wrappers() -> None:
    """From now on, note every DDP or FSDP1 module built (once per process)."""
    if not _WRAPPERS_WATCH:
        from torch.nn.modules.module import register_module_module_registration_hook

        _WRAPPERS_WATCH.append(register_module_module_registration_hook(_note_wrapper))


def wrapped_by(params: Sequence[torch.Tensor]) -> nn.Module | None:
    """A DDP or FSDP1 module built since :func:`watch_wrappers` that trains any of ``params``
    (None if none does). Costs nothing while none exists."""
    if not _WRAPPERS:
        return None
    wanted = {id(p) for p in params}
    for module in list(_WRAPPERS):
        if any(id(p) in wanted for p in module.parameters()):
            return module
    return None


_SCALED_BACKWARD: list[weakref.ref[GraphTaskToken]] = []
_LOSS_SCALING_WATCH: list[type] = []


@torch.compiler.disable
def _mark_scaled_backward(_grad: torch.Tensor) -> None:
    token = GraphTaskToken()
    _SCALED_BACKWARD[:] = [weakref.ref(token)]
    queue_end_of_backward(lambda: token)


def _tensors_in(outputs: object) -> Iterator[torch.Tensor]:
    """The tensors of ``scale()``'s result: a tensor, or nested lists and tuples of them (a
    lazy ``map``, which it returns for other iterables, cannot be walked without consuming
    it)."""
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple)):
        for item in outputs:
            yield from _tensors_in(item)


def _marking_scale(scale: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(scale)
    def marking_scale(self: Any, outputs: Any) -> Any:
        scaled = scale(self, outputs)
        if self.is_enabled() and not torch.compiler.is_compiling():
            for tensor in _tensors_in(scaled):
                if tensor.requires_grad:
                    tensor.register_hook(_mark_scaled_backward)
        return scaled

    return marking_scale


def watch_loss_scaling() -> None:
    """From now on, note every backward that starts from an output of an enabled
    ``torch.amp.GradScaler``'s ``scale()`` (once per process): :func:`in_scaled_backward`."""
    if _LOSS_SCALING_WATCH:
        return
    from torch.amp import GradScaler

    classes: list[type] = [GradScaler]
    if dist.is_available():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        classes.append(ShardedGradScaler)
    for cls in classes:
        cls.scale = _marking_scale(cls.__dict__["scale"])  # type: ignore[method-assign]
    _LOSS_SCALING_WATCH.extend(classes)


def in_scaled_backward() -> bool:
    """Whether a backward that started from a loss an enabled GradScaler scaled runs now: the
    one calling, or one it runs inside (reentrant checkpointing)."""
    return bool(_SCALED_BACKWARD) and _SCALED_BACKWARD[0]() is not None


_SAVED_TENSORS_HOOKS_WATCHED: list[bool] = []


def _strided_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor with values, whose storage can be read (a
    sparse one's cannot)."""
    return type(tensor) in _PLAIN_TYPES and tensor.layout is torch.strided and holds_values(tensor)


class _Watchers(NamedTuple):
    on_saved: Callable[[torch.Tensor], None]
    on_changed: Callable[[torch.Tensor, int], None]


def _watched(
    pack_hook: Callable[[torch.Tensor], Any],
    unpack_hook: Callable[[Any], torch.Tensor],
    watchers: _Watchers,
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """``pack_hook`` and ``unpack_hook``, telling ``watchers`` of each leaf saved (a
    parameter, or a read of one through ``.detach()``) or view (of the tensor it views: a
    weight saved transposed by ``linear``), and with autograd's version check put back for
    them: ``on_changed(tensor, version)`` where the tensor unpacked holds the memory that
    was packed and was written in place since its version counter read ``version``."""

    def pack(tensor: torch.Tensor) -> tuple[Any, int | None, int]:
        packed = pack_hook(tensor)
        view = tensor._is_view()
        if (view or tensor.is_leaf) and _strided_values(tensor):
            if tensor.requires_grad:  # a parameter, or a view of one (not a detached read)
                watchers.on_saved(tensor._base if view else tensor)
            return packed, tensor._version, tensor.untyped_storage().data_ptr()
        return packed, None, 0

    def unpack(saved: tuple[Any, int | None, int]) -> torch.Tensor:
        packed, version, address = saved
        tensor = unpack_hook(packed)
        if (
            version is not None
            and tensor._version != version
            and _strided_values(tensor)
            and tensor.untyped_storage().data_ptr() == address
        ):
            watchers.on_changed(tensor, version)
        return tensor

    return pack, unpack


def watch_saved_tensors_hooks(
    on_saved: Callable[[torch.Tensor], None], on_changed: Callable[[torch.Tensor, int], None]
) -> None:
    """From now on (once per process), call ``on_saved(tensor)`` for each leaf (a parameter,
    or a read of one through ``.detach()``) saved for backward through saved-tensor hooks, or
    the tensor a view saved so views, and ``on_changed(tensor, version)`` where one is
    unpacked after an in-place write into its memory (the check autograd makes of the tensors
    it saves itself, and not of these), ``version`` its version counter when packed."""
    from torch.autograd.graph import saved_tensors_hooks

    if _SAVED_TENSORS_HOOKS_WATCHED:
        return
    _SAVED_TENSORS_HOOKS_WATCHED.append(True)
    init = saved_tensors_hooks.__init__
    watchers = _Watchers(on_saved, on_changed)

    @functools.wraps(init)
    def watching_init(
        self: saved_tensors_hooks,
        pack_hook: Callable[[torch.Tensor], Any],
        unpack_hook: Callable[[Any], torch.Tensor],
    ) -> None:
        init(self, *_watched(pack_hook, unpack_hook, watchers))

    saved_tensors_hooks.__init__ = watching_init  # type: ignore[method-assign]


_TEARDOWN: list[Callable[[bool], None]] = []


def _run_teardown(destroying: bool = False) -> None:
    for callback in _TEARDOWN:
        callback(destroying)


def before_teardown(callback: Callable[[bool], None]) -> None:
    """Run ``callback(True)`` before ``torch.distributed.destroy_process_group()`` destroys the
    default group, on every rank that calls it (so it may run collectives), and
    ``callback(False)`` at exit."""
    if not _TEARDOWN:
        import atexit

        from torch.distributed import distributed_c10d

        original = distributed_c10d.destroy_process_group

        def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
            if group is None or group == dist.GroupMember.WORLD:
                _run_teardown(destroying=True)
            original(group)

        destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        dist.destroy_process_group = destroy_process_group
        distributed_c10d.destroy_process_group = destroy_process_group
        atexit.register(_run_teardown)
    _TEARDOWN.append(callback)


def observes_only(hook: Callable[..., object]) -> bool:
    """Whether ``hook`` is one of torch's memory trackers' (``torch.distributed._tools``):
    they note the optimizer phase and change nothing."""
    return getattr(hook, "__module__", "").startswith("torch.distributed._tools")


def hooked_after(param: torch.Tensor, handle_id: int) -> bool:
    """Whether a post-accumulate-grad hook (other than a memory tracker's, which only notes
    the gradient's storage) was registered on ``param`` after the one whose handle has
    ``handle_id``."""
    hooks = param._post_accumulate_grad_hooks
    if not hooks or next(reversed(hooks)) == handle_id:
        return False
    for key in reversed(hooks):
        if key == handle_id:
            return False
        if not observes_only(hooks[key]):
            return True
    return False


def global_step_pre_hooks() -> bool:
    """Whether a step pre-hook (other than an observer's) is registered for every optimizer."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return not all(map(observes_only, _global_optimizer_pre_hooks.values()))


def wrappers_holding(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """Return the live DDP and FSDP1 modules that train any of ``params``."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    wanted = {id(p) for p in params if not hasattr(p, "device_mesh")}
    if not wanted:
        return []
    classes = _wrapper_classes()
    # type(), not isinstance(): isinstance reads __class__, which raises ReferenceError on a
    # dead weakref.proxy (torch.compile leaves some in the heap).
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), classes) and any(id(p) in wanted for p in obj.parameters())
    ]


def _staging_in_flight(code: Any) -> bool:
    # This thread's frame is left out before anything binds it: this very frame, held by
    # one of its own locals, would be a reference cycle, keeping every frame below it alive
    # until the garbage collector ran, and with them the caller's locals (a bucket's
    # gradients) and the backward's loss and graph (whose nodes hold the parameters, which
    # torch.utils.swap_tensors then refused).
    others = sys._current_frames()
    others.pop(threading.get_ident(), None)
    for frame in others.values():
        while frame is not None:
            if frame.f_code is code:
                return True
            frame = frame.f_back
    return False


def wait_for_checkpoint_staging() -> None:
    """Return once no DCP staging copies a state dict in another thread. See [Note: checkpoint
    staging in flight]."""
    staging = sys.modules.get("torch.distributed.checkpoint.staging")
    if staging is None:
        return  # nothing can stage
    code = staging.DefaultStager._stage.__code__
    while _staging_in_flight(code):
        time.sleep(1e-3)


class Enclosing(NamedTuple):
    """Where the backward running a hook sits (see :func:`enclosing_backward`)."""

    node: torch.autograd.graph.Node | None
    """The node of the outermost autograd Function running on the stack: where that
    Function's ``backward`` runs this backward nested in it (reentrant checkpointing), the
    node the outermost enclosing backward is running."""
    from_hook: bool
    """Whether this backward runs inside another one with no Function's ``backward`` between
    them: called from a hook of the outer backward."""


def enclosing_backward(device: torch.device) -> Enclosing:
    """Where the backward running the caller (a hook of a gradient on ``device``) sits. Walks
    the stack."""
    from torch.autograd import function

    node = None
    backwards = 0
    in_function = False  # a Function's frame since the last backward's
    from_hook = False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename == function.__file__:
            node = frame.f_locals.get("self", node)
            in_function = True
        elif code.co_name == "_engine_run_backward":
            from_hook = from_hook or (backwards > 0 and not in_function)
            backwards += 1
            in_function = False
        frame = frame.f_back
    # On an accelerator's thread, the frames below the last backward's were called by the
    # engine for an outer backward, whose own frame is on another thread. (A CPU gradient's
    # hooks run on the thread that called backward, which Python may not have started
    # either: one started by C code, or by _thread.start_new_thread.)
    if (
        backwards
        and not in_function
        and device.type != "cpu"
        and isinstance(threading.current_thread(), threading._DummyThread)
    ):
        from_hook = True
    return Enclosing(node, from_hook)


current_backward_id: Callable[[], int] = torch._C._current_graph_task_id
"""An id of the backward pass running on this thread, or ``-1`` outside backward."""


def will_get_gradient(leaf: torch.Tensor) -> bool:
    """Whether the backward running on this thread will accumulate a gradient into ``leaf`` (a
    plain tensor that requires grad, not one of FSDP2's sharded parameters). Call only in
    backward."""
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    return bool(torch._C._will_engine_execute_node(node))


class GraphTaskToken:
    """An object to be held only by callbacks queued on one backward's graph task: the engine
    drops those callbacks when the backward finishes or fails (it never runs them then), so
    a weak reference to the token is alive exactly while that backward can still run them."""

    __slots__ = ("__weakref__",)


def when_node_returns(node: torch.autograd.graph.Node, callback: Callable[[], None]) -> None:
    """Call ``callback`` once, when ``node`` (a node the backward running now executes)
    returns: in that backward's graph task, where ``queue_end_of_backward`` queues on it."""

    def returned(_grad_inputs: Any, _grad_outputs: Any) -> None:
        handle.remove()
        callback()

    handle = node.register_hook(returned)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass running now has finished, after every other
    callback queued during it (FSDP2's final callback included). Call only in backward."""
    from torch.autograd import Variable

    engine = Variable._execution_engine
    # Never traced, as the hooks: see ``_grad_ready_hook`` in ``optimizer.py``.
    callback = torch.compiler.disable(callback)
    engine.queue_callback(lambda: engine.queue_callback(callback))


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values that can be read (not a meta or fake tensor).

    A plain tensor or parameter that no functionalization wraps is one: answered without
    ``is_fake``'s walk through subclasses (2.4 us a call, 0.4 us so; the registered-tensor
    check of ``_sharing.py`` asks it for every tensor registered on a module)."""
    if tensor.is_meta:
        return False
    if type(tensor) in _PLAIN_TYPES and not torch._is_functional_tensor(tensor):
        return True
    return not is_fake(tensor)


_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
