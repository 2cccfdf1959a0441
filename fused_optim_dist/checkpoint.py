"""Sharded checkpoints of an FSDP2 model and its optimizer that survive crashes and resharding.

``save`` writes the model and optimizer state with ``torch.distributed.checkpoint`` (DCP): each
rank writes its own shards, nothing is gathered. With them go the caller's ``extra`` object
(scheduler state, data position, ...) and a description of the model and optimizer, all into
``directory/step_<N>/``, which appears only once every rank has written its part (see
``_checkpoint_layout``): a save that dies leaves the previous checkpoints as they were. ``load``
takes the newest complete checkpoint, checks that it fits the model and optimizer in use before
changing anything, and loads it on any number of ranks (DCP reshards).

The optimizer may be an ``OptimizerInBackward`` or a plain ``torch.optim`` optimizer of the same
class: both save the same state under the same names, so a checkpoint written with one loads
into the other, sharded or not. Each checkpoint folder is also a plain DCP checkpoint holding
``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` returns them.

Every function except ``latest`` is collective: call it on every rank, in the same order, with
the same arguments. ``directory`` must be on a file system every rank sees. Loading unpickles
``extra``: load only checkpoints you trust (DCP's own ``.metadata`` is a pickle too).

Example, a loop that resumes and saves every 100 steps in the background::

    step, extra = 0, None
    if checkpoint.latest(ckpt_dir) is not None:
        step, extra = checkpoint.load(ckpt_dir, model, optim)
        scheduler.load_state_dict(extra["scheduler"])
    pending = None
    while step < total_steps:
        train_one_step(step)
        step += 1
        if step % 100 == 0:
            # Waits for (and commits) the previous async save first.
            pending = checkpoint.save(ckpt_dir, model, optim, step=step, async_=True,
                                      extra={"scheduler": scheduler.state_dict()}, keep_last=3)
    if pending is not None:
        pending.wait()  # commit the last checkpoint before exiting
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
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
from fused_optim_dist._checkpoint_collectives import (
    agree,
    async_save_group,
    broadcast_from_rank0,
    is_distributed,
    rank,
    world_size,
)
from fused_optim_dist._checkpoint_metadata import (
    describe,
    mismatches,
    tensor_mismatches,
    tensor_specs,
)
from fused_optim_dist.optimizer import OptimizerInBackward

__all__ = ["SaveHandle", "export_weights", "latest", "load", "load_weights", "save"]

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
"""Top-level keys of the DCP state dict, for reading a checkpoint with plain ``dcp.load``."""

# What a failed DCP save raises (CheckpointException, which gathers every rank's error, is a
# BaseException).
_SAVE_ERRORS = (Exception, dcp.CheckpointException)

# The async save that has not been committed yet; at most one is in flight.
_PENDING: SaveHandle | None = None


class SaveHandle:
    """A checkpoint being written, or written. ``path`` is the folder it commits to.

    A synchronous ``save`` returns a handle that is already committed. After ``save(...,
    async_=True)`` the shards are written by a background thread while training goes on, and the
    checkpoint becomes visible to ``latest`` and ``load`` when :meth:`wait` commits it. The next
    ``save`` or ``load`` calls ``wait()`` itself; after the last save of a run, call it on every
    rank, or that checkpoint stays uncommitted (and is never loaded).
    """

    def __init__(
        self, path: Path, metadata: dict[str, Any], keep_last: int | None, future: Future
    ) -> None:
        self.path = path
        self.step: int = metadata["step"]
        self._metadata = metadata
        self._keep_last = keep_last
        # Completes when this rank's part of DCP's save has finished (the coordinator's part
        # includes writing .metadata after every rank's shards are written).
        self._future = future
        # None while not waited on; then True, or the exception that made the save fail.
        self._outcome: bool | Exception | None = None

    def done(self) -> bool:
        """Whether this rank has finished writing. Local, does not commit."""
        return self._future.done()

    def wait(self) -> Path:
        """Wait until every rank has written its shards, commit the checkpoint, return its path.

        Collective. Calling it again returns the path (or raises the same error) at once.

        Raises:
            RuntimeError, OSError: on every rank, if any rank failed to write or rank 0 failed
                to commit. The checkpoint is then not committed; earlier ones are untouched.
        """
        global _PENDING
        if self._outcome is None:
            try:
                self._finish()
                self._outcome = True
            except Exception as e:
                self._outcome = e
            finally:
                if _PENDING is self:
                    _PENDING = None
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self.path

    def _finish(self) -> None:
        error = None
        try:
            self._future.result()
        except _SAVE_ERRORS as e:
            error = RuntimeError(
                f"writing checkpoint step {self.step} into {layout.tmp_dir(self.path)} failed, "
                f"so it was not committed: {e}"
            )
        agree(error)
        error = None
        if rank() == 0:
            try:
                layout.commit(self.path, self._metadata)
            except OSError as e:
                error = e
        agree(error)
        if rank() == 0:
            try:
                layout.prune(self.path.parent, self._keep_last)
            except OSError as e:
                error = OSError(f"checkpoint {self.path} was committed, but pruning failed: {e}")
        agree(error)


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


def _prepare_on_rank0(final: Path, extra: Any) -> None:
    """Rank 0 creates the temporary folder and writes ``extra`` into it. Collective."""
    error = None
    if rank() == 0:
        buffer = io.BytesIO()
        try:
            torch.save(extra, buffer)
        except Exception as e:
            error = ValueError(
                f"extra could not be saved with torch.save ({type(e).__name__}: {e}); pass "
                "picklable objects such as state_dict()s, numbers, strings and tensors"
            )
        if error is None:
            try:
                tmp = layout.prepare(final)
                (tmp / layout.EXTRA_FILE).write_bytes(buffer.getbuffer())
            except OSError as e:
                error = e
    agree(error)


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

    First waits for (and commits) an async save still in flight. Each rank writes only its own
    shards; rank 0 also writes ``extra`` (its own copy: pass what is the same on every rank, or
    what rank 0's should restore) and, once every rank has finished, commits the checkpoint.

    Args:
        directory: the run's checkpoint folder, created if missing.
        step: the training step, which names the checkpoint; each step is saved once.
        extra: any picklable object, returned by ``load``.
        async_: return as soon as the state is copied to host memory and write in a background
            thread (``dcp.async_save``); the checkpoint is committed by the handle's ``wait()``
            (called by the next ``save`` or ``load``). The copy is taken now, so training may
            change the model and optimizer at once.
        keep_last: after committing, delete all but this many newest checkpoints.

    Returns:
        A :class:`SaveHandle`; already committed unless ``async_``.

    Side effect: an optimizer that has no state yet (no step taken) gets its state created by
    DCP's zero-gradient, zero-lr step, as ``get_state_dict`` does for any optimizer.

    Raises:
        ValueError: for a bad ``step`` or ``keep_last``, an unpicklable ``extra``, or an
            optimizer holding a parameter the model does not have.
        FileExistsError: if the checkpoint of ``step`` already exists.
        RuntimeError, OSError: if writing or committing failed (earlier checkpoints are intact).
    """
    global _PENDING
    _check_save_args(step, keep_last)
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
    _prepare_on_rank0(final, extra)
    model_state, optim_state = get_state_dict(model, optim)
    state = {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}
    tmp = layout.tmp_dir(final)
    if async_:
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=async_save_group())
        _PENDING = SaveHandle(final, metadata, keep_last, future)
        return _PENDING
    future = Future()
    try:
        dcp.save(state, checkpoint_id=tmp)
        future.set_result(None)
    except _SAVE_ERRORS as e:
        future.set_exception(e)
    handle = SaveHandle(final, metadata, keep_last, future)
    handle.wait()
    return handle


