"""Lightning Fabric loops stepping in backward (``InBackwardFabric``), against the same loop on
a plain optimizer and plain ``Fabric``.

The loop is Fabric's own for accumulation (``no_backward_sync`` on every micro-batch but the
last of a window) and clipping (``clip_gradients`` before ``step()``). Every run ends bit for bit
where the plain one does (``assert_same_state_dict``); one process with each parameter a bucket
of its own, or, where it clips by norm, the model one bucket (exact clipping); and FSDP2 through
``ModelParallelStrategy`` on 2 and 3 gloo ranks, where Fabric's ``no_backward_sync`` is
FSDP2's ``set_requires_gradient_sync(False)``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import pytest
import torch
from _toy import assert_same_state_dict, holds_gradient
from torch import nn
from torch.optim import Optimizer

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW
from fused_optim_dist.training import in_backward_of

lightning = pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402
from test_lightning import _quiet_lightning  # noqa: E402, F401 (an autouse fixture)

from fused_optim_dist.integrations.fabric import InBackwardFabric, _sync_fsdp2  # noqa: E402

MakeOptim = Callable[[nn.Module], Optimizer]
BATCHES = 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )


def _batches(nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data))
        for _ in range(BATCHES)
    ]
    if nan_at is not None:
        batches[nan_at][0][0, 0] = math.nan
    return batches


def _train(
    fabric: Fabric,
    model: nn.Module,
    optim: Optimizer,
    window: int,
    clip: dict,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[str]:
    """Fabric's accumulation loop; returns the norm ``clip_gradients`` returned at each step.
    With an in-backward optimizer, checks that each window's last backward stepped it: no
    gradient is left for ``step()``."""
    norms = []
    for index, (x, y) in enumerate(batches):
        accumulating = (index + 1) % window != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(nn.functional.mse_loss(model(x), y))
        if accumulating:
            continue
        if in_backward_of(optim) is not None:
            assert not any(map(holds_gradient, model.parameters())), "not stepped in backward"
        if clip:
            norm = fabric.clip_gradients(model, optim, **clip)
            norms.append("clipped" if norm is None else f"{norm.item():.6e}")
        optim.step()
        optim.zero_grad()
    return norms


def _setup(
    fabric_cls: type[Fabric], make_optim: MakeOptim, **fabric_kwargs
) -> tuple[Fabric, nn.Module, Optimizer]:
    fabric = fabric_cls(accelerator="cpu", devices=1, **fabric_kwargs)
    model = fabric.setup(_net())
    return fabric, model, fabric.setup_optimizers(make_optim(model))


def _fit(
    fabric_cls: type[Fabric], make_optim: MakeOptim, window: int = 1, clip: dict | None = None
) -> tuple[nn.Module, list[str]]:
    fabric, model, optim = _setup(fabric_cls, make_optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric's advice on no_backward_sync on one device
        norms = _train(fabric, model, optim, window, clip or {}, _batches())
    return model.module, norms


def _ours(cls: type[Optimizer] = torch.optim.AdamW, **kwargs) -> MakeOptim:
    buckets = {} if {"max_grad_norm", "clip_grad_value"} & kwargs.keys() else {"bucket_numel": 1}
    return lambda m: OptimizerInBackward(m.parameters(), cls, lr=1e-2, **buckets, **kwargs)


def _plain(cls: type[Optimizer] = torch.optim.AdamW) -> MakeOptim:
    return lambda m: cls(m.parameters(), lr=1e-2)


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, CompactAdamW])
def test_no_backward_sync_accumulation_equal_plain(window: int, cls: type[Optimizer]):
    ours, _ = _fit(InBackwardFabric, _ours(cls), window)
    plain, _ = _fit(Fabric, _plain(cls), window)
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


@pytest.mark.parametrize(
    ("ours_kwargs", "clip"),
    [
        (dict(max_grad_norm=0.05), dict(max_norm=0.05)),
        (dict(clip_grad_value=0.01), dict(clip_val=0.01)),
    ],
    ids=["max_norm", "clip_val"],
)
def test_clip_gradients_equal_plain(ours_kwargs: dict, clip: dict):
    """Accumulated windows of 2, clipped: the same parameters, and the same norms returned."""
    ours, ours_norms = _fit(InBackwardFabric, _ours(**ours_kwargs), 2, clip)
    plain, plain_norms = _fit(Fabric, _plain(), 2, clip)
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert ours_norms == plain_norms, (ours_norms, plain_norms)
    if "max_norm" in clip:  # every step clipped
        assert min(map(float, plain_norms)) > clip["max_norm"], plain_norms
    unclipped, _ = _fit(Fabric, _plain(), 2)
    assert not torch.equal(unclipped[0].weight, plain[0].weight), "the clipping changed nothing"


def test_non_finite_norm_raised_as_plain_with_skip_nonfinite():
    """A NaN in the third window: Fabric's ``clip_gradients`` raises there, before the step;
    ours skipped the step in backward (one bucket: the whole step) and raises there too."""
    runs = []
    for fabric_cls, make in (
        (InBackwardFabric, _ours(max_grad_norm=0.05, skip_nonfinite=True)),
        (Fabric, _plain()),
    ):
        fabric, model, optim = _setup(fabric_cls, make)
        with pytest.raises(RuntimeError, match="non-finite"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(fabric, model, optim, 2, {"max_norm": 0.05}, _batches(nan_at=4))
        runs.append(model.module.state_dict())
    assert_same_state_dict(*runs)


@pytest.mark.parametrize(
    "clip",
    [dict(max_norm=0.5), dict(max_norm=0.05, norm_type=1.0), dict(clip_val=0.01)],
    ids=["other-max_norm", "other-norm_type", "clip_val-not-configured"],
)
def test_clip_gradients_unlike_the_optimizer_refused(clip: dict):
    with pytest.raises(ValueError, match="OptimizerInBackward"):
        _fit(InBackwardFabric, _ours(max_grad_norm=0.05), 2, clip)


def test_without_it_what_fabric_does_outside_a_step_is_refused():
    """Plain ``Fabric``: the second micro-batch of a window (its forward, reading the weights
    the first backward updated), and the clip's read of the freed gradients (after the first
    backward moved the parameters)."""
    with pytest.raises(RuntimeError, match=r"updated in backward with no optimizer\.step\(\)"):
        _fit(Fabric, _ours(), 2)
    with pytest.raises(RuntimeError, match="freed"):
        _fit(Fabric, _ours(max_grad_norm=0.05), 1, {"max_norm": 0.05})


def test_loss_scaling_refused_before_anything_moves():
    """``precision="16-mixed"`` as on a GPU (on the CPU Fabric runs ``"bf16-mixed"``): the
    plugin given a CPU ``GradScaler``."""
    from lightning.fabric.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric = InBackwardFabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(_net())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"GradScaler.*bf16-mixed.*skip_nonfinite=True"):
        fabric.setup_optimizers(_ours()(model))
    for param, initial in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, initial)


# ------------------------------------------ FSDP2 through Fabric's ModelParallelStrategy


def _sharded_body(window: int, max_norm: float | None) -> None:
    """Each ``Linear`` a unit of its own and the root, or (clipping) the root alone."""
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from fused_optim_dist._torch_internals import fsdp_sync_off

    def shard(module: nn.Module, mesh) -> nn.Module:
        if max_norm is None:
            for layer in module:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(module, mesh=mesh["data_parallel"])

    world_size = os.environ["WORLD_SIZE"]
    rank = int(os.environ["RANK"])
    clip = {} if max_norm is None else {"max_norm": max_norm}
    results = []
    for fabric_cls, make in (
        (InBackwardFabric, _ours(**({} if max_norm is None else {"max_grad_norm": max_norm}))),
        (Fabric, _plain()),
    ):
        strategy = ModelParallelStrategy(
            parallelize_fn=shard, data_parallel_size=int(world_size), tensor_parallel_size=1
        )
        fabric = fabric_cls(accelerator="cpu", devices=int(world_size), strategy=strategy)
        try:
            fabric.launch()
            model = fabric.setup(_net())
            optim = fabric.setup_optimizers(make(model))
            share = BATCHES // int(world_size)  # the same number of backwards on every rank
            batches = _batches()[rank * share : (rank + 1) * share] * 2
            norms = _train(fabric, model, optim, window, clip, batches)
        finally:
            os.environ["WORLD_SIZE"] = world_size  # Fabric's environment removes it at teardown
        if fabric_cls is InBackwardFabric:
            # Its model is left with FSDP2's sync on, as no_backward_sync found it.
            assert not fsdp_sync_off()
        else:
            # Plain Fabric left it off ([Note: Fabric leaves FSDP2's sync off]): turned on, or
            # while the model lives every backward of this rank's process (later tests' too)
            # would be a micro-batch to an in-backward optimizer.
            _sync_fsdp2(model)
        results.append((model.module.state_dict(), norms))
    (ours, ours_norms), (plain, plain_norms) = results
    assert_same_state_dict(ours, plain)
    assert ours_norms == plain_norms


@pytest.mark.parametrize(
    ("world_size", "window", "max_norm"),
    [(2, 2, None), (3, 2, None), (2, 2, 0.05)],
    ids=["units", "odd-world", "one-unit-clipped"],
)
def test_model_parallel_strategy_fsdp2_equal_plain(worlds, world_size, window, max_norm):
    worlds.run(world_size, _sharded_body, window=window, max_norm=max_norm)


def _ddp_body() -> None:
    """Fabric's DDP strategy, the optimizer built on the wrapped model or set up with it."""
    world_size = os.environ["WORLD_SIZE"]
    fabric = InBackwardFabric(accelerator="cpu", devices=int(world_size), strategy="ddp")
    try:
        fabric.launch()
        for together, refusal in ((False, ValueError), (True, RuntimeError)):
            net = _net()
            before = [p.detach().clone() for p in net.parameters()]
            with pytest.raises(refusal, match=r"DistributedDataParallel.*fully_shard"):
                if together:
                    model, optim = fabric.setup(net, _ours()(net))
                else:
                    model = fabric.setup(net)
                    optim = fabric.setup_optimizers(_ours()(model))
                x, y = _batches()[0]
                fabric.backward(nn.functional.mse_loss(model(x), y))
                optim.step()
            for param, initial in zip(net.parameters(), before, strict=True):
                assert torch.equal(param, initial)
    finally:
        os.environ["WORLD_SIZE"] = world_size


def test_ddp_strategy_refused_before_anything_moves(worlds):
    worlds.run(2, _ddp_body)
