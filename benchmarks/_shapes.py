"""Model shapes the sweep trains: what bounds their step time, and their batches.

* ``many-small``: many small parameters in few FSDP units. The step time is bound by the
  per-tensor cost of the optimizer (and of DTensor dispatch), not by arithmetic.
* ``many-tiny``: 8 units of 48 tensors of at most 64 elements: the optimizer's per-tensor cost is
  nearly the whole step (``optimizer_cost.py``).
* ``few-large``: few large matrices; the step time is bound by the matmuls.
* ``llama-*``: the Llama-style decoder of ``fused_optim_dist_recipes.models`` (one unit per block),
  with activation checkpointing as memory-bound fine-tuning recipes use it.

Every shape has a reduced ``--quick`` variant of the same structure (``QUICK_SHAPES``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fused_optim_dist_recipes.models import PRESETS, Llama

__all__ = ["QUICK_SHAPES", "SHAPES", "Shape", "get_shape"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """A model to build, how to feed it, and what bounds its step time."""

    name: str
    """Key on the command line and in the results."""
    bound: str
    """What bounds the step time: ``optimizer overhead``, ``compute`` or ``llama``."""
    build: Callable[[], nn.Module]
    """Builds the unsharded model (with a ``layers`` ModuleList) from the global RNG."""
    make_batch: Callable[[torch.Generator, int], Batch]
    """``(generator, n_samples) -> (inputs, targets)`` on the CPU."""
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    """Mean loss of the model on a batch."""
    batch_size: int
    """Samples per step at one rank: the global batch (strong), the per-rank batch (weak)."""
    tokens_per_sample: int
    """Rows (sequence positions) per sample, for tokens/s."""
    checkpointing: bool = False
    """Recompute each block's activations in backward (activation checkpointing)."""


class _Sublayer(nn.Module):
    """``x + down(gelu(up(norm(x))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Block(nn.Sequential):
    """One FSDP unit: ``depth`` residual sublayers."""

    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__(*(_Sublayer(dim, hidden) for _ in range(depth)))


class _Stack(nn.Module):
    """Residual MLP: ``n_blocks`` blocks on (batch, seq, dim) inputs."""

    def __init__(self, *, n_blocks: int, depth: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim, hidden, depth) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _regression_batch(generator: torch.Generator, n: int, *, seq: int, dim: int) -> Batch:
    return (
        torch.randn(n, seq, dim, generator=generator),
        torch.randn(n, seq, dim, generator=generator),
    )


def _mse(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(inputs).float(), targets)


def _stack_shape(
    name: str,
    bound: str,
    *,
    n_blocks: int,
    depth: int,
    dim: int,
    hidden: int,
    batch_size: int,
    seq: int,
) -> Shape:
    return Shape(
        name=name,
        bound=bound,
        build=functools.partial(_Stack, n_blocks=n_blocks, depth=depth, dim=dim, hidden=hidden),
        make_batch=functools.partial(_regression_batch, seq=seq, dim=dim),
        loss=_mse,
        batch_size=batch_size,
        tokens_per_sample=seq,
    )


def _token_batch(generator: torch.Generator, n: int, *, seq: int, vocab: int) -> Batch:
    tokens = torch.randint(vocab, (n, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _cross_entropy(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def _llama_shape(
    name: str, preset: str, *, batch_size: int, seq: int, checkpointing: bool
) -> Shape:
    config = PRESETS[preset]
    return Shape(
        name=name,
        bound="llama",
        build=functools.partial(Llama, config),
        make_batch=functools.partial(_token_batch, seq=seq, vocab=config.vocab_size),
        loss=_cross_entropy,
        batch_size=batch_size,
        tokens_per_sample=seq,
        checkpointing=checkpointing,
    )


SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        # 4 units x 8 sublayers x 6 tensors = 192 tensors of 32-1024 elements.
        _stack_shape(
            "many-small",
            "optimizer overhead",
            n_blocks=4,
            depth=8,
            dim=32,
            hidden=32,
            batch_size=8,
            seq=16,
        ),
        # 8 units x 8 sublayers x 6 tensors = 384 tensors of 8-64 elements, almost no compute:
        # the optimizer's own per-tensor cost is nearly all of the step.
        _stack_shape(
            "many-tiny",
            "optimizer overhead",
            n_blocks=8,
            depth=8,
            dim=8,
            hidden=8,
            batch_size=2,
            seq=2,
        ),
        # 4 units x 6 tensors of up to 262K elements; 512 rows per step at one rank.
        _stack_shape(
            "few-large", "compute", n_blocks=4, depth=1, dim=256, hidden=1024, batch_size=8, seq=64
        ),
        _llama_shape("llama-12x256", "12x256", batch_size=8, seq=32, checkpointing=True),
        _llama_shape("llama-12x256-noac", "12x256", batch_size=8, seq=32, checkpointing=False),
        _llama_shape("llama-tiny", "tiny", batch_size=4, seq=32, checkpointing=True),
        _llama_shape("llama-1b", "1b", batch_size=4, seq=1024, checkpointing=False),
    )
}
"""Shapes of the full runs, by name."""

QUICK_SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        _stack_shape(
            "many-small",
            "optimizer overhead",
            n_blocks=2,
            depth=2,
            dim=16,
            hidden=16,
            batch_size=4,
            seq=4,
        ),
        _stack_shape(
            "many-tiny",
            "optimizer overhead",
            n_blocks=2,
            depth=2,
            dim=8,
            hidden=8,
            batch_size=2,
            seq=2,
        ),
        _stack_shape(
            "few-large", "compute", n_blocks=2, depth=1, dim=64, hidden=256, batch_size=4, seq=8
        ),
        _llama_shape("llama-12x256", "tiny", batch_size=4, seq=16, checkpointing=True),
        _llama_shape("llama-tiny", "tiny", batch_size=4, seq=16, checkpointing=True),
    )
}
"""Reduced variants for ``--quick`` (same structure, seconds per world)."""


def get_shape(name: str, *, quick: bool) -> Shape:
    """Return the shape ``name`` (its reduced variant when ``quick``)."""
    shapes = QUICK_SHAPES if quick else SHAPES
    if name not in shapes:
        raise ValueError(f"unknown shape {name!r}; choose from {sorted(shapes)}")
    return shapes[name]
