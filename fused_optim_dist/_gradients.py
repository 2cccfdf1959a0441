"""What happens to a bucket's gradients before its step: norm, non-finite check, clipping.

[Note: the gradient norm without holding the gradients]
Each bucket adds the squared L2 norm of its gradients to a running sum before the gradients are
freed. A rank holds only shards, so its share is the sum of squares of its local gradient
tensors, divided by the number of ranks holding the same values (the replicate dimensions of
the parameter's mesh, e.g. HSDP replicas); summing the shares over all ranks gives the exact
squared norm of the full gradients. Gradients of plain (non-DTensor) parameters are local to the
rank and are not summed across ranks, as ``torch.nn.utils.clip_grad_norm_`` treats them.

When nothing needs a bucket's norm before its step, the shares stay on the rank and one
all-reduce at the end of backward completes the norm. Clipping and the non-finite guard need the
bucket's global norm before stepping, so then each bucket all-reduces its share (every rank
steps the buckets in the same order, the order FSDP2 reduces the units in).

[Note: clipping inside one backward]
The exact global coefficient ``min(1, max_norm / total_norm)`` needs every gradient before the
first step, which is what in-backward stepping gives up. Each bucket is instead scaled by
``min(1, max_norm / sqrt(seen + predicted))``, where ``seen`` is the exact squared norm of this
backward's gradients so far, this bucket included, and ``predicted`` is the squared norm the
buckets still to come had in the previous stepping backward. So:

* the last bucket of a backward is scaled by exactly the global coefficient;
* when gradient norms change little between steps, every bucket is scaled by (nearly) the global
  coefficient, i.e. the result equals exact global clipping;
* a spike is clipped in the bucket where it happens and in every later bucket, never missed as
  with the previous step's global norm; only buckets already stepped keep a coefficient computed
  before the spike was seen;
* in the first backward there is no history, and ``predicted`` is zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["GradientProcessor"]


def _replicas(param: torch.Tensor) -> int:
    """How many ranks hold each element of ``param``'s local shard (1 for a plain tensor)."""
    if not isinstance(param, DTensor):
        return 1
    replicas = 1
    for size, placement in zip(param.device_mesh.shape, param.placements, strict=True):
        if isinstance(placement, Replicate):
            replicas *= size
    return replicas


def _local_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]


