"""On a CUDA device: FSDP2 streams (hooks run on the reduce-scatter stream), fused kernels, and
CPU offload (which does nothing on a CPU-only machine, so it is tested here).

Skipped without CUDA (see ``conftest.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _toy import (
    assert_match,
    batch,
    clip_like_in_backward,
    loss_fn,
    make_models,
    shard,
    unit_order,
)
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW

pytestmark = pytest.mark.gpu

STEPS = 4
MAX_GRAD_NORM = 0.5
"""Below every step's gradient norm of the toy model (1.2 to 2.6), so clipping engages."""
SGD_LR = 0.1
"""SGD's update is proportional to the gradient: every clip coefficient shows in the weights."""


@pytest.fixture(scope="module")
def nccl_world():
    # One process: an in-memory store, no port to pick.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_cuda_parity_with_plain_optimizer(nccl_world, impl):
    model, reference = make_models()
    model, reference = model.cuda(), reference.cuda()
    shard(model)
    kwargs = dict(lr=1e-2, weight_decay=0.1, **{impl: True})
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **kwargs)
    ref_optim = torch.optim.AdamW(reference.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(step))
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)
        ref_optim.step()
        ref_optim.zero_grad()
        torch.testing.assert_close(optim.grad_norm(), expected_norm, rtol=1e-5, atol=0)
    torch.cuda.synchronize()
    assert_match(model, reference, atol=1e-5)


def _clipped_run(model, reference, impl: str) -> None:
    """Clipping in backward, against the documented per-unit formula on the reference."""
    kwargs = dict(lr=SGD_LR, momentum=0.9, **{impl: True})
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.SGD, max_grad_norm=MAX_GRAD_NORM, **kwargs
    )
    ref_optim = torch.optim.SGD(reference.parameters(), **kwargs)
    previous: list[float] = []
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(step))
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        previous = clip_like_in_backward(unit_order(reference), previous, MAX_GRAD_NORM)
        norm = math.sqrt(sum(previous))
        assert norm > 2 * MAX_GRAD_NORM, "clipping must engage for the test to see it"
        torch.testing.assert_close(optim.grad_norm().cpu(), torch.tensor(norm), rtol=1e-5, atol=0)
        ref_optim.step()
        ref_optim.zero_grad()
    torch.cuda.synchronize()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_cuda_clipping_matches_documented_reference(nccl_world, impl):
    model, reference = make_models()
    model, reference = model.cuda(), reference.cuda()
    shard(model)
    _clipped_run(model, reference, impl)
    assert_match(model, reference, atol=1e-5)


def test_cpu_offload_with_clipping(nccl_world):
    """Sharded parameters, gradients and optimizer state on pinned host memory, compute on the
    GPU: the gradient norm of host gradients must be reduced although nccl has no CPU backend,
    and the hooks must read finished device-to-host copies."""
    model, reference = make_models()
    model, reference = model.cuda(), reference.cuda()
    shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        assert local.device.type == "cpu" and local.is_pinned(), "offload must be in effect"
    _clipped_run(model, reference, "foreach")
    # One rank: the local shard is the whole parameter (no CPU collective under nccl).
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            param.to_local().detach(), ref.detach().cpu(), atol=1e-5, rtol=1e-5, msg=name
        )


def test_compact_adamw_in_backward_on_cuda(nccl_world):
    """CompactAdamW on FSDP2's bfloat16 CUDA shards, stepped in backward by its Triton kernel
    (what ``kernel="auto"`` takes there, in the hooks' stream): the same bits as the same class
    stepped after backward on an identical sharded model."""
    pytest.importorskip("triton")
    models = [shard(m.cuda().bfloat16()) for m in make_models()]
    ours = OptimizerInBackward(models[0].parameters(), CompactAdamW, lr=1e-2)
    plain = CompactAdamW(models[1].parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = (t.cuda().bfloat16() for t in batch(step))
        for model, optim in zip(models, (ours, plain), strict=True):
            loss_fn(model, x, y).backward()
            optim.step()
            optim.zero_grad()
    torch.cuda.synchronize()
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())
