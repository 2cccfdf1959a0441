"""Loops people write for a plain optimizer, with ours swapped in: equal, or refused at once.

Each test writes the loop for plain ``torch.optim`` first, then runs it with
``OptimizerInBackward`` on an identical model and data. The rule (README, "What differs from the
plain optimizer, and what raises"): the parameters end equal (1e-6), or an ordinary exception
naming the fix is raised at the first step where they cannot, with the parameters unchanged
wherever that was knowable. Single-process tests use a plain module; the ``*_body`` functions
run on 2 (or 3) gloo ranks with FSDP2, uneven shards.
"""

from __future__ import annotations

import _thread
import contextlib
import copy
import gc
import itertools
import math
import pickle
import random
import threading
import time
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from _toy import (
    IN_DIM,
    OUT_DIM,
    PLAIN_ATOL,
    SlowToCopy,
    assert_match,
    assert_same_state_dict,
    batch,
    full,
    holds_gradient,
    loss_fn,
    make_models,
    rank_slice,
    shard,
    swapping_conversions,
)
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from fused_optim_dist import InBackwardOptions, OptimizerInBackward, declare_stepping, is_freed

ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(full(param).detach(), before[name]), f"{name} moved"


def _refused_unmoved(model: nn.Module, match: str, action: Callable[[], object]) -> None:
    """``action()`` raises a RuntimeError matching ``match``, and ``model`` did not move."""
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=match):
        action()
    _assert_unchanged(model, before)


_READ_BEFORE_STEP = r"updated in backward with no optimizer\.step\(\) since"
"""The refusal of a forward reading a parameter updated in backward before ``step()``."""


def _x(step: int, sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    return (rank_slice(x), rank_slice(y)) if sharded else (x, y)


def _adamw_loops(sharded: bool) -> tuple[nn.Module, nn.Module, OptimizerInBackward, Optimizer]:
    """Two identical models (sharded by FSDP2 if ``sharded``), ours and plain AdamW on them."""
    model, reference = make_models()
    if sharded:
        shard(model)
        shard(reference)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    return model, reference, optim, torch.optim.AdamW(reference.parameters(), **ADAMW)


def _step_both(loops: tuple, step: int, sharded: bool = False, *, zero: bool) -> None:
    """A backward on batch ``step`` and a ``step()`` in each ``(model, optimizer)`` loop, then
    ``zero_grad()`` if ``zero``."""
    for net, opt in loops:
        loss_fn(net, *_x(step, sharded)).backward()
        opt.step()
        if zero:
            opt.zero_grad()


# ------------------------------------------------------------- 1. reentrant checkpointing


def _checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with every block run under reentrant activation checkpointing (the forward
    replaced on the instance, so FSDP2's hooks on the root still run)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.inp(x)
        for layer in model.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return model.head(h)

    model.forward = forward
    return model


def _reentrant(sharded: bool, max_grad_norm: float | None, bucket_numel: int) -> None:
    model, reference = map(_checkpointed, make_models())
    if sharded:
        shard(model)
        shard(reference)
    optim = OptimizerInBackward(
        model.parameters(),
        torch.optim.AdamW,
        options=InBackwardOptions(max_grad_norm=max_grad_norm, bucket_numel=bucket_numel),
        **ADAMW,
    )
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(3):
        x, y = _x(step, sharded)
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), max_grad_norm if max_grad_norm else math.inf
        )
        torch.testing.assert_close(optim.grad_norm(), full(norm), rtol=1e-5, atol=1e-6)
        plain.step()
        plain.zero_grad()
    if max_grad_norm is None or bucket_numel > 10_000:
        assert_match(model, reference)


def test_reentrant_checkpointing_is_one_pass_plain_module():
    """Nested graph tasks belong to the outer backward: one norm, and exact clipping on a
    one-bucket module (clipping must see every gradient of the backward)."""
    _reentrant(sharded=False, max_grad_norm=None, bucket_numel=20)
    _reentrant(sharded=False, max_grad_norm=0.5, bucket_numel=1 << 20)


def _reentrant_body() -> None:
    _reentrant(sharded=True, max_grad_norm=None, bucket_numel=20)


# ------------------------------------------------ 1b. backwards run from a hook (GradCache)


def _grad_cache_backward(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    nested: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> None:
    """GradCache's backward (sentence-transformers' ``Cached*`` losses): the loss on detached
    outputs of each mini-batch, backpropagated to them; then, from a tensor hook of the
    returned loss as its backward runs, one surrogate backward per mini-batch through the model
    with the cached gradient, all inside ``nested()``."""
    xs, ys = x.split(2), y.split(2)
    with torch.no_grad():
        outs = [model(chunk).requires_grad_() for chunk in xs]
    loss = sum(
        nn.functional.mse_loss(o, t, reduction="sum") for o, t in zip(outs, ys, strict=True)
    ) / len(x)
    loss.backward()
    cached = [out.grad for out in outs]

    def surrogates(grad: torch.Tensor) -> None:
        with torch.enable_grad(), nested():
            for chunk, cached_grad in zip(xs, cached, strict=True):
                (model(chunk) * cached_grad * grad).sum().backward()

    loss = loss.detach().requires_grad_()
    loss.register_hook(surrogates)
    loss.backward()


def _grad_cache(sharded: bool, max_grad_norm: float | None) -> None:
    def loops() -> tuple[nn.Module, nn.Module, OptimizerInBackward]:
        model, reference = make_models()
        if sharded:
            shard(model)
            shard(reference)
        options = InBackwardOptions(max_grad_norm=max_grad_norm)
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, options=options, **ADAMW)
        return model, reference, optim

    model, _, _ = loops()
    _refused_unmoved(
        model,
        "run from a hook of another backward",
        lambda: _grad_cache_backward(model, *_x(0, sharded)),
    )
    # Afresh: FSDP2 does not recover from an exception inside its backward.
    model, reference, optim = loops()
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(3):
        _grad_cache_backward(model, *_x(step, sharded), nested=optim.accumulate)
        optim.step()
        optim.zero_grad()
        _grad_cache_backward(reference, *_x(step, sharded))
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_backwards_nested_in_a_hook_refused_plain_module(max_grad_norm):
    """GradCache's surrogate backwards run from a hook of the outer backward, no autograd
    Function around them: the plain optimizer steps their summed gradients once. Stepped one
    by one, the first moved every parameter before the second raised (1.0e-2 moved, 3.0e-2
    from plain after three steps of a tiny Llama). Refused at the first nested backward's
    first gradient, nothing moved; run under ``accumulate()`` with ``step()`` after, as the
    message says, equal."""
    _grad_cache(sharded=False, max_grad_norm=max_grad_norm)


def test_backward_on_a_thread_python_did_not_start_as_plain():
    """A CPU backward on a thread started outside ``threading`` (``_thread.start_new_thread``,
    as C code starts one): its hooks run on that thread, which Python records as a dummy
    thread, as autograd's device threads are. That was taken for a backward run from a hook
    of another and refused; stepped now, equal."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    done = []

    def train() -> None:
        try:
            _step_both(((model, optim),), 0, zero=True)
            done.append(None)
        except BaseException as error:  # reported on the test's thread
            done.append(error)

    _thread.start_new_thread(train, ())
    while not done:
        time.sleep(1e-3)
    if done[0] is not None:
        raise done[0]
    _step_both(((reference, plain),), 0, zero=True)
    assert_match(model, reference)


def _grad_cache_body() -> None:
    _grad_cache(sharded=True, max_grad_norm=0.5)


# ------------------------------------------- 2. group and instance state of the wrapped class


class GroupStepLamb(torch.optim.Optimizer):
    """LAMB as timm writes it, reduced to what matters here: a step counter in each param
    group (``group["step"] += 1`` once per ``step()``), bias correction from it, and a trust
    ratio from the norms of the whole parameter and of its update."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.99), eps: float = 1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            c1, c2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (state["exp_avg"] / c1) / (
                    (state["exp_avg_sq"] / c2).sqrt() + group["eps"]
                )
                w_norm, u_norm = p.norm(), update.norm()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update * ratio, alpha=-group["lr"])


@declare_stepping("elementwise")
class OutOfPlaceMomentum(torch.optim.Optimizer):
    """SGD with momentum on matrices as hand-written optimizers often are: the buffer and a
    step count replaced out of place at every step, the last two gradients kept in a list, an
    average of the weights added to the state at the second step; a vector's entry looked up
    and left empty (plain SGD for it)."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if param.dim() < 2:
                    param.sub_(group["lr"] * param.grad)
                    continue
                if not state:
                    state["buf"] = torch.zeros_like(param)
                    state["count"] = 0
                    state["recent"] = []
                state["recent"] = [*state["recent"][-1:], param.grad.clone()]
                state["buf"] = state["buf"] * group["beta"] + param.grad
                state["count"] = state["count"] + 1
                if state["count"] == 2:
                    state["average"] = param.clone()
                elif "average" in state:
                    state["average"] = (state["average"] + param) / 2
                param.sub_(group["lr"] * state["buf"])


class InstanceCountSGD(torch.optim.Optimizer):
    """SGD whose lr decays with a counter kept on the instance (``self.t += 1``)."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / math.sqrt(self.t))


class NormInGroup(torch.optim.SGD):
    """Writes a value that depends on the parameters stepped into its group: no per-bucket
    stepping can reproduce it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["last_norm"] = float(
                sum(p.grad.norm() ** 2 for p in group["params"] if p.grad is not None)
            )
        return super().step()


def _counters(sharded: bool, cls: type, stepping: str | None) -> None:
    """``stepping``: ``None`` (an undeclared class: stepped jointly), or ``"dtensor"`` (bucket
    by bucket, its group and instance state tracked)."""
    model, reference = make_models()
    if sharded:
        shard(model)
        shard(reference)
    head = list(model.head.parameters())
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    ref_head = list(reference.head.parameters())
    ref_body = [p for n, p in reference.named_parameters() if not n.startswith("head")]
    optim = OptimizerInBackward(
        [{"params": body}, {"params": head, "lr": 3e-3}], cls, bucket_numel=20, stepping=stepping
    )
    plain = cls([{"params": ref_body}, {"params": ref_head, "lr": 3e-3}])
    for step in range(4):
        x, y = _x(step, sharded)
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        plain.step()
        plain.zero_grad()
    # A step() without a backward advances the counters, as plain's does.
    optim.step()
    plain.step()
    assert_match(model, reference)
    assert [g.get("step") for g in optim.param_groups] == [
        g.get("step") for g in plain.param_groups
    ]


@pytest.mark.parametrize("stepping", [None, "dtensor"], ids=["joint", "per-bucket"])
def test_group_step_counter_trains_like_plain(stepping):
    _counters(False, GroupStepLamb, stepping)


@pytest.mark.parametrize("stepping", [None, "dtensor"], ids=["joint", "per-bucket"])
def test_instance_counter_trains_like_plain(stepping):
    _counters(False, InstanceCountSGD, stepping)


class DeviceReadingLamb(GroupStepLamb):
    """Reads its first group's first parameter at the top of ``step()``, as timm's ``Lamb``
    does for its device."""

    @torch.no_grad()
    def step(self, closure=None):
        self.param_groups[0]["params"][0].device  # noqa: B018
        return super().step(closure)


def test_group_without_gradients_stepped_with_its_parameters():
    """Two param groups, a branch not taken in one step (its group gets no gradient): the
    class's step visits that group with its parameters, as the plain optimizer's does (given
    none, it raised an IndexError after the other group moved)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.ModuleDict({"a": nn.Linear(6, 3), "side": nn.Linear(6, 3)}))
    model, reference = models

    def groups(net: nn.Module) -> list[dict]:
        return [
            {"params": list(net["a"].parameters())},
            {"params": list(net["side"].parameters()), "lr": 3e-3},
        ]

    optim = OptimizerInBackward(groups(model), DeviceReadingLamb)
    plain = DeviceReadingLamb(groups(reference))
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        for net, opt in ((model, optim), (reference, plain)):
            out = net["a"](x) + (net["side"](x) if step != 1 else 0)
            (out - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)
    assert [g["step"] for g in optim.param_groups] == [g["step"] for g in plain.param_groups]


@pytest.mark.parametrize("accumulated", [False, True], ids=["in-backward", "at-step"])
@pytest.mark.parametrize(
    ("cls", "stepping"),
    [(GroupStepLamb, None), (GroupStepLamb, "dtensor"), (InstanceCountSGD, "dtensor")],
    ids=["joint", "per-bucket", "instance-counter"],
)
def test_nonfinite_step_skipped_for_a_class_counting_in_its_groups(cls, stepping, accumulated):
    """``skip_nonfinite`` and a NaN loss: every bucket is skipped and nothing moves, the
    whole step skipped as the plain loop checking the gradients skips it (GradScaler's
    ``step`` does not call the optimizer's): a class counting steps in its groups or on
    itself counts none, stepped in backward or at ``step()`` (micro-batches under
    ``accumulate()``). Before, its step visited its groups with no gradient and advanced the
    counter (a class decaying its lr by its own count 4.2e-3 apart after two NaN batches in
    seven steps, no error); earlier still, the freed gradients of the skipped buckets reached it (a
    misleading error about reading gradients)."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(), cls, skip_nonfinite=True, bucket_numel=20, stepping=stepping
    )
    plain = cls(reference.parameters())
    for step in range(4):
        before = _snapshot(model)
        for net, opt in ((model, optim), (reference, plain)):
            held = opt is optim and accumulated
            with optim.accumulate() if held else contextlib.nullcontext():
                for micro in range(2 if accumulated else 1):
                    loss = loss_fn(net, *_x(2 * step + micro))
                    (loss * float("nan") if step == 1 else loss).backward()
            if opt is optim or all(p.grad.isfinite().all() for p in net.parameters()):
                opt.step()  # the plain loop skips a non-finite step: no step() at all
            opt.zero_grad()
        if step == 1:
            _assert_unchanged(model, before)
    assert_match(model, reference)
    counted = (lambda o: o.param_groups[0]["step"]) if cls is GroupStepLamb else (lambda o: o.t)
    assert counted(optim) == counted(plain) == 3


@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_nonfinite_step_skipped_beside_a_class_skipping_on_the_device(head):
    """One optimizer, fused AdamW on the body (skipped on the device through ``found_inf``)
    and a class counting steps in its groups on the head (skipped on the host), a NaN loss:
    the head's group counts no step, as the plain loop calling no ``step()``. Trained, its
    buckets were skipped (it counted one, the device's skips being unknown on the host: 4
    against 3 two steps later, no error). Frozen, it gets no gradient, and a step that
    stepped something visits it, as the plain ``step()`` does; whether the body's buckets
    were all skipped is read from the device's flags where that decides (it counted one, 4
    against 3, no error)."""
    model, reference = make_models()
    if head == "frozen":
        model.head.requires_grad_(False)
        reference.head.requires_grad_(False)

    def groups(net: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        body = [p for n, p in net.named_parameters() if not n.startswith("head")]
        return body, list(net.head.parameters())

    body, head_params = groups(model)
    optim = OptimizerInBackward(
        [
            {"params": body, "optimizer_cls": torch.optim.AdamW, "fused": True, "lr": 1e-2},
            {"params": head_params},
        ],
        GroupStepLamb,
        skip_nonfinite=True,
        bucket_numel=20,
        stepping="dtensor",
    )
    body, head_params = groups(reference)
    plain = [torch.optim.AdamW(body, lr=1e-2, fused=True), GroupStepLamb(head_params)]
    for step in range(4):
        for net, opts in ((model, [optim]), (reference, plain)):
            loss = loss_fn(net, *_x(step))
            (loss * float("nan") if step == 1 else loss).backward()
            for opt in opts:
                if opt is optim or step != 1:  # the plain loop skips the NaN step
                    opt.step()
                opt.zero_grad()
    assert_match(model, reference)
    assert optim.param_groups[1]["step"] == plain[1].param_groups[0]["step"] == 3


class InstanceNormSGD(torch.optim.Optimizer):
    """SGD noting the norm of all its gradients on itself, for logging."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))
        self.last_norm = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.last_norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_joint_class_steps_every_group_in_one_call():
    """A class noting a value over all its gradients on itself, a group that got no gradient
    (a frozen head): its step runs once on every group, as the plain optimizer's (the group
    without gradients was stepped in a call of its own, whose value disagreed: refused after
    the other parameters moved)."""
    model, reference = make_models(freeze=("head",))

    def groups(net: nn.Module) -> list[dict]:
        body = [p for n, p in net.named_parameters() if not n.startswith("head")]
        return [{"params": body}, {"params": list(net.head.parameters()), "lr": 0.01}]

    optim = OptimizerInBackward(groups(model), InstanceNormSGD, bucket_numel=20)
    plain = InstanceNormSGD(groups(reference))
    for step in range(3):
        _step_both(((model, optim), (reference, plain)), step, zero=True)
        assert optim._stepper.steppers[None].optimizer.last_norm == pytest.approx(
            plain.last_norm, rel=1e-6
        )
    assert_match(model, reference)


def _actor_and_critic() -> tuple[nn.Module, nn.Module]:
    """An actor and a critic head, and a copy of the pair."""
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        pair.append(nn.ModuleDict({"actor": nn.Linear(6, 3), "critic": nn.Linear(6, 1)}))
    return pair[0], pair[1]


@pytest.mark.parametrize("cls", [GroupStepLamb, InstanceCountSGD])
@pytest.mark.parametrize("stepping", [None, "dtensor"], ids=["joint", "per-bucket"])
def test_two_backwards_on_disjoint_parameters_with_a_counting_class(cls, stepping):
    """An actor's and a critic's loss, two backwards on disjoint parameters, one ``step()``:
    the plain optimizer advances a class's step counter once; here each backward's pass ran
    the class's step (InstanceCountSGD 3.8e-2 apart, counters 8 against 4, no error). Refused
    at the second backward, before it moves anything; with the first under ``accumulate()``,
    equal."""

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model, _ = _actor_and_critic()
    optim = OptimizerInBackward(model.parameters(), cls, stepping=stepping)
    model["actor"](x).square().mean().backward()
    _refused_unmoved(
        model, "a second backward", lambda: model["critic"](x).square().mean().backward()
    )
    model, reference = _actor_and_critic()
    optim = OptimizerInBackward(model.parameters(), cls, stepping=stepping)
    plain = cls(reference.parameters())
    for _ in range(3):
        with optim.accumulate():
            model["actor"](x).square().mean().backward()
        model["critic"](x).square().mean().backward()
        reference["actor"](x).square().mean().backward()
        reference["critic"](x).square().mean().backward()
        for opt in (optim, plain):
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


def _critic_then_actor(model: nn.Module, optim: Optimizer, x: torch.Tensor) -> None:
    """One iteration of an actor-critic loop with one optimizer: ``zero_grad()``, the
    critic's loss stepped, its gradient dropped, then the actor's loss stepped."""
    optim.zero_grad()
    model["critic"](x).square().mean().backward()
    optim.step()
    model["critic"].zero_grad()
    model["actor"](x).square().mean().backward()
    optim.step()


