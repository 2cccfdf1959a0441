"""The bucket plan: which parameters are stepped together, derived from the param groups.

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
own it. Clipping by norm keeps them in one bucket unless ``bucket_numel`` is given: see
[Note: clipping inside one backward] in ``_gradients.py``.

[Note: a plan is derived, never patched]
The plan is a pure function of ``param_groups`` (which parameters, in which group) and each
parameter's ``requires_grad``. Both can change behind the optimizer's back: a group added, a
state dict loaded, a block unfrozen with ``requires_grad_(True)`` or frozen again. The plan
keeps the signature it was built from, and the optimizer rebuilds it whenever the signature of
the current groups differs (checked at the start of every backward and every ``step()``), so
the user never has to tell it. The storage of each plain parameter is part of the signature too
(``p.data = other`` keeps the parameter but replaces its memory), so that parameters tied
through ``.data`` after the optimizer was built are refused as at construction: see [Note:
parameters sharing memory] in ``_sharing.py``. So is the C++ tensor of each parameter outside
FSDP2 units: ``Module.to()`` of tensor-parallel parameters, or any conversion or
``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``,
keeps the parameter object but swaps its C++ tensor, and with it the registration of its
hooks, which the rebuild registers again (see [Note: tensors swapped whole] in
``_torch_internals.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fused_optim_dist._sharing import (
    refuse_registered_overlap,
    refuse_shared_memory,
    registrations,
)
from fused_optim_dist._torch_internals import (
    FSDPUnit,
    fsdp_reduced_params,
    fsdp_units,
    impl_address,
    read_requires_grad,
    storages,
)
from fused_optim_dist._validation import refuse_gathered_copies

__all__ = ["Bucket", "BucketPlan"]


class Bucket:
    """A fixed set of trainable parameters, stepped together, in one call per param group.

    ``key`` names the bucket stably across runs of the same model and wrapping (its position,
    size and element count), so that history keyed by it (the clipping history) is never
    applied to another bucket after a resume with a different wrapping.
    """

    __slots__ = ("_all_by_group", "_group_of", "index", "key", "params")

    def __init__(
        self, index: int, params: Sequence[torch.Tensor], group_of: dict[int, int]
    ) -> None:
        self.index = index
        self.params = tuple(params)
        self.key = f"{index}:{len(self.params)}:{sum(p.numel() for p in self.params)}"
        self._group_of = group_of
        # The split of the whole bucket, the usual case, computed once.
        self._all_by_group = self._split(self.params)

    def by_group(self, params: Sequence[torch.Tensor]) -> list[tuple[int, list[int]]]:
        """The positions in ``params`` (members of this bucket, in its order) of each param
        group's parameters, in group order."""
        if len(params) == len(self.params):
            return self._all_by_group
        return self._split(params)

    def _split(self, params: Sequence[torch.Tensor]) -> list[tuple[int, list[int]]]:
        split: dict[int, list[int]] = {}
        for position, param in enumerate(params):
            split.setdefault(self._group_of[id(param)], []).append(position)
        return sorted(split.items())


