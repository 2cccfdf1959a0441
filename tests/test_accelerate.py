"""An accelerate loop stepping in backward, against the same loop on plain AdamW.

The plain loop is accelerate's documented one (``accelerator.accumulate``,
``accelerator.clip_grad_norm_``); ours uses ``fused_optim_dist.integrations.accelerate``
(``prepare``, ``backward``, the optimizer's ``grad_norm()``). Parameters are compared at
``PARITY_ATOL`` and each step's norm with plain's ``clip_grad_norm_``, on one process and on 2
FSDP2 ranks; a clipped run is compared on a one-bucket model.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _frameworks import (
    NORM_RTOL,
    PARITY_ATOL,
    OneUnitLlama,
    TokenDataset,
    accelerate_on_cpu,
    full_params,
    max_difference,
    tiny_llama,
)
from _schedule_free import ScheduleFreeSGD
from _toy import holds_gradient
from test_never_silent import GroupStepLamb

accelerate = pytest.importorskip("accelerate")
from fused_optim_dist import OptimizerInBackward  # noqa: E402
from fused_optim_dist.integrations.accelerate import (  # noqa: E402
    backward,
    in_backward_optimizer,
    prepare,
)

MICRO_BATCHES = 6
LR = 1e-2
CLIP = 0.05
"""Below every gradient norm of these runs (checked), so each step is clipped."""


def _plugin(fsdp: str | None) -> accelerate.FullyShardedDataParallelPlugin | None:
    if fsdp is None:
        return None
    if fsdp == "one_unit":
        return accelerate.FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="NO_WRAP")
    return accelerate.FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )


def _loop(
    in_backward: bool,
    accumulation: int,
    clip: float | None,
    fsdp: str | None,
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    calls: str = "backward",
) -> dict:
    """``MICRO_BATCHES`` micro-batches, a step every ``accumulation``; parameters and norms.

    ``fsdp``: ``None`` (one process, or DDP), ``"one_unit"`` (FSDP2 on the root of
    ``OneUnitLlama`` only) or ``"per_layer"``. ``cls``: AdamW, or a class taking ``lr`` only.
    ``calls``: the backward ours calls, the integration's ``"backward"``, or as the plain loop
    does, ``"accelerator.backward"``, or ``"loss.backward"`` (accelerate's own example of
    ``accelerator.accumulate``; then the plain loop calls it too).
    """
    kwargs = dict(lr=LR, weight_decay=0.1) if cls is torch.optim.AdamW else dict(lr=LR)
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(
            cpu=True, gradient_accumulation_steps=accumulation, fsdp_plugin=_plugin(fsdp)
        )
        model = OneUnitLlama() if fsdp == "one_unit" else tiny_llama()
        loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2)
        if in_backward:
            optim = OptimizerInBackward(model.parameters(), cls, max_grad_norm=clip, **kwargs)
            model, optim, loader = prepare(accelerator, model, optim, loader)
        else:
            optim = cls(model.parameters(), **kwargs)
            model, optim, loader = accelerator.prepare(model, optim, loader)
        norms, in_backward_steps = [], []
        for index, batch in enumerate(loader):
            if index == MICRO_BATCHES:
                break
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if in_backward:
                    if calls == "loss.backward":
                        loss.backward()
                    elif calls == "accelerator.backward":
                        accelerator.backward(loss)
                    else:
                        backward(accelerator, loss, optim)
                    if accelerator.sync_gradients:
                        norms.append(in_backward_optimizer(optim).grad_norm().item())
                        # Stepped in backward: no gradient is left for step().
                        held = [p for p in model.parameters() if holds_gradient(p)]
                        in_backward_steps.append(not held)
                else:
                    if calls == "loss.backward":
                        loss.backward()
                    else:
                        accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        max_norm = math.inf if clip is None else clip
                        norms.append(
                            accelerator.clip_grad_norm_(model.parameters(), max_norm).item()
                        )
                optim.step()
                optim.zero_grad()
        return {
            "params": full_params(model),
            "norms": norms,
            "in_backward": in_backward_steps,
        }


def _parity(
    accumulation: int,
    clip: float | None,
    fsdp: str | None,
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    calls: str = "backward",
) -> float:
    plain = _loop(False, accumulation, clip, fsdp, cls, calls)
    ours = _loop(True, accumulation, clip, fsdp, cls, calls)
    steps = MICRO_BATCHES // accumulation
    difference = max_difference(ours["params"], plain["params"])
    assert difference < PARITY_ATOL, difference
    assert len(plain["norms"]) == steps, plain["norms"]
    torch.testing.assert_close(ours["norms"], plain["norms"], rtol=NORM_RTOL, atol=0)
    # A jointly stepped class holds its gradients until the end of backward, then frees them.
    assert ours["in_backward"] == [True] * steps, ours["in_backward"]
    if clip is not None:
        assert min(plain["norms"]) > clip, plain["norms"]
    return difference


@pytest.mark.parametrize(("accumulation", "clip"), [(1, None), (2, CLIP)], ids=["ga1", "ga2-clip"])
def test_accelerate_loop_matches_plain(accumulation, clip):
    difference = _parity(accumulation, clip, None)
    print(f"1 process, ga={accumulation}, clip={clip}: max parameter difference {difference:.2e}")


def test_accelerate_loop_with_its_own_backward_matches_plain():
    """accelerate's own accumulation loop, ``accelerator.backward(loss)`` inside
    ``accelerator.accumulate(model)``, after this library's ``prepare``: the first micro-batch
    was stepped in backward (1.0e-2 moved) and the second refused; equal now."""
    difference = _parity(2, CLIP, None, calls="accelerator.backward")
    print(f"1 process, accelerator.backward, ga=2: max parameter difference {difference:.2e}")


def test_accelerate_loop_with_loss_backward_matches_plain():
    """accelerate's own example of ``accelerator.accumulate(model)``, ``loss.backward()``
    inside it, after this library's ``prepare``: only ``accelerator.backward`` accumulated, so
    the first micro-batch was stepped in backward and the second refused (1.0e-2 moved). A
    backward inside ``accelerator.accumulate`` that does not sync now accumulates."""
    difference = _parity(2, CLIP, None, calls="loss.backward")
    print(f"1 process, loss.backward, ga=2: max parameter difference {difference:.2e}")


def test_accelerate_loop_with_a_class_counting_in_its_groups():
    """A class counting steps in its param groups (timm's Lamb): ``prepare`` hooked the
    swapped parameters by calling ``step()``, which ran the class's step on every group, so
    training started one count ahead (4.2e-2 apart after four steps, no error)."""
    difference = _parity(1, None, None, GroupStepLamb)
    print(f"1 process, GroupStepLamb: max parameter difference {difference:.2e}")


def _schedule_free_loop(in_backward: bool) -> tuple[dict, list[float]]:
    """schedulefree's documented loop: ``optimizer.train()`` before training, ``eval()``
    before evaluating, on the prepared optimizer; parameters and evaluation losses."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = tiny_llama()
        loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2)
        if in_backward:
            optim = OptimizerInBackward(model.parameters(), ScheduleFreeSGD, lr=0.5)
            model, optim, loader = prepare(accelerator, model, optim, loader)
        else:
            optim = ScheduleFreeSGD(model.parameters(), lr=0.5)
            model, optim, loader = accelerator.prepare(model, optim, loader)
        evaluations = []
        for index, batch in enumerate(loader):
            if index == 2 * MICRO_BATCHES:
                break
            model.train()
            optim.train()
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if in_backward:
                    backward(accelerator, loss, optim)
                else:
                    accelerator.backward(loss)
                optim.step()
                optim.zero_grad()
            if index % 4 == 3:
                model.eval()
                optim.eval()
                with torch.no_grad():
                    evaluations.append(model(**batch).loss.item())
        return full_params(model), evaluations


