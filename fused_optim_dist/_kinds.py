"""How the wrapped optimizer's step is run on sharded parameters, per optimizer class.

* ``ELEMENTWISE``: the update of every element depends on that element alone (its parameter,
  gradient and state), so each rank steps its local shards as plain tensors. Exact for such
  optimizers, and the fastest path: no DTensor dispatch, one ``foreach``/``fused`` call per bucket.
* ``WHOLE_TENSOR``: the update of a parameter needs that whole parameter (and only it): Muon's
  orthogonalization, Adafactor's factored moments, LAMB's trust ratio. Each parameter's update
  runs on one owner rank, on the full tensors, with the class's own step; every rank gets its
  shards of the result. Exact: the owner computes what the class computes in one process (see
  [Note: whole-tensor stepping]).
* ``DTENSOR``: the step runs on the DTensor parameters, bucket by bucket, and DTensor makes
  every reduction within a parameter global. Exact wherever DTensor supports the optimizer's
  ops and the update of a parameter does not depend on the others' (slow).
* ``JOINT``: the step runs once per backward, at its end, on the DTensor parameters of every
  bucket together, as the plain optimizer's one ``step()`` call: exact for any class DTensor
  supports, whatever it computes across its parameters (timm's and apex's LAMB clip by the norm
  of all their gradients inside ``step()``), with the gradients held until then as a plain
  optimizer holds them. The default for any class not declared otherwise: nothing tells what
  an unknown ``step()`` reduces over. See [Note: classes stepped jointly].

A class is declared once, where it is defined, and the declaration holds for that class only
(not its subclasses, which may change the update)::

    @fused_optim_dist.declare_stepping("elementwise")
    class MyAdamW(torch.optim.AdamW): ...
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch
from torch.optim import Optimizer

from fused_optim_dist._first_step_state import first_step_state_check

__all__ = [
    "Stepping",
    "cache_attributes",
    "checks_groups",
    "declare_stepping",
    "group_check",
    "instance_caches",
    "keeps_state_per_parameter",
    "per_parameter_state",
    "stepping_of",
]


class Stepping(str, enum.Enum):
    ELEMENTWISE = "elementwise"
    WHOLE_TENSOR = "whole_tensor"
    DTENSOR = "dtensor"
    JOINT = "joint"


_KNOWN: dict[type[Optimizer], Stepping] = {
    **{
        cls: Stepping.ELEMENTWISE
        for cls in (
            torch.optim.SGD,
            torch.optim.Adam,
            torch.optim.AdamW,
            torch.optim.Adamax,
            torch.optim.NAdam,
            torch.optim.RAdam,
            torch.optim.Adagrad,
            torch.optim.RMSprop,
            torch.optim.Adadelta,
            torch.optim.ASGD,
            torch.optim.Rprop,
        )
    },
    torch.optim.Muon: Stepping.WHOLE_TENSOR,
    torch.optim.Adafactor: Stepping.WHOLE_TENSOR,
}
"""torch.optim classes whose update is elementwise, or needs each whole parameter."""


_PER_PARAMETER_STATE: WeakKeyDictionary[type, bool] = WeakKeyDictionary()


def per_parameter_state(cls: _Cls) -> _Cls:
    """Class decorator for this library's own optimizers: ``cls`` keeps all its state in
    ``state[p]``, never in its param groups or on itself, so its group and instance state need
    no tracking (see [Note: group and instance state])."""
    _PER_PARAMETER_STATE[cls] = True
    return cls


_CACHES: WeakKeyDictionary[type, frozenset[str]] = WeakKeyDictionary()


def instance_caches(*names: str) -> Callable[[_Cls], _Cls]:
    """Class decorator for this library's own optimizers: the instance attributes ``names`` are
    caches (remade whenever they no longer match the parameters and state), not state, so a
    subclass's own instance state is tracked without them (see [Note: group and instance
    state] in ``_class_state.py``)."""

    def mark(cls: _Cls) -> _Cls:
        _CACHES[cls] = frozenset(names)
        return cls

    return mark


def cache_attributes(optimizer_cls: type[Optimizer]) -> frozenset[str]:
    """The instance attributes of ``optimizer_cls`` and its bases marked
    :func:`instance_caches`."""
    return frozenset().union(*(_CACHES.get(cls, ()) for cls in optimizer_cls.__mro__))


def keeps_state_per_parameter(optimizer_cls: type[Optimizer]) -> bool:
    """Whether ``optimizer_cls`` is exactly one of torch.optim's classes listed above or a class
    marked :func:`per_parameter_state`, which keep all their state in ``state[p]`` (not a
    subclass, which may keep more)."""
    return optimizer_cls in _KNOWN or optimizer_cls in _PER_PARAMETER_STATE


_GROUP_CHECKS: WeakKeyDictionary[type, str] = WeakKeyDictionary()


def checks_groups(method: str) -> Callable[[_Cls], _Cls]:
    """Class decorator for this library's own optimizers: ``optimizer.<method>(groups,
    state)``, with pairs of a param group's index and the group, raises for a group the class
    cannot step as it is now (an option set on it since, or one its state was not written
    with). ``OptimizerInBackward`` calls it with all the class's groups when a backward (or
    ``step()``) starts stepping, before anything moves: stepped bucket by bucket, the class's
    own ``step`` sees one bucket's groups at a time, after other buckets moved."""

    def mark(cls: _Cls) -> _Cls:
        _GROUP_CHECKS[cls] = method
        return cls

    return mark


