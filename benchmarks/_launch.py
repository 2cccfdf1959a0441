"""Launch one world: ``world_size`` processes (gloo on CPU, nccl on CUDA) running the sweep."""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._config import SweepConfig
from benchmarks._measure import run_world

Body = Callable[[SweepConfig], list[dict[str, Any]]]
"""What every rank runs (collective); rank 0's return value comes back to ``launch``."""

__all__ = ["CPU_THREADS_PER_RANK", "launch"]

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank that stops answering fails the run after this long instead of hanging it."""


CPU_THREADS_PER_RANK = 1
"""Intra-op threads of each CPU rank: one core per rank, as one GPU per rank. (Two threads per
rank on a shared or oversubscribed machine spin against each other and distort step times.)"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, config: SweepConfig, body: Body, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(CPU_THREADS_PER_RANK)
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        records = body(config)
        if rank == 0:
            Path(out).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def launch(world_size: int, config: SweepConfig, body: Body = run_world) -> list[dict[str, Any]]:
    """Run ``body(config)`` on ``world_size`` fresh processes; return rank 0's records.

    ``body`` must be a module-level function (it is pickled by name). A failing rank raises
    here with its traceback (``torch.multiprocessing.spawn``).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        mp.spawn(_entry, args=(world_size, _free_port(), config, body, str(out)),
                 nprocs=world_size, join=True)
        return json.loads(out.read_text())
