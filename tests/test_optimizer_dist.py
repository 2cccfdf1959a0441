"""OptimizerInBackward on FSDP2 against plain torch.optim on an unsharded copy (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from _toy import assert_match, batch, loss_fn, make_models, rank_slice, shard, train_reference

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
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_adamw_parity_across_world_sizes(worlds, world_size):
    worlds.run(world_size, _parity_body, name="AdamW", kwargs=dict(lr=1e-2, weight_decay=0.1))


@pytest.mark.parametrize(
    ("name", "kwargs"), OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTIMIZERS)]
)
def test_optimizer_parity_4_ranks(worlds, name, kwargs):
    worlds.run(4, _parity_body, name=name, kwargs=kwargs)
