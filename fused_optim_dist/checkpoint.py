"""Sharded checkpoints of an FSDP2 model and its optimizer that survive crashes and resharding.

``save`` writes the model and optimizer state with ``torch.distributed.checkpoint`` (DCP): each
rank writes its own shards, nothing is gathered. With them go the caller's ``extra`` object
(scheduler state, data position, ...), a description of the model and optimizer, and a checksum
of every file, all into ``directory/step_<N>/``, which appears only once every rank has written
its part (see ``_checkpoint_layout``): a save that dies leaves the previous checkpoints as they
were. An asynchronous save appears as soon as the last rank has written, while training goes on.
``load`` takes the newest complete checkpoint, checks that it fits the model and optimizer in use
and that its files hold what was written, before changing anything, and loads it on any number
of ranks (DCP reshards).

The optimizer may be an ``OptimizerInBackward`` or a plain ``torch.optim`` optimizer of the same
class: both save the same state under the same names, so a checkpoint written with one loads
into the other, sharded or not. Each checkpoint folder is also a plain DCP checkpoint holding
``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` returns them.

Every function except ``latest`` and ``init_process_group`` is collective: call it on every
rank, in the same order, with the same arguments. ``directory`` must be on a file system every
rank sees. Loading unpickles ``extra``: load only checkpoints you trust (DCP's own ``.metadata``
is a pickle too). Jobs restarted by ``torchrun --max-restarts`` join their process group with
:func:`init_process_group`.

Example, a loop that resumes and saves every 100 steps in the background::

    checkpoint.init_process_group("nccl")
    step, extra = 0, None
    if checkpoint.latest(ckpt_dir) is not None:
        step, extra = checkpoint.load(ckpt_dir, model, optim)
        scheduler.load_state_dict(extra["scheduler"])
    pending = None
    while step < total_steps:
        train_one_step(step)
        step += 1
        if step % 100 == 0:
            # Committed in the background once every rank has written its shards.
            pending = checkpoint.save(ckpt_dir, model, optim, step=step, async_=True,
                                      extra={"scheduler": scheduler.state_dict()}, keep_last=3)
    if pending is not None:
        pending.wait()  # the last save is committed, or its error raised, on every rank
"""

from __future__ import annotations

import copy
import io
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from fused_optim_dist import _checkpoint_layout as layout
from fused_optim_dist._checkpoint_checksums import ChecksumWriter, checksum_bytes, write_durably
from fused_optim_dist._checkpoint_collectives import (
    agree,
    async_save_group,
    is_distributed,
    on_rank0,
    rank,
    release_async_save_group,
    world_size,
)
from fused_optim_dist._checkpoint_metadata import (
    describe,
    mismatches,
    param_names,
    state_mismatches,
    state_specs,
    tensor_mismatches,
    tensor_specs,
)
from fused_optim_dist._checkpoint_reading import Inspection, inspect, verify_share
from fused_optim_dist._checkpoint_rendezvous import init_process_group
from fused_optim_dist._torch_internals import before_teardown
from fused_optim_dist.optimizer import OptimizerInBackward, uncommitted_weights_error

__all__ = [
    "SaveHandle",
    "export_weights",
    "init_process_group",
    "latest",
    "load",
    "load_weights",
    "save",
]

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
"""Top-level keys of the DCP state dict, for reading a checkpoint with plain ``dcp.load``."""

# What a failed DCP call raises (CheckpointException, which gathers every rank's error, is a
# BaseException: it must never reach the caller, whose `except Exception` would miss it).
_DCP_ERRORS = (Exception, dcp.CheckpointException)

# The async save that has not been waited on yet; at most one is in flight.
_PENDING: SaveHandle | None = None
# Finishes async saves: waits for this rank's write, then (rank 0) commits and prunes.
# See [Note: async commit].
_FINISHER: ThreadPoolExecutor | None = None


