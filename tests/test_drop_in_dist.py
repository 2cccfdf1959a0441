"""Loops a plain optimizer survives, run differentially (gloo, CPU, real processes).

Each body runs the same loop twice on identically initialised models: with plain ``torch.optim``
stepped after backward (the reference) and with ``OptimizerInBackward``; the parameters must
match to 1e-6 and gradient norms match ``torch.nn.utils.clip_grad_norm_`` on the same gradients.
The numbered items are those of the drop-in robustness issue.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from _toy import (
    OUT_DIM,
    PLAIN_ATOL,
    SlowToCopy,
    assert_match,
    assert_same_state_dict,
    batch,
    full,
    loss_fn,
    make_models,
    rank_slice,
    shard,
)
from test_never_silent import GlobalClipSGD, GroupStepLamb, OutOfPlaceMomentum
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fused_optim_dist import InBackwardOptions, OptimizerInBackward, declare_stepping

ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _pair(sharded: bool = True, freeze: tuple[str, ...] = ()) -> tuple[nn.Module, nn.Module]:
    model, reference = make_models(freeze=freeze)
    if sharded:
        shard(model)
        shard(reference)
    return model, reference


def _backward(model: nn.Module, step: int, sharded: bool = True) -> torch.Tensor:
    x, y = batch(step)
    if sharded:
        x, y = rank_slice(x), rank_slice(y)
    loss = loss_fn(model, x, y)
    loss.backward()
    return loss


def _plain_step(reference: nn.Module, optim: torch.optim.Optimizer, step: int, **kw) -> None:
    _backward(reference, step, **kw)
    optim.step()
    optim.zero_grad()


def _ours_step(model: nn.Module, optim: OptimizerInBackward, step: int, **kw) -> None:
    _backward(model, step, **kw)
    optim.step()
    optim.zero_grad()


def _grad_norm(model: nn.Module) -> float:
    """``clip_grad_norm_``'s norm: DTensor gradients over all ranks, plain ones local (it takes
    the two kinds in separate calls)."""
    params = [p for p in model.parameters() if p.grad is not None]
    assert params, "no gradient to take the norm of"
    total = 0.0
    for sharded in (True, False):
        kind = [p for p in params if isinstance(p.grad, DTensor) == sharded]
        if kind:
            total += float(full(torch.nn.utils.clip_grad_norm_(kind, math.inf))) ** 2
    return math.sqrt(total)


# ------------------------------------------------------- 1. add_param_group with a generator


def _add_group_generator_body() -> None:
    model, reference = _pair()
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    ref_body = [p for n, p in reference.named_parameters() if not n.startswith("head")]
    optim = OptimizerInBackward(body, torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(ref_body, **ADAMW)
    for step in range(4):
        if step == 2:
            optim.add_param_group({"params": model.head.parameters(), "lr": 0.05})
            plain.add_param_group({"params": reference.head.parameters(), "lr": 0.05})
            assert len(optim.param_groups[1]["params"]) == 2
        _ours_step(model, optim, step)
        _plain_step(reference, plain, step)
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


# ------------------------------------------------------- 2. freezing and unfreezing


def _unfreezing_body(add_group_while_frozen: bool) -> None:
    frozen = ("layers.1",)
    model, reference = _pair(freeze=frozen)
    later = [p for n, p in model.named_parameters() if n.startswith(frozen)]
    ref_later = [p for n, p in reference.named_parameters() if n.startswith(frozen)]
    if add_group_while_frozen:
        rest = [p for n, p in model.named_parameters() if not n.startswith(frozen)]
        ref_rest = [p for n, p in reference.named_parameters() if not n.startswith(frozen)]
        optim = OptimizerInBackward(rest, torch.optim.AdamW, **ADAMW)
        plain = torch.optim.AdamW(ref_rest, **ADAMW)
    else:
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
        plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(6):
        if step == 1 and add_group_while_frozen:
            optim.add_param_group({"params": later})
            plain.add_param_group({"params": ref_later})
        if step == 2:  # progressive unfreezing, behind the optimizer's back
            for p in later + ref_later:
                p.requires_grad_(True)
        if step == 4:  # and frozen again
            for p in later + ref_later:
                p.requires_grad_(False)
        before = [full(p).detach().clone() for p in later]
        _ours_step(model, optim, step)
        _plain_step(reference, plain, step)
        moved = any(not torch.equal(b, full(p)) for b, p in zip(before, later, strict=True))
        assert moved == (step in (2, 3)), (step, moved)
        assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("add_group_while_frozen", [False, True], ids=["in-groups", "added"])
def test_unfreezing_trains_like_plain(worlds, world_size, add_group_while_frozen):
    worlds.run(world_size, _unfreezing_body, add_group_while_frozen=add_group_while_frozen)


# ------------------------------------------------------- 4. an optimizer that gets no gradient


class _WithAux(nn.Module):
    """The toy model plus an auxiliary head used on some steps only."""

    def __init__(self, main: nn.Module) -> None:
        super().__init__()
        self.main = main
        self.aux = nn.Linear(OUT_DIM, 1)

    def loss(self, step: int) -> torch.Tensor:
        x, y = batch(step)
        out = self.main(rank_slice(x))
        loss = nn.functional.mse_loss(out, rank_slice(y))
        if step % 3 == 0:
            loss = loss + self.aux(out).pow(2).mean()
        return loss


def _no_gradient_body() -> None:
    torch.manual_seed(0)
    ours_model = _WithAux(make_models()[0])
    ref_model = copy.deepcopy(ours_model)
    for m in (ours_model, ref_model):
        shard(m.main)
        fully_shard(m.aux)
    main = OptimizerInBackward(ours_model.main.parameters(), torch.optim.AdamW, **ADAMW)
    aux = OptimizerInBackward(ours_model.aux.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    plain_main = torch.optim.AdamW(ref_model.main.parameters(), **ADAMW)
    plain_aux = torch.optim.SGD(ref_model.aux.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 7):  # the aux head is unused on the first steps
        for model, optims in ((ours_model, (main, aux)), (ref_model, (plain_main, plain_aux))):
            model.loss(step).backward()
            for optim in optims:
                optim.step()  # aux: no gradient on most steps, nothing to do
                optim.zero_grad()
    assert_match(ours_model, ref_model)


# ------------------------------------------------------- 5. skip_nonfinite with clipping


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def _poison(linear: nn.Linear, active: list[bool]) -> None:
    """Make ``linear.weight``'s gradient NaN while ``active[0]``; nothing else is touched."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = _NaNGrad.apply(linear.weight) if active[0] else linear.weight
        return nn.functional.linear(x, weight, linear.bias)

    linear.forward = forward


