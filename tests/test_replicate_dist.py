"""Data parallel with gradient release: ``replicate`` (FSDP2's all-reduce twin of DDP).

``torch.distributed._composable.replicate_with_fsdp.replicate`` keeps every parameter whole on
every rank as a ``Replicate`` DTensor and all-reduces each unit's gradients in backward, then
calls the parameters' post-accumulate-grad hooks, as ``fully_shard`` does after its
reduce-scatter: each unit is stepped and its gradients freed in backward. Compared with plain
AdamW on one process on the same global batch, on 2 and 3 ranks, with accumulation over two
micro-batches and clipping: exact on one unit, the documented per-bucket coefficients
(``clip_like_in_backward``) with one unit per block.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from _toy import (
    PLAIN_ATOL,
    assert_match,
    batch,
    clip_like_in_backward,
    full,
    holds_gradient,
    loss_fn,
    make_models,
    rank_slice,
    unit_order,
)
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.tensor import DTensor, Replicate

from fused_optim_dist import OptimizerInBackward

STEPS = 3
MICRO_BATCHES = 2
BATCH = 12
"""Divisible by every world size times ``MICRO_BATCHES``: equal slices, so the mean of the
ranks' mean gradients is the gradient of the global mean."""
CLIP = 0.1
"""Below the gradient norm of every step here (checked), so each step is clipped."""
LR = 1e-2


def _replicate_body(per_block: bool) -> float:
    model, reference = make_models()
    if per_block:
        for layer in model.layers:
            replicate(layer)
    replicate(model)
    assert all(
        isinstance(p, DTensor) and p.placements == (Replicate(),) for p in model.parameters()
    )
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR, max_grad_norm=CLIP)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    units = unit_order(reference) if per_block else [list(reference.parameters())]
    previous: list[float] = []
    for step in range(STEPS):
        x, y = batch(step, BATCH)
        xs, ys = rank_slice(x).chunk(MICRO_BATCHES), rank_slice(y).chunk(MICRO_BATCHES)
        for index, (mx, my) in enumerate(zip(xs, ys, strict=True)):
            last = index == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else optim.accumulate():
                (loss_fn(model, mx, my) / MICRO_BATCHES).backward()
        # Stepped in backward: nothing is left for step(), no gradient is kept.
        assert all(not holds_gradient(p) for p in model.parameters())
        optim.step()
        optim.zero_grad()

        loss_fn(reference, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()
        assert norm > CLIP, norm
        torch.testing.assert_close(optim.grad_norm().item(), norm, rtol=1e-5, atol=0)
        previous = clip_like_in_backward(units, previous, CLIP)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference, atol=PLAIN_ATOL)
    return max(
        (full(p) - r).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("per_block", [False, True], ids=["one-unit", "per-block"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_replicate_matches_plain_adamw(worlds, world_size, per_block):
    differences = worlds.run(world_size, _replicate_body, per_block=per_block)
    print(f"replicate, {world_size} ranks, per_block={per_block}: {max(differences):.2e}")


def _data_parallel_benchmark_body() -> list[dict]:
    from benchmarks.data_parallel import METHODS, Config, measure

    config = Config(ranks=2, quick=True)
    return [measure(config, method) for method in METHODS]


def test_data_parallel_benchmark_counts_the_gradients_each_method_keeps(worlds):
    """DDP and replicate with plain AdamW hold every gradient when backward returns; with
    the optimizer in backward none is left (``benchmarks/data_parallel.py``, quick shape)."""
    for rows in worlds.run(2, _data_parallel_benchmark_body):
        held = {row["method"]: row["grad_bytes_after_backward"] for row in rows}
        params = rows[0]["param_bytes"]
        assert held == {"ddp": params, "replicate": params, "replicate+ours": 0}, held
        assert all(row["state_bytes"] >= 2 * params for row in rows), rows
