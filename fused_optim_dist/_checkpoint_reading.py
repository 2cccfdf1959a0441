"""What one rank reads and checks of a checkpoint's files before any rank loads it.

Every file a load needs is checked before a live tensor changes, because DCP loads shards in
place: a file that fails halfway would leave the model half loaded. The checks that ask the file
system about every file (is it there, is it long enough, what do the small files say) run on
one rank, which shares its verdict: on a shared file system, every rank statting every shard is
``world_size x files`` metadata requests for one answer. Hashing the shard files, the one check
that reads them whole, is split between the ranks instead (see ``fused_optim_dist.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from fused_optim_dist import _checkpoint_layout as layout
from fused_optim_dist._checkpoint_checksums import checksum_bytes, read_shard_records, verify
from fused_optim_dist._checkpoint_metadata import saved_state_specs

__all__ = ["Inspection", "inspect", "verify_share"]


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What a load needs to know of one checkpoint, read by one rank and sent to the others."""

    metadata: dict[str, Any]
    """``checkpoint.json``: the description of the model and optimizer, and the step."""
    optimizer_state: dict[str, dict[str, Any]]
    """The optimizer state the checkpoint holds, from DCP's ``.metadata`` (``state_specs``)."""
    extra: Any
    """The caller's object saved with the checkpoint."""
    shard_checksums: dict[str, str]
    """Shard file name -> recorded checksum; empty when verification is skipped."""


def _read_recorded(path: Path, name: str, checksums: dict[str, str] | None) -> bytes:
    """The bytes of ``path/name``, checked against ``checksums`` unless it is ``None``."""
    file = path / name
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ValueError(f"{file} cannot be read ({e}); the checkpoint is incomplete") from e
    if checksums is not None:
        if name not in checksums:
            raise ValueError(f"{layout.METADATA_FILE} of {path} records no checksum for {name}")
        actual = checksum_bytes(data)
        if actual != checksums[name]:
            raise ValueError(
                f"{file} is corrupt: its checksum is {actual}, but {checksums[name]} was "
                "recorded when it was written; load an earlier checkpoint"
            )
    return data


def _check_sizes(path: Path, storage_data: dict) -> None:
    needed: dict[str, int] = {}
    for info in storage_data.values():
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


def inspect(path: Path, *, verify_checksums: bool) -> Inspection:
    """Read and check the committed checkpoint ``path``.

    Checks that every file is there and long enough and, with ``verify_checksums``, that
    ``checkpoint.json``, DCP's ``.metadata`` and ``extra.pt`` hold what was written; returns
    the shard checksums for the ranks to verify.

    Raises:
        ValueError: naming the file that is missing, truncated, unreadable or corrupt.
    """
    metadata = layout.read_metadata(path, verify_checksum=verify_checksums)
    # Checkpoints of format version 1 carry no checksums.
    checksums = metadata.get(layout.CHECKSUMS_KEY) if verify_checksums else None
    if checksums is None and verify_checksums and metadata["format_version"] != 1:
        raise ValueError(f"{path / layout.METADATA_FILE} is corrupt: it records no checksums")
    dcp_bytes = _read_recorded(path, layout.DCP_METADATA_FILE, checksums)
    try:
        # DCP's own reader would read the file a second time; this is what it does with it.
        dcp_metadata = pickle.loads(dcp_bytes)
        storage_data = dcp_metadata.storage_data or {}
        optimizer_state = saved_state_specs(dcp_metadata)
    except Exception as e:
        raise ValueError(
            f"{path / layout.DCP_METADATA_FILE} is corrupt or unreadable "
            f"({type(e).__name__}: {e}); load an earlier checkpoint"
        ) from e
    _check_sizes(path, storage_data)
    shard_checksums = {}
    if checksums is not None:
        recorded = read_shard_records(path)
        for name in sorted({info.relative_path for info in storage_data.values()}):
            if name not in recorded:
                raise ValueError(
                    f"{path / name} has no recorded checksum: the checkpoint is incomplete"
                )
            shard_checksums[name] = recorded[name]
    extra_bytes = _read_recorded(path, layout.EXTRA_FILE, checksums)
    try:
        extra = torch.load(io.BytesIO(extra_bytes), weights_only=False)
    except Exception as e:
        raise ValueError(
            f"{path / layout.EXTRA_FILE} is corrupt or unreadable ({type(e).__name__}: {e}); "
            "load an earlier checkpoint"
        ) from e
    return Inspection(metadata, optimizer_state, extra, shard_checksums)


def verify_share(path: Path, shard_checksums: dict[str, str], rank: int, world_size: int) -> None:
    """Verify this rank's share of the shard files: every ``world_size``-th, from ``rank``."""
    names = sorted(shard_checksums)[rank::world_size]
    verify(path, {name: shard_checksums[name] for name in names})
