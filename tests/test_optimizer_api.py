"""OptimizerInBackward in one process, without torch.distributed: the API, its refusals, and
plain (unsharded) modules, each against plain torch.optim on an identical copy."""

from __future__ import annotations

import copy

import pytest
import torch
from _toy import (
    PLAIN_ATOL,
    assert_match,
    assert_same_state_dict,
    batch,
    bypassed,
    holds_gradient,
    loss_fn,
    make_models,
    train_reference,
)
from torch import nn

from fused_optim_dist import OptimizerInBackward, in_backward
from fused_optim_dist.compact_adamw import CompactAdamW

STEPS = 3
ADAMW = dict(lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------------- helpers


def _hooks(param: torch.Tensor) -> int:
    """Number of post-accumulate-grad hooks registered on ``param``."""
    return len(param._post_accumulate_grad_hooks or {})


def _assert_untouched(model: nn.Module) -> None:
    assert all(_hooks(p) == 0 for p in model.parameters())


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()


# ---------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("optimizer_cls", "error", "match"),
    [
        (torch.optim.LBFGS, ValueError, "LBFGS.step requires a closure"),
        (torch.optim.SparseAdam, ValueError, "SparseAdam is built for sparse gradients"),
        (nn.Linear, TypeError, "must be a torch.optim.Optimizer subclass"),
        (lambda params, lr: None, TypeError, "must be a torch.optim.Optimizer subclass"),
        ("torch.nn.Linear", TypeError, "must be a torch.optim.Optimizer subclass"),
        ("AdamW", ValueError, "'AdamW' is not a dotted import path"),
        ("torch.optim.NoSuchOptimizer", ValueError, "cannot import optimizer class"),
        ("no_such_module.AdamW", ValueError, "cannot import optimizer class"),
        (OptimizerInBackward, TypeError, "already an in-backward optimizer"),
        (in_backward(torch.optim.SGD), TypeError, "already an in-backward optimizer"),
    ],
    ids=[
        "LBFGS",
        "SparseAdam",
        "module-class",
        "function",
        "dotted-non-optimizer",
        "no-dot",
        "missing-attr",
        "missing-module",
        "OptimizerInBackward",
        "in_backward-class",
    ],
)
def test_refuses_optimizer_class(optimizer_cls, error, match):
    model, _ = make_models()
    with pytest.raises(error, match=match):
        OptimizerInBackward(model.parameters(), optimizer_cls, lr=0.1)
    _assert_untouched(model)
    # Nothing was registered: the parameters are still free for another optimizer.
    OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_refuses_bad_parameter_lists():
    model, _ = make_models(freeze=("inp", "layers", "head"))
    params = list(model.parameters())
    with pytest.raises(ValueError, match="empty parameter list"):
        OptimizerInBackward([], torch.optim.AdamW)
    with pytest.raises(ValueError, match="no parameter passed to OptimizerInBackward requires"):
        OptimizerInBackward(params, torch.optim.AdamW)
    _assert_untouched(model)

    model, _ = make_models()
    w, b = model.head.weight, model.head.bias
    with pytest.raises(ValueError, match=r"shape \(5, 6\) is listed twice"):
        OptimizerInBackward([w, b, w], torch.optim.AdamW)
    # Across groups torch.optim's own check speaks first; either message names the problem.
    with pytest.raises(ValueError, match=r"more than one parameter group|listed twice"):
        OptimizerInBackward([{"params": [w]}, {"params": [b, w], "lr": 1.0}], torch.optim.AdamW)
    with pytest.raises(ValueError, match="bucket_numel must be a positive int or None, not 0"):
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=0)
    _assert_untouched(model)

    optim = OptimizerInBackward([w], torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"more than one parameter group|listed twice"):
        optim.add_param_group({"params": [b, w]})
    assert _hooks(b) == 0 and _hooks(w) == 1
    assert len(optim.param_groups) == 1


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.AdamW, dict(ADAMW, max_grad_norm=0.5)),  # one bucket: clipped exactly
        (CompactAdamW, dict(lr=1e-2, bucket_numel=1)),
    ],
    ids=["AdamW-clipped", "CompactAdamW-buckets"],
)
def test_step_with_a_closure_equal_plain(cls, kwargs):
    """``step(closure)``, as torch.optim takes it and PyTorch Lightning calls it at every step
    (the closure zeroes, runs the forward and the backward; ``step`` is called under
    ``no_grad``): the closure's backward steps in backward, ``step`` returns its loss."""
    model, reference = make_models()
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in ("max_grad_norm", "bucket_numel")}
    optim = OptimizerInBackward(model.parameters(), cls, **kwargs)
    plain = cls(reference.parameters(), **plain_kwargs)
    for step in range(4):
        losses = []
        for net, opt in ((model, optim), (reference, plain)):

            def closure(net=net, opt=opt, step=step):
                opt.zero_grad()
                loss = loss_fn(net, *batch(step))
                loss.backward()
                if opt is plain and "max_grad_norm" in kwargs:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), kwargs["max_grad_norm"])
                return loss

            with torch.no_grad():
                losses.append(opt.step(closure))
        assert losses[0].item() == losses[1].item()
    assert_match(model, reference, atol=PLAIN_ATOL)


