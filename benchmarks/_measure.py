"""The body every rank runs: for each shape and scaling, build every method on the same
weights, warm up, measure one step's memory, then time steps with the methods interleaved.

Interleaving (method order rotated every step) exposes every method to the same machine
noise, so ratios between methods stay meaningful on a shared or oversubscribed machine.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from benchmarks._config import SweepConfig
from benchmarks._memory import StepTracker, lower_bound
from benchmarks._methods import METHODS, Runner
from benchmarks._shapes import Batch, Shape, get_shape
from fused_optim_dist_recipes.models import apply_fsdp

__all__ = ["build_runner", "check_batches", "make_batches", "per_rank_batch", "run_world"]

MS_PER_S = 1e3


class StepTime(NamedTuple):
    """One timed step on one rank, in seconds."""

    fwd_bwd: float
    """Wall time of forward and backward (an in-backward optimizer steps in here)."""
    after_backward: float
    """Wall time of what the loop runs after backward (clipping, ``step()``, ``zero_grad()``)."""
    cpu: float
    """CPU time the rank's process used in the whole step (all its threads): unlike wall time,
    it does not grow when other processes compete for the cores."""


ONE_RANK_SCALING = "both"
"""The scaling recorded for one-rank runs, which serve strong and weak scaling alike."""


def run_world(config: SweepConfig) -> list[dict[str, Any]]:
    """Run every shape and scaling of ``config`` in this process group (collective).

    Returns the records on rank 0 and ``[]`` on the other ranks.
    """
    world_size = dist.get_world_size()
    mesh = init_device_mesh(config.device, (world_size,))
    # At one rank, strong and weak scaling are the same run.
    scalings = (ONE_RANK_SCALING,) if world_size == 1 else config.scalings
    records: list[dict[str, Any]] = []
    for shape_name in config.shapes:
        shape = get_shape(shape_name, quick=config.quick)
        for scaling in scalings:
            records += _run_case(config, shape, scaling, mesh)
    return records


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def per_rank_batch(shape: Shape, scaling: str, world_size: int, config: SweepConfig) -> int:
    per_rank = shape.batch_size // world_size if scaling == "strong" else shape.batch_size
    if scaling == "strong" and shape.batch_size % world_size:
        raise ValueError(
            f"shape {shape.name}: global batch {shape.batch_size} does not split over "
            f"{world_size} ranks for strong scaling; choose world sizes that divide it"
        )
    accumulating = any(METHODS[name].accumulates for name in config.methods)
    if accumulating and per_rank % config.micro_batches:
        raise ValueError(
            f"shape {shape.name}: {per_rank} samples per rank do not split into "
            f"{config.micro_batches} micro-batches; lower --micro-batches"
        )
    return per_rank


def check_batches(config: SweepConfig) -> None:
    """Raise ``ValueError`` now for any world size, shape and scaling whose batch won't split."""
    for world_size in config.world_sizes:
        for name in config.shapes:
            for scaling in config.scalings:
                per_rank_batch(get_shape(name, quick=config.quick), scaling, world_size, config)


def make_batches(shape: Shape, config: SweepConfig, per_rank: int) -> Callable[[int], Batch]:
    """Step -> this rank's share of the step's global batch (the same for every method)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def batch(step: int) -> Batch:
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        inputs, targets = shape.make_batch(generator, per_rank * world_size)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return inputs[rows].to(config.device), targets[rows].to(config.device)

    return batch


def build_runner(shape: Shape, config: SweepConfig, mesh: DeviceMesh, method: str) -> Runner:
    torch.manual_seed(config.seed)
    with torch.device(config.device):
        model = shape.build()
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.bf16
        else None
    )
    apply_fsdp(model, mesh=mesh, mp_policy=mp_policy, activation_checkpointing=shape.checkpointing)
    return METHODS[method].build(model, shape.loss, config)


def _memory_step(runner: Runner, batch: Batch, baseline: int, config: SweepConfig) -> dict:
    """Run one step under the tracker; this rank's peak, by kind, and its lower bound."""
    gc.collect()
    if config.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = StepTracker(runner.model, runner.state_tensors(), config.device)
    with tracker:
        tracker.track_inputs(batch)
        # FSDPMemTracker follows one forward of the root per step unless told a new one starts.
        runner.forward_backward(*batch, between_micro_batches=tracker.reset_mod_stats)
        with tracker.after_backward():
            runner.optimizer_step()
    peak, by_kind, by_category = tracker.peak()
    bound = lower_bound(
        runner.model,
        runner.state_tensors(),
        tracker.activation_peak,
        torch.bfloat16 if config.bf16 else None,
    )
    memory = {
        "peak_bytes": peak,
        "peak_by_kind": by_kind,
        "peak_by_category": by_category,
        "lower_bound": bound,
    }
    if config.device == "cuda":
        _sync(config.device)
        memory["allocator_peak_bytes"] = torch.cuda.max_memory_allocated() - baseline
    return memory


