"""Memory that two parameters share, as parameters or in their optimizer state: refused.

[Note: parameters sharing memory]
Two parameters can be two tensors over the same memory: experts "upcycled" from one dense
weight without ``.clone()`` (``nn.Parameter(w)`` for each), or weights tied through ``.data``
(``a.weight.data = b.weight.data``). The plain ``step()`` applies both in-place updates to that
memory one after the other, in parameter order. Here each is applied when its bucket is
stepped, in backward order, and the rest of the backward reads the memory already updated
(a ``.data`` tie shares no version counter, so autograd cannot tell). AdamW's decoupled decay
multiplies the memory, so the order alone changes the result: 3.0e-2 apart after three AdamW
steps with three buckets, 2.0e-2 after six for a ``.data`` tie with ``bucket_numel=1``, no error.

Stepping two trainable ones in one bucket, once both gradients arrived, in parameter order,
would restore the order; but it would bend the plan (a bucket per shared memory, across
``bucket_numel`` runs, FSDP2 units and param groups), and still leave a frozen parameter over
the same memory read by the backward after the update, for models that are almost always
wrong in the plain loop too: experts upcycled without a clone stay one expert, updated twice
per step. So the plan refuses them when it is built, before anything moves, and says what to
do: ``.clone()`` the tensors to train them apart, or tie them as one ``nn.Parameter`` (listed
once, stepped once: how torch and Hugging Face tie weights). The storages of plain parameters
are part of the plan's signature, so a tie made after the optimizer was built is refused at
the next backward or ``step()``, before it moves anything. A pair is refused where one of them
is trainable (frozen parameters are never stepped) and their bytes overlap: views of one flat
buffer that do not overlap (rows, or interleaved columns, of one matrix) train as plain and are
accepted. A DTensor is compared by its local tensor: FSDP2 gives every sharded parameter its
own storage, so its parameters never share; tensor-parallel ones distributed from one tensor
may (a ``.data`` tie made later between DTensors is not watched).

[Note: a module's tensor over a trained parameter's memory]
A frozen copy of a weight made through ``.data`` (``nn.Parameter(w.data, requires_grad=False)``,
``register_buffer("reference", w.data)``, or a view of it) and left out of the optimizer (built,
as usual, on the parameters that require grad) shares the trained parameter's memory. The plain
loop's backward reads it before ``step()`` updates that memory; here the parameter's bucket may
be stepped before a node reading the copy has run, which then reads the updated values (2.1e-2
apart after four AdamW steps with ``bucket_numel=1``, no error). ``.data`` shares no version
counter, so autograd cannot refuse the read. No public API says which tensors a forward reads,
but every tensor registered on a module as a parameter or a buffer is seen by torch's global
registration hooks (``torch.nn.modules.module.register_module_parameter_registration_hook`` and
its buffer twin), installed when this module is imported, that is with the library, before a
model is usually built: each slot is noted (its module weakly, never the tensor: see
``_REGISTERED``), and a plan refuses a tensor a noted slot holds, not one of its own, that
shares a byte with one of its trainable plain parameters, when it is built and, if tensors
were registered since, at the next backward or ``step()`` (a count compared there), before
anything moves. Not seen: a tensor registered before this library was imported, or taken
out of its module since, one kept as a plain attribute or a local of the forward
(docs/differences.md), and a registered tensor given the memory through ``.data =`` after the
plan checked it. Parameters in FSDP2 units are not compared (their forward reads unsharded
copies, never the shards the update writes); other DTensors (tensor parallel) are, by their
local tensors.

[Note: state shared between parameters]
A state dict converted by hand can hold one tensor in several parameters' entries (a single
``step = torch.tensor(100.)`` for all of them). The plain step advances such a counter once per
parameter, each parameter seeing the count reached so far in parameter order; here each bucket
sees the count the buckets stepped before it left, in backward order (1.3e-3 apart four AdamW
steps after such a load, no error). Refused for the classes that keep all their state in
``state[p]`` and update each of its tensors once per parameter (torch.optim's, this library's:
``keeps_state_per_parameter``): where it is loaded, before anything is loaded; and, put into
two entries by hand between steps, when the views of a bucket holding one of them are
derived, before that bucket moves: the first bucket stepped in the next backward whose entries
were written refuses it, whichever bucket holds the other entry (4.3e-3 apart four AdamW steps
after one ``step`` tensor was put into every entry with ``bucket_numel=1``, no error, while
only the entries of one bucket were compared). A bucket stepped before it whose entries were
not written (the one a tensor was taken from) is not looked at again, and has moved: the check
is made only when a bucket's views are derived (its state changed, or another set of its
parameters is stepped), not at every step, where it would cost as much as the step's own
check of its views. It looks the identities of every value of the state up among the
bucket's at C level (about 0.1 us per value on a 2-core VM: 0.3 ms for 1,000 AdamW entries),
and makes a Python pass naming the two parameters only where one of the bucket's tensors is
found twice. Another class may
share a tensor on purpose (a counter kept on the instance and put in every entry, which [Note:
group and instance state] steps as plain): its buckets are not checked, and a tensor shared
among its entries alone is no reason to refuse another class's bucket. The whole-tensor
classes (torch's Muon and Adafactor, ``_whole_tensor.py``) derive no views: their buckets'
entries are compared by identity with those of their last check (``SharedStateCheck``), and
checked so when they changed (2.0e-2 and 1.8e-3 apart four steps after a Muon momentum or an
Adafactor row variance was put into a second entry with ``bucket_numel=1``, no error, before;
on FSDP2 they are checked at the first two steps, where the state is created, and compared by
identity after, measured).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from fused_optim_dist._state_identity import StateEntries
from fused_optim_dist._torch_internals import holds_values, local_tensor, storages

__all__ = [
    "SharedStateCheck",
    "SharedStateError",
    "refuse_registered_overlap",
    "refuse_shared_memory",
    "refuse_shared_state",
    "registrations",
]


class SharedStateError(ValueError):
    """One tensor in the state of two parameters. Raised before any of them moved, so a bucket
    refused so in backward records no update awaiting ``step()``."""


def _bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The first and one past the last byte of its storage that ``tensor`` can reach;
    ``None`` for an empty tensor."""
    if tensor.numel() == 0:
        return None
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    reach = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (reach + 1) * size


