"""Runs the Python blocks of the README and docs/ on every rank of a torchrun job.

Each block runs in a namespace of its own holding the names the surrounding text gives it: a
small model with ``layers`` (sharded with FSDP2, unless the block shards it itself), a loader,
a loss, a checkpoint folder. A block that joins the process group itself gets none.
Usage: ``torchrun --standalone --nproc_per_node 2 tests/_doc_runner.py OUT_DIR FILE...``
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fused_optim_dist import OptimizerInBackward

DIM = 16

# Blocks run by other tests end to end rather than verbatim: the Trainer and accelerate
# snippets need a Hugging Face model, arguments and data, the Lightning and Fabric ones a data
# loader and a single-process fit (tests/test_trainer.py, tests/test_accelerate.py,
# tests/test_lightning.py and tests/test_fabric.py run those loops).
NOT_VERBATIM = (
    "in_backward_trainer(Trainer)",
    "Accelerator(gradient_accumulation_steps",
    "callbacks=[InBackward()]",
    "InBackwardFabric(accelerator",
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build_model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _namespace(block: str, tmp: Path) -> dict[str, Any]:
    model = build_model()
    if "fully_shard(" not in block and "replicate(" not in block:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    batches = [torch.randn(4, DIM, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return {
        "torch": torch,
        "nn": nn,
        "dist": dist,
        "fully_shard": fully_shard,
        "OptimizerInBackward": OptimizerInBackward,
        "build_model": build_model,
        "model": model,
        "loader": batches,
        "micro_batches": batches[:2],
        "micro_batch_loader": [batches[:2], batches[2:]],
        "loss_fn": lambda out: out.float().square().mean(),
        "optim": OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)
        if "optim =" not in block
        else None,
        "path": str(tmp / "dcp"),
        "ckpt_dir": tmp / "checkpoints",
        "out_dir": tmp,
        "schedule": lambda step: 1.0,
        "total_steps": 4,
        "save_every": 2,
        "get_batch": lambda step: batches[step % len(batches)],
    }


def main() -> int:
    out, files = Path(sys.argv[1]), sys.argv[2:]
    failures, ran = [], 0
    for file in files:
        text = Path(file).read_text()
        for index, match in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            block = match.group(1)
            if any(marker in block for marker in NOT_VERBATIM):
                continue
            line = text[: match.start()].count("\n") + 2
            joins = "init_process_group(" in block
            if joins and dist.is_initialized():
                dist.destroy_process_group()
            if not joins and not dist.is_initialized():
                dist.init_process_group("gloo")
            # The same folder on every rank (they share this machine).
            folder = out / f"{Path(file).stem}_{index}"
            folder.mkdir(parents=True, exist_ok=True)
            namespace = _namespace(block, folder)
            try:
                exec(compile(block, f"{file}:{line}", "exec"), namespace)
                ran += 1
            except Exception:
                failures.append(f"{file}:{line}\n{traceback.format_exc()}")
            if dist.is_initialized():
                dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"result_{rank}.txt").write_text(f"ran {ran}\n" + "\n".join(failures))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    status = main()
    # What the blocks built (FSDP2 modules holding their process groups) would otherwise be torn
    # down during interpreter finalization: see [Note: a rank ends without interpreter
    # finalization] in fused_optim_dist_recipes/launch.py.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
