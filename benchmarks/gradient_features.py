"""What the in-backward gradient features cost: ours with each of them on, side by side.

One process (FSDP2 on a 1-rank gloo group, so the per-bucket all-reduces are real calls), the
Llama 12 x 256 preset, AdamW; the variants take turns step by step on the same batches, and the
median step time of each is reported with its ratio to the bare in-backward optimizer::

    python benchmarks/gradient_features.py            # ~2 min on one CPU core
    python benchmarks/gradient_features.py --steps 5 --out /tmp/gf

Writes ``gradient_features.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist_recipes.metrics import describe_machine, machine_summary
from fused_optim_dist_recipes.models import PRESETS, Llama, apply_fsdp

VARIANTS: dict[str, dict] = {
    "bare (no norm)": dict(track_grad_norm=False),
    "grad norm (default)": {},
    "clip by norm": dict(max_grad_norm=1.0),
    "non-finite guard": dict(skip_nonfinite=True),
    "clip by value": dict(track_grad_norm=False, clip_grad_value=0.1),
}
BATCH, SEQ = 8, 64


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    # One process: an in-memory store, no port to pick.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    config = PRESETS["12x256"]
    runs = {}
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model = apply_fsdp(Llama(config))
        optim = OptimizerInBackward(
            model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True, **options
        )
        runs[name] = (model, optim)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps + 2):  # 2 warm-up steps
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=generator)
        for name, (model, optim) in runs.items():
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optim.step()
            optim.zero_grad()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = medians["bare (no norm)"]
    machine = describe_machine()
    lines = [
        f"In-backward gradient features, Llama 12x256, batch {BATCH}x{SEQ}, 1 rank "
        f"({machine_summary(machine)})",
        "",
        "| variant | median step ms | vs bare |",
        "|---|---|---|",
        *(f"| {n} | {m:.1f} | {m / base:.3f} |" for n, m in medians.items()),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "steps": args.steps, "median_ms": medians, "times_s": times}
    (args.out / "gradient_features.json").write_text(json.dumps(payload, indent=1))
    (args.out / "gradient_features.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
