"""State entries that torch.optim's classes make only at a parameter's first step.

[Note: options turned on after the first step]
Adam's (and AdamW's) ``amsgrad`` and RMSprop's ``centered`` and ``momentum`` each need a state
entry (``max_exp_avg_sq``, ``grad_avg``, ``momentum_buffer``) that the class's ``_init_group``
creates only where a parameter's state is empty, and reads at every later step (torch 2.13).
Turned on in a group after its parameters' first step (or set on a group whose state was loaded
from a run without it), the plain ``step()`` raises ``KeyError`` in that group's
``_init_group``, before the group moves. Stepped in backward, the class sees one bucket's
groups at a time, and the buckets that the backward reaches before that group's would move
first, the error coming mid-backward. So every group is checked when a backward (or
``step()``) starts stepping, before anything moves (``checks_groups`` in ``_kinds.py``; a
backward that fails it holds its gradients for ``step()``, which raises: [Note: a backward
held for step()] in ``optimizer.py``), and the error says what to do.

A subclass is checked where it keeps torch's ``_init_group``, which is what reads the entries.
Only parameters that require a gradient are looked at: the plain step reads the state of those
that hold one, and when a backward starts stepping it has made none yet. One that requires a
gradient and gets none in this backward (a branch its forward did not take) is refused a step
before the plain step would raise for it, at its next gradient.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from fused_optim_dist._protocol import describe

__all__ = ["first_step_state_check"]


class _Entry(NamedTuple):
    option: str
    needed: Callable[[Any], bool]
    """Whether the option's value asks for the entry."""
    key: str
    like: str
    """An entry of the same shape, dtype and placement, whose ``torch.zeros_like`` is the
    entry as the first step makes it (the fix the error names)."""


def _init_group(cls: type) -> object:
    """``cls._init_group`` as torch.optim defines it: Dynamo's first compilation replaces each
    torch.optim class's ``_init_group`` with a wrapper of it that Dynamo does not trace
    (``TorchPatcher.patch``, torch 2.13), which ``inspect.unwrap`` sees through."""
    return inspect.unwrap(getattr(cls, "_init_group", None))


_ENTRIES: dict[object, tuple[_Entry, ...]] = {
    _init_group(torch.optim.Adam): (_Entry("amsgrad", bool, "max_exp_avg_sq", "exp_avg_sq"),),
    _init_group(torch.optim.RMSprop): (
        _Entry("centered", bool, "grad_avg", "square_avg"),
        _Entry("momentum", lambda momentum: momentum > 0, "momentum_buffer", "square_avg"),
    ),
}
"""The entries each torch.optim ``_init_group`` reads only where an option asks for them."""


def first_step_state_check(
    optimizer: Optimizer,
) -> Callable[[Iterable[tuple[int, dict[str, Any]]], Mapping[torch.Tensor, dict]], None] | None:
    """A group check (see ``checks_groups`` in ``_kinds.py``) of the entries that
    ``optimizer``'s class reads only where an option asks for them, if it has any. See [Note:
    options turned on after the first step]."""
    entries = _ENTRIES.get(_init_group(type(optimizer)))
    if entries is None:
        return None
    return functools.partial(_check, type(optimizer).__name__, entries)


def _check(
    name: str,
    entries: tuple[_Entry, ...],
    groups: Iterable[tuple[int, dict[str, Any]]],
    state: Mapping[torch.Tensor, dict],
) -> None:
    for index, group in groups:
        for entry in entries:
            value = group.get(entry.option)
            if value is None or not entry.needed(value):
                continue
            for param in group["params"]:
                held = state.get(param)
                if held and param.requires_grad and entry.key not in held:
                    raise RuntimeError(
                        f"param_groups[{index}]['{entry.option}'] is {value!r}, but the state "
                        f"of {describe(param)} in it has no '{entry.key}': {name} makes that "
                        f"entry only at a parameter's first step, so the option was set after "
                        f"it (or the state was loaded from a run without it), and "
                        f"{name}.step() would raise KeyError: "
                        f"'{entry.key}'. Nothing was updated. Set '{entry.option}' before the "
                        f"first step, or add the entry as the first step makes it to every "
                        f"parameter of the group that has state (state[p]['{entry.key}'] = "
                        f"torch.zeros_like(state[p]['{entry.like}']))."
                    )