class BucketPlan:
    """The buckets of the trainable parameters of ``param_groups``, in stepping order."""

    def __init__(self, param_groups: Sequence[dict[str, Any]], bucket_numel: int | None) -> None:
        """``bucket_numel``: elements per bucket of the parameters outside FSDP units;
        ``None``: one bucket for all of them."""
        # The signature the plan is derived from: each group's parameters (by identity) and
        # every parameter's requires_grad.
        self._group_params = tuple(tuple(g["params"]) for g in param_groups)
        self._all_params = [p for params in self._group_params for p in params]
        # Held by _all_params, so no id is recycled while the plan lives.
        self._ids = frozenset(map(id, self._all_params))
        position = {id(p): i for i, p in enumerate(self._all_params)}
        self.units = fsdp_units(self._all_params)
        """The FSDP2 units of the parameters, trainable or not."""
        self._unit_positions = [[position[id(p)] for p in unit.params] for unit in self.units]
        units = {id(p): unit for unit in self.units for p in unit.params}
        self.unit_of: Callable[[int], FSDPUnit | None] = units.get
        """The FSDP2 unit of the parameter an id names; ``None`` outside units."""
        self._in_units = frozenset(id(p) for unit in self.units for p in unit.params)
        self._requires_grad = self._read_requires_grad()
        refuse_shared_memory(param_groups, self._all_params, self._requires_grad)
        refuse_gathered_copies(self._all_params)  # listed in place since (param_groups edited)
        self._registrations = registrations()
        # What a forward reads directly: trainable parameters outside FSDP2 units.
        self._read_directly = [
            flag and id(p) not in self._in_units
            for p, flag in zip(self._all_params, self._requires_grad, strict=True)
        ]
        refuse_registered_overlap(param_groups, self._all_params, self._read_directly)
        # The plain parameters that have a storage, and their storages (held: never a
        # recycled object), for is_current, which reads them without storages()'s DTensor
        # lookup. DTensors are left out: FSDP2 replaces their local tensors itself.
        plain = [p for p in self._all_params if not isinstance(p, DTensor)]
        backed = [(p, s) for p, s in zip(plain, storages(plain), strict=True) if s is not p]
        self._plain = [p for p, _ in backed]
        self._storages = [s for _, s in backed]
        # The parameters whose hooks autograd runs (outside FSDP2 units), and their C++
        # tensors, which swap_tensors replaces.
        self._outside = [p for p in self._all_params if id(p) not in self._in_units]
        self._impls = list(map(impl_address, self._outside))
        trainable = [
            p for p, flag in zip(self._all_params, self._requires_grad, strict=True) if flag
        ]
        group_of = {id(p): index for index, params in enumerate(self._group_params) for p in params}
        self.trainable = tuple(trainable)
        self.frozen = tuple(
            p for p, flag in zip(self._all_params, self._requires_grad, strict=True) if not flag
        )
        # The trainable parameters that are plain tensors (what DistributedDataParallel trains).
        self.plain_trainable = tuple(p for p in trainable if not hasattr(p, "device_mesh"))
        self.plain_ids = frozenset(map(id, self.plain_trainable))
        self.buckets = tuple(
            Bucket(index, params, group_of)
            for index, params in enumerate(_split(trainable, self.units, bucket_numel))
        )

        buckets = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.bucket_of: Callable[[int], Bucket | None] = buckets.get
        """The bucket of the parameter an id names; ``None`` if not a trainable parameter."""
        # Ids of the parameters whose unit can be closed as soon as FSDP2 has reduced it. See
        # [Note: a unit closes when FSDP2 has reduced it].
        self.reduced_by_fsdp = fsdp_reduced_params(trainable)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is in the param groups this plan was made from, trainable or
        not."""
        return id(param) in self._ids

    def is_current(self, param_groups: Sequence[dict[str, Any]]) -> bool:
        """Whether ``param_groups`` hold the same parameters, with the same ``requires_grad``
        and, for plain ones, the same storages, and, outside FSDP2 units, the same C++
        tensors.

        Runs at every backward and ``step()``: identity and flag comparisons only (about 50 ns
        per plain parameter for the storages, 60 for the C++ tensor)."""
        if len(param_groups) != len(self._group_params):
            return False
        for group, params in zip(param_groups, self._group_params, strict=True):
            current = group["params"]
            if len(current) != len(params) or not all(map(operator.is_, current, params)):
                return False
        return (
            self._read_requires_grad() == self._requires_grad
            and all(
                map(operator.is_, map(torch.Tensor.untyped_storage, self._plain), self._storages)
            )
            and list(map(impl_address, self._outside)) == self._impls
        )

    def refuse_registered_since(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """Raise if a tensor registered on a module since the last check shares memory with a
        trainable plain parameter (the groups are those the plan is current for). See [Note: a
        module's tensor over a trained parameter's memory] in ``_sharing.py``."""
        count = registrations()
        if count != self._registrations:
            refuse_registered_overlap(param_groups, self._all_params, self._read_directly)
            self._registrations = count

    def _read_requires_grad(self) -> list[bool]:
        """Each parameter's ``requires_grad`` as autograd sees it: in a unit that is unsharded,
        its unsharded parameter's. See [Note: FSDP2's copies and flags] in
        ``_torch_internals.py``."""
        flags = read_requires_grad(self._all_params)
        for unit, positions in zip(self.units, self._unit_positions, strict=True):
            module_flags = unit.module_requires_grad()
            if module_flags is not None:
                for i, flag in zip(positions, module_flags, strict=True):
                    flags[i] = flag
        return flags

    def delivers_nothing(self, param: torch.Tensor) -> bool:
        """Whether a post-accumulate-grad hook call for ``param``, one of the plan's parameters
        outside FSDP2 units, came with no gradient: autograd runs a leaf's hooks even where it
        accumulated nothing because the leaf no longer requires grad (frozen between forward
        and backward; torch 2.13), and the plain optimizer then steps nothing of it. FSDP2
        calls its sharded parameters' hooks only with the gradient it reduced into them,
        whatever their flag."""
        return not param.requires_grad and id(param) not in self._in_units and self.holds(param)

    def gathered_units(self) -> list[FSDPUnit]:
        """The units that hold all-gathered weights now."""
        return [unit for unit in self.units if unit.holds_gathered_copy()]


def _split(
    params: Sequence[torch.Tensor], units: Sequence[FSDPUnit], bucket_numel: int | None
) -> list[list[torch.Tensor]]:
    """One bucket per FSDP unit (of ``units``, those of the parameters), then runs of about
    ``bucket_numel`` remaining parameters."""
    wanted = {id(p) for p in params}
    buckets = [[p for p in unit.params if id(p) in wanted] for unit in units]
    buckets = [bucket for bucket in buckets if bucket]
    in_units = {id(p) for bucket in buckets for p in bucket}
    run: list[torch.Tensor] = []
    run_numel = 0
    for param in params:
        if id(param) in in_units:
            continue
        run.append(param)
        run_numel += param.numel()
        if bucket_numel is not None and run_numel >= bucket_numel:
            buckets.append(run)
            run, run_numel = [], 0
    if run:
        buckets.append(run)
    return buckets
