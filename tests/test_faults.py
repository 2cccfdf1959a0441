"""Ranks killed mid-training and mid-checkpoint: torchrun restarts the job, which resumes from
the newest complete checkpoint each time and ends with the uninterrupted run's weights and losses.

The kills come from ``fused_optim_dist._faults`` (``FUSED_OPTIM_DIST_FAULT``), a real SIGKILL of
one worker; ``torchrun --max-restarts`` then restarts every worker with the same command line,
which holds ``--resume`` from the start (on an empty output directory it starts from scratch).
Both kinds of kill share one torchrun job, one per attempt, since each launch costs seconds of
process start-up. The reference is the same job run without a fault in the session's 2-rank
world.
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
        ("kill:rank=1:step=7:when=during_save:attempt=-1", "attempt >= 0"),
        ("kill:rank=1:step=7:when=during_save,", r"missing \['rank', 'step', 'when'\]"),
    ],
)
def test_malformed_fault_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        _faults.active_faults({_faults.ENV_VAR: text})


def _on_attempt(text: str, attempt: int | None) -> list[_faults.Fault]:
    environ = {_faults.ENV_VAR: text}
    if attempt is not None:
        environ[_faults.RESTART_COUNT_VAR] = str(attempt)
    return _faults.active_faults(environ)


def test_a_fault_fires_on_one_attempt_the_first_by_default():
    first = _faults.Fault(action="kill", rank=1, step=7, when="during_save")
    assert _on_attempt("kill:step=7:when=during_save:rank=1", None) == [first]
    assert _on_attempt("kill:step=7:when=during_save:rank=1", 0) == [first]
    assert _on_attempt("kill:step=7:when=during_save:rank=1", 1) == []
    both = "kill:rank=1:step=7:when=during_save,kill:rank=0:step=2:when=after_backward:attempt=1"
    second = _faults.Fault(action="kill", rank=0, step=2, when="after_backward", attempt=1)
    assert [_on_attempt(both, attempt) for attempt in (0, 1, 2)] == [[first], [second], []]
    assert _faults.active_faults({}) == []
    # A malformed switch fails restarts too, rather than being ignored.
    with pytest.raises(ValueError):
        _on_attempt("kill", 1)


def test_no_switch_means_no_fault():
    # The test process has no fault set: every point passes.
    for when in _faults.POINTS:
        _faults.inject(when, step=1, rank=0)


# ---------------------------------------------------------------------------------- the job

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small data file, this package's own source: reading the default corpus (the standard
    library) costs seconds per process."""
    docs = [f.read_text() for f in sorted((REPO / "fused_optim_dist").glob("*.py"))]
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return path


@pytest.fixture(scope="module")
def uninterrupted(worlds, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    worlds.run(2, _run_main, argv=[*JOB, "--data", str(corpus), "--output-dir", str(out)])
    return out


def _run_with_faults(faults: str, corpus: Path, out: Path) -> str:
    """The job under torchrun, restarted after each of ``faults``; return its output."""
    restarts = len(_faults.parse(faults))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--max-restarts", str(restarts), str(SCRIPT), *JOB, "--resume", "--data",
               str(corpus), "--output-dir", str(out)]
    env = {**_env(), **FRESH_STORE_PER_ATTEMPT, _faults.ENV_VAR: faults}
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


def _assert_in_order(output: str, lines: list[str]) -> None:
    """Each of ``lines`` appears in ``output`` once, in this order."""
    found = []
    for line in lines:
        assert output.count(line) == 1, f"{line!r} appears {output.count(line)} times\n" + (
            output[-6000:])
        found.append(output.index(line))
    assert found == sorted(found), f"out of order: {lines}\n{output[-6000:]}"


def _banner(resumed_from: int) -> str:
    return f"steps {resumed_from + 1}..{MAX_STEPS} (resumed from step {resumed_from})"


# Rank 1 dies after step 7's backward on the first attempt; rank 0, which commits checkpoints,
# dies on the second attempt right after step 9's asynchronous save started writing.
FAULTS = "kill:rank=1:step=7:when=after_backward,kill:rank=0:step=9:when=during_save:attempt=1"


@pytest.mark.slow
def test_ranks_killed_mid_step_and_mid_save_resume_from_the_newest_complete_checkpoint(
    uninterrupted, corpus, tmp_path
):
    output = _run_with_faults(FAULTS, corpus, tmp_path)
    _assert_in_order(output, [
        # The first attempt, on an empty output directory, starts from scratch despite --resume.
        f"steps 1..{MAX_STEPS} (--resume: no checkpoint yet)",
        "killing rank 1 at step 7 (after_backward) on attempt 0",
        # Step 6's save was written in the background but is committed only by the next save
        # (step 9), so step 3 is the newest complete checkpoint when rank 1 dies at step 7.
        _banner(resumed_from=3),
        "killing rank 0 at step 9 (during_save) on attempt 1",
        # Step 9's save committed step 6 before it started; its own partial folder is ignored
        # (and removed by the next commit).
        _banner(resumed_from=6),
    ])
    _assert_same_run(tmp_path, uninterrupted)
    _assert_checkpoints_clean(tmp_path)
