"""Is clipping inside one backward as stable as exact global clipping? Measured by fine-tuning.

Runs ``scripts/finetune.py`` (same seed, batches and model) three times with a deliberately high
learning rate, where clipping matters:

* ``plain-global``: the plain optimizer, exact global clipping (``clip_grad_norm_``);
* ``in-backward``: ``OptimizerInBackward`` clipping each FSDP unit as it steps (README,
  "Clipping in one backward");
* ``in-backward-unclipped``: no clipping, to show what clipping does here.

Writes ``clipping_stability.{json,md,png}`` to ``--out``::

    python benchmarks/clipping_stability.py                 # ~6 min on 2 CPU cores
    python benchmarks/clipping_stability.py --steps 60 --out /tmp/clip   # quick look
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fused_optim_dist_recipes.metrics import describe_machine, machine_summary

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "plain-global": ["--no-in-backward"],
    "in-backward": [],
    "in-backward-unclipped": ["--max-grad-norm", "0"],
}


def _run(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> list[dict]:
    out = workdir / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.nproc}", str(REPO / "scripts" / "finetune.py"),
        "--model", args.model, "--max-steps", str(args.steps), "--lr", str(args.lr),
        "--warmup-steps", "5", "--output-dir", str(out), "--save-every", "0",
        "--max-grad-norm", str(args.max_grad_norm), "--log-every", "50", *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _summary(rows: list[dict], reference: list[dict], tail: int) -> dict[str, float]:
    losses = [r["loss"] for r in rows]
    ref = [r["loss"] for r in reference]
    diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
    return {
        "final_loss_mean_last": statistics.fmean(losses[-tail:]),
        "max_loss_after_warmup": max(losses[10:]),
        "loss_spikes": sum(b > a * 1.2 for a, b in itertools.pairwise(losses[10:])),
        "mean_abs_diff_vs_plain_global": statistics.fmean(diffs),
        "max_abs_diff_vs_plain_global": max(diffs),
        "median_grad_norm": statistics.median(r["grad_norm"] for r in rows),
    }


def _plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        steps = [r["step"] for r in rows]
        ax_loss.plot(steps, [r["loss"] for r in rows], label=name, lw=1)
        ax_norm.plot(steps, [r["grad_norm"] for r in rows], label=name, lw=1)
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_norm.set(xlabel="step", ylabel="grad norm (before clipping)", yscale="log")
    ax_loss.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="small")
    parser.add_argument("--lr", type=float, default=3e-2, help="high on purpose (default 10x)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: _run(name, extra, args, Path(tmp)) for name, extra in RUNS.items()}
    tail = max(1, args.steps // 10)
    summary = {
        name: _summary(rows, results["plain-global"], tail) for name, rows in results.items()
    }
    machine = describe_machine()
    payload = {"config": vars(args) | {"out": str(args.out)}, "machine": machine,
               "summary": summary, "metrics": results}  # fmt: skip
    (args.out / "clipping_stability.json").write_text(json.dumps(payload, indent=1))
    keys = list(next(iter(summary.values())))
    lines = [
        f"Clipping stability: {args.model}, {args.steps} steps, lr {args.lr}, "
        f"max_grad_norm {args.max_grad_norm}, {args.nproc} ranks ({machine_summary(machine)})",
        "",
        "| run | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
        *(f"| {n} | " + " | ".join(f"{s[k]:.4g}" for k in keys) + " |" for n, s in summary.items()),
    ]
    (args.out / "clipping_stability.md").write_text("\n".join(lines) + "\n")
    _plot(results, args.out / "clipping_stability.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
