"""The options of ``OptimizerInBackward`` itself, kept apart from the wrapped class's arguments."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

from torch.optim import Optimizer

__all__ = ["DEFAULT_BUCKET_NUMEL", "InBackwardOptions", "split_options"]

DEFAULT_BUCKET_NUMEL = 1 << 24
"""Elements per bucket for parameters outside FSDP units (64 MiB of fp32 gradients)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class InBackwardOptions:
    """How ``OptimizerInBackward`` steps and what it does to gradients first.

    Each field may also be passed to ``OptimizerInBackward`` as a keyword argument, next to the
    wrapped class's own. When the wrapped class takes an argument of the same name (timm's
    ``Lamb`` takes ``max_grad_norm``), the keyword is ambiguous and refused: pass these options
    as ``options=InBackwardOptions(...)``, and every keyword then goes to the wrapped class.
    """

    stepping: str | None = None
    """``"elementwise"``, ``"whole_tensor"``, ``"dtensor"``, ``"joint"`` (see
    ``fused_optim_dist.Stepping``) or ``None``: the way declared for the class
    (:func:`fused_optim_dist.declare_stepping`), else the default."""

    bucket_numel: int | None = None
    """Elements per bucket for parameters that no ``fully_shard`` manages. ``None``: one bucket
    for all of them when clipping by norm, so that their clipping is exact (their gradients are
    then held until the last one arrives, as a plain optimizer holds them), else
    ``DEFAULT_BUCKET_NUMEL``. A number is the choice of per-bucket clipping for them, see
    [Note: clipping inside one backward]."""

    max_grad_norm: float | None = None
    """Clip by norm in backward, see [Note: clipping inside one backward]; ``None``: off."""

    clip_alone: bool = False
    """With ``max_grad_norm``: clip by the norm of this optimizer's own gradients also in a
    backward that gives gradients to another ``OptimizerInBackward`` clipping by norm, as
    ``clip_grad_norm_`` called on each optimizer's parameters apart does. Without it on both,
    such a backward is refused: a plain loop's ``clip_grad_norm_(model.parameters(), ...)``
    clips all of them by their joint norm (hold them in one ``OptimizerInBackward`` for that;
    its param groups may name their classes). See [Note: clipping inside one backward]."""

    clip_grad_value: float | None = None
    """Clamp every gradient element to ``[-v, v]`` (``clip_grad_value_``); ``None``: off."""

    skip_nonfinite: bool = False
    """When a bucket's gradient holds inf/NaN on any rank, no rank updates that bucket."""

    track_grad_norm: bool = True
    """Compute the total norm that ``grad_norm()`` returns."""

    def __post_init__(self) -> None:
        if self.bucket_numel is not None and (
            isinstance(self.bucket_numel, bool)
            or not isinstance(self.bucket_numel, int)
            or self.bucket_numel < 1
        ):
            raise ValueError(
                f"bucket_numel must be a positive int or None, not {self.bucket_numel!r}"
            )
        for name in ("max_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number or None, not {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number or None, not {value!r}")
        if self.max_grad_norm is not None and self.clip_grad_value is not None:
            raise ValueError(
                "max_grad_norm and clip_grad_value were both given; choose one way to clip"
            )
        for name in ("clip_alone", "skip_nonfinite", "track_grad_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, not {getattr(self, name)!r}")

    @property
    def plain_bucket_numel(self) -> int | None:
        """``bucket_numel`` resolved: ``None`` means one bucket for every parameter outside
        FSDP units."""
        if self.bucket_numel is None:
            return None if self.max_grad_norm is not None else DEFAULT_BUCKET_NUMEL
        return self.bucket_numel


_OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(InBackwardOptions))


def _accepted_arguments(optimizer_cls: type[Optimizer]) -> set[str] | None:
    """Keyword names ``optimizer_cls.__init__`` takes, or ``None`` if it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(optimizer_cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def split_options(
    optimizer_cls: type[Optimizer], options: InBackwardOptions | None, kwargs: dict[str, Any]
) -> tuple[InBackwardOptions, dict[str, Any]]:
    """Split keyword arguments into our options and the wrapped class's arguments.

    Raises ``TypeError`` for a keyword that both we and ``optimizer_cls`` take (it would be
    captured silently otherwise), and for options given both ways.
    """
    if options is not None:
        if not isinstance(options, InBackwardOptions):
            raise TypeError(f"options must be an InBackwardOptions, not {type(options).__name__}")
        return options, kwargs
    ours = {name: kwargs[name] for name in _OPTION_NAMES & kwargs.keys()}
    accepted = _accepted_arguments(optimizer_cls) or set()
    ambiguous = sorted(ours.keys() & accepted)
    if ambiguous:
        raise TypeError(
            f"{', '.join(ambiguous)}: both an option of OptimizerInBackward and an argument of "
            f"{optimizer_cls.__name__}. Pass OptimizerInBackward's as "
            f"options=InBackwardOptions({ambiguous[0]}=...); every keyword argument then goes "
            f"to {optimizer_cls.__name__}"
        )
    rest = {name: value for name, value in kwargs.items() if name not in ours}
    return InBackwardOptions(**ours), rest
