"""Simulated peak memory per GPU of Llama-3 8B and 70B at 8, 64 and 512 ranks.

Every case is simulated on this CPU (fake tensors on a fake process group of the target size,
``fused_optim_dist_recipes.memory_estimate``): plain AdamW after backward against the
in-backward step (and every other method ``METHODS`` lists), with and without activation
checkpointing, in strong and weak scaling. One command per model::

    python benchmarks/memory_scaling.py --model llama3-8b --jobs 8
    python benchmarks/memory_scaling.py --model llama3-70b --jobs 6
    python benchmarks/memory_scaling.py --model tiny --world-sizes 2 --seq-len 64  # a smoke run

Measured: the 8B table took 21 minutes with ``--jobs 8`` on a shared 2-core VM under a load
average of 25-35 (one 8B simulation is about 20 s of CPU on an idle core, the 70B's about 2.5
times that).

Results: ``benchmarks/results/memory_scaling_<model>.{json,md,png}``. A rerun keeps the
(case, method) results already in that JSON and simulates only the missing ones (a method
added to ``METHODS``); ``--fresh`` simulates every one again.

Assumptions, shared by every case: fp32 weights, FSDP2 mixed precision (bf16 compute, fp32
gradient reduction), AdamW (foreach kernels, CUDA's default), clipping at 1.0 as the
fine-tuning job does, sequences of 2048 tokens, one FSDP unit per block plus the root
(embeddings, final norm and head), the job's loss (logits cast to fp32). Weak scaling: one
sequence per rank. Strong scaling: a fixed global batch of 64 x 2048 tokens split over the
ranks (8 sequences per rank at 8 ranks, 1 at 64); at 512 ranks, where sequences are fewer than
ranks, the same tokens as one 256-token sequence per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from fused_optim_dist_recipes import metrics
from fused_optim_dist_recipes.memory_estimate import (
    GIB,
    METHODS,
    SHAPES,
    EstimateConfig,
    estimate,
)

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN = 2048
STRONG_GLOBAL_TOKENS = 64 * SEQ_LEN
"""Strong scaling: tokens per optimizer step, whatever the number of ranks."""


def _case(
    model: str, world: int, scaling: str, ac: bool, seq_len: int, methods: tuple[str, ...]
) -> EstimateConfig:
    if scaling == "weak":
        batch, seq = world, seq_len
    else:
        tokens = STRONG_GLOBAL_TOKENS * seq_len // SEQ_LEN
        batch, seq = max(world, tokens // seq_len), min(seq_len, tokens // world)
    return EstimateConfig(
        model=model,
        world_size=world,
        activation_checkpointing=ac,
        mixed_precision="bf16",
        seq_len=seq,
        batch_size=batch,
        max_grad_norm=1.0,
        methods=methods,
    )


def _markdown(payload: dict[str, Any]) -> str:
    methods = payload["config"]["methods"]
    base = methods[0]
    lines = [
        f"# Simulated peak memory per GPU: {payload['config']['model']}",
        "",
        f"{payload['num_params'] / 1e9:.2f}B parameters. Estimates from a simulation on "
        f"{payload['machine']['cpu']} ({payload['seconds']:.0f} s of wall-clock time for the "
        "simulations of the last run; `sim s`: each case's own simulation time"
        f"{'' if payload['complete'] else ', incomplete: pending cases marked'}); GiB per rank "
        "(rank 0), tensors only: add the margin of `docs/memory_estimation.md` for the CUDA "
        "context, NCCL/cuBLAS workspaces and the caching allocator.",
        "",
        "| scaling | ranks | AC | tokens/rank | "
        + " | ".join(f"{m} GiB" for m in methods)
        + " | "
        + " | ".join(f"{m} / {base}" for m in methods[1:])
        + f" | {base} peak at | {methods[-1]} peak at | sim s |",
        "|---|---|---|---|" + "---|" * (2 * len(methods) - 1) + "---|---|---|",
    ]
    for row in payload["rows"]:
        peaks = dict.fromkeys(methods) | {r["method"]: r["peak_bytes"] for r in row["results"]}
        where = dict.fromkeys(methods, "pending") | {
            r["method"]: f"{r['peak_phase']}, {r['peak_module']}"
            if r["skipped"] is None
            else f"not simulated: {r['skipped']}"
            for r in row["results"]
        }

        def gib(method: str, peaks: dict[str, int | None] = peaks) -> str:
            return "n/a" if peaks[method] is None else f"{peaks[method] / GIB:.2f}"

        def ratio(method: str, peaks: dict[str, int | None] = peaks) -> str:
            if peaks[method] is None or peaks[base] is None:
                return "n/a"
            return f"{peaks[method] / peaks[base]:.2f}"

        lines.append(
            f"| {row['scaling']} | {row['world_size']} | {'on' if row['ac'] else 'off'} | "
            f"{row['tokens_per_rank']} | "
            + " | ".join(gib(m) for m in methods)
            + " | "
            + " | ".join(ratio(m) for m in methods[1:])
            + f" | {where[base]} | {where[methods[-1]]} | "
            + f"{sum(r['seconds'] for r in row['results']):.0f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = payload["config"]["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, scaling in zip(axes, ("strong", "weak"), strict=True):
        for ac, style in ((False, "-"), (True, "--")):
            rows = [r for r in payload["rows"] if r["scaling"] == scaling and r["ac"] == ac]
            worlds = [r["world_size"] for r in rows]
            for index, method in enumerate(methods):
                points = [
                    (w, x["peak_bytes"] / GIB)
                    for w, r in zip(worlds, rows, strict=True)
                    for x in r["results"]
                    if x["method"] == method and x["skipped"] is None
                ]
                ax.plot(
                    [w for w, _ in points],
                    [g for _, g in points],
                    style,
                    marker="o",
                    color=f"C{index}",
                    label=f"{method}, AC {'on' if ac else 'off'}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(f"{scaling} scaling")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("simulated peak per rank (GiB, est.)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{payload['config']['model']}: peak memory per GPU (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _simulate(config: EstimateConfig) -> dict[str, Any]:
    (result,) = estimate(config)
    return result.as_dict()


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], seconds: float) -> None:
    """Write the rows simulated so far; the plot once every case is done."""
    complete = all(len(r["results"]) == len(args.methods) for r in rows)
    done = next((r["results"][0] for r in rows if r["results"]), None)
    payload = {
        "machine": metrics.describe_machine("cpu"),
        "config": {"model": args.model, "methods": args.methods, "seq_len": args.seq_len},
        "num_params": done and done["num_params"],
        "seconds": seconds,
        "jobs": args.jobs,
        "complete": complete,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"memory_scaling_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(payload))
    if complete:
        _plot(payload, stem.with_suffix(".png"))


def _earlier_results(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """The results of an earlier run of the same model and sequence length, by case (the
    ``repr`` of its ``EstimateConfig`` with ``methods`` cleared) and method."""
    path = args.out / f"memory_scaling_{args.model}.json"
    if not path.exists():
        return {}
    payload = json.loads(path.read_text())
    if payload["config"]["seq_len"] != args.seq_len:
        return {}
    done: dict[str, dict[str, dict[str, Any]]] = {}
    for row in payload["rows"]:
        config = dataclasses.replace(EstimateConfig(**row["config"]), methods=tuple(args.methods))
        for result in row["results"]:
            done.setdefault(repr(config), {})[result["method"]] = result
    return done


def main(argv: list[str] | None = None) -> None:
    """Simulate every case; write JSON and Markdown as results come in, the PNG at the end."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    p.add_argument(
        "--jobs", type=int, default=2, help="simulations at once, each in its own process"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--fresh", action="store_true", help="ignore the results already written")
    args = p.parse_args(argv)
    started = time.perf_counter()
    done = {} if args.fresh else _earlier_results(args)
    rows = []
    for scaling in ("weak", "strong"):
        for ac in (True, False):
            for world in args.world_sizes:
                config = _case(args.model, world, scaling, ac, args.seq_len, tuple(args.methods))
                rows.append(
                    {
                        "scaling": scaling,
                        "world_size": world,
                        "ac": ac,
                        "tokens_per_rank": config.micro_batch * config.seq_len,
                        "config": {
                            k: str(v) if isinstance(v, Path) else v
                            for k, v in dataclasses.asdict(config).items()
                        },
                        "results": [],
                    }
                )
                earlier = done.get(repr(config), {})
                rows[-1]["results"] = [earlier[m] for m in args.methods if m in earlier]
    # One simulation per (case, method), each in a fresh process (a fake process group per
    # process). Strong scaling at 64 ranks is weak scaling's case: simulated once.
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(repr(EstimateConfig(**row["config"])), []).append(row)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            pool.submit(
                _simulate, dataclasses.replace(EstimateConfig(**same[0]["config"]), methods=(m,))
            ): (key, m)
            for key, same in by_key.items()
            for m in args.methods
            if m not in {r["method"] for r in same[0]["results"]}
        }
        for future in as_completed(futures):
            key, method = futures[future]
            result = future.result()
            for row in by_key[key]:
                row["results"].append(result)
                row["results"].sort(key=lambda r: args.methods.index(r["method"]))
            row = by_key[key][0]
            peak = "skipped" if result["skipped"] else f"{result['peak_bytes'] / GIB:.2f} GiB"
            print(
                f"{row['scaling']} {row['world_size']} ranks AC {row['ac']}: {method} {peak} "
                f"({result['seconds']:.0f} s)",
                flush=True,
            )
            _write(args, rows, time.perf_counter() - started)
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
