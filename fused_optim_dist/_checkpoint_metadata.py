"""What a checkpoint records about the model and optimizer, and the check before a load.

A description is a JSON-able dict: the format version, the wrapped optimizer class, every tensor
of the model state dict (name, global shape, dtype) and the parameter names of each param group.
``load`` describes the live model and optimizer the same way and compares the two before it
changes anything, so that a mismatch is reported by name rather than as a failure halfway
through DCP's load. The optimizer's state (which entries each parameter has, their shapes and
dtypes) is compared separately, against DCP's own ``.metadata``: see :func:`state_mismatches`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from fused_optim_dist.optimizer import OptimizerInBackward

__all__ = [
    "FORMAT_VERSION",
    "describe",
    "mismatches",
    "optimizer_class",
    "param_names",
    "saved_state_specs",
    "state_mismatches",
    "state_specs",
    "tensor_mismatches",
    "tensor_specs",
]

FORMAT_VERSION = 2
"""Bumped when the layout or the description changes incompatibly. 2: file checksums."""
OPTIMIZER_STATE_PREFIX = "optimizer.state."
"""DCP's flat key of ``state_dict["optimizer"]["state"][fqn][key]`` is this + ``fqn.key``."""

# Module wrappers whose attribute name DCP drops from parameter names: activation checkpointing
# (checkpoint_wrapper) and torch.compile (OptimizedModule). fully_shard adds none.
_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_class(optim: Optimizer) -> type[Optimizer]:
    """The class whose update ``optim`` runs: the wrapped one for ``OptimizerInBackward``."""
    return optim.optimizer_cls if isinstance(optim, OptimizerInBackward) else type(optim)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Name -> global shape and dtype of each tensor in a model state dict (DTensors included)."""
    return {
        name: {"shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
    }


def _value_spec(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
    return {"shape": None, "dtype": "a Python object"}


def state_specs(optim_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``fqn.key`` -> global shape and dtype of each entry of an optimizer state dict, as
    ``get_state_dict`` returns it (non-tensor entries have shape ``None``)."""
    return {
        f"{fqn}.{key}": _value_spec(value)
        for fqn, entries in optim_state["state"].items()
        for key, value in entries.items()
    }


def saved_state_specs(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """The same as :func:`state_specs`, for the optimizer state a DCP checkpoint holds."""
    specs = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(OPTIMIZER_STATE_PREFIX):
            continue
        name = key.removeprefix(OPTIMIZER_STATE_PREFIX)
        if isinstance(item, TensorStorageMetadata):
            specs[name] = {"shape": list(item.size), "dtype": _dtype_name(item.properties.dtype)}
        else:
            specs[name] = {"shape": None, "dtype": "a Python object"}
    return specs


def _describe_spec(spec: dict[str, Any]) -> str:
    if spec["shape"] is None:
        return spec["dtype"]
    return f"{spec['dtype']} {tuple(spec['shape'])}"


def state_mismatches(
    saved: dict[str, dict], current: dict[str, dict], frozen: Collection[str] = ()
) -> list[str]:
    """Differences between the optimizer state a checkpoint holds and the state the optimizer
    in use has (or gets on its first step), one line per entry, naming it.

    DCP loads the entries the optimizer has and silently ignores the others, converting dtypes
    on the way: an ``AdamW`` checkpoint loaded into ``AdamW(amsgrad=True)`` would fail halfway
    (no ``max_exp_avg_sq``), the reverse would leave ``amsgrad=True`` in the groups and no state
    for it. The state of a parameter ``frozen`` now (by name), saved because it trained before
    it was frozen, is left in the checkpoint, as DCP's own load leaves it: a frozen parameter
    gets no state from the optimizer, and needs none.
    """
    problems = [
        f"optimizer state {name!r} is in the optimizer but not in the checkpoint"
        for name in current.keys() - saved.keys()
    ]
    problems += [
        f"optimizer state {name!r} is in the checkpoint but not in the optimizer"
        for name in saved.keys() - current.keys()
        if name.rsplit(".", 1)[0] not in frozen
    ]
    for name in current.keys() & saved.keys():
        if current[name] != saved[name]:
            problems.append(
                f"optimizer state {name!r} is {_describe_spec(current[name])} in the optimizer "
                f"but {_describe_spec(saved[name])} in the checkpoint"
            )
    return sorted(problems)


def param_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name in checkpoints (its FQN without wrapper modules' names), by id."""
    names = {}
    for name, param in model.named_parameters():
        names[id(param)] = ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)
    return names


def _param_groups(model: nn.Module, optim: Optimizer) -> list[dict[str, list[str]]]:
    names = param_names(model)
    groups = []
    for index, group in enumerate(optim.param_groups):
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"param group {index} of the optimizer holds a parameter of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model; build the "
                    "optimizer from model.parameters() after fully_shard()"
                )
        groups.append(
            {
                "params": [names[id(p)] for p in group["params"]],
                "frozen": [names[id(p)] for p in group["params"] if not p.requires_grad],
            }
        )
    return groups


