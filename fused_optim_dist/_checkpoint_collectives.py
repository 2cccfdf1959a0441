"""Rank agreement for checkpoint code: every rank raises the same error, or none does.

Checkpoint steps that may fail on one rank only (a file rank 0 writes, a check of one rank's
model) must not leave the other ranks waiting in the next collective until its timeout. Each such
step ends in :func:`agree`, which all-gathers the ranks' errors and raises on every rank if any
rank failed. Without a process group (one process, no ``init_process_group``) every function here
is local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "agree",
    "async_save_group",
    "broadcast_from_rank0",
    "is_distributed",
    "on_rank0",
    "rank",
    "release_async_save_group",
    "world_size",
]

T = TypeVar("T")

# The gloo group async saves run their collectives on, and the default group it was made for.
_ASYNC_GROUP: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def agree(error: Exception | None) -> None:
    """Raise on every rank if any rank passes an exception. Collective.

    Every rank raises the first failing rank's exception type (builtin types only; others become
    ``RuntimeError``) with its message, prefixed with that rank; the failing rank chains its own
    exception.
    """
    local = None if error is None else _portable(error)
    gathered = [local]
    if is_distributed():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if failed:
        first_rank, (cls, message) = failed[0]
        _raise(cls, message, first_rank if len(gathered) > 1 else None, error)


def on_rank0(fn: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank; if it raises, every rank
    raises its exception (as :func:`agree` does). Collective over ``group`` (default: the
    default group).

    For checks of shared files: one rank reads them and shares the verdict, instead of every
    rank asking the file system the same questions.
    """
    outcome: tuple[bool, Any] | None = None
    error = None
    if rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as e:
            outcome, error = (False, _portable(e)), e
    ok, value = broadcast_from_rank0(outcome, group)
    if not ok:
        cls, message = value
        _raise(cls, message, 0 if world_size() > 1 else None, error)
    return value


def _raise(
    cls: type[Exception], message: str, failed_rank: int | None, cause: Exception | None
) -> None:
    if failed_rank is not None:
        message = f"on rank {failed_rank}: {message}"
    try:
        exc = cls(message)
    except Exception:
        exc = RuntimeError(message)
    raise exc from cause


def _portable(error: Exception) -> tuple[type[Exception], str]:
    # Exception objects may not pickle; builtin classes and strings always do.
    cls = type(error)
    if cls.__module__ == "builtins":
        return cls, str(error)
    return RuntimeError, f"{cls.__name__}: {error}"


def broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Return rank 0's ``obj`` on every rank. Collective over ``group`` (default: the default
    group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def async_save_group() -> dist.ProcessGroup | None:
    """A gloo group for the collectives of ``dcp.async_save``'s background thread. Collective
    the first time (it creates the group), free afterwards.

    The background thread's collectives must not share a group with the training loop's (FSDP2
    all-gathers and reduce-scatters), or the two streams of collectives would interleave in a
    different order on different ranks. Returns ``None`` without a process group.
    """
    global _ASYNC_GROUP
    if not is_distributed():
        return None
    world = dist.group.WORLD
    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not world:
        _ASYNC_GROUP = (world, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[1]


def release_async_save_group() -> None:
    """Destroy the async-save group (local: no other rank takes part), once its last save is
    over.

    For a process that exits without destroying its groups. The gloo group's worker threads free
    each collective's work after the caller has seen it complete, and freeing a work's tensors
    takes the GIL: if the interpreter is being finalized by then, the thread is ended inside a
    C++ frame and the process aborts ("terminate called without an active exception",
    pytorch#179291; seen after the commit's broadcast, the last collective before the exit).
    Destroying the group while the interpreter is alive joins those threads first.
    """
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None:
        return
    world, group = _ASYNC_GROUP
    _ASYNC_GROUP = None
    if is_distributed() and dist.group.WORLD is world:
        dist.destroy_process_group(group)
