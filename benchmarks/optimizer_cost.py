"""The optimizer's own cost per step: plain vs in-backward vs per-parameter AdamW on FSDP2.

Run from the repository root::

    python benchmarks/optimizer_cost.py                       # 2 CPU ranks, every shape
    python benchmarks/optimizer_cost.py --shapes many-tiny --repeats 1 --out /tmp/cost

Every rank builds each method on the same weights (``none``: forward and backward only), then
runs steps with the methods interleaved (the order rotated every step) on the same batches. A
method's cost at a step is the CPU time of its whole step (forward, backward, what the loop does
after backward) minus that of ``none`` at the same step, averaged over the ranks: the time the
optimizer adds, wherever it runs, unaffected by waiting for the other rank or by other processes
taking the cores. Reported: the median over the steps, its interquartile range, and the ratios
of the medians, for each of ``--repeats`` rounds of ``--steps`` steps.

Then rank 0 profiles a few steps of ``ours`` (``torch.profiler``, the library's
``fused_optim_dist::`` ranges) and times the floor: ``AdamW(fused=True)`` in one call over
tensors shaped like this rank's local shards. Results: ``optimizer_cost.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from benchmarks._config import SweepConfig
from benchmarks._measure import build_runner, make_batches, per_rank_batch
from benchmarks._report import describe_machine
from benchmarks._shapes import SHAPES, get_shape
from fused_optim_dist_recipes.launch import spawn

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
METHODS = ("none", "plain", "ours", "per-param")
MS_PER_S = 1e3
STEPS = {"many-tiny": 60, "many-small": 40, "few-large": 20, "llama-12x256": 12}
"""Timed steps per round, by shape (fewer where a step is long)."""
PROFILED_STEPS = 5
RANGES = (
    "fused_optim_dist::step_bucket",
    "fused_optim_dist::gradients",
    "fused_optim_dist::derive_local_views",
    "fused_optim_dist::update",
    "aten::_fused_adamw_",
    "fused_optim_dist::end_of_backward",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostConfig:
    shapes: tuple[str, ...]
    repeats: int
    steps: int | None
    """Timed steps per round; ``None``: ``STEPS`` of the shape."""
    warmup_steps: int = 3


def _step_cpu(runner: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    dist.barrier()
    start = time.process_time()
    runner.forward_backward(inputs, targets)
    runner.optimizer_step()
    return time.process_time() - start


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def _profile_ours(runner: Any, batch: Any, first: int) -> dict[str, float]:
    """CPU ms per step of each range under ``torch.profiler`` (rank 0's view)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(first, first + PROFILED_STEPS):
            runner.forward_backward(*batch(step))
            runner.optimizer_step()
    totals = {name: 0.0 for name in RANGES}
    for event in prof.key_averages():
        if event.key in totals:
            totals[event.key] = event.cpu_time_total / 1e3 / PROFILED_STEPS
    return totals


def _floor_ms(runner: Any, repeats: int = 20) -> float:
    """Median CPU ms of one ``AdamW(fused=True)`` step over tensors shaped like this rank's
    local shards (state already created): the update with no per-tensor Python at all."""
    shards = [
        torch.randn_like(p.to_local() if isinstance(p, DTensor) else p)
        for p in runner.model.parameters()
    ]
    for shard in shards:
        shard.grad = torch.randn_like(shard)
    optim = torch.optim.AdamW(shards, lr=1e-4, fused=True)
    optim.step()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        optim.step()
        times.append(time.process_time() - start)
    return statistics.median(times) * MS_PER_S


def cost_world(config: CostConfig) -> list[dict[str, Any]]:
    """Measure every shape of ``config`` in this process group (collective)."""
    world_size = dist.get_world_size()
    sweep = SweepConfig(world_sizes=(world_size,), methods=METHODS, shapes=config.shapes)
    mesh = init_device_mesh("cpu", (world_size,))
    records = []
    for shape_name in config.shapes:
        shape = get_shape(shape_name, quick=False)
        batch = make_batches(shape, sweep, per_rank_batch(shape, "strong", world_size, sweep))
        runners = {name: build_runner(shape, sweep, mesh, name) for name in METHODS}
        for step in range(config.warmup_steps):
            for runner in runners.values():
                runner.forward_backward(*batch(step))
                runner.optimizer_step()
        steps = config.steps or STEPS.get(shape_name, 20)
        first = config.warmup_steps
        rounds = []
        for _ in range(config.repeats):
            cpu: dict[str, list[float]] = {name: [] for name in METHODS}
            for index in range(steps):
                inputs, targets = batch(first + index)
                shift = index % len(METHODS)
                for name in METHODS[shift:] + METHODS[:shift]:
                    cpu[name].append(_step_cpu(runners[name], inputs, targets))
            first += steps
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, cpu)
            rounds.append(_summarise(gathered, steps))
        profiled = _profile_ours(runners["ours"], batch, first)
        floor = _floor_ms(runners["ours"])
        n_tensors = sum(1 for p in runners["ours"].model.parameters())
        runners.clear()
        records.append(
            {
                "shape": shape_name,
                "world_size": world_size,
                "n_tensors": n_tensors,
                "steps_per_round": steps,
                "rounds": rounds,
                "profile_ms_per_step_rank0": profiled,
                "floor_fused_adamw_ms_rank0": floor,
            }
        )
    return records


