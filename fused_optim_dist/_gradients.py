"""What happens to a bucket's gradients before its step: norm, non-finite check, clipping.

[Note: the gradient norm without holding the gradients]
Each bucket adds the squared L2 norm of its gradients to a running sum before the gradients are
freed. A rank holds only shards, so its share of a DTensor gradient is the sum of squares of its
local tensor, and the shares are summed over the mesh dimensions the gradient is sharded on
(never over replicated ones, e.g. HSDP's replicate dimension: those ranks hold the same values).
Each collective runs on the process group of the parameter's own mesh, never the world group,
so FSDP on a sub-mesh, pipeline stages or separate inference ranks are not mixed in, and on the
mesh's device type, so a norm of CPU-offloaded gradients is reduced where the backend runs.
Gradients of plain (non-DTensor) parameters are local to the rank and not summed, as
``torch.nn.utils.clip_grad_norm_`` treats them; they need no collective at all.

When nothing needs a bucket's norm before its step, the shares stay on the rank and one
all-reduce per mesh dimension at the end of backward completes the norm. Clipping and the
non-finite guard need the bucket's global norm before stepping, so then each bucket reduces its
shares (every rank steps the buckets in the same order, the order FSDP2 reduces the units in).
No value is read back to the host in backward, except to skip a non-finite bucket of an
optimizer that takes no ``found_inf`` (see ``BucketVerdict``).

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
* in the first backward there is no history, and ``predicted`` is zero;
* a bucket skipped by ``skip_nonfinite`` adds nothing to ``seen`` and keeps its previous
  history, so one bad unit never scales the others by NaN.
* when the trainable set changes (a parameter frozen or unfrozen, a group added), the plan is
  rebuilt and the history of buckets it no longer has is dropped; it would otherwise be
  predicted in every backward and never arrive.

The norm is the optimizer's own: two ``OptimizerInBackward`` clipping by norm that get
gradients from one backward (Muon's matrices and AdamW's other parameters, built apart) would
each clip by the norm of their own parameters, where a plain loop's
``clip_grad_norm_(model.parameters(), ...)`` clips every one by their joint norm. Such a
backward (stepped, or held under ``accumulate()`` for ``step()``) is refused at the first
gradient either gets, before anything moves, unless both say ``clip_alone``: the engine tells
whether it reaches the other's parameters (``OptimizerInBackward._refuse_clipping_beside``);
under reentrant checkpointing, where their first gradients come in different nested
backwards, when the second's returns into the outer one, after either may have stepped.
One ``OptimizerInBackward`` whose param groups name their classes clips them together.

[Note: clip_grad_norm_'s own norm]
Exact is bit for bit where it can be: a bucket of plain tensors, or of DTensors all sharded
alike (an FSDP2 unit), clipped by norm, takes its norm as ``clip_grad_norm_`` does, one
``_foreach_norm`` per device and dtype (so bfloat16 gradients' norms rounded to bfloat16, as
``clip_grad_norm_`` rounds them, and the coefficient computed in that dtype), in the order of
its parameters, and for DTensors the squares of that stack summed across ranks and their
roots taken (as DTensor completes the partial norms), then the norm of the stack; where it is
the plan's only bucket, that norm is the coefficient's and ``grad_norm()``'s, not the square
root of its square (the history holds no other bucket: a plan's change drops it). Both loops
then scale by the same coefficient: a difference of one rounding in it changes the gradients
in their last bit, which an optimizer with quantized state (``CompactAdamW``: a code flips)
turns into a difference of a whole code step. Elsewhere (several buckets, DTensors of several
meshes or placements, no clipping by norm) the norm is summed in float32 at least, bfloat16
gradients' too, and equals ``clip_grad_norm_``'s to float32 rounding (bfloat16 gradients: to
the two bfloat16 roundings ``clip_grad_norm_`` makes).

So clipping is exact with one bucket, and the buckets are what the user chose: FSDP units, or
runs of ``bucket_numel`` elements of the parameters outside them when ``bucket_numel`` is
given. By default those parameters are one bucket when clipping by norm: their gradients are
held until the last one arrives, as a plain optimizer holds them, and clipped exactly; giving
``bucket_numel`` trades that exactness for releasing them bucket by bucket.

[Note: what step() steps]
The gradients ``step()`` finds (every micro-batch's under ``accumulate()``, gradients set by
hand) are all known before its first bucket moves, so nothing forces the scheme of [Note:
clipping inside one backward] there: their norm and finiteness are taken over all of them first
(``GradientProcessor.before_steps``), and every bucket is then clipped by
``clip_grad_norm_``'s coefficient (bit for bit where the norm is taken as it takes it, over
every gradient in the parameters' order), and with ``skip_nonfinite`` a non-finite value
anywhere skips every bucket, as the plain loop's check before ``step()`` skips the step
(stepped bucket by bucket, they were 8.6e-3 apart after four clipped AdamW steps on three
FSDP2 units, 2.8e-2 skipping). The buckets' squared norms, reduced together (one all-reduce per
mesh dimension), are the clipping history the next backward predicts from, as a backward's
are. The buckets a backward steps at its end (``BackwardPass.finish``) are not such a set:
others were stepped before them in that backward, by the in-backward scheme, which they
complete.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fused_optim_dist._options import InBackwardOptions
from fused_optim_dist._plan import Bucket
from fused_optim_dist._torch_internals import flatten, local_tensor

__all__ = ["BackwardNorms", "BucketVerdict", "GradientProcessor", "all_zero"]

# How a share of the squared norm is completed: summed over these dimensions of this mesh, or
# (None) left local.
_ReduceKey = tuple[DeviceMesh, tuple[int, ...]] | None


def _reduce_key(param: torch.Tensor) -> _ReduceKey:
    if not isinstance(param, DTensor):
        return None
    dims = tuple(
        dim
        for dim, placement in enumerate(param.placements)
        if not isinstance(placement, Replicate)
    )
    return (param.device_mesh, dims) if dims else None


def _all_reduce(value: torch.Tensor, key: _ReduceKey) -> torch.Tensor:
    """Sum ``value`` over the ranks ``key`` names, on its mesh's groups and device type."""
    if key is None or not dist.is_initialized():
        return value
    mesh, dims = key
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    for dim in dims:
        dist.all_reduce(value, group=mesh.get_group(dim))
    return value


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value.to(total.device)