def _skip_with_clipping_body(fused: bool) -> None:
    """``fused``: the skip happens on the device (``found_inf``), else on the host."""
    model, reference = _pair()
    active = [False]
    for m in (model, reference):
        _poison(m.layers[1].up, active)
    # A clip norm far above the gradients: the coefficient must stay exactly 1.
    optim = OptimizerInBackward(
        model.parameters(),
        torch.optim.AdamW,
        max_grad_norm=1e6,
        skip_nonfinite=True,
        fused=fused,
        **ADAMW,
    )
    plain = torch.optim.AdamW(reference.parameters(), fused=fused, **ADAMW)
    unit = {id(p) for p in reference.layers[1].parameters()}
    for step in range(5):
        active[0] = step == 2
        _ours_step(model, optim, step)
        _backward(reference, step)
        if active[0]:  # the reference skips the poisoned unit's update
            for p in reference.parameters():
                if id(p) in unit:
                    p.grad = None
        plain.step()
        plain.zero_grad()
        norm = optim.grad_norm()
        assert math.isfinite(norm) == (step != 2), (step, norm)
    assert optim.nonfinite_steps == 1
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


# ------------------------------------------------------- 6. DCP's state-creation step


def _dcp_state_creation_body(sharded: bool) -> None:
    runs = []
    for call_get_state_dict in (False, True):
        model, _ = make_models()
        if sharded:
            shard(model)
        optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=0.5)
        norms = []
        for step in range(4):
            if step == 2 and call_get_state_dict:
                norm_before = optim.grad_norm().clone()
                history = optim.gradient_state_dict()
                _, optim_state = get_state_dict(model, optim)  # a zero-lr, zero-grad step
                assert optim_state["state"] == {}  # plain SGD keeps no state either
                assert not optim.state
                assert torch.equal(optim.grad_norm(), norm_before)
                assert optim.gradient_state_dict() == history
            _ours_step(model, optim, step, sharded=sharded)
            norms.append(float(optim.grad_norm()))
        runs.append(([full(p).detach().clone() for p in model.parameters()], norms))
    (params_a, norms_a), (params_b, norms_b) = runs
    assert norms_a == norms_b
    for a, b in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _dcp_async_staging_body() -> None:
    """torchtitan's ``async_with_pinned_mem`` loop: ``get_state_dict``, staged in a thread,
    waited for before ``step()``. The staged shards and state are the plain loop's (before:
    9.7e-3 apart, the next step's, no error)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, reference = _pair()
    optims = (
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW),
        torch.optim.AdamW(reference.parameters(), **ADAMW),
    )
    staged = []
    for net, optim in zip((model, reference), optims, strict=True):
        stager = DefaultStager(StagingOptions(False, False, True, False))
        for step in range(4):
            if step == 2:
                staging = stager.stage({"slow": SlowToCopy(), "dcp": get_state_dict(net, optim)})
            _backward(net, step)
            if step == 2:
                staged.append(staging.result()["dcp"])
            optim.step()
            optim.zero_grad()
        stager.close()
    (model_ours, optim_ours), (model_plain, optim_plain) = staged
    for ours, plain in ((model_ours, model_plain), (optim_ours["state"], optim_plain["state"])):
        ours, plain = (tree_map_only(DTensor, DTensor.to_local, d) for d in (ours, plain))
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)
    assert_match(model, reference)


# ------------------------------------------------------- 7. a head applied after the FSDP root


class _HeadAfterRoot(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.post = nn.Linear(OUT_DIM, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.body(x))


def _follow(reference: nn.Module, model: nn.Module) -> None:
    """Put ``reference`` on ``model``'s weights, so that the next gradients compare."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.copy_(p)