@pytest.mark.parametrize(
    "variant", ["as written", "critic frozen", "inputs=", "accumulate()", "critic zeroed"]
)
@pytest.mark.parametrize("bucket_numel", [None, 1], ids=["one-bucket", "per-parameter"])
def test_step_on_part_of_the_model_with_an_earlier_step_gradient_held(variant, bucket_numel):
    """One optimizer over an actor and a critic, ``zero_grad()`` once per iteration and
    ``step()`` twice: the critic's loss stepped, then the actor's, whose backward reaches the
    actor only (or is told so by ``inputs=``, or runs with the critic frozen, as Spinning Up's
    SAC does). The plain second ``step()`` steps the critic's gradient a second time (it is
    still held); here it was stepped once and freed, and that ``step()`` went through (the
    critic 3.7e-2 apart after four iterations, step counters 8 against 4, no error). Refused
    where the actor's backward starts, before anything moves (with that backward under
    ``accumulate()``, at the ``step()`` after it, which said "no backward since" before);
    with the critic's gradient dropped in between (``critic.zero_grad()``), equal."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model, reference = _actor_and_critic()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.Adam, lr=1e-2, bucket_numel=bucket_numel
    )
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    if variant != "critic zeroed":
        optim.zero_grad()
        model["critic"](x).square().mean().backward()
        optim.step()
        if variant == "critic frozen":
            model["critic"].requires_grad_(False)
        actor_loss = model["actor"](x).square().mean()
        inputs = list(model["actor"].parameters()) if variant == "inputs=" else None
        refusal = r"an earlier step\(\) committed"
        if variant == "accumulate()":
            with optim.accumulate():
                actor_loss.backward()
            _refused_unmoved(model, refusal, optim.step)
        else:
            _refused_unmoved(model, refusal, lambda: actor_loss.backward(inputs=inputs))
        return
    for _ in range(4):
        _critic_then_actor(model, optim, x)
        _critic_then_actor(reference, plain, x)
    assert_match(model, reference)


def _two_phases(make: Callable[[nn.Module], Optimizer], leave: str) -> nn.Module:
    """Two phases of training, each with an optimizer of its own; the first leaves after a
    backward with no ``step()`` (its step budget checked after backward), by ``leave``:
    ``"del"`` (the optimizer dropped), ``"detach"`` (ours detached, then dropped), ``"step
    after detach"`` (detached, then its ``step()``), ``"load"`` (the weights of before that
    backward loaded into the model; ``"detach, then load"``) or ``".data"`` (assigned
    through ``.data``)."""
    model, _ = make_models()
    saved = copy.deepcopy(model.state_dict())
    optim = make(model)
    for step in range(3):
        optim.zero_grad()
        saved = copy.deepcopy(model.state_dict())
        loss_fn(model, *_x(step)).backward()
        if step == 2:
            break
        optim.step()
    if "detach" in leave and isinstance(optim, OptimizerInBackward):
        optim.detach()
    if leave == "step after detach":
        optim.step()
    if leave.endswith("load"):
        model.load_state_dict(saved)
    if leave == ".data":
        for name, param in model.named_parameters():
            param.data = saved[name].clone()
    del optim
    optim = make(model)
    for step in range(3, 6):
        optim.zero_grad()
        loss_fn(model, *_x(step)).backward()
        optim.step()
    return model


@pytest.mark.parametrize(
    "leave", ["del", "detach", "step after detach", "load", "detach, then load", ".data"]
)
def test_a_new_optimizer_after_a_backward_left_uncommitted(leave):
    """The plain optimizer never applies the gradients of a backward it leaves without
    ``step()`` (the next phase's ``zero_grad()`` drops them); here they were applied in
    backward, and the next phase trained on from other weights (AdamW 1.9e-2 apart after
    three steps, no error: a warning as the old optimizer was collected). Refused when the
    next phase's optimizer is built, before it steps anything; equal where the update was
    committed (``step()`` after ``detach()``, as the plain loop's ``step()``) or the weights
    of before that backward were loaded."""
    ours = lambda m: OptimizerInBackward(m.parameters(), torch.optim.AdamW, **ADAMW)  # noqa: E731
    plain = lambda m: torch.optim.AdamW(m.parameters(), **ADAMW)  # noqa: E731
    if leave in ("del", "detach"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the collected optimizer's
            with pytest.raises(ValueError, match="no step\\(\\) committed"):
                _two_phases(ours, leave)
        return
    assert_match(_two_phases(ours, leave), _two_phases(plain, leave))


@pytest.mark.parametrize("second", ["backward", "gradient set by hand"])
def test_second_pass_before_step_refused_with_clipping(second):
    """An actor's and a critic's loss, two backwards on disjoint parameters (or one backward,
    then a gradient set by hand), one ``step()``, clipped: the plain loop clips by the norm of
    all the step's gradients (``clip_grad_norm_``), where the first backward's updates here
    were clipped by its own (AdamW 2.1e-3 apart with the default buckets, no error; a hand-set
    gradient 3.9e-3). Refused at the second pass, before it moves anything; with the first
    under ``accumulate()``, equal to the plain clipped loop. ``skip_nonfinite``, which decides
    bucket by bucket, is equal either way (finite gradients here); ``grad_norm()`` is the
    norm of all the step's gradients either way."""

    def critic(net: nn.Module) -> None:
        if second == "backward":
            net["critic"](x).square().mean().backward()
        else:
            for p in net["critic"].parameters():
                p.grad = torch.ones_like(p)

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model, _ = _actor_and_critic()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05)
    model["actor"](x).square().mean().backward()
    second_pass = (lambda: critic(model)) if second == "backward" else optim.step
    if second != "backward":
        critic(model)
    _refused_unmoved(model, "a second backward", second_pass)
    cases = ((dict(max_grad_norm=0.05), True), (dict(skip_nonfinite=True), False))
    for options, accumulate in cases:
        model, reference = _actor_and_critic()
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, **options)
        plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for _ in range(3):
            with optim.accumulate() if accumulate else contextlib.nullcontext():
                model["actor"](x).square().mean().backward()
            critic(model)
            reference["actor"](x).square().mean().backward()
            critic(reference)
            clip = options.get("max_grad_norm", math.inf)
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            for opt in (optim, plain):
                opt.step()
                opt.zero_grad()
            # The norm of all the step's gradients (it was the last pass's: 2.38 for 2.76).
            torch.testing.assert_close(optim.grad_norm(), norm, rtol=1e-5, atol=1e-6)
        assert_match(model, reference)


def _saved_tensors_hooks(kind: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The critic applied under saved-tensor hooks of ``kind``: non-reentrant activation
    checkpointing (it recomputes in backward with the weights of then), ``save_on_cpu`` (on
    the CPU it saves the tensors themselves), or hooks of the loop's own saving them as they
    are."""
    if kind == "checkpoint":
        return lambda critic, h: checkpoint(critic, h, use_reentrant=False)
    hooks = {
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    }[kind]

    def apply(critic: nn.Module, h: torch.Tensor) -> torch.Tensor:
        with hooks():
            return critic(h)

    return apply


@pytest.mark.parametrize("kind", ["checkpoint", "save_on_cpu", "identity"])
def test_second_backward_reading_updated_weights_under_saved_tensor_hooks_refused(kind):
    """An actor and a critic: both losses computed, then ``critic_loss.backward(inputs=critic
    params)`` and ``actor_loss.backward(inputs=actor params)``, whose graph reads the critic's
    weights. Without hooks autograd refuses the second backward (the critic's saved weights
    changed: "modified by an inplace operation"). Under saved-tensor hooks it checks nothing,
    and the actor's gradient came from the critic's updated weights (SGD 1.2e-2 apart after
    three steps, 9.2e-3 with the critic checkpointed, no error). Refused in the second
    backward before it moves anything (at the first node that reads an updated weight saved
    through the hooks, or else at its first gradient: the critic's weights were saved through
    them); with the first backward under ``accumulate()``, equal to the plain loop."""
    apply = _saved_tensors_hooks(kind)

    def losses(actor: nn.Module, critic: nn.Module, step: int) -> tuple[torch.Tensor, ...]:
        state = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        action = actor(state)
        actor_loss = -apply(critic, torch.cat([state, action], 1)).mean()
        critic_loss = (critic(torch.cat([state, action.detach()], 1)) - 1).square().mean()
        return actor_loss, critic_loss

    def pair() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)
        )

    actor, critic = pair()
    model = nn.ModuleList([actor, critic])
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_numel=1)
    actor_loss, critic_loss = losses(actor, critic, 0)
    critic_loss.backward(inputs=list(critic.parameters()))
    _refused_unmoved(
        model,
        "saved-tensor hooks",
        lambda: actor_loss.backward(inputs=list(actor.parameters())),
    )
    (actor, critic), (ref_actor, ref_critic) = pair(), pair()
    model, reference = nn.ModuleList([actor, critic]), nn.ModuleList([ref_actor, ref_critic])
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_numel=1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        actor_loss, critic_loss = losses(actor, critic, step)
        with optim.accumulate():
            critic_loss.backward(inputs=list(critic.parameters()))
        actor_loss.backward(inputs=list(actor.parameters()))
        actor_loss, critic_loss = losses(ref_actor, ref_critic, step)
        critic_loss.backward(inputs=list(ref_critic.parameters()))
        actor_loss.backward(inputs=list(ref_actor.parameters()))
        for opt in (optim, plain):
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


def test_gradients_set_by_hand_after_a_backward_under_saved_tensor_hooks_refused():
    """A backward whose forward ran under non-reentrant checkpointing steps the actor; the
    critic's gradients are then computed by ``torch.autograd.grad`` through the same graph and
    set by hand, and ``step()`` would step them: autograd checked none of the tensors saved
    through the hooks, and the recomputation read the actor's updated weights unseen (SGD
    1.8e-2 apart from the plain loop after three such steps, no error). ``step()`` refuses
    before it moves anything."""
    torch.manual_seed(0)
    actor, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleList([actor, critic])
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_numel=1)
    state = torch.randn(8, 4)
    value = checkpoint(lambda s: critic(actor(s)), state, use_reentrant=False).mean()
    value.backward(inputs=list(actor.parameters()), retain_graph=True)
    grads = torch.autograd.grad(value, list(critic.parameters()))
    for param, grad in zip(critic.parameters(), grads, strict=True):
        param.grad = grad
    _refused_unmoved(model, "saved-tensor hooks", optim.step)


@pytest.mark.parametrize(
    "nonfinite", ["first backward", "second backward", "gradient set by hand", "both"]
)
def test_nonfinite_in_one_pass_of_several_refused_at_step(nonfinite):
    """``skip_nonfinite``, an actor's and a critic's loss, two backwards on disjoint parameters
    (or a backward, then a gradient set by hand) before one ``step()``, one of them not
    finite: the plain loop checking the step's gradients skips the whole step; here the
    finite pass's updates were made (1.0e-2 apart after four AdamW steps, the critic's loss
    NaN at the second, no error). Refused
    at ``step()``, the finite pass's update standing; both passes not finite, nothing moves,
    as in the plain loop. See [Note: non-finite gradients in one pass of several]."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    nan = torch.tensor(math.nan)

    def losses(net: nn.Module) -> None:
        scale = nan if nonfinite in ("first backward", "both") else 1.0
        (net["actor"](x).square().mean() * scale).backward()
        if nonfinite == "gradient set by hand":
            for p in net["critic"].parameters():
                p.grad = torch.full_like(p, math.nan)
            return
        scale = nan if nonfinite in ("second backward", "both") else 1.0
        (net["critic"](x).square().mean() * scale).backward()

    model, reference = _actor_and_critic()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, skip_nonfinite=True)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses(model)
    losses(reference)
    if torch.isfinite(torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)):
        plain.step()
    if nonfinite == "both":
        optim.step()
        assert_match(model, reference)
        return
    with pytest.raises(RuntimeError, match="skip_nonfinite, one backward of this step"):
        optim.step()


def test_finite_gradients_set_by_hand_after_a_skipped_backward_refused_before_they_move():
    """``skip_nonfinite``, an actor's NaN loss (skipped in backward: nothing moved), then finite
    gradients set by hand on the critic before ``step()``: the plain loop checking the step's
    gradients skips the whole step; here ``step()`` stepped the critic before it refused the
    step (the critic 1.0e-2 from its start, an error after it moved). Refused before they move
    now; with them set to None, ``step()`` skips the step as the plain loop does, and the
    next steps train as its. See [Note: non-finite gradients in one pass of several]."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model, reference = _actor_and_critic()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, skip_nonfinite=True)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        for net in (model, reference):
            scale = math.nan if step == 0 else 1.0
            (net["actor"](x).square().mean() * scale).backward()
            for p in net["critic"].parameters():
                p.grad = torch.full_like(p, 0.5)
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)):
            plain.step()
        plain.zero_grad()
        if step == 0:
            _refused_unmoved(model, "the gradients set by hand since are finite", optim.step)
            for p in model["critic"].parameters():
                p.grad = None
        optim.step()
        optim.zero_grad()
    assert_match(model, reference)


def test_a_skipped_batch_is_dropped_with_step_and_the_next_norm_is_its_own():
    """``skip_nonfinite`` and a NaN loss, the loop dropping the batch as a plain loop does,
    with ``zero_grad()`` and no ``step()``: refused, as the skip was made on the device and
    not read back, and the message now says to call ``step()`` for such a batch too (it
    spoke of updates already stepped). With ``step()``, the next batch trains as the plain
    loop's, its norm its own."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, skip_nonfinite=True, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    (loss_fn(model, *_x(0)) * math.nan).backward()
    assert optim.grad_norm().isnan()
    with pytest.raises(RuntimeError, match="With skip_nonfinite, a batch whose gradients"):
        optim.zero_grad()
    optim.step()
    optim.zero_grad()
    (loss_fn(reference, *_x(0)) * math.nan).backward()
    plain.zero_grad()
    _step_both(((model, optim),), 1, zero=True)
    loss_fn(reference, *_x(1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)
    plain.step()
    torch.testing.assert_close(optim.grad_norm(), norm, rtol=1e-5, atol=1e-6)
    assert_match(model, reference)


def test_group_state_depending_on_parameters_refused_per_bucket_equal_jointly():
    """A class writing a norm over the parameters it steps into its group: declared to step
    bucket by bucket, refused by the check before the first update; undeclared, stepped
    jointly in one call per backward, equal to the plain optimizer."""
    model, _ = make_models()
    _optim = OptimizerInBackward(
        model.parameters(), NormInGroup, lr=0.1, bucket_numel=20, stepping="dtensor"
    )
    before = _snapshot(model)
    x, y = _x(0)
    with pytest.raises(RuntimeError, match="wrote different values in param group 0"):
        loss_fn(model, x, y).backward()
    _assert_unchanged(model, before)
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), NormInGroup, lr=0.1, bucket_numel=20)
    plain = NormInGroup(reference.parameters(), lr=0.1)
    for step in range(3):
        _step_both(((model, optim), (reference, plain)), step, zero=False)
        assert optim.param_groups[0]["last_norm"] == pytest.approx(
            plain.param_groups[0]["last_norm"], rel=1e-6
        )
        optim.zero_grad()
        plain.zero_grad()
    assert_match(model, reference)


def _refused_on_every_rank_body() -> None:
    """``NormInGroup`` declared elementwise on 4 ranks of FSDP2: the check before its first
    update sees the halves of a bucket write different norms on the ranks holding rows, but
    alike (zero) on the last rank, whose shards of the first bucket are empty; every rank now
    raises (before, the last rank went on alone to the next collective and waited there)."""
    model, _ = make_models()
    shard(model)
    _optim = OptimizerInBackward(model.parameters(), NormInGroup, lr=0.1, stepping="elementwise")
    before = [full(p).detach().clone() for p in model.parameters()]
    x, y = batch(0)
    with pytest.raises(RuntimeError, match=r"wrote different values|refused it on another rank"):
        loss_fn(model, rank_slice(x), rank_slice(y)).backward()
    for param, value in zip(model.parameters(), before, strict=True):
        assert torch.equal(full(param).detach(), value)


def test_a_class_refused_by_some_ranks_is_refused_by_every_rank(worlds):
    worlds.run(4, _refused_on_every_rank_body)


def _lamb_body(stepping: str | None) -> None:
    _counters(True, GroupStepLamb, stepping)


class GlobalClipSGD(torch.optim.Optimizer):
    """SGD clipping every gradient by the norm of all of them inside ``step()``, as timm's
    ``Lamb`` and apex's ``FusedLAMB`` do with their own ``max_grad_norm``; it writes nothing
    to its groups or itself."""

    def __init__(self, params, lr: float = 0.1, max_grad_norm: float = 0.1):
        super().__init__(params, dict(lr=lr, max_grad_norm=max_grad_norm))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            coef = torch.clamp(group["max_grad_norm"] / (norm + 1e-6), max=1.0)
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * coef, alpha=-group["lr"])


def _global_clip(sharded: bool) -> None:
    """Several buckets; the body frozen for two steps (only the head's bucket trains), then
    unfrozen, as linear probing then fine-tuning does."""
    model, reference = make_models()
    if sharded:
        shard(model)
        shard(reference)
    for net in (model, reference):
        net.requires_grad_(False)
        net.head.requires_grad_(True)
    with pytest.warns(UserWarning, match="stepped jointly"):
        optim = OptimizerInBackward(model.parameters(), GlobalClipSGD, bucket_numel=20)
    plain = GlobalClipSGD(reference.parameters())
    for step in range(4):
        if step == 2:
            model.requires_grad_(True)
            reference.requires_grad_(True)
        for net, opt in ((model, optim), (reference, plain)):
            loss_fn(net, *_x(step, sharded)).backward()
            if opt is optim:
                assert not any(holds_gradient(p) for p in model.parameters())
            opt.step()
            opt.zero_grad()
        assert_match(model, reference)


def test_class_clipping_inside_its_step_equal_with_several_buckets():
    """A class clipping by the norm of all its gradients inside ``step()``, as timm's ``Lamb``
    and apex's ``FusedLAMB`` do with their own ``max_grad_norm``: stepped bucket by bucket, each
    call would clip by its own bucket's norm (1.1e-4 apart after one step on a 16.8M-parameter
    module cut into two buckets, with no error; a check on copies missed timm's ``Lamb``, whose
    first update does not change when every gradient is scaled alike). Undeclared, it is
    stepped jointly, in one call at the end of backward: equal, with several buckets from the
    start and after unfreezing."""
    _global_clip(sharded=False)


def _global_clip_body() -> None:
    _global_clip(sharded=True)


@declare_stepping("elementwise")
class _DeclaredSGD(torch.optim.SGD):
    pass


@declare_stepping("elementwise")
class _DeclaredAdagrad(torch.optim.Adagrad):
    pass


