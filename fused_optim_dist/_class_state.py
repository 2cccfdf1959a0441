"""State the wrapped class keeps outside ``state[p]``: in its param groups and on itself.

[Note: group and instance state]
A plain optimizer's ``step()`` runs once per step, over every group. Some classes count steps
there rather than per parameter: ``group["step"] += 1`` (timm's and apex's LAMB, schedule-free
optimizers) or ``self.t += 1``. A class stepped bucket by bucket runs its step once per
bucket, on a copy of each group, so such a counter would be lost (the copy) or advanced once
per bucket (the instance). So, for every class that is not one of torch.optim's own (which keep
all their state in ``state[p]``, as this library's ``CompactAdamW`` does):

* when a pass begins, the non-``params`` entries of every group and the instance's own
  attributes are copied (the *snapshot*);
* every bucket steps from the snapshot: its groups are fresh copies of it, and the instance's
  attributes are reset to it;
* what a bucket's step changed must be what every other bucket's step changed (a counter
  advanced by one is the same in every bucket); a class whose buckets disagree writes something
  that depends on the parameters stepped, which stepping per bucket cannot reproduce, and is
  refused with an error at the first bucket that disagrees;
* before a class's first real update: in the first backward that steps it, its buckets are held
  (with their gradients, as a plain optimizer holds them) until the end of backward; then their
  parameters are split in two halves and each half is stepped on copies (parameters, gradients,
  state) from the snapshot. If the halves change the groups or the instance differently, the class
  writes something that depends on the parameters stepped (a norm, a count of parameters) and is
  refused with nothing moved. Two parameters of each held bucket of two or more, the smallest of
  each half, are also stepped together on copies: where they, or their state, moved otherwise than
  in their halves (by more than 1e-3 of the move, summed), the update of a parameter reads others (a
  norm over all gradients clipping inside ``step()``; their number; a parameter's position in its
  group) and the class is refused too (a class whose held buckets all hold one parameter has the
  smallest stepped beside a copy of itself). One parameter per class is also stepped alone and
  beside a copy of itself on gradients scaled up (``loud_copy``: largest element 1e4): a clipping
  above a threshold the first gradients do not reach is then crossed. The state is compared because
  timm's ``Lamb``, whose first update is the same whatever the gradients' scale, shows its clipping
  in its moments (before, four steps, no error: a class clipping by the norm of all its gradients
  above 5, the first ones' 2.6, 0.15-0.17 from the plain class after a loss spike, declared
  ``"dtensor"`` or ``"elementwise"``, 1 to 3 ranks; timm's ``Lamb`` declared ``"dtensor"`` 5.6e-3 on
  1 and 2 ranks). A class stepped on local shards has a shard's rows checked alike, on the gradient
  and on it scaled up ([Note: rows stepped apart]). Where a group's lr is below ``_PROBE_LR`` (a
  warmup from lr 0 or near it moves nothing to compare), every copy steps at it; copies are float32
  where the tensors are narrower. Every rank steps the same copies to the end before any verdict
  (copies of DTensors step with collectives). Otherwise the held buckets are stepped. The verdict is
  agreed over the parameters' mesh (one all-reduce): what a rank sees depends on its shards (one
  whose shards of the held buckets are empty sees its halves write alike), and a rank going on alone
  would wait at the next collective. One whose writes depend on gradient values in a way the halves
  do not show can still disagree in a later backward, and is refused then, on the ranks that see it
  (agreeing there would cost a collective per bucket). A class whose step draws random numbers
  (SGLD's noise) is refused there too, the generators restored: stepped per bucket it would draw
  them in another order, and on local shards in other shapes, than its plain ``step()``. Only
  classes declared ``"elementwise"`` or ``"dtensor"`` are checked here (one declared
  ``"whole_tensor"``: ``BesideOthers``): a class stepped jointly runs its step once per backward, at
  its end (see [Note: classes stepped jointly] and, for its draws, [Note: random numbers drawn
  jointly] in ``_engine.py``);
* every later bucket of such a class is watched for draws too: a class that starts drawing
  after its first backward (noise after a burn-in) is refused at the first bucket that draws.
  That bucket has moved (what a step will draw is not knowable before it runs); the others
  have not. The generators' states are taken before each such bucket and compared after it
  (about 50 us a bucket with NumPy imported; for these classes only); they are the process's,
  so another thread drawing from them meanwhile is refused alike;
* groups no bucket stepped in this pass get the class's step on their parameters, none of
  which holds a gradient, as the plain optimizer's ``step()`` visits them; not the groups of
  buckets skipped as non-finite (``skip_nonfinite``), whose state stays untouched, and none
  in a pass every bucket of which was skipped: that step is skipped whole, as GradScaler
  skips ``step()``, and no counter advances (where buckets a fused kernel skips on the
  device through ``found_inf`` decide it, none stepped otherwise, the pass reads their flags
  back once at its end: ``BackwardPass._skipped_whole``);
* when the pass finishes, the changed values are written back once, into the optimizer's
  groups and the instance (an entry a step removed, ``group.pop("reset")``, is removed);
* a backward the loop rolls back (the model and the optimizer loaded, then ``zero_grad()``)
  is a step the plain optimizer never ran: the loaded state dict brings the groups back, and
  what the pass wrote on the instance, which no state dict holds, is set back to the
  snapshot (it stayed advanced before: a class decaying its lr by its own count 1.7e-3 apart
  one step later, no error).

[Note: rows stepped apart]
A class declared ``"elementwise"`` promises that each element's update reads that element
alone, and each rank then steps its local shards of a parameter. A class reading more of the
parameter (LAMB's trust ratio, a norm of the whole tensor; a factorization) would step each
shard by the shard's norm, and train differently with no error (LAMB: 1e-3 and more from the
plain one after three steps on 2 and 3 ranks). So the check before such a class's first real
update also steps, on copies, the local shard with the most rows among its held buckets
whole, then its two halves of rows in two calls of their own (each with those rows of its
state), and refuses the class if the halves moved the parameter, or a state tensor with its
rows, otherwise than the whole did: by more than 1e-3 of the whole move summed over the
elements, which kernels rounding a few elements differently at another offset (a vectorized
loop and its tail) stay far below. The copies are float32 where the tensors are narrower. On
one rank too: a class stepped so is exact there, but its declaration is not what it does.
Where the group's lr is below 1e-3 (a warmup from lr 0 or near it), the copies step at 1e-3.
The three steps are then made again on the gradient scaled up (``loud_copy``: largest element
1e4), so that a threshold the first gradient does not reach is crossed: a class clipping each
parameter's gradient by its own norm above 2, declared ``"elementwise"``, passed the check on
gradients below it and, once a loss spike crossed it, clipped each shard by the shard's norm
(0.10 and 0.15 from the plain class after four steps on 2 and 3 ranks, no error). What the
check cannot see: an update that reads other elements only where neither step shows it (a
threshold above the scaled gradient's norm; a read that begins after some steps), and a shard
of one row.

[Note: what a snapshot shares]
A snapshot copies values a step advances (counters, flags, small tensors), not what they refer
to: a class keeping its parameters on itself (``self.params = params``, stepped from there),
its state tensors in a list for speed, or another model's parameters in a group (an EMA it
updates) would otherwise step copies, and the model would not train, with no error. So modules,
parameters and other tensors that require grad, and the optimizer's state tensors, are shared,
not copied, wherever they sit under an attribute or a group entry; so is an attribute that
cannot be deep-copied (a lock, a process group). A 0-dim state tensor is copied: a class may
keep one step counter on itself that is also every parameter's ``state[p]["step"]``, and
each bucket must start from its value, as from any counter's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fused_optim_dist._classes import ClassSteppers
from fused_optim_dist._generators import GeneratorStates
from fused_optim_dist._kinds import cache_attributes, keeps_state_per_parameter
from fused_optim_dist._stepping import Batch, BucketStepper, has_rows, loud_copy
from fused_optim_dist._torch_internals import OPTIMIZER_HOOKS, local_tensor

__all__ = ["BesideOthers", "ClassState", "OutsideState", "instance_attrs", "same_value"]

# Attributes torch.optim.Optimizer itself keeps on an instance, and those the stepping engine
# sets for one call: never the class's own state.
_OPTIMIZER_ATTRS = frozenset(
    {
        "defaults",
        "state",
        "param_groups",
        "found_inf",
        "grad_scale",
        "_warned_capturable_if_run_uncaptured",
        "_zero_grad_profile_name",
        *OPTIMIZER_HOOKS,
    }
)


_PARAMS = ("params", "param_names")
"""A group's parameters and their names (a group of named parameters): what a bucket is handed
its own of, never state."""


def same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same value: tensors by shape and values, containers
    item by item."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


_REMOVED = object()
"""The value of an entry a step removed (``group.pop("reset")``) among the changes."""


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``after`` that are new or differ from ``before``, and those of ``before``
    that ``after`` lacks, as ``_REMOVED``."""
    changed = {k: v for k, v in after.items() if k not in before or not same_value(before[k], v)}
    changed.update((k, _REMOVED) for k in before if k not in after)
    return changed


