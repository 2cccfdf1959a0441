"""The state entries a cache was derived from, compared by identity before it is reused.

[Note: checking state by identity]
A cache derived from an optimizer's ``state`` (the stepping engine's local views,
``CompactAdamW``'s kernel tables) is reused only while ``state`` maps each of its parameters
to the same entry object and every entry holds the same value objects in the same order:
``load_state_dict``, DCP's ``set_state_dict``, state created or converted, a value replaced,
added or removed, an entry dropped or written by hand all replace or change objects. The
values are compared one after the other and then an end marker, so that an entry that lost
its last values (or the last entry emptied) puts the marker where the cache holds a value.

Looking an entry up costs about 140 ns (``Tensor.__hash__`` is Python). Where ``state`` is at
most ``SNAPSHOT_SIZE`` times the cache's parameters, a snapshot of it (its keys and entries,
in order) is compared by identity instead, about 30 ns per entry; the entries are looked up
only when the snapshot differs, and snapshotted again if they are still the cache's. Every
check is a C-level ``map`` (a Python loop costs about 3 us per parameter).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch

__all__ = ["SNAPSHOT_SIZE", "StateEntries"]

SNAPSHOT_SIZE = 4
"""A ``state`` of at most this many times the cache's parameters is snapshotted: comparing a
larger one costs more than looking the cache's entries up."""

_END = object()
_MARKER = (_END,)


def _values(entries: Iterable[dict[str, Any] | None]) -> Iterable[Any]:
    """The values of ``entries`` (``None``: no entry), one after the other."""
    return chain.from_iterable(map(dict.values, filter(None, entries)))


class StateEntries:
    """``params``' entries in ``state`` (``None`` where one has none) and their values, as
    they are now. Holding them keeps the values alive (their addresses are not reused). See
    [Note: checking state by identity]."""

    __slots__ = ("_snapshot", "_values", "entries", "params")

    def __init__(self, params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, Any]) -> None:
        self.params = tuple(params)
        self.entries = list(map(state.get, self.params))
        self._values = [*_values(self.entries), _END]
        self._snapshot: tuple[int, list[Any], list[Any]] | None = None

    @property
    def values(self) -> list[Any]:
        """The entries' values, one after the other."""
        return self._values[:-1]

    def match(self, state: Mapping[torch.Tensor, Any]) -> bool:
        """Whether ``state`` maps ``params`` to the same entries holding the same values."""
        return self._same_entries(state) and all(
            map(operator.is_, chain(_values(self.entries), _MARKER), self._values)
        )

    def _same_entries(self, state: Mapping[torch.Tensor, Any]) -> bool:
        snapshot = self._snapshot
        if (
            snapshot is not None
            and snapshot[0] == id(state)
            and len(state) == len(snapshot[1])
            and all(map(operator.is_, state, snapshot[1]))
            and all(map(operator.is_, state.values(), snapshot[2]))
        ):
            return True
        if not all(map(operator.is_, map(state.get, self.params), self.entries)):
            return False
        if len(state) <= SNAPSHOT_SIZE * len(self.params):
            self._snapshot = (id(state), list(state), list(state.values()))
        return True
