"""Why CompactAdamW compands its 8-bit momentum: a real run's momentum coded both ways.

The quality benchmark cannot tell companded from linear 8-bit momentum by the fine-tuning job's
loss (``compact_adamw_quality.py``, 300 steps, 3 seeds). This one measures what each coding
does to the momentum itself. It runs the job with fp32 AdamW (its defaults: 2 CPU ranks, in
backward, lr 3e-3), saves a checkpoint every ``--every`` steps, and codes every parameter's
``exp_avg`` of each checkpoint with CompactAdamW's own codes, companded and linear
(``_compact_codes.encode_momentum`` and ``decode_momentum``: groups of 32 within a row, a
bfloat16 scale each; a one-dim parameter's elements are groups of one, coded exactly):

* ``zeroed``: the share of nonzero momentum elements coded 0, whose update that step loses;
* ``momentum error``: the root mean square of (decoded - exact) over that of the exact
  momentum;
* ``update error``: the same for the update direction ``m / (sqrt(v) + eps)`` with ``v``
  exact, what AdamW's step adds: a small momentum over a small variance weighs here as much as
  a large one, where the momentum error sees only the large ones.

Each figure is over every element of the model, and per kind of parameter. Results:
``compact_adamw_momentum_codes.{json,md}`` in ``--out``::

    python benchmarks/compact_adamw_momentum_codes.py               # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from benchmarks.compact_adamw_quality import run_finetune
from fused_optim_dist._compact_codes import Groups, decode_momentum, encode_momentum
from fused_optim_dist_recipes.metrics import describe_machine, machine_summary

REPO = Path(__file__).resolve().parents[1]
CODINGS = {"companded": True, "linear": False}
KINDS = ("embedding", "attention", "feed_forward", "norm")
FIGURES = ("zeroed", "momentum_error", "update_error")


def kind_of(name: str) -> str:
    """The kind of a parameter of the job's Llama, by its name."""
    if "norm" in name:
        return "norm"
    if "attention" in name:
        return "attention"
    if "feed_forward" in name:
        return "feed_forward"
    return "embedding"  # tok_embeddings and the output projection


def coded(exp_avg: torch.Tensor, compand: bool) -> torch.Tensor:
    """``exp_avg`` coded into 8 bits as CompactAdamW codes it, and decoded."""
    groups = Groups([exp_avg.shape])
    flat = exp_avg.detach().float().reshape(-1)
    code = torch.empty(flat.numel(), dtype=torch.int8)
    scale = torch.empty(groups.count, dtype=torch.bfloat16)
    encode_momentum(groups.view(flat), groups, code, scale, compand)
    return decode_momentum(code, scale, groups, compand).reshape(exp_avg.shape)


def sums(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float) -> dict[str, float]:
    """The sums the figures of one parameter are made of, for every coding."""
    m = exp_avg.detach().float()
    divisor = exp_avg_sq.detach().float().sqrt().add_(eps)
    update = m / divisor
    totals = {
        "elements": m.numel(),
        "nonzero": int(m.count_nonzero()),
        "momentum_sq": float(m.square().sum()),
        "update_sq": float(update.square().sum()),
    }
    for coding, compand in CODINGS.items():
        decoded = coded(m, compand)
        totals[f"{coding}/zeroed"] = int(((decoded == 0) & (m != 0)).sum())
        totals[f"{coding}/momentum_sq"] = float((decoded - m).square().sum())
        totals[f"{coding}/update_sq"] = float((decoded / divisor - update).square().sum())
    return totals


def _share(part: float, whole: float) -> float:
    """``part / whole``, 0 where both are (a kind whose momentum is all zeros)."""
    return part / whole if whole else 0.0


def figures(totals: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per coding: the share zeroed and the two relative errors, from summed ``sums``."""
    return {
        coding: {
            "zeroed": _share(totals[f"{coding}/zeroed"], totals["nonzero"]),
            "momentum_error": _share(totals[f"{coding}/momentum_sq"], totals["momentum_sq"]) ** 0.5,
            "update_error": _share(totals[f"{coding}/update_sq"], totals["update_sq"]) ** 0.5,
        }
        for coding in CODINGS
    }


def measure(optimizer_state: dict[str, dict[str, Any]], eps: float) -> dict[str, Any]:
    """The figures over every parameter and per kind, from an AdamW state keyed by name."""
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, entry in optimizer_state.items():
        for key, value in sums(entry["exp_avg"], entry["exp_avg_sq"], eps).items():
            by_kind[kind_of(name)][key] += value
            by_kind["all"][key] += value
    return {
        kind: {"elements": int(totals["elements"]), **figures(totals)}
        for kind, totals in by_kind.items()
    }


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# CompactAdamW's 8-bit momentum, companded and linear, on a run's momentum "
        f"({machine_summary(payload['machine'])})",
        "",
        "`benchmarks/compact_adamw_momentum_codes.py`: the fine-tuning job with fp32 AdamW "
        f"({payload['config']['steps']} steps, seed {payload['config']['seed']}), each "
        "checkpoint's `exp_avg` coded both ways; zeroed: nonzero elements coded 0; errors: "
        "rms of the difference over rms of the exact value, for the momentum and for the "
        "update direction m / (sqrt(v) + eps).",
        "",
        "| step | parameters | elements | coding | zeroed | momentum error | update error |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, measured in payload["steps"].items():
        for kind in ("all", *KINDS):
            if kind not in measured:
                continue
            for coding in CODINGS:
                row = measured[kind][coding]
                lines.append(
                    f"| {step} | {kind} | {measured[kind]['elements']:,} | {coding} | "
                    f"{row['zeroed']:.2%} | {row['momentum_error']:.2%} | "
                    f"{row['update_error']:.2%} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.every <= 0 or args.steps % args.every:
        parser.error("--every must divide --steps")
    payload: dict[str, Any] = {
        "config": {"steps": args.steps, "every": args.every, "seed": args.seed},
        "machine": describe_machine(),
        "steps": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        run_finetune(
            Path(tmp) / "job", args.nproc,
            "--max-steps", str(args.steps), "--seed", str(args.seed),
            "--save-every", str(args.every), "--keep-last", str(args.steps // args.every),
        )  # fmt: skip
        for step in range(args.every, args.steps + 1, args.every):
            converted = Path(tmp) / f"step_{step}.pt"
            dcp_to_torch_save(Path(tmp) / "job" / "checkpoints" / f"step_{step:06d}", converted)
            optimizer = torch.load(converted, weights_only=False)["optimizer"]
            (eps,) = {group["eps"] for group in optimizer["param_groups"]}
            payload["steps"][str(step)] = measure(optimizer["state"], eps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compact_adamw_momentum_codes.json").write_text(json.dumps(payload, indent=1))
    (args.out / "compact_adamw_momentum_codes.md").write_text(markdown(payload))
    print(markdown(payload))


if __name__ == "__main__":
    main()