@declare_stepping("elementwise")
class _DeclaredAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (_DeclaredSGD, dict(lr=1e-2, momentum=0.9, fused=True)),
        (_DeclaredAdagrad, dict(lr=1e-2, fused=True)),
        (_DeclaredAdamW, dict(lr=1e-3, fused=True)),
    ],
    ids=["sgd", "adagrad", "adamw"],
)
def test_declared_elementwise_subclasses_of_fused_kernels_pass_the_check(cls, kwargs, dtype):
    """Subclasses of torch's classes declared elementwise, on fused kernels, with rows of odd
    widths: the check before the first update does not refuse them, and they train as the
    plain class does. Torch's fused SGD with momentum and fused Adagrad round a few bfloat16
    elements otherwise at another offset (a shard's halves stepped apart: 0.12 apart on 16 of
    21K elements), which a check comparing each element refused; the check compares the
    moves summed, on float32 copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 333), nn.Linear(333, 63)).to(dtype)
    reference = copy.deepcopy(model)
    optim = OptimizerInBackward(model.parameters(), cls, **kwargs)
    plain = cls(reference.parameters(), **kwargs)
    for step in range(3):
        x = torch.randn(16, 7, dtype=dtype, generator=torch.Generator().manual_seed(step))
        for net, opt in ((model, optim), (reference, plain)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_state_dict(model.state_dict(), reference.state_dict())


def _global_clip_declared(sharded: bool) -> None:
    """The same class declared to step bucket by bucket: each bucket's step would clip by
    that bucket's norm (measured on the code before, four steps, ``bucket_numel=20``: 1.9e-2
    from the plain class on one process, 1.4e-2 declared "dtensor" and 2.4e-2 "elementwise"
    on 3 ranks, no error). The check before its first update steps two parameters of a held
    bucket together on copies, compares them with the bucket's halves stepped apart, and
    refuses it, on every rank, before anything moves. At lr 0 too (a warmup from lr 0, whose
    first update moves nothing to compare), the copies stepping at 1e-3: before, the class
    was stepped bucket by bucket from the second step on (a warmup from lr 0 over two steps,
    four steps: 1.3e-2 from the plain class on one process declared "dtensor", 9.8e-3 and
    1.4e-2 on 2 ranks declared "dtensor" and "elementwise", no error). Near lr 0 as well (a
    first step at 1e-7, then 0.1), where the copies, in bfloat16, showed no move: 1.2e-2 and
    1.7e-2 on 2 ranks declared "dtensor" and "elementwise" after four steps, no error; in
    float32, declared "dtensor", one rank's shards showed the difference and the other's not,
    and the rank that stopped there left the other waiting in the pairs' collectives: a hang.
    Below 1e-3 the copies now step at 1e-3, in float32, and every rank steps every pair.

    And where the first gradients do not reach the class's threshold (``max_grad_norm=5``,
    their norm 2.6), which a loss spike crosses later: the halves and the pair moved alike,
    and the class was stepped bucket by bucket (the loss scaled by 10 from the third step,
    four steps: 0.17 from the plain class on a plain module, 0.15 on 1, 2 and 3 ranks
    declared "dtensor", 0.17 "elementwise" on 2 and 3 ranks, no error). The check now also steps one
    parameter alone and beside a copy of itself on gradients scaled up (largest element 1e4):
    the threshold is crossed, otherwise by the two."""
    cases = [(0.1, torch.float32, 0.1), (0.0, torch.float32, 0.1), (1e-7, torch.float32, 0.1)]
    cases += [(1e-7, torch.bfloat16, 0.1), (0.1, torch.float32, 5.0)]
    for stepping, (lr, dtype, max_norm) in itertools.product(("dtensor", "elementwise"), cases):
        model, _ = make_models()
        model.to(dtype)
        if sharded:
            shard(model)
        _optim = OptimizerInBackward(
            model.parameters(),
            GlobalClipSGD,
            options=InBackwardOptions(bucket_numel=20, stepping=stepping),
            lr=lr,
            max_grad_norm=max_norm,
        )
        before = _snapshot(model)
        x, y = _x(0, sharded)
        with pytest.raises(RuntimeError, match=r"moved (them|it) .*otherwise|another rank"):
            loss_fn(model, x.to(dtype), y.to(dtype)).backward()
        _assert_unchanged(model, before)
    _, reference = make_models()
    loss_fn(reference, *batch(0)).backward()
    first = torch.stack([p.grad.norm() for p in reference.parameters()]).norm()
    assert 1 < first < 5.0, "the last case's threshold must be above the first gradients' norm"


def test_class_clipping_inside_its_step_declared_is_refused():
    _global_clip_declared(sharded=False)


class PositionalSGD(torch.optim.Optimizer):
    """SGD with a per-parameter lr multiplier kept in a list aligned with the parameters and
    read by position in ``group["params"]``, as layer-wise lr decay written into a class
    does; it writes nothing to its groups or itself."""

    def __init__(self, params, lr: float = 0.05):
        super().__init__(params, dict(lr=lr))
        count = sum(len(group["params"]) for group in self.param_groups)
        self.multipliers = [1.0 + 0.5 * i for i in range(count)]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.multipliers[i])


@pytest.mark.parametrize("stepping", ["elementwise", "dtensor"])
def test_class_reading_positions_declared_with_one_parameter_buckets_is_refused(stepping):
    """A class reading a parameter's position in its group, declared to step bucket by bucket,
    with one parameter in every bucket (``bucket_numel=1``): every bucket's step saw its
    parameter first, and the check had no two parameters of a bucket to step together (2.6e-1
    from the plain class after four steps, no error). The smallest is now stepped beside a
    copy of itself: refused before anything moves."""
    model, _ = make_models()
    _optim = OptimizerInBackward(
        model.parameters(), PositionalSGD, bucket_numel=1, stepping=stepping
    )
    _refused_unmoved(
        model,
        r"moved them \(or their state\) otherwise",
        lambda: loss_fn(model, *_x(0)).backward(),
    )


def _global_clip_declared_body() -> None:
    _global_clip_declared(sharded=True)


class ClippingLamb(GroupStepLamb):
    """``GroupStepLamb`` with timm's ``max_grad_norm`` (1.0 by default, read from
    ``self.defaults`` as timm reads it): every gradient divided in place by the norm of all of
    them over it, where above 1, before the update."""

    def __init__(self, params, lr: float = 1e-2, max_grad_norm: float = 1.0):
        super().__init__(params, lr=lr)
        self.defaults["max_grad_norm"] = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            for grad in grads:
                grad.div_(torch.clamp(norm / self.defaults["max_grad_norm"], min=1.0))
        return super().step(closure)


def _clipping_lamb_declared(sharded: bool) -> None:
    """timm's ``Lamb`` (a group step counter, a trust ratio, clipping by the norm of all
    gradients) declared ``"dtensor"``: its first update is the same whatever the gradients'
    scale (Adam's first step divides it out), so the check's pieces moved alike, and each
    bucket was then clipped by its own norm (5.6e-3 from the plain class after four steps on
    a plain module and on 1 and 2 ranks, no error; the first gradients' norm, 2.6, is above
    the threshold). The check now compares the copies' state too (the moments are scaled by
    the clipping): refused at the first backward, before anything moves, by the pair of
    parameters stepped together against their halves; and with a threshold of 5, above the
    first gradients' norm, by the parameter stepped beside a copy of itself on gradients
    scaled up. Undeclared, it is stepped jointly: equal."""
    seen = {1.0: r"two parameters together moved them \(or their state\)", 5.0: r"scaled up"}
    for max_grad_norm, refusal in seen.items():
        model, _ = make_models()
        if sharded:
            shard(model)
        _optim = OptimizerInBackward(
            model.parameters(),
            ClippingLamb,
            options=InBackwardOptions(bucket_numel=20, stepping="dtensor"),
            max_grad_norm=max_grad_norm,
        )
        before = _snapshot(model)
        with pytest.raises(RuntimeError, match=rf"{refusal}|another rank"):
            loss_fn(model, *_x(0, sharded)).backward()
        _assert_unchanged(model, before)
        assert not _optim.state


def test_lamb_clipping_by_all_gradients_declared_is_refused():
    _clipping_lamb_declared(sharded=False)
    _counters(False, ClippingLamb, None)


def _clipping_lamb_declared_body() -> None:
    _clipping_lamb_declared(sharded=True)


class ClipEachSGD(torch.optim.Optimizer):
    """SGD clipping each parameter's gradient by its own norm above ``max_norm``, as
    Adafactor clips each update by its RMS (``clip_threshold``): per parameter, not per
    element."""

    def __init__(self, params, lr: float = 0.1, max_norm: float = 2.0):
        super().__init__(params, dict(lr=lr, max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    coef = torch.clamp(group["max_norm"] / (p.grad.norm() + 1e-6), max=1.0)
                    p.add_(p.grad * coef, alpha=-group["lr"])


def _clip_each_declared(sharded: bool) -> None:
    """``ClipEachSGD`` declared ``"elementwise"``, its threshold above every first gradient's
    norm: the check's rows stepped apart and together moved alike, and each rank's shard was
    then clipped by the shard's norm once a loss spike crossed it (the loss scaled by 10 from
    the third step, four steps: 0.10 and 0.15 from the plain class on 2 and 3 ranks, no
    error). The rows are now also stepped on a gradient scaled up (largest element 1e4):
    refused at the first backward, before anything moves (on one process too: the class
    does not do what it declares)."""
    model, reference = make_models()
    loss_fn(reference, *batch(0)).backward()
    assert max(p.grad.norm() for p in reference.parameters()) < 2.0
    if sharded:
        shard(model)
    _optim = OptimizerInBackward(model.parameters(), ClipEachSGD, stepping="elementwise")
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"rows of a shard.* on a gradient scaled up|another"):
        loss_fn(model, *_x(0, sharded)).backward()
    _assert_unchanged(model, before)


def test_class_clipping_each_gradient_declared_elementwise_is_refused():
    _clip_each_declared(sharded=False)


def _clip_each_rightly_declared(stepping: str) -> None:
    """``ClipEachSGD`` declared as what it does, ``"dtensor"`` (its norm of a parameter made
    global by DTensor) or ``"whole_tensor"`` (each parameter stepped whole on an owner): the
    checks on gradients scaled up refuse nothing, and four steps with a loss spike crossing its
    threshold from the third end where the plain class on one process ends."""
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), ClipEachSGD, stepping=stepping)
    plain = ClipEachSGD(reference.parameters())
    for step in range(4):
        scale = 10.0 if step >= 2 else 1.0
        x, y = batch(step, 12)
        (scale * loss_fn(model, rank_slice(x), rank_slice(y))).backward()
        optim.step()
        optim.zero_grad()
        (scale * loss_fn(reference, x, y)).backward()
        if step >= 2:  # the threshold crossed, so that clipping per shard would show
            assert max(p.grad.norm() for p in reference.parameters()) > 2.0
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


def _clip_each_declared_body() -> None:
    _clip_each_declared(sharded=True)


# --------------------------------------------------------- 3. a warmup from lr 0


def test_lr_zero_step_is_an_ordinary_step():
    """A warmup's first step at lr 0 on gradients ``step()`` consumes: clipped, guarded and
    counted, exactly like the plain optimizer with clip_grad_norm_ (one bucket)."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, max_grad_norm=0.1, bucket_numel=1 << 20, **ADAMW
    )
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, s / 2)) for o in (optim, plain)
    ]
    for step in range(4):
        x, y = _x(step)
        with optim.accumulate():
            loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        torch.testing.assert_close(optim.grad_norm(), norm, rtol=1e-5, atol=1e-7)
        plain.step()
        plain.zero_grad()
        for s in schedules:
            s.step()
    assert_match(model, reference)
    for a, b in zip(optim.state.values(), plain.state.values(), strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], atol=1e-7, rtol=1e-5)


def test_lr_zero_step_skips_a_nonfinite_gradient():
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, skip_nonfinite=True, lr=0.0)
    before = _snapshot(model)
    x, y = _x(0)
    with optim.accumulate():
        loss_fn(model, x, y).backward()
    model.head.weight.grad[0, 0] = float("nan")
    optim.step()
    _assert_unchanged(model, before)
    assert optim.nonfinite_steps >= 1
    assert all(torch.isfinite(v).all() for s in optim.state.values() for v in s.values())


# ------------------------------------- 4-6. a second backward before step(): refused at once


# Every update moves the parameters' version counters (the fused kernels' too, by the engine),
# so autograd refuses the retained graph's saved weights before the second gradient arrives.
@pytest.mark.parametrize("kernel", [{}, {"fused": True}], ids=["default", "fused"])
def test_two_losses_two_backwards_refused_before_the_second_moves(kernel):
    model, _ = make_models()
    _optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW, **kernel)
    x, y = _x(0)
    out = model(x)
    nn.functional.mse_loss(out, y).backward(retain_graph=True)
    after_first = _snapshot(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().mean().backward()
    _assert_unchanged(model, after_first)


def test_two_losses_under_accumulate_equal_plain():
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for step in range(3):
        x, y = _x(step)
        out = model(x)
        with optim.accumulate():
            nn.functional.mse_loss(out, y).backward(retain_graph=True)
        out.square().mean().backward()
        optim.step()
        optim.zero_grad()
        ref = reference(x)
        (nn.functional.mse_loss(ref, y) + ref.square().mean()).backward()
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


def test_plain_style_accumulation_refused_at_the_second_micro_batch():
    model, _ = make_models()
    _optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = _x(0)
    (loss_fn(model, x[:4], y[:4]) / 2).backward()
    after_first = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"accumulate\(\)"):
        (loss_fn(model, x[4:], y[4:]) / 2).backward()
    _assert_unchanged(model, after_first)


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)
    )


def _dcgan(make_opt, fixed: bool) -> tuple[nn.Module, nn.Module]:
    """The DCGAN tutorial's loop; ``fixed``: D's two backwards as one step (accumulate) and
    G's loss run with D frozen, as the README tells in-backward users."""
    netG, netD = _gan_models()
    optD, optG = make_opt(netD.parameters()), make_opt(netG.parameters())
    bce = nn.BCEWithLogitsLoss()
    in_backward = isinstance(optD, OptimizerInBackward)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        real, noise = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        netD.zero_grad()
        errD_real = bce(netD(real), torch.ones(8, 1))
        if fixed and in_backward:
            with optD.accumulate():
                errD_real.backward()
        else:
            errD_real.backward()
        fake = netG(noise)
        bce(netD(fake.detach()), torch.zeros(8, 1)).backward()
        optD.step()
        netG.zero_grad()
        if fixed:
            netD.requires_grad_(False)
        bce(netD(fake), torch.ones(8, 1)).backward()
        netD.requires_grad_(True)
        optG.step()
    return netG, netD


def test_dcgan_tutorial_loop_refused_fixed_loop_equal():
    adam = lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.5, 0.999))  # noqa: E731
    ours = lambda ps: OptimizerInBackward(ps, torch.optim.Adam, lr=2e-3, betas=(0.5, 0.999))  # noqa: E731
    with pytest.raises(RuntimeError, match=r"accumulate\(\)"):
        _dcgan(ours, fixed=False)
    for a, b in zip(_dcgan(ours, fixed=True), _dcgan(adam, fixed=True), strict=True):
        assert_match(a, b)


def test_zero_grad_discarding_an_in_backward_update_is_refused():
    """The GAN case through the optimizer's own zero_grad(): D was updated by G's loss."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = _x(0)
    loss_fn(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) called while"):
        optim.zero_grad()
    optim.step()
    optim.zero_grad()


def _fsdp_two_backwards_body() -> None:
    """On FSDP2: two backwards refused; FSDP2's own no-sync accumulation and accumulate()
    still equal plain."""
    model, reference = make_models()
    shard(model)
    shard(reference)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(2):
        x, y = _x(step, sharded=True)
        for net, opt in ((model, optim), (reference, plain)):
            net.set_requires_gradient_sync(False)
            (loss_fn(net, x, y) / 2).backward()
            net.set_requires_gradient_sync(True)
            (loss_fn(net, x, y) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)
    x, y = _x(5, sharded=True)
    loss_fn(model, x, y).backward()
    after_first = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"accumulate\(\)"):
        loss_fn(model, x, y).backward()
    _assert_unchanged(model, after_first)


def _fsdp_step_on_part_body() -> None:
    """On FSDP2: a ``step()`` with no ``zero_grad()`` after it, every gradient but the first
    block's then dropped (``p.grad = None``) and that block frozen, and a backward: the plain
    ``step()`` after it would step the frozen block's held gradient a second time. Refused
    where the backward starts (the first unit it reduces holds none), before anything moves;
    with the block's gradient dropped too, equal."""
    for drop_first in (False, True):
        model, reference, optim, plain = _adamw_loops(sharded=True)
        pairs = ((model, optim), (reference, plain))
        _step_both(pairs, 0, sharded=True, zero=False)
        for net in (model, reference):
            for name, param in net.named_parameters():
                if drop_first or not name.startswith("layers.0."):
                    param.grad = None
            net.layers[0].requires_grad_(False)
        if drop_first:
            _step_both(pairs, 1, sharded=True, zero=True)
            assert_match(model, reference)
        else:
            _refused_unmoved(
                model,
                r"an earlier step\(\) committed",
                lambda net=model: loss_fn(net, *_x(1, sharded=True)).backward(),
            )


# ------------------------------------------------------------------ 7. GradScaler


def _scaled_losses(scaler: torch.amp.GradScaler) -> dict[str, Callable[..., torch.Tensor]]:
    """Ways a loop hands a scaled loss to backward: as the AMP recipe does, divided for
    accumulation, scaled in a list, and a forward under reentrant checkpointing (whose first
    gradients arrive in a nested backward)."""
    return {
        "scaled": lambda net, x, y: scaler.scale(loss_fn(net, x, y)),
        "scaled_then_divided": lambda net, x, y: scaler.scale(loss_fn(net, x, y)) / 2,
        "in_a_list": lambda net, x, y: scaler.scale([loss_fn(net, x, y)])[0],
        "reentrant": lambda net, x, y: scaler.scale(
            checkpoint(loss_fn, net, x.requires_grad_(), y, use_reentrant=True)
        ),
    }


@pytest.mark.parametrize("bucket_numel", [None, 1], ids=["one_bucket", "buckets"])
@pytest.mark.parametrize("scaled", ["scaled", "scaled_then_divided", "in_a_list", "reentrant"])
def test_grad_scaler_refused_before_anything_moves(scaled, bucket_numel):
    """The AMP recipe's loop (``scaler.scale(loss).backward(); scaler.step(optim);
    scaler.update()``) would step each gradient in backward, scaled, before GradScaler could
    unscale it or skip the step: refused at the backward's first gradient, nothing moved
    (before, at ``scaler.step``, after the backward had stepped every bucket by 1024 times its
    gradient). A later backward of an unscaled loss trains as the plain optimizer."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.SGD, lr=0.1, bucket_numel=bucket_numel
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _x(0)
    _refused_unmoved(
        model, "GradScaler.scale", lambda: _scaled_losses(scaler)[scaled](model, x, y).backward()
    )
    optim.zero_grad()
    for net, opt in ((model, optim), (reference, plain)):
        loss_fn(net, *_x(1)).backward()
        opt.step()
        opt.zero_grad()
    assert_match(model, reference)


def _grad_scaler_body() -> None:
    """On FSDP2 the scaled backward is refused on every rank at its first unit, before any
    rank moves. The loop then recovers as FSDP2 requires (``reset_iter_state()``: without it
    neither loop trains again) and goes on unscaled: equal to plain AdamW's loop failing at
    the same gradient (a hook raising there), every parameter moved."""
    model, reference, optim, plain = _adamw_loops(sharded=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _x(0, sharded=True)
    _refused_unmoved(
        model, "GradScaler.scale", lambda: scaler.scale(loss_fn(model, x, y)).backward()
    )

    def fail(_param: torch.Tensor) -> None:
        raise RuntimeError("failed here")

    handles = [p.register_post_accumulate_grad_hook(fail) for p in reference.parameters()]
    with pytest.raises(RuntimeError, match="failed here"):
        scaler.scale(loss_fn(reference, x, y)).backward()
    for handle in handles:
        handle.remove()
    before = [full(p).detach().clone() for p in model.parameters()]
    for net, opt in ((model, optim), (reference, plain)):
        net.reset_iter_state()
        opt.zero_grad()
        loss_fn(net, *_x(1, sharded=True)).backward()
        opt.step()
        opt.zero_grad()
    assert_match(model, reference)
    assert all(not torch.equal(full(p), b) for p, b in zip(model.parameters(), before, strict=True))


def test_grad_scaler_under_accumulate_refused_at_its_step():
    """Under ``accumulate()`` the scaled gradients are held, not stepped: ``scaler.step``
    refuses, nothing moved. A disabled scaler (``enabled=False``, the same loop without
    mixed precision) scales nothing and drives the optimizer as the plain one."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with optim.accumulate():
        scaler.scale(loss_fn(model, *_x(0))).backward()
    _refused_unmoved(model, "bf16 autocast", lambda: scaler.step(optim))
    optim.zero_grad()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for net, opt in ((model, optim), (reference, plain)):
        disabled = torch.amp.GradScaler("cpu", enabled=False)
        disabled.scale(loss_fn(net, *_x(1))).backward()
        disabled.step(opt)
        disabled.update()
        opt.zero_grad()
    assert_match(model, reference)


# ------------------------------------------------------------------ 8. step hooks


def test_step_pre_hook_refused_at_registration_post_hook_runs_at_step():
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="step pre-hook"):
        optim.register_step_pre_hook(lambda *_: None)
    calls = []
    optim.register_step_post_hook(lambda *_: calls.append(1))
    x, y = _x(0)
    loss_fn(model, x, y).backward()
    assert calls == []
    optim.step()
    assert calls == [1]


def test_global_step_pre_hook_refused_before_anything_moves():
    model, _ = make_models()
    _optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    handle = register_optimizer_step_pre_hook(lambda *_: None)
    before = _snapshot(model)
    try:
        x, y = _x(0)
        with pytest.raises(RuntimeError, match="step pre-hook"):
            loss_fn(model, x, y).backward()
    finally:
        handle.remove()
    _assert_unchanged(model, before)


def _double_gradient(param: torch.Tensor) -> None:
    param.grad.mul_(2)


def test_gradient_hook_registered_after_the_optimizer_refused_before_it_equal():
    """A user's post-accumulate-grad hook (gradient scaling, noise) runs before a plain
    optimizer's ``step()``. Registered after ours, it would run after the gradient was stepped
    and freed (it used to raise there, with the parameters moved): refused at the first
    backward, before anything moves. Registered before ours, it runs first and the update
    uses the gradient it leaves: equal to the plain loop."""
    model, _ = make_models()
    _late = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    model.head.weight.register_post_accumulate_grad_hook(_double_gradient)
    _refused_unmoved(
        model, "registered after OptimizerInBackward", lambda: loss_fn(model, *_x(0)).backward()
    )
    model, reference = make_models()
    for param in (*model.parameters(), *reference.parameters()):
        param.register_post_accumulate_grad_hook(_double_gradient)
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        _step_both(((model, optim), (reference, plain)), step, zero=True)
    assert_match(model, reference)


