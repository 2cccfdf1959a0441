"""Muon on FSDP2: plain ``torch.optim.Muon`` on the DTensors after backward vs ours in backward.

Both train the same model on the same batches in one run: a 256-wide residual MLP of 8 blocks
(16 matrices of 256 x 1024, each block one FSDP unit), Muon on the matrices and AdamW on the
norms and biases. Methods take turns step by step (the order rotated every step), so both see
the same machine noise; a third method, forward and backward with no optimizer, gives the cost
the optimizers add. The whole measurement is repeated ``--runs`` times in fresh processes::

    python benchmarks/muon.py                    # 2 CPU ranks, ~2 min on 2 cores
    python benchmarks/muon.py --runs 1 --steps 3 --out /tmp/muon

Writes ``muon.{json,md}`` to ``--out`` (default ``benchmarks/results``). Reported per method:
the median step time (forward + backward + what runs after it), the optimizer's own time (that
minus the no-optimizer step), and this rank's peak memory in one step as PyTorch's
``FSDPMemTracker`` sees it; medians over runs of each run's median, with the range over runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the ``benchmarks`` package importable (here and in the ranks).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from benchmarks._memory import StepTracker
from fused_optim_dist import OptimizerInBackward
from fused_optim_dist_recipes.launch import spawn
from fused_optim_dist_recipes.metrics import describe_machine, machine_summary

WIDTH, HIDDEN, BLOCKS = 256, 1024, 8
METHODS = ("no optimizer", "plain Muon (DTensor, after backward)", "ours (in backward)")
PLAIN, OURS = METHODS[1], METHODS[2]
MS = 1e3
MIB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    world_size: int = 2
    """CPU ranks (gloo)."""
    runs: int = 3
    """Fresh sets of processes, each timing every method."""
    steps: int = 8
    """Timed steps per method and run, after two warm-up steps."""
    tokens: int = 256
    """Rows of the per-rank batch."""
    out: Path = Path(__file__).resolve().parent / "results"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _optimizers(model: nn.Module, method: str) -> list[torch.optim.Optimizer]:
    if method == METHODS[0]:
        return []
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    wrap = OptimizerInBackward if method == OURS else None

    def build(cls: type[torch.optim.Optimizer], params, **kwargs) -> torch.optim.Optimizer:
        return wrap(params, cls, **kwargs) if wrap else cls(params, **kwargs)

    return [
        build(torch.optim.Muon, matrices, lr=2e-2, weight_decay=0.1),
        build(torch.optim.AdamW, rest, lr=1e-3, weight_decay=0.1),
    ]


def _batch(step: int, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
    return (
        torch.randn(config.tokens, WIDTH, generator=g),
        torch.randn(config.tokens, WIDTH, generator=g),
    )


def _step(model, optims, batch) -> tuple[float, float]:
    """One training step: (forward + backward, what the loop runs after it), in seconds."""
    start = time.perf_counter()
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    backward_done = time.perf_counter()
    for optim in optims:
        optim.step()
    for optim in optims:
        optim.zero_grad()
    if not optims:
        model.zero_grad()
    return backward_done - start, time.perf_counter() - backward_done


def _peak_bytes(model, optims, batch) -> tuple[int, int]:
    """This rank's peak in one step, and the temporaries at that peak."""
    state = [v for o in optims for s in o.state.values() for v in s.values()]
    tensors = [t for t in state if isinstance(t, torch.Tensor)]
    tracker = StepTracker(model, tensors, "cpu")
    with tracker:
        tracker.track_inputs(batch)
        nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
        with tracker.after_backward():
            for optim in optims:
                optim.step()
            for optim in optims:
                optim.zero_grad()
    peak, by_kind, _ = tracker.peak()
    return peak, by_kind["temporaries"]