@pytest.mark.filterwarnings("ignore:ScheduleFreeSGD is not declared")
def test_accelerate_loop_with_a_schedule_free_optimizer():
    """accelerate's ``AcceleratedOptimizer.train()``/``eval()`` call the optimizer's only where
    it has them: before, ours had neither, and the loop's calls were skipped (1.1e-2 apart,
    other evaluation losses, or the class refusing to step out of train mode)."""
    plain, plain_evaluations = _schedule_free_loop(False)
    ours, evaluations = _schedule_free_loop(True)
    assert max_difference(ours, plain) < PARITY_ATOL
    assert evaluations == plain_evaluations


def _fsdp2_body(accumulation: int, clip: float | None, fsdp: str) -> float:
    return _parity(accumulation, clip, fsdp)


@pytest.mark.parametrize(
    ("clip", "fsdp"), [(CLIP, "one_unit"), (None, "per_layer")], ids=["one-unit-clip", "units"]
)
def test_accelerate_loop_fsdp2_matches_plain(worlds, clip, fsdp):
    differences = worlds.run(2, _fsdp2_body, accumulation=2, clip=clip, fsdp=fsdp)
    print(f"FSDP2 {fsdp}, ga=2, clip={clip}: max parameter difference {max(differences):.2e}")


def _ddp_refused_body() -> None:
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR)
        with pytest.raises(ValueError, match=r"MULTI_CPU.*fsdp_version: 2.*replicate"):
            prepare(accelerator, model, optim)


