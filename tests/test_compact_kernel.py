"""CompactAdamW's C kernel against its eager path: the same bits on every layout, the fallback
where the kernel cannot run, and what ``kernel="c"`` refuses. The kernel is built from
``fused_optim_dist/csrc/`` with the machine's C compiler; without one these tests fail (CI has
one), except the fallback test, which hides it."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _compact_runs import assert_same_run, train
from torch import nn

from fused_optim_dist import OptimizerInBackward, _compact_kernel
from fused_optim_dist.compact_adamw import CompactAdamW


@pytest.mark.parametrize(
    "weight_dtype,grad_dtype,correction,compand",
    [
        (w, g, c, k)
        for w, g, c, k in itertools.product(
            (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float32), (True, False),
            (True, False),
        )
        if not (w == torch.float32 and not c)  # float32 weights take no correction either way
    ],
)  # fmt: skip
def test_same_bits_as_eager(weight_dtype, grad_dtype, correction, compand):
    args = (weight_dtype, grad_dtype, correction, compand)
    assert_same_run(train("c", *args), train("eager", *args))


@pytest.mark.parametrize(
    "weight_dtype,grad_dtype,correction,compand",
    [
        (torch.bfloat16, torch.bfloat16, True, True),
        (torch.bfloat16, torch.float32, False, False),
        (torch.float32, torch.float32, True, True),
    ],
)
def test_same_bits_as_eager_with_4_bit_variance(weight_dtype, grad_dtype, correction, compand):
    """Packed 4-bit root codes (rows of odd length end in a padding nibble)."""
    args = (weight_dtype, grad_dtype, correction, compand)
    assert_same_run(train("c", *args, variance_bits=4), train("eager", *args, variance_bits=4))


@pytest.mark.parametrize("nonfinite", [float("nan"), float("inf"), 1e20])
@pytest.mark.parametrize(
    "weight_dtype,correction,compand,variance_bits",
    [
        (torch.bfloat16, True, True, 8),
        (torch.bfloat16, False, False, 4),
        (torch.float32, True, True, 4),
    ],
)
def test_same_bits_as_eager_where_values_turn_nan(
    weight_dtype, correction, compand, variance_bits, nonfinite
):
    """Gradients holding NaN, infinities, or values whose square overflows float32: weights and
    moments turn NaN. The state differed in its bits (the kernel's NaN scales 0x7FC0, eager's
    0xFFFF) and in its values (a momentum code -127 beside an infinite scale, decoded as an
    infinity, where eager's 0 decodes as a NaN): 720 of 1,536 parameters of 192 such runs
    (measured). Now the same bits but for those of NaN weights, NaN in both: see [Note:
    non-finite values] in ``_compact_codes.py``."""
    args = (weight_dtype, torch.bfloat16, correction, compand)
    kwargs = dict(variance_bits=variance_bits, nonfinite=nonfinite)
    run = train("c", *args, **kwargs)
    assert any(p.detach().isnan().any() for p in run[0])
    assert_same_run(run, train("eager", *args, **kwargs), nan_weight_bits=False)


@pytest.mark.parametrize("compand", [True, False])
@pytest.mark.parametrize("magnitude", [1e-39, 1e-37])
def test_same_codes_as_eager_where_a_scale_is_tiny(compand, magnitude):
    """A group whose largest momentum is below 2**-120 (a subnormal 1e-39, or 1e-37) has a
    scale whose inverse times the levels overflows: it is stored as zero, with zero codes,
    by both paths. Before, the factor was infinite and the codes NaN (eager wrote 0, the
    kernel -127, companded) or the extreme ones."""
    results = []
    for kernel in ("c", "eager"):
        weight = nn.Parameter(torch.ones(2, 32, dtype=torch.bfloat16))
        signs = torch.tensor([1.0, -1.0]).repeat(32)
        weight.grad = (signs * magnitude * 10).view(2, 32).to(torch.bfloat16)
        optim = CompactAdamW([weight], compand=compand, kernel=kernel)
        optim.step()
        results.append(optim.state[weight])
    c_state, eager_state = results
    assert c_state["exp_avg_code"].eq(0).all() and c_state["exp_avg_scale"].eq(0).all()
    for key, value in c_state.items():
        assert torch.equal(value, eager_state[key]), key


def test_tensor_hyperparameters_step_as_their_values():
    """``torch.optim.AdamW`` takes lr, betas, eps and weight decay as tensors: both paths step
    with them exactly as with the same floats."""
    as_floats = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    as_tensors = {
        k: tuple(map(torch.tensor, v)) if isinstance(v, tuple) else torch.tensor(v)
        for k, v in as_floats.items()
    }
    results = []
    for kernel, kwargs in itertools.product(("c", "eager"), (as_floats, as_tensors)):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in ((4, 32), (7,))]
        optim = CompactAdamW(params, kernel=kernel, **kwargs)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, dtype=torch.bfloat16)
            optim.step()
        results.append(params)
    for params in results[1:]:
        for p, q in zip(params, results[0], strict=True):
            assert torch.equal(p.detach(), q.detach())


def test_auto_takes_the_kernel_and_tells_autograd():
    """``kernel="auto"`` steps CPU tensors with the kernel, and bumps each weight's version
    counter as an in-place op would: autograd then refuses a backward through a graph that
    saved the old weight."""
    calls = []
    kernel = _compact_kernel.kernel()
    assert kernel is not None, _compact_kernel.unavailable_reason()
    weight = nn.Parameter(torch.randn(4, 32, dtype=torch.bfloat16))
    optim = CompactAdamW([weight])
    x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = (x @ weight).sum()
    weight.grad = torch.ones_like(weight)
    version = weight._version
    original, _compact_kernel._loaded = _compact_kernel._loaded, lambda *a: calls.append(a)
    try:
        optim.step()
    finally:
        _compact_kernel._loaded = original
    assert len(calls) == 1 and weight._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_falls_back_to_eager_where_it_cannot_run(monkeypatch, tmp_path):
    """No compiler: ``"auto"`` takes the eager path (the same bits), ``"c"`` refuses at
    construction. A non-contiguous gradient: ``"auto"`` takes the eager path for that batch,
    ``"c"`` refuses at the step, before anything moves."""
    reference, _ = train("eager", torch.bfloat16, torch.bfloat16, True, True)
    monkeypatch.setattr(_compact_kernel, "_loaded", None)
    monkeypatch.setattr(_compact_kernel, "_reason", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("FUSED_OPTIM_DIST_CACHE", str(tmp_path))  # nothing built there yet
    params, _ = train("auto", torch.bfloat16, torch.bfloat16, True, True)
    assert "failed" in _compact_kernel.unavailable_reason()
    for p, q in zip(params, reference, strict=True):
        assert torch.equal(p.detach(), q.detach())
    with pytest.raises(RuntimeError, match=r"C kernel is unavailable.*kernel='auto'"):
        CompactAdamW([nn.Parameter(torch.zeros(3))], kernel="c")
    monkeypatch.undo()

    weight = nn.Parameter(torch.randn(8, 32, dtype=torch.bfloat16))
    transposed = torch.randn(32, 8, dtype=torch.bfloat16).t()
    # A vector, whose batch (another kind) the kernel takes, comes first: it must not move.
    taken = nn.Parameter(torch.randn(32, dtype=torch.bfloat16))
    optim = CompactAdamW([taken, weight], kernel="c")
    taken.grad = torch.randn(32, dtype=torch.bfloat16)
    weight.grad = transposed
    before, taken_before = weight.detach().clone(), taken.detach().clone()
    with pytest.raises(RuntimeError, match=r"contiguous CPU tensors.*kernel='auto'"):
        optim.step()
    for p, old in ((taken, taken_before), (weight, before)):
        assert torch.equal(p.detach(), old) and not optim.state[p]["step"]
    auto, eager = (nn.Parameter(before.clone()) for _ in range(2))
    for p, kernel in ((auto, "auto"), (eager, "eager")):
        p.grad = transposed
        CompactAdamW([p], kernel=kernel).step()
    assert torch.equal(auto.detach(), eager.detach())


@pytest.mark.parametrize("groups", ["two", "one per parameter"])
def test_reused_plans_follow_replaced_state(groups, monkeypatch):
    """The kernel's tables and the eager path's flat views are reused from step to step
    ([Note: reused plans]) only while they point at the group's current tensors: a state
    tensor replaced in its entry, an entry dropped or replaced by a copy, a tensor removed
    from an entry, a state dict loaded, state tensors' storage swapped through ``.data =``
    (the kernel wrote freed memory, the eager path's views the old storage), a parameter set
    changed (a new list, the group's list changed in place, a parameter replaced by another
    on the same storage), a gradient of another dtype all give what the eager path gives
    when it keeps no plan. With one group per parameter the state is too large to snapshot
    for a group, and its entries are looked up."""
    runs = {}
    for kernel in ("c", "eager", "eager without plans"):
        if kernel == "eager without plans":
            monkeypatch.setattr(CompactAdamW, "_remember", lambda self, key, plan: None)
        params, optim = train(kernel.split()[0], torch.bfloat16, torch.bfloat16, True, True)
        if groups == "one per parameter":
            optim.param_groups = [{**optim.param_groups[0], "params": [p]} for p in params]
        first = params[0]
        entry = optim.state[first]
        entry["exp_avg_code"] = entry["exp_avg_code"].clone()
        first.grad = torch.randn(first.shape, dtype=torch.bfloat16)
        optim.step()
        del optim.state[params[1]]  # starts again from zero state
        optim.state[params[3]].pop("weight_error")  # starts again from a zero error
        optim.state[params[-1]].clear()  # the group's last entry: starts again from zero
        optim.step()
        optim.state[params[4]] = copy.deepcopy(optim.state[params[4]])
        optim.step()
        optim.load_state_dict(copy.deepcopy(optim.state_dict()))
        optim.step()
        for value in optim.state[params[5]].values():  # moved off and back, as to(device)
            value.data = value.data.clone()
        optim.step()
        optim.param_groups[0]["params"] = optim.param_groups[0]["params"][1:]
        optim.step()
        optim.param_groups[-1]["params"].pop()  # the same list, one parameter fewer
        optim.step()
        group = optim.param_groups[1]
        alias = nn.Parameter(group["params"][0].detach())  # the same storage, no state
        alias.grad = torch.randn(alias.shape, dtype=torch.bfloat16)
        group["params"][0] = alias
        optim.step()
        params[2].grad = torch.randn(params[2].shape)  # float32, where the table says bfloat16
        optim.step()
        runs[kernel] = params, optim
    assert_same_run(runs["c"], runs["eager without plans"])
    assert_same_run(runs["eager"], runs["eager without plans"])


def test_eager_path_writes_state_that_is_not_contiguous():
    """A state tensor that is not contiguous (loaded so, or set by hand) has no flat view
    ([Note: kept flat views]): it is gathered through a copy and written in place through a
    view shaped like it, at every step, as a contiguous one is through its kept view."""
    runs = []
    for contiguous in (True, False):
        params, optim = train("eager", torch.bfloat16, torch.bfloat16, True, True)
        entry = optim.state[params[0]]
        if not contiguous:
            for key in ("weight_error", "exp_avg_code"):
                entry[key] = entry[key].t().contiguous().t()
        held = dict(entry)
        torch.manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, dtype=torch.bfloat16)
            optim.step()
        assert all(entry[key] is value for key, value in held.items())
        runs.append((params, optim))
    assert not optim.state[params[0]]["exp_avg_code"].is_contiguous()
    assert_same_run(runs[1], runs[0])


def test_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel must be one of"):
        CompactAdamW([nn.Parameter(torch.zeros(3))], kernel="cuda")


@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_plans_reused_in_backward(kernel, monkeypatch):
    """In backward each bucket's group is handed the same ``params`` list at every step
    ([Note: cached local views]), so its plan is reused: the full path runs while state is
    created (the first step, then the step after, whose views are re-derived from the new
    state), never in steady state; and the weights and state are those of CompactAdamW
    stepped after backward, bit for bit."""
    full_steps = []
    step_group = CompactAdamW._step_group
    monkeypatch.setattr(
        CompactAdamW,
        "_step_group",
        lambda self, group: (full_steps.append(len(group["params"])), step_group(self, group)),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3))).to(torch.bfloat16)
    plain_model = copy.deepcopy(model)
    optim = OptimizerInBackward(
        model.parameters(), CompactAdamW, lr=1e-2, kernel=kernel, bucket_numel=16 * 17
    )
    plain = CompactAdamW(plain_model.parameters(), lr=1e-2, kernel=kernel)
    for _ in range(5):
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        for m, o in ((model, optim), (plain_model, plain)):
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    # Three buckets at the first two steps, the plain run's one group at its first.
    assert full_steps == [2, 2, 2, 6, 2, 2, 2]
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in plain.state[q].items():
            assert torch.equal(optim.state[p][key], value), key
