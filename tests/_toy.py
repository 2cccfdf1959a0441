"""A small model with awkward shapes, and the single-process reference every test compares to.

Dimensions are chosen so that FSDP2's dim-0 shards are uneven on 2 and 4 ranks and some ranks
hold an empty shard (e.g. a (3, 6) weight on 4 ranks: rows 1, 1, 1, 0).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

IN_DIM, DIM, HIDDEN, OUT_DIM = 4, 6, 3, 5
GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ToyModel(nn.Module):
    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = nn.Linear(DIM, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_models(seed: int = 0, freeze: tuple[str, ...] = ()) -> tuple[nn.Module, nn.Module]:
    """Return a model and its unsharded reference copy, same weights, ``freeze`` frozen."""
    torch.manual_seed(seed)
    model = ToyModel()
    for name, param in model.named_parameters():
        if any(name.startswith(prefix) for prefix in freeze):
            param.requires_grad_(False)
    return model, copy.deepcopy(model)


def shard(model: ToyModel, **fsdp_kwargs) -> ToyModel:
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, IN_DIM, generator=g), torch.randn(size, OUT_DIM, generator=g)


def rank_slice(t: torch.Tensor) -> torch.Tensor:
    """This rank's equal share of a global batch."""
    if not dist.is_initialized():
        return t
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def assert_match(model: nn.Module, reference: nn.Module, atol: float = 1e-6) -> None:
    """Every parameter of ``model`` (gathered if sharded) equals ``reference``'s."""
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            full(param).detach(),
            ref.detach(),
            atol=atol,
            rtol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def train_reference(
    reference: nn.Module,
    optim: torch.optim.Optimizer,
    steps: int,
    scheduler: Callable | None = None,
) -> None:
    """Plain torch.optim on the unsharded copy, on the global batch."""
    for step in range(steps):
        x, y = batch(step)
        loss_fn(reference, x, y).backward()
        optim.step()
        optim.zero_grad()
        if scheduler is not None:
            scheduler.step()
