"""State the wrapped class keeps outside ``state[p]``: in its param groups and on itself.

[Note: group and instance state]
A plain optimizer's ``step()`` runs once per step, over every group. Some classes count steps
there rather than per parameter: ``group["step"] += 1`` (timm's and apex's LAMB, schedule-free
optimizers) or ``self.t += 1``. In backward the class's step runs once per bucket, on a copy of
each group, so such a counter would be lost (the copy) or advanced once per bucket (the
instance). So, for every class that is not one of torch.optim's own (which keep all their state
in ``state[p]``):

* when a pass begins, the non-``params`` entries of every group and the instance's own
  attributes are copied (the *snapshot*);
* every bucket steps from the snapshot: its groups are fresh copies of it, and the instance's
  attributes are reset to it;
* what a bucket's step changed must be what every other bucket's step changed (a counter
  advanced by one is the same in every bucket); a class whose buckets disagree writes something
  that depends on the parameters stepped, which stepping per bucket cannot reproduce, and is
  refused with an error at the first bucket that disagrees;
* groups no bucket stepped in this pass get the class's step with no parameters, as the plain
  optimizer's ``step()`` visits groups whose parameters have no gradient;
* when the pass finishes, the changed values are written back once, into the optimizer's
  groups and the instance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from fused_optim_dist._kinds import is_torch_optim_class

__all__ = ["ClassState"]

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
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    }
)


def _same(a: Any, b: Any) -> bool:
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
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``after`` that are new or differ from ``before``."""
    return {k: v for k, v in after.items() if k not in before or not _same(before[k], v)}


class ClassState:
    """The group and instance state of one pass. See [Note: group and instance state].

    Args:
        optimizer: the wrapped class's instance whose step runs per bucket.
        param_groups: the optimizer facade's groups, read at the start of the pass.
        trackable: whether the class's step runs on every rank for every bucket. Not under
            whole-tensor stepping, where each owner rank steps only its own parameters: a
            class declared ``"whole_tensor"`` must keep its state in ``state[p]``.
    """

    def __init__(
        self, optimizer: Optimizer, param_groups: list[dict[str, Any]], *, trackable: bool
    ) -> None:
        self._optimizer = optimizer
        self._groups = param_groups
        self.tracked = trackable and not is_torch_optim_class(type(optimizer))
        if not self.tracked:
            return
        # The snapshot: each group without its params, and the instance's own attributes.
        self._group_snapshot = [
            copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in param_groups
        ]
        self._instance_snapshot = copy.deepcopy(self._instance_attrs())
        # What the buckets changed: per group index, and on the instance (None: no bucket yet).
        self._group_changes: dict[int, dict[str, Any]] = {}
        self._instance_changes: dict[str, Any] | None = None

    def _instance_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self._optimizer).items() if k not in _OPTIMIZER_ATTRS}

    def group(self, index: int) -> dict[str, Any]:
        """The group a bucket's step reads: the facade's, or a fresh copy of the snapshot."""
        if not self.tracked:
            return self._groups[index]
        return {
            **copy.deepcopy(self._group_snapshot[index]),
            "params": self._groups[index]["params"],
        }

    def run(
        self,
        indices: Sequence[int],
        step: Callable[[], Sequence[dict[str, Any]] | None],
    ) -> None:
        """Run one bucket's ``step`` (over the groups ``indices``) from the snapshot; ``step``
        returns the group dicts the class's step received, in order."""
        if not self.tracked:
            step()
            return
        for key, value in copy.deepcopy(self._instance_snapshot).items():
            setattr(self._optimizer, key, value)
        handed = step()
        if handed is None:
            raise AssertionError("a tracked class must be stepped through its own step()")
        for index, group in zip(indices, handed, strict=True):
            after = {k: v for k, v in group.items() if k != "params"}
            self._agree(self._group_changes, index, _changes(self._group_snapshot[index], after))
        instance = _changes(self._instance_snapshot, self._instance_attrs())
        if self._instance_changes is None:
            self._instance_changes = instance
        elif not _same(self._instance_changes, instance):
            self._refuse("on the optimizer instance", self._instance_changes, instance)

    def _agree(self, seen: dict[int, dict[str, Any]], index: int, changes: dict[str, Any]) -> None:
        previous = seen.get(index)
        if previous is None:
            seen[index] = changes
        elif not _same(previous, changes):
            self._refuse(f"in param group {index}", previous, changes)

    def _refuse(self, where: str, first: dict[str, Any], other: dict[str, Any]) -> None:
        name = type(self._optimizer).__name__
        raise RuntimeError(
            f"{name}.step wrote different values {where} for different buckets of one backward "
            f"({sorted(first)} vs {sorted(other)}): it keeps state there that depends on the "
            "parameters stepped, which stepping bucket by bucket cannot reproduce. Keep "
            "per-parameter values in self.state[p] (as torch.optim does), or use the plain "
            f"{name}."
        )

    def untouched(self) -> list[int]:
        """Indices of the groups no bucket stepped in this pass."""
        if not self.tracked:
            return []
        return [i for i in range(len(self._groups)) if i not in self._group_changes]

    def commit(self) -> None:
        """Write what the buckets changed back, once."""
        if not self.tracked:
            return
        for index, changes in self._group_changes.items():
            self._groups[index].update(changes)
        if self._instance_changes:
            for key, value in self._instance_changes.items():
                setattr(self._optimizer, key, value)