def test_gradient_hook_returning_a_value_named():
    """A post-accumulate-grad hook returning the gradient (``lambda p: p.grad.mul_(2)``): torch
    hands the value to the next hook, ours, and refuses such a hook with no optimizer after it.
    Ours names that hook, with nothing moved (it reported a parameter missing from the
    param groups)."""
    model, _ = make_models()
    model.head.bias.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(2))
    _optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    _refused_unmoved(
        model,
        "hook must return None|hooks must return None",
        lambda: loss_fn(model, *_x(0)).backward(),
    )


class _DetachedRead(nn.Module):
    """Reads ``second``'s weight through ``.detach()`` before using it with its gradient: the
    detached read's backward node runs after ``second``'s gradient arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(nn.functional.linear(h, self.second.weight.detach()))
        return self.head(torch.tanh(self.second(h)))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_parameter_read_detached_after_its_update_refused_by_autograd(fused):
    """With several buckets, ``second``'s bucket is stepped before the node that read its weight
    through ``.detach()`` runs; the plain optimizer's backward uses the old weight there. The
    fused kernels moved no version counter, so that node computed with the updated weight
    (2.0e-3 apart after four steps, no error); now the version is moved after every update and
    autograd refuses, as it does for the in-place foreach update."""
    torch.manual_seed(0)
    model = _DetachedRead()
    _optim = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, bucket_numel=1, fused=fused, **ADAMW
    )
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_fn(model, x, y).backward()


class _DetachedReadCheckpointed(_DetachedRead):
    """``_DetachedRead`` with its first part (the detached read among it) recomputed in
    backward: non-reentrant checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def first_part(x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            return torch.tanh(nn.functional.linear(h, self.second.weight.detach()))

        h = checkpoint(first_part, x, use_reentrant=False)
        return self.head(torch.tanh(self.second(h)))


def _under_hooks(kind: str) -> contextlib.AbstractContextManager:
    return {
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "checkpoint": contextlib.nullcontext,
    }[kind]()


@pytest.mark.parametrize("kind", ["checkpoint", "save_on_cpu", "identity"])
def test_parameter_read_detached_under_saved_tensor_hooks_refused(kind):
    """The detached read above under saved-tensor hooks (its part recomputed by non-reentrant
    checkpointing, ``save_on_cpu``, hooks of one's own): autograd checks no tensor saved
    through them, and the node computed with the updated weight (AdamW 3.3e-3 apart after four
    steps, no error). The version check is made for them here: refused at that node, as
    autograd refuses it without hooks. With one bucket (nothing stepped before that node),
    equal to plain AdamW under the same hooks."""
    model_cls = _DetachedReadCheckpointed if kind == "checkpoint" else _DetachedRead
    torch.manual_seed(0)
    model = model_cls()
    _optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=1, **ADAMW)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="saved-tensor hooks"):
        with _under_hooks(kind):
            loss = loss_fn(model, x, y)
        loss.backward()
    torch.manual_seed(0)
    model, reference = model_cls(), model_cls()
    reference.load_state_dict(model.state_dict())
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        for net, opt in ((model, optim), (reference, plain)):
            with _under_hooks(kind):
                loss = loss_fn(net, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


class NameDecaySGD(torch.optim.Optimizer):
    """SGD with decoupled weight decay on every parameter but biases, told by name (an
    optimizer built on ``model.named_parameters()``: ``param_names`` beside ``params``)."""

    def __init__(self, params, lr: float = 0.05, weight_decay: float = 0.5):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                if p.grad is None:
                    continue
                if "bias" not in name:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("stepping", [None, "dtensor", "elementwise"])
def test_named_parameters_handed_with_their_names(stepping):
    """A class zipping ``param_names`` with ``params``, several buckets, a frozen layer: each
    bucket's step is handed the names of its own parameters (it got the whole group's names
    beside a bucket's parameters: 7.3e-2 apart, no error)."""
    model, reference = make_models(freeze=("layers.0",))
    optim = OptimizerInBackward(
        model.named_parameters(), NameDecaySGD, bucket_numel=20, stepping=stepping
    )
    plain = NameDecaySGD(reference.named_parameters())
    for step in range(3):
        _step_both(((model, optim), (reference, plain)), step, zero=True)
    assert_match(model, reference)


@pytest.mark.slow
def test_compiled_train_step_calling_backward_equals_plain():
    """``torch.compile`` of a train step that calls ``loss.backward()`` inside: the hooks ran
    while Dynamo evaluated frames, so the in-backward update was traced and compiled, and
    rounded otherwise than the eager kernel of the plain optimizer's ``step()`` (9.5e-7 apart
    after 20 AdamW steps, growing). The hooks are never traced: bit for bit equal."""
    torch._dynamo.reset()
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for net, opt in ((model, optim), (reference, plain)):

        @torch.compile
        def train_step(x: torch.Tensor, y: torch.Tensor, net: nn.Module = net) -> None:
            loss_fn(net, x, y).backward()

        for step in range(4):
            train_step(*_x(step))
            opt.step()
            opt.zero_grad()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, ref)


def test_another_optimizer_on_the_same_parameters_refused_at_its_step():
    """A plain optimizer built beside ours on the same parameters (a warmup phase with SGD):
    its ``step()`` reads gradients ours stepped and freed, and is refused there, naming the
    fix (it was refused at the next backward, as if a second backward came before ours'
    ``step()``)."""
    model, _ = make_models()
    _ours = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    warmup = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, *_x(0)).backward()
    with pytest.raises(RuntimeError, match="Another optimizer cannot step parameters"):
        warmup.step()


def test_group_removed_and_given_to_another_optimizer_trains_as_plain():
    """The head's group removed from one optimizer (``del optim.param_groups[1]``) and, after
    that optimizer's next step, given to a second one, as with plain optimizers: equal. It was
    refused as "already stepped in backward by another live OptimizerInBackward" (ownership
    was kept while the parameter lived; it is now what the owner's plan holds)."""
    model, reference = make_models()
    ours = OptimizerInBackward(
        [{"params": model.layers.parameters()}, {"params": model.head.parameters()}],
        torch.optim.AdamW,
        **ADAMW,
    )
    plain = torch.optim.AdamW(
        [{"params": reference.layers.parameters()}, {"params": reference.head.parameters()}],
        **ADAMW,
    )
    loops = [((model, ours),), ((reference, plain),)]
    for step in range(5):
        if step == 2:
            for optimizers in loops:
                del optimizers[0][1].param_groups[1]
        if step == 3:
            head = OptimizerInBackward(model.head.parameters(), torch.optim.SGD, lr=0.1)
            loops[0] = (*loops[0], (model, head))
            sgd = torch.optim.SGD(reference.head.parameters(), lr=0.1)
            loops[1] = (*loops[1], (reference, sgd))
        for loop in loops:
            net = loop[0][0]
            loss_fn(net, *_x(step)).backward()
            for _, optim in loop:
                optim.step()
            net.zero_grad()
    assert_match(model, reference)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copied_with_its_model_and_scheduler_trains_as_plain(how):
    """``pickle.dumps((model, optim, scheduler))`` mid-run (a checkpoint by ``torch.save`` of
    the objects), or ``copy.deepcopy`` of them: the copies train on as the plain ones do. The
    unpickled optimizer raised an AttributeError at the next step; with an LR scheduler
    built on it, pickling raised (the scheduler's wrapper of ``step``) and the deep copy's
    ``step()`` stepped the original optimizer, so the copy raised at its ``zero_grad()``.
    A copy now leaves out what ``torch.optim.Optimizer.__getstate__`` leaves out (that
    wrapper, and the hooks, registered here on the original and gone from the plain copy)."""
    copied = (lambda x: pickle.loads(pickle.dumps(x))) if how == "pickle" else copy.deepcopy
    model, reference, optim, plain = _adamw_loops(sharded=False)
    runs = []
    for net, opt in ((model, optim), (reference, plain)):
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        opt.register_step_post_hook(lambda *_: None)
        _step_both(((net, opt),), 0, zero=True)
        scheduler.step()
        runs.append(copied((net, opt, scheduler)))
    (model, optim, scheduler), (reference, plain, plain_scheduler) = runs
    assert not optim._optimizer_step_post_hooks and not plain._optimizer_step_post_hooks
    for step in range(1, 4):
        _step_both(((model, optim), (reference, plain)), step, zero=True)
        scheduler.step()
        plain_scheduler.step()
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict())


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copied_between_backward_and_step_refused(how):
    """A copy (or a pickle) of the optimizer taken between backward and ``step()`` holds this
    step's update, where the plain optimizer's holds the state before it (and its gradients):
    the copy resumed from another point (AdamW 1.3e-2 apart, no error). Refused there, before
    anything moves."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    loss_fn(model, *_x(0)).backward()
    take = (
        (lambda: pickle.dumps((model, optim)))
        if how == "pickle"
        else (lambda: copy.deepcopy((model, optim)))
    )
    _refused_unmoved(model, "await step", take)


def test_state_dict_lists_entries_in_the_plain_order():
    """With several buckets, state was created in backward's order (last layer first), and
    ``state_dict()["state"]`` listed it so: a loop that finds an entry by its position (drops
    the first entry's moments, then loads the dict back) changed another parameter (AdamW
    4.5e-2 apart, no error). Entries are now put in the order the plain optimizer creates
    them at each ``step()``: ``param_groups``' order, a parameter unfrozen later at the end,
    entries re-created after ``state.clear()`` in order again; a loaded state dict keeps its
    order. A layer's moments reset by the loop keep their place where it replaced the entries
    (``optim.state[p] = {}``: the plain dict keeps the key; they were moved to the end, and
    then, where they were the last entries, sorted into ``param_groups``' order) and go to the
    end where it deleted them."""
    model, reference = make_models(freeze=("head",))
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_numel=20)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(8):
        if step == 4:
            optim.state.clear()
            plain.state.clear()
        for net, opt in ((model, optim), (reference, plain)):
            if step == 5:
                for param in net.layers[1].parameters():
                    opt.state[param] = {}
            elif step == 6:
                for param in net.layers[0].parameters():
                    del opt.state[param]
            elif step == 7:  # every entry after layer 1's, layer 0's last since step 6
                for module in (net.layers[2], net.head, net.layers[0]):
                    for param in module.parameters():
                        opt.state[param] = {}
        if step == 1:
            for net in (model, reference):
                net.head.requires_grad_(True)
        _step_both(((model, optim), (reference, plain)), step, zero=True)
        assert list(optim.state_dict()["state"]) == list(plain.state_dict()["state"])
        if step == 2:
            for opt in (optim, plain):
                state_dict = copy.deepcopy(opt.state_dict())
                del state_dict["state"][next(iter(state_dict["state"]))]
                opt.load_state_dict(state_dict)
    assert list(optim.state_dict()["state"]) == list(plain.state_dict()["state"])
    assert_match(model, reference)


def test_state_created_after_a_rolled_back_backward_lists_in_the_plain_order():
    """A backward rolled back (the model and the optimizer loaded, then ``zero_grad()``), the
    state cleared, then a step: the entries the step creates were taken for entries there
    before, the keys the rolled-back backward found having been kept as this step's, and
    ``state_dict()`` listed them in backward's order (found by a longer run of the stateful
    property test's Adafactor machine, on 4 ranks).
    The keys are now those the step's own first pass finds."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_numel=20)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loops = ((model, optim), (reference, plain))
    _step_both(loops, 0, zero=True)
    for net, opt in loops:
        weights, state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
        loss_fn(net, *_x(1)).backward()
        net.load_state_dict(weights)
        opt.load_state_dict(state)
        opt.zero_grad()
        opt.state.clear()
    _step_both(loops, 2, zero=True)
    assert list(optim.state_dict()["state"]) == list(plain.state_dict()["state"])
    assert_match(model, reference)


def test_frozen_between_forward_and_backward_equal():
    """``requires_grad_(False)`` between forward and backward: autograd accumulates no
    gradient into the frozen parameters (it still runs their post-accumulate-grad hooks), so
    the plain optimizer does not step them. It was refused as a gradient delivered to a
    frozen parameter, after the buckets stepped before it had moved; now equal."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_numel=20)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        for net, opt in ((model, optim), (reference, plain)):
            x, y = _x(step)
            out = net(x)
            net.layers[0].requires_grad_(step == 0)
            nn.functional.mse_loss(out, y).backward()
            net.layers[0].requires_grad_(True)
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


def test_loop_ending_after_a_backward_without_step_warns():
    """A loop that stops after a backward with no ``step()`` (a step budget checked after
    backward): the plain optimizer never applies that backward's gradients, here they were
    applied in backward (AdamW 9.9e-3 apart, a validation loss 0.886 against 0.888). A
    RuntimeWarning says so when the optimizer is collected (or at exit), and none after a loop
    that ends with ``step()``; a forward reading those weights is refused from then on
    (``tests/test_forward_before_step.py``), a save of them is not."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _step_both(((model, optim),), 0, zero=True)
    loss_fn(model, *_x(1)).backward()
    with pytest.warns(RuntimeWarning, match="no step\\(\\) followed"):
        del optim
        gc.collect()
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _step_both(((model, optim),), 2, zero=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del optim
        gc.collect()
    # Recorded, not raised: a warning raised as an error in a finalizer is only printed.
    assert not [w for w in caught if "no step() followed" in str(w.message)]


def _restore_by_loading(net: nn.Module, weights: dict) -> None:
    net.load_state_dict(weights)


def _restore_by_assignment(net: nn.Module, weights: dict) -> None:
    for name, param in net.named_parameters():
        param.data = weights[name]


@pytest.mark.parametrize("restore", [_restore_by_loading, _restore_by_assignment])
def test_rollback_as_plain(restore):
    """A backward rolled back (a loss spike): the weights restored, the optimizer's state
    loaded, then ``zero_grad()``. ``state_dict()`` there returns the loaded state, as the
    plain optimizer's: the refusal of a snapshot holding this step's update does not apply
    (it raised, a false positive). Weights restored by assignment (``p.data = saved``) were
    refused at ``zero_grad()`` as discarding the backward's updates (the assignment moves no
    version counter); the replaced storage now counts as the parameter written. Equal."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    _step_both(((model, optim), (reference, plain)), 0, zero=True)
    saved = copy.deepcopy(optim.state_dict())
    for net, opt in ((model, optim), (reference, plain)):
        weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
        loss_fn(net, *_x(1)).backward()
        restore(net, weights)
        opt.load_state_dict(copy.deepcopy(saved))
        assert_same_state_dict(opt.state_dict(), saved)
        opt.zero_grad()
    _step_both(((model, optim), (reference, plain)), 2, zero=True)
    assert_match(model, reference)


def test_load_keeps_the_state_order_with_several_classes():
    """An optimizer of several classes loads its state class by class; the loaded state kept
    the classes' order, not the state dict's (entries 0, 1, 4, 5, 2, 3 of an AdamW, SGD,
    AdamW layout); it now keeps the state dict's order."""
    model, _ = make_models()
    params = list(model.parameters())
    optim = OptimizerInBackward(
        [
            {"params": params[:2]},
            {"params": params[2:4], "optimizer_cls": torch.optim.SGD, "lr": 0.1, "momentum": 0.9},
            {"params": params[4:]},
        ],
        torch.optim.AdamW,
        lr=1e-2,
    )
    _step_both(((model, optim),), 0, zero=True)
    order = list(optim.state_dict()["state"])
    optim.load_state_dict(copy.deepcopy(optim.state_dict()))
    assert list(optim.state_dict()["state"]) == order == sorted(order)


def test_step_without_backward_after_a_rollback_counts_as_plain():
    """A backward rolled back (the state and weights from before it loaded, ``zero_grad()``),
    then a ``step()`` with no backward: the plain optimizer runs its step on no gradients,
    which advances a counter kept in its groups; here the undone backward still counted as
    this step's, so the counter was not advanced (2.6e-3 apart two steps later, no error)."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(), GroupStepLamb, lr=1e-2, bucket_numel=24, stepping="dtensor"
    )
    plain = GroupStepLamb(reference.parameters(), lr=1e-2)
    for net, opt in ((model, optim), (reference, plain)):
        saved = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
        loss_fn(net, *_x(0)).backward()
        opt.load_state_dict(saved[1])
        net.load_state_dict(saved[0])
        opt.zero_grad()
        opt.step()
        opt.zero_grad()
    for step in (1, 2):
        _step_both(((model, optim), (reference, plain)), step, zero=True)
    assert optim.param_groups[0]["step"] == plain.param_groups[0]["step"]
    assert_match(model, reference)


@pytest.mark.parametrize("failed", [False, True], ids=["finished", "raised"])
@pytest.mark.parametrize("stepping", [None, "dtensor"], ids=["joint", "per-bucket"])
def test_rollback_undoes_a_counter_on_the_instance(stepping, failed):
    """A backward rolled back (weights and optimizer state loaded, then ``zero_grad()``) with
    a class counting steps on itself (``self.t += 1``, outside any state dict): the plain
    optimizer never ran that step, so its counter stays; here the backward's step had
    advanced it and the load did not set it back (1.7e-3 apart one step later, no error).
    Also where the backward raised after stepping some buckets. Equal now."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(), InstanceCountSGD, lr=0.1, bucket_numel=20, stepping=stepping
    )
    plain = InstanceCountSGD(reference.parameters(), lr=0.1)
    _step_both(((model, optim), (reference, plain)), 0, zero=True)

    class BadBatch(RuntimeError):
        pass

    def bad_batch(*_: object) -> None:
        raise BadBatch

    for net, opt in ((model, optim), (reference, plain)):
        saved = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
        handle = net.layers[0].register_full_backward_hook(bad_batch) if failed else None
        with pytest.raises(BadBatch) if failed else contextlib.nullcontext():
            loss_fn(net, *_x(1)).backward()
        if handle is not None:
            handle.remove()
        net.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        opt.zero_grad()
    assert optim.t == plain.t == 1
    _step_both(((model, optim), (reference, plain)), 2, zero=True)
    assert_match(model, reference)


def test_frozen_parameter_holding_a_gradient_refused():
    """A gradient on a frozen parameter of the optimizer at ``step()`` (set by hand, or kept
    from before it was frozen or added): the plain optimizer steps every parameter holding
    one (1.1e-2 apart after a hand-set gradient, no error); here only trainable ones are.
    Refused at that ``step()``, before it steps anything."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _step_both(((model, optim),), 0, zero=True)
    model.head.requires_grad_(False)
    loss_fn(model, *_x(1)).backward()
    model.head.bias.grad = torch.ones_like(model.head.bias)
    _refused_unmoved(model, r"is frozen \(requires_grad=False\) but holds a gradient", optim.step)


def test_layer_frozen_between_micro_batches_refused_before_the_last_backward_moves():
    """A layer frozen after the first micro-batch under ``accumulate()``, holding its
    gradient: the plain ``step()`` steps it with that gradient, and the others with the sum.
    This optimizer steps trainable parameters only; the last backward stepped the others
    before ``step()`` refused the frozen one (1.0e-2 moved at the refusal). Refused where
    that backward starts, before anything moves; its gradient dropped before the backward,
    as the message says, the plain loop doing the same: equal."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    with optim.accumulate():
        loss_fn(model, *_x(0)).backward()
    model.layers[0].requires_grad_(False)
    _refused_unmoved(
        model,
        r"backward\(\): .* is frozen \(requires_grad=False\) but holds a gradient",
        lambda: loss_fn(model, *_x(1)).backward(),
    )
    optim.zero_grad()
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    reference.layers[0].requires_grad_(False)
    for net, opt in ((model, optim), (reference, plain)):
        net.layers[0].requires_grad_(True)
        with opt.accumulate() if opt is optim else contextlib.nullcontext():
            loss_fn(net, *_x(0)).backward()
        net.layers[0].requires_grad_(False)
        net.layers[0].zero_grad()
        loss_fn(net, *_x(1)).backward()
        opt.step()
        opt.zero_grad()
    assert_match(model, reference)


def test_second_pass_with_a_jointly_stepped_class_refused():
    """A class stepped jointly (undeclared, clipping by the norm of all its gradients inside
    ``step()``): a backward, then gradients set by hand before ``step()``. The plain step()
    reads them all at once; here each pass called it on its own (1.0e-3 apart, no error).
    Refused at that ``step()``, before it moves anything; summed into one pass, equal."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), GlobalClipSGD, lr=0.05, bucket_numel=24)
    model.layers[0].requires_grad_(False)
    loss_fn(model, *_x(0)).backward()
    model.layers[0].requires_grad_(True)
    for p in model.layers[0].parameters():
        p.grad = torch.full_like(p, 0.1)
    _refused_unmoved(model, "a class stepped jointly", optim.step)


def test_second_pass_on_a_jointly_stepped_class_the_first_left_alone_equal():
    """A backward updating only the groups of an elementwise class (the others frozen), then
    gradients set by hand on those of a class stepped jointly, then ``step()``. The joint
    class's one plain call reads the hand-set gradients alone, as its call here does: equal
    (this was refused whenever the optimizer held a jointly stepped class)."""
    model, reference = make_models()
    sgd = dict(lr=0.1, momentum=0.9)

    def groups(net: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return list(net.layers.parameters()), [*net.inp.parameters(), *net.head.parameters()]

    joint, rest = groups(model)
    optim = OptimizerInBackward(
        [{"params": joint}, {"params": rest, "optimizer_cls": torch.optim.SGD, **sgd}],
        GlobalClipSGD,
        lr=0.05,
    )
    joint_ref, rest_ref = groups(reference)
    plains = (GlobalClipSGD(joint_ref, lr=0.05), torch.optim.SGD(rest_ref, **sgd))
    for step in range(3):
        for net, params in ((model, joint), (reference, joint_ref)):
            net.layers.requires_grad_(False)
            loss_fn(net, *_x(step)).backward()
            net.layers.requires_grad_(True)
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.1 * (i + step + 1))
        optim.step()
        optim.zero_grad()
        for plain in plains:
            plain.step()
            plain.zero_grad()
    assert_match(model, reference)


def test_load_state_dict_hooks_run_as_plain():
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    seen = []
    optim.register_load_state_dict_pre_hook(lambda o, sd: seen.append("pre"))
    optim.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    optim.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    state = optim.state_dict()
    assert state["extra"] == 1
    del state["extra"]
    optim.load_state_dict(state)
    assert seen == ["pre", "post"]


# ------------------------------------------------------------------ 9. DDP and FSDP1 at any time


def _ddp_late_body() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    ddp = nn.parallel.DistributedDataParallel(model)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="replicate"):
        ddp(torch.randn(3, 4)).sum().backward()
    _assert_unchanged(model, before)
    del optim, ddp


def _fsdp1_body(use_orig_params: bool) -> None:
    """FSDP1 reduces gradients outside the post-accumulate-grad hooks: with
    ``use_orig_params=False`` the FlatParameter's hook fired on the unsharded, unreduced
    gradient (the parameters moved, then FSDP1's reduce-scatter raised at the freed gradient);
    with ``use_orig_params=True`` no hook fires and ``step()`` stepped each rank's flat slices,
    clipped by their local norm (1.9e-3 apart from ``FSDP.clip_grad_norm_`` after four AdamW
    steps, no error). Refused at construction, or, wrapped after the optimizer was built (as
    Trainer and accelerate wrap), at the first ``step()``, before anything moves."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def wrap(module: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module, device_id=torch.device("cpu"), use_orig_params=use_orig_params
        )

    torch.manual_seed(0)
    fsdp1 = wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match=r"FSDP1.*fully_shard"):
        OptimizerInBackward(fsdp1.parameters(), torch.optim.AdamW, max_grad_norm=1.0)

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, max_grad_norm=1.0)
    fsdp1 = wrap(model)
    before = _snapshot(fsdp1)
    fsdp1(torch.randn(3, 4)).sum().backward()
    # use_orig_params=False: FSDP1 replaced the parameters, so none reached the optimizer.
    with pytest.raises(RuntimeError, match=r"FSDP1.*fully_shard" if use_orig_params else "live"):
        optim.step()
    _assert_unchanged(fsdp1, before)
    del optim, fsdp1, model


