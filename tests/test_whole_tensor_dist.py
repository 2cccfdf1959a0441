"""Whole-tensor stepping (Muon, Adafactor, a LAMB) on FSDP2 against single-process runs (gloo).

Muon orthogonalizes in bfloat16, so a last-bit difference in a gradient (a reduce-scatter sums
in another order than one process does) can flip a rounding and move an entry by 1e-3. The Muon
references are therefore fed the very gradients the sharded run consumed, captured by a hook
that runs before the optimizer's: same kernels on the same values. Adafactor and LAMB run in
float32 and are compared with single-process runs on the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _toy import (
    assert_same_state_dict,
    full,
    holds_gradient,
    loss_fn,
    make_models,
    rank_slice,
    shard,
)
from test_never_silent import GlobalClipSGD, PositionalSGD
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.lr_scheduler import LambdaLR

from fused_optim_dist import InBackwardOptions, OptimizerInBackward, Stepping, declare_stepping
from fused_optim_dist._kinds import stepping_of

STEPS = 3
BATCH = 12
"""Global batch: divisible by 1, 2, 3 and 4 ranks, so the ranks' mean loss is the global one."""
ATOL_MUON = 1e-6
ATOL_FP32 = 1e-5


@declare_stepping("whole_tensor")
class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): Adam's update scaled by the trust ratio ||p|| / ||update||."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m = state["exp_avg"] / (1 - beta1**step)
                v = state["exp_avg_sq"] / (1 - beta2**step)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                p_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, 1.0)
                p.sub_(update * trust, alpha=group["lr"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from _toy import batch

    return batch(step, size=BATCH)


def _capture(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Record every full gradient a hook sees; registered before the optimizers' hooks."""
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():

        def hook(p: torch.Tensor, name: str = name) -> None:
            grads[name].append(full(p.grad).detach().clone())

        param.register_post_accumulate_grad_hook(hook)
    return grads


def _muon_adamw(model: nn.Module, muon_kwargs: dict, **options):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return (
        OptimizerInBackward(matrices, torch.optim.Muon, **muon_kwargs, **options),
        OptimizerInBackward(rest, torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    )


def _reference_optims(reference: nn.Module, muon_kwargs: dict):
    """Plain Muon on the full matrices, plain AdamW on the rest."""
    matrices = [p for p in reference.parameters() if p.ndim == 2]
    rest = [p for p in reference.parameters() if p.ndim != 2]
    return (
        torch.optim.Muon(matrices, **muon_kwargs),
        torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1),
    )


def _replay(reference: nn.Module, grads, steps: range, optims) -> None:
    """Step ``optims`` on the full reference, fed the captured gradients of ``steps``."""
    for step in steps:
        for name, param in reference.named_parameters():
            param.grad = grads[name][step]
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _assert_params(model: nn.Module, reference: nn.Module, atol: float) -> None:
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            full(param).detach(), ref.detach(), atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


MUON_CONFIGS = [
    dict(lr=2e-2, weight_decay=0.1, nesterov=True, adjust_lr_fn="original"),
    dict(lr=2e-2, weight_decay=0.05, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
]


def _muon_parity_body() -> None:
    for muon_kwargs in MUON_CONFIGS:
        model, reference = make_models()
        shard(model)
        grads = _capture(model)
        muon, adamw = _muon_adamw(model, muon_kwargs)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (muon, adamw)]
        for step in range(STEPS):
            x, y = _batch(step)
            loss_fn(model, rank_slice(x), rank_slice(y)).backward()
            for optim in (muon, adamw):
                optim.step()
                optim.zero_grad()
            for sched in scheds:
                sched.step()
        assert all(not holds_gradient(p) for p in model.parameters())
        optims = _reference_optims(reference, muon_kwargs)
        ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in optims]
        for step in range(STEPS):
            _replay(reference, grads, range(step, step + 1), optims)
            for sched in ref_scheds:
                sched.step()
        _assert_params(model, reference, ATOL_MUON)
        ref_muon = optims[0]
        for param, ref in zip(
            muon.param_groups[0]["params"], ref_muon.param_groups[0]["params"], strict=True
        ):
            buf = muon.state[param]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == param.placements
            torch.testing.assert_close(
                buf.full_tensor(), ref_muon.state[ref]["momentum_buffer"], atol=ATOL_MUON, rtol=0
            )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_muon_adamw_equal_muon_on_full_matrices(worlds, world_size):
    worlds.run(world_size, _muon_parity_body)


def _train(model, optims, steps: range, micro_batches: int = 1) -> None:
    for step in steps:
        x, y = _batch(step)
        xs, ys = rank_slice(x).chunk(micro_batches), rank_slice(y).chunk(micro_batches)
        for i, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            loss = loss_fn(model, xm, ym) / micro_batches
            if i < micro_batches - 1:
                with optims[0].accumulate(), optims[-1].accumulate():
                    loss.backward()
            else:
                loss.backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _reference_run(reference, optim, steps: range, clip: float | None = None) -> list[float]:
    norms = []
    for step in steps:
        x, y = _batch(step)
        loss_fn(reference, x, y).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        optim.step()
        optim.zero_grad()
    return norms


def _fp32_body() -> None:
    # Adafactor on every parameter, against one process on the global batch.
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    _train(model, [optim], range(STEPS))
    _reference_run(reference, torch.optim.Adafactor(reference.parameters(), lr=1e-2), range(STEPS))
    _assert_params(model, reference, ATOL_FP32)
    state = optim.state[model.layers[0].up.weight]
    assert state["row_var"].placements == (Shard(0),)
    assert state["col_var"].placements == (Replicate(),)
    assert not isinstance(state["step"], DTensor) and state["step"].item() == STEPS

    # LAMB (declared whole_tensor): exact, with the norm clipped and measured in backward
    # (one FSDP unit, so the in-backward coefficient is the global one).
    torch.manual_seed(0)
    model, reference = make_models()
    fully_shard(model)
    options = InBackwardOptions(stepping="whole_tensor", max_grad_norm=0.5)
    optim = OptimizerInBackward(model.parameters(), Lamb, options=options)
    norms = []
    for step in range(STEPS):
        _train(model, [optim], range(step, step + 1))
        norms.append(float(optim.grad_norm()))
    ref_norms = _reference_run(reference, Lamb(reference.parameters()), range(STEPS), 0.5)
    _assert_params(model, reference, ATOL_FP32)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert min(ref_norms) > 0.5, "clipping must be active for this check"

    # The same LAMB on a unit per layer, after a warmup from lr 0: the check before its first
    # update (its steps of a parameter alone and beside others, on copies) passes it.
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), Lamb)
    ref_optim = Lamb(reference.parameters())
    warmups = [LambdaLR(o, lambda s: min(1.0, s / 2)) for o in (optim, ref_optim)]
    for step in range(STEPS):
        _train(model, [optim], range(step, step + 1))
        _reference_run(reference, ref_optim, range(step, step + 1))
        for warmup in warmups:
            warmup.step()
    _assert_params(model, reference, ATOL_FP32)

    # Declared elementwise, each rank would scale its shard by the shard's trust ratio (1e-3
    # and more from the plain LAMB after three steps, no error, before): refused at the first
    # backward, before anything moves, on one rank too; also where that backward's lr is 0 (a
    # warmup from lr 0, which moves nothing to compare).
    for lr in (1e-2, 0.0):
        model, _ = make_models()
        fully_shard(model)
        optim = OptimizerInBackward(model.parameters(), Lamb, stepping="elementwise", lr=lr)
        before = [full(p).detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="declared 'elementwise', but its step of the two"):
            _train(model, [optim], range(1))
        for param, value in zip(model.parameters(), before, strict=True):
            assert torch.equal(full(param).detach(), value)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_adafactor_and_lamb_equal_one_process(worlds, world_size):
    worlds.run(world_size, _fp32_body)