def _timed_steps(
    runners: dict[str, Runner],
    batch: Callable[[int], Batch],
    first_step: int,
    config: SweepConfig,
) -> dict[str, list[StepTime]]:
    """Each method's timed steps on this rank, the methods interleaved."""
    names = list(runners)
    times: dict[str, list[StepTime]] = {name: [] for name in names}
    gc.collect()
    for index in range(config.timed_steps if names else 0):
        inputs, targets = batch(first_step + index)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            dist.barrier()
            _sync(config.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            runner.forward_backward(inputs, targets)
            _sync(config.device)
            backward_done = time.perf_counter()
            runner.optimizer_step()
            _sync(config.device)
            times[name].append(
                StepTime(
                    fwd_bwd=backward_done - start,
                    after_backward=time.perf_counter() - backward_done,
                    cpu=time.process_time() - start_cpu,
                )
            )
    return times


def _shape_info(runner: Runner, shape: Shape) -> dict[str, int]:
    params = [p for p in runner.model.parameters() if p.requires_grad]
    return {
        "n_params": sum(p.numel() for p in params),
        "n_tensors": len(params),
        "n_units": sum(1 for m in runner.model.modules() if isinstance(m, FSDPModule)),
        "checkpointing": shape.checkpointing,
    }


def _run_case(
    config: SweepConfig, shape: Shape, scaling: str, mesh: DeviceMesh
) -> list[dict[str, Any]]:
    world_size = dist.get_world_size()
    per_rank = per_rank_batch(shape, scaling, world_size, config)
    batch = make_batches(shape, config, per_rank)
    case = {
        "world_size": world_size,
        "shape": shape.name,
        "bound": shape.bound,
        "scaling": scaling,
        "per_rank_batch": per_rank,
        "tokens_per_step": per_rank * world_size * shape.tokens_per_sample,
    }
    runners: dict[str, Runner] = {}
    memory: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in config.methods:
        reason = METHODS[name].missing()
        if reason is not None:
            skipped[name] = reason
            continue
        baseline = _allocated(config.device)
        runner = build_runner(shape, config, mesh, name)
        for step in range(config.warmup_steps):
            runner.forward_backward(*batch(step))
            runner.optimizer_step()
        memory[name] = _memory_step(runner, batch(config.warmup_steps), baseline, config)
        runners[name] = runner
        case.update(_shape_info(runner, shape))
    times = _timed_steps(runners, batch, config.warmup_steps + 1, config)
    runners.clear()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (memory, times))
    if dist.get_rank() != 0:
        return []
    records = [{**case, "method": name, "skipped": reason} for name, reason in skipped.items()]
    for name in memory:
        records.append(
            {
                **case,
                "method": name,
                "skipped": None,
                **_combine(
                    [g[0][name] for g in gathered],
                    [g[1][name] for g in gathered],
                    case["tokens_per_step"],
                ),
            }
        )
    return records


def _combine(memories: list[dict], times: list[list[StepTime]], tokens: int) -> dict:
    """Across ranks: the slowest rank at every step, the rank with the highest peak."""
    steps = list(zip(*times, strict=True))  # per step: every rank's StepTime

    def median_ms(value: Callable[[StepTime], float]) -> float:
        return statistics.median(max(map(value, step)) for step in steps) * MS_PER_S

    total = [max(t.fwd_bwd + t.after_backward for t in step) for step in steps]
    step_s = statistics.median(total)
    worst = max(memories, key=lambda m: m["peak_bytes"])
    return {
        "step_ms": step_s * MS_PER_S,
        "step_ms_all": [t * MS_PER_S for t in total],
        "fwd_bwd_ms": median_ms(lambda t: t.fwd_bwd),
        "after_backward_ms": median_ms(lambda t: t.after_backward),
        "step_cpu_ms": median_ms(lambda t: t.cpu),
        "tokens_per_s": tokens / step_s,
        **worst,
    }
