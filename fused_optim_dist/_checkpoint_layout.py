"""Where checkpoints live on disk, and how a new one becomes visible all at once.

::

    directory/
        step_000010/          complete: DCP shards + .metadata, extra.pt, checkpoint.json
        step_000020.tmp/      being written, or left by a save that died: never loaded

A save writes everything into ``step_N.tmp/``. Once every rank has written its shards (DCP's
coordinator has then written ``.metadata``), rank 0 writes ``checkpoint.json`` into it and renames
the folder to ``step_N/``. A rename within one directory is atomic on POSIX file systems, so a
reader sees either no ``step_N/`` or a complete one, and a crash at any point of a save leaves
the previous checkpoints as they were. The functions here touch the file system only; callers
decide which rank runs them (rank 0 for every change).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "EXTRA_FILE",
    "METADATA_FILE",
    "check_shards",
    "commit",
    "complete_checkpoints",
    "latest",
    "prepare",
    "prune",
    "read_metadata",
    "step_dir",
    "tmp_dir",
]

METADATA_FILE = "checkpoint.json"
"""Written last, just before the rename: a folder without it is not a checkpoint."""
REQUIRED_METADATA_KEYS = frozenset(
    {"format_version", "optimizer", "tensors", "param_groups", "step"}
)
"""Keys ``fused_optim_dist.checkpoint.save`` always writes into ``METADATA_FILE``."""
EXTRA_FILE = "extra.pt"
"""The caller's ``extra`` object, ``torch.save``'d by rank 0."""
DCP_METADATA_FILE = ".metadata"
"""Written by DCP's coordinator once every rank has written its shards."""
_TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:06d}"


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + _TMP_SUFFIX)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``directory`` as ``(step, path)``, oldest step first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / METADATA_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest(directory: Path) -> Path | None:
    """The committed checkpoint with the highest step under ``directory``, or ``None``."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def prepare(final: Path) -> Path:
    """Create an empty temporary folder for the checkpoint ``final``; return its path.

    A temporary folder left by an earlier save that died is removed first.

    Raises:
        FileExistsError: if ``final`` is already a committed checkpoint.
    """
    if final.exists():
        raise FileExistsError(
            f"checkpoint {final} already exists; save each step once, or delete the folder "
            "first to overwrite it"
        )
    tmp = tmp_dir(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(final: Path, metadata: dict[str, Any]) -> None:
    """Write ``metadata`` into the temporary folder of ``final`` and rename it to ``final``.

    Call only after every rank has finished writing into the temporary folder.
    """
    tmp = tmp_dir(final)
    with open(tmp / METADATA_FILE, "w") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable (POSIX); without it a power loss may undo it.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: Path, keep_last: int | None) -> None:
    """Delete temporary folders of dead saves and, if ``keep_last`` is set, all but the
    ``keep_last`` newest committed checkpoints.

    Call only while no save into ``directory`` is in flight.
    """
    for child in directory.iterdir():
        stem = child.name.removesuffix(_TMP_SUFFIX)
        if stem != child.name and _STEP_DIR.fullmatch(stem):
            shutil.rmtree(child)
    if keep_last is not None:
        for _, path in complete_checkpoints(directory)[:-keep_last]:
            shutil.rmtree(path)


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of the committed checkpoint ``path``.

    Raises:
        FileNotFoundError: if ``path`` is not a committed checkpoint.
    """
    file = path / METADATA_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint written by fused_optim_dist.checkpoint.save (no "
            f"{METADATA_FILE}); load plain DCP checkpoints with torch.distributed.checkpoint.load"
        )
    try:
        with open(file, encoding="utf-8") as f:
            metadata = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{file} is corrupt (not valid JSON: {e}); load an earlier checkpoint"
        ) from e
    missing = REQUIRED_METADATA_KEYS - set(metadata if isinstance(metadata, dict) else ())
    if missing:
        raise ValueError(
            f"{file} is corrupt: it lacks {sorted(missing)}, which every save writes; load an "
            "earlier checkpoint"
        )
    return metadata


def check_shards(path: Path) -> None:
    """Check that DCP's ``.metadata`` of ``path`` is readable and every shard file it points to
    is at least as long as it says, before anything is read into live tensors.

    DCP loads shards in place, so a shard that fails half-way would leave the model half
    loaded; this catches truncated and missing files up front (not bit flips within a file).

    Raises:
        ValueError: naming the unreadable ``.metadata`` or the missing or truncated shard file.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise ValueError(
            f"{path / DCP_METADATA_FILE} is corrupt or unreadable ({type(e).__name__}: {e}); "
            "load an earlier checkpoint"
        ) from e
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing: the checkpoint is incomplete")
        actual = file.stat().st_size
        if actual < size:
            raise ValueError(
                f"{file} is truncated (corrupt): {actual} bytes, but the checkpoint's metadata "
                f"needs {size}; load an earlier checkpoint"
            )