def _replicate_body() -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model, reference = make_models()
    replicate(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    size = 2 * dist.get_world_size()  # equal shares: replicate averages the ranks' means
    for step in range(3):
        gx, gy = batch(step, size)
        loss_fn(model, rank_slice(gx), rank_slice(gy)).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, gx, gy).backward()
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


# ------------------------------------------------------------------ extras


def test_parameter_swap_is_hooked_from_the_next_backward():
    """accelerate's FSDP2 prepare replaces the tensors in param_groups: the new parameters
    are hooked (by identity, never a recycled id) and stepped in backward."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    old = list(model.parameters())
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(param.detach().clone()))
    mapping = dict(zip(map(id, old), model.parameters(), strict=True))
    for group in optim.param_groups:
        group["params"] = [mapping[id(p)] for p in group["params"]]
    del old, mapping
    for step in range(3):
        x, y = _x(step)
        loss_fn(model, x, y).backward()
        if step > 0:  # from the first backward after the swap was seen, in backward
            assert all(not holds_gradient(p) for p in model.parameters())
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


def _swapped_whole_loops(
    loops: tuple, convert: Callable[[nn.Module], object], sharded: bool = False
) -> None:
    """A step of each loop, ``convert`` on each model (swapping its parameters' C++ tensors
    into the objects: every DTensor parameter's, and every parameter's under the swap flag),
    three more steps: from the second backward after the conversion, ours steps every
    parameter in backward again."""
    model = loops[0][0]
    _step_both(loops, 0, sharded, zero=True)
    ids = list(map(id, model.parameters()))
    impls = [p._cdata for p in model.parameters()]
    for net, _ in loops:
        convert(net)
    assert list(map(id, model.parameters())) == ids
    every = torch.__future__.get_swap_module_params_on_conversion()
    swapped = [p._cdata != impl for p, impl in zip(model.parameters(), impls, strict=True)]
    assert swapped == [every or isinstance(p, DTensor) for p in model.parameters()]
    for step in range(1, 4):
        for net, opt in loops:
            loss_fn(net, *_x(step, sharded)).backward()
            if net is model and step > 1:
                assert all(is_freed(p.grad) for p in model.parameters())
            opt.step()
            opt.zero_grad()
    assert_match(model, loops[1][0])


def _load_shifted(model: nn.Module) -> None:
    model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})


@pytest.mark.parametrize("convert", [nn.Module.cpu, _load_shifted], ids=["to", "load_state_dict"])
def test_parameters_swapped_whole_train_as_plain(convert):
    """Under ``torch.__future__.set_swap_module_params_on_conversion(True)`` (torch's coming
    default), ``Module.to()`` and ``load_state_dict()`` swap each parameter's C++ tensor into
    the object (``torch.utils.swap_tensors``), which refuses a tensor that has a weak
    reference: both raised "Couldn't swap" here, on a model built after the import and more so
    with the optimizer on it, where the plain loop trains on. They train as plain now; the swap
    also unregisters the parameters' hooks, which the next ``step()`` registers again. See
    [Note: tensors swapped whole]."""
    with swapping_conversions():
        model, reference = make_models()
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=30)
        plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
        _swapped_whole_loops(((model, optim), (reference, plain)), convert)


def _swapped_dtensors_body() -> None:
    """``Module.to()`` swaps DTensor parameters whole with no flag set. On FSDP2 units after
    the optimizer was built it raised "Couldn't swap"; they train as plain, stepped in backward
    (FSDP2 runs the hooks from their dict). A tensor-parallel module converted after the
    import raised the same with no optimizer on it; with one, it trains as plain, its hooks
    registered again."""
    model, reference, optim, plain = _adamw_loops(sharded=True)
    _swapped_whole_loops(((model, optim), (reference, plain)), nn.Module.cpu, sharded=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN_DIM, 8), nn.Tanh(), nn.Linear(8, OUT_DIM))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model[0], mesh, ColwiseParallel(output_layouts=Replicate()))
    model.cpu()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    _swapped_whole_loops(((model, optim), (reference, plain)), nn.Module.cpu)


def test_parameters_swapped_whole_on_distributed_worlds(worlds):
    worlds.run(2, _swapped_dtensors_body)
    worlds.run(3, _swapped_dtensors_body)


def _branching(model: nn.Module) -> nn.Module:
    """``model`` whose forward leaves out block ``model.skip`` if set (a branch not taken: its
    parameters get no gradient); the forward replaced on the instance, so FSDP2's hooks on
    the root still run."""
    model.skip = None

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.inp(x)
        for index, layer in enumerate(model.layers):
            if index != model.skip:
                h = layer(h)
        return model.head(h)

    model.forward = forward
    return model


def _kept_zero_gradients_body(sharded: bool = False) -> None:
    """``optim.zero_grad(set_to_none=False)`` in the loop, against the plain loop (on the same
    FSDP2 model when ``sharded``). The plain optimizer keeps zero gradients and steps them,
    gradient or not: a block its backward does not reach (a branch not taken) is still moved
    by AdamW's weight decay and moments, and a ``step()`` with no backward moves every
    parameter. Here the kept zeros are real gradients too, so both train alike, and so does
    a loop that drops them in between (``model.zero_grad()``, the module's
    ``set_to_none=True``; ``p.grad = None``; a parameter removed from ``param_groups``): each
    was refused at the next ``step()`` as a kept zero not stepped, after the other
    parameters had moved (1.0e-2), as if the plain optimizer held one. A block frozen after
    training, holding its kept zeros, which the plain optimizer steps and this one cannot,
    was refused at ``step()`` after the backward had moved the others (1.0e-2): now where
    that backward starts, before anything moves. See [Note: gradients kept as zeros]."""
    model, reference, optim, plain = _adamw_loops(sharded)
    loops = ((_branching(model), optim), (_branching(reference), plain))
    for step in range(6):
        for net, opt in loops:
            net.skip = 2 if step in (2, 4, 5) else None
            loss_fn(net, *_x(step, sharded)).backward()
            opt.step()
            if step == 1:
                net.zero_grad()
            else:
                opt.zero_grad(set_to_none=False)
            if step == 3:
                for param in net.layers[1].parameters():
                    param.grad = None
            if step == 4:
                opt.param_groups[0]["params"] = [
                    p for p in opt.param_groups[0]["params"] if p is not net.head.bias
                ]
        assert_match(model, reference)
    for opt in (optim, plain):
        opt.step()  # no backward: every kept zero gradient is stepped
    assert_match(model, reference)
    for net, opt in loops:
        opt.zero_grad(set_to_none=False)
        net.skip = None
        net.layers[2].requires_grad_(False)
    before = _snapshot(reference)
    loss_fn(reference, *_x(6, sharded)).backward()
    plain.step()
    assert not torch.equal(full(reference.layers[2].up.weight), before["layers.2.up.weight"])
    _refused_unmoved(
        model,
        r"backward\(\): .* is frozen .* kept as zeros by zero_grad\(set_to_none=False\)",
        lambda: loss_fn(model, *_x(6, sharded)).backward(),
    )


def test_zero_gradients_kept_as_plain():
    _kept_zero_gradients_body()


def _freed_gradients_body(sharded: bool = False) -> None:
    """Loops that use the gradients a plain optimizer holds after backward, against the plain
    loop on the same model (FSDP2 when ``sharded``): each raises where it uses one, naming the
    fix; before the fix, each trained differently in silence. See [Note: freed gradients]."""
    model, reference, optim, plain = _adamw_loops(sharded)
    # Clipping over the model's parameters between backward and step (nanoGPT, tutorials):
    # the plain loop clips; here the gradients were stepped, and clip_grad_norm_ used to
    # return 0 and clip nothing.
    loss_fn(model, *_x(0, sharded)).backward()
    with pytest.raises(RuntimeError, match=r"max_grad_norm="):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_value="):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match=r"optim\.grad_norm\(\)"):
        sum(p.grad.square().sum() for p in model.parameters())
    # Noise added to the gradients between backward and step (gradient-noise training): the
    # plain loop steps the noisy gradients. Refused as any other use, naming the hook that
    # does it here, not as a second backward's gradient.
    grad = model.head.weight.grad
    with pytest.raises(RuntimeError, match=r"cannot use it.*param\.register_hook"):
        grad.add_(grad.detach())
    optim.step()
    optim.zero_grad()
    loss_fn(reference, *_x(0, sharded)).backward()
    plain.step()
    plain.zero_grad()
    assert_match(model, reference)
    # The module's zero_grad(set_to_none=False) after step(): refused at the call.
    _step_both(((model, optim), (reference, plain)), 1, sharded, zero=False)
    _refused_unmoved(
        model,
        r"model\.zero_grad\(\) \(set_to_none=True",
        lambda: model.zero_grad(set_to_none=False),
    )
    model.zero_grad()
    reference.zero_grad()
    assert_match(model, reference)
    # No zero_grad() at all: the plain optimizer steps the sum of both backwards' gradients;
    # the second backward is refused before any parameter moves.
    _step_both(((model, optim), (reference, plain)), 2, sharded, zero=False)
    assert_match(model, reference)
    _refused_unmoved(
        model,
        r"never dropped \(no zero_grad\(\) since\)",
        lambda: loss_fn(model, *_x(3, sharded)).backward(),
    )


def test_freed_gradients_refused_where_a_plain_loop_uses_them():
    _freed_gradients_body()


def test_gradient_noise_added_by_a_tensor_hook_equals_the_plain_loop_adding_it():
    """The fix the refusal of an edited gradient names: noise added by ``param.register_hook``
    reaches the update in backward as the plain loop's ``p.grad.add_(noise)`` reaches its
    ``step()``."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    noise = {}
    for i, param in enumerate(model.parameters()):
        noise[i] = torch.randn(param.shape, generator=torch.Generator().manual_seed(i)) * 1e-2
        param.register_hook(lambda grad, n=noise[i]: grad + n)
    for step in range(3):
        loss_fn(model, *_x(step)).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, *_x(step)).backward()
        for i, param in enumerate(reference.parameters()):
            param.grad.add_(noise[i])
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


def test_freed_gradients_converted_with_the_module_and_dropped_by_zero_grad():
    """``Module.to`` converts the gradients it finds (a model cast for export after its last
    step): freed ones stay freed, and still raise when read; ``zero_grad()`` drops them."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for net, opt in ((model, optim), (reference, plain)):
        loss_fn(net, *_x(0)).backward()
        opt.step()
        net.double()
    assert_match(model, reference)
    grad = model.head.weight.grad
    assert is_freed(grad) and grad.dtype == torch.float64, grad
    with pytest.raises(RuntimeError, match="cannot use it"):
        grad.sum()
    assert reference.head.weight.grad.dtype == torch.float64
    optim.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_gradients_dropped_by_the_module_before_step_refused():
    """``model.zero_grad()`` between backward and ``step()``: the plain optimizer then steps
    nothing; here the update happened in backward, so ``step()`` refuses to commit it."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for net in (model, reference):
        loss_fn(net, *_x(0)).backward()
        net.zero_grad()
    before = _snapshot(reference)
    plain.step()
    _assert_unchanged(reference, before)
    with pytest.raises(RuntimeError, match=r"dropped or replaced before this step\(\)"):
        optim.step()


def test_gradient_set_through_data_before_step_refused():
    """``p.grad.data = values`` between backward and ``step()``: the plain optimizer steps the
    values; here the backward's gradient was stepped. It went unseen (``set_data`` reaches no
    dispatch) and the values were ignored: SGD 2.5e-1 apart after six steps. Refused at
    ``step()``, as ``p.grad = values`` is."""
    model, _, optim, _ = _adamw_loops(sharded=False)
    loss_fn(model, *_x(0)).backward()
    model.head.weight.grad.data = torch.full_like(model.head.weight, 0.01)
    with pytest.raises(RuntimeError, match=r"dropped or replaced before this step\(\)"):
        optim.step()


def test_gradient_detached_before_step_trains_as_plain():
    """``p.grad = p.grad.detach()`` after ``backward(create_graph=True)`` (dropping the
    gradients' graph before the step) changes nothing for the plain optimizer; here it was
    refused at ``step()`` as a replaced gradient, after every parameter had moved. The copy
    of a freed gradient still holds it: equal."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for step in range(3):
        for net, opt in ((model, optim), (reference, plain)):
            loss_fn(net, *_x(step)).backward(create_graph=True)
            for p in net.parameters():
                p.grad = p.grad.detach()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


def test_gradients_in_a_flat_buffer_written_after_backward_refused():
    """Hand-written data parallelism keeps every ``p.grad`` as a view of one flat buffer and
    reduces the buffer after backward (``dist.all_reduce(flat); flat /= world``): the plain
    optimizer steps the reduced gradients, ours stepped each rank's own in backward (SGD
    8.0e-2 apart on 2 ranks, the replicas 1.6e-1 apart, no error). The write into the buffer
    is refused at ``step()``; left unwritten, the loop trains as plain. See [Note: gradients
    in a flat buffer]."""
    for written in (True, False):
        runs = []
        for ours in (True, False):
            model, reference, optim, plain = _adamw_loops(sharded=False)
            net, opt = (model, optim) if ours else (reference, plain)
            params = list(net.parameters())
            flat = torch.zeros(sum(p.numel() for p in params))
            for p, view in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad = view.view_as(p)
            loss_fn(net, *_x(0)).backward()
            if written:
                flat.div_(2)  # what an all-reduce averaging over two ranks writes
            if ours and written:
                with pytest.raises(RuntimeError, match="flat gradient buffer"):
                    opt.step()
                break
            opt.step()
            opt.zero_grad()
            runs.append(net)
        if not written:
            assert_match(*runs)


def test_gradients_set_from_autograd_grad_then_accumulated_train_as_plain():
    """An auxiliary loss's gradients from ``torch.autograd.grad`` set as ``.grad`` by hand,
    then the main loss's backward adding to them: ``autograd.grad`` returns views of tensors
    of their own size (a transpose), no flat buffer. Equal to plain SGD, with one bucket and
    several (the view check refused it once)."""
    for bucket_numel in (None, 20):
        runs = []
        for ours in (True, False):
            torch.manual_seed(0)
            enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
            params = [*enc.parameters(), *head.parameters()]
            if ours:
                optim = OptimizerInBackward(
                    params, torch.optim.SGD, lr=0.1, bucket_numel=bucket_numel
                )
            else:
                optim = torch.optim.SGD(params, lr=0.1)
            for step in range(3):
                h = torch.tanh(enc(torch.randn(16, 4, generator=torch.manual_seed(step))))
                aux = h.pow(2).mean()
                for p, g in zip(
                    enc.parameters(),
                    torch.autograd.grad(aux, list(enc.parameters()), retain_graph=True),
                    strict=True,
                ):
                    p.grad = g
                head(h).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
            runs.append([p.detach().clone() for p in params])
        for p, q in zip(*runs, strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_gradient_dropped_by_an_earlier_hook_trains_as_plain():
    """A post-accumulate-grad hook registered before the optimizer that sets ``p.grad = None``
    (a parameter left out of this step): the plain optimizer skips it. Ours stepped the
    bucket on a missing gradient and raised ``AttributeError`` in backward, after other
    buckets moved. Equal."""
    runs = []
    for ours in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        model[0].bias.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        cls = torch.optim.SGD
        opt = (
            OptimizerInBackward(model.parameters(), cls, lr=0.1)
            if ours
            else cls(model.parameters(), lr=0.1)
        )
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs, strict=True):
        assert torch.equal(p, q)


def test_gradients_through_a_concatenation_set_by_hand_train_as_plain():
    """A fused QKV weight built with ``torch.cat`` from three parameters: ``torch.autograd.grad``
    returns narrow views of the concatenation's gradient, set as ``.grad``, then a backward
    adds to them. Views of a larger tensor that nothing writes after backward: equal to plain
    SGD (refused once as a flat gradient buffer)."""
    runs = []
    for ours in (True, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4, 8)) for _ in range(3)]
        optim = (
            OptimizerInBackward(params, torch.optim.SGD, lr=0.1, bucket_numel=40)
            if ours
            else torch.optim.SGD(params, lr=0.1)
        )
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            aux = (x @ torch.cat(params).t()).abs().mean()
            for p, g in zip(params, torch.autograd.grad(aux, params), strict=True):
                assert g._base is not None and g._base.numel() > g.numel()
                p.grad = g
            (x @ torch.cat(params).t()).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
        runs.append([p.detach().clone() for p in params])
    for p, q in zip(*runs, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def _loaded_between_backward_and_step_body(sharded: bool = False) -> None:
    """A checkpoint loaded between backward and ``step()`` (a rollback after a loss spike): the
    plain optimizer steps the loaded parameters and state with the backward's gradients; here
    the gradients were stepped before the load. Refused at ``step()``: the model's load (a
    write into parameters updated in backward), then the optimizer's. The plain loop's
    rollback, both loaded and ``zero_grad()``, is equal. On FSDP2 (3 ranks, uneven shards)
    when ``sharded``."""
    model, reference, optim, plain = _adamw_loops(sharded)
    _step_both(((model, optim), (reference, plain)), 0, sharded, zero=True)
    saved = [
        (
            {k: v.detach().clone() for k, v in net.state_dict().items()},
            copy.deepcopy(o.state_dict()),
        )
        for net, o in ((model, optim), (reference, plain))
    ]
    for net in (model, reference):
        loss_fn(net, *_x(1, sharded)).backward()
        net.load_state_dict(saved[net is reference][0])
    with pytest.raises(RuntimeError, match=r"written in place since"):
        optim.step()
    optim.load_state_dict(saved[0][1])
    with pytest.raises(RuntimeError, match=r"optimizer state was loaded while"):
        optim.step()
    plain.load_state_dict(saved[1][1])
    for opt in (optim, plain):
        opt.zero_grad()
    assert_match(model, reference)
    _step_both(((model, optim), (reference, plain)), 2, sharded, zero=True)
    assert_match(model, reference)
    assert_same_state_dict(
        optim.state_dict(), plain.state_dict(), path="rolled back", atol=PLAIN_ATOL
    )


def test_second_step_without_backward_refused():
    """``step()`` twice on one backward's gradients (a helper that steps, then the loop): the
    plain optimizer steps them twice; refused at the second, before anything moves."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    _step_both(((model, optim), (reference, plain)), 0, zero=False)
    assert_match(model, reference)
    before = _snapshot(reference)
    plain.step()
    assert not torch.equal(reference.head.weight, before["head.weight"])
    _refused_unmoved(model, r"step\(\) called again with no backward", optim.step)


