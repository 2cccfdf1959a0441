"""Two ``OptimizerInBackward`` clipping by norm over one model: refused, or apart on request.

A plain loop with two optimizers over one model (Muon on the matrices, AdamW on the other
parameters) clips with one ``clip_grad_norm_(model.parameters(), ...)``: every gradient by their
joint norm. Two ``OptimizerInBackward`` with ``max_grad_norm`` each clipped by the norm of their
own parameters (2.4e-3 to 6.1e-3 apart from that loop after four steps, with no error, before
this was refused). A backward that gives gradients to both, stepped or held under
``accumulate()``, is refused before anything moves (under reentrant checkpointing, where the
two get their first gradients in different nested backwards, when the second's returns); one
``OptimizerInBackward`` whose groups name their classes clips them together
(``test_never_silent.py``). With ``clip_alone=True`` on both, each clips apart, as
``clip_grad_norm_`` called on each optimizer's parameters does. A GAN's two optimizers, each
fed by a backward of its own, are never refused.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _toy import PLAIN_ATOL, assert_match, full, loss_fn, make_models, rank_slice, shard
from _toy import batch as toy_batch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fused_optim_dist import OptimizerInBackward

CLIP = 0.05
"""Below every gradient norm of these runs: each step is clipped."""
REFUSAL = r"gives gradients to two OptimizerInBackward clipping by norm"


def _split(model: nn.Module, how: str) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters of the two optimizers: matrices and the rest (Muon's split, interleaved
    in every layer), or the body and the head."""
    if how == "matrices":
        params = list(model.parameters())
        return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return body, list(model.head.parameters())


def _ours(
    model: nn.Module, how: str, clip_alone: tuple[bool, bool] = (False, False)
) -> tuple[OptimizerInBackward, OptimizerInBackward]:
    a, b = _split(model, how)
    return (
        OptimizerInBackward(
            a, torch.optim.AdamW, lr=1e-2, max_grad_norm=CLIP, clip_alone=clip_alone[0]
        ),
        OptimizerInBackward(
            b, torch.optim.SGD, lr=1e-1, max_grad_norm=CLIP, clip_alone=clip_alone[1]
        ),
    )


def _batch(step: int, sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = toy_batch(step)
    return (rank_slice(x), rank_slice(y)) if sharded else (x, y)


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [full(p).detach().clone() for p in model.parameters()]


def _assert_unchanged(model: nn.Module, before: list[torch.Tensor]) -> None:
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(full(param).detach(), old)


def _train_plain(reference: nn.Module, how: str, jointly: bool, sharded: bool = False) -> None:
    """Four steps of the plain loop: AdamW and SGD, every gradient clipped by the joint norm
    (``jointly``) or each optimizer's by their own."""
    a, b = _split(reference, how)
    optims = (torch.optim.AdamW(a, lr=1e-2), torch.optim.SGD(b, lr=1e-1))
    for step in range(4):
        loss_fn(reference, *_batch(step, sharded)).backward()
        norms = (
            [torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)]
            if jointly
            else [torch.nn.utils.clip_grad_norm_(params, CLIP) for params in (a, b)]
        )
        assert all(float(norm) > CLIP for norm in norms), norms
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _train_ours(model: nn.Module, optims: tuple[OptimizerInBackward, ...], sharded=False) -> None:
    for step in range(4):
        loss_fn(model, *_batch(step, sharded)).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()


@pytest.mark.parametrize("how", ["matrices", "head"])
def test_one_backward_for_two_clipping_optimizers_refused_before_anything_moves(how):
    """Muon's split (each layer's matrix beside its bias: both optimizers' first gradients
    arrive together) or the body and the head (the head's optimizer would complete its bucket
    before the body's first gradient): the engine tells that the backward will reach the other
    optimizer's parameters, so the first to start stepping refuses it."""
    model, _ = make_models()
    optims = _ours(model, how)  # noqa: F841 (held: an optimizer collected steps nothing)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=REFUSAL):
        loss_fn(model, *_batch(0)).backward()
    _assert_unchanged(model, before)


@pytest.mark.parametrize("how", ["matrices", "head"])
def test_clip_alone_on_both_clips_each_apart_as_plain(how):
    """With ``clip_alone`` on both, ours equals the plain loop clipping each optimizer's
    parameters by their own norm, which ends far from the loop clipping them jointly (what the
    refusal protects)."""
    model, reference = make_models()
    _train_ours(model, _ours(model, how, clip_alone=(True, True)))
    _train_plain(reference, how, jointly=False)
    assert_match(model, reference, atol=PLAIN_ATOL)
    _, jointly = make_models()
    _train_plain(jointly, how, jointly=True)
    apart = max(
        (p - q).abs().max().item()
        for p, q in zip(reference.parameters(), jointly.parameters(), strict=True)
    )
    assert apart > 1e-4, apart


@pytest.mark.parametrize("held", [False, True], ids=["stepped", "accumulated"])
def test_reentrant_checkpointing_each_block_its_own_backward_refused(held):
    """Every block and the head under reentrant checkpointing: each runs its backward nested
    in the outer one, and the two optimizers (body, head) get their first gradients in
    different nested backwards, where the engine cannot tell the other's will come: refused
    when the second's nested backward returns into the outer one (the head's optimizer has
    stepped its bucket by then where not held, and the message says so)."""
    model, _ = make_models()
    optims = _ours(model, "head")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.inp(x)
        for layer in model.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return checkpoint(model.head, h, use_reentrant=True)

    x, y = _batch(0)
    held_context = contextlib.ExitStack()
    if held:
        for optim in optims:
            held_context.enter_context(optim.accumulate())
    with held_context, pytest.raises(RuntimeError, match=REFUSAL):
        nn.functional.mse_loss(forward(x), y).backward()


