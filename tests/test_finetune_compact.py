"""The fine-tuning job with ``--optimizer compactadamw``: bfloat16 weights by default, stepped
in backward with gradient accumulation and clipping, and a resumed run equal to the
uninterrupted one (2 ranks of the persistent world)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import torch

from fused_optim_dist import checkpoint
from fused_optim_dist_recipes.metrics import read_metrics

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune.py"
COMPACT = "fused_optim_dist.compact_adamw.CompactAdamW"
# 12 steps of the tiny preset, 2 micro-batches per step, clipping in backward, checkpoints at
# steps 6 and 12.
JOB = [
    "--model", "tiny", "--seq-len", "32", "--batch-size", "8", "--warmup-steps", "2",
    "--lr", "1e-2", "--log-every", "6", "--eval-tokens", "2048", "--sample-tokens", "0",
    "--eval-every", "0", "--max-steps", "12", "--grad-accum", "2", "--save-every", "6",
    "--max-grad-norm", "0.5", "--optimizer", "compactadamw",
]  # fmt: skip


def _load_script():
    spec = importlib.util.spec_from_file_location("finetune_compact_job", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


finetune = _load_script()


def test_compact_optimizer_flag_picks_bf16_weights(tmp_path):
    out = ["--output-dir", str(tmp_path)]
    cfg = finetune.parse_args(["--optimizer", "compactadamw", *out])
    assert (cfg.optimizer, cfg.param_dtype) == (COMPACT, "bfloat16")
    cfg = finetune.parse_args(["--optimizer", "compactadamw", "--param-dtype", "float32", *out])
    assert cfg.param_dtype == "float32"
    assert finetune.parse_args(out).param_dtype == "float32"


def _run_main(argv: list[str]) -> dict:
    """Test body: the job's ``main`` on every rank of the already-initialised world."""
    return finetune.main(argv)


def _losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(output_dir / "metrics.jsonl")}


def test_compact_job_learns_and_resumes_exactly(worlds, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    worlds.run(2, _run_main, argv=[*JOB, "--output-dir", str(straight)])
    config = (straight / "config.json").read_text()
    assert '"param_dtype": "bfloat16"' in config and COMPACT in config
    losses = _losses(straight)
    assert losses[12] < losses[1] - 1.0, losses
    weights = torch.load(straight / "weights.pt", weights_only=True)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}

    # Interrupted after the step-6 checkpoint, resumed: the same losses, bit for bit.
    shutil.copytree(straight, resumed)
    shutil.rmtree(checkpoint.latest(resumed / "checkpoints"))
    worlds.run(2, _run_main, argv=[*JOB, "--resume", "--output-dir", str(resumed)])
    got = _losses(resumed)
    assert sorted(got) == sorted(losses)
    assert all(got[step] == losses[step] for step in range(7, 13)), (got, losses)
