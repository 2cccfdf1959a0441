"""OptimizerInBackward on FSDP2 against plain torch.optim on an unsharded copy (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from _toy import (
    assert_match,
    batch,
    holds_gradient,
    loss_fn,
    make_models,
    rank_slice,
    shard,
    train_reference,
)

from fused_optim_dist import OptimizerInBackward

STEPS = 4

OPTIMIZERS = [
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, maximize=True)),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, foreach=True, maximize=True)),
    ("Adamax", dict(lr=1e-2)),
    ("NAdam", dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    ("Adagrad", dict(lr=1e-1, lr_decay=0.01)),
    ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    ("Adadelta", dict(lr=1.0)),
    ("ASGD", dict(lr=1e-2, t0=1)),
    ("Rprop", dict(lr=1e-2)),
]


def _parity_body(name: str, kwargs: dict, steps: int = STEPS) -> None:
    cls = getattr(torch.optim, name)
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), cls, **kwargs)
    ref_optim = cls(reference.parameters(), **kwargs)
    for step in range(steps):
        x, y = batch(step)
        loss_fn(model, rank_slice(x), rank_slice(y)).backward()
        optim.step()
        optim.zero_grad()
    train_reference(reference, ref_optim, steps)
    assert_match(model, reference)
    assert all(not holds_gradient(p) for p in model.parameters())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_adamw_parity_across_world_sizes(worlds, world_size):
    worlds.run(world_size, _parity_body, name="AdamW", kwargs=dict(lr=1e-2, weight_decay=0.1))


@pytest.mark.parametrize(
    ("name", "kwargs"), OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTIMIZERS)]
)
def test_optimizer_parity_4_ranks(worlds, name, kwargs):
    worlds.run(4, _parity_body, name=name, kwargs=kwargs)


def _gradient_placement_body() -> None:
    """Gradients that are not FSDP2's: a ``Partial`` gradient of a replicated DTensor parameter
    is redistributed (summed over ranks) and stepped as plain AdamW steps the sum; a plain
    gradient on a DTensor parameter is refused before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    rank = torch.distributed.get_rank()
    start = torch.arange(6.0).reshape(2, 3)
    param = torch.nn.Parameter(DTensor.from_local(start.clone(), mesh, [Replicate()]))
    reference = torch.nn.Parameter(start.clone())
    optim = OptimizerInBackward([param], torch.optim.AdamW, lr=0.1)
    ref_optim = torch.optim.AdamW([reference], lr=0.1)
    for step in range(3):
        local = torch.full((2, 3), float(rank + step + 1))
        param.grad = DTensor.from_local(local, mesh, [Partial()])
        reference.grad = sum(
            torch.full((2, 3), float(r + step + 1))
            for r in range(torch.distributed.get_world_size())
        )
        optim.step()
        ref_optim.step()
        torch.testing.assert_close(param.to_local(), reference.detach(), atol=1e-6, rtol=0)
        assert not holds_gradient(param)
    before = param.to_local().clone()
    param.grad = torch.ones(2, 3)
    with pytest.raises(TypeError, match="set DTensor gradients on DTensor parameters"):
        optim.step()
    assert torch.equal(param.to_local(), before)


def test_gradients_placed_like_their_parameter(worlds):
    worlds.run(2, _gradient_placement_body)


def test_sparse_gradient_refused():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    optim = OptimizerInBackward(embedding.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    before = embedding.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        embedding(torch.tensor([1, 2])).sum().backward()
    assert torch.equal(embedding.weight.detach(), before)
    assert not optim.state
