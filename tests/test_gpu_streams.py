"""Stream ordering on a GPU: see [Note: streams of the in-backward step].

The hooks run on FSDP2's all-reduce stream when ``set_all_reduce_hook`` is set on 1-D FSDP,
while the gradients were allocated on the reduce-scatter stream; and with
``set_is_last_backward(False)`` FSDP2 skips the finalize that makes the default stream wait for
the post-reduce event. Both must still train exactly like the plain optimizer. Skipped without
a CUDA device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fused_optim_dist import OptimizerInBackward

pytestmark = pytest.mark.gpu

WIDTH, DEPTH, STEPS = 1024, 6, 5


@pytest.fixture(scope="module")
def nccl_world():
    # One process: an in-memory store, no port to pick.
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)]
    return nn.Sequential(*layers).cuda()


def _shard(model: nn.Module, all_reduce_hook: bool) -> nn.Module:
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if all_reduce_hook:
        # A no-op hook: its only effect is to move the post-reduce work to another stream.
        model.set_all_reduce_hook(lambda output: None)
    return model


@pytest.mark.parametrize("variant", ["all_reduce_hook", "not_last_backward"])
def test_gpu_stream_ordering_matches_plain(nccl_world, variant):
    hook = variant == "all_reduce_hook"
    ours = _shard(_model(), all_reduce_hook=hook)
    reference = _shard(copy.deepcopy(_model()), all_reduce_hook=hook)
    optim = OptimizerInBackward(ours.parameters(), torch.optim.AdamW, lr=1e-3)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        g = torch.Generator("cuda").manual_seed(step)
        x = torch.randn(64, WIDTH, device="cuda", generator=g)
        if variant == "not_last_backward":
            ours.set_is_last_backward(False)
        ours(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        reference(x).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), float("inf"))
        torch.testing.assert_close(optim.grad_norm(), norm.full_tensor(), rtol=1e-4, atol=0)
        plain.step()
        plain.zero_grad()
    for p, q in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6)