def test_step_with_no_gradient_steps_nothing():
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    before = copy.deepcopy(model.state_dict())
    assert optim.step() is None  # no gradient: nothing to do, as for the plain optimizer
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not optim.state


def test_second_optimizer_on_same_params_refused_until_detach():
    model, reference = make_models()
    first = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    with pytest.raises(ValueError, match="already stepped in backward by another live"):
        OptimizerInBackward(model.head.parameters(), torch.optim.SGD, lr=0.1)
    assert all(_hooks(p) == 1 for p in model.parameters())

    ref_optim = torch.optim.AdamW(reference.parameters(), **ADAMW)
    _train(model, first, 2)
    first.detach()
    _assert_untouched(model)
    # The state moves to a new optimizer, which then continues as if nothing had happened.
    second = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    second.load_state_dict(first.state_dict())
    assert all(_hooks(p) == 1 for p in model.parameters())
    _train(model, second, 2, start=2)
    train_reference(reference, ref_optim, 4)
    assert_match(model, reference)


def test_detached_optimizer_steps_like_plain_one():
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    optim.detach()
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    assert all(holds_gradient(p) for p in model.parameters())
    optim.step()
    assert all(not holds_gradient(p) for p in model.parameters())
    train_reference(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), 1)
    assert_match(model, reference)


def test_refused_attach_stays_detached():
    """``attach()`` refused while another optimizer steps the parameters in backward leaves
    this one detached: once the other lets go, it steps like the plain optimizer (it took
    itself for attached with no hooks, and its ``step()`` failed on a KeyError)."""
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    optim.detach()
    other = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    with pytest.raises(ValueError, match="already stepped in backward"):
        optim.attach()
    other.detach()
    loss_fn(model, *batch(0)).backward()
    optim.step()
    train_reference(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), 1)
    assert_match(model, reference)


# ---------------------------------------------------------------------------------- construction


def test_dotted_path_and_in_backward_factory():
    models = [make_models()[0] for _ in range(3)]
    _, reference = make_models()
    by_path = OptimizerInBackward(models[0].parameters(), "torch.optim.AdamW", **ADAMW)
    adamw_in_backward = in_backward(torch.optim.AdamW)
    by_factory = adamw_in_backward(models[1].parameters(), **ADAMW)
    by_path_factory = in_backward("torch.optim.AdamW")(models[2].parameters(), **ADAMW)
    for optim in (by_path, by_factory, by_path_factory):
        assert isinstance(optim, OptimizerInBackward)
        assert isinstance(optim, torch.optim.Optimizer)
        assert optim.optimizer_cls is torch.optim.AdamW
        assert optim.defaults == torch.optim.AdamW(reference.parameters(), **ADAMW).defaults
    assert adamw_in_backward.__name__ == "AdamWInBackward"
    train_reference(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), STEPS)
    for model, optim in zip(models, (by_path, by_factory, by_path_factory), strict=True):
        _train(model, optim, STEPS)
        assert_match(model, reference)


def test_param_groups_hold_every_key_of_the_wrapped_class():
    for cls, kwargs in [
        (torch.optim.AdamW, ADAMW),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (torch.optim.Adagrad, dict(lr=0.1)),
    ]:
        model, reference = make_models()
        groups = lambda m: [  # noqa: E731
            {"params": [p for n, p in m.named_parameters() if n.endswith("weight")]},
            {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "lr": 0.5},
        ]
        optim = OptimizerInBackward(groups(model), cls, **kwargs)
        plain = cls(groups(reference), **kwargs)
        assert optim.defaults == plain.defaults
        for group, plain_group in zip(optim.param_groups, plain.param_groups, strict=True):
            assert group.keys() == plain_group.keys()
            assert {k: v for k, v in group.items() if k != "params"} == {
                k: v for k, v in plain_group.items() if k != "params"
            }
        for group, given in zip(optim.param_groups, groups(model), strict=True):
            assert all(p is q for p, q in zip(group["params"], given["params"], strict=True))
        # Adagrad creates its state in the constructor; so does the facade.
        assert_same_state_dict(optim.state_dict(), plain.state_dict())


