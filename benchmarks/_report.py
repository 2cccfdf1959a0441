"""Results: the machine, a JSON file of every record, a Markdown table and PNG plots."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks._config import SweepConfig
from benchmarks._memory import KINDS
from fused_optim_dist_recipes import metrics
from fused_optim_dist_recipes.launch import CPU_THREADS_PER_RANK

__all__ = ["describe_machine", "write_results"]

MIB = 2**20
"""Bytes per MiB."""
BASELINE, OURS, PER_PARAM = "plain", "ours", "per-param"
JSON_NAME, MARKDOWN_NAME = "scaling.json", "scaling.md"


def describe_machine(config: SweepConfig) -> dict[str, Any]:
    """The machine (``fused_optim_dist_recipes.metrics.describe_machine``) and the threads of a
    CPU rank."""
    machine = metrics.describe_machine(config.device)
    if config.device == "cpu":
        machine["threads_per_rank"] = CPU_THREADS_PER_RANK
    return machine


def write_results(
    out: Path, config: SweepConfig, machine: dict[str, Any], records: list[dict[str, Any]]
) -> list[Path]:
    """Write ``scaling.json``, ``scaling.md`` and the plots into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    machine = {**machine, "load_average_1min_at_end": round(os.getloadavg()[0], 2)}
    payload = {"machine": machine, "config": dataclasses.asdict(config), "records": records}
    paths = [out / JSON_NAME, out / MARKDOWN_NAME]
    paths[0].write_text(json.dumps(payload, indent=1) + "\n")
    paths[1].write_text(markdown(payload))
    return paths + _plots(out, config, records)


# ---------------------------------------------------------------------------------- tables


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or not b else f"{a / b:.2f}"


def _ok(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["skipped"] is None]