def _summarise(gathered: list[dict[str, list[float]]], steps: int) -> dict[str, Any]:
    """Per method: the optimizer's cost at each step (CPU ms over ``none``, mean over ranks),
    its median and quartiles; the ratios of the medians."""

    def mean_over_ranks(name: str, step: int) -> float:
        return statistics.fmean(rank[name][step] for rank in gathered) * MS_PER_S

    out: dict[str, Any] = {
        "none_step_cpu_ms": statistics.median(mean_over_ranks("none", i) for i in range(steps))
    }
    for name in METHODS[1:]:
        costs = [mean_over_ranks(name, i) - mean_over_ranks("none", i) for i in range(steps)]
        q1, median, q3 = _quartiles(costs)
        out[name] = {"cost_ms_median": median, "cost_ms_q1": q1, "cost_ms_q3": q3}
    plain, ours, per_param = (out[n]["cost_ms_median"] for n in ("plain", "ours", "per-param"))
    out["ours_over_plain"] = ours / plain
    out["per_param_over_ours"] = per_param / ours
    return out


def markdown(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    lines = [
        "# Optimizer cost per step (CPU time over a forward+backward with no optimizer)",
        "",
        f"{payload['world_size']} ranks, {machine.get('cpu', '')}, torch {torch.__version__}, "
        f"load average (1 min) {payload['load_before']} before, {payload['load_after']} after. "
        "Cost: median over interleaved steps of a method's step CPU time minus `none`'s at the "
        "same step, mean over ranks; [q1, q3] its interquartile range.",
        "",
        "| shape | tensors | round | plain ms [q1, q3] | ours ms [q1, q3] | per-param ms [q1, q3] "
        "| ours / plain | per-param / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in payload["records"]:
        for index, r in enumerate(record["rounds"], 1):
            cells = [
                f"{r[n]['cost_ms_median']:.2f} [{r[n]['cost_ms_q1']:.2f}, {r[n]['cost_ms_q3']:.2f}]"
                for n in ("plain", "ours", "per-param")
            ]
            lines.append(
                f"| {record['shape']} | {record['n_tensors']} | {index} | {' | '.join(cells)} "
                f"| {r['ours_over_plain']:.3f} | {r['per_param_over_ours']:.1f} |"
            )
    lines += [
        "",
        "Rank 0, ours, `torch.profiler` CPU ms per step (ranges nest: `step_bucket` holds "
        "`gradients`, `derive_local_views`, `update`; `update` holds the fused kernel), and the "
        "floor: `AdamW(fused=True)`, one call over tensors shaped like rank 0's local shards.",
        "",
        "| shape | " + " | ".join(RANGES) + " | floor |",
        "|---|" + "---|" * (len(RANGES) + 1),
    ]
    for record in payload["records"]:
        prof = record["profile_ms_per_step_rank0"]
        lines.append(
            f"| {record['shape']} | "
            + " | ".join(f"{prof[name]:.2f}" for name in RANGES)
            + f" | {record['floor_fused_adamw_ms_rank0']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(STEPS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of timed steps")
    parser.add_argument("--steps", type=int, help="timed steps per round (default: by shape)")
    args = parser.parse_args(argv)
    config = CostConfig(shapes=tuple(args.shapes), repeats=args.repeats, steps=args.steps)
    load_before = round(os.getloadavg()[0], 2)
    records = spawn(args.world_size, cost_world, config)
    payload = {
        "machine": describe_machine(SweepConfig()),
        "world_size": args.world_size,
        "config": dataclasses.asdict(config),
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
        "records": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_cost.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(payload)
    (args.out / "optimizer_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