def test_optimizer_state_edited_between_backward_and_step_refused():
    """Adam's moments reset between backward and ``step()`` (after a loss spike): the plain
    optimizer steps from the reset moments; here the step was taken before the reset."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    for step in range(2):
        for net, opt in ((model, optim), (reference, plain)):
            loss_fn(net, *_x(step)).backward()
            if step == 1:
                for entry in opt.state.values():
                    entry["exp_avg"].zero_()
            if opt is optim and step == 1:
                with pytest.raises(RuntimeError, match=r"optimizer state was written in place"):
                    opt.step()
            else:
                opt.step()
                opt.zero_grad()


def test_lr_set_between_backward_and_step_refused():
    """The LR set by hand between backward and ``step()`` (build-nanogpt's ``train_gpt2.py``
    sets it after clipping): the plain optimizer steps with the new LR; here the update was
    made in backward with the old one: refused at that ``step()``. Setting it back steps as
    the plain optimizer at the old LR."""
    model, reference, optim, plain = _adamw_loops(sharded=False)
    loss_fn(model, *_x(0)).backward()
    optim.param_groups[0]["lr"] = 2e-2
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] was changed between"):
        optim.step()
    optim.param_groups[0]["lr"] = ADAMW["lr"]
    optim.step()
    optim.zero_grad()
    loss_fn(reference, *_x(0)).backward()
    plain.step()
    plain.zero_grad()
    assert_match(model, reference)


def _two_group_loops() -> tuple[nn.Module, nn.Module, OptimizerInBackward, Optimizer]:
    """``_adamw_loops`` with the head's weight in a second group, without weight decay; the
    first group holds a NaN of the loop's own (unequal to itself, it was refused as changed
    at every step)."""
    model, reference = make_models()
    groups = [
        lambda net: [p for n, p in net.named_parameters() if n != "head.weight"],
        lambda net: [net.head.weight],
    ]

    def param_groups(net: nn.Module) -> list[dict]:
        return [
            {"params": groups[0](net), "note": math.nan},
            {"params": groups[1](net), "weight_decay": 0.0},
        ]

    optim = OptimizerInBackward(param_groups(model), torch.optim.AdamW, **ADAMW)
    return model, reference, optim, torch.optim.AdamW(param_groups(reference), **ADAMW)


def _replace_group(lr: float) -> Callable[[Optimizer], Callable[[], None]]:
    """An edit replacing ``param_groups[0]`` by a new dict with ``lr``; it returns its undo."""

    def edit(optim: Optimizer) -> Callable[[], None]:
        old = optim.param_groups[0]
        optim.param_groups[0] = {**old, "lr": lr}
        return lambda: optim.param_groups.__setitem__(0, old)

    return edit


def _move_head_weight(to: int | None) -> Callable[[Optimizer], Callable[[], None]]:
    """An edit moving the head's weight from ``param_groups[1]`` to ``param_groups[to]``, or
    out of every group; it returns its undo."""

    def edit(optim: Optimizer) -> Callable[[], None]:
        params = optim.param_groups[1]["params"]
        weight = params.pop()
        if to is not None:
            optim.param_groups[to]["params"].append(weight)

        def undo() -> None:
            if to is not None:
                optim.param_groups[to]["params"].pop()
            params.append(weight)

        return undo

    return edit


def _write_key(key: str) -> Callable[[Optimizer], Callable[[], None]]:
    """An edit writing a key of the loop's own into ``param_groups[0]`` (a logged value), which
    AdamW's step never reads; it returns its undo."""

    def edit(optim: Optimizer) -> Callable[[], None]:
        optim.param_groups[0][key] = 1.0
        return lambda: optim.param_groups[0].pop(key)

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (_replace_group(5e-2), r"param_groups\[0\]\['lr'\] was changed"),
        (_move_head_weight(0), r"moved from param_groups\[1\] to param_groups\[0\]"),
        (_move_head_weight(None), r"removed from param_groups"),
        (_replace_group(ADAMW["lr"]), None),
        (_write_key("last_loss"), None),
    ],
    ids=[
        "group-dict-replaced",
        "moved-to-another-group",
        "removed",
        "replaced-same-values",
        "key-no-update-reads",
    ],
)
def test_param_groups_edited_between_backward_and_step(edit, match):
    """``param_groups`` edited between backward and ``step()`` in its structure, not a value
    in place: a group's dict replaced with another LR, a parameter moved into a group with
    weight decay, or removed from every group. The plain optimizer steps with the new groups;
    here the updates were made in backward with the old ones: refused at that ``step()``
    (before, the first two ended 4.0e-2 and 1.6e-3 apart without an error, the third raised a
    misleading error a backward later). Undoing the edit steps as the plain optimizer; a dict
    replaced with the same values changes nothing, nor does a key AdamW never reads (it was
    refused; a class other than torch.optim's has every key compared)."""
    model, reference, optim, plain = _two_group_loops()
    for step in range(3):
        for net, opt in ((model, optim), (reference, plain)):
            loss_fn(net, *_x(step)).backward()
            if opt is optim and step == 1:
                undo = edit(opt)
                if match is not None:
                    _refused_unmoved(model, match, opt.step)
                    undo()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


@pytest.mark.parametrize(
    ("cls", "betas", "edit"),
    [
        (torch.optim.NAdam, [0.9, 0.99], lambda betas: betas.__setitem__(0, 0.5)),
        (torch.optim.Adam, (torch.tensor(0.9), torch.tensor(0.99)), lambda b: b[0].fill_(0.5)),
    ],
    ids=["list", "tensor in a tuple"],
)
def test_value_edited_in_place_between_backward_and_step_refused(cls, betas, edit):
    """NAdam keeps ``betas`` as the list it is given, Adam a tuple of the tensors it is
    given; ``param_groups[0]["betas"][0] = 0.5``, or ``betas[0].fill_(0.5)``, between backward
    and ``step()`` changes what the plain optimizer steps with. The list was noted by
    reference, the tuple without its tensors' version counters, so the edits went unseen
    (4.3e-3 and 7.6e-3 apart after a few steps, no error): refused, before anything moves."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), cls, lr=1e-2, betas=betas)
    loss_fn(model, *_x(0)).backward()
    optim.step()
    optim.zero_grad()
    loss_fn(model, *_x(1)).backward()
    edit(optim.param_groups[0]["betas"])
    _refused_unmoved(model, r"param_groups\[0\]\['betas'\] was changed", optim.step)


def _sam(model: nn.Module, optim: Optimizer, steps: range, restore: str, held: bool) -> None:
    """SAM as davda54/sam writes it: the ascent backward (under ``accumulate()`` for ours),
    the weights perturbed in place along the gradient, the backward at the perturbed point
    (under ``accumulate()`` too if ``held``), then the weights restored (``restore``:
    ``"assign"`` its ``p.data = old_p``, ``"copy"`` an in-place ``p.copy_(old_p)``,
    ``"load_swapped"`` a ``load_state_dict()`` under the swap flag, which swaps a new C++
    tensor into each parameter, its gradient left behind) and ``step()``, which steps that
    gradient from the restored weights."""
    ours = isinstance(optim, OptimizerInBackward)
    params = list(model.parameters())
    for step in steps:
        with optim.accumulate() if ours else contextlib.nullcontext():
            loss_fn(model, *_x(step)).backward()
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        old = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(p.grad * 0.05 / (norm + 1e-12))
        optim.zero_grad()
        with optim.accumulate() if ours and held else contextlib.nullcontext():
            loss_fn(model, *_x(step)).backward()
        if restore == "load_swapped":
            names = [name for name, _ in model.named_parameters()]
            with swapping_conversions():
                model.load_state_dict(dict(zip(names, old, strict=True)))
        with torch.no_grad():
            for p, backup in zip(params, old, strict=True):
                if restore == "assign":
                    p.data = backup
                elif restore == "copy":
                    p.copy_(backup)
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize(
    ("restore", "match"),
    [
        ("assign", "its data was replaced"),
        ("copy", "was written in place"),
        ("load_swapped", "was written in place"),
    ],
    ids=["p.data = old_p", "p.copy_(old_p)", "load_state_dict swapping"],
)
def test_sam_restoring_weights_between_backward_and_step_refused(restore, match):
    """SAM's second step (davda54/sam: ``p.data = self.state[p]["old_p"]``, then the base
    optimizer's ``step()``; FGM and AWP restore weights alike): the plain optimizer steps the
    restored weights with the gradient taken at the perturbed ones. Here the gradient was
    stepped in backward into the perturbed weights, and the assignment replaced them with the
    update (5.8e-2 apart after six AdamW steps, no error; an in-place restore was already
    refused). Refused at that ``step()``, the weights the restored ones, as the plain loop's
    before its step; the backward run under ``accumulate()`` too, as the message says, holds
    the gradient for ``step()``: equal. Restored by ``load_state_dict()`` under the swap flag,
    which also leaves the freed gradients behind with the old C++ tensors, it was refused as
    gradients dropped by ``model.zero_grad()``: the write is named now."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    with pytest.raises(RuntimeError, match=match):
        _sam(model, optim, range(1), restore, held=False)
    assert_match(model, reference)  # the restored weights: as before the plain step
    model, reference, optim, plain = _adamw_loops(sharded=False)
    _sam(model, optim, range(3), restore, held=True)
    _sam(reference, plain, range(3), restore, held=False)
    assert_match(model, reference)


def _conv_net() -> nn.Module:
    """Convolutions without biases: every parameter 4-D, converted by ``memory_format``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.Tanh(),
        nn.Conv2d(6, 4, 3, padding=1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def _conv_loss(net: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 4, generator=g)
    return nn.functional.mse_loss(net(x), y)


def _to_channels_last(net: nn.Module) -> None:
    net.to(memory_format=torch.channels_last)


def _cloned(net: nn.Module) -> None:
    for param in net.parameters():
        param.data = param.data.clone()


def _rounded(net: nn.Module) -> None:
    net.half()
    net.float()


@pytest.mark.parametrize(
    ("convert", "equal"),
    [(_to_channels_last, True), (_cloned, True), (_rounded, False)],
    ids=["channels_last", "p.data = p.data.clone()", "half() then float()"],
)
def test_data_swapped_for_equal_values_between_backward_and_step(convert, equal):
    """A conversion that keeps every value (``model.to(memory_format=torch.channels_last)``,
    ``p.data = p.data.clone()``) between backward and ``step()``: the plain optimizer steps the
    converted weights, here the update was made before and the conversion copied it; the
    update is elementwise, so both are the same. It was refused as data replaced (with the
    check bypassed, 0.0 apart); equal now. A conversion that changes values (``half()`` then
    ``float()`` rounds them) is still refused, the weights the converted ones; and such a
    conversion with the optimizer's state loaded, then ``zero_grad()``, is no rollback: the
    converted weights hold the update, the plain loop's those of before it."""
    model, reference = _conv_net(), _conv_net()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(4):
        for net, opt in ((model, optim), (reference, plain)):
            _conv_loss(net, step).backward()
            if step == 1:
                convert(net)
            if opt is optim and not equal and step == 1:
                _refused_unmoved(net, "its data was replaced since by other values", opt.step)
                return
            opt.step()
            opt.zero_grad()
        assert_match(model, reference)
    saved = copy.deepcopy(optim.state_dict())
    _conv_loss(model, 4).backward()
    convert(model)
    optim.load_state_dict(copy.deepcopy(saved))
    _refused_unmoved(model, r"zero_grad\(\) called while 2 parameter\(s\) hold", optim.zero_grad)


def test_dtype_conversion_after_a_state_load_is_no_rollback():
    """Backward, the optimizer's state loaded, then ``model.double()`` and ``zero_grad()``:
    the conversion replaces every parameter's storage, which was taken for weights restored,
    so ``zero_grad()`` accepted a rollback whose weights still held the backward's update,
    no error. The converted values are the updated ones, rounded: refused, nothing moved."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    loss_fn(model, *_x(0)).backward()
    optim.step()
    optim.zero_grad()
    saved = copy.deepcopy(optim.state_dict())
    loss_fn(model, *_x(1)).backward()
    optim.load_state_dict(copy.deepcopy(saved))
    model.double()
    _refused_unmoved(model, r"zero_grad\(\) called while \d+ parameter\(s\) hold", optim.zero_grad)


def test_state_dict_between_backward_and_step_refused():
    """``torch.save(optim.state_dict(), path)`` between backward and ``step()``: the plain
    optimizer's state there is the state before this step's update, ours already holds it, so
    a rollback to that checkpoint resumed from another point (AdamW 9.6e-3 apart two steps
    after the rollback, step counters 3 and 4 saved, no error). Refused there, before
    anything moves; after ``step()`` it is the plain optimizer's, and under ``accumulate()``,
    where no update is made, it is allowed."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        for net, opt in ((model, optim), (reference, plain)):
            with opt.accumulate() if opt is optim else contextlib.nullcontext():
                loss_fn(net, *_x(step)).backward()
            assert_same_state_dict(opt.state_dict(), plain.state_dict())
            loss_fn(net, *_x(step + 2)).backward()
            if opt is optim:
                _refused_unmoved(model, r"state_dict\(\): .* await step\(\)", opt.state_dict)
            opt.step()
            opt.zero_grad()
        assert_same_state_dict(optim.state_dict(), plain.state_dict())
    assert_match(model, reference)


def test_checkpoint_loaded_between_backward_and_step_refused():
    _loaded_between_backward_and_step_body()