def _head_after_root_body() -> None:
    """Clipping on: the norm and the history must cover the head and the FSDP units alike."""
    torch.manual_seed(0)
    ours, _ = make_models()
    ours = _HeadAfterRoot(ours)
    ref = copy.deepcopy(ours)
    shard(ours.body)  # the root is ``body``: ``post`` is outside every fully_shard
    shard(ref.body)
    optim = OptimizerInBackward(ours.parameters(), torch.optim.AdamW, max_grad_norm=1.0, **ADAMW)
    for step in range(4):
        _ours_step(ours, optim, step)
        _backward(ref, step)
        torch.testing.assert_close(float(optim.grad_norm()), _grad_norm(ref), rtol=1e-5, atol=0)
        ref.zero_grad()
        _follow(ref, ours)
    history = optim.gradient_state_dict()["previous_sq"]
    assert len(history) == len(optim._current_plan().buckets)
    torch.testing.assert_close(
        math.sqrt(sum(history.values())), float(optim.grad_norm()), rtol=1e-5, atol=0
    )


def _head_after_root_parity_body() -> None:
    torch.manual_seed(0)
    ours, _ = make_models()
    ours = _HeadAfterRoot(ours)
    ref = copy.deepcopy(ours)
    shard(ours.body)
    shard(ref.body)
    optim = OptimizerInBackward(ours.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(4):
        _ours_step(ours, optim, step)
        _backward(ref, step)
        torch.testing.assert_close(float(optim.grad_norm()), _grad_norm(ref), rtol=1e-5, atol=0)
        plain.step()
        plain.zero_grad()
    assert_match(ours, ref)


def _evaluate(model: nn.Module) -> None:
    """An evaluation forward under ``torch.no_grad()``: FSDP2 leaves the root unit unsharded
    (no backward comes to reshard it), its modules listing the all-gathered copies."""
    model.eval()
    with torch.no_grad():
        model(rank_slice(batch(100)[0]))
    model.train()


def _groups_after_an_evaluation_body(kept_after_forward: bool) -> None:
    """A plain optimizer given the root unit's parameters after an evaluation holds FSDP2's
    all-gathered copies and trains nothing for them, in silence; ours refuses them, naming
    ``model.reshard()``, before anything changes: at construction, in ``add_param_group``, and
    listed in a group in place (at the next ``step()``). After ``reshard()`` the group added
    later trains as the plain optimizer's. Kept unsharded after forward
    (``reshard_after_forward=False``), every unit is left so, a block's parameters refused
    too (by default the root alone)."""
    fsdp_kwargs = {"reshard_after_forward": False} if kept_after_forward else {}
    trap_model, _ = make_models()
    shard(trap_model, **fsdp_kwargs)
    _evaluate(trap_model)
    root = [trap_model.inp.weight, trap_model.head.weight]
    assert not any(isinstance(p, DTensor) for p in root)
    before = [p.detach().clone() for p in root]
    trap = torch.optim.AdamW(trap_model.parameters(), **ADAMW)
    _plain_step(trap_model, trap, 0)
    assert all(
        torch.equal(old, full(p).detach())
        for old, p in zip(before, (trap_model.inp.weight, trap_model.head.weight), strict=True)
    )

    model, reference = (shard(m, **fsdp_kwargs) for m in make_models())
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    ref_body = [p for n, p in reference.named_parameters() if not n.startswith("head")]
    optim = OptimizerInBackward(body, torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(ref_body, **ADAMW)
    _ours_step(model, optim, 0)
    _plain_step(reference, plain, 0)
    for m in (model, reference):
        _evaluate(m)
    refusal = r"all-gathered copy of a sharded parameter .* model\.reshard\(\)"
    with pytest.raises(ValueError, match=refusal):
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    if kept_after_forward:
        with pytest.raises(ValueError, match=refusal):
            OptimizerInBackward(model.layers[0].parameters(), torch.optim.AdamW, **ADAMW)
    with pytest.raises(ValueError, match=refusal):
        optim.add_param_group({"params": model.head.parameters(), "lr": 0.05})
    assert len(optim.param_groups) == 1
    weights = [p.to_local().clone() for p in body]
    optim.param_groups[0]["params"].append(model.head.weight)
    with pytest.raises(ValueError, match=refusal):
        optim.step()
    optim.param_groups[0]["params"].pop()
    assert all(torch.equal(w, p.to_local()) for w, p in zip(weights, body, strict=True))
    for m in (model, reference):
        m.reshard()
    optim.add_param_group({"params": model.head.parameters(), "lr": 0.05})
    plain.add_param_group({"params": reference.head.parameters(), "lr": 0.05})
    for step in range(1, 4):
        _ours_step(model, optim, step)
        _plain_step(reference, plain, step)
        _evaluate(model)
        _evaluate(reference)
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


def _step_after_an_evaluation_body() -> None:
    """One unit, evaluated, then ``step()`` with no backward (nothing to step) and training:
    as plain. The check that refuses an optimizer built before ``fully_shard`` (no gradient
    ever, no parameter on a live module) took the sharded parameters, which the unsharded
    unit's modules did not list, for replaced ones, and refused that ``step()``."""
    model, reference = make_models()
    fully_shard(model)
    fully_shard(reference)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for m, o in ((model, optim), (reference, plain)):
        _evaluate(m)
        o.step()
    for step in range(3):
        _ours_step(model, optim, step)
        _plain_step(reference, plain, step)
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


def _frozen_between_sync_off_micro_batches_body(layer: int) -> None:
    """FSDP2's micro-batches with gradient sync off, ``layer`` frozen after the first: FSDP2
    holds the layer's gradient unsharded and hands it over in the last micro-batch's
    backward, and the plain optimizer steps it. Ours refuses that backward where it starts,
    before anything moves, as for a layer frozen between micro-batches under ``accumulate()``
    (before, the last layer, reduced first, was refused so; the first, reduced after the
    others had moved, with an unrelated message)."""
    model, reference = _pair()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for net in (model, reference):
        _ours_step(net, optim if net is model else plain, 0)
        net.set_requires_gradient_sync(False)
        _backward(net, 1)
        net.layers[layer].requires_grad_(False)
        net.set_requires_gradient_sync(True)
    # The plain loop: the last micro-batch hands the frozen layer its gradient, and step()
    # steps it.
    frozen = list(reference.layers[layer].parameters())
    weights = [p.to_local().clone() for p in frozen]
    _backward(reference, 2)
    assert all(p.grad is not None for p in frozen)
    plain.step()
    assert all(not torch.equal(w, p.to_local()) for w, p in zip(weights, frozen, strict=True))
    params = optim.param_groups[0]["params"]  # the sharded ones: the root is unsharded
    before = [p.to_local().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"is frozen .* FSDP2's with gradient sync off"):
        _backward(model, 2)
    for old, param in zip(before, params, strict=True):
        assert torch.equal(old, param.to_local())


# ------------------------------------------------------- 10. norms on the parameters' mesh


def _sub_mesh_body() -> None:
    """Two independent data-parallel jobs in one world (ranks {0,1} and {2,3}): each norm and
    clip must see only its own job's gradients."""
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("job", "dp"))["dp"]
    job = rank // 2
    model, reference = make_models(seed=job)
    for m in (model, reference):
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=0.3)
    for step in range(3):
        x, y = batch(10 * job + step)
        share = lambda t: t.chunk(2)[rank % 2]  # noqa: E731
        loss_fn(model, share(x), share(y)).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, share(x), share(y)).backward()
        torch.testing.assert_close(
            float(optim.grad_norm()), _grad_norm(reference), rtol=1e-5, atol=0
        )
        reference.zero_grad()
        _follow(reference, model)