def test_clip_alone_on_one_of_them_refused():
    model, _ = make_models()
    optims = _ours(model, "matrices", clip_alone=(True, False))  # noqa: F841 (held)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=REFUSAL):
        loss_fn(model, *_batch(0)).backward()
    _assert_unchanged(model, before)


def test_micro_batches_held_for_both_refused_at_the_backward():
    """Every micro-batch under ``accumulate()``, then ``step()``: each ``step()`` would clip
    the held gradients by its own optimizer's norm, so the micro-batch's backward is refused,
    nothing held or moved."""
    model, _ = make_models()
    first, second = _ours(model, "matrices")
    before = _snapshot(model)
    with first.accumulate(), second.accumulate(), pytest.raises(RuntimeError, match=REFUSAL):
        loss_fn(model, *_batch(0)).backward()
    _assert_unchanged(model, before)


def test_detached_optimizer_not_counted():
    """A Trainer detaches its optimizer when ``train()`` returns, and a second stage builds
    another on the same parameters: the detached one steps nothing in backward, so the new
    one's backward is not refused, and both stages end as the plain ones."""
    model, reference = make_models()
    stages = []  # held: a detached optimizer stays alive
    for stage in range(2):
        optim = OptimizerInBackward(
            model.parameters(), torch.optim.AdamW, lr=1e-2, max_grad_norm=CLIP
        )
        stages.append(optim)
        loss_fn(model, *_batch(stage)).backward()
        optim.step()
        optim.zero_grad()
        optim.detach()
        plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        loss_fn(reference, *_batch(stage)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference, atol=PLAIN_ATOL)


def _gan(in_backward: bool) -> tuple[nn.Module, nn.Module]:
    """The DCGAN tutorial's loop on toy networks, each network's gradients clipped in its own
    step: the discriminator's two backwards as one step, the generator's loss through the
    frozen discriminator."""
    torch.manual_seed(0)
    netg = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    netd = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    kwargs = dict(lr=2e-3, betas=(0.5, 0.999))
    if in_backward:
        optd = OptimizerInBackward(
            netd.parameters(), torch.optim.Adam, max_grad_norm=CLIP, **kwargs
        )
        optg = OptimizerInBackward(
            netg.parameters(), torch.optim.Adam, max_grad_norm=CLIP, **kwargs
        )
    else:
        optd = torch.optim.Adam(netd.parameters(), **kwargs)
        optg = torch.optim.Adam(netg.parameters(), **kwargs)
    bce = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(1)
    for _ in range(4):
        real = torch.randn(16, 8, generator=data) + 1
        fake = netg(torch.randn(16, 4, generator=data))
        optd.zero_grad()
        if in_backward:
            with optd.accumulate():
                bce(netd(real), torch.ones(16, 1)).backward()
        else:
            bce(netd(real), torch.ones(16, 1)).backward()
        bce(netd(fake.detach()), torch.zeros(16, 1)).backward()
        if not in_backward:
            torch.nn.utils.clip_grad_norm_(netd.parameters(), CLIP)
        optd.step()
        netd.requires_grad_(False)
        optg.zero_grad()
        bce(netd(fake), torch.ones(16, 1)).backward()
        if not in_backward:
            torch.nn.utils.clip_grad_norm_(netg.parameters(), CLIP)
        optg.step()
        netd.requires_grad_(True)
    return netg, netd


def test_gan_optimizers_clipping_each_in_its_own_backward_equal_plain():
    for ours, plain in zip(_gan(True), _gan(False), strict=True):
        assert_match(ours, plain, atol=PLAIN_ATOL)


def _fsdp2_body() -> None:
    """FSDP2, on every rank before anything moves: every block a unit and the root, the
    matrices and the rest (both optimizers hold parameters of every unit); then the head a
    unit of its own beside the body's units (the head's unit is reduced first: the engine
    tells that the backward will reach the body's unsharded parameters). Then the root alone
    a unit, ``clip_alone`` on both: equal to the plain loop clipping each optimizer's DTensors
    apart."""
    for how in ("matrices", "head"):
        model, _ = make_models()
        if how == "head":
            fully_shard(model.head)
        shard(model)
        optims = _ours(model, how)  # noqa: F841 (held)
        before = _snapshot(model)
        with pytest.raises(RuntimeError, match=REFUSAL):
            loss_fn(model, *_batch(0, sharded=True)).backward()
        _assert_unchanged(model, before)

    model, reference = make_models()
    for net in (model, reference):
        fully_shard(net)
    assert isinstance(next(model.parameters()), DTensor)
    _train_ours(model, _ours(model, "matrices", clip_alone=(True, True)), sharded=True)
    _train_plain(reference, "matrices", jointly=False, sharded=True)
    assert_match(model, reference, atol=PLAIN_ATOL)


def test_on_fsdp2(worlds):
    worlds.run(2, _fsdp2_body)
