"""The soak benchmark's probes and verdict, and a short soak on a 1-rank world.

The full soak (``python -m benchmarks.soak``, 3000 steps on 2 ranks) is a benchmark; here 200
steps on one rank (FSDP2 over a 1-rank gloo group: the same hooks, buckets, clipping,
accumulation and async checkpoints, at half the cost of two ranks) check that the live tensors
do not grow at all and RSS not faster than a leak would make it.
"""

from __future__ import annotations

import mmap
import tempfile
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks import soak
from fused_optim_dist_recipes.metrics import KIB

MIB = KIB * KIB
CI = soak.SoakConfig(steps=200, sample_every=40, save_every=50, warmup_fraction=0.4)
"""200 steps, 4 checkpoints (two pruned); slopes over the last 120 steps, from 3 samples (a
sample costs as much as ten steps)."""
CI_RSS_LIMIT = 32 * KIB
"""Per step. Looser than the full soak's: 100 steps after a short warm-up still see the
allocator settle (a few KiB per step measured). Leaking the tiny model's gradients each step
(about 150 KiB) exceeds it."""


def _series(key: str, values: list[float], every: int = 25) -> list[dict[str, float]]:
    other = {"rss_bytes": 300 * MIB, "tensors": 291, "tensor_bytes": 200 * KIB}
    return [{**other, "step": (i + 1) * every, key: v} for i, v in enumerate(values)]


def test_verdict_flags_growth_only():
    flat = _series("tensors", [291] * 20)
    assert soak.analyse(flat, warmup_steps=100)["flat"]
    shrinking = _series("rss_bytes", [300 * MIB - 25 * 40 * KIB * i for i in range(20)])
    assert soak.analyse(shrinking, warmup_steps=100)["flat"]
    one_tensor_per_step = _series("tensors", [291 + 25 * i for i in range(20)])
    verdict = soak.analyse(one_tensor_per_step, warmup_steps=100)
    assert not verdict["flat"] and not verdict["tensors"]["flat"]
    assert verdict["tensors"]["slope_per_step"] == pytest.approx(1.0)
    gradient_per_step = _series("rss_bytes", [300 * MIB + 25 * 40 * KIB * i for i in range(20)])
    assert not soak.analyse(gradient_per_step, warmup_steps=100)["rss_bytes"]["flat"]
    with pytest.raises(ValueError, match="2 samples after step 450; need at least 3"):
        soak.analyse(flat, warmup_steps=450)


def test_probes_see_what_is_alive():
    count, nbytes = soak.live_tensors()
    held = torch.zeros(1000)
    view = held[10:]
    count_after, nbytes_after = soak.live_tensors()
    assert count_after == count + 2  # the view is a tensor of its own ...
    assert nbytes_after == nbytes + held.untyped_storage().nbytes()  # ... on the same storage
    # 16 MiB of fresh pages, written, so resident. A tensor's memory could come from pages the
    # allocator already holds from earlier tests (already resident): an anonymous mapping
    # never does.
    rss = soak.rss_bytes()
    touched = mmap.mmap(-1, 16 * MIB)
    touched.write(b"\1" * (16 * MIB))
    assert soak.rss_bytes() - rss > 12 * MIB
    touched.close()
    del held, view


def test_probes_skip_fake_tensors():
    """A fake tensor holds no memory, and reading its storage's address raises: the probe counts
    it as a tensor and adds no bytes (``torch.compile`` run earlier in the process leaves some
    alive in its caches)."""
    count, nbytes = soak.live_tensors()
    with FakeTensorMode():
        fake = torch.zeros(1000)
    assert soak.live_tensors() == (count + 1, nbytes)
    del fake


def test_config_rejects_runs_without_enough_samples():
    with pytest.raises(ValueError, match="fewer than 3 samples after warm-up"):
        soak.SoakConfig(steps=100, sample_every=50)


def _soak_body(config: soak.SoakConfig) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        return soak.run_rank(config, Path(tmp))


@pytest.mark.slow
def test_short_soak_leaks_nothing(worlds):
    warmup = int(CI.steps * CI.warmup_fraction)
    (samples,) = worlds.run(1, _soak_body, config=CI)
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in samples)
    verdict = soak.analyse(samples, warmup_steps=warmup, rss_limit=CI_RSS_LIMIT)
    assert verdict["flat"], verdict