def _no_collective_for_plain_tensors_body() -> None:
    model, _ = make_models()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=0.3, bucket_numel=20
    )
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for step in range(2):
            _ours_step(model, optim, step, sharded=False)
    finally:
        dist.all_reduce = original
    assert calls == []


# ------------------------------------------------------- a backward that raises


class _Boom(RuntimeError):
    pass


def _raise_at(module: nn.Module) -> torch.utils.hooks.RemovableHandle:
    def hook(_module, _grad_input, _grad_output):
        raise _Boom("a bad batch")

    return module.register_full_backward_hook(hook)


def _state_steps(optim: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): float(s["step"]) for p, s in optim.state.items() if "step" in s}


def _failing_backward_body(sharded: bool) -> None:
    """A backward raises after some buckets were stepped: ``zero_grad()`` refuses to discard
    what cannot be undone; ``step()`` accepts the partial step, as the plain optimizer stepping
    the same partial gradients."""
    model, reference = _pair(sharded=sharded)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=20, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(5):
        if step == 2:
            before = _state_steps(optim)
            for net in (model, reference):
                handle = _raise_at(net.layers[0])
                with pytest.raises(_Boom):
                    _backward(net, step, sharded=sharded)
                handle.remove()
                if sharded:
                    # FSDP2's recovery: without it, neither loop would train again.
                    net.reset_iter_state()
            assert _state_steps(optim) != before, "the failure came before any bucket stepped"
            with pytest.raises(RuntimeError, match=r"A backward raised after updating them"):
                optim.zero_grad()
            optim.step()
            optim.zero_grad()
            plain.step()
            plain.zero_grad()
            after_failure = [full(p).detach().clone() for p in model.parameters()]
            continue
        _ours_step(model, optim, step, sharded=sharded)
        _plain_step(reference, plain, step, sharded=sharded)
    assert_match(model, reference)
    moved = [
        not torch.equal(full(p), b) for p, b in zip(model.parameters(), after_failure, strict=True)
    ]
    assert all(moved), "the loop stopped training after the failure"


@pytest.mark.parametrize("change", [None, "lr", "weights"])
def test_a_change_after_a_failing_backward_is_refused_before_the_rest_moves(change):
    """A backward raises after some buckets were stepped, and the loop changes something
    before ``step()``: a new lr, or the weights restored from before the backward (without
    the optimizer). The plain ``step()`` steps every partial gradient with the new lr, or
    from the restored weights; here the stepped buckets used the old lr, or were overwritten.
    ``step()`` finished the backward first, noting the new values as those its updates were
    made with, and stepped the rest (2.2e-2 from plain with the lr, 1.1e-2 with the weights,
    no error). Refused now,
    nothing moved since the change; with nothing changed, equal."""
    model, reference = _pair(sharded=False)
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=50, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    before = copy.deepcopy(model.state_dict())
    for net in (model, reference):
        handle = _raise_at(net.layers[1])
        with pytest.raises(_Boom):
            _backward(net, 0, sharded=False)
        handle.remove()
    if change is None:
        optim.step()
        plain.step()
        assert_match(model, reference)
        return
    if change == "lr":
        optim.param_groups[0]["lr"] = 3 * ADAMW["lr"]
        match = r"param_groups\[0\]\['lr'\] was changed"
    else:
        model.load_state_dict(before)
        match = "written in place since"
    changed = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=match):
        optim.step()
    for param, then in zip(model.parameters(), changed, strict=True):
        assert torch.equal(param.detach(), then)