def _cases(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(shape, world size, scaling) -> method -> record, in run order."""
    cases: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in _ok(records):
        cases.setdefault((r["shape"], r["world_size"], r["scaling"]), {})[r["method"]] = r
    return cases


def _get(case: dict[str, dict[str, Any]], method: str, key: str) -> float | None:
    return case[method][key] if method in case else None


def _summary(records: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| shape | ranks | scaling | ours / plain step | (CPU time) | per-param / ours step "
        "| (CPU time) | ours / plain peak | ours peak / bound | plain after-backward ms "
        "| ours saves ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, world, scaling), case in _cases(records).items():
        ours_bound = case[OURS]["lower_bound"]["total"] if OURS in case else None
        saved = (
            case[BASELINE]["step_ms"] - case[OURS]["step_ms"]
            if BASELINE in case and OURS in case
            else None
        )
        after = _get(case, BASELINE, "after_backward_ms")
        lines.append(
            f"| {shape} | {world} | {scaling} "
            f"| {_ratio(_get(case, OURS, 'step_ms'), _get(case, BASELINE, 'step_ms'))} "
            f"| {_ratio(_get(case, OURS, 'step_cpu_ms'), _get(case, BASELINE, 'step_cpu_ms'))} "
            f"| {_ratio(_get(case, PER_PARAM, 'step_ms'), _get(case, OURS, 'step_ms'))} "
            f"| {_ratio(_get(case, PER_PARAM, 'step_cpu_ms'), _get(case, OURS, 'step_cpu_ms'))} "
            f"| {_ratio(_get(case, OURS, 'peak_bytes'), _get(case, BASELINE, 'peak_bytes'))} "
            f"| {_ratio(_get(case, OURS, 'peak_bytes'), ours_bound)} "
            f"| {'' if after is None else f'{after:.1f}'} "
            f"| {'' if saved is None else f'{saved:.1f}'} |"
        )
    return lines


def _shape_table(records: list[dict[str, Any]], shape: str) -> list[str]:
    kinds = list(KINDS)
    allocator = any("allocator_peak_bytes" in r for r in records)
    head = [
        "ranks",
        "scaling",
        "method",
        "step ms",
        "fwd+bwd ms",
        "after-bwd ms",
        "step CPU ms",
        "tokens/s",
        "peak MiB",
        *(f"{k.replace('_', ' ')} MiB" for k in kinds),
        "bound MiB",
        "peak / bound",
    ]
    if allocator:
        head.append("allocator peak MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in _ok(records):
        if r["shape"] != shape:
            continue
        row = [
            str(r["world_size"]),
            r["scaling"],
            r["method"],
            f"{r['step_ms']:.1f}",
            f"{r['fwd_bwd_ms']:.1f}",
            f"{r['after_backward_ms']:.1f}",
            f"{r['step_cpu_ms']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            _mib(r["peak_bytes"]),
            *(_mib(r["peak_by_kind"][k]) for k in kinds),
            _mib(r["lower_bound"]["total"]),
            _ratio(r["peak_bytes"], r["lower_bound"]["total"]),
        ]
        if allocator:
            row.append(_mib(r.get("allocator_peak_bytes", 0)))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(payload: dict[str, Any]) -> str:
    """The results as Markdown: machine, summary of ratios, one table per shape."""
    machine, config, records = payload["machine"], payload["config"], payload["records"]
    lines = [
        "# Scaling benchmark: plain vs per-param vs ours (FSDP2, AdamW)",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()),
        "",
        f"Config: warm-up {config['warmup_steps']} steps, then 1 tracked step (memory), then "
        f"{config['timed_steps']} timed steps with the methods interleaved; step time is the "
        "median over timed steps of the slowest rank (wall clock; CPU time is the process time "
        "of the busiest rank, which other load on the machine does not inflate); peak memory "
        "is the rank with the highest "
        "peak; the bound is sharded params + optimizer state + largest unit unsharded "
        "(params + grads) + the next unit's unsharded params (FSDP2's backward prefetch) + "
        "measured activation peak. "
        + ("Quick (reduced) shapes. " if config["quick"] else "")
        + ("bf16 mixed precision." if config["bf16"] else "fp32."),
        "",
        "## Summary",
        "",
        *_summary(records),
    ]
    skipped = {(r["method"], r["skipped"]) for r in records if r["skipped"] is not None}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{m}: {why}" for m, why in sorted(skipped))]
    for shape in dict.fromkeys(r["shape"] for r in _ok(records)):
        first = next(r for r in _ok(records) if r["shape"] == shape)
        lines += [
            "",
            f"## {shape} ({first['bound']}-bound: {first['n_params']:,} parameters in "
            f"{first['n_tensors']} tensors, {first['n_units']} FSDP units"
            + (", activation checkpointing" if first["checkpointing"] else "")
            + ")",
            "",
            *_shape_table(records, shape),
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- plots


def _plots(out: Path, config: SweepConfig, records: list[dict[str, Any]]) -> list[Path]:
    """One PNG per scaling: peak memory, step time and step CPU time vs ranks, a line per
    method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = _ok(records)
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    paths = []
    for scaling in config.scalings:
        # One-rank runs serve both scalings.
        chosen = [r for r in ok if r["scaling"] in (scaling, "both")]
        if not chosen:
            continue
        fig, axes = plt.subplots(3, len(shapes), figsize=(4.5 * len(shapes), 10), squeeze=False)
        for col, shape in enumerate(shapes):
            for method in dict.fromkeys(r["method"] for r in chosen):
                points = sorted(
                    (r["world_size"], r["peak_bytes"] / MIB, r["step_ms"], r["step_cpu_ms"])
                    for r in chosen
                    if r["shape"] == shape and r["method"] == method
                )
                if not points:
                    continue
                ranks, *series = zip(*points, strict=True)
                for row, values in zip(axes, series, strict=True):
                    row[col].plot(ranks, values, marker="o", label=method)
            axes[0][col].set_title(f"{shape} ({scaling} scaling)")
            axes[0][col].set_ylabel("peak memory per rank (MiB)")
            axes[1][col].set_ylabel("step time, wall (ms)")
            axes[2][col].set_ylabel("step CPU time, busiest rank (ms)")
            for row in axes:
                row[col].set_xlabel("ranks")
                row[col].set_xticks(sorted({r["world_size"] for r in chosen}))
        axes[0][0].legend(fontsize="small")
        fig.tight_layout()
        path = out / f"scaling_{scaling}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
