"""Lightning Fabric with ``OptimizerInBackward``: ``no_backward_sync`` accumulation and
``clip_gradients``, as the plain optimizer runs them.

A Fabric loop is the plain loop with Fabric's calls in it. Two of them act outside
``optimizer.step()``, so ``InBackwardFabric`` (a ``Fabric``, built with the same arguments)
changes only those two::

    from fused_optim_dist.integrations.fabric import InBackwardFabric

    fabric = InBackwardFabric(accelerator="cpu", devices=1)
    model = fabric.setup(model)
    optim = fabric.setup_optimizers(
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0)
    )
    for index, (x, y) in enumerate(loader):
        accumulating = (index + 1) % 4 != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(loss_fn(model(x), y))
        if not accumulating:
            norm = fabric.clip_gradients(model, optim, max_norm=1.0)
            optim.step()
            optim.zero_grad()

* ``no_backward_sync(module, enabled=True)``: Fabric skips the gradient all-reduce of the
  micro-batches but the last (FSDP2's ``set_requires_gradient_sync(False)``; nothing on one
  device), and the plain optimizer steps their sum at ``step()``. An in-backward optimizer
  would step each micro-batch's gradients in its backward: the block also runs under
  :meth:`OptimizerInBackward.accumulate` for every in-backward optimizer this Fabric set up,
  so the window's last backward steps the sum. Without it the second micro-batch is refused
  (a second gradient before ``step()``), after the first one moved the parameters.
* ``clip_gradients`` reads the gradients after the backward, which were stepped and freed in
  it. For an in-backward optimizer it clips nothing itself: the clipping is the optimizer's
  own, configured at construction (``max_grad_norm=`` for ``max_norm``, ``clip_grad_value=``
  for ``clip_val``); a value that differs from it is refused at the call (the backward before
  it was clipped by the configured one), and so is a norm other than the 2-norm. With
  ``max_norm`` it returns :meth:`OptimizerInBackward.grad_norm`, the norm
  ``torch.nn.utils.clip_grad_norm_`` returns, and, as Fabric with ``error_if_nonfinite=True``,
  raises where it is not finite: there the plain loop stops before its step, and ours has
  moved nothing only where ``skip_nonfinite=True`` skipped the whole step (a model of one
  bucket; with several, the finite buckets were stepped).
* Loss scaling (``precision="16-mixed"`` on GPUs; on the CPU Fabric runs ``"bf16-mixed"``):
  the ``GradScaler`` unscales and checks the gradients after the backward. Refused when an
  in-backward optimizer is set up, before anything moves.

Fabric's DDP strategy wraps the model in ``DistributedDataParallel``, which this library
refuses before any update: when the optimizer is built on the wrapped model, or at the first
backward when ``fabric.setup(model, optim)`` wraps it after. FSDP2 runs through
``ModelParallelStrategy``: the optimizer is built on the sharded parameters, after
``fabric.setup(model)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.optim import Optimizer

from fused_optim_dist.integrations._loss_scaling import refuse_loss_scaling
from fused_optim_dist.optimizer import OptimizerInBackward
from fused_optim_dist.training import clip_grad_norm_, in_backward_of

__all__ = ["InBackwardFabric"]


class InBackwardFabric(Fabric):
    """``Fabric`` whose ``no_backward_sync`` accumulates and whose ``clip_gradients`` reads the
    clipping done in backward, for the ``OptimizerInBackward`` instances it set up (see the
    module's docstring). Plain optimizers set up beside them are handled by Fabric itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_backward: list[OptimizerInBackward] = []

    def setup(self, module: nn.Module, *optimizers: Optimizer, **kwargs: Any) -> Any:
        self._note(optimizers)
        return super().setup(module, *optimizers, **kwargs)

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        self._note(optimizers)
        return super().setup_optimizers(*optimizers)

    def _note(self, optimizers: tuple[Optimizer, ...]) -> None:
        found = [o for o in map(in_backward_of, optimizers) if o is not None]
        if not found:
            return
        refuse_loss_scaling(self._precision, "Fabric")
        self._in_backward.extend(o for o in found if o not in self._in_backward)

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not enabled:
                stack.callback(_sync_fsdp2, module)
            stack.enter_context(super().no_backward_sync(module, enabled))
            if enabled:
                for optimizer in self._in_backward:
                    stack.enter_context(optimizer.accumulate())
            yield

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        in_backward = in_backward_of(optimizer)
        if in_backward is None or (clip_val is None) == (max_norm is None):
            # Fabric's own: a plain optimizer, or the arguments' error.
            return super().clip_gradients(
                module, optimizer, clip_val, max_norm, norm_type, error_if_nonfinite
            )
        if clip_val is not None:
            configured = in_backward.options.clip_grad_value
            if clip_val != configured:
                raise ValueError(
                    f"clip_gradients(clip_val={clip_val}) on an OptimizerInBackward built with "
                    f"clip_grad_value={configured}: it clips in backward, so build it with "
                    f"clip_grad_value={clip_val}"
                )
            return None
        if float(norm_type) != 2.0:
            raise ValueError(
                f"clip_gradients(norm_type={norm_type}): OptimizerInBackward clips by the "
                "2-norm (max_grad_norm=); use norm_type=2.0"
            )
        norm = clip_grad_norm_(in_backward, max_norm)
        if error_if_nonfinite and not math.isfinite(norm.item()):
            raise RuntimeError(
                "The total norm of order 2.0 of this step's gradients is non-finite, so Fabric "
                "would not clip them. OptimizerInBackward stepped them in backward: with "
                "skip_nonfinite=True it skipped the buckets holding inf/NaN (the whole step "
                "where the model is one bucket), without it it stepped those too. Call "
                "optim.step() to end the step (it moves nothing more), or pass "
                "error_if_nonfinite=False."
            )
        return norm


def _sync_fsdp2(module: nn.Module) -> None:
    """Turn FSDP2's gradient sync back on, as ``no_backward_sync(enabled=False)`` found it.

    [Note: Fabric leaves FSDP2's sync off]
    Fabric's context for FSDP2 (``_FSDPNoSync``, Lightning 2.6) sets
    ``set_requires_gradient_sync(not enabled)`` on entry and ``(enabled)`` on exit, so the block
    that ends a window (``enabled=False``) leaves the model with its sync off. A plain
    optimizer never notices: every backward of Fabric's loop runs inside such a block, which
    sets the flag again. This optimizer reads it to tell a micro-batch from a step (see
    [Note: FSDP2's micro-batches] in ``optimizer.py``): a model left so, even one no longer
    trained, would make every later backward of the process a micro-batch, stepped only at
    ``step()`` (equal, but holding every gradient, and with no norm for ``clip_gradients``).
    The flag is put back here rather than read differently there: when a backward's first
    gradient arrives, a model no longer trained cannot be told from one whose units that
    backward has not reached yet (a head outside ``fully_shard`` gets its gradient before any
    unit of the body).
    """
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.set_requires_gradient_sync(True, recurse=False)