class _PlainSGD(torch.optim.SGD):
    """SGD as a class of one's own (a subclass is not torch.optim's): undeclared, or declared
    per call."""


def _after_a_failed_held_backward(
    cls: type[torch.optim.Optimizer],
    lr: float,
    then: Callable[[torch.optim.Optimizer], None],
    *,
    sharded: bool = False,
    stepping: str | None,
    bucket_numel: int | None = 20,
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """A first backward raising on ours and on plain ``cls``, where ours only held its
    buckets (to check the class, or to step it jointly), or, one bucket (``bucket_numel=
    None``), had completed none; ``then(optimizer)`` on each, then two ordinary steps, the
    models equal after each part. Returns ours and the plain one."""
    model, reference = _pair(sharded=sharded)
    optim = OptimizerInBackward(
        model.parameters(), cls, lr=lr, bucket_numel=bucket_numel, stepping=stepping
    )
    plain = cls(reference.parameters(), lr=lr)
    for net, opt in ((model, optim), (reference, plain)):
        handle = _raise_at(net.layers[0])
        with pytest.raises(_Boom):
            _backward(net, 0, sharded=sharded)
        handle.remove()
        if sharded:
            # FSDP2's recovery: without it, neither loop would train again.
            net.reset_iter_state()
        then(opt)
    assert_match(model, reference)
    before = [full(p).detach().clone() for p in model.parameters()]
    for step in range(1, 3):
        _ours_step(model, optim, step, sharded=sharded)
        _plain_step(reference, plain, step, sharded=sharded)
    assert_match(model, reference)
    assert all(not torch.equal(full(p), b) for p, b in zip(model.parameters(), before, strict=True))
    return optim, plain


def _failed_held_backward_body(sharded: bool, stepping: str | None) -> None:
    """A class's first backward raises, having only held its buckets (to check the class, or
    to step it jointly); the loop skips the batch with ``zero_grad()`` and calls ``step()``,
    which steps nothing, as the plain loop's (``step()`` stepped the held gradients captured
    before ``zero_grad()``: 4.1e-2 apart on FSDP2 for an ``"elementwise"`` class; a
    ``"dtensor"`` one raised an AttributeError)."""

    def skip_the_batch(opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        opt.step()
        opt.zero_grad()

    _after_a_failed_held_backward(
        _PlainSGD, 0.1, skip_the_batch, sharded=sharded, stepping=stepping
    )


def test_failed_backward_then_a_new_lr_for_a_held_class_is_refused():
    """One optimizer, two classes: SGD updates the head in backward, a class stepped jointly
    holds the blocks to the end of it. The backward raises, the loop sets a new lr for the
    blocks' group only, and calls ``step()``: the plain step steps the blocks with it; here
    finishing the backward stepped the held blocks with the old one, the head's group being
    unchanged (3.0e-3 apart, no error). Refused, nothing moved since the failure."""
    model, _ = _pair(sharded=False)
    blocks = [*model.inp.parameters(), *model.layers.parameters()]
    head = list(model.head.parameters())
    optim = OptimizerInBackward(
        [{"params": blocks}, {"params": head, "optimizer_cls": torch.optim.SGD, "lr": 0.1}],
        GlobalClipSGD,
        lr=0.05,
        bucket_numel=20,
    )
    handle = _raise_at(model.layers[0])
    with pytest.raises(_Boom):
        _backward(model, 0, sharded=False)
    handle.remove()
    assert optim._pass.updated  # the head moved in backward
    failed = [p.detach().clone() for p in model.parameters()]
    optim.param_groups[0]["lr"] = 0.15
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] was changed"):
        optim.step()
    for param, then in zip(model.parameters(), failed, strict=True):
        assert torch.equal(param.detach(), then)


def _first_step_entry_body(
    cls: type[torch.optim.Optimizer],
    key: str,
    value: object,
    missing: str,
    like: str,
    index: int,
    sharded: bool = True,
    recovery: str = "entry",
) -> None:
    """An option turned on in a group mid-run that needs a state entry the class makes only at
    a parameter's first step: the plain ``step()`` raises ``KeyError`` in that group's
    ``_init_group``, after the groups before it moved (the body, where the option is the
    head's). Ours used to raise the class's error in backward at that group's first bucket,
    after the buckets that the backward reached first had moved, and on FSDP2 with its units
    left mid-backward: where nothing had moved, a loop going on after it stepped nothing, no
    error. Now the backward completes holding its gradients, and ``step()`` raises before
    anything moves, naming the fix ([Note: a backward held for step()]). Then either the
    entry is added as it says and ``step()`` steps the held gradients (``recovery="entry"``),
    or the batch is skipped with ``zero_grad()`` and the option set back (``"skip"``): the
    loops end equal where the plain step raised before any update (the body's case); where
    it had moved the body first, ours trains on, every parameter moving."""
    model, reference = _pair(sharded=sharded)
    loops = []
    for net in (model, reference):
        head = list(net.head.parameters())
        body = [p for p in net.parameters() if all(p is not h for h in head)]
        loops.append([{"params": body}, {"params": head, "lr": 5e-3}])
    optim = OptimizerInBackward(loops[0], cls, lr=1e-2, bucket_numel=20)
    plain = cls(loops[1], lr=1e-2)
    for step in range(2):
        _ours_step(model, optim, step, sharded=sharded)
        _plain_step(reference, plain, step, sharded=sharded)
    for opt in (optim, plain):
        opt.param_groups[index][key] = value

    before = {p: full(p).detach().clone() for p in reference.parameters()}
    _backward(reference, 2, sharded=sharded)
    with pytest.raises(KeyError, match=missing):
        plain.step()
    for position, group in enumerate(plain.param_groups):
        for param in group["params"]:
            assert torch.equal(full(param), before[param]) == (position >= index)

    before = [full(p).detach().clone() for p in model.parameters()]
    _backward(model, 2, sharded=sharded)
    assert all(p.grad is not None for p in optim.param_groups[index]["params"])
    refused = rf"param_groups\[{index}\]\['{key}'\] is .* no '{missing}'.* Nothing was updated"
    with pytest.raises(RuntimeError, match=refused):
        optim.step()
    assert all(torch.equal(full(p), b) for p, b in zip(model.parameters(), before, strict=True))

    for opt in (optim, plain):
        if recovery == "entry":
            for param in opt.param_groups[index]["params"]:
                opt.state[param][missing] = torch.zeros_like(opt.state[param][like])
            opt.step()
        else:
            opt.param_groups[index][key] = type(value)()
        opt.zero_grad()
    before = [full(p).detach().clone() for p in model.parameters()]
    for step in range(3, 5):
        _ours_step(model, optim, step, sharded=sharded)
        if index == 0:
            _plain_step(reference, plain, step, sharded=sharded)
    assert all(not torch.equal(full(p), b) for p, b in zip(model.parameters(), before, strict=True))
    if index == 0:
        assert_match(model, reference)
        assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


_FIRST_STEP_ENTRIES = pytest.mark.parametrize(
    ("cls", "key", "value", "missing", "like"),
    [
        (torch.optim.AdamW, "amsgrad", True, "max_exp_avg_sq", "exp_avg_sq"),
        (torch.optim.RMSprop, "centered", True, "grad_avg", "square_avg"),
        (torch.optim.RMSprop, "momentum", 0.9, "momentum_buffer", "square_avg"),
    ],
    ids=["amsgrad", "centered", "momentum"],
)


@_FIRST_STEP_ENTRIES
@pytest.mark.parametrize("recovery", ["entry", "skip"])
@pytest.mark.parametrize("index", [0, 1], ids=["body-group", "head-group"])
def test_option_needing_a_first_step_entry_refused_at_step_before_anything_moves(
    cls, key, value, missing, like, index, recovery
):
    # Dynamo's first compilation in the process wraps every torch.optim class's _init_group
    # (the check's key: it was not recognised after it until found by the full suite).
    torch.compile(torch.neg, backend="eager")(torch.ones(1))
    _first_step_entry_body(cls, key, value, missing, like, index, sharded=False, recovery=recovery)


@_FIRST_STEP_ENTRIES
@pytest.mark.parametrize("world_size", [2, 3])
def test_option_needing_a_first_step_entry_refused_at_step_on_fsdp2(
    worlds, world_size, cls, key, value, missing, like
):
    for index in (0, 1):
        worlds.run(
            world_size,
            _first_step_entry_body,
            **dict(cls=cls, key=key, value=value, missing=missing, like=like, index=index),
        )


@pytest.mark.parametrize("stepping", [None, "elementwise"], ids=["joint", "checked-first"])
def test_failed_held_backward_then_a_new_lr_steps_as_plain(stepping):
    """A class's first backward raises having only held its buckets (to step it jointly, or
    to check it first), then the loop sets a new lr and calls ``step()``: the plain step
    steps the partial gradients with the new lr; here the held buckets were stepped with the
    group values of the backward's start (1.2e-2 apart after that step, either way, no
    error). Nothing had moved: they are now stepped afresh at ``step()``, equal."""

    def new_lr(opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0]["lr"] = 0.3
        opt.step()
        opt.zero_grad()

    _after_a_failed_held_backward(_PlainSGD, 0.1, new_lr, stepping=stepping)


@pytest.mark.parametrize("bucket_numel", [20, None], ids=["held", "one-bucket"])
@pytest.mark.parametrize("stepping", [None, "dtensor"], ids=["joint", "checked-first"])
def test_failed_held_backward_skipped_then_a_step_counts_it(stepping, bucket_numel):
    """A class counting steps in its groups (timm's LAMB): its first backward raises having
    only held its buckets, or, one bucket, before it completed (nothing stepped or held), the
    loop skips the batch with ``zero_grad()`` and calls ``step()`` with no gradient, as the
    plain loop does. The plain step counts the step in every group; here ``step()`` took the
    dropped backward for this step's and counted nothing (the groups' ``step`` 2 against 3
    two steps later, no error; with one bucket until this was found by the stateful property
    test, with clipping). Equal now."""

    def skip_the_batch(opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        opt.step()

    optim, plain = _after_a_failed_held_backward(
        GroupStepLamb, 0.01, skip_the_batch, stepping=stepping, bucket_numel=bucket_numel
    )
    assert optim.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


# ------------------------------------------------------- deepcopy, options, declarations


class _Lamb(torch.optim.SGD):
    """An optimizer taking its own ``max_grad_norm``, as timm's Lamb does."""

    def __init__(self, params, lr: float = 0.1, max_grad_norm: float = 1.0) -> None:
        super().__init__(params, lr=lr)
        self.own_max_grad_norm = max_grad_norm


def test_options_apart_from_the_wrapped_class():
    model, _ = make_models()
    with pytest.raises(TypeError, match="max_grad_norm: both an option of OptimizerInBackward"):
        OptimizerInBackward(model.parameters(), _Lamb, max_grad_norm=2.0)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    optim = OptimizerInBackward(
        model.parameters(), _Lamb, max_grad_norm=2.0, options=InBackwardOptions(max_grad_norm=0.5)
    )
    assert (
        optim.max_grad_norm == 0.5
        and optim._stepper.steppers[None].optimizer.own_max_grad_norm == 2.0
    )
    with pytest.raises(ValueError, match="max_grad_norm must be a positive"):
        InBackwardOptions(max_grad_norm=-1.0)


def test_declared_subclass_steps_local_shards():
    @declare_stepping("elementwise")
    class MyAdamW(torch.optim.AdamW):
        pass

    class Undeclared(torch.optim.AdamW):
        pass

    model, _ = make_models()
    assert (
        OptimizerInBackward(model.parameters(), MyAdamW, lr=0.1)
        ._stepper.steppers[None]
        .local_shards
    )
    other, _ = make_models()
    assert (
        not OptimizerInBackward(other.parameters(), Undeclared, lr=0.1)
        ._stepper.steppers[None]
        .local_shards
    )
    with pytest.raises(ValueError, match="stepping must be one of"):
        declare_stepping("sideways")


def test_deepcopy_gives_a_working_optimizer():
    model, reference = make_models()
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_numel=20, **ADAMW)
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    _ours_step(model, optim, 0, sharded=False)
    _plain_step(reference, plain, 0, sharded=False)
    model_copy, optim_copy = copy.deepcopy((model, optim))
    for step in range(1, 4):
        _ours_step(model, optim, step, sharded=False)
        _ours_step(model_copy, optim_copy, step, sharded=False)
        _plain_step(reference, plain, step, sharded=False)
    assert_match(model, reference)
    assert_match(model_copy, reference)
    assert_same_state_dict(optim_copy.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


@pytest.mark.parametrize("removed", ["parameter", "group"])
def test_parameters_removed_from_groups_by_hand_train_as_plain(removed):
    """A parameter deleted from its group's list, or a whole group deleted, between steps: the
    plain optimizer stops stepping it and its gradient accumulates in ``.grad``; so here. It
    was refused in the next backward, after the buckets before it had moved (8.2e-3)."""
    model, reference = make_models()
    loops = []
    for net in (model, reference):
        head = list(net.head.parameters())
        groups = [{"params": [p for p in net.parameters() if all(p is not h for h in head)]}]
        loops.append((net, [*groups, {"params": head, "lr": 0.05}]))
    optim = OptimizerInBackward(loops[0][1], torch.optim.SGD, lr=0.1, bucket_numel=20)
    plain = torch.optim.SGD(loops[1][1], lr=0.1)
    for step in range(4):
        if step == 2:
            for opt, net in ((optim, model), (plain, reference)):
                if removed == "group":
                    del opt.param_groups[1]
                else:
                    params = opt.param_groups[0]["params"]
                    del params[next(i for i, p in enumerate(params) if p is net.inp.weight)]
        _ours_step(model, optim, step, sharded=False)
        _plain_step(reference, plain, step, sharded=False)
    assert_match(model, reference)
    kept = reference.head.weight if removed == "group" else reference.inp.weight
    ours = model.head.weight if removed == "group" else model.inp.weight
    torch.testing.assert_close(ours.grad, kept.grad)  # accumulated over the last two steps


def test_clipping_history_never_reaches_another_bucket():
    model, _ = make_models()
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=1.0, bucket_numel=20
    )
    _ours_step(model, optim, 0, sharded=False)
    history = optim.gradient_state_dict()
    assert len(history["previous_sq"]) > 1
    other, _ = make_models()  # the same model in one bucket: no key matches
    one_bucket = OptimizerInBackward(other.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=1.0)
    one_bucket.load_gradient_state_dict(history)
    assert one_bucket.gradient_state_dict()["previous_sq"] == {}
    same, _ = make_models()
    again = OptimizerInBackward(
        same.parameters(), torch.optim.SGD, lr=0.1, max_grad_norm=1.0, bucket_numel=20
    )
    again.load_gradient_state_dict(history)
    assert again.gradient_state_dict() == history


# ------------------------------------------------------- state written by hand or by the class


def _state_values_body(cls: type[torch.optim.Optimizer], reset: str) -> None:
    """A layer's state entries emptied between steps (``optim.state[p] = {}``, or
    ``optim.state[p].clear()``), and a class replacing its state values out of place, keeping
    tensors in a list and adding a value at a later step: the plain optimizer holds each value
    as the step left it, DTensors placed like their parameter (in the list too); so does ours,
    hence its ``state_dict()``, DCP checkpoints and the plain optimizer loading them. Before,
    an emptied entry was filled with the step's local shards as plain tensors, a value the
    class replaced or added in an entry it already had never reached ``state``, a list held
    local shards, and an entry the class looked up and left empty (its vectors') was missing,
    with no error."""
    model, reference = _pair()
    optim = OptimizerInBackward(model.parameters(), cls, lr=1e-2)
    plain = cls(reference.parameters(), lr=1e-2)
    for net, opt, step_of in ((model, optim, _ours_step), (reference, plain, _plain_step)):
        for step in range(4):
            step_of(net, opt, step)
            if step == 1 and reset:
                for param in net.layers[2].parameters():
                    if reset == "empty":
                        opt.state[param] = {}
                    else:
                        opt.state[param].clear()
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain.state_dict(), atol=PLAIN_ATOL)


