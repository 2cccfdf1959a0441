"""Every configuration PyTorch tests its own optimizers with, run through ``OptimizerInBackward``.

``optim_db`` (``torch.testing._internal.common_optimizers``) lists each ``torch.optim`` class with
the keyword combinations PyTorch's own tests step it with (``maximize``, ``amsgrad``, ``nesterov``,
a tensor ``lr``, ``centered``, ``decoupled_weight_decay``, ...) and the implementations it has
(``foreach``, ``fused``, ``differentiable``). Each runs the same loop twice on identical models,
plain and in backward (several buckets, so that parameters are stepped at different points of
backward): the parameters end equal bit for bit, or ours is refused with an ordinary exception
before anything moves. Refused by design: LBFGS (its ``step`` needs a closure that re-evaluates
the loss), SparseAdam (sparse gradients), and ``differentiable=True``, whose in-place update of a
leaf that requires grad the plain optimizer cannot run either.

The same configurations on FSDP2 over 2 ranks (uneven shards), against the plain optimizer on an
unsharded copy given the global batch (plain Muon stepping the DTensors does not give the
unsharded update, 5.9e-4 apart after one step here: docs/differences.md): each keyword
combination with the class's default implementation, each other implementation with the first
combination. Equal to 1e-6 (the gradients are reduce-scattered).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _toy import PLAIN_ATOL, batch, full, loss_fn, make_models, rank_slice, shard
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.testing._internal.common_optimizers import OptimizerInfo, OptimizerInput, optim_db

from fused_optim_dist import InBackwardOptions, OptimizerInBackward

STEPS = 5
MAX_GRAD_NORM = 0.05
BUCKET_NUMEL = 60
"""Elements per bucket: the model's 158 parameters (131 for Muon, no biases) in several."""

CASES = [
    pytest.param(info, given, id=f"{info.optim_cls.__name__}-{given.desc}")
    for info in optim_db
    for given in info.optim_inputs_func(device="cpu")
]


def _refused(info: OptimizerInfo) -> bool:
    """LBFGS (a closure re-evaluating the loss) and SparseAdam (sparse gradients)."""
    return info.step_requires_closure or info.only_supports_sparse_grads


RUNNABLE = [case for case in CASES if not _refused(case.values[0])]
"""The configurations ours runs."""


def _implementations(info: OptimizerInfo) -> list[dict[str, bool]]:
    """The class's default, then each implementation PyTorch tests it with."""
    impls: list[dict[str, bool]] = [{}]
    if "foreach" in info.supported_impls:
        impls += [{"foreach": False}, {"foreach": True}]
    impls += [{impl: True} for impl in ("fused", "differentiable") if impl in info.supported_impls]
    return impls


def _model(cls: type[torch.optim.Optimizer]) -> nn.Module:
    torch.manual_seed(0)
    bias = cls is not torch.optim.Muon  # Muon steps matrices only
    return nn.Sequential(
        nn.Linear(6, 8, bias=bias),
        nn.Tanh(),
        nn.Linear(8, 8, bias=bias),
        nn.Tanh(),
        nn.Linear(8, 3, bias=bias),
    )


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)
    return (model(x) - y).square().mean()


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        _loss(model, step).backward()
        optim.step()
        optim.zero_grad()


