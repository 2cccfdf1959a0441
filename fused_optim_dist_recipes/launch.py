"""Start one process per rank on this machine, without torchrun: for benchmarks and tests.

``spawn(world_size, body, *args)`` runs ``body(*args)`` on fresh processes joined in one process
group (gloo on CPU, nccl with one GPU per rank) and returns rank 0's result. A failing rank
raises in the caller with its traceback (``torch.multiprocessing.spawn``), and every collective
waits at most ``COLLECTIVE_TIMEOUT``, so a rank that stops answering fails the run instead of
hanging it.

[Note: the rendezvous port is bound before anyone is told it]
Picking a free port, closing it and handing the number to the ranks (the usual
``MASTER_PORT`` recipe) leaves a window in which another process on the machine (a parallel
test worker, another job) can take the port, and the group then fails to form or, worse, joins
a stranger's store. ``rendezvous_store`` instead binds the store's server on port 0 in the
calling process, so the operating system picks a port that is already ours, and the ranks join
that server as clients (``join_store``). The caller keeps the server alive while the ranks run:
process groups created later (device meshes, ``new_group``) rendezvous through it too.

[Note: a rank ends without interpreter finalization]
``destroy_process_group`` drops c10d's own references to the groups, not the others: FSDP2's
param groups hold their mesh's process group (torch 2.13), and in the scaling benchmark's
ranks FSDP2's param groups were still alive after ``destroy_process_group`` and
``gc.collect()`` (the per-parameter method's gradient hooks keep its model). What is still
alive is torn down during interpreter finalization, after Python has started dismantling
itself, and a gloo group or thread torn down there can abort the process with "terminate
called without an active exception" (as pytorch#190489 shows for a group never destroyed).
This was seen in the quick scaling run after the ranks had met in the barrier below: once in
a full test run and once in 50 runs under load, the rank's result already written. A rank
whose body returned has nothing left to do once its group is destroyed and its result is on
disk, so it leaves with ``os._exit(0)``, as multiprocessing's forked children do: no
finalization, no destructor racing a background thread. A failing body still raises through
``torch.multiprocessing.spawn``'s error handling.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "CPU_THREADS_PER_RANK",
    "join_store",
    "rendezvous_store",
    "spawn",
]

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank that stops answering fails the run after this long instead of hanging it."""
CPU_THREADS_PER_RANK = 1
"""Intra-op threads of each CPU rank: one core per rank, as one GPU per rank. (Two threads per
rank on a shared or oversubscribed machine spin against each other and distort step times.)"""

T = TypeVar("T")


LOCALHOST = "127.0.0.1"


def rendezvous_store(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.TCPStore:
    """A store server on 127.0.0.1, bound to a port the OS chose; its ``port`` is the rendezvous.

    Keep the returned object alive while any rank uses the group: dropping it stops the server.
    See [Note: the rendezvous port is bound before anyone is told it].
    """
    return dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join_store(port: int, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.TCPStore:
    """A client of the server ``rendezvous_store`` bound on ``port``, for
    ``dist.init_process_group(store=...)``."""
    return dist.TCPStore(LOCALHOST, port, is_master=False, timeout=timeout)


def _entry(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(CPU_THREADS_PER_RANK)
        backend = "gloo"
    dist.init_process_group(
        backend,
        store=join_store(port),
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        result = body(*args)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(result))
        # destroy_process_group is not collective: a rank that tears its group down while a
        # peer's last collective is still in flight on the same connection can abort the peer
        # (gloo: "terminate called without an active exception"). Meet first.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # See [Note: a rank ends without interpreter finalization].
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world_size: int, body: Callable[..., T], *args: Any, device: str = "cpu") -> T:
    """Run ``body(*args)`` on ``world_size`` fresh processes; return rank 0's result.

    ``body`` must be a module-level function (it is pickled by name) and is collective: every
    rank calls it inside an initialised default process group, and destroys the group after.
    """
    store = rendezvous_store()  # held until every rank has finished
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pkl"
        mp.spawn(
            _entry,
            args=(world_size, store.port, device, body, args, str(out)),
            nprocs=world_size,
            join=True,
        )
        return pickle.loads(out.read_bytes())
