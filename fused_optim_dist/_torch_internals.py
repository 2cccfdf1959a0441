"""The one module that reads torch internals (FSDP2, DDP and the autograd engine).

Everything else in the package uses public APIs. What this module relies on, for torch 2.13:

* ``torch.distributed._composable_state._module_state_mapping`` maps every module managed by a
  composable API (``fully_shard`` among them) to its state object.
* ``FSDPState._fsdp_param_groups`` lists the state's ``FSDPParamGroup`` objects, and each group's
  ``fsdp_params[i].sharded_param`` is the DTensor ``nn.Parameter`` registered on the module. One
  group is one FSDP unit: its gradients are reduce-scattered together into one flat buffer, and
  ``foreach_reduce`` (``_fsdp_collectives.py``) then calls each sharded parameter's
  post-accumulate-grad hooks, one after the other.
* ``DistributedDataParallel`` keeps no registry of its instances, so finding one means scanning
  the garbage collector's objects; this is done once per optimizer, and only for plain-tensor
  parameters in a multi-process job.
* The autograd engine runs callbacks queued with ``Variable._execution_engine.queue_callback``
  once the current backward has finished, in the order they were queued, including callbacks
  queued by a running callback (``exec_post_processing`` in ``engine.cpp`` loops until the list
  is exhausted). FSDP2 queues its final callback at the root's first pre-backward hook, and may
  still reduce a unit (and call our hooks) inside it; a parameter outside every ``fully_shard``
  can get its gradient before that hook, so ours may be queued first. ``queue_end_of_backward``
  therefore queues a callback that queues ours: it runs after every callback queued during the
  backward. ``torch._C._current_graph_task_id()`` is ``-1`` outside a backward and stays the
  backward's id while its callbacks run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["current_backward_id", "ddp_modules_holding", "fsdp_units", "queue_end_of_backward"]


def fsdp_units(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group ``params`` by the FSDP2 unit (``FSDPParamGroup``) that reduces their gradients.

    Returns one list per unit that holds at least one of ``params``, in the unit's own parameter
    order; parameters that no ``fully_shard`` manages are left out.
    """
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    wanted = {id(p) for p in params}
    units: list[list[torch.Tensor]] = []
    seen_groups: set[int] = set()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, FSDPState):
            continue
        for param_group in state._fsdp_param_groups:
            if id(param_group) in seen_groups:
                continue
            seen_groups.add(id(param_group))
            members = [
                fsdp_param.sharded_param
                for fsdp_param in param_group.fsdp_params
                if id(fsdp_param.sharded_param) in wanted
            ]
            if members:
                units.append(members)
    return units


def ddp_modules_holding(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """Return the live ``DistributedDataParallel`` modules that train any of ``params``."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    wanted = {id(p) for p in params if not hasattr(p, "device_mesh")}
    if not wanted:
        return []
    ddp_cls = nn.parallel.DistributedDataParallel
    # type(), not isinstance(): isinstance reads __class__, which raises ReferenceError on a
    # dead weakref.proxy (torch.compile leaves some in the heap).
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), ddp_cls) and any(id(p) in wanted for p in obj.parameters())
    ]


def current_backward_id() -> int:
    """An id of the backward pass running on this thread, or ``-1`` outside backward."""
    return torch._C._current_graph_task_id()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass running now has finished, after every other
    callback queued during it (FSDP2's final callback included). Call only in backward."""
    from torch.autograd import Variable

    engine = Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(callback))
