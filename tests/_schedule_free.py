"""A schedule-free SGD for the tests (Defazio et al., "The Road Less Scheduled", 2024; the update
of the ``schedulefree`` package's reference ``SGDScheduleFree``, which is no dependency here).

Its parameters hold ``y``, the point gradients are taken at, while training, and ``x``, the
averaged point, for evaluation: ``train()`` and ``eval()`` move them between the two, and
``step()`` refuses to run out of train mode. It counts its steps in its groups (``k``,
``weight_sum``), so ``OptimizerInBackward`` steps it jointly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class ScheduleFreeSGD(torch.optim.Optimizer):
    def __init__(
        self, params: Iterable[Any], lr: float = 1.0, momentum: float = 0.9, r: float = 0.0
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, r=r, k=0, weight_sum=0.0, train_mode=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def eval(self) -> None:
        """Parameters to ``x``: ``x = y + (1 / momentum - 1) (y - z)``."""
        self._move(False, lambda group: 1 - 1 / group["momentum"])

    @torch.no_grad()
    def train(self) -> None:
        """Parameters to ``y = (1 - momentum) z + momentum x``."""
        self._move(True, lambda group: 1 - group["momentum"])

    def _move(self, train_mode: bool, weight: Any) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train_mode:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.lerp_(self.state[p]["z"], weight(group))
                group["train_mode"] = train_mode

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError("not in train mode: call optimizer.train() before step()")
        for group in self.param_groups:
            k, lr, momentum = group["k"], group["lr"], group["momentum"]
            weight = (k + 1) ** group["r"] * lr**2
            group["weight_sum"] += weight
            average = weight / group["weight_sum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "z" not in state:
                    state["z"] = p.clone()
                p.lerp_(state["z"], average)
                p.add_(p.grad, alpha=lr * (momentum * (1 - average) - 1))
                state["z"].sub_(p.grad, alpha=lr)
            group["k"] = k + 1
