"""No host synchronisation inside backward (gloo, CPU, 2 ranks, FSDP2).

A read of a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``) dispatches
``aten._local_scalar_dense``; on a GPU it stalls the CPU until the stream drains, so the
reduce-scatters of the next units stop overlapping compute. A ``TorchDispatchMode`` counts those
reads during ``loss.backward()``, leaving out the wrapped optimizer's own update (e.g. Adam reading
its CPU step counter), which is the optimizer's business, not ours.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _toy import batch, loss_fn, make_models, rank_slice, shard
from torch.utils._python_dispatch import TorchDispatchMode

from fused_optim_dist import OptimizerInBackward


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _uncounted(reads: _HostReads, update: Callable[..., None]) -> Callable[..., None]:
    def paused(*args, **kwargs) -> None:
        reads.paused += 1
        try:
            update(*args, **kwargs)
        finally:
            reads.paused -= 1

    return paused


def _count_host_reads(optimizer: str, kwargs: dict) -> tuple[int, int]:
    """Host reads in the backward of steps 1..3, and the number of buckets per backward."""
    model, _ = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), getattr(torch.optim, optimizer), **kwargs)
    reads = _HostReads()
    # The update: the class's step, or the functional call it makes (cached lists).
    stepper = optim._stepper.steppers[None]
    for name in ("_step", "_adam_update"):
        setattr(stepper, name, _uncounted(reads, getattr(stepper, name)))
    for step in range(4):
        x, y = batch(step)
        loss = loss_fn(model, rank_slice(x), rank_slice(y))
        if step == 0:  # the first step creates state: not counted
            loss.backward()
        else:
            with reads:
                loss.backward()
        optim.step()
        optim.zero_grad()
    assert optim.grad_norm().isfinite()
    return reads.count, len(optim._current_plan().buckets)


CASES = [
    ("AdamW", dict(lr=1e-2, fused=True, max_grad_norm=0.5, skip_nonfinite=True)),
    ("Adam", dict(lr=1e-2, fused=True, skip_nonfinite=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, max_grad_norm=0.5)),
    ("AdamW", dict(lr=1e-2, foreach=True, clip_grad_value=0.1)),
    ("AdamW", dict(lr=1e-2, foreach=True)),
]


@pytest.mark.parametrize(("optimizer", "kwargs"), CASES, ids=[str(c) for c in range(len(CASES))])
def test_no_host_sync_in_backward(worlds, optimizer, kwargs):
    for count, _ in worlds.run(2, _count_host_reads, optimizer=optimizer, kwargs=kwargs):
        assert count == 0


def test_non_fused_skip_pays_one_sync_per_bucket(worlds):
    """The documented cost: an optimizer that takes no ``found_inf`` decides on the host. Also
    shows that the counter sees our reads."""
    kwargs = dict(lr=1e-2, foreach=True, skip_nonfinite=True)
    for count, buckets in worlds.run(2, _count_host_reads, optimizer="AdamW", kwargs=kwargs):
        assert count == 3 * buckets
