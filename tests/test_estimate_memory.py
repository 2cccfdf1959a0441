"""The memory estimate: a simulation on fake tensors and a fake process group, checked against
the same step run on real tensors on 2 and 3 gloo ranks.

The reference is the CPU allocator's peak during the tracked step (``measure``: torch.profiler
allocation events), the median of three tracked steps, since gloo's worker thread releases its
buffers at slightly different moments each step. The estimate compared with it is the
simulation of that gloo job, which holds gloo's reduce-scatter buffer (see [Note: gloo's
reduce-scatter buffer] in ``memory_tracking.py``); the estimate for NCCL leaves it out and is
checked to be the smaller one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fused_optim_dist_recipes.memory_estimate import (
    GIB,
    EstimateConfig,
    Margin,
    estimate,
    measure,
    verdict,
)
from fused_optim_dist_recipes.memory_tracking import KINDS
from fused_optim_dist_recipes.models import PRESETS, Llama

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10
"""Largest relative error of the estimate against the measured peak."""
FIDELITY = 0.05
"""Largest relative difference of the tracker's peak on fake and on real tensors: the same
accounting of the same step, apart from gloo's timing."""
MEASURED_STEPS = 3
SIMULATED = ("plain", "in-backward", "compact")
"""Every method: each runs on fake tensors, and for real on gloo (the compact one with its
eager update, the one a GPU runs)."""

# One parameter-heavy workload (the peak near the gradients, where the methods differ) on 2
# ranks, without activation checkpointing; one activation-heavy workload on 3, with it.
WORKLOADS = {
    2: {"batch_per_rank": 1, "seq_len": 32, "activation_checkpointing": False},
    3: {"batch_per_rank": 4, "seq_len": 128, "activation_checkpointing": True},
}


def _configs(world_size: int) -> list[EstimateConfig]:
    load = WORKLOADS[world_size]
    return [
        EstimateConfig(
            model="small",
            world_size=world_size,
            batch_size=load["batch_per_rank"] * world_size,
            seq_len=load["seq_len"],
            activation_checkpointing=load["activation_checkpointing"],
            max_grad_norm=1.0,
            methods=(method,),
        )
        for method in SIMULATED
    ]


