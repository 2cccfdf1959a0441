"""A small model with awkward shapes, and the single-process reference every test compares to.

Dimensions are chosen so that FSDP2's dim-0 shards are uneven on 2 and 4 ranks and some ranks
hold an empty shard (e.g. a (3, 6) weight on 4 ranks: rows 1, 1, 1, 0).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fused_optim_dist import is_freed
from fused_optim_dist._left_updates import LEFT_UPDATES

IN_DIM, DIM, HIDDEN, OUT_DIM = 4, 6, 3, 5
GLOBAL_BATCH = 8
PLAIN_ATOL = 1e-6
"""Ours against the plain optimizer: the same update, possibly by another kernel of the class."""


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ToyModel(nn.Module):
    """Input layer, residual blocks, head; the default sizes are the awkward ones above."""

    def __init__(
        self,
        n_layers: int = 3,
        *,
        in_dim: int = IN_DIM,
        dim: int = DIM,
        hidden: int = HIDDEN,
        out_dim: int = OUT_DIM,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(n_layers))
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@contextlib.contextmanager
def swapping_conversions() -> Iterator[None]:
    """Under ``torch.__future__.set_swap_module_params_on_conversion(True)``: ``Module.to()``
    and ``load_state_dict()`` swap a new C++ tensor into each parameter object."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


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


def holds_gradient(param: torch.Tensor) -> bool:
    """Whether ``param`` holds a gradient still to be stepped (not a freed one, see
    [Note: freed gradients])."""
    return param.grad is not None and not is_freed(param.grad)


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def assert_match(model: nn.Module, reference: nn.Module, atol: float = 1e-6) -> None:
    """Every parameter of ``model`` (gathered if sharded) equals ``reference``'s."""
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            full(param).detach(),
            full(ref).detach(),
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


@contextlib.contextmanager
def bypassed(*modules: nn.Module) -> Iterator[None]:
    """Run ``modules`` as the identity: their parameters get no gradient in this forward.

    The modules are still called, so FSDP2's hooks on them run as usual.
    """
    for module in modules:
        module.forward = lambda x: x
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def unit_order(reference: ToyModel) -> list[list[nn.Parameter]]:
    """The FSDP units of ``shard(model)`` in the order backward completes them."""
    layers = [list(layer.parameters()) for layer in reversed(reference.layers)]
    root = [*reference.inp.parameters(), *reference.head.parameters()]
    return [*layers, root]


def clip_like_in_backward(
    units: list[list[nn.Parameter]], previous: list[float], max_norm: float
) -> list[float]:
    """Scale the gradients of ``units`` (in backward order) by the documented in-backward
    coefficients, ``min(1, max_norm / sqrt(seen + predicted))`` (README, "Clipping in one
    backward"), given the previous step's squared norms per unit (``[]`` on the first step).

    Returns this step's squared norms per unit, before clipping: the next step's ``previous``.
    """
    squares = [sum(p.grad.square().sum().item() for p in unit) for unit in units]
    total_previous, seen, seen_previous = sum(previous), 0.0, 0.0
    for index, (unit, square) in enumerate(zip(units, squares, strict=True)):
        seen += square
        seen_previous += previous[index] if previous else 0.0
        coefficient = min(1.0, max_norm / (math.sqrt(seen + total_previous - seen_previous) + 1e-6))
        for p in unit:
            p.grad.mul_(coefficient)
    return squares


def assert_same_state_dict(
    actual: object, expected: object, path: str = "", *, atol: float = 0.0
) -> None:
    """Same keys, nesting, dtypes and devices, DTensors placed alike, and tensors equal: bitwise
    by default (a round trip of the same optimizer), or to ``atol`` (and ``rtol=1e-5``) where
    ours is compared with the plain optimizer on gradients reduced otherwise (another number of
    ranks, an unsharded reference), which differ in the last bit."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: {actual.keys()} != {expected.keys()}"
        for key in expected:
            assert_same_state_dict(actual[key], expected[key], f"{path}/{key}", atol=atol)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state_dict(a, e, f"{path}/{i}", atol=atol)
    elif isinstance(expected, torch.Tensor):
        if isinstance(expected, DTensor):
            assert (actual.device_mesh, actual.placements, actual.shape) == (
                expected.device_mesh,
                expected.placements,
                expected.shape,
            ), f"{path}: {actual} placed unlike {expected}"
            actual, expected = actual.to_local(), expected.to_local()
        rtol = 1e-5 if atol else 0.0
        # assert_close checks dtype and device too.
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=path)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


class SlowToCopy:
    """Deep-copied slowly (0.3 s): put first in a state dict, it holds DCP's staging thread
    before the entries after it, so that the copy of those overlaps the next backward."""

    def __deepcopy__(self, memo: dict) -> SlowToCopy:
        time.sleep(0.3)
        return SlowToCopy()


def forget_updates_left() -> None:
    """Forget the parameters a test left holding updates that no ``step()`` committed (their
    optimizer collected or detached after a backward).

    Tests share processes (xdist's workers, the pooled gloo worlds), and such parameters can
    outlive their test: torch 2.13 keeps a backward that raised, its graph or the exception
    raised in it (whose frames hold the model), alive after it. While any is noted, a
    ``torch.compile``d forward anywhere in the process checks outside its graph ([Note:
    updates left uncommitted]), and a later test counting graphs would fail for the one that
    left them."""
    LEFT_UPDATES._left.clear()
    LEFT_UPDATES._remove_hook_if_idle()
