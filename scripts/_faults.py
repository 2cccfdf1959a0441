"""Test-only fault injection: kill one rank of a training job at a chosen point.

A test sets one environment variable on the job it launches::

    FUSED_OPTIM_DIST_FAULT=kill:rank=1:step=7:when=after_backward torchrun ... --resume

and the job (``finetune.py``, which imports this module only when the variable is set) calls
:func:`inject` at its fault points. When the running rank, step and point
match, the process sends itself ``SIGKILL``, the way a preempted or crashed node disappears: no
exception, no ``finally``, no flush. A fault fires on one attempt of the job only, the first by
default (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0 or unset), so the job restarted by
``torchrun --max-restarts`` runs through; ``attempt=N`` moves it to the N-th restart, and
several faults separated by ``,`` fail successive attempts. ``committed=N`` holds the fault back
until the checkpoint of step N is committed (at most ``COMMIT_WAIT_S``, then the job fails), so
that a test knows which checkpoint the restart must resume from. Without the variable
:func:`inject` does nothing.

Fault points (``when=``):

* ``after_backward``: the step's backward passes (and in-backward updates) are done, before the
  loss is logged or anything is saved.
* ``during_save``: an asynchronous checkpoint save of this step has just started writing in the
  background and is not committed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from fused_optim_dist._checkpoint_layout import step_dir

__all__ = ["ENV_VAR", "POINTS", "RESTART_COUNT_VAR", "Fault", "active_faults", "inject", "parse"]

ENV_VAR = "FUSED_OPTIM_DIST_FAULT"
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in every worker: 0 on the first attempt, then the number of restarts."""
POINTS = ("after_backward", "during_save")
_ACTIONS = ("kill",)
_REQUIRED = ("rank", "step", "when")
_OPTIONAL = ("attempt", "committed")
_NUMBERS = ("rank", "step", "attempt", "committed")
_GRAMMAR = "kill:rank=R:step=S:when=POINT[:attempt=N][:committed=C], several separated by ','"
COMMIT_WAIT_S = 120.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault: ``action`` on rank ``rank`` at point ``when`` of step ``step``, on the
    job's attempt ``attempt``."""

    action: str
    """What happens: ``kill`` (the process sends itself SIGKILL)."""
    rank: int
    """Global rank that fails."""
    step: int
    """Training step (1-based, as the job logs it) at which it fails."""
    when: str
    """Fault point, one of :data:`POINTS`."""
    attempt: int = 0
    """Attempt of the job it fires on: torchrun's restart count (0, the first attempt)."""
    committed: int | None = None
    """Fire only once the checkpoint of this step is committed (waiting for it)."""

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"fault action {self.action!r}: expected one of {_ACTIONS}")
        if self.when not in POINTS:
            raise ValueError(f"fault point when={self.when!r}: expected one of {POINTS}")
        if self.rank < 0 or self.step < 1 or self.attempt < 0:
            raise ValueError(
                f"fault needs rank >= 0, step >= 1 and attempt >= 0, got "
                f"rank={self.rank} step={self.step} attempt={self.attempt}"
            )


def _parse_one(text: str, whole: str) -> Fault:
    action, *fields = text.strip().split(":")
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep or key not in _REQUIRED + _OPTIONAL or key in values:
            raise ValueError(
                f"{ENV_VAR}={whole!r}: bad field {field!r}; expected {_GRAMMAR}, each field once"
            )
        values[key] = value
    missing = [key for key in _REQUIRED if key not in values]
    if missing:
        raise ValueError(f"{ENV_VAR}={whole!r}: missing {missing}; expected {_GRAMMAR}")
    try:
        numbers = {key: int(values[key]) for key in _NUMBERS if key in values}
    except ValueError:
        raise ValueError(f"{ENV_VAR}={whole!r}: {', '.join(_NUMBERS)} must be integers") from None
    return Fault(action=action, when=values["when"], **numbers)


def parse(text: str) -> list[Fault]:
    """Parse ``kill:rank=R:step=S:when=POINT[:attempt=N]``, several separated by ``,`` (fields
    in any order).

    Raises:
        ValueError: naming what is malformed, missing or unknown, so that a typo fails the job
            instead of silently never firing.
    """
    return [_parse_one(part, text) for part in text.split(",")]


def active_faults(environ: Mapping[str, str] = os.environ) -> list[Fault]:
    """The faults ``environ`` asks for on the current attempt of the job (none if unset).

    Raises:
        ValueError: if the variable is set but malformed (see :func:`parse`).
    """
    text = environ.get(ENV_VAR)
    if not text:
        return []
    attempt = int(environ.get(RESTART_COUNT_VAR, "0"))
    return [fault for fault in parse(text) if fault.attempt == attempt]


def _wait_until_committed(checkpoint_dir: Path, step: int) -> None:
    deadline = time.monotonic() + COMMIT_WAIT_S
    while not step_dir(checkpoint_dir, step).is_dir():  # committed: renamed into place
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{ENV_VAR}: checkpoint step {step} was not committed within {COMMIT_WAIT_S:g} s"
            )
        time.sleep(0.05)


def inject(when: str, *, step: int, rank: int, checkpoint_dir: Path) -> None:
    """Fault point ``when`` of ``step`` on ``rank``: kill this process if a fault says so.

    Prints one line to stderr before the kill, so a test can tell the fault fired.
    """
    assert when in POINTS, when
    for fault in active_faults():
        if (fault.when, fault.step, fault.rank) == (when, step, rank):
            if fault.committed is not None:
                _wait_until_committed(checkpoint_dir, fault.committed)
            print(
                f"{ENV_VAR}: killing rank {rank} at step {step} ({when}) on attempt "
                f"{fault.attempt}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
