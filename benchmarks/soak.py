"""Soak test: thousands of training steps, watching for leaks in process memory and live tensors.

Each rank trains the ``tiny`` Llama preset sharded with FSDP2 and stepped in backward
(``OptimizerInBackward`` AdamW) with gradient accumulation, clipping and an asynchronous
checkpoint every ``--save-every`` steps (``keep_last``), the loop of ``scripts/finetune.py``.
Every ``--sample-every`` steps, after a full garbage collection, it records its resident set size
(``/proc/self/statm``) and the tensors Python can reach (count, and bytes of their distinct
storages). After the warm-up, the least-squares slope of each series must stay under a
threshold (see ``RSS_FLAT_BYTES_PER_STEP`` and ``TENSORS_FLAT_PER_STEP``)::

    python -m benchmarks.soak                       # 3000 steps on 2 ranks: 16 min on 2 CPUs
    python -m benchmarks.soak --steps 300 --out /tmp/soak

Writes ``soak.json`` (configuration, samples, slopes, verdict) and ``soak.png`` into ``--out``
(default ``benchmarks/results``); exits with status 1 if a series is not flat.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fused_optim_dist import build_optimizer, checkpoint, clip_grad_norm_
from fused_optim_dist._freed import FreedGradient
from fused_optim_dist._torch_internals import holds_values
from fused_optim_dist.training import backward_micro_batches
from fused_optim_dist_recipes.launch import spawn
from fused_optim_dist_recipes.metrics import KIB, describe_machine, format_bytes
from fused_optim_dist_recipes.models import PRESETS, Llama, apply_fsdp

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
RSS_FLAT_BYTES_PER_STEP = 1 * KIB
"""RSS is flat if it grows by less than this per step after warm-up (3 MiB over 3000 steps).
The smallest leak that matters here, one FSDP unit's gradients per step (a ``tiny`` block,
about 40 KiB), grows it 40 times faster; allocator noise (arenas of the checkpoint writer
threads, fragmentation) stays well below it once warm."""
TENSORS_FLAT_PER_STEP = 0.01
"""The live tensor count is flat if it grows by less than one tensor per 100 steps: a leak of
even one tensor per step is 100 times that. Sampled at the same point of every step, the count
is otherwise exactly periodic."""
TENSOR_BYTES_FLAT_PER_STEP = 64
"""Live tensor bytes are flat if they grow by less than this per step: one leaked scalar per
step is caught by the count, anything holding a gradient or state buffer by this."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakConfig:
    steps: int = 3000
    """Optimizer steps per rank."""
    sample_every: int = 25
    """Record memory every this many steps."""
    save_every: int = 100
    """Start an asynchronous checkpoint every this many steps (0: never)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    grad_accum: int = 2
    """Micro-batches per step (all but the last under ``accumulate_grads``)."""
    max_grad_norm: float = 1.0
    """Clipping in backward."""
    warmup_fraction: float = 0.2
    """Leading fraction of the run left out of the slopes (allocator and cache warm-up)."""
    micro_batch: int = 4
    """Sequences per micro-batch and rank (random tokens, new each step)."""
    seq_len: int = 32
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.sample_every < 1 or self.save_every < 0:
            raise ValueError(f"steps and sample_every must be >= 1 and save_every >= 0: {self}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.steps * (1 - self.warmup_fraction) < 3 * self.sample_every:
            raise ValueError(
                "fewer than 3 samples after warm-up: raise steps or lower sample_every"
            )


# ---------------------------------------------------------------------------------- probes


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def live_tensors() -> tuple[int, int]:
    """``(count, bytes)`` of the tensors the garbage collector can reach, after a collection.

    Bytes are those of distinct storages, so views and a DTensor's local shard are counted once
    (a DTensor owns no storage, nor does a freed gradient); meta and fake tensors
    (``torch.compile``'s caches keep some alive) hold no memory and are not counted. Tensors
    only C++ holds (autograd graphs) are not seen; RSS covers those.
    """
    gc.collect()
    count, storages = 0, {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some objects compute.
        cls = type(obj)
        if not issubclass(cls, torch.Tensor):
            continue
        count += 1
        if issubclass(cls, (DTensor, FreedGradient)) or not holds_values(obj):
            continue
        storage = obj.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return count, sum(storages.values())


# ---------------------------------------------------------------------------------- the run


def _batch(config: SoakConfig, step: int, micro: int) -> torch.Tensor:
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed((step * config.grad_accum + micro) * 1000 + rank)
    vocab = PRESETS["tiny"].vocab_size
    return torch.randint(0, vocab, (config.micro_batch, config.seq_len + 1), generator=generator)


def run_rank(config: SoakConfig, checkpoint_dir: Path) -> list[dict[str, float]]:
    """Train ``config.steps`` steps on this rank; return its samples. Collective."""
    torch.manual_seed(0)
    model = apply_fsdp(Llama(PRESETS["tiny"]))
    optim = build_optimizer(
        model.parameters(),
        "torch.optim.AdamW",
        in_backward=True,
        max_grad_norm=config.max_grad_norm,
        lr=1e-3,
    )
    samples, pending, started = [], None, time.perf_counter()

    def loss_fn(tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    for step in range(1, config.steps + 1):
        micro_batches = [_batch(config, step, micro) for micro in range(config.grad_accum)]
        loss = backward_micro_batches(optim, loss_fn, micro_batches)
        grad_norm = clip_grad_norm_(optim, config.max_grad_norm)
        optim.step()
        optim.zero_grad()
        loss_value = loss.item()  # host sync, as a logging loop does
        if step % config.sample_every == 0:
            # Before this step's save, so that every sample sees the same save state.
            count, nbytes = live_tensors()
            samples.append(
                {
                    "step": step,
                    "rss_bytes": rss_bytes(),
                    "tensors": count,
                    "tensor_bytes": nbytes,
                    "loss": loss_value,
                    "grad_norm": grad_norm.item(),
                    "seconds": time.perf_counter() - started,
                }
            )
        if config.save_every and step % config.save_every == 0:
            pending = checkpoint.save(
                checkpoint_dir, model, optim, step=step, async_=True, keep_last=config.keep_last
            )
    if pending is not None:
        pending.wait()
    return samples


# ---------------------------------------------------------------------------------- analysis


def slope(steps: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` against ``steps`` (units per step)."""
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0])