def describe(model_state: dict[str, Any], model: nn.Module, optim: Optimizer) -> dict[str, Any]:
    """Describe ``model`` (through its DCP state dict ``model_state``) and ``optim``.

    Raises:
        ValueError: if the optimizer holds a parameter that is not the model's.
    """
    return {
        "format_version": FORMAT_VERSION,
        "optimizer": _class_path(optimizer_class(optim)),
        "in_backward": isinstance(optim, OptimizerInBackward),
        "tensors": tensor_specs(model_state),
        "param_groups": _param_groups(model, optim),
    }


def tensor_mismatches(
    saved: dict[str, dict], current: dict[str, dict], where: str = "the checkpoint"
) -> list[str]:
    """Differences between two ``tensor_specs``, one line per tensor, naming it; ``where``
    names the saved side in the messages.
    """
    problems = [
        f"{name!r} is in the model but not in {where}" for name in current.keys() - saved.keys()
    ]
    problems += [
        f"{name!r} is in {where} but not in the model" for name in saved.keys() - current.keys()
    ]
    for name in current.keys() & saved.keys():
        for field in ("shape", "dtype"):
            now, then = current[name][field], saved[name][field]
            if now != then:
                if field == "shape":
                    now, then = tuple(now), tuple(then)
                problems.append(f"{name!r} has {field} {now} in the model but {then} in {where}")
    return sorted(problems)


def _group_mismatches(saved: list[dict], current: list[dict], names: set[str]) -> list[str]:
    """Differences in the param groups, for the tensors in ``names`` (those both sides have)."""
    if len(saved) != len(current):
        return [
            f"the checkpoint has {len(saved)} param group(s) but the optimizer has {len(current)}"
        ]
    saved_group = {n: i for i, g in enumerate(saved) for n in g["params"]}
    current_group = {n: i for i, g in enumerate(current) for n in g["params"]}
    problems = []
    for name in sorted(names):
        where_saved, where_now = saved_group.get(name), current_group.get(name)
        if where_saved == where_now:
            continue
        saved_text = "not optimized" if where_saved is None else f"in param group {where_saved}"
        now_text = "not optimized" if where_now is None else f"in param group {where_now}"
        problems.append(
            f"{name!r} is {now_text} by the optimizer but was {saved_text} in the checkpoint"
        )
    saved_frozen = {n for g in saved for n in g["frozen"]}
    current_frozen = {n for g in current for n in g["frozen"]}
    for name in sorted(names & current_group.keys() - current_frozen):
        if name in saved_frozen:
            problems.append(
                f"{name!r} requires grad but was frozen when the checkpoint was written: load "
                "it with the parameters frozen as they were then, and unfreeze them after"
            )
    return problems


def mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Why the checkpoint described by ``saved`` cannot be loaded into ``current``'s model and
    optimizer, one line per problem; empty when it can.
    """
    version = saved.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        return [
            f"the checkpoint has format version {version!r}; this release reads versions up to "
            f"{FORMAT_VERSION}: upgrade fused_optim_dist"
        ]
    problems = []
    if saved["optimizer"] != current["optimizer"]:
        problems.append(
            f"the checkpoint holds {saved['optimizer']} state but the optimizer in use runs "
            f"{current['optimizer']}"
        )
    problems += tensor_mismatches(saved["tensors"], current["tensors"])
    names = saved["tensors"].keys() & current["tensors"].keys()
    problems += _group_mismatches(saved["param_groups"], current["param_groups"], names)
    return problems