# [Note: async commit]
# DCP's coordinator (rank 0) writes ``.metadata`` only after every rank has reported its shards
# written, and its save completes only after that; if any rank failed, every rank's save raises.
# So when rank 0's background write completes without error, every rank's part is on disk and
# rank 0 can commit (write checkpoint.json, rename) at once, in a background thread of its own:
# the checkpoint becomes the newest complete one while training goes on, with no further call.
# Rank 0 then broadcasts the outcome over the async-save group, from that thread, to the other
# ranks' commit threads, so that on every rank a save is over only once it is committed (or has
# failed). A rank leaving first could otherwise take the commit with it: under torchrun, a rank
# that aborts while exiting (as torch's gloo groups can during interpreter finalization) has
# its peers terminated, rank 0's pending commit included. ``SaveHandle.wait()`` is then how
# every rank learns the outcome (the next save or load calls it).


class SaveHandle:
    """A checkpoint being written, or written. ``path`` is the folder it commits to.

    A synchronous ``save`` returns a handle that is already committed. After ``save(...,
    async_=True)`` the shards are written by a background thread while training goes on, and
    rank 0 commits the checkpoint, in the background too, as soon as every rank has written its
    part: from then on ``latest`` and ``load`` (and a restarted job) see it, without any call.
    :meth:`wait` tells every rank the outcome; the next ``save`` or ``load`` calls it, and after
    the last save of a run call it yourself to hear of a failure. A save still pending when
    the process group is destroyed or the process exits is completed first, or its failure
    logged with exit status 1 (see [Note: an async save is never lost silently]).
    """

    def __init__(self, path: Path, step: int, finished: Future) -> None:
        self.path = path
        self.step = step
        # Completes when this rank has written its shards and heard from rank 0 that the
        # checkpoint is committed and old ones pruned; holds the error if that failed.
        self._finished = finished
        # None while not waited on; then True, or the exception that made the save fail.
        self._outcome: bool | BaseException | None = None

    def done(self) -> bool:
        """Whether the save is over on this rank: committed, or failed. Local."""
        return self._finished.done()

    def wait(self) -> Path:
        """Wait until the checkpoint is committed and return its path, or raise on every rank
        why it was not. Local: every rank's end of the save already heard rank 0's outcome
        (see [Note: async commit]), so every rank returns or raises alike.

        Calling it again returns the path (or raises the same error) at once.

        Raises:
            RuntimeError, OSError: on every rank, if any rank failed to write, or rank 0 failed
                to commit or to prune. Earlier checkpoints are untouched.
        """
        global _PENDING
        if self._outcome is None:
            self._outcome = self._finished.exception() or True
            if _PENDING is self:
                _PENDING = None
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self.path


