"""Argument checks for ``OptimizerInBackward``, run before anything is modified."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["check_param_groups", "resolve_optimizer_class"]

_IN_BACKWARD_METHODS = ("accumulate", "grad_norm")
"""Methods of ``OptimizerInBackward`` that no ``torch.optim`` optimizer has."""


def _steps_in_backward(optimizer_cls: type[Optimizer]) -> bool:
    """Whether ``optimizer_cls`` is an in-backward optimizer (``OptimizerInBackward`` or a class
    made by ``in_backward``), recognised by the two methods only those have.

    Duck-typed on purpose: ``optimizer.py`` imports this module, so importing it back would be
    a cycle.
    """
    return all(callable(getattr(optimizer_cls, name, None)) for name in _IN_BACKWARD_METHODS)


def resolve_optimizer_class(optimizer_cls: type[Optimizer] | str) -> type[Optimizer]:
    """Return the optimizer class named by ``optimizer_cls`` (a class or a dotted import path).

    Raises ``TypeError``/``ValueError`` for anything that is not a ``torch.optim.Optimizer``
    subclass, and for the optimizers that cannot run inside backward: those whose ``step``
    requires a closure (LBFGS) and those built for sparse gradients (SparseAdam).
    """
    if isinstance(optimizer_cls, str):
        module_name, _, attr = optimizer_cls.rpartition(".")
        if not module_name:
            raise ValueError(
                f"optimizer_cls={optimizer_cls!r} is not a dotted import path; pass e.g. "
                "'torch.optim.AdamW' or the class itself"
            )
        try:
            optimizer_cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import optimizer class {optimizer_cls!r}: {e}") from e
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer subclass or its dotted path, "
            f"not {optimizer_cls!r}"
        )
    if _steps_in_backward(optimizer_cls):
        raise TypeError("optimizer_cls is already an in-backward optimizer; pass the plain class")
    if issubclass(optimizer_cls, torch.optim.SparseAdam):
        raise ValueError(
            f"{optimizer_cls.__name__} is built for sparse gradients, which FSDP2 and the "
            "in-backward step do not produce; use torch.optim.Adam or AdamW"
        )
    closure = inspect.signature(optimizer_cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_cls.__name__}.step requires a closure that re-evaluates the loss, "
            "which cannot run inside backward; use a first-order optimizer such as AdamW"
        )
    return optimizer_cls


def check_param_groups(param_groups: list[dict[str, Any]]) -> None:
    """Refuse parameter lists that would train nothing or step a parameter twice."""
    seen: set[int] = set()
    for index, group in enumerate(param_groups):
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is listed twice (found again in "
                    f"param group {index}); list each parameter once"
                )
            seen.add(id(param))
    if not any(p.requires_grad for group in param_groups for p in group["params"]):
        raise ValueError(
            "no parameter passed to OptimizerInBackward requires grad, so nothing would train; "
            "pass the trainable parameters (frozen ones may be included)"
        )
