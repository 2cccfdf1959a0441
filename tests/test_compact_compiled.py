"""CompactAdamW's compiled path (``kernel="compile"``) against its eager path: the same bits on
every layout, and a learning-rate schedule that does not recompile. See [Note: compiling the
flat update]. On the CPU, Inductor builds C++ with the machine's compiler (CI has one)."""

from __future__ import annotations

import copy

import pytest
import torch
from _compact_runs import assert_same_run, train
from torch import nn
from torch._dynamo.utils import counters

from fused_optim_dist import OptimizerInBackward, _compact_compiled
from fused_optim_dist.compact_adamw import CompactAdamW

LAYOUTS = [
    (torch.bfloat16, torch.bfloat16, True, True),
    (torch.bfloat16, torch.float32, False, False),
    (torch.float32, torch.float32, True, True),
]
"""bfloat16 weights with and without their error, companded and linear momentum, float32
weights and gradients. Rows of whole groups only (the other matrix graph) are stepped by the
in-backward test's linear layers."""


@pytest.fixture(autouse=True)
def _own_graphs():
    """Each test compiles its own graphs (4 per run of ``train``): reused graphs, or Dynamo's
    limit of 8 graphs per function reached by earlier tests (past it the function runs
    uncompiled), would let a test pass without compiling what it checks."""
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("weight_dtype,grad_dtype,correction,compand", LAYOUTS)
def test_same_bits_as_eager(weight_dtype, grad_dtype, correction, compand):
    args = (weight_dtype, grad_dtype, correction, compand)
    compiled = train("compile", *args)
    # Matrices with short groups and vectors, each with one and with several step counts.
    assert counters["stats"]["unique_graphs"] == 4
    assert_same_run(compiled, train("eager", *args))


def test_same_bits_as_eager_with_4_bit_variance():
    """Packed 4-bit root codes, rows of odd length included: where a group is short, the
    codes' places among the nibbles are an input of the graph (as the groups' lengths are),
    not constants: the same 4 graphs as with 8 bits."""
    args = (torch.bfloat16, torch.bfloat16, True, True)
    compiled = train("compile", *args, variance_bits=4)
    assert counters["stats"]["unique_graphs"] == 4
    assert_same_run(compiled, train("eager", *args, variance_bits=4))


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype,grad_dtype,correction,compand", LAYOUTS)
def test_same_bits_as_eager_on_cuda(weight_dtype, grad_dtype, correction, compand):
    args = (weight_dtype, grad_dtype, correction, compand)
    assert_same_run(train("compile", *args, device="cuda"), train("eager", *args, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("variance_bits", [8, 4])
@pytest.mark.parametrize("weight_dtype,grad_dtype,correction,compand", LAYOUTS)
def test_cuda_eager_same_bits_as_cpu(weight_dtype, grad_dtype, correction, compand, variance_bits):
    """The eager path on CUDA takes float32 square roots where the CPU's takes them in float64
    (see ``_compact_codes.sqrt_rn``): both correctly rounded, so the same bits."""
    args = (weight_dtype, grad_dtype, correction, compand)
    cuda = train("eager", *args, device="cuda", variance_bits=variance_bits)
    assert_same_run(cuda, train("eager", *args, variance_bits=variance_bits))


def test_a_schedule_and_new_step_counts_do_not_recompile():
    """Hyperparameters and bias corrections are graph inputs, not constants: a learning rate
    that changes at every step runs the graph compiled at the first step."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(8, 64, dtype=torch.bfloat16))
    optim = CompactAdamW([weight], lr=1e-3, kernel="compile")
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1 / (step + 1))
    for step in range(4):
        weight.grad = torch.randn(weight.shape, dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            optim.step()
        schedule.step()


def test_in_backward_equals_eager_after_backward():
    """Compiled graphs run inside the gradient hooks: ``OptimizerInBackward`` stepping with the
    compiled path ends where the eager path ends after backward, two micro-batches a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 1)).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    in_backward = OptimizerInBackward(model.parameters(), CompactAdamW, lr=1e-2, kernel="compile")
    after = CompactAdamW(reference.parameters(), lr=1e-2, kernel="eager")

    def loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x).float().square().mean() / 2

    for _ in range(3):
        first, second = (torch.randn(8, 64, dtype=torch.bfloat16) for _ in range(2))
        with in_backward.accumulate():
            loss(model, first).backward()
        loss(model, second).backward()  # steps in backward
        in_backward.step()
        in_backward.zero_grad()
        loss(reference, first).backward()
        loss(reference, second).backward()
        after.step()
        after.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_without_a_compiler_the_first_step_raises_and_moves_nothing():
    """Inductor without its C++ compiler: the first step raises Inductor's error and leaves the
    weights and state (step counts included) as they were."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in [(4, 64), (64,)]]
    optim = CompactAdamW(params, kernel="compile")
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()
    before = copy.deepcopy((params, optim.state_dict()))
    for p in params:
        p.grad = torch.randn_like(p)
    torch._dynamo.reset()
    inductor = {"cpp.cxx": (None, "/nonexistent/c++"), "force_disable_caches": True}
    with torch._inductor.config.patch(inductor), pytest.raises(Exception, match="C\\+\\+ compiler"):
        optim.step()
    torch._dynamo.reset()
    for p, q in zip(params, before[0], strict=True):
        assert torch.equal(p.detach(), q.detach())
    for index, entry in optim.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, before[1]["state"][index][key]), (index, key)


def test_a_failed_batch_moves_no_batch_of_its_group(monkeypatch):
    """An update that fails in the group's second batch (the vectors' graph failing to
    compile, say) raises and leaves the first batch as it was too; the step run again ends
    where eager's ends. See [Note: a group moves whole or not at all]."""
    calls = []

    def compiled(update_flat):
        def update(*args):
            calls.append(len(calls))
            if len(calls) == 4:  # the second step's second batch
                raise RuntimeError("the vectors' graph failed to compile")
            return update_flat(*args)

        return update

    monkeypatch.setattr(_compact_compiled, "compiled", compiled)
    runs = {}
    for kernel in ("compile", "eager"):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in [(4, 64), (64,)]]
        optim = CompactAdamW(params, kernel=kernel)
        for step in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            if kernel == "compile" and step == 1:
                before = copy.deepcopy((params, optim.state_dict()))
                with pytest.raises(RuntimeError, match="failed to compile"):
                    optim.step()
                assert len(calls) == 4  # the first batch was updated, then the second failed
                for p, q in zip(params, before[0], strict=True):
                    assert torch.equal(p.detach(), q.detach())
                for index, entry in optim.state_dict()["state"].items():
                    for key, value in entry.items():
                        assert torch.equal(value, before[1]["state"][index][key]), (index, key)
            optim.step()
        runs[kernel] = params, optim
    assert_same_run(runs["compile"], runs["eager"])