# ---------------------------------------------------------------------------------- plain modules


def test_norm_of_bfloat16_gradients_is_summed_in_float32():
    """The float64 norm of the bfloat16 gradients, where ``clip_grad_norm_`` rounds each
    tensor's norm and the total to bfloat16 (docs/gradients.md)."""
    model, reference = (m.to(torch.bfloat16) for m in make_models())
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.0)
    x, y = (t.bfloat16() for t in batch(0))
    loss_fn(reference, x, y).backward()
    loss_fn(model, x, y).backward()
    grads = [p.grad.double() for p in reference.parameters()]
    expected = torch.cat([g.flatten() for g in grads]).norm()
    torch.testing.assert_close(optim.grad_norm().double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("AdamW", dict(lr=1e-2, weight_decay=0.1, eps=1e-4)),
        ("Adam", dict(lr=1e-2, eps=1e-4)),
        ("SGD", dict(lr=1e-2, momentum=0.9)),
        ("Adagrad", dict(lr=1e-2)),
    ],
)
def test_low_precision_parameters_step_like_the_plain_optimizer(name, kwargs, dtype):
    """bfloat16 and float16 parameters are stepped by the class's own kernel, as the plain
    optimizer steps them, not by the fused one, which computes in float32 and rounds once
    (bfloat16 AdamW ended 3.5e-3 away after five steps). ``eps`` above float16's smallest
    normal: at AdamW's default the plain float16 loop divides by zero. See [Note: the fastest
    kernel of the same update]."""
    cls = getattr(torch.optim, name)
    model, reference = (m.to(dtype) for m in make_models())
    optims = (
        OptimizerInBackward(model.parameters(), cls, **kwargs),
        cls(reference.parameters(), **kwargs),
    )
    for net, optim in zip((model, reference), optims, strict=True):
        for step in range(STEPS + 2):
            x, y = batch(step)
            loss_fn(net, x.to(dtype), y.to(dtype)).backward()
            optim.step()
            optim.zero_grad()
    assert all(p.isfinite().all() for p in reference.parameters())
    assert_match(model, reference)


def test_plain_module_buckets_step_during_backward_and_flush_unused():
    model, reference = make_models(freeze=("layers.0.up",))
    frozen = [model.layers[0].up.weight, model.layers[0].up.bias]
    frozen_before = [p.clone() for p in frozen]
    # inp.weight's gradient is the last to arrive; by then the head must have been stepped.
    # (Registered before the optimizer, whose hook must run last: see test_never_silent.)
    head_seen: list[bool] = []
    head_before: list[torch.Tensor] = []
    model.inp.weight.register_post_accumulate_grad_hook(
        lambda _: head_seen.append(not torch.equal(model.head.weight, head_before[-1]))
    )
    # About one Block's worth of elements per bucket: several buckets, each completing while
    # backward is still running through the layers below it.
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=30, **ADAMW)
    ref_optim = torch.optim.AdamW(reference.parameters(), **ADAMW)
    # Frozen ones are hooked too (one unfrozen later steps in its first backward); a frozen
    # parameter gets no gradient, so its hook never runs.
    assert all(_hooks(p) == 1 for p in frozen)
    # Step 1 skips a norm (part of a bucket), step 2 a whole Block: those parameters get no
    # gradient, their buckets never complete, and end of backward steps the rest.
    skips = {1: lambda m: [m.layers[1].norm], 2: lambda m: [m.layers[2]]}
    for step in range(4):
        x, y = batch(step)
        for net, opt in ((model, optim), (reference, ref_optim)):
            head_before.append(model.head.weight.detach().clone())
            with bypassed(*skips.get(step, lambda m: [])(net)):
                loss_fn(net, x, y).backward()
            if net is model:
                assert all(not holds_gradient(p) for p in model.parameters()), "grads not freed"
            opt.step()
            opt.zero_grad()
        assert_match(model, reference)
    # Steps 0 and 3 use every parameter; on steps 1 and 2 the head's bucket may hold a skipped
    # parameter, and then completes only at the end of backward.
    assert head_seen[0] and head_seen[3]
    for p, before in zip(frozen, frozen_before, strict=True):
        assert torch.equal(p, before)
        assert p not in optim.state
    # The skipped parameters were not stepped: one step fewer, as with the plain optimizer.
    assert optim.state[model.layers[1].norm.weight]["step"].item() == 3
    assert optim.state[model.layers[2].up.weight]["step"].item() == 3
    assert_same_state_dict(optim.state_dict(), ref_optim.state_dict(), atol=PLAIN_ATOL)


