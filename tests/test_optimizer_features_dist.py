"""OptimizerInBackward with the features a training loop combines, on FSDP2 and friends (gloo,
CPU). Every test compares with plain torch.optim on an unsharded single-process copy trained on
the same global batch, parameter by parameter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _toy import (
    assert_match,
    batch,
    bypassed,
    full,
    loss_fn,
    make_models,
    rank_slice,
    shard,
    train_reference,
)
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR

from fused_optim_dist import OptimizerInBackward

STEPS = 4
ADAMW = dict(lr=1e-2, weight_decay=0.1)
DIFFERENT = 1e-4
"""A parameter that moved by more than this between two runs took a different update."""


# ---------------------------------------------------------------------------------- helpers


def _hooks(param: torch.Tensor) -> int:
    return len(param._post_accumulate_grad_hooks or {})


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [full(p).detach().clone() for p in model.parameters()]


def _max_diff(model: nn.Module, reference: nn.Module) -> float:
    return max(
        (full(p).detach() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if p.numel()
    )


def _backward(model: nn.Module, step: int, skip: Callable = lambda m: ()) -> None:
    """This rank's share of the global batch of ``step``; ``skip(model)`` modules unused."""
    x, y = batch(step)
    with bypassed(*skip(model)):
        loss_fn(model, rank_slice(x), rank_slice(y)).backward()


def _reference_step(reference, optim, step, skip: Callable = lambda m: ()) -> None:
    x, y = batch(step)
    with bypassed(*skip(reference)):
        loss_fn(reference, x, y).backward()
    optim.step()
    optim.zero_grad()


def _assert_grads_freed(model: nn.Module) -> None:
    held = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not held, f"gradients left after backward: {held}"


def _two_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the matrices only, a larger lr for biases and norms."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.endswith("weight") and ".norm." not in n]
    others = [p for n, p in named if not (n.endswith("weight") and ".norm." not in n)]
    return [{"params": matrices}, {"params": others, "lr": 3e-2, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------------- groups


SCHEDULERS: dict[str, Callable] = {
    # Per-group factors with a zero for each group at a different step: a step at lr 0 must
    # leave that group's parameters exactly unchanged.
    "lambda": lambda optim: LambdaLR(
        optim, [lambda s: (1.0, 0.5, 0.0, 2.0, 1.0)[s], lambda s: (1.0, 3.0, 0.5, 0.0, 1.0)[s]]
    ),
    "cosine": lambda optim: CosineAnnealingLR(optim, T_max=3, eta_min=1e-3),
}


def _groups_body(
    optimizer: str,
    kwargs: dict,
    scheduler: str | None = None,
    edits: dict[int, list[tuple[int, str, object]]] | None = None,
    freeze: tuple[str, ...] = (),
) -> None:
    """Two param groups; optionally a scheduler, frozen parameters, and writes into the groups
    before the backward of given steps (``edits[step] = [(group, key, value), ...]``)."""
    cls = getattr(torch.optim, optimizer)
    edits = edits or {}
    model, reference = make_models(freeze=freeze)
    _, unscheduled = make_models(freeze=freeze)
    shard(model)
    optim = OptimizerInBackward(_two_groups(model), cls, **kwargs)
    ref_optim = cls(_two_groups(reference), **kwargs)
    sched = ref_sched = None
    if scheduler is not None:
        sched, ref_sched = SCHEDULERS[scheduler](optim), SCHEDULERS[scheduler](ref_optim)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_before = [full(p).clone() for p in frozen]
    assert all(_hooks(p) == 0 for p in frozen)
    assert all(_hooks(p) == 1 for p in model.parameters() if p.requires_grad)

    zero_lr_steps = 0
    for step in range(STEPS):
        for opt in (optim, ref_optim):
            for index, key, value in edits.get(step, ()):
                opt.param_groups[index][key] = value
        lrs = [g["lr"] for g in optim.param_groups]
        assert lrs == [g["lr"] for g in ref_optim.param_groups]
        before = {id(p): full(p).detach().clone() for p in model.parameters()}
        _backward(model, step)
        _assert_grads_freed(model)
        optim.step()
        optim.zero_grad()
        _reference_step(reference, ref_optim, step)
        for s in (sched, ref_sched):
            if s is not None:
                s.step()
        assert_match(model, reference)
        # The lr the scheduler wrote is the one in force: at lr 0 a group does not move at all.
        for lr, group in zip(lrs, optim.param_groups, strict=True):
            if lr == 0.0:
                zero_lr_steps += 1
                assert all(torch.equal(full(p), before[id(p)]) for p in group["params"])

    if scheduler == "lambda":
        assert zero_lr_steps == 2
    for p, value in zip(frozen, frozen_before, strict=True):
        assert torch.equal(full(p), value)
        assert p not in optim.state
    assert len(optim.state) == sum(p.requires_grad for p in model.parameters())

    # The test can fail: without the scheduler or the edits the reference ends elsewhere.
    if scheduler is not None or edits:
        train_reference(unscheduled, cls(_two_groups(unscheduled), **kwargs), STEPS)
        assert _max_diff(model, unscheduled) > DIFFERENT


@pytest.mark.parametrize(("world_size", "scheduler"), [(2, "lambda"), (4, "lambda"), (4, "cosine")])
def test_param_groups_scheduler_and_frozen_params(worlds, world_size, scheduler):
    worlds.run(
        world_size,
        _groups_body,
        optimizer="AdamW",
        kwargs=ADAMW,
        scheduler=scheduler,
        freeze=("inp", "layers.1.norm"),
    )


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "edits"),
    [
        (
            "AdamW",
            ADAMW,
            {
                1: [(0, "weight_decay", 0.5)],
                2: [(1, "betas", (0.5, 0.6)), (0, "lr", 0.05)],
                3: [(1, "weight_decay", 0.2), (1, "eps", 1e-3)],
            },
        ),
        (
            "SGD",
            dict(lr=0.1, momentum=0.9),
            {1: [(1, "momentum", 0.0)], 2: [(0, "momentum", 0.3), (0, "nesterov", True)]},
        ),
    ],
    ids=["AdamW", "SGD"],
)
def test_group_writes_take_effect_from_next_backward(worlds, optimizer, kwargs, edits):
    worlds.run(4, _groups_body, optimizer=optimizer, kwargs=kwargs, edits=edits)