def _byte_view(mask: torch.Tensor, tensor: torch.Tensor, origin: int) -> torch.Tensor:
    """The bytes of ``tensor`` as a view of ``mask``, a byte map of its storage from byte
    ``origin`` on."""
    size = tensor.element_size()
    return mask.as_strided(
        (*tensor.shape, size),
        (*(s * size for s in tensor.stride()), 1),
        tensor.storage_offset() * size - origin,
    )


def _share_a_byte(a: torch.Tensor, b: torch.Tensor, a_bytes: tuple, b_bytes: tuple) -> bool:
    """Whether ``a`` and ``b``, of one storage and with overlapping byte ranges, share a byte:
    strided views can interleave in one range without sharing any (columns of one matrix).
    Two contiguous tensors fill their ranges, so they do, without a byte map of the span (the
    usual case: a whole weight's size)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    origin = min(a_bytes[0], b_bytes[0])
    mask = torch.zeros(max(a_bytes[1], b_bytes[1]) - origin, dtype=torch.bool)
    _byte_view(mask, a, origin).fill_(True)
    return bool(_byte_view(mask, b, origin).any())


def _overlapping_pair(
    params: Sequence[torch.Tensor], trainable: Sequence[bool]
) -> tuple[int, int] | None:
    """The positions of two of ``params`` whose memory overlaps, one of them trainable (the
    first such pair); ``None`` if there is none. See [Note: parameters sharing memory].

    Costs a storage lookup per parameter; bytes are compared only within a shared storage."""
    tensors = list(map(local_tensor, params))
    held = storages(params)  # a tensor without storage stands for itself: shares nothing
    counts = Counter(map(id, held))
    if all(count == 1 for count in counts.values()):
        return None
    by_storage: dict[int, list[tuple[tuple[int, int], int, torch.Tensor]]] = {}
    for position, (tensor, storage) in enumerate(zip(tensors, held, strict=True)):
        span = _bytes(tensor) if counts[id(storage)] > 1 else None
        if span is not None:
            by_storage.setdefault(id(storage), []).append((span, position, tensor))
    for spans in by_storage.values():
        spans.sort(key=itemgetter(0))
        for i, (a_bytes, a_pos, a) in enumerate(spans):
            for b_bytes, b_pos, b in spans[i + 1 :]:
                if b_bytes[0] >= a_bytes[1]:
                    break  # sorted by start: no later one reaches into a's range
                if (trainable[a_pos] or trainable[b_pos]) and _share_a_byte(a, b, a_bytes, b_bytes):
                    return min(a_pos, b_pos), max(a_pos, b_pos)
    return None


def refuse_shared_memory(
    param_groups: Sequence[dict[str, Any]], params: Sequence[torch.Tensor], trainable: list[bool]
) -> None:
    """Raise if two of ``params`` (the groups' parameters, in order) share memory, one of them
    trainable. See [Note: parameters sharing memory].

    Raises:
        ValueError: naming the two parameters.
    """
    pair = _overlapping_pair(params, trainable)
    if pair is None:
        return
    names = [_param_name(param_groups, k) for k in pair]
    raise ValueError(
        f"{names[0]} and {names[1]} share memory (one weight given to two nn.Parameters, e.g. "
        "experts copied from one weight without .clone(), or a weight tied through .data). The "
        "plain step() updates that memory once per parameter, in parameter order; "
        "OptimizerInBackward updates each in backward, in backward order, and the backward "
        "reads the memory in between, so the result would differ. Clone the tensors to train "
        "them apart, or tie them as one nn.Parameter (module.weight = other.weight)."
    )


def _param_name(param_groups: Sequence[dict[str, Any]], k: int) -> str:
    """The ``k``-th parameter of ``param_groups`` (counted over the groups in order), named for
    an error: by its name where the groups have them, else by its place; with its shape."""
    for index, group in enumerate(param_groups):
        if k < len(group["params"]):
            name = group["param_names"][k] if "param_names" in group else None
            where = f"{name!r}" if name else f"parameter {k} of param group {index}"
            return f"{where} (shape {tuple(group['params'][k].shape)})"
        k -= len(group["params"])
    raise IndexError(k)


_REGISTERED: dict[tuple[int, str, str], weakref.ref[nn.Module]] = {}
"""Each slot of a module a tensor was registered in since this module was imported, by the
module's id, the name and the kind (``"parameter"`` or ``"buffer"``): the module, weakly. The
tensor is read from the slot when checked, never referenced here: a weak reference to a
parameter would make ``torch.utils.swap_tensors`` refuse it, and with it ``Module.to()`` of
DTensor parameters and every conversion under
``torch.__future__.set_swap_module_params_on_conversion(True)``. See [Note: a module's tensor
over a trained parameter's memory]."""
_COUNT = [0]
"""Registrations noted so far."""


def _noter(kind: str) -> Callable[[nn.Module, str, object], None]:
    def note(module: nn.Module, name: str, tensor: object) -> None:
        if isinstance(tensor, torch.Tensor):
            key = (id(module), name, kind)
            if key not in _REGISTERED:
                # Dropped with the module: the callback, given the dead reference, calls
                # _REGISTERED.pop(key, reference), before its id can be given again.
                forget = functools.partial(_REGISTERED.pop, key)
                _REGISTERED[key] = weakref.ref(module, forget)
            _COUNT[0] += 1

    return note


register_module_parameter_registration_hook(_noter("parameter"))
register_module_buffer_registration_hook(_noter("buffer"))


def _registered(module: nn.Module, name: str, kind: str) -> torch.Tensor | None:
    """The tensor ``module`` holds in the slot, if still registered there."""
    slots = module._parameters if kind == "parameter" else module._buffers
    tensor = slots.get(name)
    return tensor if isinstance(tensor, torch.Tensor) else None


def _address(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Where ``tensor``'s storage is: two live storages of a device never share an address."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def registrations() -> int:
    """How many tensors have been registered on modules so far (a count that only grows)."""
    return _COUNT[0]


def refuse_registered_overlap(
    param_groups: Sequence[dict[str, Any]], params: Sequence[torch.Tensor], checked: list[bool]
) -> None:
    """Raise if a tensor registered on a module, not one of ``params`` (the groups' parameters,
    in order), shares a byte with one of them that ``checked`` marks (the trainable ones a
    forward reads directly: outside FSDP2 units). DTensors are compared by their local tensors.
    See [Note: a module's tensor over a trained parameter's memory].

    Costs a storage lookup per registered tensor, and nothing while no parameter is marked
    (every trainable one in an FSDP2 unit).

    Raises:
        ValueError: naming the registered tensor, its module and the parameter.
    """
    by_storage: dict[tuple[torch.device, int], list[int]] = {}  # by device and address
    for k, (param, flag) in enumerate(zip(params, checked, strict=True)):
        local = local_tensor(param)
        if flag and holds_values(local) and local.numel():
            by_storage.setdefault(_address(local), []).append(k)
    if not by_storage:
        return
    mine = set(map(id, params))
    # A copy made in C: a tensor collected while a Python loop built one would change the dict.
    for (_, name, kind), module_ref in _REGISTERED.copy().items():
        module = module_ref()
        registered = None if module is None else _registered(module, name, kind)
        if registered is None or id(registered) in mine:
            continue
        tensor = local_tensor(registered)
        if not holds_values(tensor) or not tensor.numel():
            continue
        for k in by_storage.get(_address(tensor), ()):
            param = local_tensor(params[k])
            spans = _bytes(tensor), _bytes(param)
            if spans[0][0] >= spans[1][1] or spans[1][0] >= spans[0][1]:
                continue
            if not _share_a_byte(tensor, param, *spans):
                continue
            raise ValueError(
                f"{kind} {name!r} of {type(module).__name__} (shape "
                f"{tuple(registered.shape)}) shares memory with "
                f"{_param_name(param_groups, k)}, which this optimizer trains, and is not in "
                "the optimizer itself (a copy made through .data, or a view of it). The plain "
                "loop's backward reads it before step() updates that memory; "
                "OptimizerInBackward updates the parameter in backward, and a node run after "
                "that would read the updated values (.data shares no version counter: autograd "
                "cannot tell), so the result would differ. Keep a frozen copy with .clone(), or "
                "read the parameter itself in the forward (.detach() there, which autograd "
                "checks)."
            )


def refuse_shared_state(
    entries: Iterable[tuple[Any, Any]],
    name: Callable[[Any], str],
    state: dict[Any, Any] | None = None,
) -> None:
    """Raise if one tensor is held in two of ``entries`` (pairs of a parameter, or its key in a
    state dict, and its state entry; ``name`` names one), or, given the whole ``state`` the
    entries belong to, if a tensor of ``entries`` is also held in the entry of a parameter of
    ``state`` outside them. See [Note: state shared between parameters].

    C-level passes over the values when no object repeats (the usual case: about 0.1 us per
    value); a Python pass only when one does (a repeated number or ``None`` is no tensor).

    Raises:
        SharedStateError: naming the two parameters and the state keys.
    """
    held = [(key, entry) for key, entry in entries if isinstance(entry, dict)]
    values = list(chain.from_iterable(map(dict.values, map(itemgetter(1), held))))
    if state is None:
        if len(set(map(id, values))) == len(values):
            return
        holders: Iterable[tuple[Any, Any]] = held
    else:
        # The entries are the state's: each of their tensors is found there at least once, so
        # as many hits as tensors means each is found once.
        mine = {id(v) for v in values if isinstance(v, torch.Tensor)}
        every = map(id, chain.from_iterable(map(dict.values, state.values())))
        if sum(map(mine.__contains__, every)) == len(mine):
            return
        holders = chain(held, state.items())
    _refuse_repeated(holders, {id(v) for v in values if isinstance(v, torch.Tensor)}, name)


def _refuse_repeated(
    holders: Iterable[tuple[Any, Any]], ids: set[int], name: Callable[[Any], str]
) -> None:
    """Raise for the first tensor among ``ids`` found in the entries of two parameters of
    ``holders`` (pairs of a parameter and its entry; a parameter may come twice)."""
    holder: dict[int, tuple[Any, str]] = {}
    for param, entry in holders:
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or id(value) not in ids:
                continue
            first, first_key = holder.setdefault(id(value), (param, key))
            if first is not param:
                raise SharedStateError(
                    f"the optimizer state of {name(first)} and of {name(param)} holds one "
                    f"tensor (under {first_key!r} and {key!r}). The plain step() updates it once "
                    "per parameter, in parameter order; OptimizerInBackward steps parameters "
                    "in backward order, so the result would differ. Give each parameter its "
                    "own tensor (.clone() it in each entry of the state dict before loading)."
                )


class SharedStateCheck:
    """:func:`refuse_shared_state` for a stepper that derives no views of the state (the
    whole-tensor one, ``_whole_tensor.py``): made for a set of parameters stepped together when
    its entries changed since its last check ([Note: checking state by identity]), so that a
    step whose state is as it was costs a comparison of identities. See [Note: state shared
    between parameters]."""

    MAX_SETS = 64
    """Sets of parameters remembered; past it, all are forgotten (each is checked again)."""

    def __init__(self) -> None:
        self._checked: dict[tuple[int, ...], StateEntries] = {}

    def __call__(
        self, params: Sequence[torch.Tensor], state: dict[Any, Any], name: Callable[[Any], str]
    ) -> None:
        # The ids are those of the parameters the kept entries hold alive: never recycled.
        key = tuple(map(id, params))
        checked = self._checked.get(key)
        if checked is not None and checked.match(state):
            return
        refuse_shared_state([(p, state.get(p)) for p in params], name, state)
        if len(self._checked) >= self.MAX_SETS:
            self._checked.clear()
        self._checked[key] = StateEntries(params, state)
