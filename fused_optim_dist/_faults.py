"""Test-only fault injection: kill one rank of a training job at a chosen point.

A test sets one environment variable on the job it launches::

    FUSED_OPTIM_DIST_FAULT=kill:rank=1:step=7:when=after_backward torchrun ... --resume

and the job calls :func:`inject` at its fault points. When the running rank, step and point
match, the process sends itself ``SIGKILL``, the way a preempted or crashed node disappears: no
exception, no ``finally``, no flush. The fault fires on a job's first attempt only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0 or unset), so a job restarted by ``torchrun --max-restarts``
runs through. Without the variable :func:`inject` does nothing.

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
from collections.abc import Mapping

__all__ = ["ENV_VAR", "POINTS", "RESTART_COUNT_VAR", "Fault", "active_fault", "inject", "parse"]

ENV_VAR = "FUSED_OPTIM_DIST_FAULT"
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in every worker: 0 on the first attempt, then the number of restarts."""
POINTS = ("after_backward", "during_save")
_ACTIONS = ("kill",)
_FIELDS = ("rank", "step", "when")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault: ``action`` on rank ``rank`` at fault point ``when`` of step ``step``."""

    action: str
    """What happens: ``kill`` (the process sends itself SIGKILL)."""
    rank: int
    """Global rank that fails."""
    step: int
    """Training step (1-based, as the job logs it) at which it fails."""
    when: str
    """Fault point, one of :data:`POINTS`."""

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"fault action {self.action!r}: expected one of {_ACTIONS}")
        if self.when not in POINTS:
            raise ValueError(f"fault point when={self.when!r}: expected one of {POINTS}")
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"fault needs rank >= 0 and step >= 1, got rank={self.rank} "
                             f"step={self.step}")


def parse(text: str) -> Fault:
    """Parse ``kill:rank=R:step=S:when=POINT`` (fields in any order).

    Raises:
        ValueError: naming what is malformed, missing or unknown, so that a typo fails the job
            instead of silently never firing.
    """
    action, *fields = text.strip().split(":")
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep or key not in _FIELDS or key in values:
            raise ValueError(f"{ENV_VAR}={text!r}: bad field {field!r}; expected "
                             "kill:rank=R:step=S:when=POINT, each field once")
        values[key] = value
    missing = [key for key in _FIELDS if key not in values]
    if missing:
        raise ValueError(f"{ENV_VAR}={text!r}: missing {missing}; expected "
                         "kill:rank=R:step=S:when=POINT")
    try:
        rank, step = int(values["rank"]), int(values["step"])
    except ValueError:
        raise ValueError(f"{ENV_VAR}={text!r}: rank and step must be integers") from None
    return Fault(action=action, rank=rank, step=step, when=values["when"])


def active_fault(environ: Mapping[str, str] = os.environ) -> Fault | None:
    """The fault ``environ`` asks for, or ``None`` if none is set or this is a restart.

    Raises:
        ValueError: if the variable is set but malformed (see :func:`parse`).
    """
    text = environ.get(ENV_VAR)
    if not text:
        return None
    fault = parse(text)
    if int(environ.get(RESTART_COUNT_VAR, "0")) > 0:
        return None
    return fault


def inject(when: str, *, step: int, rank: int) -> None:
    """Fault point ``when`` of ``step`` on ``rank``: kill this process if the fault says so.

    Prints one line to stderr before the kill, so a test can tell the fault fired.
    """
    assert when in POINTS, when
    fault = active_fault()
    if fault is None or (fault.when, fault.step, fault.rank) != (when, step, rank):
        return
    print(f"{ENV_VAR}: killing rank {rank} at step {step} ({when})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
