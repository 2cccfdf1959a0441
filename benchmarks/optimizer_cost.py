"""The optimizer's own cost per step: plain vs in-backward vs per-parameter AdamW on FSDP2.

Run from the repository root::

    python benchmarks/optimizer_cost.py                       # 2 CPU ranks, every shape
    python benchmarks/optimizer_cost.py --shapes many-tiny --repeats 1 --out /tmp/cost

Every rank builds each method on the same weights (``none``: forward and backward only), then
runs steps with the methods interleaved (the order rotated every step) on the same batches. A
method's cost at a step is the CPU time of its backward and of what the loop does after it,
minus that of ``none`` at the same step, averaged over the ranks: the time the optimizer adds,
wherever it runs. Reported: the median over the steps, its interquartile range, and the ratios
of the medians, for each of ``--repeats`` rounds of ``--steps`` steps, and how far the rounds'
ratios spread around their median.

[Note: measuring a few milliseconds in a step of tens]
On this benchmark's machines a step's CPU time varies by several percent from one step to the
next, with nothing changed, and the optimizer's cost is a few percent of the step. So:

* The clock is the main thread's CPU time (``time.thread_time``). On the CPU the autograd engine
  runs backward on the calling thread, and FSDP2's hooks, the in-backward step and the plain
  step all run there; gloo's threads, whose polling varies with the other rank's timing, do not
  count.
* The forward is left out (no method runs anything in it), which halves the noise.
* The garbage collector is frozen after set-up and runs between the timed parts only.
* ``per-param``, ~30 times the others' cost and needed only to clear a 5x ratio, runs every
  ``PER_PARAM_EVERY`` steps, so that the others get more steps in the same time.

Then rank 0 profiles a few steps of ``ours`` (``torch.profiler``, the library's
``fused_optim_dist::`` ranges), times its hooks and its ``step()``/``zero_grad()`` apart, and
times two floors over tensors shaped like this rank's local shards: ``AdamW(fused=True).step()``
and the fused kernel alone. Results: ``optimizer_cost.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
from fused_optim_dist import OptimizerInBackward
from fused_optim_dist_recipes.launch import spawn

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
EVERY_STEP = ("none", "plain", "ours", "ours-update-only")
"""Methods timed at every step; ``none`` is the baseline."""
PER_PARAM = "per-param"
PER_PARAM_EVERY = 4
METHODS = (*EVERY_STEP, PER_PARAM)
COMPARED = METHODS[1:]
MS_PER_S = 1e3
STEPS = {"many-tiny": 300, "many-small": 80, "few-large": 40, "llama-12x256": 24}
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
RATIOS = {
    "ours_over_plain": ("ours", "plain"),
    "update_only_over_plain": ("ours-update-only", "plain"),
    "per_param_over_ours": ("per-param", "ours"),
}
"""Ratios of median costs reported per round: name -> (numerator, denominator)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostConfig:
    shapes: tuple[str, ...]
    repeats: int
    steps: int | None
    """Timed steps per round; ``None``: ``STEPS`` of the shape."""
    warmup_steps: int = 3