def _run(config: Config) -> dict[str, dict]:
    """One run on every rank: each method's median times and its peak memory (rank 0's)."""
    setups = {method: (model := _model(), _optimizers(model, method)) for method in METHODS}
    for step in range(2):  # warm-up: state created, kernels loaded
        for model, optims in setups.values():
            _step(model, optims, _batch(step, config))
    result: dict[str, dict] = {}
    for method, (model, optims) in setups.items():
        gc.collect()
        peak, temporaries = _peak_bytes(model, optims, _batch(2, config))
        result[method] = {"peak_mib": peak / MIB, "temporaries_at_peak_mib": temporaries / MIB}
    times: dict[str, list[tuple[float, float]]] = {method: [] for method in METHODS}
    for index in range(config.steps):
        shift = index % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            model, optims = setups[method]
            dist.barrier()
            times[method].append(_step(model, optims, _batch(3 + index, config)))
    for method, samples in times.items():
        result[method]["step_ms"] = statistics.median(a + b for a, b in samples) * MS
        result[method]["after_backward_ms"] = statistics.median(b for _, b in samples) * MS
    base = result[METHODS[0]]["step_ms"]
    for method in METHODS[1:]:
        result[method]["optimizer_ms"] = result[method]["step_ms"] - base
    return result


def _summary(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Per method and quantity: median over runs and the range."""
    out: dict[str, dict] = {}
    for method in METHODS:
        out[method] = {}
        for key in runs[0][method]:
            values = [run[method][key] for run in runs]
            out[method][key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    ratios = [run[PLAIN]["step_ms"] / run[OURS]["step_ms"] for run in runs]
    opt_ratios = [run[PLAIN]["optimizer_ms"] / run[OURS]["optimizer_ms"] for run in runs]
    out["speedup"] = {
        "whole_step": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "optimizer": {
            "median": statistics.median(opt_ratios),
            "min": min(opt_ratios),
            "max": max(opt_ratios),
        },
    }
    return out


def _markdown(summary: dict, config: Config, machine: dict) -> str:
    def cell(entry: dict, digits: int = 0) -> str:
        return f"{entry['median']:.{digits}f} ({entry['min']:.{digits}f}-{entry['max']:.{digits}f})"

    lines = [
        f"# Muon on FSDP2, {config.world_size} CPU ranks: {machine_summary(machine)}",
        "",
        f"{BLOCKS} blocks, width {WIDTH}, hidden {HIDDEN} ({2 * BLOCKS} Muon matrices), "
        f"{config.tokens} rows per rank; {config.runs} runs x {config.steps} timed steps. "
        "Median over runs (range over runs). Peak: rank 0, one step, FSDPMemTracker.",
        "",
        "| method | step ms | optimizer ms | after backward ms | peak MiB | temporaries at peak MiB"
        " |",
        "|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        row = summary[method]
        optimizer = cell(row["optimizer_ms"]) if "optimizer_ms" in row else "-"
        lines.append(
            f"| {method} | {cell(row['step_ms'])} | {optimizer} | "
            f"{cell(row['after_backward_ms'])} | {cell(row['peak_mib'], 1)} | "
            f"{cell(row['temporaries_at_peak_mib'], 1)} |"
        )
    speedup = summary["speedup"]
    lines += [
        "",
        f"Whole step, plain / ours: **{cell(speedup['whole_step'], 2)}x**; "
        f"optimizer time, plain / ours: {cell(speedup['optimizer'], 2)}x.",
        f"Load average at start: {machine['load_average_1min_at_start']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    parser.add_argument("--runs", type=int, default=defaults.runs)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--out", type=Path, default=defaults.out)
    args = parser.parse_args(argv)
    config = Config(runs=args.runs, steps=args.steps, out=args.out)
    machine = describe_machine("cpu")
    runs = [spawn(config.world_size, _run, config) for _ in range(config.runs)]
    summary = _summary(runs)
    config.out.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {**dataclasses.asdict(config), "out": str(config.out)},
        "machine": machine,
        "runs": runs,
        "summary": summary,
    }
    (config.out / "muon.json").write_text(json.dumps(record, indent=2) + "\n")
    markdown = _markdown(summary, config, machine)
    (config.out / "muon.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
