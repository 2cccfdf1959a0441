"""Does CompactAdamW train as well as fp32 AdamW? Measured by fine-tuning, over seeds.

Runs ``scripts/finetune.py`` (defaults: the small Llama, lr 3e-3, clipping at 1.0, in backward)
for each variant and seed, and compares the final loss and the mean loss of the last 10% of
steps with the seed-to-seed spread of fp32 AdamW:

* ``adamw-fp32``: ``torch.optim.AdamW``, float32 weights (12 B/param of state and weights);
* ``compact``: ``CompactAdamW``, bfloat16 weights with their int8 error, 8-bit moments;
* ``compact-no-correction``: bfloat16 weights alone (ablation of the error);
* ``compact-linear-momentum``: linear 8-bit momentum, no companding (ablation);
* ``compact-4bit-variance``: ``variance_bits=4``, the second moment in 4 bits (4.63 B/param).

Each finished run is added to ``--out``/compact_adamw_quality_<steps>_lr<lr>.json at once, so an
interrupted grid resumes where it stopped; ``--report`` writes the Markdown table and the loss
plot from every such file::

    python benchmarks/compact_adamw_quality.py --steps 300 --seeds 0 1 2   # ~3 min a run, 2 cores
    python benchmarks/compact_adamw_quality.py --steps 300 --lr 3e-4 --variants adamw-fp32 \\
        compact compact-no-correction                                      # where the error matters
    python benchmarks/compact_adamw_quality.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fused_optim_dist_recipes.metrics import describe_machine, machine_summary

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "adamw-fp32": ["--optimizer", "adamw"],
    "compact": ["--optimizer", "compactadamw"],
    "compact-no-correction": [
        "--optimizer", "compactadamw", "--optimizer-kwargs", '{"weight_correction": false}',
    ],
    "compact-linear-momentum": [
        "--optimizer", "compactadamw", "--optimizer-kwargs", '{"compand": false}',
    ],
    "compact-4bit-variance": [
        "--optimizer", "compactadamw", "--optimizer-kwargs", '{"variance_bits": 4}',
    ],
}  # fmt: skip
REFERENCE = "adamw-fp32"
TAIL_FRACTION = 10
"""The mean of the last 1/TAIL_FRACTION of the steps is the "mean last 10%" loss."""


def _results_path(out: Path, steps: int, lr: float) -> Path:
    return out / f"compact_adamw_quality_{steps}_lr{lr:g}.json"


def run_finetune(out: Path, nproc: int, *flags: str) -> None:
    """``scripts/finetune.py`` under torchrun on ``nproc`` CPU ranks of one thread each, its
    outputs in ``out``, without sampling or held-out evaluation (training only), with
    ``flags``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(REPO / "scripts" / "finetune.py"),
        "--output-dir", str(out), "--log-every", "100", "--sample-tokens", "0",
        "--eval-every", "0", *flags,
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run(variant: str, seed: int, args: argparse.Namespace, workdir: Path) -> list[float]:
    out = workdir / f"{variant}-{seed}"
    run_finetune(
        out, args.nproc,
        "--max-steps", str(args.steps), "--lr", str(args.lr), "--seed", str(seed),
        "--save-every", "0", *VARIANTS[variant],
    )  # fmt: skip
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def _grid(args: argparse.Namespace) -> None:
    path = _results_path(args.out, args.steps, args.lr)
    payload = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    payload.update(config={"steps": args.steps, "lr": args.lr, "nproc": args.nproc})
    payload["machine"] = describe_machine()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for variant in args.variants:
                key = f"{variant}/{seed}"
                if key in payload["runs"]:
                    continue
                payload["runs"][key] = _run(variant, seed, args, Path(tmp))
                args.out.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(payload))


def _summaries(runs: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
    """Per variant: the final and mean-last-10% loss of each seed."""
    out: dict[str, dict[str, list[float]]] = {}
    for key, losses in sorted(runs.items()):
        variant = key.split("/")[0]
        tail = max(1, len(losses) // TAIL_FRACTION)
        entry = out.setdefault(variant, {"final": [], "tail": []})
        entry["final"].append(losses[-1])
        entry["tail"].append(statistics.fmean(losses[-tail:]))
    return out


def _describe(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f} (1 seed)"
    return (
        f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f} "
        f"[{min(values):.4f}, {max(values):.4f}]"
    )


def _within(values: list[float], reference: list[float]) -> str:
    """How many seeds of ``values`` lie inside the reference's seed range, and below it
    (lower loss); where the mean lies."""
    low, high = min(reference), max(reference)
    inside = sum(low <= v <= high for v in values)
    below = sum(v < low for v in values)
    mean = statistics.fmean(values)
    where = "inside" if low <= mean <= high else ("below" if mean < low else "above")
    return f"{inside}/{len(values)} inside, {below} below; mean {where}"


def _report(out: Path) -> None:
    lines = ["# CompactAdamW training quality (`benchmarks/compact_adamw_quality.py`)", ""]
    grids = sorted(out.glob("compact_adamw_quality_*.json"))
    for path in grids:
        payload = json.loads(path.read_text())
        config = payload["config"]
        summary = _summaries(payload["runs"])
        reference = summary.get(REFERENCE)
        lines += [
            f"## {config['steps']} steps, lr {config['lr']:g}, {config['nproc']} ranks "
            f"({machine_summary(payload['machine'])})",
            "",
            "Mean ± stdev over seeds [min, max]; against fp32 AdamW's range over its seeds: "
            "seeds inside it, below it (lower loss), and where the mean lies.",
            "",
            "| variant | final loss | within | mean last 10% | within |",
            "|---|---|---|---|---|",
        ]
        for variant, entry in summary.items():
            within = (
                [_within(entry[k], reference[k]) for k in ("final", "tail")]
                if reference and variant != REFERENCE
                else ["", ""]
            )
            lines.append(
                f"| {variant} | {_describe(entry['final'])} | {within[0]} | "
                f"{_describe(entry['tail'])} | {within[1]} |"
            )
        lines.append("")
    (out / "compact_adamw_quality.md").write_text("\n".join(lines))
    _plot(grids, out / "compact_adamw_quality.png")
    print("\n".join(lines))


def _plot(grids: list[Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grids), figsize=(6 * len(grids), 4), squeeze=False)
    # The reference in black, the others in matplotlib's cycle of ten colours.
    others = [variant for variant in VARIANTS if variant != REFERENCE]
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {REFERENCE: "black", **dict(zip(others, cycle, strict=False))}
    for ax, grid in zip(axes[0], grids, strict=True):
        payload = json.loads(grid.read_text())
        for key, losses in sorted(payload["runs"].items()):
            variant, seed = key.split("/")
            # A running mean over 10 steps, so that the variants can be told apart.
            smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
            label = variant if seed == min(k.split("/")[1] for k in payload["runs"]) else None
            ax.plot(range(1, len(losses) + 1), smooth, color=colors[variant], lw=0.8, label=label)
        config = payload["config"]
        ax.set(xlabel="step", ylabel="loss (mean of 10 steps)", yscale="log")
        ax.set_title(f"{config['steps']} steps, lr {config['lr']:g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--report", action="store_true", help="only write the table and plot")
    args = parser.parse_args(argv)
    if not args.report:
        _grid(args)
    _report(args.out)


if __name__ == "__main__":
    main()
