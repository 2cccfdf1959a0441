"""Scaling benchmark: peak memory and step time of plain, per-param and in-backward AdamW
on FSDP2, over world sizes, model shapes, and strong and weak scaling, in one run.

Run from the repository root (``python -m benchmarks.scaling`` works too)::

    python benchmarks/scaling.py                          # full CPU sweep: 1, 2, 4 ranks
    python benchmarks/scaling.py --quick --out /tmp/bench # smoke run (< 2 min)
    python benchmarks/scaling.py --device cuda --bf16     # every visible GPU

Each world size is a fresh set of processes (gloo on CPU, nccl on CUDA). Within a world, every
method trains the same weights on the same batches. Results go to ``--out`` (default
``benchmarks/results/``): ``scaling.json``, ``scaling.md`` and ``scaling_<scaling>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the ``benchmarks`` package importable (here and in the spawned
    # ranks, which inherit sys.path).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks._config import SCALINGS, SweepConfig
from benchmarks._measure import check_batches, run_world
from benchmarks._methods import METHODS
from benchmarks._report import describe_machine, write_results
from benchmarks._shapes import SHAPES
from fused_optim_dist_recipes.launch import spawn

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK = {"world_sizes": (1, 2), "warmup_steps": 1, "timed_steps": 1, "quick": True}
"""Overrides of ``--quick``: a smoke run of every shape, method and scaling."""


def _cuda_world_sizes() -> tuple[int, ...]:
    """1, 2, 4, ... up to every visible GPU, and every visible GPU."""
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("--device cuda but no CUDA device is visible")
    sizes = [1 << i for i in range(count.bit_length()) if 1 << i <= count]
    return tuple(sorted({*sizes, count}))


def parse_config(argv: Sequence[str] | None = None) -> tuple[SweepConfig, Path]:
    """The sweep configuration and output directory from the command line."""
    defaults = SweepConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--quick", action="store_true", help="reduced shapes, 1 and 2 ranks")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        help="default: 1 2 4 on CPU, 1 2 4 ... all visible GPUs on CUDA",
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=defaults.shapes)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=defaults.methods)
    parser.add_argument("--scalings", nargs="+", choices=SCALINGS, default=defaults.scalings)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--timed-steps", type=int)
    parser.add_argument("--micro-batches", type=int, default=defaults.micro_batches)
    parser.add_argument("--bf16", action="store_true", help="FSDP2 bf16 mixed precision")
    args = parser.parse_args(argv)

    fields = {
        "device": args.device,
        "shapes": tuple(args.shapes),
        "methods": tuple(args.methods),
        "scalings": tuple(args.scalings),
        "micro_batches": args.micro_batches,
        "bf16": args.bf16,
    }
    if args.device == "cuda":
        fields["world_sizes"] = _cuda_world_sizes()
    if args.quick:
        fields.update(QUICK)
    # Explicit flags win over --quick and the device's defaults.
    for name in ("world_sizes", "warmup_steps", "timed_steps"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = tuple(value) if isinstance(value, list) else value
    config = dataclasses.replace(defaults, **fields)
    try:
        check_batches(config)
    except ValueError as error:
        parser.error(str(error))
    return config, args.out


def main(argv: Sequence[str] | None = None) -> None:
    config, out = parse_config(argv)
    machine = describe_machine(config)
    print(f"config: {config}\nmachine: {machine}\nresults: {out}", flush=True)
    records: list[dict] = []
    for world_size in config.world_sizes:
        records += spawn(world_size, run_world, config, device=config.device)
        # Rewritten after every world, so a failure later keeps what was measured.
        paths = write_results(out, config, machine, records)
        print(f"{world_size} rank(s) done: " + ", ".join(map(str, paths)), flush=True)
    print((out / "scaling.md").read_text())


if __name__ == "__main__":
    main()