def _accumulate_body() -> None:
    muon_kwargs = MUON_CONFIGS[0]
    model, reference = make_models()
    shard(model)
    grads = _capture(model)
    optims = _muon_adamw(model, muon_kwargs)
    _train(model, optims, range(STEPS), micro_batches=2)
    # The hook saw each micro-batch's running sum; the step consumed the last.
    last = {name: g[1::2] for name, g in grads.items()}
    _replay(reference, last, range(STEPS), _reference_optims(reference, muon_kwargs))
    _assert_params(model, reference, ATOL_MUON)


def test_muon_gradient_accumulation(worlds):
    worlds.run(3, _accumulate_body)


def _held_and_create_graph_body() -> None:
    """Whole-tensor updates made outside a backward's no-grad mode: at ``step()``, where every
    micro-batch ran under ``accumulate()`` (the loop that clips exactly over several units) or
    the gradients were set by hand, and in a ``backward(create_graph=True)`` (a gradient
    penalty's, MAML's). Each raised, after the units before the last had moved: the last
    unit's rows were written through ``to_local()`` with grad mode on, which autograd refuses
    on a parameter that requires grad. Adafactor on every parameter, clipped when held,
    against one process on the global batch; Muon with AdamW, fed the gradients the sharded
    run consumed."""
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(
        model.parameters(), torch.optim.Adafactor, lr=1e-2, max_grad_norm=0.5
    )
    plain = torch.optim.Adafactor(reference.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        for xm, ym in zip(rank_slice(x).chunk(2), rank_slice(y).chunk(2), strict=True):
            with optim.accumulate():
                (loss_fn(model, xm, ym) / 2).backward()
        optim.step()
        optim.zero_grad()
        norms.append(float(optim.grad_norm()))
    ref_norms = _reference_run(reference, plain, range(STEPS), clip=0.5)
    _assert_params(model, reference, ATOL_FP32)
    assert norms == pytest.approx(ref_norms, rel=1e-5) and min(ref_norms) > 0.5

    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    for step in range(STEPS):
        x, y = _batch(step)
        loss_fn(model, rank_slice(x), rank_slice(y)).backward(create_graph=True)
        assert not any(holds_gradient(p) for p in model.parameters())
        optim.step()
        optim.zero_grad()
    _reference_run(reference, torch.optim.Adafactor(reference.parameters(), lr=1e-2), range(STEPS))
    _assert_params(model, reference, ATOL_FP32)

    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    plain = torch.optim.Adafactor(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            ref.grad = torch.cos(3 * ref.detach() + step)
            param.grad = distribute_tensor(ref.grad, param.device_mesh, param.placements)
        for opt in (optim, plain):
            opt.step()
            opt.zero_grad()
    _assert_params(model, reference, ATOL_FP32)

    muon_kwargs = MUON_CONFIGS[0]
    model, reference = make_models()
    shard(model)
    grads = _capture(model)
    optims = _muon_adamw(model, muon_kwargs)
    for step in range(STEPS):
        x, y = _batch(step)
        with optims[0].accumulate(), optims[1].accumulate():
            loss_fn(model, rank_slice(x), rank_slice(y)).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    _replay(reference, grads, range(STEPS), _reference_optims(reference, muon_kwargs))
    _assert_params(model, reference, ATOL_MUON)


def test_updates_at_step_and_under_create_graph(worlds):
    worlds.run(2, _held_and_create_graph_body)


def _save_body(path: str, muon_kwargs: dict) -> dict:
    model, _ = make_models()
    shard(model)
    grads = _capture(model)
    muon, adamw = _muon_adamw(model, muon_kwargs)
    _train(model, [muon, adamw], range(2))
    model_state, optim_state = get_state_dict(model, (muon, adamw))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return grads


def _resume_body(path: str, muon_kwargs: dict) -> tuple[dict, dict]:
    model, _ = make_models(seed=1)
    shard(model)
    grads = _capture(model)
    muon, adamw = _muon_adamw(model, muon_kwargs)
    model_state, optim_state = get_state_dict(model, (muon, adamw))
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, (muon, adamw), model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _train(model, [muon, adamw], range(2, 4))
    return grads, {name: full(p).detach() for name, p in model.named_parameters()}


def _adafactor_save_body(path: str) -> None:
    model, _ = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    _train(model, [optim], range(2))
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _adafactor_resume_body(path: str) -> None:
    model, reference = make_models()
    shard(model)
    optim = OptimizerInBackward(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, [optim], range(2, 4))
    _reference_run(reference, torch.optim.Adafactor(reference.parameters(), lr=1e-2), range(4))
    _assert_params(model, reference, ATOL_FP32)


def test_checkpoint_4_ranks_resumes_on_2(worlds, tmp_path):
    muon_kwargs = MUON_CONFIGS[1]
    first = worlds.run(4, _save_body, path=str(tmp_path / "muon"), muon_kwargs=muon_kwargs)[0]
    second, params = worlds.run(
        2, _resume_body, path=str(tmp_path / "muon"), muon_kwargs=muon_kwargs
    )[0]
    # Uninterrupted: one Muon + AdamW on the full model through all four steps.
    _, reference = make_models()
    grads = {name: first[name] + second[name] for name in first}
    _replay(reference, grads, range(4), _reference_optims(reference, muon_kwargs))
    for name, ref in reference.named_parameters():
        torch.testing.assert_close(params[name], ref.detach(), atol=ATOL_MUON, rtol=0, msg=name)

    worlds.run(4, _adafactor_save_body, path=str(tmp_path / "adafactor"))
    worlds.run(2, _adafactor_resume_body, path=str(tmp_path / "adafactor"))


def _interchange_body(path: str) -> None:
    """Checkpoints of in-backward Muon load into plain Muon on FSDP2, and back."""
    kwargs = dict(lr=2e-2)

    def build(in_backward: bool):
        model, _ = make_models()
        shard(model)
        matrices = [p for p in model.parameters() if p.ndim == 2]
        if in_backward:
            return model, OptimizerInBackward(matrices, torch.optim.Muon, **kwargs)
        return model, torch.optim.Muon(matrices, **kwargs)

    for source_in_backward in (True, False):
        model, source = build(source_in_backward)
        _train(model, [source], range(2))
        model_state, optim_state = get_state_dict(model, source)
        checkpoint = f"{path}/{source_in_backward}"
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
        target_model, target = build(not source_in_backward)
        model_state, optim_state = get_state_dict(target_model, target)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(
            target_model, target, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        assert_same_state_dict(target.state_dict(), source.state_dict())


def test_checkpoints_interchange_with_plain_muon(worlds, tmp_path):
    worlds.run(2, _interchange_body, path=str(tmp_path))


def _shared_momentum_body() -> None:
    """A Muon momentum put by hand into a second entry (on every rank) of FSDP2 units: the
    unit holding the written entry refuses before it moves (the plain Muon would update the
    tensor twice per step, in parameter order)."""
    model, _ = make_models()
    shard(model)
    muon, adamw = _muon_adamw(model, MUON_CONFIGS[0])
    for step in range(2):
        x, y = _batch(step)
        loss_fn(model, rank_slice(x), rank_slice(y)).backward()
        for optim in (muon, adamw):
            optim.step()
            optim.zero_grad()
    # layers.0.up.weight is written, from layers.2.up.weight (the unit stepped before it).
    names = {p: n for n, p in model.named_parameters()}
    first, last = (
        next(p for p in muon.param_groups[0]["params"] if names[p] == f"layers.{i}.up.weight")
        for i in (0, 2)
    )
    muon.state[first]["momentum_buffer"] = muon.state[last]["momentum_buffer"]
    before = full(first).detach().clone()
    x, y = _batch(2)
    with pytest.raises(ValueError, match="holds one tensor"):
        loss_fn(model, rank_slice(x), rank_slice(y)).backward()
    assert torch.equal(full(first).detach(), before), "the written unit moved"


def test_shared_momentum_refused_before_the_written_unit_moves(worlds):
    worlds.run(2, _shared_momentum_body)


class _OutsideState(Lamb):
    """The LAMB above keeping state where a class stepped by owners cannot: ``where`` says
    what its step does, from its ``since``-th step on (counted per parameter)."""

    where = "group"
    since = 1

    @torch.no_grad()
    def step(self, closure=None):
        late = any(
            self.state[p].get("step", 0) + 1 >= self.since
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        )
        if late and self.where == "group":
            for group in self.param_groups:
                group["k"] = group.get("k", 0) + 1  # timm's LAMB counts its steps so
        if late and self.where == "instance":
            self.t = getattr(self, "t", 0) + 1
        if late and self.where == "draw":
            torch.rand(())
        if late and self.where == "key":
            for p in self.state:
                self.state[p]["extra"] = torch.zeros(())
        # Shapes of layers.2 (stepped first), one owner's parameters on 3 ranks.
        shapes = {p.numel() for g in self.param_groups for p in g["params"]}
        if late and self.where == "raise" and shapes & {3, 18}:
            raise RuntimeError("this class rejects a parameter of this shape")
        return super().step(closure)


OUTSIDE_STATE = [
    ("group", 1, "wrote values into its param groups"),
    ("instance", 1, "set attributes on the optimizer instance"),
    ("draw", 1, "drew random numbers"),
    ("group", 2, "wrote values into its param groups"),
    ("key", 2, "changed the keys, shapes or dtypes of its state"),
    ("raise", 1, "rejects a parameter|step raised on another rank"),
    ("raise", 2, "rejects a parameter|step raised on another rank"),
]


def _full_state(optim: OptimizerInBackward) -> list[dict[str, torch.Tensor]]:
    return [
        {key: full(value).clone() for key, value in optim.state[p].items()}
        for group in optim.param_groups
        for p in group["params"]
    ]


def _outside_state_body(freeze: tuple[str, ...]) -> None:
    """Each case's first step that keeps state outside ``state[p]`` is refused on every rank,
    before any parameter moves, the instance and the generators as before it; a unit one rank
    owns alone (``freeze`` leaves layers.2, the first unit stepped, one parameter) included.
    A step that raises on its owner raises there and on every other rank (before, they went
    on alone to the next collective).
    Before, such a class trained differently with no error (a counter in its groups: 1.3e-4
    from the plain class after three steps; on the instance, 3.7e-3)."""
    for where, since, message in OUTSIDE_STATE:
        cls = type(f"_{where.title()}Lamb", (_OutsideState,), {"where": where, "since": since})
        declare_stepping("whole_tensor")(cls)
        model, _ = make_models(freeze=freeze)
        shard(model)
        optim = OptimizerInBackward([p for p in model.parameters() if p.requires_grad], cls)
        _train(model, [optim], range(since - 1))
        before = [full(p).detach().clone() for p in model.parameters()]
        state = _full_state(optim)
        rng = torch.get_rng_state()
        x, y = _batch(since)
        if where != "raise":
            message = f"declared 'whole_tensor', but its step {message}"
        with pytest.raises(RuntimeError, match=message):
            loss_fn(model, rank_slice(x), rank_slice(y)).backward()
        for param, value in zip(model.parameters(), before, strict=True):
            assert torch.equal(full(param).detach(), value), (where, since)
        assert_same_state_dict(_full_state(optim), state)
        assert not hasattr(optim, "t"), "the instance's counter stayed advanced"
        assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize(
    ("world_size", "freeze"),
    [(1, ()), (3, ()), (3, ("layers.2.norm", "layers.2.up", "layers.2.down.bias"))],
    ids=["1", "3", "3-one-owner"],
)
def test_state_outside_state_p_refused_before_anything_moves(worlds, world_size, freeze):
    worlds.run(world_size, _outside_state_body, freeze=freeze)


def test_state_outside_state_p_refused_on_a_plain_module():
    """Parameters whole on every rank (a plain module): the first step runs on copies, so a
    class writing into its groups from its first step is refused with nothing moved; one that
    starts writing at its second step is refused at the first bucket that writes, that bucket
    moved (one parameter, ``bucket_numel=1``), the others not."""
    declared = declare_stepping("whole_tensor")(type("_GroupLamb", (_OutsideState,), {}))
    model, _ = make_models()
    before = copy.deepcopy(model.state_dict())
    optim = OptimizerInBackward(model.parameters(), declared, bucket_numel=1)
    x, y = _batch(0)
    with pytest.raises(RuntimeError, match="wrote values into its param groups"):
        loss_fn(model, x, y).backward()
    assert_same_state_dict(model.state_dict(), before)
    assert not optim.state

    late = declare_stepping("whole_tensor")(type("_LateLamb", (_OutsideState,), {"since": 2}))
    model, _ = make_models()
    optim = OptimizerInBackward(model.parameters(), late, bucket_numel=1)
    _reference_run(model, optim, range(1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(1)
    with pytest.raises(RuntimeError, match=r"into its param groups.*This bucket's parameters have"):
        loss_fn(model, x, y).backward()
    moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
    assert sum(moved) == 1, moved


READS_OTHERS = [
    (GlobalClipSGD, {"lr": 0.1}),
    (GlobalClipSGD, {"lr": 0.0}),
    (GlobalClipSGD, {"lr": 0.1, "max_grad_norm": 5.0}),
    (PositionalSGD, {"lr": 0.05}),
]
"""Classes whose update of a parameter reads the others (a norm of all gradients clipping
inside ``step()``; a multiplier by position in the group), at an lr, at lr 0 (a warmup from
lr 0), and with a threshold above the first gradients' norm (2.6)."""


def _reads_others(sharded: bool) -> None:
    """Each class of ``READS_OTHERS`` declared ``"whole_tensor"`` is refused on every rank at
    its first backward, before any parameter or state moves. Each owner steps its own
    parameters of a unit, each in a group of its own, where the plain ``step()`` hands the
    class all of them: measured on the code before, four steps, no error: the clipping class
    2.1e-2 from the plain one on a plain module, 1.9e-2 and 2.3e-2 on 2 and 3 ranks (1.1e-2
    and 1.4e-2 after a warmup from lr 0 over two steps); the positional class 2.6e-1 on 2
    ranks. With the threshold above the first gradients' norm, crossed by a loss spike (the
    loss scaled by 10 from the third step), the check saw nothing at the first step: 0.16
    and 0.17 on 2 and 3 ranks, 0.15 on one, 0.17 on a plain module, no error; it now also
    steps the parameter alone and beside a copy of itself on gradients scaled up (largest
    element 1e4)."""
    for cls, kwargs in READS_OTHERS:
        model, _ = make_models()
        if sharded:
            shard(model)
        optim = OptimizerInBackward(
            model.parameters(), cls, options=InBackwardOptions(stepping="whole_tensor"), **kwargs
        )
        before = [full(p).detach().clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        x, y = _batch(0)
        if sharded:
            x, y = rank_slice(x), rank_slice(y)
        with pytest.raises(RuntimeError, match=r"otherwise beside others|another rank"):
            loss_fn(model, x, y).backward()
        for param, value in zip(model.parameters(), before, strict=True):
            assert torch.equal(full(param).detach(), value), (cls.__name__, kwargs)
        assert not optim.state, (cls.__name__, kwargs)
        assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_class_reading_other_parameters_refused_before_anything_moves(worlds, world_size):
    worlds.run(world_size, _reads_others, sharded=True)


def test_class_reading_other_parameters_refused_on_a_plain_module():
    _reads_others(sharded=False)


def _refusal_body() -> None:
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match="sharded on dim 0"):
        OptimizerInBackward([weight], torch.optim.Adafactor)
    assert not weight._post_accumulate_grad_hooks


def test_refusals(worlds):
    linear = nn.Linear(3, 4)
    with pytest.raises(ValueError, match="2D parameters"):
        OptimizerInBackward(linear.parameters(), torch.optim.Muon)
    # Muon asked to step each shard apart: its orthogonalization needs the whole matrix.
    with pytest.raises(ValueError, match="needs each whole parameter"):
        OptimizerInBackward([linear.weight], torch.optim.Muon, stepping="elementwise")
    assert linear.weight._post_accumulate_grad_hooks is None
    worlds.run(2, _refusal_body)


def test_which_path_each_class_takes():
    assert stepping_of(torch.optim.Muon, None) is Stepping.WHOLE_TENSOR
    assert stepping_of(torch.optim.Adafactor, None) is Stepping.WHOLE_TENSOR
    assert stepping_of(Lamb, None) is Stepping.WHOLE_TENSOR
    assert stepping_of(torch.optim.AdamW, None) is Stepping.ELEMENTWISE
    assert stepping_of(torch.optim.AdamW, "whole_tensor") is Stepping.WHOLE_TENSOR