# ---------------------------------------------------------------------------------- non-elementwise


class NormalizedSGD(torch.optim.Optimizer):
    """``p -= lr * g / ||g||``, the norm taken over the whole parameter: not elementwise."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=group["lr"])
        return None


def _non_elementwise_body() -> None:
    model, reference = make_models()
    forced, _ = make_models()
    shard(model)
    shard(forced)
    optim = OptimizerInBackward(model.parameters(), NormalizedSGD, lr=0.05)
    wrong = OptimizerInBackward(forced.parameters(), NormalizedSGD, elementwise=True, lr=0.05)
    for step in range(STEPS):
        for net, opt in ((model, optim), (forced, wrong)):
            _backward(net, step)
            _assert_grads_freed(net)
            opt.step()
    train_reference(reference, NormalizedSGD(reference.parameters(), lr=0.05), STEPS)
    assert_match(model, reference)
    # Each rank normalised its own shard by the shard's norm: a different update.
    assert _max_diff(forced, reference) > DIFFERENT


def test_non_elementwise_optimizer_steps_dtensors(worlds):
    worlds.run(4, _non_elementwise_body)


def _adafactor_body() -> None:
    # torch.optim.Adafactor's factored moments take norms along each dimension; on a DTensor
    # sharded along dim 0 the column norm is a partial result, and torch 2.13's Adafactor then
    # squares it in place, which DTensor refuses. The plain optimizer on the same FSDP2 model
    # fails the same way; the in-backward step must fail too, not fall back to something wrong.
    plain_model, _ = make_models()
    model, reference = make_models()
    forced, _ = make_models()
    for net in (plain_model, model, forced):
        shard(net)
    plain = torch.optim.Adafactor(plain_model.parameters(), lr=1e-2)
    _backward(plain_model, 0)
    with pytest.raises(RuntimeError, match=r"aten.pow_.Scalar: in-place operations that require"):
        plain.step()

    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    with pytest.raises(RuntimeError, match=r"aten.pow_.Scalar: in-place operations that require"):
        _backward(model, 0)

    # Forced onto local shards it runs, but each rank factors its own rows: a wrong result.
    # (On 4 ranks some shards are empty, and Adafactor divides by their numel.)
    wrong = OptimizerInBackward(
        forced.parameters(), torch.optim.Adafactor, elementwise=True, lr=1e-2
    )
    for step in range(STEPS):
        _backward(forced, step)
        wrong.step()
    train_reference(reference, torch.optim.Adafactor(reference.parameters(), lr=1e-2), STEPS)
    assert _max_diff(forced, reference) > DIFFERENT
    del optim


def test_adafactor_fails_on_dtensors_like_plain_torch(worlds):
    worlds.run(2, _adafactor_body)


# ---------------------------------------------------------------------------------- meshes


def _train_and_match(model, reference, data_slice, steps=STEPS, atol=1e-6) -> None:
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    for step in range(steps):
        x, y = batch(step)
        loss_fn(model, data_slice(x), data_slice(y)).backward()
        _assert_grads_freed(model)
        optim.step()
        optim.zero_grad()
    train_reference(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), steps)
    assert_match(model, reference, atol=atol)


def _hsdp_body() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, reference = make_models()
    shard(model, mesh=mesh)
    assert all(p.placements[0].is_replicate() for p in model.parameters())
    _train_and_match(model, reference, rank_slice)


def _fsdp_tp_body() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, reference = make_models()
    for layer in model.layers:
        # HIDDEN (3) does not divide by 2: TP's default Shard(-1) hand-over between the two
        # linears would infer a wrong global size, so hand over a replicated activation.
        plan = {
            "up": ColwiseParallel(output_layouts=Replicate()),
            "down": RowwiseParallel(input_layouts=Replicate()),
        }
        parallelize_module(layer, mesh["tp"], plan)
    shard(model, mesh=mesh["dp"])
    assert model.layers[0].up.weight.device_mesh.ndim == 2
    dp_rank = mesh["dp"].get_local_rank()
    _train_and_match(model, reference, lambda t: t.chunk(2)[dp_rank])


@pytest.mark.parametrize("body", [_hsdp_body, _fsdp_tp_body], ids=["HSDP", "FSDP+TP"])
def test_two_dimensional_meshes(worlds, body):
    worlds.run(4, body)
