"""Per-file checksums of a checkpoint: recorded by the rank that wrote each file, checked on load.

[Note: checksums without gathering]
DCP keeps no checksums, so a flipped bit inside a shard file of the right size loads without a
word. Each rank hashes the shard files it has just written, inside DCP's write step and in the
thread that wrote them, and records them in its own file ``__<rank>_checksums.json`` beside
them before it reports its write as done. DCP's coordinator writes ``.metadata`` only once every
rank has reported, so by the time a checkpoint is committed every record is on disk, and no rank
sent another rank a checksum. Rank 0 records the files it writes itself (``extra.pt``,
``.metadata``) in ``checkpoint.json``, which carries a checksum of its own content. On load the
shard files are split between the ranks, each rank hashes its share once, and the ranks agree
on the verdict (see ``fused_optim_dist.checkpoint.load``).

CRC-32 (``zlib.crc32``, about 2.7 GB/s on one CPU core) catches every flipped bit and every burst
of up to 32 bits; it guards against storage faults, not against someone forging a file.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = [
    "RECORD_SUFFIX",
    "ChecksumWriter",
    "checksum_bytes",
    "checksum_file",
    "read_shard_records",
    "verify",
    "write_durably",
]

RECORD_SUFFIX = "checksums.json"
"""Rank r's record is ``__<r>_checksums.json``: DCP names rank r's shards ``__<r>_<n>.distcp``."""
_CHUNK = 8 << 20


def checksum_bytes(data: bytes | memoryview) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def checksum_file(path: Path) -> str:
    """The checksum of the file ``path``, read in chunks (constant memory)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def write_durably(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` and fsync it, so that a commit after it never points at a
    file a power loss could still take back."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class ChecksumWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that records a checksum of each shard file this rank wrote.

    See [Note: checksums without gathering].
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        results = written.wait()
        directory = Path(self.path)
        files = sorted({result.storage_data.relative_path for result in results})
        record = {name: checksum_file(directory / name) for name in files}
        prefix = plan.storage_data.prefix  # "__<rank>_"
        write_durably(directory / f"{prefix}{RECORD_SUFFIX}", json.dumps(record).encode())
        return written


def read_shard_records(path: Path) -> dict[str, str]:
    """Every rank's shard checksums in the checkpoint folder ``path``: file name -> checksum.

    Raises:
        ValueError: naming a record file that is not what ``ChecksumWriter`` wrote.
    """
    checksums: dict[str, str] = {}
    for record in sorted(path.glob(f"__*_{RECORD_SUFFIX}")):
        try:
            entries = json.loads(record.read_bytes())
            if not isinstance(entries, dict) or not all(
                isinstance(v, str) for v in entries.values()
            ):
                raise ValueError("not a JSON object of checksums")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(
                f"{record} is corrupt ({e}); load an earlier checkpoint, or pass "
                "verify_checksums=False to load without checking the files"
            ) from e
        checksums.update(entries)
    return checksums


def verify(path: Path, expected: dict[str, Any]) -> None:
    """Hash each file named in ``expected`` (name -> checksum) under ``path`` and compare.

    Raises:
        ValueError: naming the first file whose content differs from what was written.
    """
    for name, checksum in sorted(expected.items()):
        actual = checksum_file(path / name)
        if actual != checksum:
            raise ValueError(
                f"{path / name} is corrupt: its checksum is {actual}, but {checksum} was "
                "recorded when it was written; load an earlier checkpoint"
            )