def test_hand_set_gradients_are_stepped_by_step():
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=30, **ADAMW)
    ref_optim = torch.optim.AdamW(reference.parameters(), **ADAMW)
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        # Step 1 sets only some gradients: the others must be left alone.
        chosen = [i for i, _ in enumerate(reference.parameters()) if step != 1 or i % 3 == 0]
        for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters(), strict=True)):
            if i in chosen:
                grad = torch.randn(p.shape, generator=g)
                p.grad, q.grad = grad.clone(), grad.clone()
        optim.step()
        ref_optim.step()
        assert all(not holds_gradient(p) for p in model.parameters())
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), ref_optim.state_dict(), atol=PLAIN_ATOL)


def test_step_after_backward_does_nothing_more():
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    after_backward = copy.deepcopy(model.state_dict())
    # Read directly: state_dict() is refused until step() (tests/test_never_silent.py).
    state_after_backward = [copy.deepcopy(optim.state[p]) for p in model.parameters()]
    optim.step()
    optim.zero_grad()
    for key, value in model.state_dict().items():
        assert torch.equal(value, after_backward[key]), key
    for p, entry in zip(model.parameters(), state_after_backward, strict=True):
        assert optim.state[p].keys() == entry.keys()
        assert all(torch.equal(optim.state[p][k], v) for k, v in entry.items())
    train_reference(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), 1)
    assert_match(model, reference)
    # The stepped state is that of exactly one step.
    assert all(s["step"].item() == 1 for s in optim.state.values())


def test_zero_grad_and_add_param_group():
    model, reference = make_models()
    head = lambda m: list(m.head.parameters())  # noqa: E731
    rest = lambda m: [p for n, p in m.named_parameters() if not n.startswith("head")]  # noqa: E731
    optim = OptimizerInBackward(rest(model), torch.optim.AdamW, bucket_numel=30, **ADAMW)
    ref_optim = torch.optim.AdamW(rest(reference), **ADAMW)
    assert all(_hooks(p) == 0 for p in head(model))
    for step in range(4):
        if step == 2:
            # The head was trained by nobody so far; its gradients are dropped by hand.
            for net in (model, reference):
                net.head.zero_grad()
            optim.add_param_group({"params": head(model), "lr": 0.05, "weight_decay": 0.0})
            ref_optim.add_param_group({"params": head(reference), "lr": 0.05, "weight_decay": 0.0})
            assert all(_hooks(p) == 1 for p in head(model))
            assert optim.param_groups[1].keys() == ref_optim.param_groups[1].keys()
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        # Parameters outside the optimizer keep their gradients; its own were freed.
        assert all(holds_gradient(p) == (step < 2) for p in head(model))
        assert all(not holds_gradient(p) for p in rest(model))
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), ref_optim.state_dict(), atol=PLAIN_ATOL)

    # zero_grad drops gradients set by hand, as the plain optimizer's does, and with
    # set_to_none=False zeroes them in place as it does.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.zero_grad()
    assert all(not holds_gradient(p) for p in model.parameters())
    for net in (model, reference):
        for p in net.parameters():
            p.grad = torch.ones_like(p)
    kept = [p.grad for p in model.parameters()]
    optim.zero_grad(set_to_none=False)
    ref_optim.zero_grad(set_to_none=False)
    for p, q, grad in zip(model.parameters(), reference.parameters(), kept, strict=True):
        assert p.grad is grad and torch.equal(p.grad, q.grad) and not p.grad.any()


