"""Stream ordering of the in-backward work on an accelerator (no-ops for CPU tensors).

[Note: streams of the in-backward step]
FSDP2 calls the post-accumulate-grad hooks inside ``with stream(post_reduce_stream)``: the
reduce-scatter stream, or the all-reduce stream for HSDP and with ``set_all_reduce_hook``
(``foreach_reduce`` in torch 2.13's ``_fsdp_collectives.py``). So a bucket's norm, clipping and
step are queued on that stream, and two things follow:

* The gradients are views of the reduce-scatter output, allocated on the reduce-scatter stream.
  When the hook's stream is another one, dropping them would let the caching allocator hand
  the block to the next unit's reduce-scatter while our kernels still read it. Before dropping
  a bucket's gradients we ``record_stream`` them on the hook's stream.
* Whatever runs after backward (the end-of-backward norm reduction, ``step()``, the next
  forward's all-gathers) must see the updated parameters. FSDP2's finalize makes the default
  stream wait for the post-reduce event, but it is skipped under
  ``set_is_last_backward(False)``; we do not rely on it. Each stepped bucket records an event
  on its stream, and the end-of-backward callback makes the current stream wait on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["StepEvents", "hook_stream", "keep_alive_until_done"]


def _on_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type not in ("cpu", "meta")


def keep_alive_until_done(tensors: Iterable[torch.Tensor]) -> None:
    """Keep the memory of ``tensors`` from reuse until the current stream's queued work ends.

    One ``record_stream`` per distinct storage: a unit's gradients share one buffer.
    """
    seen: set[int] = set()
    for tensor in tensors:
        if not _on_accelerator(tensor):
            continue
        storage = tensor.untyped_storage().data_ptr()
        if storage not in seen:
            seen.add(storage)
            tensor.record_stream(torch.accelerator.current_stream(tensor.device))


def hook_stream(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """A context that makes the current stream of ``tensor``'s device the one current now (in a
    hook FSDP2 calls: its post-reduce stream), for work queued later, outside the hook, that
    must be ordered as if queued in it; a no-op for CPU tensors."""
    if not _on_accelerator(tensor):
        return contextlib.nullcontext()
    return torch.accelerator.current_stream(tensor.device)


class StepEvents:
    """Events recorded after in-backward steps, one per stream, waited on at end of backward."""

    def __init__(self) -> None:
        self._events: dict[torch.Stream, torch.Event] = {}

    def record(self, device: torch.device) -> None:
        """Record an event on ``device``'s current stream (the hook's stream)."""
        if device.type in ("cpu", "meta"):
            return
        stream = torch.accelerator.current_stream(device)
        self._events[stream] = stream.record_event()

    def wait(self) -> None:
        """Make the current stream wait for every recorded step; forget them."""
        for stream, event in self._events.items():
            torch.accelerator.current_stream(stream.device).wait_event(event)
        self._events.clear()
