"""Training-loop calls that work the same for a plain optimizer and an in-backward one.

A loop written with these has no ``if in_backward:`` branch::

    optim = build_optimizer(model.parameters(), "torch.optim.AdamW", in_backward=True,
                            max_grad_norm=1.0, lr=3e-4)
    for micro_batches in loader:
        loss = backward_micro_batches(optim, lambda mb: loss_fn(model(mb)), micro_batches)
        grad_norm = clip_grad_norm_(optim, 1.0)
        optim.step()
        optim.zero_grad()

``backward_micro_batches`` is the accumulation loop written out once::

    for mb in micro_batches[:-1]:
        with accumulate_grads(optim):
            (loss_fn(model(mb)) / len(micro_batches)).backward()
    (loss_fn(model(micro_batches[-1])) / len(micro_batches)).backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fused_optim_dist._torch_internals import read_grads
from fused_optim_dist._validation import resolve_optimizer_class
from fused_optim_dist.optimizer import OptimizerInBackward

__all__ = [
    "accumulate_grads",
    "backward_micro_batches",
    "build_optimizer",
    "clip_grad_norm_",
    "in_backward_of",
]

MicroBatch = TypeVar("MicroBatch")


def build_optimizer(
    params: Iterable[Any],
    optimizer_cls: type[Optimizer] | str,
    *,
    in_backward: bool,
    max_grad_norm: float | None = None,
    **optimizer_kwargs: Any,
) -> Optimizer:
    """Build ``optimizer_cls`` on ``params``, stepped in backward or after it.

    ``max_grad_norm`` configures clipping in backward for the in-backward optimizer; a plain
    optimizer clips when the loop calls :func:`clip_grad_norm_`, so it is not needed there.
    """
    if in_backward:
        return OptimizerInBackward(
            params, optimizer_cls, max_grad_norm=max_grad_norm, **optimizer_kwargs
        )
    return resolve_optimizer_class(optimizer_cls)(params, **optimizer_kwargs)


def in_backward_of(optimizer: Optimizer) -> OptimizerInBackward | None:
    """The ``OptimizerInBackward`` that ``optimizer`` is or wraps, else ``None``.

    Wrappers keep the optimizer they wrap in ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``) and forward ``step``/``zero_grad``, but not ``accumulate()`` or
    ``grad_norm()``: looking through them keeps the calls below right for a wrapped one.
    """
    inner: Any = optimizer
    while not isinstance(inner, OptimizerInBackward):
        inner = getattr(inner, "optimizer", None)
        if not isinstance(inner, Optimizer):
            return None
    return inner


def accumulate_grads(optimizer: Optimizer) -> contextlib.AbstractContextManager[None]:
    """Context for the backward passes of all micro-batches but the last.

    A plain optimizer only steps when asked, so this does nothing for it; an
    ``OptimizerInBackward`` (or a wrapper of one) would otherwise step in every backward.
    """
    in_backward = in_backward_of(optimizer)
    if in_backward is not None:
        return in_backward.accumulate()
    return contextlib.nullcontext()


def backward_micro_batches(
    optimizer: Optimizer,
    loss_fn: Callable[[MicroBatch], torch.Tensor],
    micro_batches: Sequence[MicroBatch],
    *,
    between: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Backward of the mean of ``loss_fn`` over ``micro_batches``: the gradients of one step.

    Every backward but the last runs under :func:`accumulate_grads`, so an
    ``OptimizerInBackward`` steps once, in the last backward, on the summed gradients; a plain
    optimizer is left to ``step()``. ``between`` is called after every backward but the last
    (e.g. to mark a micro-batch boundary for a memory tracker).

    Returns the mean loss, detached, on the loss's device (no host sync). With FSDP2 each rank
    passes its own micro-batches, so this is the rank's share of the global mean.
    """
    if not micro_batches:
        raise ValueError("backward_micro_batches got no micro-batches; pass at least one")
    count = len(micro_batches)
    total = None
    for index, micro_batch in enumerate(micro_batches):
        last = index == count - 1
        with contextlib.nullcontext() if last else accumulate_grads(optimizer):
            loss = loss_fn(micro_batch) / count
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        if not last and between is not None:
            between()
    return total


def clip_grad_norm_(optimizer: Optimizer, max_norm: float | None = None) -> torch.Tensor:
    """Clip the gradients ``optimizer`` is about to step (if ``max_norm``); return their norm.

    Call it once per step, after the last backward and before ``optimizer.step()``.

    * Plain optimizer: ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters,
      or ``torch.nn.utils.get_total_norm`` of their gradients without ``max_norm`` (DTensor
      gradients give the norm over all ranks: collective).
    * ``OptimizerInBackward``: the gradients were already stepped and clipped in backward;
      returns :meth:`OptimizerInBackward.grad_norm` (local, never blocks), or 0 where no
      parameter holds a gradient (none since ``zero_grad()``). Where gradients
      are held for ``step()`` instead (every backward under ``accumulate()``, a pipeline
      schedule's reduction, gradients set by hand;
      :meth:`OptimizerInBackward.gradients_held_for_step`), they are measured as the plain
      optimizer's are, and ``step()`` clips them. Gradients set by hand after a backward
      that stepped are measured too, and the norm returned is that of both, the plain
      optimizer's.

    The result is a 0-dim, non-DTensor tensor, the norm before clipping.

    Raises:
        ValueError: if ``max_norm`` differs from an in-backward optimizer's ``max_grad_norm``:
            clipping there is configured at construction, and silently using another value
            would clip by a norm the loop did not ask for.
    """
    in_backward = in_backward_of(optimizer)
    if in_backward is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if max_norm is None:
            return _grad_norm(params)
        return _plain(torch.nn.utils.clip_grad_norm_(_with_grads(params), max_norm))
    configured = in_backward.max_grad_norm
    if max_norm != configured:
        raise ValueError(
            f"clip_grad_norm_(max_norm={max_norm}) on an OptimizerInBackward built with "
            f"max_grad_norm={configured}: clipping happens in backward, so pass the same "
            "value to the optimizer (e.g. build_optimizer(..., max_grad_norm=...))"
        )
    unstepped = in_backward.unstepped_gradients()
    if in_backward.gradients_held_for_step():
        return _grad_norm(unstepped)  # step() clips them
    if unstepped:
        # Set by hand after a backward that stepped (or left by one that raised): step()
        # steps them, and the plain step's norm is over both.
        stepped = in_backward.grad_norm()
        held = _grad_norm(unstepped).to(stepped.device)
        return torch.linalg.vector_norm(torch.stack([stepped, held]))
    params = [p for group in in_backward.param_groups for p in group["params"]]
    if not _with_grads(params):
        return _grad_norm([])  # no gradient since zero_grad(): 0, as clip_grad_norm_'s
    return in_backward.grad_norm()


def _with_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p, grad in zip(params, read_grads(params), strict=True) if grad is not None]


def _grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``get_total_norm`` of the gradients of ``params`` (those holding one), as
    ``clip_grad_norm_`` measures them: over all ranks for DTensors."""
    # Not clip_grad_norm_ with an infinite max_norm: it would multiply every gradient by
    # inf / (norm + 1e-6), a NaN where the norm overflows to inf.
    return _plain(torch.nn.utils.get_total_norm([p.grad for p in _with_grads(params)]))


def _plain(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