def test_state_dict_matches_plain_optimizer_and_round_trips():
    model, reference = make_models(freeze=("layers.1",))
    groups = lambda m: [  # noqa: E731
        {"params": [p for n, p in m.named_parameters() if n.endswith("weight")]},
        {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "lr": 3e-2},
    ]
    optim = OptimizerInBackward(groups(model), torch.optim.AdamW, amsgrad=True, **ADAMW)
    ref_optim = torch.optim.AdamW(groups(reference), amsgrad=True, **ADAMW)
    _train(model, optim, STEPS)
    train_reference(reference, ref_optim, STEPS)
    saved = optim.state_dict()
    assert_same_state_dict(saved, ref_optim.state_dict(), atol=PLAIN_ATOL)
    assert len(optim.state) == sum(p.requires_grad for p in model.parameters())

    # Round trip into a fresh optimizer on a copy of the model, then train on.
    restored_model = copy.deepcopy(model)
    restored = OptimizerInBackward(groups(restored_model), torch.optim.AdamW, amsgrad=True, **ADAMW)
    restored.load_state_dict(copy.deepcopy(saved))
    assert_same_state_dict(restored.state_dict(), saved)
    # The plain optimizer's checkpoint loads into the facade too, and vice versa.
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(groups(plain_model), amsgrad=True, **ADAMW)
    plain.load_state_dict(copy.deepcopy(saved))
    from_plain_model = copy.deepcopy(reference)
    from_plain = OptimizerInBackward(
        groups(from_plain_model), torch.optim.AdamW, amsgrad=True, **ADAMW
    )
    # state_dict() returns the live state tensors: copy it, or both optimizers would share them.
    from_plain.load_state_dict(copy.deepcopy(ref_optim.state_dict()))

    for step in range(STEPS, STEPS + 2):
        x, y = batch(step)
        for net, opt in (
            (restored_model, restored),
            (plain_model, plain),
            (from_plain_model, from_plain),
            (reference, ref_optim),
        ):
            loss_fn(net, x, y).backward()
            opt.step()
            opt.zero_grad()
    for net in (restored_model, plain_model, from_plain_model):
        assert_match(net, reference)
    assert_same_state_dict(restored.state_dict(), ref_optim.state_dict(), atol=PLAIN_ATOL)
    assert_same_state_dict(from_plain.state_dict(), ref_optim.state_dict(), atol=PLAIN_ATOL)


# ---------------------------------------------------------------------------------- the class's API


def _schedule_free_run(in_backward_: bool) -> tuple[nn.Module, list[torch.Tensor]]:
    """Train with ``train()`` before each step and evaluate after ``eval()`` every other one."""
    from _schedule_free import ScheduleFreeSGD

    model, _ = make_models()
    if in_backward_:
        optim = OptimizerInBackward(model.parameters(), ScheduleFreeSGD, lr=0.1)
    else:
        optim = ScheduleFreeSGD(model.parameters(), lr=0.1)
    evaluations = []
    for step in range(4):
        x, y = batch(step)
        optim.train()
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        if step % 2:
            optim.eval()
            with torch.no_grad():
                evaluations.append(model(x))
    return model, evaluations


@pytest.mark.filterwarnings("ignore:ScheduleFreeSGD is not declared")
def test_train_and_eval_of_the_class_run_on_its_groups():
    """A schedule-free optimizer's ``train()``/``eval()`` move the parameters between its two
    points. Before, ``OptimizerInBackward`` had neither: the loop failed (the class refuses to
    step out of train mode), and where frameworks call them only if present (Trainer,
    accelerate) they were skipped, 1.1e-2 apart. See [Note: the wrapped class's own methods]."""
    model, evaluations = _schedule_free_run(in_backward_=True)
    reference, plain_evaluations = _schedule_free_run(in_backward_=False)
    assert_match(model, reference)
    for ours, plain in zip(evaluations, plain_evaluations, strict=True):
        torch.testing.assert_close(ours, plain, rtol=0, atol=PLAIN_ATOL)


class _WithStaticMethods(torch.optim.AdamW):
    @staticmethod
    def _rate(group: dict) -> float:
        return group["lr"] * 2

    @classmethod
    def _name(cls) -> str:
        return cls.__name__

    def _instance_method(self) -> None:
        """Not reached through ``OptimizerInBackward``: it would run on the wrapped instance,
        whose groups are not this optimizer's."""


def test_static_and_class_methods_of_the_class_are_reached():
    """transformers' ``AdafactorSchedule`` calls ``optimizer._get_lr(group, state)``, a static
    method: ``AttributeError`` after the first update before."""
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), _WithStaticMethods, lr=0.5)
    assert optim._rate(optim.param_groups[0]) == 1.0
    assert optim._name() == "_WithStaticMethods"
    for name in ("_instance_method", "train", "eval", "missing"):
        assert not hasattr(optim, name), name
    with pytest.raises(AttributeError, match=r"no optimizer class .* defines train\(\)"):
        optim.train()