_SMALL_NUMEL = 1 << 15
"""Local gradients of at most this many elements are concatenated for the norm. See [Note: the
squared norm of many small gradients]."""


class _Shares:
    """A bucket's squared gradient norm, split by how each share must be reduced.

    [Note: the squared norm of many small gradients]
    ``torch._foreach_norm`` runs one kernel per tensor on the CPU: a few microseconds each, far
    more than the arithmetic for small tensors. Small gradients are therefore concatenated into
    one copy (at most ``_SMALL_NUMEL`` elements each, freed at once) and their squared norm
    taken as one dot product; large ones keep ``_foreach_norm``, which copies nothing.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        # Per reduce key: indices of the small gradients, and of the large ones.
        by_key: dict[_ReduceKey, tuple[list[int], list[int]]] = {}
        for index, param in enumerate(params):
            small, large = by_key.setdefault(_reduce_key(param), ([], []))
            (small if local_tensor(param).numel() <= _SMALL_NUMEL else large).append(index)
        self._by_key = [(key, small, large) for key, (small, large) in by_key.items()]
        # See [Note: clip_grad_norm_'s own norm]: one reduce key, DTensors or plain tensors.
        self.exact = (
            len(by_key) == 1
            and len({isinstance(p, DTensor) for p in params}) == 1
            and not any(p.is_complex() for p in params)
        )
        self.key = next(iter(by_key), None)
        # Summed in fp32 at least (bf16 sums lose the small gradients), fp64 if any gradient is
        # (a gradient has its parameter's dtype).
        self._dtype = (
            torch.float64
            if any(p.dtype in (torch.float64, torch.complex128) for p in params)
            else torch.float32
        )

    def squares(self, grads: Sequence[torch.Tensor]) -> list[tuple[_ReduceKey, torch.Tensor]]:
        """Each reduce key's share of the squared norm of ``grads``."""
        dtype = self._dtype
        # A complex gradient's norm is that of its real and imaginary parts.
        grads = [torch.view_as_real(g) if g.is_complex() else g for g in grads]
        out = []
        for key, small, large in self._by_key:
            share: torch.Tensor | None = None
            if small:
                flat = flatten(grads if len(small) == len(grads) else [grads[i] for i in small])
                if flat.dtype != dtype:
                    flat = flat.to(dtype)
                share = torch.dot(flat, flat)
            if large:
                norms = torch._foreach_norm([grads[i] for i in large], 2, dtype=dtype)
                share = _add(share, torch.stack(norms).square().sum())
            assert share is not None
            out.append((key, share))
        return out


