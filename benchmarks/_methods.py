"""The methods compared: the same AdamW, stepped after backward or inside it.

* ``plain``: FSDP2 and ``torch.optim.AdamW(foreach=True)`` stepped after backward.
* ``per-param``: the PyTorch tutorial / torchtune / torchtitan pattern, reimplemented: one
  non-foreach AdamW per parameter, stepped from a post-accumulate-grad hook registered on each
  sharded DTensor parameter after ``fully_shard``, its gradient set to ``None`` after.
* ``ours``: ``fused_optim_dist.OptimizerInBackward(AdamW, fused=True)``: the fused kernel on
  each bucket's local shards (unset, the library runs the plain optimizer's own kernel, the
  per-tensor loop on the CPU: see [Note: the plain optimizer's own kernel]); the total
  gradient norm tracked for ``grad_norm()``, which ``plain`` does not compute.
* ``ours-update-only``: ``ours`` with ``track_grad_norm=False``: the same work as ``plain``.
* ``none``: forward and backward with no optimizer (gradients dropped): the baseline that the
  optimizer's own cost is measured against (``optimizer_cost.py``).
* ``plain+accum+clip`` / ``ours+accum+clip``: the global batch in ``micro_batches`` backward
  passes, gradients clipped to ``max_grad_norm`` (``clip_grad_norm_`` after backward for plain,
  ``max_grad_norm=`` in backward for ours).
* ``torchtune``: ``torchtune.modules.optim.OptimizerInBackward`` where torchtune is importable.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

from benchmarks._config import SweepConfig
from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.training import backward_micro_batches

__all__ = ["METHODS", "Method", "Runner"]

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Runner:
    """One method's model and optimizer; a training step is ``forward_backward`` then
    ``optimizer_step`` (timed apart, so the time each method spends after backward shows)."""

    def __init__(self, model: nn.Module, loss: LossFn, micro_batches: int) -> None:
        self.model = model
        self.loss = loss
        self.micro_batches = micro_batches

    def forward_backward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        between_micro_batches: Callable[[], None] | None = None,
    ) -> None:
        """Forward and backward over the batch, in ``micro_batches`` chunks, calling
        ``between_micro_batches`` after every backward but the last."""
        chunks = list(
            zip(inputs.chunk(self.micro_batches), targets.chunk(self.micro_batches), strict=True)
        )
        backward_micro_batches(
            self.optimizers()[0],
            lambda chunk: self.loss(self.model, *chunk),
            chunks,
            between=between_micro_batches,
        )

    def optimizer_step(self) -> None:
        """What the training loop does after backward."""

    def optimizers(self) -> list[Optimizer]:
        """The optimizers holding the state (for memory accounting); the first is the one the
        loop accumulates with (``accumulate_grads`` acts on an in-backward one only)."""
        raise NotImplementedError

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for optimizer in self.optimizers():
            for entry in optimizer.state.values():
                yield from (v for v in entry.values() if isinstance(v, torch.Tensor))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class _Plain(Runner):
    def __init__(self, model: nn.Module, loss: LossFn, config: SweepConfig, *, clip: bool):
        super().__init__(model, loss, config.micro_batches if clip else 1)
        self.optimizer = AdamW(_trainable(model), lr=config.lr, foreach=True)
        self.max_norm = config.max_grad_norm if clip else None

    def optimizer_step(self) -> None:
        if self.max_norm is not None:
            nn.utils.clip_grad_norm_(_trainable(self.model), self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizers(self) -> list[Optimizer]:
        return [self.optimizer]


class _PerParam(Runner):
    def __init__(self, model: nn.Module, loss: LossFn, config: SweepConfig) -> None:
        super().__init__(model, loss, 1)
        self.per_param = {p: AdamW([p], lr=config.lr, foreach=False) for p in _trainable(model)}

        def hook(param: torch.Tensor) -> None:
            self.per_param[param].step()
            self.per_param[param].zero_grad(set_to_none=True)

        for param in self.per_param:
            param.register_post_accumulate_grad_hook(hook)

    def optimizers(self) -> list[Optimizer]:
        return list(self.per_param.values())


class _Ours(Runner):
    def __init__(
        self,
        model: nn.Module,
        loss: LossFn,
        config: SweepConfig,
        *,
        clip: bool,
        track_grad_norm: bool = True,
    ) -> None:
        super().__init__(model, loss, config.micro_batches if clip else 1)
        self.optimizer = OptimizerInBackward(
            _trainable(model),
            AdamW,
            lr=config.lr,
            fused=True,
            max_grad_norm=config.max_grad_norm if clip else None,
            track_grad_norm=track_grad_norm,
        )

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def optimizers(self) -> list[Optimizer]:
        return [self.optimizer]


class _NoOptimizer(Runner):
    def __init__(self, model: nn.Module, loss: LossFn, config: SweepConfig) -> None:
        super().__init__(model, loss, 1)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *_: object) -> None:
        self.loss(self.model, inputs, targets).backward()

    def optimizer_step(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def optimizers(self) -> list[Optimizer]:
        return []


TORCHTUNE_MODULE = "torchtune.modules.optim"


def _torchtune_missing() -> str | None:
    try:
        importlib.import_module(TORCHTUNE_MODULE)
    except Exception as error:  # torchtune may fail on import against this torch, not only miss
        return f"{TORCHTUNE_MODULE} not importable ({type(error).__name__}: {error})"
    return None


class _Torchtune(Runner):
    def __init__(self, model: nn.Module, loss: LossFn, config: SweepConfig) -> None:
        super().__init__(model, loss, 1)
        cls = importlib.import_module(TORCHTUNE_MODULE).OptimizerInBackward
        self.optimizer = cls(_trainable(model), AdamW, lr=config.lr)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def optimizers(self) -> list[Optimizer]:
        return list(self.optimizer.per_param_optimizers.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """A way to train: builds a ``Runner`` on a sharded model."""

    name: str
    build: Callable[[nn.Module, LossFn, SweepConfig], Runner]
    accumulates: bool = False
    """Whether a step is ``SweepConfig.micro_batches`` backward passes."""
    missing: Callable[[], str | None] = lambda: None
    """Why the method cannot run here, or ``None``."""


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method(name="plain", build=lambda m, loss, c: _Plain(m, loss, c, clip=False)),
        Method(name="per-param", build=_PerParam),
        Method(name="ours", build=lambda m, loss, c: _Ours(m, loss, c, clip=False)),
        Method(
            name="ours-update-only",
            build=lambda m, loss, c: _Ours(m, loss, c, clip=False, track_grad_norm=False),
        ),
        Method(
            name="plain+accum+clip",
            accumulates=True,
            build=lambda m, loss, c: _Plain(m, loss, c, clip=True),
        ),
        Method(
            name="ours+accum+clip",
            accumulates=True,
            build=lambda m, loss, c: _Ours(m, loss, c, clip=True),
        ),
        Method(name="torchtune", build=_Torchtune, missing=_torchtune_missing),
        Method(name="none", build=_NoOptimizer),
    )
}