class _OwnScaler(torch.amp.GradScaler):
    """A scaler whose ``scale`` is its own: the backward of its loss is not told apart."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale


def test_grad_scaler_unscale_refused():
    """``scaler.unscale_(optim)`` before clipping (the AMP tutorial's loop) reads the gradients
    stepped in backward: refused there, naming bf16 autocast. (With torch's GradScaler the
    backward refuses first; a subclass scaling the loss its own way is not seen there.)"""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = _OwnScaler("cpu", init_scale=1024.0)
    scaler.scale(loss_fn(model, *_x(0))).backward()
    with pytest.raises(RuntimeError, match="bf16 autocast"):
        scaler.unscale_(optim)


def test_ten_loops_on_distributed_worlds(worlds):
    worlds.run(2, _reentrant_body)
    worlds.run(3, _kept_zero_gradients_body, sharded=True)
    worlds.run(3, _freed_gradients_body, sharded=True)
    worlds.run(2, _freed_gradients_body, sharded=True)
    worlds.run(3, _loaded_between_backward_and_step_body, sharded=True)
    worlds.run(2, _lamb_body, stepping="dtensor")
    worlds.run(3, _lamb_body, stepping=None)
    worlds.run(3, _global_clip_body)
    worlds.run(3, _global_clip_declared_body)
    worlds.run(2, _global_clip_declared_body)
    worlds.run(2, _clip_each_declared_body)
    worlds.run(2, _clipping_lamb_declared_body)
    worlds.run(3, _clip_each_declared_body)
    worlds.run(4, _clip_each_declared_body)  # the last rank's shards are all empty
    for stepping in ("dtensor", "whole_tensor"):
        worlds.run(2, _clip_each_rightly_declared, stepping=stepping)
        worlds.run(3, _clip_each_rightly_declared, stepping=stepping)
    worlds.run(2, _fsdp_two_backwards_body)
    worlds.run(3, _fsdp_step_on_part_body)
    worlds.run(2, _ddp_late_body)
    worlds.run(2, _grad_scaler_body)
    worlds.run(2, _fsdp1_body, use_orig_params=True)
    worlds.run(3, _fsdp1_body, use_orig_params=False)
    worlds.run(2, _replicate_body)
    worlds.run(3, _replicate_body)
    worlds.run(2, _grad_cache_body)
    worlds.run(2, _tensor_parallel_frozen_copy_body)


# ------------------------------------- 10. one optimizer, several classes, one global norm


def _muon_adamw(model: nn.Module, ours: bool, max_grad_norm: float | None, bucket_numel: int):
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "layers" in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "layers" in n)]
    if ours:
        return OptimizerInBackward(
            [{"params": matrices, "optimizer_cls": torch.optim.Muon, "lr": 0.02}, {"params": rest}],
            torch.optim.AdamW,
            options=InBackwardOptions(max_grad_norm=max_grad_norm, bucket_numel=bucket_numel),
            **ADAMW,
        )
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, **ADAMW)]


def _mixed(sharded: bool, max_grad_norm: float | None, bucket_numel: int) -> None:
    # The reference is unsharded, on the global batch: plain Muon on FSDP2's DTensors is not
    # exact (DESIGN section 1).
    model, reference = make_models()
    if sharded:
        shard(model)
    optim = _muon_adamw(model, True, max_grad_norm, bucket_numel)
    plain = _muon_adamw(reference, False, None, bucket_numel)
    for step in range(3):
        x, y = _x(step, sharded)
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, *_x(step)).backward()
        norm = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), max_grad_norm if max_grad_norm else math.inf
        )
        torch.testing.assert_close(optim.grad_norm(), full(norm), rtol=1e-5, atol=1e-6)
        for opt in plain:
            opt.step()
            opt.zero_grad()
    assert_match(model, reference, atol=1e-5)
    # Each class's entries keep its plain format; the group names its class by path.
    state = optim.state_dict()
    assert state["param_groups"][0]["optimizer_cls"] == "torch.optim.Muon"
    assert "optimizer_cls" not in state["param_groups"][1]
    muon_state = plain[0].state_dict()["state"]
    assert {k for e in muon_state.values() for k in e} == {"momentum_buffer"}
    optim.detach()
    again = _muon_adamw(model, True, max_grad_norm, bucket_numel)
    again.load_state_dict(copy.deepcopy(state))
    loaded = again.state_dict()["state"]
    assert loaded.keys() == state["state"].keys()
    for index, entry in state["state"].items():
        assert loaded[index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(full(loaded[index][key]), full(value), rtol=0, atol=0)
    assert again.param_groups[0]["lr"] == 0.02 and again.param_groups[0]["nesterov"]


def test_muon_and_adamw_groups_one_norm_one_clipping():
    """One OptimizerInBackward holding a Muon group and an AdamW group: grad_norm() is
    clip_grad_norm_ over the whole model, and clipping is exact on a one-bucket module."""
    _mixed(sharded=False, max_grad_norm=None, bucket_numel=20)
    _mixed(sharded=False, max_grad_norm=0.5, bucket_numel=1 << 20)


def _mixed_body() -> None:
    _mixed(sharded=True, max_grad_norm=None, bucket_numel=20)


def test_mixed_classes_on_fsdp2(worlds):
    worlds.run(2, _mixed_body)


class _Wrapper(torch.optim.Optimizer):
    """A wrapper keeping the optimizer in ``.optimizer``, as accelerate's does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step()


def test_loop_helpers_see_through_a_wrapper():
    """accumulate_grads and clip_grad_norm_ on a wrapped OptimizerInBackward act on it (not
    as on a plain optimizer, which would step twice or return a norm of nothing)."""
    from fused_optim_dist import accumulate_grads, clip_grad_norm_

    model, reference = make_models()
    optim = _Wrapper(OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _x(0)
    with accumulate_grads(optim):
        (loss_fn(model, x[:4], y[:4]) / 2).backward()
    (loss_fn(model, x[4:], y[4:]) / 2).backward()
    norm = clip_grad_norm_(optim, None)
    optim.step()
    (loss_fn(reference, x[:4], y[:4]) / 2 + loss_fn(reference, x[4:], y[4:]) / 2).backward()
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    plain.step()
    assert_match(model, reference)


@pytest.mark.parametrize(
    "bucket_numel,max_grad_norm", [(10**9, 0.05), (64, None)], ids=["clipped", "buckets"]
)
def test_backward_inside_autocast_steps_as_plain(bucket_numel, max_grad_norm):
    """``loss.backward()`` inside the ``torch.autocast`` block, ``step()`` after it: the plain
    update and ``clip_grad_norm_`` run without autocast, and so do ours in backward ([Note:
    updates outside autocast]). Before, Adafactor's matmul ran in bfloat16 in backward: 1.5e-3
    apart after five steps, no error."""
    model, reference = make_models()
    optim = OptimizerInBackward(
        model.parameters(),
        torch.optim.Adafactor,
        options=InBackwardOptions(max_grad_norm=max_grad_norm, bucket_numel=bucket_numel),
        lr=1e-2,
    )
    plain = torch.optim.Adafactor(reference.parameters(), lr=1e-2)
    for step in range(5):
        x, y = _x(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(reference, x, y).backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            torch.testing.assert_close(optim.grad_norm(), norm, rtol=1e-5, atol=0)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        for key, value in plain.state[q].items():
            torch.testing.assert_close(optim.state[p][key], value, rtol=0, atol=1e-7)


def test_loop_helper_measuring_an_overflowing_norm_equal():
    """The loop written once with ``clip_grad_norm_(optim, None)`` (measure, do not clip) and
    a loss spike whose gradients are finite but whose norm overflows to inf. Before, the
    helper measured the plain optimizer's norm with ``torch.nn.utils.clip_grad_norm_(params,
    inf)``, which multiplies every gradient by ``inf / (inf + 1e-6)``: every parameter NaN,
    where ours (no clipping) trained on."""
    from fused_optim_dist import clip_grad_norm_

    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW),
        torch.optim.AdamW(models[1].parameters(), **ADAMW),
    )
    norms: list[list[float]] = [[], []]
    for step in range(4):
        x, y = _x(step)
        for model, optim, logged in zip(models, optims, norms, strict=True):
            (loss_fn(model, x, y) * (1e20 if step == 1 else 1.0)).backward()
            logged.append(clip_grad_norm_(optim, None).item())
            optim.step()
            optim.zero_grad()
    assert math.isinf(norms[1][1])
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
    assert all(torch.isfinite(p).all() for p in models[1].parameters())
    assert_match(*models)


class _SGLD(torch.optim.Optimizer):
    """Stochastic gradient Langevin dynamics: half a gradient step plus Gaussian noise."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.5 * group["lr"])
                    p.add_(torch.randn_like(p), alpha=group["lr"] ** 0.5)


@declare_stepping("elementwise")
class _DeclaredSGLD(_SGLD):
    pass


@declare_stepping("elementwise")
class _DeclaredPythonNoise(torch.optim.SGD):
    """SGD whose learning rate is scaled by a draw from Python's ``random``."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * random.random())


@pytest.mark.parametrize("bucket_numel", [10**9, 1], ids=["one-bucket", "per-parameter"])
def test_class_drawing_random_numbers_declared_refused_undeclared_equal(bucket_numel):
    """SGLD draws its noise in ``step()``. Declared elementwise, the check on copies drew from
    the generator (shifting every later draw: dropout masks, the real noise), and per bucket
    the noise came in another order: 0.25 apart after four steps, no error. Now refused at
    the first backward, nothing moved and the generator as it was; undeclared (stepped
    jointly) it trains as plain."""
    model, reference = make_models()
    for cls in (_DeclaredSGLD, _DeclaredPythonNoise):
        optim = OptimizerInBackward(model.parameters(), cls, lr=1e-3, bucket_numel=bucket_numel)
        loss = loss_fn(model, *_x(0))
        generators = torch.get_rng_state(), random.getstate()
        _refused_unmoved(model, "draws random numbers", loss.backward)
        assert torch.equal(torch.get_rng_state(), generators[0]) and not optim.state
        assert random.getstate() == generators[1]
        optim.detach()
        model.zero_grad()

    model = copy.deepcopy(reference)
    loops = (
        (model, OptimizerInBackward(model.parameters(), _SGLD, bucket_numel=bucket_numel)),
        (reference, _SGLD(reference.parameters())),
    )
    for step in range(4):
        for net, opt in loops:
            torch.manual_seed(step)
            loss_fn(net, *_x(step)).backward()
            opt.step()
            opt.zero_grad()
    assert_match(model, reference)


@declare_stepping("elementwise")
class _BurnInSGLD(_SGLD):
    """SGLD whose noise starts after two steps of each parameter (a burn-in)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    p.add_(p.grad, alpha=-0.5 * group["lr"])
                    if state["step"] > 2:
                        p.add_(torch.randn_like(p), alpha=group["lr"] ** 0.5)


def test_class_drawing_random_numbers_after_a_burn_in_refused():
    """Declared elementwise, an SGLD that draws nothing in its first backward passes the check
    on copies; from its third step it draws per bucket, in another order than the plain
    step(): 0.18 apart after four steps, no error. Now refused at the first bucket that
    draws (that bucket has moved: what a step draws is not knowable before it runs)."""
    model, reference = make_models()
    optims = (
        OptimizerInBackward(model.parameters(), _BurnInSGLD, lr=1e-3, bucket_numel=1),
        _BurnInSGLD(reference.parameters(), lr=1e-3),
    )
    for step in range(4):
        for net, opt in zip((model, reference), optims, strict=True):
            torch.manual_seed(step)
            loss = loss_fn(net, *_x(step))
            if step == 2 and opt is optims[0]:
                with pytest.raises(RuntimeError, match="draws random numbers"):
                    loss.backward()
                optims[0].detach()
                return
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert_match(model, reference)
    pytest.fail("the draws were not refused")


def _dropout_forward(net: nn.Module, x: torch.Tensor) -> None:
    """A forward for logging, in train mode: its dropout draws a mask."""
    with torch.no_grad():
        nn.functional.dropout(net(x), 0.5, training=True)


_OWN = torch.Generator()


@pytest.mark.parametrize(
    "draw, after_step, refused",
    [
        (lambda net, x: torch.rand(()), False, "step"),
        (_dropout_forward, False, "draw"),
        (lambda net, x: torch.rand(()), True, None),
        (lambda net, x: torch.rand((), generator=_OWN), False, None),
        (lambda net, x: random.random(), False, None),
    ],
    ids=[
        "torch.rand-between",
        "dropout-forward-between",
        "torch.rand-after-step",
        "own-generator-between",
        "python-random-between",
    ],
)
def test_undeclared_class_drawing_with_the_loop_drawing_before_step(draw, after_step, refused):
    """SGLD left undeclared is stepped jointly, at the end of backward; the plain optimizer
    draws its noise at ``step()``. A loop drawing from torch's generator between backward and
    ``step()`` (a drop-path decision, a dropout forward for logging) got the class's draws
    before its own: 8.9e-2 apart after four steps, the loop's own draws different too, no
    error. Now refused at that ``step()``, which moves nothing more (the backward's update is
    made: what the loop draws after backward is not knowable there); the dropout forward is
    refused before it runs, reading the updated weights. The same loop drawing after
    ``step()``, from a generator of its own, or from Python's ``random`` (not the class's)
    trains as plain."""
    model, reference = make_models()
    optims = (OptimizerInBackward(model.parameters(), _SGLD), _SGLD(reference.parameters()))
    drawn: list[list[object]] = [[], []]
    torch.manual_seed(123)
    generators = torch.get_rng_state(), random.getstate(), _OWN.get_state()
    for net, opt, log in zip((model, reference), optims, drawn, strict=True):
        torch.set_rng_state(generators[0])
        random.setstate(generators[1])
        _OWN.set_state(generators[2])
        for step in range(4):
            x, y = _x(step)
            loss_fn(net, x, y).backward()
            if refused == "draw" and opt is optims[0]:
                _refused_unmoved(net, _READ_BEFORE_STEP, lambda: draw(net, x))  # noqa: B023
                return
            if not after_step:
                log.append(draw(net, x))
            if refused == "step" and opt is optims[0]:
                _refused_unmoved(net, "drew them at the end of backward", opt.step)
                return
            opt.step()
            if after_step:
                log.append(draw(net, x))
            opt.zero_grad()
    assert_match(model, reference)
    assert drawn[0] == drawn[1]


def test_rollback_after_a_jointly_stepped_class_drew_as_plain():
    """A backward rolled back (a loss spike: the weights and the optimizer's state loaded,
    then ``zero_grad()``) with SGLD left undeclared: the plain optimizer never ran that
    backward's step, so it drew nothing; here the class drew its noise at the end of
    backward, and every later draw was shifted: 1.4e-1 apart two steps after the rollback,
    no error. Now ``zero_grad()`` of the rollback sets torch's generator back to its state
    before those draws. Equal, the generator's state too."""
    model, reference = make_models()
    optims = (OptimizerInBackward(model.parameters(), _SGLD), _SGLD(reference.parameters()))
    generators = []
    for net, opt in zip((model, reference), optims, strict=True):
        torch.manual_seed(123)
        saved = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
        loss_fn(net, *_x(0)).backward()
        net.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        opt.zero_grad()
        for step in (1, 2):
            loss_fn(net, *_x(step)).backward()
            opt.step()
            opt.zero_grad()
        generators.append(torch.get_rng_state())
    assert torch.equal(*generators)
    assert_match(model, reference)


def test_dcp_async_staging_waited_for_before_step_equal():
    """DCP's asynchronous staging (torchtitan's ``async_with_pinned_mem``) copies the state in
    a thread after ``async_save`` returns; torchtitan's loop waits for it before
    ``optimizer.step()``. Before, the updates made in backward ran while the copy did: the
    staged weights were the next step's (1.0e-2 apart) and so was the state (step counters
    one ahead), no error. Now a backward's first update waits for the staging."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        torch.optim.AdamW(models[1].parameters(), **ADAMW),
    )
    staged = []
    for model, optim in zip(models, optims, strict=True):
        stager = DefaultStager(StagingOptions(False, False, True, False))
        for step in range(4):
            if step == 2:
                state = {
                    "slow": SlowToCopy(),
                    "model": model.state_dict(),
                    "optim": optim.state_dict(),
                }
                staging = stager.stage(state)
            loss_fn(model, *_x(step)).backward()
            if step == 2:
                staged.append(staging.result())
            optim.step()
            optim.zero_grad()
        stager.close()
    ours, plain = staged
    torch.testing.assert_close(ours["model"], plain["model"], rtol=0, atol=0)
    torch.testing.assert_close(ours["optim"]["state"], plain["optim"]["state"], rtol=0, atol=0)
    assert_match(*models)


class _SelfParamsSGD(torch.optim.Optimizer):
    """Steps the parameters it keeps on itself, not its groups'."""

    def __init__(self, params, lr: float = 0.1) -> None:
        params = list(params)
        super().__init__(params, dict(lr=lr))
        self.params = params
        self._lock = threading.Lock()  # cannot be deep-copied

    @torch.no_grad()
    def step(self, closure=None):
        with self._lock:
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


class _CachedMomentum(torch.optim.Optimizer):
    """Keeps its state tensors in a list too, stepped from there."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))
        self._buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        if self._buffers is None:
            self._buffers = []
            for p in params:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                self._buffers.append(self.state[p]["momentum_buffer"])
        for p, buffer in zip(params, self._buffers, strict=True):
            if p.grad is not None:
                buffer.mul_(0.9).add_(p.grad)
                p.add_(buffer, alpha=-self.param_groups[0]["lr"])


class _EMASGD(torch.optim.Optimizer):
    """Updates an exponential moving average of the parameters held in a group entry, and
    resets its momentum once when a group says ``reset`` (popped by the step)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            reset = group.pop("reset", False)
            for p, average in zip(group["params"], group["ema"], strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if reset or "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["momentum_buffer"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
                average.lerp_(p, 0.1)


@pytest.mark.parametrize("cls", [_SelfParamsSGD, _CachedMomentum, _EMASGD])
def test_class_keeping_references_trains_as_plain(cls):
    """A class (stepped jointly, the default) keeping its parameters on itself, its state
    tensors in a list, or another model's parameters (an average it updates) in a group:
    before, the snapshot of its attributes and groups deep-copied them, and its step moved
    the copies: the model never trained (7.8e-2 apart), the saved momentum 0.44 apart, the
    average 2.5e-2, no error; an attribute that cannot be deep-copied (a lock) raised a
    TypeError. A flag the step pops from its group (a one-shot reset) stayed set (8.6e-2
    apart). Now equal: see [Note: what a snapshot shares]."""
    models = make_models()
    averages = [copy.deepcopy(m).requires_grad_(False) for m in models]
    optims = []
    for model, average, wrap in zip(models, averages, (True, False), strict=True):
        params = list(model.parameters())
        groups = [dict(params=params, ema=list(average.parameters()))] if cls is _EMASGD else params
        optims.append(OptimizerInBackward(groups, cls) if wrap else cls(groups))
    for step in range(4):
        for model, optim in zip(models, optims, strict=True):
            if step == 2 and cls is _EMASGD:
                optim.param_groups[0]["reset"] = True
            loss_fn(model, *_x(step)).backward()
            optim.step()
            optim.zero_grad()
            assert "reset" not in optim.param_groups[0]
    assert_match(*models)
    assert_match(*averages)
    assert_same_state_dict(optims[0].state_dict(), optims[1].state_dict())


class _AnnealedSGD(torch.optim.Optimizer):
    """SGD scaled by a temperature the loop anneals on the instance."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))
        self.temperature = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.temperature)


def test_attribute_of_the_class_set_through_the_optimizer_as_plain():
    """``optim.temperature = ...``, an attribute the class's step reads from its instance:
    before, it was set on this optimizer and the wrapped instance stepped with its initial
    value (7.9e-2 apart after five steps, no error). Now it is the wrapped instance's, read
    and set through the optimizer; set between backward and ``step()`` it is refused, nothing
    moved by the assignment."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), _AnnealedSGD),
        _AnnealedSGD(models[1].parameters()),
    )
    for step in range(5):
        for model, optim in zip(models, optims, strict=True):
            optim.temperature = 0.5**step
            loss_fn(model, *_x(step)).backward()
            optim.step()
            optim.zero_grad()
    assert optims[0].temperature == optims[1].temperature == 0.5**4
    assert_match(*models)
    loss_fn(models[0], *_x(5)).backward()
    before = _snapshot(models[0])
    with pytest.raises(RuntimeError, match="temperature was set between backward and step"):
        optims[0].temperature = 2.0
    _assert_unchanged(models[0], before)
    assert optims[0].temperature == 0.5**4


class _CountingSGD(torch.optim.Optimizer):
    """Keeps a step count on itself and saves it through its own ``state_dict``."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))
        self.k = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.k += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.k)

    def state_dict(self):
        return {**super().state_dict(), "k": self.k}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.k = state_dict.pop("k")
        super().load_state_dict(state_dict)


class _ResetOnZeroGrad(_AnnealedSGD):
    """Its step reads counts its own ``zero_grad`` (taking no argument) resets, one on itself
    and one per parameter in its state."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.since_zero = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.since_zero += 1
        self.temperature = 1.0 / self.since_zero
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    count = self.state[p]["count"] = self.state[p].get("count", 0) + 1
                    p.mul_(1 - 0.01 * count)
        super().step()

    def zero_grad(self) -> None:  # type: ignore[override]
        super().zero_grad()
        self.since_zero = 0
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = 0


def test_class_state_dict_override_refused():
    """A class saving values of its own through its ``state_dict`` override: ours saved
    torch.optim.Optimizer's state dict without them, and a run resumed from it ended 3.1e-2
    from the uninterrupted one, no error; now saving or loading is refused."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), _CountingSGD)
    loss_fn(model, *_x(0)).backward()
    optim.step()
    for call in (optim.state_dict, lambda: optim.load_state_dict({})):
        with pytest.raises(RuntimeError, match=r"_CountingSGD overrides (load_)?state_dict\(\)"):
            call()


def test_class_zero_grad_override_runs_as_plain():
    """A class whose ``zero_grad`` override resets values its step reads: ours never ran it
    (4.4e-2 apart after four steps, no error); then ran it with no parameters in its groups
    (the per-parameter reset did nothing: 5.8e-2 apart) and with an argument its signature
    lacks (TypeError); now it runs on its groups and state, called as the loop called ours."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), _ResetOnZeroGrad),
        _ResetOnZeroGrad(models[1].parameters()),
    )
    for step in range(4):
        for model, optim in zip(models, optims, strict=True):
            for micro in range(2):  # two backwards, one step(): since_zero counts 2, then 0
                with (
                    optim.accumulate()
                    if micro == 0 and optim is optims[0]
                    else (contextlib.nullcontext())
                ):
                    (loss_fn(model, *_x(2 * step + micro)) / 2).backward()
            optim.step()
            optim.zero_grad()
    assert_match(*models)


def test_step_before_any_gradient_on_free_tensors_as_plain():
    """SAC's entropy temperature: a free tensor (no module's parameter), ``step()`` called on
    iterations before its loss starts. Before, the check for an optimizer built before
    ``fully_shard`` took it for one and raised; free tensors are never replaced by
    ``fully_shard``. Now as plain."""
    runs = []
    for wrap in (True, False):
        log_alpha = torch.zeros(1, requires_grad=True)
        optim = (
            OptimizerInBackward([log_alpha], torch.optim.Adam, lr=1e-2)
            if wrap
            else torch.optim.Adam([log_alpha], lr=1e-2)
        )
        for step in range(4):
            optim.zero_grad()
            if step >= 2:
                (log_alpha.exp() * 0.5).sum().backward()
            optim.step()
        runs.append(log_alpha.detach())
    torch.testing.assert_close(*runs, rtol=0, atol=1e-7)