def test_accelerate_ddp_is_refused_before_prepare(worlds):
    worlds.run(2, _ddp_refused_body)


def _with_grad_scaler(accelerator: accelerate.Accelerator) -> None:
    """What ``Accelerator(mixed_precision="fp16")`` does on a GPU (on the CPU it builds no
    scaler): a ``torch.amp.GradScaler`` that ``accelerator.backward`` scales the loss by."""
    accelerator.scaler = torch.amp.GradScaler("cpu")
    accelerator.native_amp = True


def test_accelerate_grad_scaler_is_refused_before_anything_moves():
    """A GradScaler on the accelerator: ``prepare`` accepted it, the first backward stepped the
    scaled gradients (1.0e-2 moved) and the refusal came at the optimizer step. Refused in
    ``prepare``, before anything is prepared; one put on the accelerator after ``prepare`` is
    refused by ``accelerator.backward`` (and ``backward``) before the backward runs."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        _with_grad_scaler(accelerator)
        model = tiny_llama()
        before = full_params(model)
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR)
        with pytest.raises(ValueError, match=r"GradScaler.*mixed_precision=.bf16"):
            prepare(accelerator, model, optim)
        accelerator.scaler, accelerator.native_amp = None, False
        model, optim = prepare(accelerator, model, optim)
        _with_grad_scaler(accelerator)
        _both_backwards_refuse(accelerator, model, optim, r"GradScaler.*mixed_precision=.bf16")
        assert max_difference(full_params(model), before) == 0.0


def _both_backwards_refuse(
    accelerator: accelerate.Accelerator, model: torch.nn.Module, optim: Any, match: str
) -> None:
    """``accelerator.backward`` (as ``prepare`` wrapped it) and ``backward`` both raise
    ``match`` on a batch's loss, before the backward runs."""
    batch = next(iter(torch.utils.data.DataLoader(TokenDataset(), batch_size=2)))
    loss = model(**batch).loss
    with pytest.raises(ValueError, match=match):
        accelerator.backward(loss)
    with pytest.raises(ValueError, match=match):
        backward(accelerator, loss, optim)


def _clipped_step(
    accelerator: accelerate.Accelerator, model: torch.nn.Module, optim: Any, in_backward: bool
) -> float:
    """The end of a step clipped at 0.05 over ``model.parameters()``: the plain loop's
    ``clip_grad_norm_``, or ours' norm (clipped in backward); returns the norm."""
    if in_backward:
        norm = in_backward_optimizer(optim).grad_norm().item()
    else:
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.05).item()
    optim.step()
    optim.zero_grad()
    return norm