def _declared_class_resumed_body() -> None:
    """A class of one's own declared ``"elementwise"`` resumed on FSDP2: a new optimizer
    loading the state dict of one that stepped, as after a restart. Its first backward checks
    the class on copies of its shards and state (see [Note: group and instance state] in
    ``_class_state.py``); the copies of the loaded state were DTensors handed to a step on
    local shards, so that backward raised (mixed ``torch.Tensor`` and ``DTensor``) and no run
    of such a class could resume. Equal to the plain optimizer resumed alike."""
    model, reference = _pair()
    optim = OptimizerInBackward(model.parameters(), OutOfPlaceMomentum, lr=1e-2)
    plain = OutOfPlaceMomentum(reference.parameters(), lr=1e-2)
    for step in range(2):
        _ours_step(model, optim, step)
        _plain_step(reference, plain, step)
    optim.detach()  # the run that stopped
    optim = OptimizerInBackward(model.parameters(), OutOfPlaceMomentum, lr=1e-2)
    optim.load_state_dict(copy.deepcopy(plain.state_dict()))
    plain_again = OutOfPlaceMomentum(reference.parameters(), lr=1e-2)
    plain_again.load_state_dict(plain.state_dict())
    for step in range(2, 4):
        _ours_step(model, optim, step)
        _plain_step(reference, plain_again, step)
    assert_match(model, reference)
    assert_same_state_dict(optim.state_dict(), plain_again.state_dict(), atol=PLAIN_ATOL)