def _step_cpu(runner: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """This thread's CPU seconds in backward and the loop's optimizer calls. See [Note:
    measuring a few milliseconds in a step of tens]."""
    loss = runner.loss(runner.model, inputs, targets)
    gc.collect()
    dist.barrier()
    start = time.thread_time()
    loss.backward()
    runner.optimizer_step()
    return time.thread_time() - start


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Freeze what set-up allocated (so each collection is short) and collect only when
    ``_step_cpu`` asks."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def _profile_ours(runner: Any, batch: Callable, first: int) -> dict[str, float]:
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


def _timed(accumulated: dict[str, float], name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            accumulated[name] += time.thread_time() - start

    return wrapper


def _breakdown_ours(runner: Any, batch: Callable, first: int) -> dict[str, float]:
    """Thread CPU ms per step in ``ours``' hooks (every in-backward step included) and in its
    ``step()`` and ``zero_grad()``, timed through wrappers on this object only."""
    optim: OptimizerInBackward = runner.optimizer
    spent = dict.fromkeys(("hooks", "step", "zero_grad"), 0.0)
    optim._on_grad_ready = _timed(spent, "hooks", optim._on_grad_ready)
    optim.step = _timed(spent, "step", optim.step)
    optim.zero_grad = _timed(spent, "zero_grad", optim.zero_grad)
    try:
        for step in range(first, first + PROFILED_STEPS):
            runner.forward_backward(*batch(step))
            runner.optimizer_step()
    finally:
        for name in ("_on_grad_ready", "step", "zero_grad"):
            del optim.__dict__[name]
    return {name: value / PROFILED_STEPS * MS_PER_S for name, value in spent.items()}


def _median_ms(fn: Callable[[], None], repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * MS_PER_S


def _floors_ms(runner: Any) -> dict[str, float]:
    """Median CPU ms of AdamW over tensors shaped like this rank's local shards (state already
    created): ``AdamW(fused=True).step()`` in one call, and its fused kernel alone (no
    per-tensor Python at all)."""
    shards = [
        torch.randn_like(p.to_local() if isinstance(p, DTensor) else p)
        for p in runner.model.parameters()
    ]
    for shard in shards:
        shard.grad = torch.randn_like(shard)
    optim = torch.optim.AdamW(shards, lr=1e-4, fused=True)
    optim.step()
    state = [optim.state[shard] for shard in shards]
    lists = (
        shards,
        [shard.grad for shard in shards],
        [s["exp_avg"] for s in state],
        [s["exp_avg_sq"] for s in state],
        [],
        [s["step"] for s in state],
    )

    def kernel() -> None:
        torch._fused_adamw_(
            *lists,
            amsgrad=False,
            lr=1e-4,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
            maximize=False,
        )

    return {"adamw_fused_step": _median_ms(optim.step), "fused_kernel": _median_ms(kernel)}


def _round(
    runners: dict[str, Any], batch: Callable, first: int, steps: int
) -> dict[str, list[float | None]]:
    """CPU seconds per step of each method (``None`` where ``per-param`` did not run)."""
    cpu: dict[str, list[float | None]] = {name: [] for name in METHODS}
    for index in range(steps):
        inputs, targets = batch(first + index)
        shift = index % len(EVERY_STEP)
        order = list(EVERY_STEP[shift:] + EVERY_STEP[:shift])
        if index % PER_PARAM_EVERY == 0:
            order.insert(index // PER_PARAM_EVERY % (len(order) + 1), PER_PARAM)
        else:
            cpu[PER_PARAM].append(None)
        for name in order:
            cpu[name].append(_step_cpu(runners[name], inputs, targets))
    return cpu


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
        with _collector_paused():
            for _ in range(config.repeats):
                cpu = _round(runners, batch, first, steps)
                first += steps
                gathered: list[Any] = [None] * world_size
                dist.all_gather_object(gathered, cpu)
                rounds.append(_summarise(gathered, steps))
        ours = runners["ours"]
        profiled = _profile_ours(ours, batch, first)
        breakdown = _breakdown_ours(ours, batch, first + PROFILED_STEPS)
        floors = _floors_ms(ours)
        n_tensors = sum(1 for p in ours.model.parameters())
        runners.clear()
        records.append(
            {
                "shape": shape_name,
                "world_size": world_size,
                "n_tensors": n_tensors,
                "steps_per_round": steps,
                "per_param_every": PER_PARAM_EVERY,
                "rounds": rounds,
                "spread": _spread(rounds),
                "profile_ms_per_step_rank0": profiled,
                "breakdown_ms_per_step_rank0": breakdown,
                "floors_ms_rank0": floors,
            }
        )
    return records


def _summarise(gathered: list[dict[str, list[float | None]]], steps: int) -> dict[str, Any]:
    """Per method: the optimizer's cost at each step it ran (CPU ms over ``none``, mean over
    ranks), its median and quartiles; the ratios of the medians."""

    def mean_over_ranks(name: str, step: int) -> float | None:
        values = [rank[name][step] for rank in gathered]
        if None in values:
            return None
        return statistics.fmean(values) * MS_PER_S

    baseline = [mean_over_ranks("none", i) for i in range(steps)]
    out: dict[str, Any] = {"none_step_cpu_ms": statistics.median(baseline)}
    for name in COMPARED:
        costs = []
        for step in range(steps):
            value = mean_over_ranks(name, step)
            if value is not None:
                costs.append(value - baseline[step])
        q1, median, q3 = _quartiles(costs)
        out[name] = {"cost_ms_median": median, "cost_ms_q1": q1, "cost_ms_q3": q3}
    for ratio, (numerator, denominator) in RATIOS.items():
        out[ratio] = out[numerator]["cost_ms_median"] / out[denominator]["cost_ms_median"]
    return out


def _spread(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each ratio's median over the rounds and its half-range relative to that median."""
    spread = {}
    for ratio in RATIOS:
        values = [r[ratio] for r in rounds]
        median = statistics.median(values)
        spread[ratio] = {
            "median": median,
            "half_range_pct": (max(values) - min(values)) / 2 / abs(median) * 100,
        }
    return spread


def markdown(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    lines = [
        "# Optimizer cost per step (CPU time over a backward with no optimizer)",
        "",
        f"{payload['world_size']} ranks, {machine.get('cpu', '')}, torch {torch.__version__}, "
        f"load average (1 min) {payload['load_before']} before, {payload['load_after']} after. "
        "Cost: median over interleaved steps of a method's main-thread CPU time in backward and "
        "after it, minus `none`'s at the same step, mean over ranks; [q1, q3] its "
        f"interquartile range. `per-param` runs every {PER_PARAM_EVERY} steps. "
        "`ours-update-only`: `track_grad_norm=False`, the same work as `plain`; `ours`: the "
        "defaults, which also compute the total gradient norm.",
        "",
        "| shape | tensors | round | steps | plain ms [q1, q3] | ours ms [q1, q3] "
        "| ours-update-only ms [q1, q3] | per-param ms [q1, q3] | ours / plain "
        "| update-only / plain | per-param / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in payload["records"]:
        for index, r in enumerate(record["rounds"], 1):
            cells = [
                f"{r[n]['cost_ms_median']:.2f} [{r[n]['cost_ms_q1']:.2f}, {r[n]['cost_ms_q3']:.2f}]"
                for n in COMPARED
            ]
            lines.append(
                f"| {record['shape']} | {record['n_tensors']} | {index} "
                f"| {record['steps_per_round']} | {' | '.join(cells)} "
                f"| {r['ours_over_plain']:.3f} | {r['update_only_over_plain']:.3f} "
                f"| {r['per_param_over_ours']:.1f} |"
            )
    lines += [
        "",
        "Spread of the ratios over the rounds: median, and half the range relative to it.",
        "",
        "| shape | " + " | ".join(RATIOS) + " |",
        "|---|" + "---|" * len(RATIOS),
    ]
    for record in payload["records"]:
        cells = [
            f"{v['median']:.3f} ± {v['half_range_pct']:.0f}%" for v in record["spread"].values()
        ]
        lines.append(f"| {record['shape']} | {' | '.join(cells)} |")
    lines += [
        "",
        "Rank 0, `ours`, CPU ms per step. `torch.profiler` ranges (nested: `step_bucket` holds "
        "`gradients`, `derive_local_views`, `update`; `update` holds the fused kernel); the "
        "main thread's time in the optimizer's hooks (every in-backward step included) and in "
        "`step()` + `zero_grad()`; and two floors over tensors shaped like rank 0's local "
        "shards: `AdamW(fused=True).step()` in one call, and its fused kernel alone.",
        "",
        "| shape | "
        + " | ".join(RANGES)
        + " | hooks | step + zero_grad | AdamW fused step | fused kernel |",
        "|---|" + "---|" * (len(RANGES) + 4),
    ]
    for record in payload["records"]:
        prof = record["profile_ms_per_step_rank0"]
        spent = record["breakdown_ms_per_step_rank0"]
        floors = record["floors_ms_rank0"]
        lines.append(
            f"| {record['shape']} | "
            + " | ".join(f"{prof[name]:.2f}" for name in RANGES)
            + f" | {spent['hooks']:.2f} | {spent['step'] + spent['zero_grad']:.2f}"
            + f" | {floors['adamw_fused_step']:.2f} | {floors['fused_kernel']:.2f} |"
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
    if args.steps is not None and args.steps < 2 * PER_PARAM_EVERY:
        parser.error(
            f"--steps must be at least {2 * PER_PARAM_EVERY} (per-param runs every "
            f"{PER_PARAM_EVERY} steps and needs two)"
        )
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
