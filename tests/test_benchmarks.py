"""Smoke tests of the scaling and optimizer-cost benchmarks, into a temporary directory.

Checks the structure of what they write and the arithmetic that derives one figure from
another, never a measured time's size or sign, nor how two times compare: a cost is a
difference of two noisy CPU times, negative on a busy machine with a few steps. Only the
benchmarks themselves, run on purpose, judge timings.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RATIOS = {
    "ours_over_plain": ("ours", "plain"),
    "update_only_over_plain": ("ours-update-only", "plain"),
    "per_param_over_ours": ("per-param", "ours"),
}
"""The ratios ``benchmarks/optimizer_cost.py`` reports: name -> (numerator, denominator)."""
TIMEOUT_S = 900
"""Catches a hang only: the longest run took 157 s on 2 cores at a load average of 15 (the
suite beside two busy processes)."""
KINDS = {"parameters", "gradients", "optimizer_state", "activations", "temporaries"}


def _run_script(script: str, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_quick_run_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    _run_script("benchmarks/scaling.py", "--quick", "--out", str(tmp_path))

    payload = json.loads((tmp_path / "scaling.json").read_text())
    assert {"cpu", "logical_cores", "torch"} <= payload["machine"].keys()
    config = payload["config"]
    assert config["quick"] is True
    assert config["world_sizes"] == [1, 2] and config["scalings"] == ["strong", "weak"]
    assert len(config["shapes"]) >= 3
    expected = {
        (world, shape, scaling, method)
        for world in config["world_sizes"]
        for shape in config["shapes"]
        for scaling in (["both"] if world == 1 else config["scalings"])
        for method in config["methods"]
    }
    records = payload["records"]
    assert {(r["world_size"], r["shape"], r["scaling"], r["method"]) for r in records} == expected
    assert len(records) == len(expected)

    measured = [r for r in records if r["skipped"] is None]
    assert {r["method"] for r in measured} >= {"plain", "per-param", "ours", "ours+accum+clip"}
    for r in records:
        assert r["skipped"] is None or (isinstance(r["skipped"], str) and r["skipped"])
    for r in measured:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
        assert len(r["step_ms_all"]) == config["timed_steps"]
        assert set(r["peak_by_kind"]) == KINDS
        assert sum(r["peak_by_kind"].values()) == r["peak_bytes"] > 0
        bound = r["lower_bound"]
        assert bound["total"] == sum(v for k, v in bound.items() if k != "total") > 0

    table = (tmp_path / "scaling.md").read_text()
    assert "## Summary" in table
    for shape in config["shapes"]:
        assert f"## {shape} (" in table
    for scaling in config["scalings"]:
        assert (tmp_path / f"scaling_{scaling}.png").stat().st_size > 0


@pytest.mark.slow
def test_optimizer_cost_writes_rounds_profile_and_floor(tmp_path: Path) -> None:
    steps, repeats = 8, 2
    _run_script(
        "benchmarks/optimizer_cost.py",
        *("--shapes", "llama-tiny", "--repeats", str(repeats), "--steps", str(steps)),
        *("--out", str(tmp_path)),
    )

    payload = json.loads((tmp_path / "optimizer_cost.json").read_text())
    assert payload["world_size"] == 2
    assert {"load_before", "load_after"} <= payload.keys()
    (record,) = payload["records"]
    assert record["shape"] == "llama-tiny" and record["steps_per_round"] == steps
    assert len(record["rounds"]) == repeats
    for round_ in record["rounds"]:
        for method in ("plain", "ours", "ours-update-only", "per-param"):
            q1, median, q3 = (round_[method][f"cost_ms_{k}"] for k in ("q1", "median", "q3"))
            assert q1 <= median <= q3
        # Each ratio is the ratio of the recorded medians.
        for ratio, (numerator, denominator) in RATIOS.items():
            assert round_[ratio] == pytest.approx(
                round_[numerator]["cost_ms_median"] / round_[denominator]["cost_ms_median"],
                rel=1e-12,
            )
    for ratio in RATIOS:
        values = [round_[ratio] for round_ in record["rounds"]]
        spread = record["spread"][ratio]
        assert spread["median"] == pytest.approx(statistics.median(values), rel=1e-12)
        assert spread["half_range_pct"] == pytest.approx(
            (max(values) - min(values)) / 2 / abs(spread["median"]) * 100, rel=1e-9
        )
    # The profiler recorded the library's ranges and the fused kernel (an absent range reads
    # 0), the wrappers timed the hooks, and both floors were measured.
    profile = record["profile_ms_per_step_rank0"]
    assert profile["fused_optim_dist::step_bucket"] > 0
    assert profile["aten::_fused_adamw_"] > 0
    assert set(record["breakdown_ms_per_step_rank0"]) == {"hooks", "step", "zero_grad"}
    assert record["breakdown_ms_per_step_rank0"]["hooks"] > 0
    assert set(record["floors_ms_rank0"]) == {"adamw_fused_step", "fused_kernel"}
    assert all(math.isfinite(v) for v in record["floors_ms_rank0"].values())
    table = (tmp_path / "optimizer_cost.md").read_text()
    assert table.count("| llama-tiny | 21 |") == repeats
