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

The facade's ``state`` (DTensor values placed like their parameter, exactly as the plain
optimizer would hold them) is the one source of truth. The local-shard view of it is re-derived
for every step, so nothing goes stale after ``load_state_dict`` or when FSDP2 re-creates a
parameter's local tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["Batch", "BucketStepper", "place_grad_like_param"]

# Classes whose fused kernels skip the update (parameters, state and step count) on the device
# when ``found_inf`` is nonzero, as ``torch.amp.GradScaler`` uses them. Fused SGD with momentum
# is left out: a skipped first step leaves its momentum buffer uninitialised (``empty_like``).
_FOUND_INF_CLASSES = (torch.optim.Adam, torch.optim.AdamW)

Batch = tuple[dict[str, Any], Sequence[torch.Tensor]]
"""A param group of the facade and the parameters of that group to step now."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placed_like(value: Any, param: torch.Tensor, local_param: torch.Tensor) -> Any:
    """Return a local state value as the plain optimizer would hold it for ``param``.

    State tensors shaped like the local shard become DTensors placed like ``param``; scalars
    (e.g. Adam's ``step``) stay plain tensors, as torch.optim creates them. FSDP2 shards dim 0
    unevenly (the last ranks may hold fewer rows, or none), so ``from_local`` is given the
    global shape and stride instead of inferring them from the local shard.
    """
    if not (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.shape == local_param.shape
    ):
        return value
    return DTensor.from_local(
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def place_grad_like_param(param: torch.Tensor) -> None:
    """Make ``param.grad`` a DTensor placed like ``param`` (a no-op for FSDP2 gradients).

    Raises ``TypeError`` for a plain gradient on a DTensor parameter. A gradient placed
    differently, e.g. the ``Partial`` gradient of a replicated tensor-parallel parameter, is
    redistributed (a collective, run by every rank in the same bucket order).
    """
    grad = param.grad
    if not isinstance(param, DTensor) or grad is None:
        return
    if not isinstance(grad, DTensor):
        raise TypeError(
            f"parameter of shape {tuple(param.shape)} is a DTensor but its gradient is a "
            f"{type(grad).__name__}; set DTensor gradients on DTensor parameters"
        )
    if grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


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

    def takes_found_inf(self, batches: Sequence[Batch]) -> bool:
        """Whether a ``found_inf`` flag makes this step skip the update on the device."""
        optimizer = self.optimizer
        if isinstance(optimizer, _FOUND_INF_CLASSES):
            return all(group.get("fused") for group, _ in batches)
        if type(optimizer) is torch.optim.SGD:
            return all(group.get("fused") and group["momentum"] == 0 for group, _ in batches)
        return False

    @torch.no_grad()
    def step(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step every parameter of ``batches`` using its ``.grad``, updating ``state`` in place.

        DTensor gradients must be placed like their parameter (``place_grad_like_param``).
        Gradients are left in place; the caller frees them. ``found_inf`` (only where
        :meth:`takes_found_inf`): a 0-dim float tensor, nonzero to skip the update on the device.
        """
        self.optimizer.found_inf = found_inf
        try:
            if self.local_shards:
                self._step_local(batches, state)
            else:
                self._run([{**group, "params": list(params)} for group, params in batches], state)
        finally:
            self.optimizer.found_inf = None

    def _step_local(self, batches: Sequence[Batch], state: defaultdict[torch.Tensor, dict]):
        groups: list[dict[str, Any]] = []
        local_state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        # (parameter, its local-shard alias, the local views of its state before the step)
        shards: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        plain: list[torch.Tensor] = []
        for group, params in batches:
            local_params = []
            for param in params:
                if isinstance(param, DTensor):
                    # A fresh alias of the local shard, so that setting its .grad leaves
                    # FSDP2's own local tensor untouched.
                    shard = param.to_local().detach()
                    shard.grad = param.grad.to_local()
                    entry = state.get(param)
                    views = {k: _local(v) for k, v in entry.items()} if entry else {}
                    local_state[shard] = dict(views)
                    shards.append((param, shard, views))
                else:
                    shard = param
                    plain.append(param)
                    # No entry for a parameter without state: the step creates one only if the
                    # optimizer keeps state (plain SGD keeps none).
                    if param in state:
                        local_state[shard] = state[param]
                local_params.append(shard)
            groups.append({**group, "params": local_params})
        try:
            self._run(groups, local_state)
        finally:
            for _, shard, _ in shards:
                shard.grad = None
        for param in plain:
            if param not in state and local_state.get(param):
                state[param] = local_state[param]
        for param, shard, views in shards:
            # Bring back the state the step created or replaced (e.g. on the first step).
            for key, value in local_state.get(shard, {}).items():
                if views.get(key) is not value:
                    state[param][key] = _placed_like(value, param, shard)

    def _run(self, groups: list[dict[str, Any]], state: defaultdict[torch.Tensor, dict]) -> None:
        optimizer = self.optimizer
        optimizer.param_groups, optimizer.state = groups, state
        try:
            self._step(optimizer)
        finally:
            # Drop the references so the stepper never keeps a bucket's tensors alive.
            optimizer.param_groups, optimizer.state = [], defaultdict(dict)
