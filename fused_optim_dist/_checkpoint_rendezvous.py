"""Joining the process group of a torchrun job so that ``--max-restarts`` restarts work.

[Note: one store, many attempts]
Since torch 2.5 torchrun's agent hosts one TCPStore for the whole job and hands it to every
worker (``TORCHELASTIC_USE_AGENT_STORE=True``); ``init_process_group("env://")`` then joins it
without a per-attempt namespace. The store outlives the workers, so after a restart it still
holds the keys the killed attempt wrote: gloo's and NCCL's rendezvous keys (each rank's address,
the NCCL unique id) and the init barrier's counters. A restarted worker can read its peer's
address from the dead attempt before the live peer has published its new one, and then waits on
a connection that never comes: the job hangs after the restart (pytorch/pytorch#135712; in our
runs most restarts hung). Setting ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it by giving
each attempt a fresh store, but nobody sets it before their first failure.

:func:`init_process_group` instead joins the agent's store under a prefix naming the attempt
(``TORCHELASTIC_RESTART_COUNT``), so every attempt starts from an empty namespace. torchrun
counts restarts per agent, so the prefix is shared by all workers of one node: every
single-node job is covered. In torch 2.13 a multi-node job's agents can disagree (the agent
whose worker failed counts a restart, the others restart their workers without counting one),
so restartable multi-node jobs still need ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; with it set
this function is plain ``init_process_group``.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["init_process_group"]

_AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
_RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def init_process_group(
    backend: str | None = None, *, timeout: datetime.timedelta | None = None
) -> None:
    """``dist.init_process_group(backend, timeout=timeout)`` for a job launched by torchrun,
    safe across ``torchrun --max-restarts`` restarts. See [Note: one store, many attempts].

    Outside torchrun's shared store (plain ``env://`` variables, or
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) it is exactly ``dist.init_process_group``.
    """
    if os.environ.get(_AGENT_STORE_VAR) != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout or _DEFAULT_TIMEOUT,
    )
    attempt = os.environ.get(_RESTART_COUNT_VAR, "0")
    store = dist.PrefixStore(f"fused_optim_dist/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