# [Note: a non-finite step]
# A bucket (or what ``step()`` steps) is not finite where its gradient norm is not: an inf or
# NaN value, or finite values so large that the float32 sum of their squares overflows (a norm
# above about 1.8e19, a run already diverging). That is the criterion of
# ``clip_grad_norm_(..., error_if_nonfinite=True)``, and of a plain loop skipping its step where
# the norm ``clip_grad_norm_`` returns is not finite, which ``skip_nonfinite`` equals. A loop
# checking the values instead (GradScaler's ``found_inf``) steps such gradients, clipped by a
# zero coefficient where it clips; telling the two apart would cost a second pass over every
# bucket's gradients (their largest magnitude) for a step that only a diverged run takes.


def clip_grad_norm(grads: Sequence[torch.Tensor], key: _ReduceKey) -> torch.Tensor:
    """The L2 norm of ``grads`` (local tensors, of DTensors sharded as ``key`` says or of plain
    tensors) computed as ``torch.nn.utils.clip_grad_norm_`` computes it (torch 2.13,
    ``_get_total_norm``): one ``_foreach_norm`` per device and dtype, in order of first
    appearance, stacked on the first one's device; for DTensors, the stack's squares summed
    across the ranks and their roots taken, as DTensor completes a ``_NormPartial``; then the
    norm of the stack. See [Note: clip_grad_norm_'s own norm]."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    norms = [norm for group in by_kind.values() for norm in torch._foreach_norm(group, 2.0)]
    first = grads[0].device
    stacked = torch.stack([n.to(first) for n in norms])
    if key is not None:
        stacked = _all_reduce(stacked**2.0, key).to(first) ** 0.5
    return torch.linalg.vector_norm(stacked, 2.0)


def all_zero(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` (``grads``: their local tensors) is exactly zero
    on every rank that holds a shard of it. Collective, as the norm is; reads one value back.
    The largest magnitude is taken, not the square, which can underflow to zero."""
    by_key: dict[_ReduceKey, list[torch.Tensor]] = {}
    for param, grad in zip(params, grads, strict=True):
        if grad.numel():
            by_key.setdefault(_reduce_key(param), []).append(grad)
        else:
            by_key.setdefault(_reduce_key(param), [])
    total: torch.Tensor | None = None
    for key, local in by_key.items():
        largest = (
            torch.stack(torch._foreach_norm(local, float("inf"))).max().float()
            if local
            else torch.zeros(())
        )
        total = _add(total, _all_reduce(largest, key))
    return total is None or bool(total == 0)


@dataclasses.dataclass
class BucketVerdict:
    """Whether to step a bucket, and the ``found_inf`` flag a fused kernel skips it with."""

    step: bool = True
    found_inf: torch.Tensor | None = None


class BackwardNorms:
    """The norm bookkeeping of one backward pass; a new one starts with every backward."""

    def __init__(self) -> None:
        # Shares not yet reduced across ranks (reduced once, at the end), by reduce key.
        self.pending: dict[_ReduceKey, list[torch.Tensor]] = {}
        # Global squared norm of the buckets reduced so far: all of them, and the finite ones.
        self.reduced: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        # Each bucket's global squared norm, by bucket key (for the clipping history).
        self.bucket_sq: dict[str, torch.Tensor] = {}
        # The part of the previous backward's squared norm that belongs to buckets seen now.
        self.previous_seen: torch.Tensor | float = 0.0
        self.any = False
        # The global norm, where it is known before it clips a bucket: the plan's only
        # bucket's, or that of every gradient step() steps (see GradientProcessor.before_steps),
        # as clip_grad_norm_ takes it where it can: see [Note: clip_grad_norm_'s own norm].
        self.exact: torch.Tensor | None = None
        # Whether every gradient of the pass is finite, where known before its first bucket.
        self.finite: torch.Tensor | None = None