def _decay_groups_run(in_backward: bool, calls: str) -> tuple[list[torch.Tensor], list[float]]:
    """CompactAdamW with weight decay on the matrices only (two groups that hold the parameters
    in another order than ``model.parameters()``), clipped: the plain accelerate loop, or ours
    through ``prepare``. ``calls``: the model and the optimizer prepared in ``"one"`` call, or
    in two, ``"model_first"`` or ``"optimizer_first"``."""
    from fused_optim_dist.compact_adamw import CompactAdamW

    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 8)
        )
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        if in_backward:
            optim = OptimizerInBackward(groups, CompactAdamW, lr=1e-2, max_grad_norm=0.05)
            model, optim = _prepare_in(calls, functools.partial(prepare, accelerator), model, optim)
        else:
            optim = CompactAdamW(groups, lr=1e-2)
            model, optim = _prepare_in(calls, accelerator.prepare, model, optim)
        norms = []
        for step in range(8):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
            accelerator.backward(((model(x) - y) ** 2).mean() * 10)
            norms.append(_clipped_step(accelerator, model, optim, in_backward))
        return [p.detach().clone() for p in model.parameters()], norms


def _prepare_in(
    calls: str, prepare_: Callable[..., Any], model: torch.nn.Module, optim: torch.optim.Optimizer
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``prepare_(model, optim)`` in one call, or in two in the order ``calls`` names."""
    if calls == "one":
        return prepare_(model, optim)
    if calls == "model_first":
        model = prepare_(model)
        return model, prepare_(optim)
    optim = prepare_(optim)
    return prepare_(model), optim


@pytest.mark.parametrize("calls", ["one", "model_first", "optimizer_first"])
def test_accelerate_clipping_in_the_model_order_bit_for_bit(calls):
    """``prepare`` takes the norm in the prepared model's parameter order, as the plain loop's
    ``accelerator.clip_grad_norm_(model.parameters())`` takes it: with the usual two
    weight-decay groups, CompactAdamW ends where the plain loop ends, bit for bit (the norm
    summed in the groups' order flipped codes: 4.2e-4 apart). Also with the model and the
    optimizer prepared in two calls, in either order, where the order was not set (6.6e-7
    apart after these eight steps, 1.9e-5 after 40)."""
    ours, ours_norms = _decay_groups_run(True, calls)
    plain, plain_norms = _decay_groups_run(False, calls)
    assert ours_norms == plain_norms
    for p, q in zip(ours, plain, strict=True):
        assert torch.equal(p, q)


def _embedding_left_out(model: torch.nn.Module) -> OptimizerInBackward:
    """An optimizer on every parameter but the embedding, which stays trainable."""
    params = [p for name, p in model.named_parameters() if "embed_tokens" not in name]
    return OptimizerInBackward(params, torch.optim.AdamW, lr=LR, max_grad_norm=CLIP)


@pytest.mark.parametrize("calls", ["one", "model_first", "optimizer_first"])
def test_accelerate_trainable_parameters_outside_the_optimizer_refused(calls):
    """A trainable parameter of the prepared model left out of the optimizer: the plain loop
    clips and measures the norm over ``model.parameters()``, ours over the optimizer's (2.5e-3
    apart after six steps, reported norms 1.12 against 1.61, no error). Refused by
    ``prepare``, however the model and the optimizer are prepared, before any backward;
    frozen, accepted; unfrozen later, refused by ``accelerator.backward`` (and ``backward``)
    before it runs. Nothing moved."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        before = full_params(model)
        optim = _embedding_left_out(model)
        with pytest.raises(ValueError, match=r"embed_tokens.*not in the optimizer.*Freeze"):
            _prepare_in(calls, functools.partial(prepare, accelerator), model, optim)
        optim.detach()
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model.model.embed_tokens.requires_grad_(False)
        model, optim = prepare(accelerator, model, _embedding_left_out(model))
        model.model.embed_tokens.requires_grad_(True)
        _both_backwards_refuse(
            accelerator, model, optim, r"embed_tokens.*not in the optimizer.*Freeze"
        )
    assert max_difference(full_params(model), before) == 0.0


def _embedding_left_out_unclipped(in_backward: bool) -> dict[str, torch.Tensor]:
    """Three steps with the embedding trainable but left out of an unclipped optimizer."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        params = [p for name, p in model.named_parameters() if "embed_tokens" not in name]
        if in_backward:
            optim = OptimizerInBackward(params, torch.optim.AdamW, lr=LR)
            model, optim, loader = prepare(accelerator, model, optim, _loader())
        else:
            optim = torch.optim.AdamW(params, lr=LR)
            model, optim, loader = accelerator.prepare(model, optim, _loader())
        for _, batch in zip(range(3), loader, strict=False):
            accelerator.backward(model(**batch).loss)
            optim.step()
            optim.zero_grad()
        return full_params(accelerator.unwrap_model(model))


def test_accelerate_unclipped_optimizer_need_not_hold_every_trainable_parameter():
    """Without ``max_grad_norm`` nothing is clipped and every update is the plain one, so a
    trainable parameter left out of the optimizer is accepted (it was refused)."""
    assert (
        max_difference(_embedding_left_out_unclipped(True), _embedding_left_out_unclipped(False))
        < PARITY_ATOL
    )


class ProxyLoss(torch.nn.Module):
    """A criterion with learnable parameters (class proxies and a temperature, as metric
    learning's proxy losses keep), prepared beside the model and trained with it."""

    def __init__(self) -> None:
        super().__init__()
        self.proxies = torch.nn.Parameter(torch.randn(10, 8))
        self.log_temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        normalize = torch.nn.functional.normalize
        logits = normalize(embeddings, dim=-1) @ normalize(self.proxies, dim=-1).T
        return torch.nn.functional.cross_entropy(logits * self.log_temperature.exp(), labels)


def _criterion_run(
    in_backward: bool, max_norm: float | None = 0.5
) -> tuple[list[torch.Tensor], list[float]]:
    """The model clipped (``clip_grad_norm_(model.parameters())``), the criterion's parameters
    stepped unclipped: plain AdamW over both, or ours with an optimizer per module, the
    criterion's without ``max_grad_norm``. With ``max_norm=None`` nothing is clipped, and ours
    is one optimizer over both."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
        )
        criterion = ProxyLoss()
        if in_backward and max_norm is None:
            params = [*model.parameters(), *criterion.parameters()]
            optims = [OptimizerInBackward(params, torch.optim.AdamW, lr=LR)]
        elif in_backward:
            optims = [
                OptimizerInBackward(
                    model.parameters(), torch.optim.AdamW, lr=LR, max_grad_norm=max_norm
                ),
                OptimizerInBackward(criterion.parameters(), torch.optim.AdamW, lr=LR),
            ]
        else:
            params = [*model.parameters(), *criterion.parameters()]
            optims = [torch.optim.AdamW(params, lr=LR)]
        prepare_ = functools.partial(prepare, accelerator) if in_backward else accelerator.prepare
        model, criterion, *optims = prepare_(model, criterion, *optims)
        norms = []
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
            accelerator.backward(criterion(model(x), y))
            if max_norm is None:
                pass
            elif in_backward:
                norms.append(in_backward_optimizer(optims[0]).grad_norm().item())
            else:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm).item())
            for optim in optims:
                optim.step()
                optim.zero_grad()
        return [p.detach().clone() for p in [*model.parameters(), *criterion.parameters()]], norms


def test_accelerate_optimizer_over_a_model_and_its_criterion():
    """One optimizer over the model and a criterion with learnable parameters, both prepared:
    the plain loop clips over ``model.parameters()`` and steps the criterion unclipped, ours
    clipped all it held by their joint norm (9.7e-3 apart after eight steps, reported norms
    8.60 against 7.89, no error). Refused by ``prepare``, nothing moved; with an optimizer per
    module, the criterion's without ``max_grad_norm`` (the way the refusal names), as plain;
    without ``max_grad_norm`` one optimizer over both is accepted, as plain."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model, criterion = torch.nn.Linear(16, 8), ProxyLoss()
        before = [p.detach().clone() for p in [*model.parameters(), *criterion.parameters()]]
        params = [*model.parameters(), *criterion.parameters()]
        optim = OptimizerInBackward(params, torch.optim.AdamW, lr=LR, max_grad_norm=0.5)
        with pytest.raises(ValueError, match=r"2 prepared modules \(Linear, ProxyLoss\).*own"):
            prepare(accelerator, model, criterion, optim)
        for p, q in zip([*model.parameters(), *criterion.parameters()], before, strict=True):
            assert torch.equal(p, q)
        optim.detach()
    (ours, ours_norms), (plain, plain_norms) = _criterion_run(True), _criterion_run(False)
    assert (
        max(torch.max((p - q).abs()).item() for p, q in zip(ours, plain, strict=True)) < PARITY_ATOL
    )
    torch.testing.assert_close(ours_norms, plain_norms, rtol=NORM_RTOL, atol=0)
    assert min(plain_norms) > 0.5, plain_norms
    # Unclipped, one optimizer over both is accepted (nothing's norm matters), as plain.
    (ours, _), (plain, _) = _criterion_run(True, None), _criterion_run(False, None)
    assert (
        max(torch.max((p - q).abs()).item() for p, q in zip(ours, plain, strict=True)) < PARITY_ATOL
    )


def _two_phases(in_backward: bool) -> dict[str, torch.Tensor]:
    """Two training phases on one accelerator, each with an optimizer of its own (another LR),
    the first released as accelerate documents: ``free_memory()``, then the loop's references
    dropped."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = tiny_llama()
        for lr in (LR, LR / 3):
            model, optim, loader = _prepared(accelerator, model, in_backward, lr)
            for _, batch in zip(range(4), loader, strict=False):
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch).loss)
                    optim.step()
                    optim.zero_grad()
            model = accelerator.unwrap_model(model)
            accelerator.free_memory()
            del optim, loader
            gc.collect()
        return full_params(model)


def _prepared(
    accelerator: Any, model: torch.nn.Module, in_backward: bool, lr: float
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader]:
    """``model``, an AdamW at ``lr`` (in backward, through this library's ``prepare``, or
    plain, through accelerate's) and the loader, prepared on ``accelerator``."""
    if in_backward:
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=lr)
        return prepare(accelerator, model, optim, _loader())
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    return accelerator.prepare(model, optim, _loader())


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(TokenDataset(), batch_size=2)


def test_accelerate_optimizer_released_by_free_memory():
    """A second phase's optimizer on the same parameters, after ``accelerator.free_memory()``
    and ``del optim``: the wrapped ``accelerator.backward`` kept the first one live, so the
    second was refused as another live optimizer on the same parameters (naming an object the
    loop had deleted). As plain now."""
    assert max_difference(_two_phases(True), _two_phases(False)) < PARITY_ATOL


class _FrozenEncoderNet(torch.nn.Module):
    """A trained head over a frozen encoder, which the loop also runs alone for targets."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(x)))


def _frozen_encoder_run(in_backward: bool) -> tuple[torch.Tensor, list[float]]:
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = _FrozenEncoderNet()
        if in_backward:
            optim = OptimizerInBackward(
                model.parameters(), torch.optim.AdamW, lr=LR, max_grad_norm=0.05
            )
            model, encoder, optim = prepare(accelerator, model, model.enc, optim)
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=LR)
            model, encoder, optim = accelerator.prepare(model, model.enc, optim)
        g, norms = torch.Generator().manual_seed(1), []
        for _ in range(4):
            x = torch.randn(4, 8, generator=g)
            with torch.no_grad():
                target = encoder(x.flip(0))
            accelerator.backward((model(x) - target).pow(2).mean())
            norms.append(_clipped_step(accelerator, model, optim, in_backward))
        return torch.cat([p.detach().flatten() for p in model.parameters()]), norms


def test_accelerate_frozen_submodule_prepared_alone_is_not_a_second_model():
    """A frozen encoder inside the model, prepared on its own too: it shares only frozen
    parameters with the optimizer, which count in neither norm. It was counted as a second
    prepared module and the clipped optimizer refused; as plain now (and a module prepared
    twice, accelerate keeping it and its compiled wrapper, is one)."""
    (ours, ours_norms), (plain, plain_norms) = _frozen_encoder_run(True), _frozen_encoder_run(False)
    assert (ours - plain).abs().max().item() < PARITY_ATOL
    torch.testing.assert_close(ours_norms, plain_norms, rtol=NORM_RTOL, atol=0)


def _no_sync_run(in_backward: bool, calls: str, trigger: bool) -> dict[str, torch.Tensor]:
    """accelerate's manual accumulation, two micro-batches a step, on one process: the first's
    backward inside ``accelerator.no_sync(model)`` (``Accelerator.no_sync``'s example), or,
    with ``trigger``, both forwards inside it and the second backward inside
    ``accelerator.trigger_sync_in_backward(model)`` (that method's example). ``calls``: the
    backward ours calls, as in :func:`_loop`."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        model, optim, loader = _prepared(accelerator, model, in_backward, LR)
        batches = iter(loader)

        def backward_of(loss: torch.Tensor) -> None:
            if calls == "backward" and in_backward:
                backward(accelerator, loss, optim)
            elif calls == "loss.backward":
                loss.backward()
            else:
                accelerator.backward(loss)

        for _ in range(2):
            if trigger:
                with accelerator.no_sync(model):
                    loss_a = model(**next(batches)).loss
                    loss_b = model(**next(batches)).loss
                backward_of(loss_a)
                with accelerator.trigger_sync_in_backward(model):
                    backward_of(loss_b)
            else:
                with accelerator.no_sync(model):
                    backward_of(model(**next(batches)).loss)
                backward_of(model(**next(batches)).loss)
            optim.step()
            optim.zero_grad()
        return full_params(model)


def _nested_no_sync_run(in_backward: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """Two micro-batches a step: the first's backward inside ``accelerator.no_sync(model)``,
    the second's forward inside a ``no_sync`` nested in it, its backward after both. Returns
    the parameters, and whether the last backward of the first step left every gradient
    stepped (freed) rather than held."""
    with accelerate_on_cpu():
        accelerator = accelerate.Accelerator(cpu=True)
        model, optim, loader = _prepared(accelerator, tiny_llama(), in_backward, LR)
        batches = iter(loader)
        stepped = []
        for _ in range(2):
            with accelerator.no_sync(model):
                accelerator.backward(model(**next(batches)).loss)
                with accelerator.no_sync(model):
                    loss = model(**next(batches)).loss
            accelerator.backward(loss)
            stepped.append(not any(holds_gradient(p) for p in model.parameters()))
            optim.step()
            optim.zero_grad()
        return full_params(model), stepped[0]


def test_accelerate_nested_no_sync_keeps_the_outer_backward():
    """A ``no_sync`` of forwards only nested in one that ran a backward: the backward after
    both is the step's last, stepped in backward as after the outer one alone. The inner
    context's exit forgot the outer one's backward, and the last backward was taken for one
    after forwards only and held to ``step()`` (equal values, its gradients all held)."""
    (ours, stepped), (plain, _) = _nested_no_sync_run(True), _nested_no_sync_run(False)
    assert stepped
    assert max_difference(ours, plain) < PARITY_ATOL


@pytest.mark.parametrize(
    ("calls", "trigger"),
    [
        ("accelerator.backward", False),
        ("backward", False),
        ("loss.backward", False),
        ("accelerator.backward", True),
        ("backward", True),
    ],
)
def test_accelerate_manual_accumulation_under_no_sync(calls, trigger):
    """A backward inside ``accelerator.no_sync(model)`` only accumulates, on one process too
    (where accelerate's ``no_sync`` does nothing and ``sync_gradients`` stays true), and so do
    the backwards after a ``no_sync`` that ran forwards only, up to one inside
    ``trigger_sync_in_backward``: the first micro-batch was stepped in backward and the second
    refused after every parameter had moved. As plain now (see [Note: accelerate's
    no_sync]; ``loss.backward()`` after a ``no_sync`` of forwards only is not seen, and still
    steps)."""
    ours, plain = _no_sync_run(True, calls, trigger), _no_sync_run(False, calls, trigger)
    assert max_difference(ours, plain) < PARITY_ATOL
