"""Param groups of several optimizer classes in one ``OptimizerInBackward``.

[Note: groups of several classes]
Muon trains the matrices and AdamW the rest; as two optimizers, each would clip by the norm of
its own parameters and report its own norm, and there would be no global one. So a param group
may name its own class, ``{"params": matrices, "optimizer_cls": torch.optim.Muon, "lr": 0.02}``:
one ``OptimizerInBackward`` then holds every group, computes one norm over all of them and clips
once. Each class is instantiated on its own groups, with that group's keyword arguments (the
constructor's keyword arguments go to the default class only), so every group gets exactly its
class's keys and defaults and every ``state[p]`` keeps its class's plain format. A group of
another class than the default keeps its class in ``"optimizer_cls"``, as a dotted import path,
so that ``state_dict()`` stays a plain dict of strings and tensors. Each class has its own
stepper (elementwise, whole tensor or DTensor, as the class is declared); a bucket's groups go
to their classes' steppers in group order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from fused_optim_dist._kinds import group_check
from fused_optim_dist._stepping import Batch, BucketStepper, Stepper

__all__ = ["GROUP_CLASS_KEY", "ClassSteppers", "class_path"]

GROUP_CLASS_KEY = "optimizer_cls"
"""The param-group key naming the group's own optimizer class."""


def class_path(cls: type[Optimizer]) -> str:
    """The dotted import path of ``cls``, as ``resolve_optimizer_class`` takes it."""
    return f"{cls.__module__}.{cls.__qualname__}"


class ClassSteppers:
    """The steppers of every class of an optimizer's groups, as one ``Stepper``.

    Args:
        steppers: by the value of a group's ``"optimizer_cls"`` key (``None``: the default
            class, whose groups have no such key).
        trackable: whether each class's group and instance state can be tracked (see
            [Note: group and instance state]), by the same key.
        joint: the keys of the classes stepped jointly, once per backward (see [Note: classes
            stepped jointly]).
    """

    def __init__(
        self,
        steppers: dict[str | None, Stepper],
        trackable: dict[str | None, bool],
        joint: set[str | None],
    ):
        self.steppers = steppers
        self.trackable = trackable
        self.joint = joint
        # The classes whose group and instance state was checked before their first update.
        self.probed: set[str | None] = set()

    def of(self, group: dict[str, Any]) -> Stepper:
        return self.steppers[group.get(GROUP_CLASS_KEY)]

    def takes_found_inf(self, batches: Sequence[Batch]) -> bool:
        return all(self.of(batch.group).takes_found_inf([batch]) for batch in batches)

    def step(
        self,
        batches: Sequence[Batch],
        state: defaultdict[torch.Tensor, dict],
        found_inf: torch.Tensor | None = None,
    ) -> list[dict[str, Any] | None]:
        by_class: dict[str | None, list[int]] = {}
        for position, batch in enumerate(batches):
            by_class.setdefault(batch.group.get(GROUP_CLASS_KEY), []).append(position)
        handed: list[dict[str, Any] | None] = [None] * len(batches)
        for key, positions in by_class.items():
            out = self.steppers[key].step([batches[i] for i in positions], state, found_inf)
            if out is not None:
                for position, group in zip(positions, out, strict=True):
                    handed[position] = group
        return handed

    def tracked(self, group: dict[str, Any]) -> BucketStepper:
        """The stepper of ``group``'s class, one whose group and instance state is tracked:
        it runs the class's own step on every rank (see ``ClassState``)."""
        stepper = self.of(group)
        assert isinstance(stepper, BucketStepper), "whole-tensor classes are not tracked"
        return stepper

    def step_without_gradients(self, groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run each class's step once on its ``groups`` (as the plain optimizer's one call),
        none of whose parameters holds a gradient; the groups each received, in order."""
        by_class: dict[str | None, list[int]] = {}
        for position, group in enumerate(groups):
            by_class.setdefault(group.get(GROUP_CLASS_KEY), []).append(position)
        handed: list[dict[str, Any]] = [{}] * len(groups)
        for positions in by_class.values():
            mine = [groups[i] for i in positions]
            out = self.tracked(mine[0]).step_without_gradients(mine)
            for position, group in zip(positions, out, strict=True):
                handed[position] = group
        return handed

    def check_groups(
        self, param_groups: Sequence[dict[str, Any]], state: dict[torch.Tensor, dict]
    ) -> None:
        """Let each class refuse, before anything moves, a group of ``param_groups`` it cannot
        step as it is now (see ``_kinds.checks_groups``)."""
        by_class: dict[str | None, list[tuple[int, dict[str, Any]]]] = {}
        for index, group in enumerate(param_groups):
            by_class.setdefault(group.get(GROUP_CLASS_KEY), []).append((index, group))
        for key, groups in by_class.items():
            check = group_check(self.steppers[key].optimizer)
            if check is not None:
                check(groups, state)

    def flush(self) -> None:
        for stepper in self.steppers.values():
            stepper.flush()

    def optimizer_of(self, group: dict[str, Any]) -> Optimizer:
        return self.of(group).optimizer

    def can_track(self, group: dict[str, Any]) -> bool:
        return self.trackable[group.get(GROUP_CLASS_KEY)]

    def key_of(self, group: dict[str, Any]) -> str | None:
        return group.get(GROUP_CLASS_KEY)

    def is_joint(self, group: dict[str, Any]) -> bool:
        return group.get(GROUP_CLASS_KEY) in self.joint
