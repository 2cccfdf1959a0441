"""Buckets: the sets of parameters stepped together.

[Note: why buckets follow FSDP units]
FSDP2 reduce-scatters the gradients of one unit (one ``fully_shard`` call) into a single flat
buffer, and the sharded gradients it hands to the post-accumulate-grad hooks are views into that
buffer. Dropping one parameter's gradient therefore frees nothing until every gradient of the
unit is dropped, and stepping the unit's parameters one hook at a time would forgo the foreach
kernels. So a bucket is one unit: it is stepped, in one call per param group, when its last
gradient arrives, and then the whole buffer is released.

Parameters no ``fully_shard`` manages (a plain module, or tensor-parallel DTensors) get their
gradients from autograd one at a time; they are bucketed in runs of consecutive parameters of
about ``bucket_numel`` elements, so that each run completes as backward passes the layers that
own it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fused_optim_dist._torch_internals import fsdp_units

__all__ = ["Bucket", "plan_buckets"]


class Bucket:
    """A fixed set of parameters and the subset whose gradient has arrived since the last step."""

    __slots__ = ("_arrived", "params")

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = tuple(params)
        self._arrived: dict[int, torch.Tensor] = {}

    def arrive(self, param: torch.Tensor) -> bool:
        """Record that ``param`` holds its gradient; return whether the bucket is now complete."""
        self._arrived[id(param)] = param
        return len(self._arrived) == len(self.params)

    @property
    def pending(self) -> bool:
        return bool(self._arrived)

    def take(self) -> list[torch.Tensor]:
        """Return the arrived parameters in bucket order and start over."""
        arrived = [p for p in self.params if id(p) in self._arrived]
        self._arrived.clear()
        return arrived


def plan_buckets(params: Sequence[torch.Tensor], bucket_numel: int) -> list[Bucket]:
    """Bucket ``params``: one bucket per FSDP unit, then runs of the remaining parameters."""
    units = fsdp_units(params)
    in_units = {id(p) for unit in units for p in unit}
    buckets = [Bucket(unit) for unit in units]
    run: list[torch.Tensor] = []
    run_numel = 0
    for param in params:
        if id(param) in in_units:
            continue
        run.append(param)
        run_numel += param.numel()
        if run_numel >= bucket_numel:
            buckets.append(Bucket(run))
            run, run_numel = [], 0
    if run:
        buckets.append(Bucket(run))
    return buckets