def _finish(
    write: Future,
    final: Path,
    metadata: dict[str, Any],
    keep_last: int | None,
    step: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """This rank's end of a save: wait for its write; rank 0 commits and prunes, and every rank
    raises if that failed. Collective over ``group``.

    See [Note: async commit].
    """
    try:
        write.result()
    except _DCP_ERRORS as e:
        error = RuntimeError(
            f"writing checkpoint step {step} into {layout.tmp_dir(final)} failed, so it was not "
            f"committed: {e}"
        )
    else:
        error = None

    def commit() -> None:
        if error is not None:
            raise error
        layout.commit(final, metadata)
        try:
            layout.prune(final.parent, keep_last)
        except OSError as e:
            raise OSError(f"checkpoint {final} was committed, but pruning failed: {e}") from e

    # Every rank takes part whatever its own write did: DCP fails every rank's write or none.
    on_rank0(commit, group)


def _finisher() -> ThreadPoolExecutor:
    global _FINISHER
    if _FINISHER is None:
        _FINISHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        before_teardown(_finish_pending)
    return _FINISHER


# [Note: an async save is never lost silently]
# A loop that ends with an async save and then destroys the process group, or simply exits,
# without ``wait()`` would leave the checkpoint half-written (a ``.tmp`` folder) and exit 0.
# So a pending save is completed first: before ``destroy_process_group`` tears down the groups
# its background write uses, and at interpreter exit. Every rank waits for its own commit
# thread, which ends once rank 0 has committed (see [Note: async commit]): no rank leaves while
# the checkpoint is still uncommitted, and none waits on another rank's main thread, so a rank
# exiting on an error while its peers train does not hang. Before ``destroy_process_group`` the
# ranks then meet in a barrier, so that no rank tears down a group another rank's background
# thread still uses. If the save failed, the error is logged and the process exits with status
# 1: a checkpoint that silently does not exist is never the outcome.


def _finish_pending(destroying: bool) -> None:
    pending = _PENDING
    if pending is None or pending._outcome is not None:
        return
    error = pending._finished.exception()
    if error is None:
        if not destroying:
            release_async_save_group()
        elif dist.is_initialized():
            # Every rank's part is over before any rank tears down the groups the background
            # threads used (one rank's commit thread can end before another's has heard).
            dist.barrier()
        return
    sys.stderr.write(
        f"fused_optim_dist.checkpoint: the asynchronous save of step {pending.step} into "
        f"{pending.path} failed and was not committed: {error}\n"
    )
    sys.stderr.flush()
    os._exit(1)


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest (highest step) complete checkpoint under ``directory``, or ``None``. Local."""
    return layout.latest(Path(directory))


def _wait_pending() -> None:
    if _PENDING is not None:
        _PENDING.wait()


def _check_save_args(step: int, keep_last: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, not {keep_last!r}")


def _prepare_on_rank0(final: Path, extra: Any) -> dict[str, str]:
    """Rank 0 creates the temporary folder and writes ``extra`` into it (fsynced); return the
    checksum of what it wrote, on every rank. Collective."""

    def prepare() -> dict[str, str]:
        buffer = io.BytesIO()
        try:
            torch.save(extra, buffer)
        except Exception as e:
            raise ValueError(
                f"extra could not be saved with torch.save ({type(e).__name__}: {e}); pass "
                "picklable objects such as state_dict()s, numbers, strings and tensors"
            ) from e
        tmp = layout.prepare(final)
        write_durably(tmp / layout.EXTRA_FILE, buffer.getbuffer())
        return {layout.EXTRA_FILE: checksum_bytes(buffer.getbuffer())}

    return on_rank0(prepare)


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optim: Optimizer,
    *,
    step: int,
    extra: Any = None,
    async_: bool = False,
    keep_last: int | None = None,
) -> SaveHandle:
    """Save ``model`` and ``optim`` as shards into ``directory/step_<step>/``. Collective.

    First waits for an async save still in flight. Each rank writes only its own shards and a
    checksum of each; rank 0 also writes ``extra`` (its own copy: pass what is the same on every
    rank, or what rank 0's should restore) and, once every rank has finished, commits the
    checkpoint and deletes those ``keep_last`` leaves out.

    Args:
        directory: the run's checkpoint folder, created if missing.
        step: the training step, which names the checkpoint; each step is saved once.
        extra: any picklable object, returned by ``load``.
        async_: return as soon as the state is copied to host memory and write in a background
            thread (``dcp.async_save``); rank 0 commits the checkpoint in the background as
            soon as every rank has written (see :class:`SaveHandle`). The copy is taken now, so
            training may change the model and optimizer at once.
        keep_last: after committing, delete all but this many newest checkpoints.

    Returns:
        A :class:`SaveHandle`; already committed unless ``async_``.

    Side effect: an optimizer that has no state yet (no step taken) gets its state created by
    DCP's zero-gradient, zero-lr step, as ``get_state_dict`` does for any optimizer.

    Raises:
        ValueError: for a bad ``step`` or ``keep_last``, an unpicklable ``extra``, or an
            optimizer holding a parameter the model does not have.
        RuntimeError: on every rank, before anything is written, if a weight of ``model``
            holds an update made in backward that no ``step()`` committed (a save between
            backward and ``step()``, or after a loop that stopped after a backward): the plain
            loop's weights there are those of before it.
        FileExistsError: if the checkpoint of ``step`` already exists.
        RuntimeError, OSError: if writing or committing failed (earlier checkpoints are intact).
    """
    global _PENDING
    _check_save_args(step, keep_last)
    agree(uncommitted_weights_error(model, "checkpoint.save()"))
    directory = Path(directory)
    _wait_pending()
    final = layout.step_dir(directory, step)
    metadata = {
        **describe(get_model_state_dict(model), model, optim),
        "step": step,
        "world_size": world_size(),
        "torch_version": torch.__version__,
        # Outside the wrapped optimizer's state_dict (which stays interchangeable with the
        # plain optimizer's): the in-backward clipping history, needed to resume exactly.
        "gradient_state": (
            optim.gradient_state_dict() if isinstance(optim, OptimizerInBackward) else None
        ),
    }
    metadata[layout.CHECKSUMS_KEY] = _prepare_on_rank0(final, extra)
    model_state, optim_state = get_state_dict(model, optim)
    state = {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}
    writer = ChecksumWriter(layout.tmp_dir(final))
    if async_:
        group = async_save_group()
        write = dcp.async_save(state, storage_writer=writer, process_group=group)
        finished = _finisher().submit(_finish, write, final, metadata, keep_last, step, group)
        _PENDING = SaveHandle(final, step, finished)
        return _PENDING
    write = Future()
    try:
        dcp.save(state, storage_writer=writer)
        write.set_result(None)
    except _DCP_ERRORS as e:
        write.set_exception(e)
    finished = Future()
    try:
        _finish(write, final, metadata, keep_last, step)
        finished.set_result(None)
    except Exception as e:
        finished.set_exception(e)
    handle = SaveHandle(final, step, finished)
    handle.wait()
    return handle


def _resolve(directory: Path) -> Path | None:
    # A committed step folder itself, or the newest one under ``directory``.
    if (directory / layout.METADATA_FILE).is_file():
        return directory
    return layout.latest(directory)


def _inspect_newest(directory: Path, verify_checksums: bool) -> tuple[Path, Inspection]:
    path = _resolve(directory)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    return path, inspect(path, verify_checksums=verify_checksums)


def _refusal(path: Path, problems: list[str]) -> ValueError:
    return ValueError(
        f"checkpoint {path} does not fit the model and optimizer; nothing was loaded:\n  "
        + "\n  ".join(problems)
        + f"\nBuild them as the checkpoint was written (see {layout.METADATA_FILE})."
    )


def _state_dicts_checked(
    path: Path, inspection: Inspection, model: nn.Module, optim: Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(model, optim)``, after checking that the optimizer's state matches the
    checkpoint's entry by entry. Collective.

    [Note: comparing optimizer state without keeping it]
    Which state entries an optimizer has (``max_exp_avg_sq`` only with ``amsgrad``), and their
    shapes and dtypes, are known only once it has state. For an optimizer without state,
    ``get_state_dict`` creates it with a zero-gradient, zero-lr step (as DCP's load does), which
    changes no parameter. If the comparison then refuses, that new state is dropped again
    (``load_state_dict`` with no state and the groups as they were), with the in-backward
    gradient history, so the optimizer is as before.
    """
    fresh = not optim.state
    if fresh:
        groups = copy.deepcopy(optim.state_dict()["param_groups"])
        gradient_state = (
            copy.deepcopy(optim.gradient_state_dict())
            if isinstance(optim, OptimizerInBackward)
            else None
        )
    error = None
    try:
        model_state, optim_state = get_state_dict(model, optim)
        names = param_names(model)
        frozen = {names[id(p)] for p in model.parameters() if not p.requires_grad}
        problems = state_mismatches(inspection.optimizer_state, state_specs(optim_state), frozen)
        if problems:
            error = _refusal(path, problems)
    except Exception as e:
        error = e
    try:
        agree(error)
    except Exception:
        if fresh:
            optim.load_state_dict({"state": {}, "param_groups": groups})
            if gradient_state is not None:
                optim.load_gradient_state_dict(gradient_state)
        raise
    return model_state, optim_state


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optim: Optimizer,
    *,
    verify_checksums: bool = True,
) -> tuple[int, Any]:
    """Load the newest complete checkpoint under ``directory`` into ``model`` and ``optim``.
    Collective.

    ``directory`` may also be one checkpoint's ``step_<N>`` folder. The checkpoint may come from
    any number of ranks, and from an ``OptimizerInBackward`` or the plain optimizer of the same
    class. First waits for an async save still in flight.

    Before anything changes, rank 0 checks every file (present, long enough; the small files'
    checksums) and tells the others; the shard files' checksums are verified by all ranks
    together, each file hashed once by one rank; then the model's tensors, the optimizer class,
    its param groups and its state (entries, shapes, dtypes) are compared with the checkpoint's.

    Args:
        verify_checksums: hash every file and compare with the checksums recorded at save.
            Reads the whole checkpoint once more (split between the ranks); ``False`` skips it
            and still checks that every file is there and long enough.

    Returns:
        ``(step, extra)`` as passed to ``save``.

    Side effect: as ``get_state_dict``, creates the state of an optimizer that has none
    (dropped again if the load is refused).

    Raises:
        FileNotFoundError: if there is no complete checkpoint.
        ValueError: if the checkpoint does not fit: a tensor missing on either side or shaped
            or typed differently, another optimizer class, other param groups, a parameter
            trainable now that was frozen then, optimizer state entries missing on either side
            or shaped or typed differently; or if a file of it is corrupt (unreadable, missing,
            truncated, or not what was written). Each problem and file is named; nothing has
            been changed.
        RuntimeError: if reading the shards fails after every check passed (an I/O error);
            the model and optimizer may then be partly loaded.
    """
    directory = Path(directory)
    _wait_pending()
    path, inspection = on_rank0(lambda: _inspect_newest(directory, verify_checksums))
    error = None
    try:
        current = describe(get_model_state_dict(model), model, optim)
        problems = mismatches(inspection.metadata, current)
        if problems:
            error = _refusal(path, problems)
        else:
            verify_share(path, inspection.shard_checksums, rank(), world_size())
    except Exception as e:  # e.g. an unreadable file: every rank must hear of it
        error = e
    agree(error)
    model_state, optim_state = _state_dicts_checked(path, inspection, model, optim)
    state = {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}
    try:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optim, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIMIZER_KEY]
        )
    except _DCP_ERRORS as e:
        raise RuntimeError(
            f"loading checkpoint {path} failed after its checks passed, so the model and "
            f"optimizer may be partly loaded; load it again or an earlier one: {e}"
        ) from None
    gradient_state = inspection.metadata.get("gradient_state")
    if isinstance(optim, OptimizerInBackward) and gradient_state is not None:
        optim.load_gradient_state_dict(gradient_state)
    return inspection.metadata["step"], inspection.extra