def _partly_skipped(applied: bool) -> RuntimeError:
    """The refusal of a step whose passes were not all finite or all not, with
    ``skip_nonfinite``: ``applied``, after a finite pass's updates were made."""
    if applied:
        return RuntimeError(
            "step(): with skip_nonfinite, one backward of this step had a non-finite "
            "gradient and was skipped, where another's updates were applied in backward "
            "and cannot be undone; a plain loop checking the step's gradients would skip "
            "the whole step. Run every backward of a step but the last under "
            "optim.accumulate() (the step is then checked as a whole), and restart from "
            "the last checkpoint."
        )
    return RuntimeError(
        "step(): with skip_nonfinite, a backward of this step had a non-finite gradient and "
        "was skipped, and the gradients set by hand since are finite: a plain loop checking "
        "the step's gradients would skip the whole step, here they would be applied. Nothing "
        "of this step moved: set those gradients to None and call step() again to skip the "
        "step as the plain loop does, or set gradients by hand only after finite backwards."
    )


PER_BUCKET_CLIPPING = (
    "max_grad_norm over several buckets (FSDP units) in backward: each bucket is clipped when "
    "ready, by the norm seen so far plus the rest's from the previous step, so the result "
    "differs slightly from clip_grad_norm_ over all gradients (docs/gradients.md, 'Clipping in "
    "one backward'). Exact: every backward of a step under optim.accumulate(), then step(); "
    "or one FSDP unit."
)
"""Said once per optimizer, at the first bucket it clips in backward with others to come or
gone. See [Note: clipping inside one backward]."""