def _measure_body(ranks: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for config in _configs(ranks):
        torch.manual_seed(0)
        measured = measure(config, config.methods[0], steps=MEASURED_STEPS)
        out.append((measured.allocator_peaks, [p.total for p in measured.tracker]))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_estimate_within_ten_percent_of_real_gloo_runs(worlds, world_size: int) -> None:
    rank0 = worlds.run(world_size, _measure_body, ranks=world_size)[0]
    errors = []
    for config, (allocator, tracker) in zip(_configs(world_size), rank0, strict=True):
        measured = statistics.median(allocator)
        gloo = estimate(dataclasses.replace(config, gloo_reduce_scatter_buffer=True))[0]
        nccl = estimate(config)[0]
        error = gloo.peak.total / measured - 1
        case = f"{config.methods[0]}, AC {config.activation_checkpointing}"
        errors.append(f"{case}: {error:+.1%}")
        assert abs(error) <= TOLERANCE, (
            f"{case}: estimate {gloo.peak.total} B vs measured {measured} B ({error:+.1%})"
        )
        assert nccl.peak.total <= gloo.peak.total
        fidelity = nccl.peak.total / statistics.median(tracker) - 1
        assert abs(fidelity) <= FIDELITY, f"{case}: fake vs real tracker {fidelity:+.1%}"
    print(f"{world_size} ranks: " + "; ".join(errors))


def test_breakdown_adds_up_and_the_state_is_the_sharded_state() -> None:
    config = EstimateConfig(
        model="small", world_size=4, batch_size=4, seq_len=16, methods=("plain", "in-backward")
    )
    plain, ours = estimate(config)
    # AdamW in fp32: exp_avg and exp_avg_sq per local element, plus one step count per tensor.
    with torch.device("meta"):
        model = Llama(PRESETS["small"])
    local = sum(-(-p.shape[0] // 4) * p[0].numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    for result in (plain, ours):
        peak = result.peak
        assert sum(peak.by_kind.values()) == peak.total
        assert set(peak.by_kind) == set(KINDS)
        assert 2 * local * 4 <= peak.by_kind["optimizer_state"] <= 2 * local * 4 + 8 * tensors
        assert peak.by_kind["parameters"] >= local * 4
    # Parameter-heavy step: in backward, no parameter holds a gradient at the plain peak.
    assert ours.peak.total < plain.peak.total
    assert ours.peak.by_kind["gradients"] < plain.peak.by_kind["gradients"]


def test_4_bit_variance_holds_half_a_byte_less_state_per_element() -> None:
    """``compact-4bit``: CompactAdamW's state with ``variance_bits=4``, against the 8-bit one:
    half a byte less per element of each matrix's local shard. (Its eager step's float64
    square roots are temporaries of a unit: on this small model the peak is not lower.)"""
    config = EstimateConfig(
        model="small", world_size=2, batch_size=2, seq_len=16, methods=("compact", "compact-4bit")
    )
    eight, four = estimate(config)
    with torch.device("meta"):
        model = Llama(PRESETS["small"])
    rows = [(-(-p.shape[0] // 2), p[0].numel()) for p in model.parameters() if p.dim() >= 2]
    saved = sum(r * (length - -(-length // 2)) for r, length in rows)
    state = "optimizer_state"
    assert eight.peak.by_kind[state] - four.peak.by_kind[state] == saved


def test_hsdp_and_a_512_rank_world_in_one_process() -> None:
    tiny = dict(model="tiny", seq_len=16, methods=("in-backward",))
    hsdp = estimate(EstimateConfig(world_size=4, hsdp_replicas=2, batch_size=4, **tiny))[0]
    fsdp2 = estimate(EstimateConfig(world_size=2, batch_size=2, **tiny))[0]
    # HSDP 2 x 2 shards like FSDP on 2 ranks: the same sharded state.
    assert hsdp.peak.by_kind["optimizer_state"] == fsdp2.peak.by_kind["optimizer_state"]
    big = estimate(EstimateConfig(world_size=512, batch_size=512, **tiny))[0]
    assert big.peak.by_kind["optimizer_state"] < fsdp2.peak.by_kind["optimizer_state"]


def test_verdict_counts_the_margin() -> None:
    margin = Margin(fixed_gib=2.0, fraction=0.1)
    assert verdict(70 * GIB, margin, 80.0) == "fits a 80.0 GiB GPU with 1.0 GiB to spare (est.)"
    assert verdict(72 * GIB, margin, 80.0).startswith("does not fit a 80.0 GiB GPU: 1.2 GiB")
    with pytest.raises(ValueError, match="margin"):
        Margin(fraction=1.5)


def test_config_errors_name_the_flags() -> None:
    with pytest.raises(ValueError, match="--hsdp-replicas 3 must divide --world-size 8"):
        EstimateConfig(world_size=8, hsdp_replicas=3)
    with pytest.raises(ValueError, match="--batch-size 6"):
        EstimateConfig(world_size=4, batch_size=6)
    with pytest.raises(ValueError, match="unknown model"):
        EstimateConfig(model="llama-9000")


def test_script_prints_peaks_breakdown_location_and_verdict(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("estimate", REPO / "scripts/estimate_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "estimate.json"
    text = script.main(
        ["--model", "tiny", "--world-size", "2", "--seq-len", "16", "--batch-size", "2"]
        + ["--activation-checkpointing", "--methods", "plain", "in-backward"]
        + ["--json", str(out)]
    )
    assert capsys.readouterr().out.strip() == text.strip()
    for method in ("plain", "in-backward"):
        assert f"| {method} |" in text
        assert f"{method}: fits a 79.6 GiB GPU" in text
    assert "peak at (phase, module)" in text and "estimate" in text
    assert "NCCL and cuBLAS workspaces" in text
    payload = json.loads(out.read_text())
    assert [r["method"] for r in payload["results"]] == ["plain", "in-backward"]
    assert all(r["peak_phase"] for r in payload["results"])


@pytest.mark.slow
def test_finetune_estimate_memory_prints_and_exits(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "scripts/finetune.py", "--model", "tiny", "--estimate-memory"]
        + ["--output-dir", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Estimated peak memory per rank" in run.stdout
    assert "This job steps the optimizer in backward" in run.stdout
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_estimate_leaves_no_process_group_and_the_default_dtype() -> None:
    # It runs in the caller's process: a pure-bf16 model is built under a default dtype.
    config = EstimateConfig(model="tiny", world_size=2, batch_size=2, seq_len=16)
    estimate(dataclasses.replace(config, param_dtype="bfloat16"))
    assert not torch.distributed.is_initialized()
    assert torch.get_default_dtype() == torch.float32
