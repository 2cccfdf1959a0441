"""The per-backward engine: the state of one backward pass, and what it steps.

[Note: one backward, one BackwardPass]
Everything that belongs to one backward pass lives in one ``BackwardPass``: which gradients
arrived in which bucket, which parameters were stepped, the norm sums, the stream events. A
``BackwardPass`` is created by the first hook of a backward (told apart by the autograd graph
task id) and finished by a callback queued then. Nothing is reset by hand: when a backward
raises half-way (an OOM the loop catches, a bad batch), its callback never runs, and the next
backward simply starts a new ``BackwardPass``. The gradients that arrived in the failed one stay
on the parameters, as they would for a plain optimizer (``zero_grad()`` drops them).

One ``loss.backward()`` is one pass even when it runs nested backward graphs: reentrant
activation checkpointing (``checkpoint(..., use_reentrant=True)``) recomputes a block and runs
its backward as a graph task of its own, with its own id, inside the outer one. A gradient
that arrives under another id while the pass's own graph task is still alive belongs to that
pass (:meth:`BackwardPass.adopt`): one norm, one clipping, one history. Whether the graph task
is alive is told by a token only the callbacks queued on it hold: the engine drops them when the
task finishes or fails, so a new backward after a failed one starts a new pass.
A backward run from a hook of another one (GradCache's surrogate backwards, from a tensor hook
of the loss) has no Function around it, and no node whose return would end the pass in the
outer backward: its first gradient, starting a pass, is refused before anything moves
(``_nested_in_hook_error`` in ``optimizer.py``).

Phases: ``COLLECTING`` (hooks arrive; complete buckets are stepped at once), then ``FINISHED``
(:meth:`BackwardPass.finish`: the buckets that did not complete are stepped, gradients that
reached the parameters without a hook too, the norm is completed). A ``step()`` outside
backward runs a ``BackwardPass`` of its own over the gradients it finds.

[Note: a unit closes when FSDP2 has reduced it]
A bucket of plain parameters is stepped when its last gradient arrives. A bucket that is an
FSDP unit is stepped as soon as FSDP2 has handed out every gradient it reduced for the unit in
this backward: a parameter the forward did not use (an expert no token was routed to, a branch
not taken) gets no gradient, and waiting for it until the end of backward would keep the
unit's whole reduce-scatter output alive through the rest of backward. FSDP2 reduces a unit and
calls all its hooks from one autograd node, the unit's post-backward
(``fsdp_post_backward_node`` in ``_torch_internals``): the unit's first hook that runs inside
it registers a post hook on that node, which closes the unit when the node returns, on the
stream the hook ran on. Every rank reduces the same parameters of a unit, so every rank closes
it at the same point. A unit FSDP2 reduces in its end-of-backward callback (one whose forward
inputs did not require grad, such as an embedding's), or without calling the hooks from a node
(compiled autograd), is stepped at the end of backward. A unit the forward applied twice is
reduced twice: what the first reduction handed out is stepped at its node, the rest later, as
a second part, which is refused where clipping or the non-finite check would take the parts
apart (``_refuse_second_part``).

Neither the count of a unit's gradients nor what they look like can tell the last one. A
gradient autograd accumulates into a sharded parameter itself (a penalty on the weights the
modules hold outside their forward, DTensors) arrives through autograd's ``AccumulateGrad``,
before or after FSDP2 adds the reduced one: counted, it completed the unit before FSDP2's
gradients came. And under ``accumulate()`` FSDP2 adds into the views of an earlier
micro-batch's output, so one unit's gradients span two buffers: told by where its view ends in
its buffer, the unit was closed early. Either way the rest of the unit was stepped as a second
part (clipped by another norm, judged non-finite apart) or refused after the first part
moved. A parameter of the unit that holds a gradient FSDP2 did not hand out in this backward
(accumulated in an earlier micro-batch under ``accumulate()``) keeps the unit open until the
end of backward, where it is stepped whole: one norm, one clipping, one non-finite verdict, as
``step()`` takes them.

[Note: classes stepped jointly]
A plain optimizer's ``step()`` is one call over all its parameters, and a class may reduce over
them in it: timm's and apex's LAMB clip every gradient by the norm of all of them. Stepped bucket
by bucket, each call would see its own bucket's gradients only, and the parameters would move
differently with nothing to tell (no check on copies can: LAMB's first update does not change
when every gradient is scaled alike). So a class not declared elementwise, whole-tensor or
DTensor (every class but torch.optim's and this library's own, unless declared) is stepped
*jointly*: each of its buckets, once complete and clipped, is held with its gradients (as a
plain optimizer holds them), and at the end of backward the class's step runs once on all its
param groups, each with all its parameters (as DTensors), those of the held buckets holding
their gradients and the others none (a group no gradient reached; a bucket skipped as
non-finite, whose freed gradients are hidden for the call). That call is the plain
optimizer's, exact whatever the class computes; what it costs is the gradient memory the
in-backward step would have released early. Declaring the class (``declare_stepping``)
steps it bucket by bucket again.

[Note: random numbers drawn jointly]
A jointly stepped class whose step draws random numbers (SGLD's noise, ``torch.randn_like``)
draws them at the end of backward, where the plain optimizer draws them at ``step()``. That is
the same sequence of draws unless the loop draws from the same generator in between (a
``torch.rand`` deciding the next drop-path, an augmentation, a dropout forward for logging or
an evaluation in train mode): then the class's draws come before the loop's instead of after,
and both differ from the plain loop's (SGLD 8.9e-2 apart after four steps, no error). What a
step draws is not knowable before it runs, nor the loop's draws before they happen, so this is
refused after the update, at ``step()``: the states of torch's generators (the CPU's, and the
accelerator's once initialised) are taken before the joint step of a backward and compared
after it; those it advanced are noted as they are then (``PendingUpdates.note_draws``), and
``step()`` raises if one of them has advanced since. A backward rolled back (the model and
the optimizer loaded, then ``zero_grad()``) is one whose step the plain optimizer never ran,
so it drew nothing: ``zero_grad()`` sets those generators back to their states before the
joint step, unless something drew from them since (or set them). The watch costs a backward
about 5 us (20 us in a training loop's cold caches), and ``step()`` after a class that drew
about 4 us. A loop drawing from another generator than the class's (its own
``torch.Generator``) draws the same numbers in either order and is not refused. Python's
``random`` and NumPy's global generator are not watched here: their states cost 17 and 60 us
more to read and compare, every backward.

Profiler ranges, stable names for traces: ``fused_optim_dist::step_bucket`` (one bucket, all
of it), inside it ``fused_optim_dist::gradients`` (norm, clipping, non-finite check),
``fused_optim_dist::derive_local_views`` (only when the cached views are re-derived) and
``fused_optim_dist::update`` (the wrapped optimizer's update);
``fused_optim_dist::end_of_backward``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from fused_optim_dist._class_state import ClassState
from fused_optim_dist._classes import ClassSteppers
from fused_optim_dist._freed import FreedGradients, freed_hidden, is_freed
from fused_optim_dist._generators import GeneratorStates
from fused_optim_dist._gradients import BackwardNorms, BucketVerdict, GradientProcessor
from fused_optim_dist._plan import Bucket, BucketPlan
from fused_optim_dist._protocol import PendingUpdates, describe
from fused_optim_dist._sharing import SharedStateError
from fused_optim_dist._stepping import Batch, local_gradients
from fused_optim_dist._streams import StepEvents, hook_stream, keep_alive_until_done
from fused_optim_dist._torch_internals import (
    FSDPUnit,
    GraphTaskToken,
    current_backward_id,
    fsdp_post_backward_node,
    local_tensor,
    queue_end_of_backward,
    read_grads,
    traced,
    wait_for_checkpoint_staging,
    when_node_returns,
)

__all__ = ["BackwardPass", "Phase"]


@functools.cache
def _autocast_device_types() -> tuple[str, ...]:
    accelerator = torch.accelerator.current_accelerator()
    return ("cpu",) if accelerator is None else ("cpu", accelerator.type)


def _autocast_enabled_on() -> list[str]:
    """The device types (CPU, accelerator) with an autocast region of the calling thread in
    force."""
    return [t for t in _autocast_device_types() if torch.is_autocast_enabled(t)]


def autocast_enabled() -> bool:
    """Whether an autocast region of the calling thread is in force (CPU or accelerator)."""
    return bool(_autocast_enabled_on())


def outside_autocast() -> contextlib.AbstractContextManager[Any]:
    """A context in which no autocast region of the calling thread is in force.

    [Note: updates outside autocast]
    The hooks and the end-of-backward callback run on the thread that called ``backward()``,
    under its autocast state: a loop that calls ``loss.backward()`` inside its
    ``torch.autocast`` block, as many do, would run every update and norm in backward with
    autocast on, where the plain loop's ``step()`` and ``clip_grad_norm_``, after the block,
    run without it. Autocast changes the class's own ops (``torch.optim.Adafactor``'s matmul,
    any matmul of a class's step, runs in bfloat16: 1.5e-3 apart after five steps, no error).
    So the steps and norms of a backward run with autocast off on the CPU and the accelerator,
    as the plain optimizer's do. A loop that calls ``step()`` inside the block too would run
    the plain update under autocast: ``step()`` refuses it there for a class that is not
    elementwise (a matmul in its step), the first point where it is known. What ``step()``
    itself steps (gradients set by hand) runs under the caller's autocast, as the plain
    ``step()``."""
    enabled = _autocast_enabled_on()
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device_type in enabled:
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


class Phase(enum.Enum):
    COLLECTING = enum.auto()
    FINISHED = enum.auto()


class _Ready(NamedTuple):
    """A bucket ready to step, or held until the end of backward (its class stepped jointly,
    or not yet checked): the bucket, its members stepped and their gradients' local tensors,
    the groups, batches and ``found_inf``."""

    bucket: Bucket
    params: Sequence[torch.Tensor]
    grads: list[torch.Tensor]
    indices: list[int]
    batches: list[Batch]
    found_inf: torch.Tensor | None


class BackwardPass:
    """One backward pass (or one ``step()``) of an ``OptimizerInBackward``.

    Args:
        backward_id: the autograd graph task id of the backward; ``None`` for ``step()``.
        plan: the bucket plan, current when the pass starts.
        param_groups, state: the optimizer's, read when a bucket is stepped (so values an LR
            scheduler wrote apply).
        pending: the updates made in backward since the last ``step()``; this pass adds its
            own, and refuses a gradient for a parameter already there. See [Note: the step
            protocol].
        freed: puts freed gradients on the parameters stepped. See [Note: freed gradients].
        record: account gradients in the norm and the clipping history, and check them against
            ``pending``. ``False`` only for the zero-gradient, zero-lr step
            ``torch.distributed.checkpoint`` runs to create state.
    """

    def __init__(
        self,
        backward_id: int | None,
        plan: BucketPlan,
        stepper: ClassSteppers,
        gradients: GradientProcessor,
        param_groups: list[dict[str, Any]],
        state: defaultdict[torch.Tensor, dict],
        pending: PendingUpdates,
        freed: FreedGradients,
        *,
        record: bool = True,
    ) -> None:
        # The graph task ids of this backward (nested reentrant ones adopted), and a weak
        # reference to the token its queued callbacks hold.
        self._backward_ids = {backward_id}
        self._in_backward = backward_id is not None
        # See [Note: updates outside autocast]: a backward's steps and norms only.
        self._autocast_off = outside_autocast if self._in_backward else contextlib.nullcontext
        # See [Note: checkpoint staging in flight] in _torch_internals.py: a backward's first
        # write waits for it; step() writes where the plain optimizer's does.
        self._staging_awaited = backward_id is None
        self._token: weakref.ref[GraphTaskToken] | None = None
        self.phase = Phase.COLLECTING
        self._plan = plan
        self._stepper = stepper
        self._gradients = gradients
        self._param_groups = param_groups
        self._state = state
        self._record = record
        self._pending = pending
        self._freed = freed
        # Ids of the parameters whose gradient arrived, per bucket index not yet stepped, and
        # of the parameters already stepped.
        self._arrived: dict[int, set[int]] = {}
        self._stepped: set[int] = set()
        # Whether this pass updated a parameter (held buckets are stepped, not updated).
        self.updated = False
        # The groups of the buckets skipped as non-finite on the host, whether a bucket was
        # stepped (or held to be) with no device flag to skip it, and the flags of those a
        # fused kernel skips on the device (found_inf): a pass every bucket of which was
        # skipped is a skipped step, which no class's step visits (see ClassState.finish).
        self._skipped: set[int] = set()
        self._stepping = False
        self._device_flags: list[torch.Tensor] = []
        # Indices of the units whose closing is registered on FSDP2's post-backward node.
        self._closing: set[int] = set()
        # The FSDP2 units that held all-gathered weights when updated, by id of their group.
        # See [Note: copies gathered before step()] in _protocol.py.
        self._gathered_when_updated: dict[int, FSDPUnit] = {}
        self._norms = BackwardNorms()
        self._events = StepEvents()
        # Buckets held until the end of backward: see [Note: classes stepped jointly] and
        # [Note: group and instance state].
        self._deferred: list[_Ready] = []
        # See [Note: group and instance state].
        self._class_state = ClassState(stepper, param_groups, state)
        # Whether held buckets are clipped at the end of backward, and whether every bucket
        # is held (clipped and judged there together): [Note: held buckets clipped together].
        self._clips_held, self._all_held = self._derive_held()

    def queue_finish(self, node: torch.autograd.graph.Node | None) -> None:
        """Finish this pass once its backward has finished (call in its first hook).

        In a backward nested inside another from an autograd Function's ``backward``, the pass
        belongs to the outermost one: its finish is queued there, from a post hook of ``node``,
        the node that backward is running (``enclosing_backward().node``)."""
        token = GraphTaskToken()
        self._token = weakref.ref(token)
        if node is None:
            queue_end_of_backward(lambda: self.finish(token))
            return

        def in_enclosing_backward() -> None:
            if self.phase is Phase.COLLECTING:
                self._backward_ids.add(current_backward_id())
                queue_end_of_backward(lambda: self.finish(token))

        when_node_returns(node, in_enclosing_backward)

    def owns(self, backward_id: int) -> bool:
        return backward_id in self._backward_ids

    def adopt(self, backward_id: int) -> bool:
        """Take ``backward_id`` as this pass's if it runs nested inside this pass's backward
        (reentrant checkpointing); whether it did."""
        alive = self._token is not None and self._token() is not None
        if alive and self.phase is Phase.COLLECTING:
            self._backward_ids.add(backward_id)
            return True
        return False

    def undo_class_state(self) -> None:
        """The loop rolled this pass's backward back: see :meth:`ClassState.undo`."""
        self._class_state.undo()

    def wrote_class_state(self) -> bool:
        """Whether this pass advanced state a class keeps in its groups or on itself. See
        [Note: group and instance state]."""
        return self._class_state.wrote()

    @property
    def unfinished(self) -> bool:
        """Whether this pass stepped something and its backward has not finished it: it runs,
        or it raised (its norm and clipping are then completed by ``step()``)."""
        return self.phase is Phase.COLLECTING and bool(self._stepped)

    @property
    def raised(self) -> bool:
        """Whether this pass's backward will never finish it (it raised, and the engine
        dropped its callbacks)."""
        return self.phase is Phase.COLLECTING and self._token is not None and self._token() is None

    @property
    def abandoned(self) -> bool:
        """Whether this pass stepped something in a backward that raised."""
        return self.unfinished and self.raised

    def arrive(self, param: torch.Tensor) -> None:
        """``param`` holds its gradient: step its bucket if that completes it.

        Runs once per parameter per backward, so it does as little as it can: two dict
        lookups and a set insertion, and at a unit's first gradient the registration of [Note:
        a unit closes when FSDP2 has reduced it].
        """
        assert self.phase is Phase.COLLECTING, self.phase
        key = id(param)
        bucket = self._plan.bucket_of(key)
        if bucket is None or key in self._stepped:
            if bucket is None and (
                self._plan.delivers_nothing(param)
                or (param.requires_grad and not self._plan.holds(param))
            ):
                # Not the optimizer's now (a group removed by hand): the plain optimizer
                # leaves its gradient to accumulate, and so does this one.
                return
            self._refuse(param, bucket)
        if self._pending and self._pending.holds(param):
            self._pending.refuse_second_gradient(param)
        grad = param.grad
        if grad is None:
            # Dropped by a hook that ran before ours: no gradient in this backward, as the
            # plain optimizer's step finds it.
            return
        if key in self._plan.plain_ids:
            base = grad._base
            if base is not None and base.numel() > param.numel() and self._record:
                # See [Note: gradients in a flat buffer] in _protocol.py.
                self._pending.note_gradient_buffer(base)
        arrived = self._arrived.get(bucket.index)
        if arrived is None:
            arrived = self._arrived[bucket.index] = set()
        arrived.add(key)
        if key in self._plan.reduced_by_fsdp:
            # See [Note: a unit closes when FSDP2 has reduced it].
            if bucket.index not in self._closing:
                node = fsdp_post_backward_node()
                if node is not None:
                    self._close_after(node, bucket, grad)
        elif len(arrived) == len(bucket.params):
            del self._arrived[bucket.index]
            self._step_bucket(bucket, bucket.params)

    def _close_after(
        self, node: torch.autograd.graph.Node, bucket: Bucket, grad: torch.Tensor
    ) -> None:
        """Close ``bucket`` once ``node``, FSDP2's post-backward of its unit, returns. See
        [Note: a unit closes when FSDP2 has reduced it]."""
        self._closing.add(bucket.index)
        stream = hook_stream(grad)

        def close(_grad_inputs: Any, _grad_outputs: Any) -> None:
            handle.remove()
            if self.phase is not Phase.COLLECTING:
                return
            arrived = self._arrived[bucket.index]
            rest = [p for p in bucket.params if id(p) not in arrived]
            if any(g is not None and not is_freed(g) for g in read_grads(rest)):
                return  # stepped whole at the end of backward
            del self._arrived[bucket.index]
            with stream:
                self._step_bucket(bucket, [p for p in bucket.params if id(p) in arrived])

        handle = node.register_hook(close)

    def refuse_if_stepped(self, param: torch.Tensor) -> None:
        """Raise if ``param`` was stepped in this backward, still running: a gradient is being
        added to its freed one (see [Note: freed gradients])."""
        if self.phase is Phase.COLLECTING and not self.abandoned and id(param) in self._stepped:
            self._refuse(param, self._plan.bucket_of(id(param)))

    def _refuse(self, param: torch.Tensor, bucket: Bucket | None) -> NoReturn:
        if bucket is None and not param.requires_grad:
            # Not a trainable parameter: what a hook before ours returned, passed on by torch.
            raise RuntimeError(
                "OptimizerInBackward's post-accumulate-grad hook was handed a tensor of shape "
                f"{tuple(param.shape)} that is no trainable parameter: a post-accumulate-grad "
                "hook registered before it on that parameter returned a value, which torch "
                "hands to the next hook (`lambda p: p.grad.mul_(2)` returns the gradient). "
                "Post-accumulate-grad hooks must return None; torch refuses such a hook with no "
                "optimizer hooked after it too."
            )
        if bucket is None:
            raise RuntimeError(
                f"{describe(param)} received a gradient but did not require one when this "
                "backward began (requires_grad turned on during backward), so this "
                "OptimizerInBackward has no bucket for it; set requires_grad before the "
                "forward"
            )
        raise RuntimeError(
            f"{describe(param)} received a second gradient after it was stepped in this "
            "backward (a module applied twice in one forward; a loss term computed on the "
            "sharded parameters themselves before the forward, whose gradient autograd adds "
            "after FSDP2 reduced the unit; or a gradient added to it by hand in backward); a "
            "plain optimizer would step the sum. Apply each parameter once per forward, compute "
            "such a term after the forward, or build a plain optimizer for this model"
        )

    def _refuse_second_part(self, bucket: Bucket) -> None:
        """Raise if part of ``bucket`` was stepped earlier in this pass: clipped by its own
        norm and judged non-finite on its own, the rest would be too, where
        ``clip_grad_norm_`` and the plain loop's non-finite check take the step's gradients
        together. FSDP2 reduces a unit twice in one backward when the forward applied it twice
        (each time on other parameters: a block reused with another branch); what it reduces
        first is stepped before the second reduction can be seen."""
        if not any(id(p) in self._stepped for p in bucket.params):
            return
        raise RuntimeError(
            "a bucket of this optimizer received gradients after part of it was stepped in this "
            "backward, with max_grad_norm or skip_nonfinite: the parts would be clipped and "
            "checked apart, where the plain loop clips and checks the step's gradients "
            "together. The usual cause is an FSDP2 unit applied twice in one forward (FSDP2 "
            "then reduces it twice); give each part applied separately its own fully_shard, or "
            "clip and check in the plain optimizer"
        )

    def step_all(self, params: Sequence[torch.Tensor]) -> None:
        """Step ``params`` (members of the plan holding gradients) bucket by bucket, in order,
        clipped by their global norm and skipped together if one is not finite (see [Note:
        what step() steps] in _gradients.py).

        Raises before anything moves if one of them was updated in backward since the last
        ``step()`` (its gradient would be stepped a second time)."""
        if self._record and self._pending:
            for param in params:
                if self._pending.holds(param):
                    self._pending.refuse_second_gradient(param)
        ready = {id(p) for p in params}
        parts = [
            (bucket, members)
            for bucket in self._plan.buckets
            if (members := [p for p in bucket.params if id(p) in ready])
        ]
        # The plan's only bucket takes its norm as it is stepped: the same, at no extra cost.
        if self._record and self._gradients.reduces_per_bucket and len(self._plan.buckets) > 1:
            with torch.no_grad(), self._autocast_off(), traced("fused_optim_dist::gradients"):
                self._gradients.before_steps(self._norms, params, local_gradients(params), parts)
        for bucket, members in parts:
            self._step_bucket(bucket, members)

    def finish(self, token: GraphTaskToken | None = None) -> None:
        """Step what did not complete, wait for the steps' streams, complete the norm.

        ``token``: the one :meth:`queue_finish` made, held by the queued callback until now."""
        del token
        if self.phase is Phase.FINISHED:
            return
        self.phase = Phase.FINISHED
        # Without gradients, as every update: at step() (gradients held under accumulate(),
        # or set by hand) grad mode is on, and whole-tensor stepping writes each parameter's
        # rows through ``to_local()``, which autograd refuses in place on a parameter that
        # requires grad.
        with torch.no_grad(), self._autocast_off(), traced("fused_optim_dist::end_of_backward"):
            # Buckets with a parameter that got no gradient (unused in this forward), then
            # gradients that reached a trainable parameter without a hook (accumulated under
            # accumulate() and unused now, set by hand, or on a parameter unfrozen after this
            # backward's first hook): a plain optimizer would step them all.
            self._arrived.clear()
            stepped = self._stepped
            for bucket in self._plan.buckets:
                members = [
                    p
                    for p, grad in zip(bucket.params, read_grads(bucket.params), strict=True)
                    if grad is not None and id(p) not in stepped and not is_freed(grad)
                ]
                if members:
                    self._step_bucket(bucket, members)
            self._step_deferred()
            # Updates still in flight (whole-tensor stepping) are applied before anything
            # after this backward reads the parameters.
            self._stepper.flush()
            self._await_staging()
            self._class_state.finish(self._skipped, whole=self._skipped_whole())
            if self._record:
                self._pending.settle(
                    self._param_groups, self._state, list(self._gathered_when_updated.values())
                )
            self._events.wait()
            if self._record:
                self._gradients.end_of_backward(self._norms)

    @torch.no_grad()
    def _step_bucket(self, bucket: Bucket, params: Sequence[torch.Tensor]) -> None:
        """Clip and step one bucket's parameters, then free their gradients."""
        if self._record and self._gradients.reduces_per_bucket:
            self._refuse_second_part(bucket)
        with self._autocast_off(), traced("fused_optim_dist::step_bucket"):
            grads, moved = None, True
            try:
                grads = local_gradients(params)
                split = bucket.by_group(params)
                group = self._class_state.group
                batches = [
                    Batch(group(index), params, grads)
                    if len(positions) == len(params)
                    else Batch(
                        group(index),
                        [params[i] for i in positions],
                        [grads[i] for i in positions],
                    )
                    for index, positions in split
                ]
                ready = _Ready(bucket, params, grads, [i for i, _ in split], batches, None)
                held = self._holds(ready.indices)
                if held and self._all_held:
                    self._hold(ready)  # clipped and judged with the others at the end
                    params = ()
                    return
                verdict = self._judge(ready, clipped_at_end=held and self._clips_held)
                if verdict.step:
                    if held:
                        self._hold(ready._replace(found_inf=verdict.found_inf))
                        params = ()
                        return
                    self._update(ready.indices, batches, verdict.found_inf)
            except SharedStateError:
                moved = False
                raise
            finally:
                self._release(params, grads, moved=moved)

    def _holds(self, indices: Sequence[int]) -> bool:
        """Whether a bucket of the groups ``indices`` is held until the end of backward, its
        gradients and all: its class is stepped jointly, or not yet checked. See [Note:
        classes stepped jointly] and [Note: group and instance state]."""
        return self._class_state.must_check(indices) or any(
            self._stepper.is_joint(self._param_groups[index]) for index in indices
        )

    def _hold(self, ready: _Ready) -> None:
        self._deferred.append(ready)
        self._stepped.update(map(id, ready.params))

    def _judge(self, bucket: _Ready, *, clipped_at_end: bool = False) -> BucketVerdict:
        """Account for, clip and check ``bucket``'s gradients (see ``GradientProcessor.
        before_step``; ``clipped_at_end``: a held bucket, scaled at the end of backward by
        ``clip_held``); note a skipped bucket's groups, or how a stepped one may be skipped."""
        verdict = BucketVerdict()
        if self._record and self._gradients.active:
            with traced("fused_optim_dist::gradients"):
                verdict = self._gradients.before_step(
                    self._norms,
                    bucket.bucket,
                    bucket.params,
                    bucket.grads,
                    device_skip=self._gradients.skip_nonfinite
                    and self._stepper.takes_found_inf(bucket.batches),
                    alone=len(self._plan.buckets) == 1,
                    held=clipped_at_end,
                )
        if not verdict.step:
            self._skipped.update(bucket.indices)
        elif verdict.found_inf is None:
            self._stepping = True
        else:
            self._device_flags.append(verdict.found_inf)
        return verdict

    def _derive_held(self) -> tuple[bool, bool]:
        """Whether the buckets this backward holds to its end are clipped there (by the norm
        of every bucket it stepped, ``GradientProcessor.clip_held``), and whether every bucket
        of the plan is held, so that all are clipped and judged non-finite there together,
        rather than each when it is ready.

        [Note: held buckets clipped together]
        Clipping by norm in backward scales each bucket when it is ready, by the norm seen so
        far and the rest's predicted (see [Note: clipping inside one backward] in
        ``_gradients.py``), because it is stepped then. A bucket held until the end of
        backward (its class stepped jointly, or held for the check before its first update)
        is stepped only there, when every gradient of the backward is known. Where every
        bucket of the plan is held (an optimizer whose classes are all stepped jointly, as an
        undeclared one is, or the first backward of declared ones), none is clipped or judged
        when it arrives: at the end of backward their global norm is taken as ``step()``
        takes it for the gradients it steps (``GradientProcessor.before_steps``), each is
        scaled by exactly ``clip_grad_norm_``'s coefficient, and a non-finite gradient skips
        them all, as the plain loop skips its step. Before, each was scaled as it arrived, and
        a non-finite one skipped alone (a class counting steps in its groups, undeclared, on
        four FSDP2 units, four steps, every one clipped: 1.4e-2 from the plain loop on 2 and 3
        ranks; 2.3e-2 with a NaN in some units at one step). Where only some buckets are held
        (classes mixed in one optimizer by their groups), those stepped in backward keep the
        per-bucket coefficients, and each held one is judged non-finite when it arrives (a
        bucket stepped before may not be skipped), but the held ones are scaled at the end by
        the norm of every bucket the backward stepped: the global coefficient, nothing left
        to predict. The same on every rank: each holds the same plan and groups."""
        clips_held = self._in_backward and self._record and len(self._plan.buckets) > 1
        all_held = (
            clips_held
            and self._gradients.reduces_per_bucket
            and all(
                self._holds([index for index, _ in bucket.by_group(bucket.params)])
                for bucket in self._plan.buckets
            )
        )
        return clips_held, all_held

    def _judge_held(self, deferred: list[_Ready]) -> list[_Ready]:
        """Clip the ``deferred`` buckets (every bucket this backward stepped) by their global
        norm, and skip them all where it is not finite; those to step, with their
        ``found_inf``. See [Note: held buckets clipped together]."""
        position = {id(p): i for i, p in enumerate(self._plan.trainable)}
        params = sorted((p for d in deferred for p in d.params), key=lambda p: position[id(p)])
        with traced("fused_optim_dist::gradients"):
            self._gradients.before_steps(
                self._norms,
                params,
                local_gradients(params),
                [(d.bucket, d.params) for d in deferred],
            )
        kept = []
        for held in deferred:
            verdict = self._judge(held)
            if verdict.step:
                kept.append(held._replace(found_inf=verdict.found_inf))
            else:
                self._release(held.params, held.grads)
        return kept

    def _skipped_whole(self) -> bool:
        """Whether every bucket that got a gradient was skipped as non-finite: a skipped step
        (see ``ClassState.finish``). Where buckets a fused kernel skips on the device decide
        it (none was stepped otherwise), and a class keeps state in its groups (skipped on
        the host, bucket by bucket, so reading flags back is its own cost already), their
        flags are read back: one host sync, at the end of backward."""
        if self._stepping or not (self._skipped or self._device_flags):
            return False
        if not self._device_flags:
            return True
        if not self._class_state.tracked:
            return False  # nothing visits a group: no need to know
        flags = self._device_flags
        return bool(torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).all())

    def _update(
        self, indices: list[int], batches: list[Batch], found_inf: torch.Tensor | None
    ) -> None:
        self._await_staging()
        if self._record:
            unit_of = self._plan.unit_of
            for batch in batches:
                for unit in filter(None, map(unit_of, map(id, batch.params))):
                    key = id(unit.group)
                    if key not in self._gathered_when_updated and unit.holds_gathered_copy():
                        self._gathered_when_updated[key] = unit
        self._class_state.run(indices, lambda: self._stepper.step(batches, self._state, found_inf))
        # The fused kernels (torch._fused_adamw_, _fused_sgd_) write the parameters in place
        # without moving their version counters; an in-place op would. Moved here, autograd
        # refuses a node of this backward, still to run, that saved a parameter it updated
        # (read through .detach() in the forward) instead of computing with the new values.
        torch.autograd.graph.increment_version([p for batch in batches for p in batch.params])

    def _await_staging(self) -> None:
        """Before this backward's first write into the weights, the state or the groups."""
        if not self._staging_awaited:
            self._staging_awaited = True
            wait_for_checkpoint_staging()

    def _step_deferred(self) -> None:
        """Check the classes whose first buckets were held, step those buckets, then the held
        batches of the classes stepped jointly, in one call."""
        deferred, self._deferred = self._deferred, []
        if deferred and self._all_held:
            deferred = self._judge_held(deferred)
        elif deferred and self._clips_held:
            self._gradients.clip_held(self._norms, [g for d in deferred for g in d.grads])
        if not deferred:
            return
        self._class_state.check([(d.indices, d.batches) for d in deferred])
        joint = False
        for held in deferred:
            apart = [
                (index, batch)
                for index, batch in zip(held.indices, held.batches, strict=True)
                if not self._stepper.is_joint(batch.group)
            ]
            joint = joint or len(apart) < len(held.batches)
            if apart:
                indices, batches = map(list, zip(*apart, strict=True))
                self._update(indices, batches, held.found_inf)
        if joint:
            self._step_jointly()
        for held in deferred:
            params = [p for batch in held.batches for p in batch.params]
            grads = [g for batch in held.batches for g in batch.grads]
            self._release(params, grads)

    def _step_jointly(self) -> None:
        """One call of each jointly stepped class's step on all its groups, each with all its
        parameters: those of the held buckets hold their gradients, the others none (a freed
        gradient of a skipped bucket is hidden). See [Note: classes stepped jointly]."""
        indices = [i for i, group in enumerate(self._param_groups) if self._stepper.is_joint(group)]
        batches = [
            Batch(self._class_state.group(i), list(self._param_groups[i]["params"]), [])
            for i in indices
        ]
        # See [Note: random numbers drawn jointly]: step() draws where the plain one does.
        watch = self._in_backward and self._record
        generators = GeneratorStates(torch_only=True) if watch else None
        with freed_hidden([p for batch in batches for p in batch.params]):
            self._update(indices, batches, None)
        if generators is not None:
            drawn = generators.advanced()
            if drawn:
                after = GeneratorStates(torch_only=True).only(drawn)
                self._pending.note_draws(generators.only(drawn), after)

    def _release(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        *,
        moved: bool = True,
    ) -> None:
        """Free the gradients of stepped ``params`` (``grads``: their local tensors, if read),
        leaving freed ones in their place, and record their updates as awaiting ``step()``
        unless the step was refused before anything ``moved``. See [Note: streams of the
        in-backward step] and [Note: freed gradients]."""
        if grads is None:
            grads = [
                local_tensor(g) for g in read_grads(params) if g is not None and not is_freed(g)
            ]
        on_device = [local for local in grads if not (local.is_cpu or local.is_meta)]
        if on_device:
            keep_alive_until_done(on_device)
            self._events.record(on_device[0].device)
        self._freed.put(params)
        self._stepped.update(map(id, params))
        if self._record and moved and params:
            self.updated = True
            self._pending.note_group_values(self._param_groups)
            self._pending.add(params)