class _ShareWeights:
    """Per bucket: which gradients are sharded (summed over ranks), and 1 / their replicas."""

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.sharded = [isinstance(p, DTensor) for p in params]
        scale = [1.0 / _replicas(p) for p in params]
        self.scale = None if all(s == 1.0 for s in scale) else torch.tensor(scale, device=device)
        self.mask = torch.tensor(self.sharded, device=device)

    def shares(self, squares: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's squared-norm shares: (of sharded DTensor grads, of plain local grads)."""
        if self.scale is not None:
            squares = squares * self.scale
        if all(self.sharded):
            return squares.sum(), squares.new_zeros(())
        if not any(self.sharded):
            return squares.new_zeros(()), squares.sum()
        # torch.where, not a 0/1 weight: 0 * inf would turn an infinite norm into NaN.
        return (
            torch.where(self.mask, squares, 0.0).sum(),
            torch.where(self.mask, 0.0, squares).sum(),
        )


class GradientProcessor:
    """Per-backward gradient bookkeeping of one ``OptimizerInBackward``.

    Args:
        max_grad_norm: clip by norm as in [Note: clipping inside one backward]; ``None``: off.
        clip_grad_value: clamp each gradient element to ``[-v, v]``; ``None``: off.
        skip_nonfinite: when a bucket's gradient holds inf/NaN on any rank, skip its update on
            every rank (its gradients are dropped and its state is untouched).
        track_grad_norm: compute the total norm reported by :meth:`grad_norm`.
    """

    def __init__(
        self,
        *,
        max_grad_norm: float | None,
        clip_grad_value: float | None,
        skip_nonfinite: bool,
        track_grad_norm: bool,
    ) -> None:
        self.max_grad_norm = max_grad_norm
        self.clip_grad_value = clip_grad_value
        self.skip_nonfinite = skip_nonfinite
        self.track_grad_norm = track_grad_norm
        # A global norm is needed before each bucket's step: reduce per bucket.
        self._reduce_per_bucket = max_grad_norm is not None or skip_nonfinite
        self._needs_norm = self._reduce_per_bucket or track_grad_norm
        # This backward: squared-norm shares (sharded part, summed over ranks; local part), and
        # each bucket's global squared norm when reduced per bucket.
        self._sharded_sq: torch.Tensor | None = None
        self._local_sq: torch.Tensor | None = None
        self._bucket_sq: dict[int, torch.Tensor] = {}
        # Clipping history: each bucket's squared norm in the previous stepping backward, their
        # total, and the part of it that belongs to buckets already seen in this backward.
        self._previous_sq: dict[int, torch.Tensor] = {}
        self._previous_total: torch.Tensor | float = 0.0
        self._previous_seen: torch.Tensor | float = 0.0
        self._last_norm: torch.Tensor | None = None
        self.nonfinite_steps = 0
        # Cached per (bucket, number of parameters stepped).
        self._share_weights: dict[tuple[int, int], _ShareWeights] = {}

    def before_step(self, bucket_id: int, params: Sequence[torch.Tensor]) -> bool:
        """Account for and clip the bucket's gradients in place; return whether to step it.

        Collective (an all-reduce) when clipping by norm or skipping non-finite gradients.
        """
        if not self._needs_norm and self.clip_grad_value is None:
            return True
        grads = _local_grads(params)
        if self._needs_norm:
            squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()
            sharded, local = self._weights(bucket_id, params, squares.device).shares(squares)
            if self._reduce_per_bucket and dist.is_initialized():
                dist.all_reduce(sharded)
            self._sharded_sq = sharded if self._sharded_sq is None else self._sharded_sq + sharded
            self._local_sq = local if self._local_sq is None else self._local_sq + local
            if self._reduce_per_bucket:
                bucket_sq = sharded + local
                self._bucket_sq[bucket_id] = bucket_sq
                if self.skip_nonfinite and not torch.isfinite(bucket_sq):  # host sync
                    self.nonfinite_steps += 1
                    return False
                if self.max_grad_norm is not None:
                    torch._foreach_mul_(grads, self._clip_coefficient(bucket_id))
        if self.clip_grad_value is not None:
            torch._foreach_clamp_min_(grads, -self.clip_grad_value)
            torch._foreach_clamp_max_(grads, self.clip_grad_value)
        return True

    def _weights(
        self, bucket_id: int, params: Sequence[torch.Tensor], device: torch.device
    ) -> _ShareWeights:
        key = (bucket_id, len(params))  # a bucket stepped partially has other weights
        weights = self._share_weights.get(key)
        if weights is None or len(weights.sharded) != len(params):
            weights = self._share_weights[key] = _ShareWeights(params, device)
        return weights

    def _clip_coefficient(self, bucket_id: int) -> torch.Tensor:
        seen = self._sharded_sq + self._local_sq
        self._previous_seen = self._previous_seen + self._previous_sq.get(bucket_id, 0.0)
        predicted = seen + (self._previous_total - self._previous_seen)
        return (self.max_grad_norm / (predicted.sqrt() + 1e-6)).clamp(max=1.0)

    def end_of_step(self) -> None:
        """Close a stepping backward (or a ``step()`` of hand-set gradients).

        Collective (one all-reduce) when the norm was not already reduced per bucket.
        """
        if self._sharded_sq is None:
            return
        if not self._reduce_per_bucket and dist.is_initialized():
            dist.all_reduce(self._sharded_sq)
        self._last_norm = (self._sharded_sq + self._local_sq).sqrt()
        if self.max_grad_norm is not None:
            # Buckets that did not step this time are predicted to stay silent; a non-finite
            # bucket keeps its previous norm. No host sync.
            self._previous_sq = {
                k: torch.where(torch.isfinite(v), v, self._previous_sq.get(k, 0.0))
                for k, v in self._bucket_sq.items()
            }
            self._previous_total = sum(self._previous_sq.values(), 0.0)
        self._sharded_sq = self._local_sq = None
        self._bucket_sq = {}
        self._previous_seen = 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to clip exactly as the uninterrupted one: the clipping
        history (each bucket's squared norm in the last stepping backward) and the count of
        skipped updates. Identical on every rank. Reads the history back to the host."""
        return {
            "previous_sq": {k: float(v) for k, v in self._previous_sq.items()},
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        previous = {int(k): torch.tensor(v) for k, v in state["previous_sq"].items()}
        self._previous_sq = previous
        self._previous_total = sum(previous.values(), 0.0)
        self.nonfinite_steps = int(state["nonfinite_steps"])

    def grad_norm(self) -> torch.Tensor:
        if not self.track_grad_norm and not self._reduce_per_bucket:
            raise RuntimeError(
                "grad_norm() needs track_grad_norm=True (the default) at construction"
            )
        if self._last_norm is None:
            raise RuntimeError("grad_norm() is available after the first stepping backward")
        return self._last_norm
