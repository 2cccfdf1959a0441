"""A rank killed mid-training or mid-checkpoint: torchrun restarts the job, which resumes from
the newest complete checkpoint and ends with the uninterrupted run's weights and losses.

The kill comes from ``fused_optim_dist._faults`` (``FUSED_OPTIM_DIST_FAULT``), a real SIGKILL of
one worker; ``torchrun --max-restarts 1`` then restarts every worker with the same command line,
which holds ``--resume`` from the start (on an empty output directory it starts from scratch).
The reference is the same job run without a fault in the session's 2-rank world.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_finetune import REPO, SCRIPT, TINY, _env, _losses, _run_main

from fused_optim_dist import _faults
from fused_optim_dist._checkpoint_layout import complete_checkpoints
from fused_optim_dist.data import read_documents

RUN_TIMEOUT_S = 300
TOLERANCE = 1e-6
"""Eager CPU runs on the same global batches: resumed and uninterrupted runs agree to this."""
MAX_STEPS, SAVE_EVERY, KEEP_LAST = 12, 3, 2
# Accumulation and in-backward clipping (the default --max-grad-norm), whose history the
# checkpoints carry: a resumed run must match the uninterrupted one exactly.
JOB = [*TINY, "--max-steps", str(MAX_STEPS), "--grad-accum", "2", "--save-every",
       str(SAVE_EVERY), "--keep-last", str(KEEP_LAST)]
# torchrun's agent keeps one TCPStore for all attempts by default, so a restarted worker may read
# the address a killed worker published and fail to connect (pytorch/pytorch#135712); a store
# per attempt, hosted by rank 0, avoids it.
FRESH_STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# ---------------------------------------------------------------------------------- the switch

@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill:rank=1:step=7", r"missing \['when'\]"),
        ("kill:rank=1:step=7:when=after_forward", "when='after_forward': expected one of"),
        ("kill:rank=1:step=7:when=during_save:rank=0", "bad field 'rank=0'"),
        ("kill:rank=one:step=7:when=during_save", "must be integers"),
        ("kill:rank=1:step=0:when=during_save", "step >= 1"),
        ("hang:rank=1:step=7:when=during_save", "fault action 'hang'"),
        ("kill:rank=1:step=7:at=during_save", "bad field 'at=during_save'"),
    ],
)
def test_malformed_fault_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        _faults.active_fault({_faults.ENV_VAR: text})


def test_fault_fires_on_the_first_attempt_only():
    text = "kill:step=7:when=during_save:rank=1"
    fault = _faults.Fault(action="kill", rank=1, step=7, when="during_save")
    assert _faults.active_fault({_faults.ENV_VAR: text}) == fault
    assert _faults.active_fault({_faults.ENV_VAR: text, _faults.RESTART_COUNT_VAR: "0"}) == fault
    assert _faults.active_fault({_faults.ENV_VAR: text, _faults.RESTART_COUNT_VAR: "1"}) is None
    assert _faults.active_fault({}) is None
    # A malformed switch fails restarts too, rather than being ignored.
    with pytest.raises(ValueError):
        _faults.active_fault({_faults.ENV_VAR: "kill", _faults.RESTART_COUNT_VAR: "1"})


def test_no_switch_means_no_fault():
    # The test process has no fault set: every point passes.
    for when in _faults.POINTS:
        _faults.inject(when, step=1, rank=0)


# ---------------------------------------------------------------------------------- the job

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small data file: reading the whole standard library costs seconds per process."""
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in read_documents()[:3]))
    return path


@pytest.fixture(scope="module")
def uninterrupted(worlds, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    worlds.run(2, _run_main, argv=[*JOB, "--data", str(corpus), "--output-dir", str(out)])
    return out


def _run_with_fault(fault: str, corpus: Path, out: Path) -> str:
    """The job under ``torchrun --max-restarts 1`` with ``fault`` set; return its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--max-restarts", "1", str(SCRIPT), *JOB, "--resume", "--data", str(corpus),
               "--output-dir", str(out)]
    env = {**_env(), **FRESH_STORE_PER_ATTEMPT, _faults.ENV_VAR: fault}
    proc = subprocess.run(command, cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


def _assert_same_run(run: Path, reference: Path) -> None:
    """Same losses at every step and the same exported weights, tensor by tensor."""
    got, want = _losses(run), _losses(reference)
    assert sorted(got) == list(range(1, MAX_STEPS + 1)), sorted(got)
    for step in want:
        assert abs(got[step] - want[step]) <= TOLERANCE, (step, got[step], want[step])
    weights = torch.load(run / "weights.pt", weights_only=True)
    reference_weights = torch.load(reference / "weights.pt", weights_only=True)
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=TOLERANCE,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _assert_checkpoints_clean(run: Path) -> None:
    """The last ``KEEP_LAST`` saves are committed; no partial save is left over."""
    directory = run / "checkpoints"
    steps = [step for step, _ in complete_checkpoints(directory)]
    assert steps == list(range(MAX_STEPS - SAVE_EVERY * (KEEP_LAST - 1), MAX_STEPS + 1,
                               SAVE_EVERY))
    assert sorted(p.name for p in directory.iterdir()) == [f"step_{s:06d}" for s in steps]


def _assert_killed_then_resumed(output: str, fault: str, resumed_from: int) -> None:
    fault = _faults.parse(fault)
    fired = f"killing rank {fault.rank} at step {fault.step} ({fault.when})"
    assert output.count(fired) == 1, output[-6000:]
    # The first attempt, on an empty output directory, started from scratch despite --resume.
    assert f"steps 1..{MAX_STEPS} (--resume: no checkpoint yet)" in output, output[-6000:]
    assert f"steps {resumed_from + 1}..{MAX_STEPS} (resumed from step {resumed_from})" in output, (
        output[-6000:])


@pytest.mark.slow
def test_rank_killed_after_backward_resumes_from_the_newest_checkpoint(
    uninterrupted, corpus, tmp_path
):
    fault = "kill:rank=1:step=7:when=after_backward"
    output = _run_with_fault(fault, corpus, tmp_path)
    # Step 6's save was written in the background but is committed only by the next save
    # (step 9), so step 3 is the newest complete checkpoint when rank 1 dies at step 7.
    _assert_killed_then_resumed(output, fault, resumed_from=3)
    _assert_same_run(tmp_path, uninterrupted)
    _assert_checkpoints_clean(tmp_path)


@pytest.mark.slow
def test_rank_killed_during_a_save_resumes_from_the_previous_checkpoint(
    uninterrupted, corpus, tmp_path
):
    # Rank 0 (which commits) dies while step 9's shards are being written; the save of step 9
    # committed step 6 first.
    fault = "kill:rank=0:step=9:when=during_save"
    output = _run_with_fault(fault, corpus, tmp_path)
    _assert_killed_then_resumed(output, fault, resumed_from=6)
    _assert_same_run(tmp_path, uninterrupted)
    _assert_checkpoints_clean(tmp_path)