class GradientProcessor:
    """Norm, non-finite guard and clipping of one ``OptimizerInBackward``, across steps.

    Per-backward sums live in a :class:`BackwardNorms`; this object keeps only what outlives a
    backward: the clipping history, the last norm and the count of skipped updates.
    """

    def __init__(self, options: InBackwardOptions) -> None:
        self.max_grad_norm = options.max_grad_norm
        self.clip_grad_value = options.clip_grad_value
        self.skip_nonfinite = options.skip_nonfinite
        self.track_grad_norm = options.track_grad_norm
        # A global norm is needed before each bucket's step: reduce per bucket.
        self._reduce_per_bucket = self.max_grad_norm is not None or self.skip_nonfinite
        self._needs_norm = self._reduce_per_bucket or self.track_grad_norm
        # Clipping history: each bucket's squared norm in the previous stepping backward (by
        # bucket key) and their total.
        self._previous_sq: dict[str, torch.Tensor] = {}
        self._previous_total: torch.Tensor | float = 0.0
        self._last_norm: torch.Tensor | None = None
        # Each stepping pass's norm since the last step().
        self._pass_norms: list[torch.Tensor] = []
        # Skipped bucket updates: a device counter, read back only when asked.
        self._nonfinite: torch.Tensor | int = 0
        # _Shares of each bucket's full parameter list, cached by bucket key.
        self._shares: dict[str, _Shares] = {}
        # id(param) -> position in the order clip_grad_norm_ is given the parameters (set by
        # OptimizerInBackward.set_norm_order); empty: the buckets' order.
        self.norm_order: dict[int, int] = {}
        # Whether the warning that clipping runs per bucket was given (once per optimizer).
        self._warned_per_bucket = False

    @property
    def reduces_per_bucket(self) -> bool:
        """Whether each bucket's step depends on the norm seen so far (clipping by norm, or
        the non-finite check)."""
        return self._reduce_per_bucket

    @property
    def active(self) -> bool:
        return self._needs_norm or self.clip_grad_value is not None

    def before_step(
        self,
        norms: BackwardNorms,
        bucket: Bucket,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        device_skip: bool,
        alone: bool,
        held: bool = False,
    ) -> BucketVerdict:
        """Account for and clip the bucket's gradients (``grads``: the local tensors of the
        gradients of ``params``) in place; say whether to step it.

        Collective (all-reduces of one scalar) when clipping by norm or skipping non-finite
        gradients. ``device_skip``: the step takes a ``found_inf`` flag, so a non-finite bucket
        is skipped on the device with no host sync. ``alone``: the bucket is the plan's only
        one (see [Note: clip_grad_norm_'s own norm]). ``held``: the bucket is stepped at the
        end of backward, and clipped there by :meth:`clip_held`, not here.
        """
        if not self.active:
            return BucketVerdict()
        verdict = BucketVerdict()
        if self._needs_norm:
            norms.any = True
            # Known before the pass's first bucket (see before_steps): the verdict on all.
            finite = norms.finite
            if finite is None:
                of_bucket = self._shares_of(bucket, params)
                if alone and self.max_grad_norm is not None and of_bucket.exact and grads:
                    exact = norms.exact = clip_grad_norm(
                        self._in_norm_order(params, grads), of_bucket.key
                    )
                    shares = [(None, exact.square())]
                else:
                    shares = of_bucket.squares(grads)
                if not self._reduce_per_bucket:
                    for key, share in shares:
                        norms.pending.setdefault(key, []).append(share)
                    return self._clamp(grads, verdict)
                bucket_sq: torch.Tensor | None = None
                for key, share in shares:
                    bucket_sq = _add(bucket_sq, _all_reduce(share, key))
                assert bucket_sq is not None
                norms.bucket_sq[bucket.key] = bucket_sq
                norms.reduced = _add(norms.reduced, bucket_sq)
                # See [Note: a non-finite step].
                finite = torch.isfinite(bucket_sq)
                norms.seen = _add(norms.seen, torch.where(finite, bucket_sq, 0.0))
            if self.skip_nonfinite:
                self._nonfinite = self._nonfinite + (~finite).int()
                if device_skip:
                    verdict.found_inf = (~finite).float()
                elif not finite:  # host sync: this optimizer takes no found_inf
                    return BucketVerdict(step=False)
            if self.max_grad_norm is not None:
                # Clipped per bucket: by the norm seen so far, and the rest's predicted (none
                # where the bucket is the plan's only one, whose own norm is then the whole).
                if norms.exact is None and not alone and not self._warned_per_bucket:
                    self._warned_per_bucket = True
                    warnings.warn(PER_BUCKET_CLIPPING, UserWarning, stacklevel=2)
                # Computed for a held bucket too: it notes the bucket's history as seen, so
                # that the buckets after it do not predict it again.
                coefficient = self._clip_coefficient(norms, bucket.key)
                if not held:
                    torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return self._clamp(grads, verdict)

    def clip_held(self, norms: BackwardNorms, grads: list[torch.Tensor]) -> None:
        """At the end of a backward, clip the gradients of the buckets held to it (``grads``,
        local tensors; accounted by :meth:`before_step` with ``held``) by the norm of every
        bucket the backward stepped: the global coefficient, nothing left to predict. See
        [Note: held buckets clipped together] in ``_engine.py``."""
        if self.max_grad_norm is None or not grads or norms.seen is None:
            return
        coefficient = self._coefficient(norms.seen.sqrt())
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))

    def before_steps(
        self,
        norms: BackwardNorms,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        buckets: Sequence[tuple[Bucket, Sequence[torch.Tensor]]],
    ) -> None:
        """Take the global norm and finiteness of ``grads`` (the local tensors of the gradients
        of ``params``, every one a pass steps, in the order ``clip_grad_norm_`` is given them
        unless ``set_norm_order`` says another) before the pass's first bucket is stepped;
        ``buckets``: each bucket to step, with its members of ``params``. See [Note: what
        step() steps].

        Collective, when clipping by norm or skipping non-finite gradients: one all-reduce per
        mesh dimension of the buckets' squared norms, and ``clip_grad_norm_``'s own where the
        norm is taken as it takes it. No value is read back to the host. Called only where
        :attr:`reduces_per_bucket`.
        """
        grad_of = dict(zip(map(id, params), grads, strict=True))
        # The buckets' squared norms (the clipping history): their shares of each reduce key
        # reduced together.
        by_key: dict[_ReduceKey, list[tuple[int, torch.Tensor]]] = {}
        for index, (bucket, members) in enumerate(buckets):
            shares = self._shares_of(bucket, members).squares([grad_of[id(p)] for p in members])
            for key, share in shares:
                by_key.setdefault(key, []).append((index, share))
        squares: list[torch.Tensor | None] = [None] * len(buckets)
        for key, entries in by_key.items():
            device = entries[0][1].device
            reduced = _all_reduce(torch.stack([share.to(device) for _, share in entries]), key)
            for (index, _), square in zip(entries, reduced, strict=True):
                squares[index] = _add(squares[index], square)
        total: torch.Tensor | None = None
        for (bucket, _), square in zip(buckets, squares, strict=True):
            assert square is not None
            norms.bucket_sq[bucket.key] = square
            total = _add(total, square)
        assert total is not None
        norms.reduced = total
        norms.finite = torch.isfinite(total)  # see [Note: a non-finite step]
        of_all = _Shares(params)
        if self.max_grad_norm is not None and of_all.exact:
            norms.exact = clip_grad_norm(self._in_norm_order(params, grads), of_all.key)
        else:
            norms.exact = total.sqrt()

    def _in_norm_order(
        self, params: Sequence[torch.Tensor], grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``grads`` (of ``params``) in the order ``clip_grad_norm_`` is given them."""
        if not self.norm_order:
            return grads
        last = len(self.norm_order)
        positions = [self.norm_order.get(id(p), last + i) for i, p in enumerate(params)]
        return [grads[i] for i in sorted(range(len(grads)), key=positions.__getitem__)]

    def _clamp(self, grads: list[torch.Tensor], verdict: BucketVerdict) -> BucketVerdict:
        if self.clip_grad_value is not None:
            torch._foreach_clamp_min_(grads, -self.clip_grad_value)
            torch._foreach_clamp_max_(grads, self.clip_grad_value)
        return verdict

    def _shares_of(self, bucket: Bucket, params: Sequence[torch.Tensor]) -> _Shares:
        if len(params) != len(bucket.params):  # a bucket stepped partially
            return _Shares(params)
        shares = self._shares.get(bucket.key)
        if shares is None:
            shares = self._shares[bucket.key] = _Shares(params)
        return shares

    def _clip_coefficient(self, norms: BackwardNorms, key: str) -> torch.Tensor:
        norms.previous_seen = norms.previous_seen + self._previous_sq.get(key, 0.0)
        if norms.exact is not None:
            # The plan's only bucket: its norm as clip_grad_norm_'s.
            norm = norms.exact
        else:
            norm = (norms.seen + (self._previous_total - norms.previous_seen)).sqrt()
        return self._coefficient(norm)

    def _coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient for a total norm ``norm``."""
        assert self.max_grad_norm is not None
        return (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)

    def end_of_backward(self, norms: BackwardNorms) -> None:
        """Close a stepping backward: complete the norm, update the clipping history.

        Collective (one all-reduce per mesh dimension) for shares not reduced per bucket.
        """
        if not norms.any:
            return
        total = norms.reduced
        for key, shares in norms.pending.items():
            device = shares[0].device
            share = torch.stack([s.to(device) for s in shares]).sum()
            total = _add(total, _all_reduce(share, key))
        assert total is not None
        norm = norms.exact if norms.exact is not None else total.sqrt()
        self._pass_norms.append(norm)
        if len(self._pass_norms) > 1:
            # Several stepping passes before one step() (two backwards on disjoint
            # parameters, a backward and gradients set by hand): the norm of all the step's
            # gradients, as clip_grad_norm_ takes it, a norm of the per-tensor norms.
            norm = torch.linalg.vector_norm(torch.stack([n.to(norm) for n in self._pass_norms]))
        self._last_norm = norm
        if self.max_grad_norm is not None:
            # Buckets that did not step this time are predicted to stay silent; a non-finite
            # bucket keeps its previous norm. No host sync.
            self._previous_sq = {
                k: torch.where(torch.isfinite(v), v, self._previous_sq.get(k, 0.0))
                for k, v in norms.bucket_sq.items()
            }
            self._previous_total = sum(self._previous_sq.values(), 0.0)

    @property
    def nonfinite_steps(self) -> int:
        return int(self._nonfinite)

    def state_dict(self) -> dict[str, Any]:
        """The clipping history (each bucket's squared norm in the last stepping backward, by
        bucket key) and the count of skipped updates. Identical on every rank. Reads them back
        to the host."""
        return {
            "previous_sq": {k: float(v) for k, v in self._previous_sq.items()},
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state: dict[str, Any], bucket_keys: Sequence[str]) -> None:
        """Restore :meth:`state_dict`. History of buckets this run does not have (another
        wrapping of the model) is dropped: those buckets clip as on a first step."""
        self._previous_sq = {
            str(k): torch.tensor(float(v)) for k, v in state["previous_sq"].items()
        }
        self.keep_history_of(bucket_keys)
        self._nonfinite = int(state["nonfinite_steps"])

    def keep_history_of(self, bucket_keys: Sequence[str]) -> None:
        """Drop the clipping history of every bucket but those ``bucket_keys`` name (the
        buckets of a new plan). What is dropped would otherwise be predicted to come in every
        backward and never arrive: with one bucket, a coefficient other than the exact one."""
        keys = set(bucket_keys)
        self._previous_sq = {k: v for k, v in self._previous_sq.items() if k in keys}
        self._previous_total = sum(self._previous_sq.values(), 0.0)

    def refuse_partly_skipped(self) -> None:
        """At ``step()``, with ``skip_nonfinite``: raise if, of the stepping passes since the
        last ``step()``, one had a non-finite gradient and another none.

        [Note: non-finite gradients in one pass of several]
        Two backwards on disjoint parameters (an actor's and a critic's loss), or a backward
        and gradients set by hand, before one ``step()``: the plain loop checking the step's
        gradients skips the whole step if one is not finite; here each pass's buckets were
        stepped or skipped in that pass, and the finite pass's updates stand (1.0e-2 apart
        after four AdamW steps, an actor's and a critic's loss, the critic's NaN once).
        Whether a later pass will come, or find a non-finite value, is not known while the
        earlier one steps, so this is refused at ``step()``, after the fact; each pass's flag
        is read back to the host here, one sync, only where several passes stepped. Gradients
        set by hand are the exception: ``step()`` knows them before it steps them, and
        :meth:`refuse_mixed_before` refuses finite ones after a skipped backward before they
        move. Passes
        all finite, or all not (every bucket skipped), end as the plain loop's (within a
        pass, see "skip_nonfinite skips bucket by bucket" in ``docs/differences.md``)."""
        if not self.skip_nonfinite or len(self._pass_norms) < 2:
            return
        device = self._pass_norms[0].device
        finite = torch.isfinite(torch.stack([n.to(device) for n in self._pass_norms]))
        if 0 < int(finite.sum()) < len(self._pass_norms):
            raise _partly_skipped(applied=True)

    def refuse_mixed_before(
        self, params: Sequence[torch.Tensor], grads: list[torch.Tensor]
    ) -> None:
        """At ``step()``, with ``skip_nonfinite``, before gradients set by hand since a
        stepping pass of this step move (``grads``, the local tensors of those of
        ``params``): raise if every earlier pass was skipped (not finite) and they are
        finite. Both are known here, before this pass moves anything: they would otherwise be
        stepped before :meth:`refuse_partly_skipped` refused the step (see [Note: non-finite
        gradients in one pass of several]). The other way round (an earlier pass applied,
        these not finite: skipped on the device, nothing more moves) is left to that refusal,
        whose message says what stands. Collective: one all-reduce per mesh dimension of their
        squared norm, and one host sync, only in such a step."""
        if not self.skip_nonfinite or not self._pass_norms:
            return
        total: torch.Tensor | None = None
        for key, share in _Shares(params).squares(grads):
            total = _add(total, _all_reduce(share, key))
        assert total is not None
        norms = torch.stack([*(n.to(total.device) for n in self._pass_norms), total.sqrt()])
        *earlier, finite = torch.isfinite(norms).tolist()
        if finite and not any(earlier):
            raise _partly_skipped(applied=False)

    def end_of_step(self) -> None:
        """``step()``, or ``zero_grad()`` dropping the step's gradients: the next stepping
        pass starts the next step's norm."""
        self._pass_norms.clear()

    def grad_norm(self) -> torch.Tensor:
        if not self._needs_norm:
            raise RuntimeError(
                "grad_norm() needs track_grad_norm=True (the default) at construction"
            )
        if self._last_norm is None:
            raise RuntimeError("grad_norm() is available after the first stepping backward")
        return self._last_norm
