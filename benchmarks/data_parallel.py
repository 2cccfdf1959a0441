"""Data parallel memory: DDP keeps every gradient, ``replicate`` with in-backward AdamW none.

Run from the repository root::

    python benchmarks/data_parallel.py                         # 2 CPU ranks, llama-12x256
    python benchmarks/data_parallel.py --ranks 3 --shape few-large --out /tmp/dp

Every method trains the same weights on the same batches with AdamW, the model whole on every
rank (no sharding):

* ``ddp``: ``DistributedDataParallel`` (``gradient_as_bucket_view=True``: the gradients are
  views of its all-reduce buckets, no second copy) and ``torch.optim.AdamW`` after backward.
* ``replicate``: ``replicate`` from ``torch.distributed._composable.replicate_with_fsdp``
  (FSDP2's data-parallel twin: one unit per block and the root, all-reduce instead of
  reduce-scatter) and ``torch.optim.AdamW`` after backward.
* ``replicate+ours``: the same with ``fused_optim_dist.OptimizerInBackward(AdamW,
  fused=True)``: each unit is stepped as soon as its all-reduce is done, and its gradients
  freed.

Per method and rank, after one warm-up step (which creates the optimizer state): the bytes of
gradients still held when backward returns (counted tensor by tensor: what ``step()`` will
read), and the process's peak resident memory during one step (``VmHWM`` reset through
``/proc/self/clear_refs``; with glibc's mmap threshold lowered, every large buffer is returned
when freed, so the peak is not hidden by reuse), above what the rank held before the model was
built (the method's whole footprint: parameters, state, gradients, the framework's buffers,
activations) and above what it held when the step began (what the step allocates; buffers a
method keeps between steps, like DDP's buckets, are not in it). Linux only.
Results: ``data_parallel.json`` and ``data_parallel.md`` in ``--out`` (default
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from benchmarks._shapes import SHAPES, Shape, get_shape
from fused_optim_dist import OptimizerInBackward, is_freed
from fused_optim_dist_recipes.launch import spawn

METHODS = ("ddp", "replicate", "replicate+ours")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
KIB = 1024
MIB = KIB * KIB
MMAP_THRESHOLD = 64 * KIB
"""glibc maps every buffer at least this large on its own, and unmaps it when freed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """What to run; built once from the command line and sent to every rank."""

    ranks: int = 2
    """Processes (gloo, CPU), each holding the whole model."""
    shape: str = "llama-12x256"
    """A key of ``benchmarks._shapes.SHAPES``; its activation checkpointing is applied per
    block (non-reentrant), as the scaling benchmark does."""
    quick: bool = False
    """The reduced shape of the same structure (a smoke run)."""
    lr: float = 1e-4
    """AdamW learning rate of every method."""
    seed: int = 0
    """Seed of the weights and batches: every method gets the same ones."""


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def _wrap(model: nn.Module, method: str, shape: Shape) -> nn.Module:
    if shape.checkpointing:
        # As fused_optim_dist_recipes.models.apply_fsdp does it, before wrapping: without it
        # the activations of the forward set every method's peak.
        for layer in model.layers:
            checkpoint(layer)
    if method == "ddp":
        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    for layer in model.layers:
        replicate(layer)
    replicate(model)
    return model


def _optimizer(model: nn.Module, method: str, lr: float) -> torch.optim.Optimizer:
    if method == "replicate+ours":
        return OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=lr, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def _step(
    model: nn.Module, optim: torch.optim.Optimizer, shape: Shape, config: Config, index: int
) -> int:
    """One training step on this rank's share of step ``index``'s global batch; the bytes of
    gradients held when backward returned (freed ones hold none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    inputs, targets = shape.make_batch(generator, shape.batch_size * world)
    rows = slice(rank * shape.batch_size, (rank + 1) * shape.batch_size)
    shape.loss(model, inputs[rows], targets[rows]).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None and not is_freed(p.grad)]
    held = sum(g.numel() * g.element_size() for g in grads)
    del grads
    optim.step()
    optim.zero_grad(set_to_none=True)
    return held


def _nbytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def measure(config: Config, method: str) -> dict[str, Any]:
    """One method on this rank: bytes of parameters, optimizer state, gradients held after
    backward, and the step's peak resident memory above the rank's before the model was built
    and above its own start. Collective."""
    shape = get_shape(config.shape, quick=config.quick)
    gc.collect()
    start = _status_kib("VmRSS")
    torch.manual_seed(config.seed)
    model = _wrap(shape.build(), method, shape)
    optim = _optimizer(model, method, config.lr)
    _step(model, optim, shape, config, 0)  # creates the optimizer state
    gc.collect()
    dist.barrier()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    held = _step(model, optim, shape, config, 1)
    peak = _status_kib("VmHWM")
    state = [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "method": method,
        "rank": dist.get_rank(),
        "param_bytes": _nbytes(list(model.parameters())),
        "state_bytes": _nbytes(state),
        "grad_bytes_after_backward": held,
        "step_peak_bytes": (peak - start) * KIB,
        "step_peak_growth_bytes": (peak - before) * KIB,
    }


def _world(config: Config) -> list[dict[str, Any]]:
    rows = []
    for method in METHODS:
        row = measure(config, method)
        gc.collect()  # the method's model and optimizer, before the next one's
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        rows += gathered
    return rows


def _markdown(config: Config, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Data parallel memory: {config.shape}{' (quick)' if config.quick else ''}, "
        f"{config.ranks} CPU ranks (gloo), AdamW",
        "",
        "Per rank, MiB. Gradients held after backward: what `step()` will read (DDP's are views "
        "of its buckets). Step peak: peak resident memory during one step above the rank's "
        "before the model was built (the whole footprint). Step growth: the same peak above "
        "the rank's at the start of the step (buffers kept between steps are not in it).",
        "",
        "| method | rank | parameters | optimizer state | gradients held after backward "
        "| step peak | step growth |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['rank']} | {row['param_bytes'] / MIB:.1f} "
            f"| {row['state_bytes'] / MIB:.1f} | {row['grad_bytes_after_backward'] / MIB:.1f} "
            f"| {row['step_peak_bytes'] / MIB:.1f} | {row['step_peak_growth_bytes'] / MIB:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(config: Config, out: Path) -> list[dict[str, Any]]:
    """Measure every method on ``config.ranks`` fresh processes; write JSON and Markdown."""
    # Read by glibc when each rank starts, so set before spawning.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    rows = spawn(config.ranks, _world, config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_parallel.json").write_text(
        json.dumps({"config": dataclasses.asdict(config), "rows": rows}, indent=2) + "\n"
    )
    (out / "data_parallel.md").write_text(_markdown(config, rows))
    return rows


def parse_config(argv: Sequence[str] | None = None) -> tuple[Config, Path]:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=defaults.ranks)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=defaults.shape)
    parser.add_argument("--quick", action="store_true", help="the reduced shape (smoke run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be positive, not {args.ranks}")
    return Config(ranks=args.ranks, shape=args.shape, quick=args.quick), args.out


def main(argv: Sequence[str] | None = None) -> None:
    config, out = parse_config(argv)
    print(f"config: {config}")
    rows = run(config, out)
    print(_markdown(config, rows))


if __name__ == "__main__":
    main()
