"""A pool of gloo process groups that stay up for the whole test session.

Spawning a world costs seconds (each process imports torch), so each world size is spawned once
per test process and runs many test bodies, as PyTorch's ``MultiProcContinuousTest`` does. A
body is a module-level function; it runs on every rank with the same keyword arguments, and the
ranks' results come back as a list. A failing rank fails the test with its traceback; a rank that
hangs hits the collective timeout or the per-body timeout, and the world is then torn down and
re-spawned for the next test. A rank that crashes (a segmentation fault) writes the Python stacks
of its threads to a file of its own (``faulthandler``), which the failure then shows.

The time-outs only catch hangs, so they are sized for a loaded machine, never for speed: two
ranks sharing two busy cores with other test workers run several times slower than on an idle
machine, and one rank may compile or plot for a minute while the other waits in a collective.
The group's store is bound by this process before the ranks start (see [Note: the rendezvous
port is bound before anyone is told it] in ``fused_optim_dist_recipes.launch``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fused_optim_dist_recipes.launch import join_store, rendezvous_store

COLLECTIVE_TIMEOUT_S = 300
"""A collective waiting longer than this fails its rank."""
BODY_TIMEOUT_S = 600
"""A test body running longer than this on some rank is a hang: the world is torn down."""
START_TIMEOUT_S = 300
"""Spawning the ranks and forming the group (each process imports torch)."""
FAILURE_GRACE_S = 30
"""After one rank fails, how long to wait for the others to report before tearing the world
down: they are usually blocked in a collective the failed rank will never join."""
POLL_S = 1.0
"""How often a wait for results checks that every rank's process is still alive, so a rank
that died (killed, or crashed outside a body) fails the test at once, not at the time-out."""


def _worker(
    rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue, crash_log: str
) -> None:
    # Kept open for the process's life: faulthandler writes to it from the signal handler.
    crash_file = open(crash_log, "w")  # noqa: SIM115
    faulthandler.enable(file=crash_file, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        dist.init_process_group(
            "gloo",
            store=join_store(port, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        results.put((rank, True, pickle.dumps("ready")))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        try:
            task = tasks.get()
        except BaseException:
            # The body could not be unpickled (its test module failed to import here): report
            # it rather than die silently, and wait for the world to be torn down.
            results.put((rank, False, traceback.format_exc()))
            continue
        if task is None:
            break
        fn, kwargs = task
        try:
            from _toy import forget_updates_left

            forget_updates_left()
            out = fn(**kwargs)
            dist.barrier()
            # Pickled here, not in the queue's feeder thread, so that an unpicklable result
            # fails this rank with a traceback instead of never arriving.
            results.put((rank, True, pickle.dumps(out)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """``world_size`` processes in one gloo process group, running test bodies on request."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results: mp.Queue = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # Held for the world's life: the ranks' groups (meshes included) rendezvous through it.
        self._store = rendezvous_store(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self._crash_dir = tempfile.TemporaryDirectory(prefix="world-")
        self._crash_logs = [
            str(Path(self._crash_dir.name) / f"rank{rank}.txt") for rank in range(world_size)
        ]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    rank,
                    world_size,
                    self._store.port,
                    self._tasks[rank],
                    self._results,
                    self._crash_logs[rank],
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(START_TIMEOUT_S, what="start")

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self._procs)

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank; return the ranks' results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, kwargs))
        return self._collect(BODY_TIMEOUT_S, what=fn.__name__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        dead: list[str] = []
        while len(outcomes) < self.world_size and not dead and time.monotonic() < deadline:
            try:
                rank, ok, out = self._results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [
                    f"rank {r} exited with code {proc.exitcode}{self._crash_report(r)}"
                    for r, proc in enumerate(self._procs)
                    if r not in outcomes and not proc.is_alive()
                ]
                continue
            outcomes[rank] = (ok, out)
            if not ok:
                # The others are likely blocked in a collective it will never join.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        with contextlib.suppress(queue.Empty):  # what a rank sent before it exited
            while len(outcomes) < self.world_size:
                rank, ok, out = self._results.get_nowait()
                outcomes[rank] = (ok, out)
        if len(outcomes) < self.world_size:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            failures = [out for ok, out in outcomes.values() if not ok]
            raise AssertionError(
                f"{what}: ranks {missing} of {self.world_size} did not finish"
                + "".join(f"; {line}" for line in dead)
                + "\n"
                + "\n".join(failures)
            )
        failures = [
            f"--- rank {r} ---\n{out}" for r, (ok, out) in sorted(outcomes.items()) if not ok
        ]
        if failures:
            raise AssertionError(
                f"{what} failed on {len(failures)} rank(s):\n" + "\n".join(failures)
            )
        return [pickle.loads(outcomes[r][1]) for r in range(self.world_size)]

    def _crash_report(self, rank: int) -> str:
        """What ``rank``'s faulthandler wrote (its threads' stacks where it crashed), if any."""
        with contextlib.suppress(OSError):
            text = Path(self._crash_logs[rank]).read_text().strip()
            if text:
                return f" (its stacks where it crashed:)\n{text}\n"
        return ""

    def close(self) -> None:
        for tasks in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


class WorldPool:
    """One live ``World`` per world size, re-spawned if a test body left it broken."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def get(self, world_size: int) -> World:
        world = self._worlds.get(world_size)
        if world is None or not world.alive:
            world = self._worlds[world_size] = World(world_size)
        return world

    def run(self, world_size: int, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        world = self.get(world_size)
        try:
            return world.run(fn, **kwargs)
        except AssertionError:
            # A failed body may leave collectives out of step: start the next test afresh.
            world.close()
            del self._worlds[world_size]
            raise

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
