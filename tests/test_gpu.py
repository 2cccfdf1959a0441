"""On a CUDA device: FSDP2 streams (hooks run on the reduce-scatter stream) and fused kernels.

Skipped without CUDA (see ``conftest.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _toy import assert_match, batch, loss_fn, make_models, shard

from fused_optim_dist import OptimizerInBackward

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_cuda_parity_with_plain_optimizer(nccl_world, impl):
    model, reference = make_models()
    model, reference = model.cuda(), reference.cuda()
    shard(model)
    kwargs = dict(lr=1e-2, weight_decay=0.1, **{impl: True})
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, max_grad_norm=10.0, **kwargs)
    ref_optim = torch.optim.AdamW(reference.parameters(), **kwargs)
    for step in range(4):
        x, y = (t.cuda() for t in batch(step))
        loss_fn(model, x, y).backward()
        optim.step()
        loss_fn(reference, x, y).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 10.0)
        ref_optim.step()
        ref_optim.zero_grad()
        torch.testing.assert_close(optim.grad_norm(), expected_norm, rtol=1e-5, atol=0)
    torch.cuda.synchronize()
    assert_match(model, reference, atol=1e-5)