def _shared_objects(
    values: Sequence[dict[str, Any]], state: dict[torch.Tensor, dict]
) -> dict[int, Any]:
    """The objects under ``values`` (through dicts, lists, tuples and sets) that a snapshot
    shares instead of copying, by id: modules, parameters and other tensors that require
    grad, and the optimizer's state tensors but 0-dim counters. See [Note: what a snapshot
    shares]."""
    shared: dict[int, Any] = {}
    tensors: list[torch.Tensor] = []
    pending: list[Any] = [v for value in values for v in value.values()]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.nn.Module | torch.nn.Parameter):
            shared[id(value)] = value
        elif isinstance(value, torch.Tensor):
            if value.requires_grad:
                shared[id(value)] = value
            else:
                tensors.append(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            pending.extend(value)
    if tensors:
        # A 0-dim state tensor is a counter (a class may keep one ``step`` for every
        # parameter on itself too): copied, so that every bucket starts from its value.
        held = {id(v) for entry in state.values() for v in entry.values()}
        shared.update((id(t), t) for t in tensors if id(t) in held and t.dim() > 0)
    return shared


def _copy(values: dict[str, Any], shared: dict[int, Any]) -> dict[str, Any]:
    """``values`` deep-copied entry by entry, the objects of ``shared`` (by id) and any entry
    that cannot be deep-copied shared. See [Note: what a snapshot shares]."""
    copied = {}
    for key, value in values.items():
        try:
            copied[key] = copy.deepcopy(value, dict(shared))
        except (TypeError, copy.Error, RuntimeError):
            copied[key] = value  # a lock, a process group: not state a step advances
    return copied


class ClassState:
    """The group and instance state of one pass. See [Note: group and instance state].

    Args:
        steppers: the optimizer's steppers; a group's class is tracked when its stepper runs
            the class's step on every rank for every bucket, which whole-tensor stepping does
            not (each owner rank steps only its own parameters: a class declared
            ``"whole_tensor"`` must keep its state in ``state[p]``).
        param_groups: the optimizer facade's groups, read at the start of the pass.
    """

    def __init__(
        self,
        steppers: ClassSteppers,
        param_groups: list[dict[str, Any]],
        state: dict[torch.Tensor, dict],
    ) -> None:
        self._groups = param_groups
        self._state = state
        self._owners = [steppers.optimizer_of(g) for g in param_groups]
        self._tracked = [
            steppers.can_track(g) and not keeps_state_per_parameter(type(owner))
            for g, owner in zip(param_groups, self._owners, strict=True)
        ]
        self.tracked = any(self._tracked)
        if not self.tracked:
            return
        self._steppers = steppers
        # The snapshot: each tracked group without its params, and each tracked class
        # instance's own attributes (by id of the instance).
        groups = {i: _without_params(g) for i, g in enumerate(param_groups) if self._tracked[i]}
        self._instances = {
            id(owner): owner for i, owner in enumerate(self._owners) if self._tracked[i]
        }
        attrs = {key: instance_attrs(owner) for key, owner in self._instances.items()}
        self._shared = _shared_objects([*groups.values(), *attrs.values()], state)
        self._group_snapshot = {i: _copy(g, self._shared) for i, g in groups.items()}
        self._instance_snapshot = {key: _copy(a, self._shared) for key, a in attrs.items()}
        # What the buckets changed: per group index, and per instance.
        self._group_changes: dict[int, dict[str, Any]] = {}
        self._instance_changes: dict[int, dict[str, Any]] = {}

    def group(self, index: int) -> dict[str, Any]:
        """The group a bucket's step reads: the facade's, or a fresh copy of the snapshot."""
        if not self.tracked or not self._tracked[index]:
            return self._groups[index]
        group = self._groups[index]
        return {
            **_copy(self._group_snapshot[index], self._shared),
            **{key: group[key] for key in _PARAMS if key in group},
        }

    def run(
        self,
        indices: Sequence[int],
        step: Callable[[], Sequence[dict[str, Any] | None] | None],
    ) -> None:
        """Run one bucket's ``step`` (over the groups ``indices``) from the snapshot; ``step``
        returns the group dicts the classes' steps received, in order."""
        tracked = [i for i in indices if self.tracked and self._tracked[i]]
        if not tracked:
            step()
            return
        instances = {id(self._owners[i]) for i in tracked}
        self._restore(instances)
        apart = not any(self._steppers.is_joint(self._groups[i]) for i in tracked)
        generators = GeneratorStates() if apart else None
        handed = step()
        assert handed is not None, "a tracked class is stepped through its own step()"
        if generators is not None and generators.drawn():
            raise RuntimeError(
                _DRAWS + ". This bucket's parameters have moved; the others not. (A thread of "
                "yours drawing from these generators while this step ran reads the same.)"
            )
        self._collect(indices, tracked, instances, handed)

    def must_check(self, indices: Sequence[int]) -> bool:
        """Whether a class of the groups ``indices`` is tracked and not yet checked."""
        return self.tracked and any(
            self._tracked[index]
            and not self._steppers.is_joint(self._groups[index])
            and self._steppers.key_of(self._groups[index]) not in self._steppers.probed
            for index in indices
        )

    def check(self, held: Sequence[tuple[Sequence[int], Sequence[Batch]]]) -> None:
        """Check the classes of the ``held`` buckets (their groups and batches) before their
        first real update: step two halves of their parameters on copies and refuse a class
        that changes its groups or instance differently for each, or draws random numbers.
        See [Note: group and instance state]."""
        chosen = [
            (index, batch)
            for indices, batches in held
            for index, batch in zip(indices, batches, strict=True)
            if self._tracked[index] and not self._steppers.is_joint(batch.group)
        ]
        self._steppers.probed |= {self._steppers.key_of(batch.group) for _, batch in chosen}
        if not chosen:
            return
        # Each held batch, in two halves where it has two parameters or more: every piece must
        # change the groups and the instance alike.
        pieces = []
        for index, batch in chosen:
            n = len(batch.params)
            cuts = [range(n)] if n < 2 else _halves(n)
            pieces += [(index, batch, cut) for cut in cuts]
        groups: dict[int, dict[str, Any]] = {}
        objects: dict[int, dict[str, Any]] = {}
        generators = GeneratorStates()
        refusal: Exception | None = None
        # The smallest parameter of each piece as the piece's step left it (a copy, by batch and
        # position: the one _check_together steps beside another), and the copies' state. Only
        # those are kept: the pieces together are every held parameter.
        apart: dict[tuple[int, int], torch.Tensor] = {}
        copies: dict[torch.Tensor, dict] = {}
        try:
            for index, batch, cut in pieces:
                owner = id(self._owners[index])
                self._restore({owner})
                params, grads = batch.params, batch.grads
                group = self.group(index)
                probe = _probing(group)
                part = Batch(group, [params[i] for i in cut], [grads[i] for i in cut])
                stepper = self._steppers.tracked(part.group)
                (group,), copied = stepper.step_copies([part], self._state)
                i = _smallest(batch, cut)
                kept = apart[id(batch), i] = group["params"][cut.index(i)]
                copies[kept] = copied.get(kept, {})
                after = _without_params(group)
                if probe is not None and same_value(after.get("lr"), probe):
                    after["lr"] = self._group_snapshot[index].get("lr")  # as the step left it
                try:
                    changes = _changes(self._group_snapshot[index], after)
                    self._agree(groups, index, changes, f"in param group {index}")
                    changes = _changes(
                        self._instance_snapshot[owner], instance_attrs(self._owners[index])
                    )
                    self._agree(objects, owner, changes, "on the optimizer instance")
                except RuntimeError as e:  # the steps on copies go on: see _check_together
                    refusal = refusal or e
            if refusal is None and generators.drawn():
                refusal = RuntimeError(_DRAWS)
            together = self._check_together(chosen, apart, copies)  # every rank, whatever else
            refusal = refusal or together
            if refusal is None:
                self._check_rows(chosen)
        except Exception as e:  # agreed below, so that every rank raises
            refusal = e
        finally:
            generators.restore()
            self._restore(set(self._instances))
        mesh_param = next(
            (p for _, batch in chosen for p in batch.params if isinstance(p, DTensor)), None
        )
        if mesh_param is not None:
            names = sorted({type(self._owners[index]).__name__ for index, _ in chosen})
            refusal = _agreed(refusal, mesh_param, " and ".join(names))
        if refusal is not None:
            raise refusal

    def _check_together(
        self,
        chosen: Sequence[tuple[int, Batch]],
        apart: dict[tuple[int, int], torch.Tensor],
        copies: dict[torch.Tensor, dict],
    ) -> RuntimeError | None:
        """The refusal of a class whose step of two parameters together moves them (or their
        state) otherwise than its steps of the batch's halves they were in (``apart``, their
        state in ``copies``): its update of a
        parameter reads others (a norm over all of them clipping inside ``step()``, their
        number, a parameter's position in its group), which stepping bucket by bucket cannot
        reproduce. The pair is the smallest parameter of each half, so that the copies cost
        little; a class whose held buckets all hold one parameter has the smallest of them
        stepped beside a copy of itself. See [Note: group and instance state].

        Every pair is stepped, and the same pairs on every rank (chosen by their global
        sizes), before any verdict: copies of DTensors (``"dtensor"``) step with collectives,
        and a rank that stopped at a disagreement its shards show, or stepped another pair,
        would leave the others waiting in theirs (found: a first step at lr 1e-7 in float32 hung 2
        ranks, declared ``"dtensor"``)."""
        pairs = [
            (index, batch, [_smallest(batch, half) for half in _halves(len(batch.params))])
            for index, batch in chosen
            if len(batch.params) >= 2
        ]
        paired = {self._steppers.key_of(batch.group) for _, batch, _ in pairs}
        alone: dict[Any, tuple[int, Batch]] = {}
        for index, batch in chosen:
            key = self._steppers.key_of(batch.group)
            if key in paired or (key in alone and _size(batch, 0) >= _size(alone[key][1], 0)):
                continue
            alone[key] = (index, batch)
        pairs += [(index, batch, [0, 0]) for index, batch in alone.values()]
        refusal = None
        for index, batch, pair in pairs:
            both, copied = self._stepped(index, batch, pair)
            copies.update(copied)
            if refusal is None and any(
                _moved_otherwise(
                    together, apart[id(batch), i], batch.params[i], copies, self._state
                )
                for i, together in zip(pair, both, strict=True)
            ):
                refusal = _reads_others(
                    self._owners[index],
                    "two parameters together moved them (or their state) otherwise than "
                    "its steps of the halves of their bucket",
                )
        # On loud gradients, one parameter per class alone and beside a copy of itself, its
        # state compared too: a threshold the first gradients do not reach (a clipping by the
        # norm of all of them, max_grad_norm=1.0 above it) is then crossed otherwise by the two.
        loud: dict[Any, tuple[int, Batch, int]] = {}
        for index, batch, pair in pairs:
            loud.setdefault(self._steppers.key_of(batch.group), (index, batch, pair[0]))
        for index, batch, i in loud.values():
            (alone,), copied = self._stepped(index, batch, [i], loud=True)
            copies.update(copied)
            twins, copied = self._stepped(index, batch, [i, i], loud=True)
            copies.update(copied)
            param = batch.params[i]
            if refusal is None and any(
                _moved_otherwise(twin, alone, param, copies, self._state) for twin in twins
            ):
                refusal = _reads_others(
                    self._owners[index],
                    "a parameter beside a copy of itself, on gradients scaled up, moved it "
                    "(or its state) otherwise than its step of it alone",
                )
        return refusal

    def _stepped(
        self, index: int, batch: Batch, which: Sequence[int], *, loud: bool = False
    ) -> tuple[list[torch.Tensor], dict[torch.Tensor, dict]]:
        """Copies of ``batch``'s parameters ``which`` (repeated: each its own copy), stepped
        together from the snapshot by group ``index``'s class, and their state (see
        ``step_copies``)."""
        self._restore({id(self._owners[index])})
        group = self.group(index)
        _probing(group)
        copies = Batch(group, [batch.params[i] for i in which], [batch.grads[i] for i in which])
        stepper = self._steppers.tracked(batch.group)
        (group,), state = stepper.step_copies([copies], self._state, loud=loud)
        return group["params"], state

    def _check_rows(self, chosen: Sequence[tuple[int, Batch]]) -> None:
        """Refuse a class stepped on local shards whose update of a row depends on the
        parameter's other rows. See [Note: rows stepped apart]."""
        # Per class: its group index and the local shard with the most rows (two or more).
        probes: dict[str | None, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        for index, batch in chosen:
            if not self._steppers.tracked(batch.group).local_shards:
                continue
            key = self._steppers.key_of(batch.group)
            for param, grad in zip(batch.params, batch.grads, strict=True):
                shard = local_tensor(param)
                rows = shard.shape[0] if shard.dim() > 0 else 0
                if rows >= 2 and rows > probes.get(key, (1,))[0]:
                    probes[key] = (rows, index, param, grad)
        for rows, index, param, grad in probes.values():
            seen = self._rows_apart(index, rows, param, grad)
            if seen is not None:
                raise RuntimeError(
                    f"{type(self._owners[index]).__name__} is declared 'elementwise', but its "
                    f"step of the two halves of {seen} apart changed it otherwise than its "
                    "step of the whole: its update of an element reads other elements of the "
                    "parameter (a norm, as LAMB's trust ratio; a factorization), so stepping "
                    "each rank's local shards would train differently from the plain step(). "
                    "Nothing has moved. Declare it 'whole_tensor' (each parameter stepped whole "
                    "on an owner rank) or 'dtensor' (every reduction within a parameter made "
                    "global), or leave it undeclared (stepped jointly)."
                )

    def _rows_apart(
        self, index: int, rows: int, param: torch.Tensor, grad: torch.Tensor
    ) -> str | None:
        """Step ``param``'s local shard whole, then its two halves of rows apart, on copies;
        what the halves changed otherwise than the whole, or ``None``."""
        stepper = self._steppers.tracked(self._groups[index])
        shard = local_tensor(param)
        before = {k: local_tensor(v) for k, v in self._state.get(param, {}).items()}
        # On the gradient, then on it scaled up: a threshold on a norm of the parameter's
        # gradient (a clipping of each parameter's) that the first gradient does not reach.
        for gradient, how in ((grad, ""), (loud_copy(grad), " on a gradient scaled up")):
            stepped = []
            for part in (slice(None), slice(0, rows // 2), slice(rows // 2, None)):
                self._restore({id(self._owners[index])})
                group = self.group(index)
                _probing(group)
                stepped.append(stepper.step_rows(group, param, gradient, part, self._state))
            (whole, state), (top, top_state), (bottom, bottom_state) = stepped
            apart = [("the rows of a shard", whole, top, bottom, shard)] + [
                (
                    f"the rows of its state {key!r}",
                    value,
                    top_state[key],
                    bottom_state[key],
                    before.get(key),
                )
                for key, value in state.items()
                if has_rows(value, whole) and key in top_state and key in bottom_state
            ]
            for what, together, first, second, start in apart:
                if _rows_disagree(together, torch.cat([first, second]), start):
                    return f"{what} of shape {tuple(shard.shape)}{how}"
        return None

    def _restore(self, instances: set[int]) -> None:
        """Reset the attributes of the tracked instances ``instances`` to the snapshot."""
        for key in instances:
            _set_attrs(self._instances[key], _copy(self._instance_snapshot[key], self._shared))

    def _collect(
        self,
        indices: Sequence[int],
        tracked: list[int],
        instances: set[int],
        handed: Sequence[dict[str, Any] | None],
    ) -> None:
        for index, group in zip(indices, handed, strict=True):
            if index in tracked:
                assert group is not None
                after = _without_params(group)
                changes = _changes(self._group_snapshot[index], after)
                self._agree(self._group_changes, index, changes, f"in param group {index}")
        for key in instances:
            changes = _changes(self._instance_snapshot[key], instance_attrs(self._instances[key]))
            self._agree(self._instance_changes, key, changes, "on the optimizer instance")

    def _agree(
        self, seen: dict[int, dict[str, Any]], key: int, changes: dict[str, Any], where: str
    ) -> None:
        previous = seen.get(key)
        if previous is None:
            seen[key] = changes
        elif not same_value(previous, changes):
            self._disagree(where, previous, changes)

    @staticmethod
    def _disagree(where: str, previous: dict[str, Any], changes: dict[str, Any]) -> NoReturn:
        raise RuntimeError(
            f"the wrapped optimizer's step wrote different values {where} for different "
            f"buckets of one backward ({sorted(previous)} vs {sorted(changes)}): it keeps "
            "state there that depends on the parameters stepped, which stepping bucket by "
            "bucket cannot reproduce. Keep per-parameter values in self.state[p] (as "
            "torch.optim does), or use the plain optimizer."
        )

    def wrote(self) -> bool:
        """Whether this pass changed a value in a group or on an instance (a step counter)."""
        return self.tracked and any(
            changes
            for seen in (self._group_changes, self._instance_changes)
            for changes in seen.values()
        )

    def finish(self, skipped: set[int], *, whole: bool = False) -> None:
        """Step the tracked groups no bucket stepped, none of whose parameters holds a gradient
        (the plain optimizer's ``step()`` visits them too), then write what the buckets
        changed back, once. ``skipped``: the groups of buckets skipped as non-finite, left
        untouched as those buckets' state is; ``whole``: every bucket that got a gradient was
        skipped, a skipped step, which a loop skipping it (GradScaler's ``step``) never hands
        to the class: no group is visited, and no counter advances."""
        if not self.tracked:
            return
        untouched = [
            i
            for i in range(len(self._groups))
            if not whole and self._tracked[i] and i not in self._group_changes and i not in skipped
        ]
        if untouched:
            groups = [self.group(i) for i in untouched]
            self.run(untouched, lambda: self._steppers.step_without_gradients(groups))
        for index, changes in self._group_changes.items():
            for name, value in changes.items():
                if value is _REMOVED:
                    self._groups[index].pop(name, None)
                else:
                    self._groups[index][name] = value
        for key, changes in self._instance_changes.items():
            instance = self._instances[key]
            for name, value in changes.items():
                if value is _REMOVED:
                    if hasattr(instance, name):
                        delattr(instance, name)
                else:
                    setattr(instance, name, value)

    def undo(self) -> None:
        """Set what this pass wrote on the instances back to the snapshot: the loop rolled its
        backward back (the model and the optimizer loaded, then ``zero_grad()``), a step the
        plain optimizer never ran. The groups came back with the loaded state dict; the
        instance's own attributes are in no state dict, so the plain optimizer's kept the
        values they had before it."""
        if not self.tracked:
            return
        for key, changes in self._instance_changes.items():
            instance = self._instances[key]
            before = _copy(self._instance_snapshot[key], self._shared)
            for name in changes:
                if name in before:
                    setattr(instance, name, before[name])
                elif hasattr(instance, name):
                    delattr(instance, name)


def _reads_others(optimizer: Optimizer, seen: str) -> RuntimeError:
    """The refusal of a class declared to step bucket by bucket whose step of ``seen``."""
    return RuntimeError(
        f"{type(optimizer).__name__} is declared to step bucket by bucket, but its step of "
        f"{seen}: its update of a parameter reads other parameters (a norm over all its "
        "gradients, clipping inside step(), their number, a parameter's position in its "
        "group), so stepping bucket by bucket would train differently from the plain step(). "
        "Nothing has moved. Leave the class undeclared (stepped jointly, once per backward, "
        "exact whatever its step() reduces over)."
    )


def _agreed(refusal: Exception | None, param: DTensor, checked: str) -> Exception | None:
    """``refusal`` agreed by every rank of ``param``'s mesh: another rank's (what it checked
    depends on its shards: one holding no shard of two rows, or empty ones whose halves
    write alike, sees nothing) for ``None``, so that every rank raises instead of one going
    on to the next collective alone. A collective, made by every rank in the same order."""
    mesh = param.device_mesh
    # On the mesh's device type: a shard offloaded to the host has a device-side group.
    flag = torch.tensor([refusal is not None], dtype=torch.int32, device=mesh.device_type)
    for dim in range(mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if refusal is None and bool(flag):
        return RuntimeError(
            f"the check before the first update of {checked} refused it on another rank (that "
            "rank's error says why); nothing has moved"
        )
    return refusal


def _size(batch: Batch, i: int) -> tuple[bool, int]:
    """How a check picks a parameter to step on copies: a non-empty one, the smallest (its
    copies cost least), by its global size (a DTensor's), so that every rank picks the same:
    copies of DTensors step with collectives."""
    numel = batch.params[i].numel()
    return numel == 0, numel


def _halves(n: int) -> tuple[range, range]:
    return range(n // 2), range(n // 2, n)


def _smallest(batch: Batch, indices: Sequence[int]) -> int:
    return min(indices, key=lambda i: _size(batch, i))


_PROBE_LR = 1e-3
"""The lr a check's copies step at where the group's is lower (a warmup from lr 0 or near it)."""


def _probing(group: dict[str, Any]) -> Any:
    """Set a copy's ``group`` to step at ``_PROBE_LR`` where its lr is lower: a warmup from lr
    0 moves nothing, one from near it next to nothing, and a check comparing moves would see
    none (a class clipping by the norm of all its gradients, declared ``"dtensor"``, was
    stepped bucket by bucket from the second step on, no error: 1.3e-2 from the plain one
    after four steps from lr 0, 9.8e-3 on 2 ranks from 1e-7 on bfloat16 weights). Returns the
    lr set, or ``None``."""
    lr = group.get("lr")
    if not _is_below(lr, _PROBE_LR):
        return None
    group["lr"] = torch.full_like(lr, _PROBE_LR) if torch.is_tensor(lr) else _PROBE_LR
    return group["lr"]


def _is_below(value: Any, bound: float) -> bool:
    """Whether ``value`` is a number (or a one-element tensor) of magnitude below ``bound``."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.abs() < bound)
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < bound


def _moved_otherwise(
    moved: torch.Tensor,
    apart: torch.Tensor,
    param: torch.Tensor,
    copies: dict[torch.Tensor, dict],
    state: dict[torch.Tensor, dict],
) -> bool:
    """Whether copy ``moved`` of ``param``, stepped beside others, moved otherwise than copy
    ``apart``, stepped alone: it, or a state tensor the step left it (``copies``: the copies'
    state; ``state``: the real one, where both began). The state shows what a first update
    can hide: timm's ``Lamb`` clipping by the norm of all gradients moves its first update
    alike whatever the gradients' scale (Adam's first step divides it out), not its moments."""
    if _rows_disagree(local_tensor(moved), local_tensor(apart), local_tensor(param)):
        return True
    beside, alone = copies.get(moved, {}), copies.get(apart, {})
    if beside.keys() != alone.keys():
        return True
    start = state.get(param, {})
    return any(
        _rows_disagree(local_tensor(value), local_tensor(alone[key]), _local(start.get(key)))
        for key, value in beside.items()
        if isinstance(value, torch.Tensor) and isinstance(alone[key], torch.Tensor)
    )


def _local(value: Any) -> torch.Tensor | None:
    return local_tensor(value) if isinstance(value, torch.Tensor) else None


def _rows_disagree(
    together: torch.Tensor, apart: torch.Tensor, before: torch.Tensor | None
) -> bool:
    """Whether rows stepped ``apart`` moved otherwise than stepped ``together`` from
    ``before`` (zeros for a state tensor the step created): by more than 1e-3 of the whole
    move, summed over the elements, so that a kernel rounding a few elements differently at
    another offset (a vectorized loop and its tail) passes, and an update scaled otherwise
    (LAMB's trust ratio, a clipping coefficient) does not."""
    if together.shape != apart.shape:
        return True
    if together.numel() == 0:
        return False
    if not together.is_floating_point():
        return not torch.equal(together, apart)
    together, apart = together.float(), apart.float()
    start = torch.zeros_like(together) if before is None else before.float()
    if start.shape != together.shape:
        start = torch.zeros_like(together)
    moved = (together - start).abs().sum()
    return bool((together - apart).abs().sum() > 1e-3 * moved)


_DRAWS = (
    "the wrapped optimizer's step draws random numbers (it advanced torch's, Python's or "
    "NumPy's generator, as SGLD's noise does): stepped bucket by bucket, as its declared "
    "stepping asks, it would draw them in another order, and on each rank's local shards in "
    "other shapes, than the plain step(), and train differently with nothing to tell. Leave "
    "the class undeclared (stepped jointly: one call of its step, as the plain step() is, at "
    "the end of backward, so the loop must draw nothing between backward and step()), or use "
    "the plain optimizer"
)


class OutsideState:
    """What one call of a class's step does outside ``state[p]``: values it writes into the
    groups it is handed or onto its instance, numbers it draws from the default generators.
    Taken for classes declared ``"whole_tensor"`` (not torch.optim's), which must keep all
    their state in ``state[p]``: see [Note: whole-tensor classes keep their state per
    parameter] in ``_whole_tensor.py``.

    Args:
        optimizer: the class's instance, whose attributes are taken now.
        groups: the groups the step will be handed, taken now (deep copies: a step may change
            a value in place).
        state: the state the step will read; its tensors are shared, not copied.
    """

    WROTE_GROUPS = 1
    WROTE_INSTANCE = 2
    DREW = 4

    def __init__(
        self,
        optimizer: Optimizer,
        groups: Sequence[dict[str, Any]],
        state: dict[torch.Tensor, dict],
    ) -> None:
        self._optimizer = optimizer
        values = [_without_params(group) for group in groups]
        attrs = instance_attrs(optimizer)
        self._shared = _shared_objects([*values, attrs], state)
        self._groups = [_copy(value, self._shared) for value in values]
        self._attrs = _copy(attrs, self._shared)
        self._generators = GeneratorStates()

    def undo(self, handed: Sequence[dict[str, Any]] | None) -> int:
        """What the step did, the codes above or-ed (0: nothing outside ``state[p]``), given
        the groups it was handed (``None``: the step raised); if anything, or if it raised,
        the instance's attributes and the generators are set back to what they were."""
        code = 0
        if handed is not None and any(
            _changes(before, _without_params(group))
            for before, group in zip(self._groups, handed, strict=True)
        ):
            code |= self.WROTE_GROUPS
        if _changes(self._attrs, instance_attrs(self._optimizer)):
            code |= self.WROTE_INSTANCE
        if self._generators.drawn():
            code |= self.DREW
        if code or handed is None:
            _set_attrs(self._optimizer, _copy(self._attrs, self._shared))
            self._generators.restore()
        return code


class BesideOthers:
    """The check that a class declared ``"whole_tensor"`` steps a parameter beside others as
    it steps it alone, taken before its first real update on this rank.

    Each owner rank runs the class's step on its own parameters of a unit, each in a group of
    its own, where the plain ``step()`` hands it every parameter of a group at once: a class
    whose update of a parameter reads the others (a norm over several clipping inside
    ``step()``, their number, a parameter's position in its group) trains differently, with no
    error (measured on the code before, four steps: a class clipping by the norm of all its
    gradients 1.9e-2 and 2.3e-2 from the plain one on 2 and 3 ranks, 2.1e-2 on a plain
    module; one reading a multiplier by position 2.6e-1). So, on copies (float32 where the
    tensors are narrower, at ``_PROBE_LR`` where the group's lr is lower), the smallest
    parameter of ``batches`` is stepped alone, beside a copy of itself, and with all of
    ``batches``, then alone and beside a copy of itself on gradients scaled up (``loud_copy``:
    a threshold the first gradients do not reach is crossed); :meth:`disagrees` says whether
    it, or a state tensor of it, moved otherwise beside others than alone (by more than 1e-3
    of the move summed, as ``ClassState``'s check compares a bucket's halves). The copies of
    all of ``batches`` cost their size once per process. What the instance and the generators
    saw is set back.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        stepper: BucketStepper,
        batches: Sequence[Batch],
        state: dict[torch.Tensor, dict],
    ) -> None:
        b, i = min(
            ((b, i) for b, batch in enumerate(batches) for i in range(len(batch.params))),
            key=lambda where: _size(batches[where[0]], where[1]),
        )
        param, grad = batches[b].params[i], batches[b].grads[i]
        probed = [Batch(dict(batch.group), batch.params, batch.grads) for batch in batches]
        for batch in probed:
            _probing(batch.group)
        group = probed[b].group
        watch = OutsideState(optimizer, [], state)
        one, two = Batch(group, [param], [grad]), Batch(group, [param, param], [grad, grad])
        copies: dict[torch.Tensor, dict] = {}
        stepped = []
        try:
            steps = [([one], False), ([two], False), (probed, False), ([one], True), ([two], True)]
            for handed, loud in steps:
                groups, copied = stepper.step_copies(handed, state, loud=loud)
                copies.update(copied)
                stepped.append(groups)
        finally:
            watch.undo(None)
        (alone,), (twins,), every, (loud_alone,), (loud_twins,) = stepped
        compared = [
            (moved, apart["params"][0])
            for apart, beside in (
                (alone, [*twins["params"], every[b]["params"][i]]),
                (loud_alone, loud_twins["params"]),
            )
            for moved in beside
        ]
        self._disagrees = any(_moved_otherwise(m, a, param, copies, state) for m, a in compared)

    def disagrees(self) -> bool:
        """Whether the parameter (or its state) moved otherwise beside others than alone."""
        return self._disagrees


def _without_params(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _PARAMS}


def _set_attrs(instance: Optimizer, attrs: dict[str, Any]) -> None:
    """Set the instance's own attributes to ``attrs``, deleting those set since."""
    for name in instance_attrs(instance).keys() - attrs.keys():
        delattr(instance, name)
    for name, value in attrs.items():
        setattr(instance, name, value)


def instance_attrs(optimizer: Optimizer) -> dict[str, Any]:
    """The instance's own state: its attributes but torch.optim's and its class's caches."""
    skip = _OPTIMIZER_ATTRS | cache_attributes(type(optimizer))
    return {k: v for k, v in vars(optimizer).items() if k not in skip}
