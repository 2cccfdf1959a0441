"""The states of the default random number generators an optimizer's step may draw from.

torch's on the CPU, and on the accelerator once initialised; Python's ``random``; NumPy's global
one where NumPy is imported. A class whose step draws from them (SGLD's noise), stepped
elsewhere than where the plain ``step()`` runs, may draw its numbers in another order than the
plain optimizer: see [Note: group and instance state] in ``_class_state.py`` for classes
stepped bucket by bucket, and [Note: random numbers drawn jointly] in ``_engine.py`` for
classes stepped once per backward.
"""

from __future__ import annotations

import pickle
import random
import sys
from collections.abc import Callable, Collection
from typing import Any

import torch

__all__ = ["GeneratorStates"]


def _generators(torch_only: bool) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Each default generator there is now (torch's only, if ``torch_only``), by name: how to
    read its state and set it."""
    generators: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "torch's CPU generator": (torch.get_rng_state, torch.set_rng_state)
    }
    accelerator = torch.accelerator.current_accelerator()
    module = None if accelerator is None else torch.get_device_module(accelerator)
    if module is not None and module.is_initialized():
        generators[f"torch's {accelerator.type} generators"] = (
            module.get_rng_state_all,
            module.set_rng_state_all,
        )
    if torch_only:
        return generators
    generators["Python's random"] = (random.getstate, random.setstate)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        # NumPy's state holds an array: compared by its pickle.
        generators["NumPy's global generator"] = (
            lambda: pickle.dumps(numpy.random.get_state()),
            lambda state: numpy.random.set_state(pickle.loads(state)),
        )
    return generators


def _same(then: Any, now: Any) -> bool:
    """Whether a generator's state ``then`` is its state ``now``."""
    if isinstance(then, torch.Tensor):
        return torch.equal(then, now)
    if isinstance(then, list):  # an accelerator's generators, one state tensor per device
        return len(then) == len(now) and all(map(torch.equal, then, now))
    return then == now


class GeneratorStates:
    """The states of the default generators, taken when made.

    Args:
        torch_only: watch torch's generators only: reading and comparing their states costs
            about 4 us, Python's about 17 more, NumPy's (imported by torch) about 60 more.
    """

    __slots__ = ("_generators", "_states")

    def __init__(self, *, torch_only: bool = False) -> None:
        self._generators = _generators(torch_only)
        self._states = {name: read() for name, (read, _) in self._generators.items()}

    def only(self, names: Collection[str]) -> GeneratorStates:
        """These states of the generators ``names`` (as :meth:`advanced` names them) only."""
        kept = object.__new__(GeneratorStates)
        kept._generators = {n: g for n, g in self._generators.items() if n in names}
        kept._states = {n: self._states[n] for n in kept._generators}
        return kept

    def advanced(self) -> list[str]:
        """The names of the generators whose state changed since (a draw, a seed set)."""
        return [
            name
            for name, (read, _) in self._generators.items()
            if not _same(self._states[name], read())
        ]

    def drawn(self) -> bool:
        """Whether a generator advanced since."""
        return bool(self.advanced())

    def restore(self) -> None:
        """Set the generators back to their states when this was made: a check stepping
        copies draws nothing that the real steps or the rest of the loop (dropout masks,
        shuffling) would then miss."""
        for name, (_, write) in self._generators.items():
            write(self._states[name])