def analyse(
    samples: list[dict[str, float]],
    *,
    warmup_steps: int,
    rss_limit: float = RSS_FLAT_BYTES_PER_STEP,
    tensors_limit: float = TENSORS_FLAT_PER_STEP,
    tensor_bytes_limit: float = TENSOR_BYTES_FLAT_PER_STEP,
) -> dict[str, Any]:
    """Slopes of one rank's series after ``warmup_steps``, each with its limit and verdict.

    A series is flat when its slope is below the limit: only growth is a leak (RSS may shrink
    when the allocator returns memory).

    Raises:
        ValueError: with fewer than 3 samples after the warm-up.
    """
    kept = [s for s in samples if s["step"] > warmup_steps]
    if len(kept) < 3:
        raise ValueError(f"{len(kept)} samples after step {warmup_steps}; need at least 3")
    steps = [s["step"] for s in kept]
    result: dict[str, Any] = {"from_step": steps[0], "to_step": steps[-1], "samples": len(kept)}
    for key, limit in (
        ("rss_bytes", rss_limit),
        ("tensors", tensors_limit),
        ("tensor_bytes", tensor_bytes_limit),
    ):
        per_step = slope(steps, [s[key] for s in kept])
        result[key] = {
            "slope_per_step": per_step,
            "limit_per_step": limit,
            "flat": per_step < limit,
            "first": kept[0][key],
            "last": kept[-1][key],
        }
    result["flat"] = all(result[key]["flat"] for key in ("rss_bytes", "tensors", "tensor_bytes"))
    return result


def plot(samples_by_rank: list[list[dict[str, float]]], warmup_steps: int, path: Path) -> None:
    """RSS and live tensor bytes and count against step, one line per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=110)
    series = (
        ("rss_bytes", "RSS (MiB)", KIB * KIB),
        ("tensor_bytes", "live tensor KiB", KIB),
        ("tensors", "live tensors", 1),
    )
    for axis, (key, label, unit) in zip(axes, series, strict=True):
        for rank, samples in enumerate(samples_by_rank):
            axis.plot(
                [s["step"] for s in samples], [s[key] / unit for s in samples], label=f"rank {rank}"
            )
        axis.axvline(warmup_steps, color="grey", linestyle=":", label="end of warm-up")
        axis.set_xlabel("step")
        axis.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------- launch


def _soak_world(config: SoakConfig) -> list[list[dict[str, float]]]:
    """Every rank's samples (on every rank). Collective."""
    with tempfile.TemporaryDirectory() as tmp:
        samples = run_rank(config, Path(tmp))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return gathered


def soak(config: SoakConfig, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Run the soak on ``world_size`` fresh processes; write and return the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    machine, started = describe_machine(), time.perf_counter()
    samples_by_rank = spawn(world_size, _soak_world, config)
    warmup_steps = int(config.steps * config.warmup_fraction)
    analyses = [analyse(samples, warmup_steps=warmup_steps) for samples in samples_by_rank]
    report = {
        "config": dataclasses.asdict(config),
        "world_size": world_size,
        "machine": machine,
        "seconds": time.perf_counter() - started,
        "warmup_steps": warmup_steps,
        "flat": all(a["flat"] for a in analyses),
        "analysis": analyses,
        "samples": samples_by_rank,
    }
    (out_dir / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(samples_by_rank, warmup_steps, out_dir / "soak.png")
    return report


def summary(report: dict[str, Any]) -> str:
    """Human-readable slopes and verdicts, one line per rank and series."""
    lines = [
        f"{report['config']['steps']} steps on {report['world_size']} ranks in "
        f"{report['seconds']:.0f} s; slopes after step {report['warmup_steps']}:"
    ]
    for rank, analysis in enumerate(report["analysis"]):
        for key, fmt in (
            ("rss_bytes", format_bytes),
            ("tensor_bytes", format_bytes),
            ("tensors", lambda v: f"{v:.0f}"),
        ):
            a = analysis[key]
            lines.append(
                f"  rank {rank} {key:<12} {a['slope_per_step']:+.4g}/step (limit "
                f"{a['limit_per_step']:g}) {fmt(a['first'])} -> {fmt(a['last'])}: "
                + ("flat" if a["flat"] else "GROWING")
            )
    lines.append("verdict: " + ("flat" if report["flat"] else "NOT flat"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = SoakConfig()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--sample-every", type=int, default=defaults.sample_every)
    p.add_argument("--save-every", type=int, default=defaults.save_every)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    config = SoakConfig(
        steps=args.steps, sample_every=args.sample_every, save_every=args.save_every
    )
    report = soak(config, args.world_size, args.out)
    print(summary(report), flush=True)
    return 0 if report["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