def export_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the full, unsharded model state dict to one ``torch.save`` file. Collective.

    Every rank takes part in gathering the shards; only rank 0 holds the full tensors (in host
    memory) and writes them, to a temporary file renamed into place. The file holds a plain
    ``{name: tensor}`` dict, readable without this library:
    ``model.load_state_dict(torch.load(path, weights_only=True))``.

    Raises:
        OSError: on every rank, if rank 0 could not write the file.
        RuntimeError: on every rank, before anything is written, if a weight holds an update
            made in backward that no ``step()`` committed (as :func:`save`).
    """
    agree(uncommitted_weights_error(model, "export_weights()"))
    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    error = None
    if rank() == 0:
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(weights, tmp)
            os.replace(tmp, path)
        except OSError as e:
            error = e
    agree(error)


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a file written by :func:`export_weights` into ``model``, sharded or not. Collective.

    Rank 0 reads the file and the shards are sent from it to every rank, so the file must be
    readable by rank 0 only. Use it to start training from exported weights (``--init-from``).

    Raises:
        FileNotFoundError, ValueError: on every rank, if rank 0 cannot read the file, or its
            tensors differ from the model's in name or shape (each named); the model is then
            unchanged.
    """
    path = Path(path)
    current = tensor_specs(get_model_state_dict(model))
    weights: dict[str, torch.Tensor] = {}
    error = None
    if rank() == 0:
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            problems = tensor_mismatches(tensor_specs(weights), current, where="the file")
            if problems:
                error = ValueError(
                    f"weights {path} do not fit the model; nothing was loaded:\n  "
                    + "\n  ".join(problems)
                )
        except OSError as e:
            error = e
        except Exception as e:  # not a torch.save file of plain tensors
            error = ValueError(f"cannot read {path} as exported weights: {e}")
    agree(error)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_distributed())
    set_model_state_dict(model, weights, options=options)
