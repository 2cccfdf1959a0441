"""Where the time of a step goes, per method: cProfile of rank 0 on one shape.

    python -m benchmarks._profile --shape many-small --world-size 2

For each method, rank 0 runs warm-up steps, then profiled steps (the methods interleaved, on the
same batches as the sweep), and the per-step time of a few code paths is printed. cProfile
slows Python-heavy code (optimizer wrappers, FSDP2 bookkeeping) more than kernels: compare the
methods with it, do not read its times as the unprofiled step time.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks._config import SweepConfig
from benchmarks._measure import build_runner, make_batches, per_rank_batch
from benchmarks._methods import METHODS
from benchmarks._shapes import SHAPES, get_shape
from fused_optim_dist_recipes.launch import spawn

PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "whole step": (("benchmarks/_profile.py", "_one_step"),),
    "optimizer after backward": (("benchmarks/_methods.py", "optimizer_step"),),
    "optimizer in backward (hooks)": (
        ("fused_optim_dist/optimizer.py", "_step_bucket"),
        ("benchmarks/_methods.py", "hook"),
    ),
    "  of which the update (torch.optim.adam.adam)": (("torch/optim/adam.py", "adam"),),
    "FSDP2 reduce-scatter path (incl. hooks)": (("_fsdp_collectives.py", "foreach_reduce"),),
    "FSDP2 all-gather + wait": (
        ("_fsdp_collectives.py", "foreach_all_gather"),
        ("_fsdp_param_group.py", "wait_for_unshard"),
    ),
}
"""Reported code paths: (file suffix, function name) whose cumulative times are summed."""


def _per_step_ms(stats: pstats.Stats, steps: int) -> dict[str, float]:
    table: dict[tuple[str, int, str], tuple] = stats.stats  # type: ignore[attr-defined]
    out = {}
    for label, functions in PATHS.items():
        seconds = sum(
            entry[3]
            for (filename, _, name), entry in table.items()
            for suffix, wanted in functions
            if name == wanted and filename.endswith(suffix)
        )
        out[label] = seconds / steps * 1e3
    return out


def _one_step(runner: Any, inputs: Any, targets: Any) -> None:
    runner.forward_backward(inputs, targets)
    runner.optimizer_step()


def profile_world(config: SweepConfig) -> list[dict[str, Any]]:
    """Profile every method of ``config`` on its first shape and scaling (collective)."""
    shape = get_shape(config.shapes[0], quick=config.quick)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(config.device, (world_size,))
    batch = make_batches(
        shape, config, per_rank_batch(shape, config.scalings[0], world_size, config)
    )
    runners = {}
    for name in config.methods:
        if METHODS[name].missing() is None:
            runners[name] = build_runner(shape, config, mesh, name)
    for step in range(config.warmup_steps):
        for runner in runners.values():
            _one_step(runner, *batch(step))
    profiles = {name: cProfile.Profile() for name in runners}
    for step in range(config.warmup_steps, config.warmup_steps + config.timed_steps):
        inputs, targets = batch(step)
        for name, runner in runners.items():
            dist.barrier()
            profiles[name].runcall(_one_step, runner, inputs, targets)
    return [
        {"method": name, **_per_step_ms(pstats.Stats(profile), config.timed_steps)}
        for name, profile in profiles.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="many-small")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--scaling", choices=("strong", "weak"), default="strong")
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=["plain", "per-param", "ours"]
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    config = dataclasses.replace(
        SweepConfig(),
        world_sizes=(args.world_size,),
        shapes=(args.shape,),
        methods=tuple(args.methods),
        scalings=(args.scaling,),
        timed_steps=args.steps,
        warmup_steps=2,
    )
    rows = spawn(args.world_size, profile_world, config, device=config.device)
    print(
        f"{args.shape}, {args.world_size} rank(s), {args.scaling} scaling: rank 0, ms per "
        f"step under cProfile, mean of {args.steps} steps"
    )
    width = max(map(len, PATHS))
    print(" " * width + "".join(f"{row['method']:>18}" for row in rows))
    for label in PATHS:
        print(f"{label:<{width}}" + "".join(f"{row[label]:>18.1f}" for row in rows))


if __name__ == "__main__":
    main()
