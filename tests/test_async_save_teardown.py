"""An asynchronous save is never lost silently (README, "What differs from the plain optimizer,
and what raises"): a run that ends with ``checkpoint.save(..., async_=True)`` and then destroys
the process group, or exits, without ``wait()`` either finds the checkpoint committed, or logs
why it is not and exits with status 1. Each case runs in a fresh process (world of 2 ranks,
gloo), as a training script would.

The "exit" case once aborted during interpreter finalization ("terminate called without an
active exception": a gloo worker thread freeing the async save's last collective work once the
interpreter was half torn down, pytorch#179291), and torchrun terminated the other rank. Every
rank's exit now waits until rank 0 has committed, then destroys the async-save group while the
interpreter is alive (see [Note: async commit] and ``release_async_save_group``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from fused_optim_dist import OptimizerInBackward, checkpoint

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    if sys.argv[2] == "commit_fails" and dist.get_rank() == 0:
        def fail(*_):
            raise OSError("disk full")
        checkpoint.layout.commit = fail
    checkpoint.save(sys.argv[1], model, optim, step=1, async_=True)
    if sys.argv[2] != "exit":
        dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("ending", ["destroy", "exit", "commit_fails"])
def test_pending_async_save_is_committed_or_reported(tmp_path: Path, ending: str):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(ckpt),
            ending,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    if ending == "commit_fails":
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "asynchronous save of step 1" in proc.stderr and "disk full" in proc.stderr
        assert not list(ckpt.glob("step_*[0-9]"))
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [p.name for p in ckpt.glob("step_*[0-9]")] == ["step_000001"]
        assert (ckpt / "step_000001" / "checkpoint.json").exists()
        assert not list(ckpt.glob("*.tmp"))
