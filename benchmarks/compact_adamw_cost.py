"""Cost of a CompactAdamW update against fused fp32 AdamW, on the optimizer-cost shards.

For each shape of ``benchmarks/optimizer_cost.py`` (``benchmarks/_shapes.py``), the tensors are
shaped like rank 0's local shards on ``--world`` ranks (FSDP2's dim-0 chunks), grouped by FSDP
unit (each block one unit, the rest the root's) as the in-backward step sees them: one update
call per unit. A step updates every unit; its cost is the main thread's CPU time:

* ``adamw-fused``: ``torch._fused_adamw_`` per unit on float32 weights and moments, the call
  ``OptimizerInBackward`` makes for AdamW (``[Note: the update without the class's
  per-parameter loop]``): the baseline of the ratios;
* ``adamw-fused-step``: ``torch.optim.AdamW(fused=True).step()`` per unit, the same kernel
  behind the class's walk over its parameters in Python: what fused AdamW costs used alone,
  the baseline of a second set of ratios (``step_ratio``), for CompactAdamW used alone;
* ``compact-c``: ``CompactAdamW(kernel="c").step()`` per unit on bfloat16 weights and
  gradients: the C kernel (``fused_optim_dist/csrc/compact_adamw.c``), what ``kernel="auto"``
  takes on the CPU;
* ``compact-c-4bit``: the same with ``variance_bits=4`` (packed 4-bit second-moment codes);
* ``compact-triton``, ``compact-triton-4bit``: the same with ``kernel="triton"``, one Triton
  kernel per unit (``fused_optim_dist/_compact_triton.py``), what ``kernel="auto"`` takes on
  CUDA (``--device cuda`` only);
* ``compact-compile``: ``CompactAdamW(kernel="compile").step()``, the eager path's update
  compiled by ``torch.compile`` (Inductor's C++ on the CPU; compiled before the rounds);
* ``compact-eager``: ``CompactAdamW(kernel="eager").step()``, the fallback in whole-tensor
  PyTorch ops (no compiler).

Every timed call starts with cold caches, as a unit's step does in training (a backward pass
runs between two steps of a unit): a 64 MiB buffer, twice the L3 cache of the machine measured,
is written before it, untimed. Without it the fused baseline found its state in the cache more
or less often depending on which methods ran just before it, and the ratios moved by 10-20%.
All run interleaved, ``--steps`` steps per round, ``--rounds`` rounds; reported: each round's
median ms, the ratio of each compact method's median to fused AdamW's, and the ratios' spread
over the rounds. Then the share of the C path's time inside its kernel, and a profile of the
eager path (``torch.profiler``, self CPU time by op), say where the time goes. Single
process, one thread::

    python benchmarks/compact_adamw_cost.py                          # ~2-3 min
    python benchmarks/compact_adamw_cost.py --shapes many-tiny --rounds 1 --out /tmp/cost

With ``--device cuda`` the tensors are on the GPU and the methods are those that run there
(``compact-triton``, ``compact-compile``, Inductor's Triton, and ``compact-eager``; the C
kernel is the CPU's); a
call's cost is its wall time between two ``torch.cuda.synchronize()`` (host work and kernels
both, as a step in backward costs them), and the buffer written before each call is twice
the GPU's L2 cache; the results go to ``compact_adamw_cost_cuda.{md,json}``. Add a shape of GPU
size::

    python benchmarks/compact_adamw_cost.py --device cuda --shapes few-large llama-12x256 llama-1b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks._shapes import SHAPES
from fused_optim_dist import _compact_kernel
from fused_optim_dist.compact_adamw import CompactAdamW
from fused_optim_dist_recipes.metrics import describe_machine, machine_summary

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHAPES = ("many-tiny", "many-small", "few-large", "llama-12x256")
MS_PER_S = 1e3
KWARGS = dict(lr=1e-4, weight_decay=0.01)
VARIANTS = {
    "compact-c": dict(kernel="c"),
    "compact-c-4bit": dict(kernel="c", variance_bits=4),
    "compact-triton": dict(kernel="triton"),
    "compact-triton-4bit": dict(kernel="triton", variance_bits=4),
    "compact-compile": dict(kernel="compile"),
    "compact-eager": dict(kernel="eager"),
}
"""CompactAdamW's methods, by their constructor arguments."""
ONLY_ON = {
    "compact-c": "cpu",
    "compact-c-4bit": "cpu",
    "compact-triton": "cuda",
    "compact-triton-4bit": "cuda",
}
"""The kernels' methods: the C kernel runs on the CPU, the Triton kernel on CUDA."""
COLD_CACHE_BYTES = 64 << 20
"""Written before each timed call on the CPU: twice the L3 cache of the machine measured."""
BASELINE = "adamw-fused"
RATIOS = {"ratio": BASELINE, "step_ratio": "adamw-fused-step"}
"""Ratios of each compact method's median to a baseline's: key -> baseline."""
COMPACT = tuple(VARIANTS)