class _AdaHessian(torch.optim.Optimizer):
    """AdaHessian (Yao et al. 2021), simplified: Hutchinson's estimate of the Hessian's
    diagonal from the gradients' graph, as timm's. Declares ``is_second_order``, which timm's
    training script reads to call ``backward(create_graph=True)``."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @property
    def is_second_order(self) -> bool:
        return True

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        probes = [torch.randint_like(p, high=2) * 2 - 1 for p in params]
        grads = [p.grad for p in params]
        products = torch.autograd.grad(grads, params, grad_outputs=probes)
        with torch.no_grad():
            for p, product, probe in zip(params, products, probes, strict=True):
                curvature = self.state[p].setdefault("curvature", torch.zeros_like(p))
                curvature.mul_(0.9).add_((product * probe).abs(), alpha=0.1)
                p.addcdiv_(p.grad, curvature.add(1e-4), value=-self.param_groups[0]["lr"])


def test_second_order_flag_of_the_class_read_through_the_optimizer():
    """timm's loop: ``second_order = hasattr(optim, "is_second_order") and
    optim.is_second_order``, then ``loss.backward(create_graph=second_order)``. Before, the
    class's property was not reached through ours, the loop backpropagated without a graph,
    and AdaHessian's step failed in autograd; now as plain."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), _AdaHessian),
        _AdaHessian(models[1].parameters()),
    )
    for step in range(3):
        for model, optim in zip(models, optims, strict=True):
            second_order = hasattr(optim, "is_second_order") and optim.is_second_order
            torch.manual_seed(step)
            loss_fn(model, *_x(step)).backward(create_graph=second_order)
            optim.step()
            optim.zero_grad()
    assert_match(*models)


@declare_stepping("elementwise")
class _SharedCounterMomentum(torch.optim.Optimizer):
    """Keeps one step counter on itself, also every parameter's ``state[p]["step"]``."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))
        self.global_step = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        self.global_step += 1
        t = self.global_step.item()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state.setdefault("step", self.global_step)
                    momentum = state.setdefault("momentum", torch.zeros_like(p))
                    momentum.mul_(0.9).add_(p.grad, alpha=0.1)
                    p.add_(momentum, alpha=-group["lr"] / (1 - 0.9**t))


def test_counter_on_the_instance_shared_with_the_state_steps_once_per_backward():
    """Stepped per parameter, each bucket must start from the counter's value: shared by the
    snapshot as a state tensor, it advanced once per bucket (5.8e-3 apart after four steps,
    no error). 0-dim state tensors are copied."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), _SharedCounterMomentum, bucket_numel=1),
        _SharedCounterMomentum(models[1].parameters()),
    )
    for step in range(4):
        _step_both(tuple(zip(models, optims, strict=True)), step, zero=True)
    assert_match(*models)


def test_step_inside_autocast_refused_for_a_matmul_class_equal_for_adamw():
    """``backward()`` and ``step()`` both inside the ``torch.autocast`` block: the plain
    Adafactor's step runs under autocast, ours ran the update in backward without it (6.5e-5
    apart after five steps, no error): refused at ``step()``. An elementwise class (AdamW)
    does the same arithmetic either way: as plain."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(model, *_x(0)).backward()
        with pytest.raises(RuntimeError, match=r"step\(\) was called inside a torch.autocast"):
            optim.step()
    models = make_models()
    loops = tuple(
        zip(
            models,
            (
                OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW),
                torch.optim.AdamW(models[1].parameters(), **ADAMW),
            ),
            strict=True,
        )
    )
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _step_both(loops, step, zero=True)
    assert_match(*models)


def test_gradients_set_by_hand_stepped_under_the_callers_autocast():
    """Gradients set by hand (no backward), ``step()`` inside an autocast block: the plain
    Adafactor steps under autocast, and so does ours, at ``step()``; only the updates made in
    backward run with autocast off. Before, ``step()`` turned it off too (5.7e-5 apart after
    five steps, no error)."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.Adafactor, lr=1e-2),
        torch.optim.Adafactor(models[1].parameters(), lr=1e-2),
    )
    for step in range(5):
        torch.manual_seed(step)
        grads = [torch.randn_like(p) for p in models[1].parameters()]
        for model, optim in zip(models, optims, strict=True):
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.clone()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                optim.step()
            optim.zero_grad()
    assert_match(*models)


# ------------------------------------------------------------- parameters and state sharing memory


def _tie_by_memory(model: nn.Module, how: str) -> None:
    """Two parameters of ``model`` over one memory: two ``nn.Parameter`` of one tensor (experts
    upcycled without a clone), or a tie through ``.data``."""
    first, third = model.layers[0].up, model.layers[2].up
    if how == "upcycled":
        weight = first.weight.detach()
        first.weight, third.weight = nn.Parameter(weight), nn.Parameter(weight)
    else:
        third.weight.data = first.weight.data


@pytest.mark.parametrize("how", ["upcycled", "tied through .data"])
def test_parameters_sharing_memory_refused_at_construction(how):
    """The plain step() applies both updates to the shared memory in parameter order; here
    each bucket is stepped in backward order, and the backward reads the memory in between.
    Before, the ``.data`` tie here ended 1.0e-3 apart after three AdamW steps, no error; the
    upcycled pair (one version counter) was refused by autograd here, where a node read it
    after its update, and was 3.0e-2 apart with no error where none does (three buckets of a
    4096-wide MLP). Refused when the optimizer is built, or the group added, naming both."""
    model, _ = make_models()
    _tie_by_memory(model, how)
    with pytest.raises(ValueError, match=r"parameter 4 of param group 0 .* and parameter 16 "):
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1)
    named = model.named_parameters()
    with pytest.raises(ValueError, match=r"'layers.0.up.weight' .* and 'layers.2.up.weight' "):
        OptimizerInBackward(named, torch.optim.AdamW, **ADAMW, bucket_numel=1)
    # One of them frozen: the backward reads it after the other's update (a .data tie was
    # 1.0e-3 apart after three steps, no error).
    model.layers[0].up.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="share memory"):
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1)
    model.layers[0].up.weight.requires_grad_(True)
    first, third = model.layers[0].up.weight, model.layers[2].up.weight
    # One left out: a module's tensor over the memory trained (see the frozen-copy test).
    with pytest.raises(ValueError, match=r"parameter 'weight' of Linear .* not in the optimizer"):
        OptimizerInBackward([p for p in model.parameters() if p is not third], torch.optim.AdamW)
    others = [p for p in model.parameters() if p is not first and p is not third]
    optim = OptimizerInBackward(others, torch.optim.AdamW, **ADAMW)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 .*share memory"):
        optim.add_param_group({"params": [first, third]})
    assert len(optim.param_groups) == 1


def test_parameters_tied_through_data_after_construction_refused_before_moving():
    """A ``.data`` tie made after the optimizer was built: equal up to it, refused at the next
    backward, nothing moved."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        torch.optim.AdamW(models[1].parameters(), **ADAMW),
    )
    loops = tuple(zip(models, optims, strict=True))
    _step_both(loops, 0, zero=True)
    assert_match(*models)
    for model in models:
        _tie_by_memory(model, "tied through .data")
    _step_both(loops[1:], 1, zero=True)  # the plain loop trains on
    before = _snapshot(models[0])
    with pytest.raises(ValueError, match="share memory"):
        loss_fn(models[0], *_x(1)).backward()
    _assert_unchanged(models[0], before)
    with pytest.raises(ValueError, match="share memory"):
        optims[0].step()
    _assert_unchanged(models[0], before)


IN = 8


class _ReadsAFrozenCopy(nn.Module):
    """A layer between ``a`` and ``c`` multiplies by a copy of ``c.weight`` kept on the module
    (``how``): its backward node runs after ``c``'s gradient, so after ``c``'s bucket stepped
    with ``bucket_numel=1``, and reads the copy for ``a``'s gradient."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c = nn.Linear(IN, IN), nn.Linear(IN, IN)
        self.transposed = how == "transposed view"
        if how == "clone":
            self.register_buffer("copy", self.c.weight.detach().clone())
        elif how == "frozen parameter":
            self.copy = nn.Parameter(self.c.weight.data, requires_grad=False)
        else:
            copy = self.c.weight.data.T if self.transposed else self.c.weight.data
            self.register_buffer("copy", copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(h @ self.copy if self.transposed else h @ self.copy.T)
        return self.c(h)


def _frozen_copy_loop(model: nn.Module, optim: Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, IN, generator=g), torch.randn(16, IN, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _cloned_copy_loops() -> tuple[tuple[nn.Module, nn.Module], tuple[Optimizer, Optimizer]]:
    """Two models keeping a ``.clone()`` of the weight, ours (``bucket_numel=1``) and plain
    AdamW on their trainable parameters."""
    models = _ReadsAFrozenCopy("clone"), _ReadsAFrozenCopy("clone")
    optims = (
        OptimizerInBackward(_trainable(models[0]), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        torch.optim.AdamW(_trainable(models[1]), **ADAMW),
    )
    return models, optims


@pytest.mark.parametrize("how", ["frozen parameter", "buffer", "transposed view"])
def test_frozen_copy_through_data_refused_at_construction(how):
    """A frozen copy of a weight made through ``.data`` (or a view of it), registered on a
    module and left out of the optimizer: the plain loop's backward reads it before
    ``step()``, ours after the weight's update in backward. Before, 2.1e-2 apart after four
    AdamW steps, no error (``bucket_numel=1``); now refused when the optimizer is built,
    naming the copy and the parameter. A ``.clone()``, what the refusal says, trains as
    plain."""
    model = _ReadsAFrozenCopy(how)
    with pytest.raises(ValueError, match=r"'copy' of _ReadsAFrozenCopy .* not in the optimizer"):
        OptimizerInBackward(_trainable(model), torch.optim.AdamW, **ADAMW, bucket_numel=1)
    models, optims = _cloned_copy_loops()
    for model, optim in zip(models, optims, strict=True):
        _frozen_copy_loop(model, optim, range(4))
    assert_match(*models, atol=0)


def _tensor_parallel_frozen_copy_body() -> None:
    """Tensor parallel (DTensors outside FSDP2 units, which the forward reads directly): a
    ``.data`` copy of a sharded weight holds its local shard's memory, and is refused at
    construction; its ``.clone()`` is accepted. A ``.data`` copy of an FSDP2 unit's parameter
    is accepted: the unit's forward reads the unsharded copy, never the shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model[0], mesh, ColwiseParallel())
    model.register_buffer("copy", model[0].weight.data)
    with pytest.raises(ValueError, match="buffer 'copy' of Sequential"):
        OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    model.copy = model[0].weight.detach().clone()
    OptimizerInBackward(model.parameters(), torch.optim.AdamW).detach()
    sharded = shard(make_models()[0])
    sharded.register_buffer("copy", sharded.layers[0].up.weight.data)
    OptimizerInBackward(sharded.parameters(), torch.optim.AdamW).detach()


def test_registered_tensor_over_other_bytes_of_the_memory_accepted():
    """A registered view of the trained parameter's storage that shares no byte with it (the
    other columns of one matrix) is accepted; one that does (a column of it) is refused."""
    matrix = torch.randn(8, 8)
    module = nn.Module()
    module.weight = nn.Parameter(matrix[:, 0::2])
    module.register_buffer("other_columns", matrix[:, 1::2])
    OptimizerInBackward([module.weight], torch.optim.AdamW).detach()
    module.register_buffer("first_column", matrix[:, 0])
    with pytest.raises(ValueError, match="buffer 'first_column' of Module"):
        OptimizerInBackward([module.weight], torch.optim.AdamW)


def test_frozen_copy_registered_after_construction_refused_before_moving():
    """Registered after the optimizer was built: refused at the next backward, nothing moved,
    and at ``step()`` again."""
    models, optims = _cloned_copy_loops()
    for model, optim in zip(models, optims, strict=True):
        _frozen_copy_loop(model, optim, range(2))
        model.copy = model.c.weight.data  # the buffer now over the weight's memory
    _frozen_copy_loop(models[1], optims[1], range(2, 3))  # the plain loop trains on
    before = _snapshot(models[0])
    with pytest.raises(ValueError, match=r"'copy' of _ReadsAFrozenCopy .* not in the optimizer"):
        _frozen_copy_loop(models[0], optims[0], range(2, 3))
    _assert_unchanged(models[0], before)
    with pytest.raises(ValueError, match="not in the optimizer"):
        optims[0].step()
    _assert_unchanged(models[0], before)


@pytest.mark.parametrize(
    "how", ["one parameter", "rows of one buffer", "columns of one buffer", "both frozen"]
)
def test_parameters_tied_as_one_or_disjoint_in_one_buffer_train_as_plain(how):
    """What the refusal suggests, memory shared without overlap, and frozen parameters
    sharing memory (never stepped): as plain, several buckets."""
    models = make_models()
    for model in models:
        first, third = model.layers[0].up, model.layers[2].up
        if how == "one parameter":
            third.weight = first.weight
            continue
        if how == "both frozen":
            third.weight.data = first.weight.data
            first.weight.requires_grad_(False)
            third.weight.requires_grad_(False)
            continue
        both = torch.cat(
            [first.weight.detach(), third.weight.detach()],
            dim=0 if how == "rows of one buffer" else 1,
        )
        halves = both.chunk(2, dim=0 if how == "rows of one buffer" else 1)
        first.weight.data, third.weight.data = halves
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        torch.optim.AdamW(models[1].parameters(), **ADAMW),
    )
    for step in range(3):
        _step_both(tuple(zip(models, optims, strict=True)), step, zero=True)
    assert_match(*models)


def _share_step(state: dict) -> None:
    """One ``step`` tensor in every entry of ``state`` (a hand-converted checkpoint)."""
    shared = torch.tensor(100.0)
    for entry in state.values():
        entry["step"] = shared


def test_state_tensor_taken_from_a_bucket_stepped_first_refused_at_the_written_one():
    """One parameter's ``step`` tensor put into the entry of a parameter stepped later in
    backward (a bucket per parameter): the bucket the tensor was taken from is not written and
    moves; the written one refuses before it moves, so the loop does not go on silently."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1)
    for step in range(2):
        loss_fn(model, *_x(step)).backward()
        optim.step()
        optim.zero_grad()
    params = list(model.parameters())  # backward steps the last ones first
    optim.state[params[0]]["step"] = optim.state[params[-1]]["step"]
    before = _snapshot(model)
    with pytest.raises(ValueError, match="holds one tensor"):
        loss_fn(model, *_x(2)).backward()
    name = next(n for n, p in model.named_parameters() if p is params[0])
    assert torch.equal(params[0].detach(), before[name]), "the written bucket moved"


@pytest.mark.parametrize(
    ("cls", "key"), [(torch.optim.Muon, "momentum_buffer"), (torch.optim.Adafactor, "row_var")]
)
@pytest.mark.parametrize("bucket_numel", [None, 1], ids=["one-bucket", "bucket-per-param"])
def test_whole_tensor_state_tensor_put_into_two_entries_refused(cls, key, bucket_numel):
    """The same for the whole-tensor classes, whose steps derive no views: the plain Muon
    updates a shared momentum twice per step in parameter order (2.0e-2 apart four steps
    later with a bucket per parameter, Adafactor's row variance 1.8e-3, no error, before).
    Refused before the written bucket moves (one bucket: before anything moves)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
    optim = OptimizerInBackward(model.parameters(), cls, lr=1e-2, bucket_numel=bucket_numel)
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()
    first, last = model[0].weight, model[2].weight
    optim.state[first][key] = optim.state[last][key]
    before = _snapshot(model)
    with pytest.raises(ValueError, match="holds one tensor"):
        model(x).square().sum().backward()
    assert torch.equal(first.detach(), before["0.weight"]), "the written bucket moved"
    if bucket_numel is None:
        _assert_unchanged(model, before)


def test_state_dict_sharing_a_tensor_between_parameters_refused_at_load():
    """The plain AdamW advances a ``step`` tensor shared by every entry once per parameter,
    in parameter order; here in backward order (1.9e-2 apart four steps after such a load,
    ``bucket_numel=1``, no error before). Refused by ``load_state_dict``, before anything is
    loaded."""
    models = make_models()
    optims = (
        OptimizerInBackward(models[0].parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        torch.optim.AdamW(models[1].parameters(), **ADAMW),
    )
    _step_both(tuple(zip(models, optims, strict=True)), 0, zero=True)
    saved = copy.deepcopy(optims[1].state_dict())
    _share_step(saved["state"])
    optims[1].load_state_dict(saved)  # the plain optimizer accepts it
    kept = copy.deepcopy(optims[0].state_dict())
    with pytest.raises(
        ValueError, match=r"parameter 0 of the state dict and of parameter 1 .*'step'"
    ):
        optims[0].load_state_dict(saved)
    assert_same_state_dict(optims[0].state_dict(), kept)
    # A class sharing a tensor on purpose (its counter on the instance, in every entry) is
    # not checked: test_counter_on_the_instance_shared_with_the_state_steps_once_per_backward
    # trains it as plain.
    model, _ = make_models()
    counting = OptimizerInBackward(model.parameters(), _SharedCounterMomentum)
    loss_fn(model, *_x(0)).backward()
    counting.step()
    counting.load_state_dict(counting.state_dict())


@pytest.mark.parametrize("bucket_numel", [None, 1], ids=["one-bucket", "bucket-per-param"])
def test_state_tensor_put_into_two_entries_by_hand_refused_before_moving(bucket_numel):
    """The same sharing written into ``optim.state`` by hand between steps: refused when the
    first bucket holding one of the entries is derived again, in the next backward, nothing
    moved and no update recorded (``state_dict()`` took the refused bucket for updates
    awaiting ``step()`` and raised). With a bucket per parameter the entries lie in different
    buckets (4.3e-3 apart four steps later, no error, while only one bucket's entries were
    compared)."""
    model, _ = make_models()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, **ADAMW, bucket_numel=bucket_numel
    )
    for step in range(2):
        loss_fn(model, *_x(step)).backward()
        optim.step()
        optim.zero_grad()
    _share_step(optim.state)
    before, kept = _snapshot(model), copy.deepcopy(optim.state_dict())
    with pytest.raises(ValueError, match="holds one tensor"):
        loss_fn(model, *_x(2)).backward()
    _assert_unchanged(model, before)
    assert_same_state_dict(optim.state_dict(), kept)


# ---------------------------------------------------- parameters unfrozen after being added


def _head_added_frozen_then_unfrozen() -> tuple[tuple[nn.Module, Optimizer], ...]:
    """Ours (one bucket per parameter) and plain AdamW on the body, the head added as a param
    group while frozen, then unfrozen."""
    ours_model, plain_model = make_models()
    for model in (ours_model, plain_model):
        model.head.requires_grad_(False)
    body = lambda m: [p for n, p in m.named_parameters() if not n.startswith("head")]  # noqa: E731
    loops = (
        (
            ours_model,
            OptimizerInBackward(body(ours_model), torch.optim.AdamW, **ADAMW, bucket_numel=1),
        ),
        (plain_model, torch.optim.AdamW(body(plain_model), **ADAMW)),
    )
    for model, optim in loops:
        optim.add_param_group({"params": list(model.head.parameters()), "lr": 1e-3})
        model.head.requires_grad_(True)
    return loops


def _fail_in_layer_0(model: nn.Module) -> None:
    """A backward raising in the first layer's backward hook (the head and the layers above
    have their gradients by then)."""

    def boom(*_: object) -> None:
        raise RuntimeError("bad batch")

    handle = model.layers[0].register_full_backward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="bad batch"):
            loss_fn(model, *_x(0)).backward()
    finally:
        handle.remove()


def test_head_unfrozen_after_its_group_was_added_steps_in_its_first_backward():
    """The head's gradient is the first of a backward. Hooked only when the plan was rebuilt,
    at the first hooked gradient (after the head's own), it was held to ``step()``; a backward
    retried after that one failed then stepped the head with both gradients before it was
    refused at a layer the failed one had updated (the head moved; found by the random-loop
    test). Frozen parameters are hooked too now: the failed backward steps the head, and the
    retry is refused before anything moves (at its forward now, which would read the updated
    weights); ``step()`` after the failure steps the partial gradients as the plain optimizer
    does, and a loop that does not fail trains as plain."""
    (model, optim), _ = _head_added_frozen_then_unfrozen()
    _fail_in_layer_0(model)
    assert optim._pending.holds(model.head.weight)
    _refused_unmoved(model, _READ_BEFORE_STEP, lambda: loss_fn(model, *_x(0)).backward())

    loops = _head_added_frozen_then_unfrozen()
    for model, optim in loops:
        _fail_in_layer_0(model)
        optim.step()
        optim.zero_grad()
    assert_match(*(model for model, _ in loops))
    for step in range(1, 4):
        _step_both(loops, step, zero=True)
    assert_match(*(model for model, _ in loops))