# ------------------------------------------------------- the world tests


@pytest.mark.parametrize(
    ("world_size", "body", "kwargs"),
    [
        (2, _add_group_generator_body, {}),
        (2, _no_gradient_body, {}),
        (2, _skip_with_clipping_body, {"fused": False}),
        (2, _skip_with_clipping_body, {"fused": True}),
        (2, _dcp_state_creation_body, {"sharded": True}),
        (1, _dcp_state_creation_body, {"sharded": False}),
        (1, _head_after_root_body, {}),
        (2, _head_after_root_parity_body, {}),
        (2, _dcp_async_staging_body, {}),
        (4, _sub_mesh_body, {}),
        (2, _no_collective_for_plain_tensors_body, {}),
        (1, _failing_backward_body, {"sharded": False}),
        (2, _failing_backward_body, {"sharded": True}),
        (2, _failed_held_backward_body, {"sharded": True, "stepping": "elementwise"}),
        (1, _failed_held_backward_body, {"sharded": False, "stepping": "dtensor"}),
        (1, _failed_held_backward_body, {"sharded": False, "stepping": None}),
        (2, _groups_after_an_evaluation_body, {"kept_after_forward": False}),
        (3, _groups_after_an_evaluation_body, {"kept_after_forward": True}),
        (2, _step_after_an_evaluation_body, {}),
        (2, _frozen_between_sync_off_micro_batches_body, {"layer": 0}),
        (2, _frozen_between_sync_off_micro_batches_body, {"layer": 2}),
        (2, _state_values_body, {"cls": torch.optim.AdamW, "reset": "empty"}),
        (3, _state_values_body, {"cls": torch.optim.AdamW, "reset": "clear"}),
        (2, _state_values_body, {"cls": OutOfPlaceMomentum, "reset": None}),
        (3, _state_values_body, {"cls": OutOfPlaceMomentum, "reset": "empty"}),
        (2, _declared_class_resumed_body, {}),
    ],
    ids=[
        "1-add-group-generator",
        "4-no-gradient",
        "5-skip-with-clipping-host",
        "5-skip-with-clipping-device",
        "6-dcp-state-creation-sharded",
        "6-dcp-state-creation-plain",
        "7-head-after-root-norm",
        "7-head-after-root-parity",
        "6-dcp-async-staging",
        "10-sub-mesh-norms",
        "10-no-collective-plain",
        "3-failing-backward",
        "3-failing-backward-sharded",
        "3-failed-held-backward-elementwise",
        "3-failed-held-backward-dtensor",
        "3-failed-held-backward-joint",
        "groups-after-an-evaluation-2",
        "groups-after-an-evaluation-3-kept-after-forward",
        "step-after-an-evaluation",
        "frozen-between-sync-off-micro-batches-first",
        "frozen-between-sync-off-micro-batches-last",
        "state-emptied-by-hand",
        "state-cleared-by-hand-3",
        "state-replaced-by-the-class",
        "state-replaced-by-the-class-emptied-3",
        "declared-class-resumed",
    ],
)
def test_drop_in(worlds, world_size, body, kwargs):
    worlds.run(world_size, body, **kwargs)


def test_float64_parameters_norm_and_clip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_numel=1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        reference(x).square().mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)
        assert optim.grad_norm().dtype == torch.float64
        torch.testing.assert_close(optim.grad_norm(), expected, rtol=1e-12, atol=0)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)