def compact_methods(device: str) -> tuple[str, ...]:
    """The compact methods measured on ``device``."""
    return tuple(m for m in COMPACT if ONLY_ON.get(m, device) == device)


def _units(model: nn.Module) -> list[list[nn.Parameter]]:
    """Parameters by FSDP unit: each of ``model.layers``, then the rest (the root's)."""
    blocks = [list(layer.parameters()) for layer in model.layers]
    inside = {id(p) for block in blocks for p in block}
    root = [p for p in model.parameters() if id(p) not in inside]
    return [*blocks, root] if root else blocks


def _shard(param: torch.Tensor, world: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tensor shaped like rank 0's FSDP2 shard of ``param``, random, with a gradient."""
    shape = torch.empty(param.shape, device="meta").chunk(world)[0].shape
    shard = torch.randn(shape, device=device).to(dtype)
    shard.grad = torch.randn(shape, device=device).to(dtype)
    return shard


def _fused_adamw(units: list[list[torch.Tensor]]) -> Callable[[], None]:
    lists = []
    for shards in units:
        optim = torch.optim.AdamW(shards, fused=True, **KWARGS)
        optim.step()  # creates the state
        state = [optim.state[s] for s in shards]
        lists.append(
            (
                shards,
                [s.grad for s in shards],
                [e["exp_avg"] for e in state],
                [e["exp_avg_sq"] for e in state],
                [],
                [e["step"] for e in state],
            )
        )

    def step() -> None:
        for tensors in lists:
            torch._fused_adamw_(
                *tensors,
                amsgrad=False,
                lr=KWARGS["lr"],
                beta1=0.9,
                beta2=0.999,
                weight_decay=KWARGS["weight_decay"],
                eps=1e-8,
                maximize=False,
            )

    return step


def _stepped(
    cls: type[torch.optim.Optimizer], units: list[list[torch.Tensor]], **options: Any
) -> Callable[[], None]:
    """``cls(...).step()`` on each unit."""
    optims = [cls(shards, **options, **KWARGS) for shards in units]
    for _ in range(2):  # state created, tables built, graphs compiled
        for optim in optims:
            optim.step()
    # The step without Optimizer's profiling and hook wrapper (OptimizerInBackward runs a class's
    # step so), for both classes alike.
    unwrapped = cls.step.__wrapped__

    def step() -> None:
        for optim in optims:
            unwrapped(optim)

    return step


def _cpu_ms(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * MS_PER_S


def _cuda_ms(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * MS_PER_S


def _evicting_buffer(device: str) -> torch.Tensor:
    """What is written before each timed call: twice the last-level cache."""
    size = COLD_CACHE_BYTES
    if device == "cuda":
        size = 2 * torch.cuda.get_device_properties(device).L2_cache_size
    return torch.zeros(size // 4, device=device)


def _kernel_share(step: Callable[[], None], steps: int = 5) -> float:
    """The share of ``step``'s CPU time spent inside the C kernel (the rest is Python: the
    batches, the tables' checks, the gradients' pointers)."""
    kernel = _compact_kernel.kernel()
    inside = 0.0

    def timed(*args: Any) -> None:
        nonlocal inside
        start = time.thread_time()
        kernel(*args)
        inside += time.thread_time() - start

    _compact_kernel._loaded = timed
    try:
        total = sum(_cpu_ms(step) for _ in range(steps)) / MS_PER_S
    finally:
        _compact_kernel._loaded = kernel
    return inside / total


def _measure(name: str, world: int, steps: int, rounds: int, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = SHAPES[name].build()
    units = _units(model)
    compact = compact_methods(device)

    def shards(dtype: torch.dtype) -> list[list[torch.Tensor]]:
        return [[_shard(p, world, dtype, device) for p in u] for u in units]

    methods = {
        "adamw-fused": _fused_adamw(shards(torch.float32)),
        "adamw-fused-step": _stepped(torch.optim.AdamW, shards(torch.float32), fused=True),
        **{
            method: _stepped(CompactAdamW, shards(torch.bfloat16), **VARIANTS[method])
            for method in compact
        },
    }
    timed = _cpu_ms if device == "cpu" else _cuda_ms
    out: dict[str, Any] = {
        "methods": compact,
        "tensors": sum(len(u) for u in units),
        "local_elements": sum(
            torch.empty(p.shape, device="meta").chunk(world)[0].numel() for u in units for p in u
        ),
        "rounds": [],
    }
    evicting = _evicting_buffer(device)
    for _ in range(rounds):
        times: dict[str, list[float]] = {m: [] for m in methods}
        for index in range(steps):
            order = list(methods)[index % len(methods) :] + list(methods)[: index % len(methods)]
            for method in order:
                evicting.add_(1.0)
                times[method].append(timed(methods[method]))
        medians = {m: statistics.median(t) for m, t in times.items()}
        quartiles = {m: statistics.quantiles(t, n=4) for m, t in times.items()}
        out["rounds"].append(
            {
                "median_ms": medians,
                "iqr_ms": {m: [q[0], q[2]] for m, q in quartiles.items()},
                **{
                    key: {m: medians[m] / medians[baseline] for m in compact}
                    for key, baseline in RATIOS.items()
                },
            }
        )
    for key in RATIOS:
        out[f"{key}_median"], out[f"{key}_range"] = {}, {}
        for method in compact:
            ratios = [r[key][method] for r in out["rounds"]]
            out[f"{key}_median"][method] = statistics.median(ratios)
            out[f"{key}_range"][method] = [min(ratios), max(ratios)]
    if device != "cpu":  # the CPU breakdowns below would say nothing of a GPU's time
        return out
    # The C path's steady state runs no torch op (its tables are reused, its pointers written
    # in Python): its breakdown is the kernel's share; the eager path's is its op profile.
    out["kernel_share"] = _kernel_share(methods["compact-c"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            methods["compact-eager"]()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    out["profile_top"] = [
        {"op": e.key, "share": e.self_cpu_time_total / total, "calls_per_step": e.count / 5}
        for e in events[:12]
    ]
    return out


def markdown(results: dict[str, Any], args: argparse.Namespace, machine: str) -> str:
    compact = next(iter(results.values()))["methods"]
    methods = (*RATIOS.values(), *compact)
    if args.device == "cpu":
        cost = f"CPU ms per step ({COLD_CACHE_BYTES >> 20} MiB written before each call)"
    else:
        cost = (
            "wall ms per step between two CUDA synchronizations (twice the L2 cache written "
            "before each call)"
        )
    lines = [
        f"# CompactAdamW update cost against fused fp32 AdamW ({machine}, {args.device}, 1 thread)",
        "",
        f"Rank 0's shards of {args.world} ranks, one call per FSDP unit, each call with cold "
        f"caches; {cost}, median [IQR] of {args.steps} steps, per round; ratio = compact / "
        f"{BASELINE}.",
        "",
        "| shape | tensors | elements | round | "
        + " | ".join(f"{m} ms" for m in methods)
        + " | "
        + " | ".join(f"{m} ratio" for m in compact)
        + " |",
        "|---" * (4 + len(methods) + len(compact)) + "|",
    ]
    for name, r in results.items():
        for index, rnd in enumerate(r["rounds"]):
            cells = [
                f"{rnd['median_ms'][m]:.3f} [{rnd['iqr_ms'][m][0]:.3f}, {rnd['iqr_ms'][m][1]:.3f}]"
                for m in methods
            ] + [f"{rnd['ratio'][m]:.2f}" for m in compact]
            lines.append(
                f"| {name} | {r['tensors']} | {r['local_elements']:,} | {index + 1} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [
        "",
        "Ratios, the median of the rounds' with their range: against the fused kernel (the "
        f"call OptimizerInBackward makes for AdamW), and against {RATIOS['step_ratio']} "
        "(AdamW(fused=True).step(), the class's Python included: fused AdamW used alone).",
        "",
        f"| shape | method | ratio to {BASELINE} | range | ratio to {RATIOS['step_ratio']} "
        "| range |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for m in compact:
            cells = []
            for key in RATIOS:
                low, high = r[f"{key}_range"][m]
                cells += [f"{r[f'{key}_median'][m]:.2f}", f"{low:.2f} - {high:.2f}"]
            lines.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    if args.device != "cpu":
        return "\n".join(lines) + "\n"
    lines += ["", "Share of compact-c's CPU time inside the C kernel (the rest is Python):", ""]
    lines += [f"* {name}: {100 * r['kernel_share']:.0f}%" for name, r in results.items()]
    lines += ["", "Where compact-eager's time goes (self CPU time, all ops of 5 steps):", ""]
    for name, r in results.items():
        top = ", ".join(
            f"{e['op']} {100 * e['share']:.0f}% ({e['calls_per_step']:.0f}/step)"
            for e in r["profile_top"][:8]
        )
        lines.append(f"* {name}: {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=DEFAULT_SHAPES)
    parser.add_argument("--world", type=int, default=2, help="ranks the shards are taken from")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {
        name: _measure(name, args.world, args.steps, args.rounds, args.device)
        for name in args.shapes
    }
    machine = describe_machine(args.device)
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "machine": machine}
    payload["results"] = results
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "compact_adamw_cost" if args.device == "cpu" else f"compact_adamw_cost_{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    text = markdown(results, args, machine_summary(machine))
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
