"""Where checkpoints live on disk, and how a new one becomes visible all at once.

::

    directory/
        step_000010/          complete: DCP shards + .metadata, __<rank>_checksums.json,
                              extra.pt, checkpoint.json
        step_000020.tmp/      being written, or left by a save that died: never loaded

A save writes everything into ``step_N.tmp/``: each rank its shards and a record of their
checksums, rank 0 also ``extra.pt`` (see ``_checkpoint_checksums``). Once every rank has written
its shards (DCP's coordinator has then written ``.metadata``), rank 0 writes ``checkpoint.json``
into it, with the checksums of ``.metadata``, ``extra.pt`` and its own content, and renames the
folder to ``step_N/``; every file is fsynced before the rename. A rename within one directory
is atomic on POSIX file systems, so a reader sees either no ``step_N/`` or a complete one, and a
crash at any point of a save leaves the previous checkpoints as they were. The functions here
touch the file system only; callers decide which rank runs them (rank 0 for every change).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fused_optim_dist._checkpoint_checksums import checksum_bytes, checksum_file

__all__ = [
    "DCP_METADATA_FILE",
    "EXTRA_FILE",
    "METADATA_FILE",
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
CHECKSUMS_KEY = "checksums"
"""In ``METADATA_FILE``: file name -> checksum of the files rank 0 wrote (``.metadata``,
``extra.pt``); shard files are recorded by the rank that wrote them."""
SELF_CHECKSUM_KEY = "metadata_checksum"
"""In ``METADATA_FILE``: the checksum of the rest of its content (see :func:`_canonical`)."""
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


def _canonical(metadata: dict[str, Any]) -> bytes:
    body = {k: v for k, v in metadata.items() if k != SELF_CHECKSUM_KEY}
    return json.dumps(body, sort_keys=True).encode()


def commit(final: Path, metadata: dict[str, Any]) -> None:
    """Write ``metadata`` into the temporary folder of ``final`` and rename it to ``final``.

    Records the checksum of DCP's ``.metadata`` (rank 0 wrote it as DCP's coordinator) and of
    the metadata itself. Call only after every rank has finished writing into the temporary
    folder.
    """
    tmp = tmp_dir(final)
    checksums = {**metadata.get(CHECKSUMS_KEY, {})}
    checksums[DCP_METADATA_FILE] = checksum_file(tmp / DCP_METADATA_FILE)
    metadata = {**metadata, CHECKSUMS_KEY: checksums}
    metadata[SELF_CHECKSUM_KEY] = checksum_bytes(_canonical(metadata))
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

    Call only while no save into ``directory`` is in flight. A checkpoint is renamed to a
    temporary folder before it is deleted: a prune killed halfway (it runs in the background
    of an async save) leaves a temporary folder, removed by the next prune, never a step folder
    without its ``METADATA_FILE``. Step folders left so by older releases are removed too.
    """
    for child in directory.iterdir():
        stem = child.name.removesuffix(_TMP_SUFFIX)
        if _STEP_DIR.fullmatch(stem) and (
            stem != child.name or not (child / METADATA_FILE).is_file()
        ):
            shutil.rmtree(child)
    if keep_last is not None:
        for _, path in complete_checkpoints(directory)[:-keep_last]:
            doomed = tmp_dir(path)
            os.rename(path, doomed)
            shutil.rmtree(doomed)


def read_metadata(path: Path, *, verify_checksum: bool = True) -> dict[str, Any]:
    """The metadata of the committed checkpoint ``path``.

    Raises:
        FileNotFoundError: if ``path`` is not a committed checkpoint.
        ValueError: naming the file, if it is not valid JSON, lacks a key every save writes, or
            (with ``verify_checksum``) its content differs from what was written.
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
    # Format version 1 wrote no checksums; the format check in load() reports newer versions.
    if verify_checksum and metadata["format_version"] != 1:
        recorded = metadata.get(SELF_CHECKSUM_KEY)
        actual = checksum_bytes(_canonical(metadata))
        if recorded != actual:
            raise ValueError(
                f"{file} is corrupt: its checksum is {actual}, but {recorded} was recorded when "
                "it was written; load an earlier checkpoint"
            )
    return metadata