def _resolve(directory: Path) -> Path | None:
    # A committed step folder itself, or the newest one under ``directory``.
    if (directory / layout.METADATA_FILE).is_file():
        return directory
    return layout.latest(directory)


def _read_extra(file: Path) -> Any:
    try:
        return torch.load(file, weights_only=False)
    except Exception as e:
        raise ValueError(
            f"{file} is corrupt or unreadable ({type(e).__name__}: {e}); load an earlier checkpoint"
        ) from e


def load(directory: str | os.PathLike, model: nn.Module, optim: Optimizer) -> tuple[int, Any]:
    """Load the newest complete checkpoint under ``directory`` into ``model`` and ``optim``.
    Collective.

    ``directory`` may also be one checkpoint's ``step_<N>`` folder. The checkpoint may come from
    any number of ranks, and from an ``OptimizerInBackward`` or the plain optimizer of the same
    class. First waits for (and commits) an async save still in flight.

    Returns:
        ``(step, extra)`` as passed to ``save``.

    Raises:
        FileNotFoundError: if there is no complete checkpoint.
        ValueError: if the checkpoint does not fit: a tensor missing on either side or shaped
            differently, another optimizer class, other param groups, or a parameter trainable
            now that was frozen then; or if a file of it is corrupt (unreadable metadata, a
            missing or truncated shard file, an unreadable ``extra``). Each problem is named;
            nothing has been changed.
    """
    directory = Path(directory)
    _wait_pending()
    path = broadcast_from_rank0(_resolve(directory) if rank() == 0 else None)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    error = None
    try:
        saved = layout.read_metadata(path)
        problems = mismatches(saved, describe(get_model_state_dict(model), model, optim))
        if problems:
            error = ValueError(
                f"checkpoint {path} does not fit the model and optimizer; nothing was loaded:\n  "
                + "\n  ".join(problems)
                + f"\nBuild them as the checkpoint was written (see {layout.METADATA_FILE})."
            )
        else:
            # Everything that can fail is read or checked before a live tensor changes.
            layout.check_shards(path)
            extra = _read_extra(path / layout.EXTRA_FILE)
    except Exception as e:  # e.g. an unreadable file: every rank must hear of it
        error = e
    agree(error)
    model_state, optim_state = get_state_dict(model, optim)
    state = {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optim, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIMIZER_KEY]
    )
    if isinstance(optim, OptimizerInBackward) and saved.get("gradient_state") is not None:
        optim.load_gradient_state_dict(saved["gradient_state"])
    return saved["step"], extra


def export_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the full, unsharded model state dict to one ``torch.save`` file. Collective.

    Every rank takes part in gathering the shards; only rank 0 holds the full tensors (in host
    memory) and writes them, to a temporary file renamed into place. The file holds a plain
    ``{name: tensor}`` dict, readable without this library:
    ``model.load_state_dict(torch.load(path, weights_only=True))``.

    Raises:
        OSError: on every rank, if rank 0 could not write the file.
    """
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