def group_check(optimizer: Optimizer) -> Callable[..., None] | None:
    """``optimizer``'s group check (see :func:`checks_groups`; its class's or a base's), or,
    for a class of torch.optim's, of the state entries its step reads only where an option
    asks for them (see [Note: options turned on after the first step] in
    ``_first_step_state.py``), if any."""
    for cls in type(optimizer).__mro__:
        method = _GROUP_CHECKS.get(cls)
        if method is not None:
            return getattr(optimizer, method)
    return first_step_state_check(optimizer)


_DECLARED: WeakKeyDictionary[type, Stepping] = WeakKeyDictionary()

_Cls = TypeVar("_Cls", bound=type[Optimizer])


def _parse(kind: str | Stepping) -> Stepping:
    try:
        return Stepping(kind)
    except ValueError:
        choices = ", ".join(repr(k.value) for k in Stepping)
        raise ValueError(f"stepping must be one of {choices}, not {kind!r}") from None


def declare_stepping(kind: str | Stepping) -> Callable[[_Cls], _Cls]:
    """Class decorator: step ``cls`` in backward the way ``kind`` says (see the module doc).

    Declare ``"elementwise"`` only if the update truly is elementwise: a norm of the whole
    parameter taken on a local shard is silently wrong; and ``"dtensor"`` only if the update of
    a parameter does not depend on the others' (no norm over all gradients inside ``step()``).
    """
    stepping = _parse(kind)

    def declare(cls: _Cls) -> _Cls:
        if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
            raise TypeError(f"declare_stepping applies to Optimizer subclasses, not {cls!r}")
        _DECLARED[cls] = stepping
        return cls

    return declare


def stepping_of(optimizer_cls: type[Optimizer], override: str | Stepping | None) -> Stepping:
    """The stepping of ``optimizer_cls``: ``override`` if given, else declared, else default.

    Raises ``ValueError`` for ``"elementwise"`` asked of a torch.optim class that needs each
    whole parameter (Muon, Adafactor): each rank would step its shards apart, a different
    update with no error. (A class of the user's declared so is checked before its first
    update: [Note: rows stepped apart] in ``_class_state.py``.)"""
    if override is not None:
        stepping = _parse(override)
        if stepping is Stepping.ELEMENTWISE and _KNOWN.get(optimizer_cls) is Stepping.WHOLE_TENSOR:
            raise ValueError(
                f"{optimizer_cls.__name__} needs each whole parameter (its update reads all of "
                "it), so stepping='elementwise' would step each rank's shards apart and train "
                "differently from the plain optimizer with no error; leave stepping unset (each "
                "parameter is stepped whole on an owner rank)"
            )
        return stepping
    declared = _DECLARED.get(optimizer_cls)
    if declared is not None:
        return declared
    return _KNOWN.get(optimizer_cls, Stepping.JOINT)
