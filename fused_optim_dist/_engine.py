"""The per-backward engine: the state of one backward pass, and what it steps.

[Note: one backward, one BackwardPass]
Everything that belongs to one backward pass lives in one ``BackwardPass``: which gradients
arrived in which bucket, which parameters were stepped, the norm sums, the stream events. A
``BackwardPass`` is created by the first hook of a backward (told apart by the autograd graph
task id) and finished by a callback queued then. Nothing is reset by hand: when a backward
raises half-way (an OOM the loop catches, a bad batch), its callback never runs, and the next
backward simply starts a new ``BackwardPass``. The gradients that arrived in the failed one stay
on the parameters, as they would for a plain optimizer (``zero_grad()`` drops them).

Phases: ``COLLECTING`` (hooks arrive; complete buckets are stepped at once), then ``FINISHED``
(:meth:`BackwardPass.finish`: the buckets that did not complete are stepped, gradients that
reached the parameters without a hook too, the norm is completed). A ``step()`` outside
backward runs a ``BackwardPass`` of its own over the gradients it finds.

[Note: a unit closes when FSDP2 has reduced it]
A bucket that is an FSDP unit is stepped when its last gradient arrives, or as soon as FSDP2 has
handed out the last gradient it reduced for the unit in this backward, whichever comes first:
a parameter the forward did not use (an expert no token was routed to, a branch not taken) gets
no gradient, and waiting for it until the end of backward would keep the unit's whole
reduce-scatter output alive through the rest of backward. FSDP2 runs the unit's hooks back to
back, in parameter order, each on a view into that one output, so the gradient whose view ends
at the output's end is the last (``ends_reduce_output`` in ``_torch_internals``). Every rank
reduces the same parameters of a unit, so every rank closes it at the same hook. A parameter of
a closed unit that still gets a gradient in this backward (not from FSDP2's reduction) is
stepped like any other, at the end of backward.

Profiler ranges, stable names for traces: ``fused_optim_dist::step_bucket`` (one bucket, all
of it), inside it ``fused_optim_dist::gradients`` (norm, clipping, non-finite check),
``fused_optim_dist::derive_local_views`` (only when the cached views are re-derived) and
``fused_optim_dist::update`` (the wrapped optimizer's update);
``fused_optim_dist::end_of_backward``.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import record_function

from fused_optim_dist._gradients import BackwardNorms, BucketVerdict, GradientProcessor
from fused_optim_dist._plan import Bucket, BucketPlan
from fused_optim_dist._stepping import BucketStepper, place_grad_like_param
from fused_optim_dist._streams import StepEvents, keep_alive_until_done
from fused_optim_dist._torch_internals import ends_reduce_output, local_tensor

__all__ = ["BackwardPass", "Phase"]


class Phase(enum.Enum):
    COLLECTING = enum.auto()
    FINISHED = enum.auto()


def _describe(param: torch.Tensor) -> str:
    return f"a parameter of shape {tuple(param.shape)}"


class BackwardPass:
    """One backward pass (or one ``step()``) of an ``OptimizerInBackward``.

    Args:
        backward_id: the autograd graph task id of the backward; ``None`` for ``step()``.
        plan: the bucket plan, current when the pass starts.
        param_groups, state: the optimizer's, read when a bucket is stepped (so values an LR
            scheduler wrote apply).
        record: account gradients in the norm and the clipping history. ``False`` for the
            zero-gradient, zero-lr step ``torch.distributed.checkpoint`` runs to create state.
    """

    def __init__(
        self,
        backward_id: int | None,
        plan: BucketPlan,
        stepper: BucketStepper,
        gradients: GradientProcessor,
        param_groups: list[dict[str, Any]],
        state: defaultdict[torch.Tensor, dict],
        *,
        record: bool = True,
    ) -> None:
        self.backward_id = backward_id
        self.phase = Phase.COLLECTING
        self._plan = plan
        self._stepper = stepper
        self._gradients = gradients
        self._param_groups = param_groups
        self._state = state
        self._record = record
        # Gradients arrived per bucket index (by parameter id), and parameters already stepped.
        self._arrived: dict[int, dict[int, torch.Tensor]] = {}
        self._stepped: set[int] = set()
        self._norms = BackwardNorms()
        self._events = StepEvents()

    def arrive(self, param: torch.Tensor) -> None:
        """``param`` holds its gradient: step its bucket if that completes it."""
        assert self.phase is Phase.COLLECTING, self.phase
        bucket = self._plan.bucket_of(param)
        if bucket is None:
            raise RuntimeError(
                f"{_describe(param)} received a gradient and is hooked by this "
                "OptimizerInBackward, but is no longer in its param_groups; add it with "
                "add_param_group() or call detach() before editing param_groups by hand"
            )
        if id(param) in self._stepped:
            raise RuntimeError(
                f"{_describe(param)} received a second gradient after it was stepped in this "
                "backward (reentrant activation checkpointing does this); use "
                "torch.utils.checkpoint with use_reentrant=False"
            )
        arrived = self._arrived.setdefault(bucket.index, {})
        arrived[id(param)] = param
        if len(arrived) == len(bucket.params):
            del self._arrived[bucket.index]
            self._step_bucket(bucket, bucket.params)
            return
        # See [Note: a unit closes when FSDP2 has reduced it].
        slot = self._plan.gradient_slots.get(id(param))
        if slot is not None and ends_reduce_output(param.grad, slot):
            del self._arrived[bucket.index]
            self._step_bucket(bucket, [p for p in bucket.params if id(p) in arrived])

    def step_all(self, params: Sequence[torch.Tensor]) -> None:
        """Step ``params`` (members of the plan holding gradients) bucket by bucket, in order."""
        ready = {id(p) for p in params}
        for bucket in self._plan.buckets:
            members = [p for p in bucket.params if id(p) in ready]
            if members:
                self._step_bucket(bucket, members)

    def finish(self) -> None:
        """Step what did not complete, wait for the steps' streams, complete the norm."""
        if self.phase is Phase.FINISHED:
            return
        self.phase = Phase.FINISHED
        with record_function("fused_optim_dist::end_of_backward"):
            # Buckets with a parameter that got no gradient (unused in this forward), then
            # gradients that reached a trainable parameter without a hook (e.g. one unfrozen
            # after this backward's first hook): a plain optimizer would step them all.
            for bucket in self._plan.buckets:
                arrived = self._arrived.pop(bucket.index, None)
                stragglers = [
                    p
                    for p in bucket.params
                    if p.grad is not None
                    and id(p) not in self._stepped
                    and (arrived is None or id(p) not in arrived)
                ]
                members = [p for p in bucket.params if arrived and id(p) in arrived]
                if members or stragglers:
                    ids = {id(p) for p in members + stragglers}
                    self._step_bucket(bucket, [p for p in bucket.params if id(p) in ids])
            # Updates still in flight (whole-tensor stepping) are applied before anything
            # after this backward reads the parameters.
            self._stepper.flush()
            self._events.wait()
            if self._record:
                self._gradients.end_of_backward(self._norms)

    @torch.no_grad()
    def _step_bucket(self, bucket: Bucket, params: Sequence[torch.Tensor]) -> None:
        """Clip and step one bucket's parameters, then free their gradients."""
        with record_function("fused_optim_dist::step_bucket"):
            try:
                for param in params:
                    if param.grad.is_sparse:
                        raise RuntimeError(
                            f"{_describe(param)} has a sparse gradient, which the in-backward "
                            "step does not support; use dense gradients (e.g. "
                            "nn.Embedding(sparse=False))"
                        )
                    place_grad_like_param(param)
                batches = [
                    (self._param_groups[index], members)
                    for index, members in bucket.by_group(params)
                ]
                verdict = BucketVerdict()
                if self._record and self._gradients.active:
                    device_skip = self._gradients.skip_nonfinite and self._stepper.takes_found_inf(
                        batches
                    )
                    with record_function("fused_optim_dist::gradients"):
                        verdict = self._gradients.before_step(
                            self._norms, bucket, params, device_skip=device_skip
                        )
                if verdict.step:
                    self._stepper.step(batches, self._state, verdict.found_inf)
            finally:
                # See [Note: streams of the in-backward step].
                grads = [p.grad for p in params if p.grad is not None]
                keep_alive_until_done(map(local_tensor, grads))
                if grads:
                    self._events.record(grads[0].device)
                for param in params:
                    param.grad = None
                self._stepped.update(map(id, params))