def _values(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


Pair = tuple[nn.Module, torch.optim.Optimizer]


def _pairs(
    info: OptimizerInfo, kwargs: dict[str, Any], options: InBackwardOptions
) -> tuple[Pair, Pair]:
    """Identical models, one with the plain optimizer and one with ours."""
    cls = info.optim_cls
    reference, model = _model(cls), _model(cls)
    plain = cls(reference.parameters(), **copy.deepcopy(kwargs))
    ours = OptimizerInBackward(model.parameters(), cls, options=options, **copy.deepcopy(kwargs))
    return (reference, plain), (model, ours)


def _stepping_runs(
    info: OptimizerInfo, given: OptimizerInput, options: InBackwardOptions
) -> Iterator[tuple[dict[str, bool], Pair, Pair]]:
    """For each implementation but ``differentiable``: it, and the plain and our pair."""
    for impl in _implementations(info):
        if not impl.get("differentiable"):
            yield impl, *_pairs(info, {**given.kwargs, **impl}, options)


def _assert_same(model: nn.Module, reference: nn.Module, what: object, atol: float) -> None:
    """Every parameter of ``model`` (gathered, if sharded) within ``atol`` of ``reference``'s."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            full(p).detach(), q.detach(), atol=atol, rtol=0, msg=f"{what} {name}"
        )


# With differentiable=True the bucket whose update raised is counted as updated (a bucket that
# raises part-way may have moved some of its parameters), and the optimizer says so when it is
# collected: expected here, where nothing moved.
@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
@pytest.mark.parametrize(("info", "given"), CASES)
def test_equal_to_the_plain_optimizer_or_refused(info: OptimizerInfo, given: OptimizerInput):
    cls = info.optim_cls
    options = InBackwardOptions(bucket_numel=BUCKET_NUMEL)
    if _refused(info):
        model = _model(cls)
        with pytest.raises(ValueError, match=cls.__name__):
            OptimizerInBackward(model.parameters(), cls, options=options, **given.kwargs)
        return
    start = _values(_model(cls))
    if "differentiable" in info.supported_impls:
        for net, optim in _pairs(info, {**given.kwargs, "differentiable": True}, options):
            with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
                _train(net, optim)
            assert all(map(torch.equal, _values(net), start)), "moved"
    for impl, (reference, plain), (model, ours) in _stepping_runs(info, given, options):
        _train(reference, plain)
        _train(model, ours)
        _assert_same(model, reference, impl, atol=0.0)
        assert not all(map(torch.equal, _values(model), start)), (impl, "nothing moved")


def _clipped_accumulating(
    model: nn.Module, optim: torch.optim.Optimizer, in_backward: bool, every_micro_batch: bool
) -> list[float]:
    """Two micro-batches per step, clipped to ``MAX_GRAD_NORM``, the learning rate warmed up
    (unless it is a tensor); the plain loop clips with ``clip_grad_norm_`` before ``step()``.
    Ours accumulates the first micro-batch (``every_micro_batch``: both, stepped at
    ``step()``). Returns each step's norm."""
    norms = []
    scheduled = not isinstance(optim.param_groups[0]["lr"], torch.Tensor)
    schedule = LambdaLR(optim, lambda step: (step + 1) / STEPS) if scheduled else None
    for step in range(STEPS):
        for micro in range(2):
            held = in_backward and (micro == 0 or every_micro_batch)
            with optim.accumulate() if held else contextlib.nullcontext():
                _loss(model, 10 * step + micro).backward()
        if not in_backward:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
        elif not every_micro_batch:
            norms.append(optim.grad_norm().item())  # known before step() here
        optim.step()
        if in_backward and every_micro_batch:
            norms.append(optim.grad_norm().item())
        optim.zero_grad()
        if schedule is not None:
            schedule.step()
    return norms


@pytest.mark.parametrize("every_micro_batch", [False, True])
@pytest.mark.parametrize(("info", "given"), RUNNABLE)
def test_accumulated_and_clipped_as_the_plain_loop(
    info: OptimizerInfo, given: OptimizerInput, every_micro_batch: bool
):
    """One bucket, the first micro-batch accumulated and the second stepping in backward (a
    model in one bucket is clipped by exactly the global coefficient); or several buckets,
    every micro-batch accumulated and stepped at ``step()`` (all gradients known there: the
    global coefficient too). Clipping that steps several buckets in backward differs by
    design (docs/differences.md)."""
    bucket_numel = BUCKET_NUMEL if every_micro_batch else None
    options = InBackwardOptions(max_grad_norm=MAX_GRAD_NORM, bucket_numel=bucket_numel)
    for impl, (reference, plain), (model, ours) in _stepping_runs(info, given, options):
        expected = _clipped_accumulating(reference, plain, False, every_micro_batch)
        norms = _clipped_accumulating(model, ours, True, every_micro_batch)
        torch.testing.assert_close(norms, expected, rtol=1e-5, atol=0, msg=str(impl))
        assert min(expected) > MAX_GRAD_NORM  # every step clipped
        _assert_same(model, reference, impl, atol=PLAIN_ATOL)


def _skipping_nonfinite(model: nn.Module, optim: torch.optim.Optimizer, plain: bool) -> None:
    """A NaN gradient in one layer's weight at step 2; the plain loop drops that step (checks
    the gradients, then ``step()`` or not), ours is given ``skip_nonfinite``."""
    for step in range(STEPS):
        handle = None
        if step == 2:
            handle = model[2].weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
        _loss(model, step).backward()
        if handle is not None:
            handle.remove()
        if not plain or all(p.grad.isfinite().all() for p in model.parameters()):
            optim.step()
        optim.zero_grad()


@pytest.mark.parametrize(("info", "given"), RUNNABLE)
def test_nonfinite_step_skipped_as_the_plain_loop_drops_it(
    info: OptimizerInfo, given: OptimizerInput
):
    """``skip_nonfinite`` (one bucket: the whole step; fused Adam and AdamW, and momentum-free
    SGD, skip on the device through ``found_inf``): the parameters end as the plain loop's
    that does not call ``step()`` on a non-finite batch (a step count taken would change
    Adam's bias corrections)."""
    options = InBackwardOptions(skip_nonfinite=True)
    for impl, (reference, plain), (model, ours) in _stepping_runs(info, given, options):
        _skipping_nonfinite(reference, plain, plain=True)
        _skipping_nonfinite(model, ours, plain=False)
        assert ours.nonfinite_steps == 1, impl
        _assert_same(model, reference, impl, atol=0.0)


SHARDED = [
    pytest.param(info.optim_cls.__name__, id=info.optim_cls.__name__)
    for info in optim_db
    if not _refused(info)
]


def _sharded_runs(info: OptimizerInfo) -> list[dict[str, Any]]:
    """Each keyword combination with the default implementation; each other implementation
    with the first combination."""
    given = [g.kwargs for g in info.optim_inputs_func(device="cpu")]
    impls = [impl for impl in _implementations(info)[1:] if not impl.get("differentiable")]
    return given + [{**given[0], **impl} for impl in impls]


def _sharded_body(name: str) -> None:
    info = next(i for i in optim_db if i.optim_cls.__name__ == name)
    cls = info.optim_cls
    for kwargs in _sharded_runs(info):
        model, reference = make_models()
        shard(model)
        if cls is torch.optim.Muon:  # matrices only; the biases stay as they are
            for net in (model, reference):
                for param in net.parameters():
                    param.requires_grad_(param.ndim == 2)
        trained = [[p for p in net.parameters() if p.requires_grad] for net in (model, reference)]
        ours = OptimizerInBackward(trained[0], cls, **copy.deepcopy(kwargs))
        plain = cls(trained[1], **copy.deepcopy(kwargs))
        for step in range(STEPS):
            x, y = batch(step)
            loss_fn(model, rank_slice(x), rank_slice(y)).backward()
            loss_fn(reference, x, y).backward()
            for optim in (ours, plain):
                optim.step()
                optim.zero_grad()
        _assert_same(model, reference, kwargs, atol=PLAIN_ATOL)


@pytest.mark.parametrize("name", SHARDED)
def test_fsdp2_equal_to_the_plain_optimizer_unsharded(worlds, name: str):
    worlds.run(2, _sharded_body, name=name)
