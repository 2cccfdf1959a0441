"""Peak memory of one training step on an FSDP2 model, by kind, and where the peak sits.

One tracker serves the simulation (fake tensors on a fake process group, see
:mod:`fused_optim_dist_recipes.memory_estimate`) and its validation on real tensors: it is
PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools``), a ``TorchDispatchMode`` that
accounts every tensor storage created by a dispatched op and frees it through weakref
finalizers, and that labels FSDP2's sharded/unsharded parameters and gradients and its
communication buffers. Three things are adapted here:

* Optimizer state is labelled by identity: the tensors in the optimizer's ``state`` (created by
  the warm-up step) are marked as optimizer state on entry. ``FSDPMemTracker`` labels by the
  optimizer's step hooks instead, which an in-backward step never fires, and it counts a plain
  step's scratch (foreach intermediates) as state.
* What the loop allocates after backward (clipping, ``step()``, ``zero_grad()``) is labelled
  temporary, like the scratch of an in-backward step inside backward.
* The moment of the peak is located: the phase of the step and the innermost module running.

Optionally the tracker adds, to every reduce-scatter, the transient input-sized buffer that
gloo's ``reduce_scatter_tensor`` allocates (it runs an all-reduce on a copy of the input and
keeps one chunk): see [Note: gloo's reduce-scatter buffer].
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import (
    FSDPMemTracker,
    _FSDPRefType,
    _FSDPState,
)

__all__ = ["KINDS", "Peak", "StepMemoryTracker"]

KINDS: dict[str, tuple[_FSDPRefType, ...]] = {
    "parameters": (
        _FSDPRefType.SHARDED_PARAM,
        _FSDPRefType.UNSHARDED_PARAM,
        _FSDPRefType.ALL_GATHER,
        _FSDPRefType.BUFFER,
    ),
    "gradients": (
        _FSDPRefType.SHARDED_GRAD,
        _FSDPRefType.UNSHARDED_GRAD,
        _FSDPRefType.REDUCE_SCATTER,
    ),
    "optimizer_state": (_FSDPRefType.OPT,),
    "activations": (_FSDPRefType.ACT, _FSDPRefType.INP),
    "temporaries": (_FSDPRefType.TEMP,),
}
"""The reported kinds of memory, and the tracker's categories each one sums."""

_TOTAL = "Total"
_GLOBAL_MODULE = "Global"

# [Note: gloo's reduce-scatter buffer]
# ProcessGroupGloo implements reduce_scatter_tensor as an all-reduce of a copy of the whole
# input followed by a copy of this rank's chunk: it holds one more input-sized buffer,
# allocated in C++ where no dispatch mode sees it (torch.profiler's allocator events show it:
# 4 MiB allocated for a 4 MiB input), and released by gloo's worker thread when the work is
# done, which in backward overlaps the next unit's compute. NCCL reduce-scatters into the
# output, and the fake process group allocates nothing. To compare a simulation with a
# measured gloo run, the tracker can hold such a buffer from each reduce-scatter until the
# next one (at most one at a time) and drop the last when backward ends; an estimate for
# NCCL leaves it out.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peak:
    """The peak of one tracked step on one rank."""

    total: int
    """Bytes of all tracked tensors at the peak."""
    by_kind: dict[str, int]
    """Bytes of each of ``KINDS`` at the peak; they sum to ``total``."""
    phase: str
    """Phase of the step at the peak (forward, backward, recompute, post-backward, step)."""
    module: str
    """Innermost module running at the peak (its fully qualified name), or ``"-"``."""


class StepMemoryTracker(FSDPMemTracker):
    """``FSDPMemTracker`` for one training step; see the module docstring.

    Enter it after a warm-up step (the optimizer state exists), run one step inside, and read
    :meth:`peak`. Wrap what the loop runs after backward in :meth:`after_backward`.

    Args:
        model: the root ``fully_shard`` module.
        state: the optimizer state tensors that exist on entry.
        gloo_reduce_scatter_buffer: add gloo's transient reduce-scatter buffer (see
            [Note: gloo's reduce-scatter buffer]).
    """

    def __init__(
        self,
        model: nn.Module,
        state: Iterable[torch.Tensor],
        *,
        gloo_reduce_scatter_buffer: bool = False,
    ) -> None:
        super().__init__(model, None)
        self._state = list(state)
        # The phase label of what runs inside after_backward(); None while backward runs.
        self._loop_phase: str | None = None
        self._gloo_buffer = gloo_reduce_scatter_buffer
        # The emulated gloo buffer of the latest reduce-scatter, while it lives.
        self._gloo_scratch: torch.Tensor | None = None
        # Where the peak was reached: (phase, module); updated whenever the peak grows.
        self._peak_at = ("before the step", "-")

    def __enter__(self) -> StepMemoryTracker:
        super().__enter__()
        for tensor in self._state:
            self._update_and_maybe_create_winfos(tensor, _FSDPRefType.OPT)
        return self

    @contextlib.contextmanager
    def after_backward(self) -> Iterator[None]:
        """Label what the loop allocates inside as temporary, in the optimizer-step phase."""
        self._loop_phase = "after backward: clipping, optimizer step(), zero_grad()"
        self._gloo_scratch = None  # backward's last reduce-scatter is done
        try:
            yield
        finally:
            self._loop_phase = None

    def _track(self, reftype: _FSDPRefType, t: torch.Tensor) -> None:
        super()._track(_FSDPRefType.TEMP if self._loop_phase else reftype, t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            self._gloo_buffer
            and func is torch.ops.c10d._reduce_scatter_base_.default
            and self._fsdp_state == _FSDPState.POST_BW
        ):
            # See [Note: gloo's reduce-scatter buffer]: replaces the previous one.
            self._gloo_scratch = None
            self._gloo_scratch = torch.empty_like(args[1])
            self._update_and_maybe_create_winfos(self._gloo_scratch, _FSDPRefType.REDUCE_SCATTER)
            self._update_peak_stats(None)  # no per-module state: see _update_peak_stats
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Only the global peak and its location: the per-module peak snapshots the parent
        # class keeps (a deep copy each time a module's own peak grows) are not reported, and
        # they took a third of a simulated step's time.
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                self._peak_mem[dev] = snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(snap)
                self._peak_at = (self._phase(), self._innermost_module())

    def _phase(self) -> str:
        if self._loop_phase is not None:
            return self._loop_phase
        if not self._mod_tracker.is_bw:
            return "forward: all-gather" if self._fsdp_state == _FSDPState.PRE_FW else "forward"
        if self._in_ac:
            return "backward: recomputing the forward (activation checkpointing)"
        return {
            _FSDPState.PRE_BW: "backward: all-gather",
            _FSDPState.POST_BW: "backward: reduce-scatter and post-backward (in-backward step)",
        }.get(self._fsdp_state, "backward")

    def _innermost_module(self) -> str:
        names = [name for name in self._mod_tracker.parents if name != _GLOBAL_MODULE]
        return max(names, key=lambda name: name.count("."), default="-")

    def peak(self) -> Peak:
        """The peak of everything tracked so far, with its breakdown and location."""
        snaps = list(self.get_tracker_snapshot("peak").values())
        if len(snaps) != 1:
            raise RuntimeError(
                f"expected tensors on one device in the tracker, found {len(snaps)}; track "
                "one device per process"
            )
        snap = snaps[0]
        by_kind = {kind: sum(snap.get(ref, 0) for ref in refs) for kind, refs in KINDS.items()}
        phase, module = self._peak_at
        return Peak(total=snap[_TOTAL], by_kind=by_kind, phase=phase, module=module)
