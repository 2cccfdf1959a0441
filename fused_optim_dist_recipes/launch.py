"""Start one process per rank on this machine, without torchrun: for benchmarks and tests.

``spawn(world_size, body, *args)`` runs ``body(*args)`` on fresh processes joined in one process
group (gloo on CPU, nccl with one GPU per rank) and returns rank 0's result. A failing rank
raises in the caller with its traceback (``torch.multiprocessing.spawn``), and every collective
waits at most ``COLLECTIVE_TIMEOUT``, so a rank that stops answering fails the run instead of
hanging it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["COLLECTIVE_TIMEOUT", "CPU_THREADS_PER_RANK", "free_port", "spawn"]

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank that stops answering fails the run after this long instead of hanging it."""
CPU_THREADS_PER_RANK = 1
"""Intra-op threads of each CPU rank: one core per rank, as one GPU per rank. (Two threads per
rank on a shared or oversubscribed machine spin against each other and distort step times.)"""

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(CPU_THREADS_PER_RANK)
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = body(*args)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, body: Callable[..., T], *args: Any, device: str = "cpu") -> T:
    """Run ``body(*args)`` on ``world_size`` fresh processes; return rank 0's result.

    ``body`` must be a module-level function (it is pickled by name) and is collective: every
    rank calls it inside an initialised default process group, and destroys the group after.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pkl"
        mp.spawn(
            _entry,
            args=(world_size, free_port(), device, body, args, str(out)),
            nprocs=world_size,
            join=True,
        )
        return pickle.loads(out.read_bytes())
