"""Smoke tests of the CompactAdamW benchmarks: the analytic bytes per parameter against the
state a step creates, the cost benchmark end to end at a tiny size, the quality summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import (
    compact_adamw_cost,
    compact_adamw_memory,
    compact_adamw_momentum_codes,
    compact_adamw_quality,
)
from fused_optim_dist.compact_adamw import CompactAdamW
from fused_optim_dist_recipes.models import PRESETS, Llama


@pytest.mark.parametrize(
    ("method", "low", "high"),
    [("compact-in-backward", 5.125, 5.6), ("compact-4bit-in-backward", 4.625, 5.1)],
)
def test_analytic_bytes_match_the_state_a_step_creates(method, low, high):
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"]).to(torch.bfloat16)
    params = list(model.parameters())
    optim = CompactAdamW(params, variance_bits=compact_adamw_memory.COMPACT[method])
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()
    held = sum(p.numel() * p.element_size() for p in params)
    steps = 0
    for entry in optim.state.values():
        for key, value in entry.items():
            if key == "step":
                steps += value.numel() * value.element_size()
            else:
                held += value.numel() * value.element_size()
    numel = sum(p.numel() for p in params)
    analytic = compact_adamw_memory.analytic_bytes_per_param(model, method)
    assert held / numel == analytic
    assert low <= analytic < high  # the tiny preset's 32-wide rows and its norms


def test_cost_benchmark_runs(tmp_path):
    argv = ["--shapes", "many-tiny", "--steps", "3", "--rounds", "1", "--out", str(tmp_path)]
    compact_adamw_cost.main(argv)
    text = (tmp_path / "compact_adamw_cost.md").read_text()
    for method in compact_adamw_cost.compact_methods("cpu"):
        assert f"| many-tiny | {method} |" in text
    # The structure and the arithmetic only: timings are for the benchmark to judge.
    result = json.loads((tmp_path / "compact_adamw_cost.json").read_text())["results"]["many-tiny"]
    (round_,) = result["rounds"]
    medians = round_["median_ms"]
    for method in compact_adamw_cost.compact_methods("cpu"):
        for key, baseline in (("ratio", "adamw-fused"), ("step_ratio", "adamw-fused-step")):
            assert round_[key][method] == medians[method] / medians[baseline]
            assert result[f"{key}_median"][method] == round_[key][method]
    assert result["profile_top"] and 0 < result["kernel_share"] < 1


@pytest.mark.gpu
def test_cost_benchmark_runs_on_cuda(tmp_path):
    """The GPU's methods only (the Triton kernel, no C kernel), timed between CUDA
    synchronizations."""
    argv = ["--device", "cuda", "--shapes", "many-tiny", "--steps", "3", "--rounds", "1"]
    compact_adamw_cost.main([*argv, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "compact_adamw_cost_cuda.json").read_text())["results"]
    (round_,) = result["many-tiny"]["rounds"]
    methods = ["compact-triton", "compact-triton-4bit", "compact-compile", "compact-eager"]
    assert result["many-tiny"]["methods"] == methods
    assert set(round_["ratio"]) == set(methods)
    assert "| many-tiny | compact-eager |" in (tmp_path / "compact_adamw_cost_cuda.md").read_text()


def test_quality_summary_against_the_reference_spread():
    runs = {
        "adamw-fp32/0": [3.0, 2.0, 1.0],
        "adamw-fp32/1": [3.0, 2.0, 1.2],
        "compact/0": [3.0, 2.0, 1.1],
        "compact/1": [3.0, 2.0, 1.5],
    }
    summary = compact_adamw_quality._summaries(runs)
    assert summary["compact"]["final"] == [1.1, 1.5]
    verdict = compact_adamw_quality._within(summary["compact"]["final"], [1.0, 1.2])
    assert verdict == "1/2 inside, 0 below; mean above"


def test_momentum_codes_zero_what_linear_levels_cannot_hold():
    """Elements at 1/300 of their group's largest lie below half a linear level (1/254) and
    above half a companded one (about 1/508): linear codes lose them, companded ones keep
    them; a one-dim parameter's elements are groups of one, never zeroed."""
    momentum = torch.full((2, 64), 1 / 300)
    momentum[:, ::32] = 1.0
    norm = torch.tensor([1e-3, -2.0, 5e-7])
    state = {
        "layers.0.feed_forward.w1.weight": {"exp_avg": momentum, "exp_avg_sq": momentum.abs()},
        "layers.0.ffn_norm.weight": {"exp_avg": norm, "exp_avg_sq": norm.square()},
        # All zeros (a parameter that never had a gradient): nothing to code, nothing lost.
        "tok_embeddings.weight": {"exp_avg": torch.zeros(2, 32), "exp_avg_sq": torch.zeros(2, 32)},
    }
    measured = compact_adamw_momentum_codes.measure(state, eps=1e-8)
    linear, companded = (measured["feed_forward"][c] for c in ("linear", "companded"))
    assert linear["zeroed"] == 124 / 128 and companded["zeroed"] == 0
    assert companded["update_error"] < linear["update_error"]
    assert measured["norm"]["linear"]["zeroed"] == measured["norm"]["companded"]["zeroed"] == 0
    assert measured["all"]["elements"] == 128 + 3 + 64
    for coding in ("linear", "companded"):
        assert measured["embedding"][coding] == dict.fromkeys(
            ("zeroed", "momentum_error", "update_error"), 0.0
        )
    decoded = compact_adamw_momentum_codes.coded(momentum, compand=True)
    assert decoded[:, ::32].eq(1.0).all() and decoded.gt(0).all()
    payload = {
        "config": {"steps": 1, "seed": 0},
        "machine": compact_adamw_momentum_codes.describe_machine(),
        "steps": {"1": measured},
    }
    table = compact_adamw_momentum_codes.markdown(payload)
    assert "| 1 | feed_forward | 128 | linear | 96.88% |" in table
    assert "| 1 | attention |" not in table  # no such parameter
