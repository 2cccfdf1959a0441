"""Owner ranks for whole-tensor stepping, and the byte exchange that moves shards to them.

[Note: owners balance every unit]
A whole-tensor update runs on one rank, the parameter's owner. Owners are chosen per FSDP unit,
greedily by size (largest parameter first, to the least loaded rank), so every rank gets a share
of every unit and the orthogonalizations of one unit run side by side on all ranks, instead of
one rank working while the others wait. The choice depends only on the unit's shapes and the
number of ranks, so every rank computes the same owners without talking.

[Note: one all-to-all per unit and direction]
Moving a unit's shards to their owners is one ``all_to_all_single`` of bytes: each rank packs,
for every destination, the tensors that rank needs, and each tensor starts at a 16-byte offset
so that the receiver can view it in its own dtype without a copy. One collective for the whole
unit, whatever the dtypes, instead of one gather per parameter; gloo and NCCL both take uneven
splits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Exchange", "TensorSpec", "assign_owners", "chunk_rows"]

TensorSpec = tuple[torch.Size, torch.dtype]
"""The shape and dtype of a tensor a rank expects to receive."""

_ALIGN = 16
"""Byte alignment of every tensor in an exchange buffer (any dtype can be viewed in place)."""


def chunk_rows(dim0: int, world_size: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` rows of dim 0 each rank holds under ``Shard(0)``.

    FSDP2 and DTensor shard with ``torch.chunk`` semantics: chunks of ``ceil(dim0 / n)`` rows, so
    the last ranks may hold fewer rows, or none.
    """
    chunk = -(-dim0 // world_size)
    return [(min(r * chunk, dim0), min((r + 1) * chunk, dim0)) for r in range(world_size)]


def assign_owners(numels: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each of a unit's parameters. See [Note: owners balance every unit]."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = min(range(world_size), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += numels[index]
    return owners


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(spec: TensorSpec) -> int:
    shape, dtype = spec
    return shape.numel() * dtype.itemsize


class Exchange:
    """Every rank of ``group`` sends a list of tensors to every rank, in one collective.

    Launched asynchronously at construction; :meth:`wait` returns, per source rank, the tensors
    it sent here, as views into one receive buffer. The send buffer is a copy, so the tensors
    passed in may be freed or changed as soon as the constructor returns. On a group of one
    rank nothing is copied or sent.

    Args:
        sends: for each destination rank, the tensors to send it.
        expects: for each source rank, the shape and dtype of each tensor it sends here.
        group: the process group; ranks are its group ranks.
    """

    def __init__(
        self,
        sends: Sequence[Sequence[torch.Tensor]],
        expects: Sequence[Sequence[TensorSpec]],
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self._expects = expects
        self._work: dist.Work | None = None
        if len(sends) == 1:
            self._received = [list(sends[0])]
            return
        in_splits = [sum(_padded(t.numel() * t.element_size()) for t in ts) for ts in sends]
        out_splits = [sum(_padded(_nbytes(spec)) for spec in specs) for specs in expects]
        send = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)
        offset = 0
        for tensors in sends:
            for tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                send[offset : offset + nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
                offset += _padded(nbytes)
        self._recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        self._send = send  # alive until the collective has read it
        self._work = dist.all_to_all_single(
            self._recv, send, out_splits, in_splits, group=group, async_op=True
        )

    def wait(self) -> list[list[torch.Tensor]]:
        """Wait for the collective; the tensors each source rank sent here, in order."""
        if self._work is None:
            return self._received
        self._work.wait()
        # Only the views keep the receive buffer alive from here: the caller frees it.
        recv, self._send, self._recv = self._recv, None, None
        received: list[list[torch.Tensor]] = []
        offset = 0
        for specs in self._expects:
            tensors = []
            for shape, dtype in specs:
                nbytes = _nbytes((shape, dtype))
                tensors.append(recv[offset : offset + nbytes].view(dtype).view(shape))
                offset += _padded(nbytes)
            received.append(tensors)
        return received
