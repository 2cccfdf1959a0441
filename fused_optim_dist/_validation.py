"""Argument checks for ``OptimizerInBackward``, run before anything is modified."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch.optim import Optimizer

from fused_optim_dist._torch_internals import fsdp_gathered_copies

__all__ = ["check_param_groups", "refuse_gathered_copies", "resolve_optimizer_class"]

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


def refuse_gathered_copies(params: list[torch.Tensor]) -> None:
    """Refuse FSDP2's all-gathered copies of sharded parameters in place of the parameters.

    FSDP2 leaves a unit unsharded after a forward that gets no backward (the root unit after
    an evaluation under ``torch.no_grad()``), and its modules then list the copies. The
    gradients autograd gives them are reduce-scattered into the sharded parameters' and
    dropped, and the copies are freed at the next reshard: a plain optimizer holding them
    trains nothing, in silence. See [Note: FSDP2's copies and flags] in
    ``_torch_internals.py``."""
    copies = fsdp_gathered_copies(params)
    if copies:
        copy, unit = copies[0]
        owners = ", ".join(type(m).__name__ for m in unit.modules)
        raise ValueError(
            f"a parameter of shape {tuple(copy.shape)} is FSDP2's all-gathered copy of a sharded "
            f"parameter (of the unit fully_shard made on {owners}), not the parameter: FSDP2 "
            "leaves a unit unsharded after a forward that gets no backward (the root unit after "
            "an evaluation under torch.no_grad()), and its modules then list these copies: a "
            "plain optimizer holding them trains nothing (FSDP2 reduces their gradients into "
            "the sharded parameters' and frees them). Call "
            "model.reshard() before building the optimizer or adding the param group, so that "
            "parameters() gives the sharded parameters"
        )


def check_param_groups(param_groups: list[dict[str, Any]]) -> None:
    """Refuse parameter lists that would train nothing or step a parameter twice."""
    refuse_gathered_copies([p for group in param_groups for p in group["params"]])
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
