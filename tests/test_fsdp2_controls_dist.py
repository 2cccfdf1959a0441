"""Loops that drive FSDP2's own controls, with ours swapped in for the plain optimizer.

``set_requires_gradient_sync`` (and HSDP's ``set_requires_all_reduce``) on part of the model,
``unshard()``/``reshard()`` around ``step()``, ``requires_grad_()`` while a root unit is
unsharded (a forward with no backward leaves it so: a GAN's frozen generator, an evaluation
before unfreezing a head, or before freezing one between micro-batches), units built otherwise
(``ignored_params``, one unit of several modules, a full SPMD mesh), the controls of the
gradient reduction (an all-reduce hook, sum reductions, more input buffers, a separate
reduce-scatter group) and the recovery from a failed backward (``reset_iter_state()``). Each
loop runs with plain AdamW and with ours on identical FSDP2 models (2 and 3 gloo ranks, 2 and 4
on the SPMD mesh): equal, or refused at ``step()`` (``zero_grad()`` after a failed backward; the
head frozen between micro-batches: at its backward). See [Note: FSDP2's copies and flags] in
``fused_optim_dist/_torch_internals.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _toy import assert_match, full
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fused_optim_dist import OptimizerInBackward

LR = 1e-2


def _layers(seed: int = 0) -> nn.Sequential:
    """The unwrapped model: a child between two layers; 3 output rows, so 3 ranks shard them
    unevenly."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3)
    )


def _model(seed: int = 0) -> nn.Sequential:
    """The child a unit between two root layers."""
    model = _layers(seed)
    fully_shard(model[1])
    fully_shard(model)
    return model


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step``."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _both(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, list, list]:
    """Two identical models, ours and plain AdamW on them (built after any freezing)."""
    ours, plain = build(), build()
    return (
        ours,
        plain,
        [OptimizerInBackward(ours.parameters(), torch.optim.AdamW, lr=LR)],
        [torch.optim.AdamW(plain.parameters(), lr=LR)],
    )


def _child_only() -> nn.Sequential:
    """The child a unit, the layers around it plain tensors outside ``fully_shard`` (each rank
    steps its own gradient of them, alike in both loops)."""
    model = _layers()
    fully_shard(model[1])
    return model


def _frozen_child() -> nn.Sequential:
    """The model with its child unit frozen (a frozen backbone between trained layers)."""
    model = _model()
    model[1].requires_grad_(False)
    return model


def _partial_no_sync_body(unsynced: str) -> None:
    """Micro-batches with gradient sync off for the root unit alone (``recurse=False``), for
    the child alone, or for the only unit beside parameters outside ``fully_shard``: the
    other units (autograd, for those outside) add to their gradients every micro-batch, and
    the plain optimizer steps the sums. Here those were stepped in the first micro-batch and
    the second was refused (after they moved); now such a backward is a micro-batch, as
    under ``accumulate()``: equal. Also with sync off for a frozen child only, whose flag
    reduces nothing (found by the stateful property test: the root was stepped in the first
    micro-batch and the second refused, after it moved)."""
    build = {"unit beside plain": _child_only, "frozen child": _frozen_child}.get(unsynced, _model)
    ours, plain, (optim,), (reference_optim,) = _both(build)
    before = _off_but_last("set_requires_gradient_sync", unsynced)
    _micro_batches((ours, optim), (plain, reference_optim), before)


def _off_but_last(flag: str, unsynced: str) -> Callable[[nn.Module, int], None]:
    """What runs before micro-batch ``i`` of two: FSDP2's ``flag`` setter off but for the last,
    on the root unit alone (``recurse=False``) when ``unsynced`` says so, else on the child."""

    def before(model: nn.Module, i: int) -> None:
        if unsynced == "root":
            getattr(model, flag)(i == 1, recurse=False)
        else:
            getattr(model[1], flag)(i == 1)

    return before


def _micro_batches(
    ours: tuple[nn.Module, object],
    plain: tuple[nn.Module, object],
    before: Callable[[nn.Module, int], None],
) -> None:
    """Three steps of two micro-batches on both loops, ``before(model, i)`` ahead of
    micro-batch ``i``: equal, and every trainable parameter moved (frozen ones did not)."""
    start = [full(p).detach().clone() for p in ours[0].parameters()]
    for model, opt in (ours, plain):
        for step in range(3):
            x, y = _batch(step)
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                before(model, i)
                (_loss(model, xm, ym) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert_match(ours[0], plain[0])
    for param, first in zip(ours[0].parameters(), start, strict=True):
        assert torch.equal(full(param), first) != param.requires_grad


def _sync_off_after_a_stepping_backward_body(flag: str) -> None:
    """Sync on for the first micro-batch and off for the second (the condition reversed), with
    ``set_requires_gradient_sync`` or HSDP's ``set_requires_all_reduce``: the first was
    stepped in backward, so the second's forward ran on the updated weights (the plain loop's
    on those of before ``step()``; FSDP2 carries its unreduced gradients into the next step:
    5.6e-3 apart after four steps, 4.5e-3 with the all-reduce flag, no error). That forward is
    refused before it runs. With both forwards run first, the second backward gathers the
    updated weights again; no hook runs in a backward with every unit's sync off: refused at
    ``step()``."""
    x, y = _batch(0)
    (x0, x1), (y0, y1) = x.chunk(2), y.chunk(2)
    for forwards_first in (False, True):
        model = _hsdp_model() if flag == "set_requires_all_reduce" else _model()
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR)
        first = _loss(model, x0, y0) / 2
        second = _loss(model, x1, y1) / 2 if forwards_first else None
        getattr(model, flag)(True)
        first.backward()
        getattr(model, flag)(False)
        if forwards_first:
            second.backward()
            with pytest.raises(RuntimeError, match=r"gradient sync off .* ran after a backward"):
                optim.step()
        else:
            with pytest.raises(RuntimeError, match=r"updated in backward with no optimizer\.step"):
                _loss(model, x1, y1)
        # Left with sync off, this model would make every later backward of the process a
        # micro-batch (see [Note: FSDP2's micro-batches]).
        getattr(model, flag)(True)


def _no_sync_two_optimizers_body() -> None:
    """Two optimizers on one model, the head's and the body's, with gradient sync off for the
    child unit (the body's) during micro-batches: the head's root unit reduces every
    micro-batch and the plain head optimizer steps the sum. The head's optimizer saw only its
    own unit reducing, stepped the first micro-batch (1.0e-2 moved) and refused the second;
    a unit of any optimizer with sync off now makes the backward a micro-batch: equal."""
    runs = []
    for ours in (True, False):
        model = _model()

        groups = ([*model[0].parameters(), *model[1].parameters()], list(model[2].parameters()))
        optims = [
            OptimizerInBackward(params, torch.optim.AdamW, lr=LR)
            if ours
            else torch.optim.AdamW(params, lr=LR)
            for params in groups
        ]
        for step in range(3):
            x, y = _batch(step)
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                model[1].set_requires_gradient_sync(i == 1)
                (_loss(model, xm, ym) / 2).backward()
            for opt in optims:
                opt.step()
                opt.zero_grad()
        runs.append(model)
    assert_match(*runs)


def _gathered_before_step_body() -> None:
    """``model.unshard()`` between backward and ``step()`` (the next forward's all-gather
    started early): the plain loop gathers the weights before its update and its next forward
    runs on that copy; here the update was made in backward (3.4e-3 apart after four steps,
    no error). Refused at that next forward, before it reads the copy. An evaluation forward
    there reads the updated weights itself: refused before it runs (it was refused at the
    next forward, the root left gathered). Where the copy is dropped before the next forward
    (``reshard()`` before or after ``step()``, ``model.state_dict()`` after it), or gathered
    after ``step()``, the plain loop runs on the stepped weights: equal. A unit gathered in
    backward after it was reduced (``unshard()`` from a gradient hook) is the same case."""
    for between in ("unshard", "forward", "unshard in backward"):
        model = _model()
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR)
        if between == "unshard in backward":
            # From a hook on the child unit's input gradient: after FSDP2 reduced the unit and
            # it was updated, the copy holds the update (5.8e-3 apart, no error, before).
            def gather_child(
                _module: nn.Module, _args: Any, out: torch.Tensor, child: nn.Module = model[1]
            ) -> None:
                out.register_hook(lambda _grad: child.unshard())

            model[0].register_forward_hook(gather_child)
        _loss(model, *_batch(0)).backward()
        if between == "unshard":
            model.unshard()
        elif between == "forward":
            with torch.no_grad(), pytest.raises(RuntimeError, match=r"with no optimizer\.step"):
                model(_batch(1)[0])
            continue
        optim.step()
        optim.zero_grad()
        with pytest.raises(RuntimeError, match="would run on the weights FSDP2 all-gathered"):
            _loss(model, *_batch(1)).backward()
    ours, plain, (optim,), (reference_optim,) = _both(_model)
    for model, opt in ((ours, optim), (plain, reference_optim)):
        for step in range(6):
            x, y = _batch(step)
            _loss(model, x, y).backward()
            if step % 3 == 0:
                model.unshard()
                model.reshard()
                opt.step()
            elif step % 3 == 1:
                model.unshard()
                opt.step()
                model.state_dict()
            else:
                opt.step()
                model.unshard()
            opt.zero_grad()
        model.reshard()
    assert_match(ours, plain)


def _not_last_backward_body() -> None:
    """``set_is_last_backward(False)`` before every backward, each followed by ``step()`` (the
    flag meant for all but the last backward of an accumulation): FSDP2 keeps every forward's
    order, and from the second step its backward prefetches the child unit by an earlier
    forward's index, after the unit was reduced, and leaves the all-gather pending. The plain
    loop's next forward runs on that copy, the weights of before ``step()`` (7.0e-4 from the
    loop without the flag on 2 ranks, no error); here the copy holds the update: refused at
    that forward. On one rank FSDP2 copies the shards when it waits for the all-gather, not
    when it issues it: no stale copy, and equal. The root holds no parameters (else it would
    be last in the forward order and, never resharded, the mistargeted prefetch's no-op)."""

    def units() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 3))
        for unit in (model[0], model[1], model):
            fully_shard(unit)
        return model

    def loop(model: nn.Module, opt: Any, last: bool) -> None:
        for step in range(4):
            model.set_is_last_backward(last)
            _loss(model, *_batch(step)).backward()
            opt.step()
            opt.zero_grad()

    ours, plain, (optim,), (reference,) = _both(units)
    loop(plain, reference, last=False)
    if dist.get_world_size() == 1:
        loop(ours, optim, last=False)
        assert_match(ours, plain)
        return
    with pytest.raises(RuntimeError, match="set_is_last_backward"):
        loop(ours, optim, last=False)
    flagged, (model, _, (opt,), _) = plain, _both(units)
    loop(model, opt, last=True)  # ours, the flag left on: the plain loop's stale copy shows
    with pytest.raises(AssertionError):
        assert_match(model, flagged)


def _gan_frozen_root_body() -> None:
    """A GAN whose generator and discriminator are FSDP2 roots of their own. The discriminator
    phase freezes the generator and runs it (a forward with no backward: its root stays
    unsharded), so ``G.requires_grad_(True)`` before the generator phase reaches only FSDP2's
    unsharded parameters; the gradient still reaches the sharded ones, and the plain optimizer
    steps it. Here it was refused as a freeze between forward and backward; now equal."""

    def gan(seed: int) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(seed)
        generator = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
        discriminator = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
        return fully_shard(generator), fully_shard(discriminator)

    bce = nn.BCEWithLogitsLoss()
    runs = []
    for ours in (True, False):
        generator, discriminator = gan(0)
        start = [full(p).detach().clone() for p in generator.parameters()]
        opt_g = (
            OptimizerInBackward(generator.parameters(), torch.optim.Adam, lr=2e-2)
            if ours
            else torch.optim.Adam(generator.parameters(), lr=2e-2)
        )
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-2)
        for step in range(4):
            real, _ = _batch(step)
            z = real[:, :3] * 0.5
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            generator.requires_grad_(False)
            fake = generator(z)
            opt_d.zero_grad()
            (bce(discriminator(real), ones) + bce(discriminator(fake), zeros)).backward()
            opt_d.step()
            generator.requires_grad_(True)
            opt_g.zero_grad()
            bce(discriminator(generator(z)), ones).backward()
            opt_g.step()
        # The loop trains the generator (else equality would hold with both left alone).
        moved = zip(generator.parameters(), start, strict=True)
        assert all(not torch.equal(full(p), p0) for p, p0 in moved)
        runs.append(generator)
    assert_match(*runs)


def _unfrozen_after_evaluation_body() -> None:
    """A frozen head in the root unit, unfrozen after an evaluation forward under ``no_grad``
    (the root stays unsharded, so only FSDP2's unsharded parameters require grad): the plain
    optimizer steps the gradient FSDP2 reduces into the sharded head. Here ``step()`` refused
    it as a frozen parameter holding a gradient, after the other units had moved; now equal."""

    def build() -> nn.Module:
        model = _model()
        model[2].requires_grad_(False)
        return model

    ours, plain, (optim,), (reference_optim,) = _both(build)
    head = full(plain[2].weight).detach().clone()
    for model, opt in ((ours, optim), (plain, reference_optim)):
        for step in range(4):
            x, y = _batch(step)
            if step == 2:
                with torch.no_grad():
                    model(x)
                model[2].requires_grad_(True)
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    # The plain loop trains the unfrozen head (else equality would hold with both frozen).
    assert not torch.equal(full(plain[2].weight), head)
    assert_match(ours, plain)


def _frozen_after_evaluation_body() -> None:
    """The head in the root unit frozen after an evaluation forward under ``no_grad``, between
    two micro-batches: the root stays unsharded, so ``requires_grad_(False)`` reaches only
    FSDP2's all-gathered copies, and the sharded head keeps the first micro-batch's gradient,
    which the plain ``step()`` steps (the second micro-batch adds nothing to it). Ours cannot
    tell it from a frozen parameter holding a gradient: refused at the second backward, before
    anything moves, naming ``model.reshard()`` (found by the stateful loop test, where a head
    frozen so after being added as a group held the gradients it had accumulated before)."""
    ours, plain, (optim,), (reference_optim,) = _both(_model)
    x, y = _batch(0)
    for model, opt in ((ours, optim), (plain, reference_optim)):
        with opt.accumulate() if opt is optim else contextlib.nullcontext():
            _loss(model, x, y).backward()
        with torch.no_grad():
            model(x)
        model[2].requires_grad_(False)
    head = full(reference_optim.param_groups[0]["params"][-2]).detach().clone()
    _loss(plain, x, y).backward()
    reference_optim.step()
    assert not torch.equal(full(reference_optim.param_groups[0]["params"][-2]), head)
    before = [full(p).detach().clone() for p in optim.param_groups[0]["params"]]
    with pytest.raises(RuntimeError, match=r"frozen .* holds a gradient.* model\.reshard\(\)"):
        _loss(ours, x, y).backward()
    after = [full(p) for p in optim.param_groups[0]["params"]]
    assert all(map(torch.equal, after, before))


def _hsdp_model() -> nn.Sequential:
    """``_model`` on an HSDP mesh: every rank a replica, shards of one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "shard"))
    model = _layers()
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _no_all_reduce_body(unsynced: str) -> None:
    """HSDP micro-batches with ``set_requires_all_reduce(False)`` for the root alone or the
    child alone (also frozen): FSDP2 keeps such a unit's reduce-scattered gradients and hands
    none out until a backward that all-reduces. The units still all-reducing were stepped in
    the first micro-batch and the second refused after they moved (1.0e-2). Such a backward
    is now a micro-batch, as with gradient sync off: equal."""

    def build() -> nn.Module:
        model = _hsdp_model()
        model[1].requires_grad_(unsynced != "frozen child")
        return model

    ours, plain, (optim,), (reference_optim,) = _both(build)
    before = _off_but_last("set_requires_all_reduce", unsynced)
    _micro_batches((ours, optim), (plain, reference_optim), before)


class _Branchy(nn.Module):
    """A trunk, a branch some micro-batches skip, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.h = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        return self.h(x + torch.tanh(self.b(x)) if use_b else x)


def _hsdp_branch_skipped_body() -> None:
    """HSDP micro-batches with all-reduce on the last only, a branch unit used in the first
    micro-batch of a step and not the last: FSDP2 keeps its reduce-scattered gradient for its
    next all-reducing backward, and the plain optimizer does not step it this step. That
    unit holds no update here, so there is nothing to refuse (it was refused at ``step()``,
    after the other units moved, 2.0e-2). Equal."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "shard"))
    models = []
    for ours in (True, False):
        model = _Branchy()
        for unit in (model.a, model.b, model):
            fully_shard(unit, mesh=mesh)
        opt = (
            OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=LR)
            if ours
            else torch.optim.AdamW(model.parameters(), lr=LR)
        )
        for step in range(3):
            for i in range(2):
                model.set_requires_all_reduce(i == 1)
                g = torch.Generator().manual_seed(100 * step + 10 * i + dist.get_rank())
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                ((model(x, not (step == 0 and i == 1)) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    assert_match(*models)


def _ignored_params() -> nn.Sequential:
    """The child unit and the root with ``ignored_params``: the child's bias and the root's
    last bias stay plain tensors inside the units, which FSDP2 neither shards nor reduces
    (each rank steps its own gradient of them, alike in both loops)."""
    model = _layers()
    ignored = {model[1][0].bias, model[2].bias}
    fully_shard(model[1], ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    return model


def _grouped_unit() -> nn.Sequential:
    """One unit of two modules (``fully_shard([first, child])``: one reduce-scatter for both),
    then the root."""
    model = _layers()
    fully_shard([model[0], model[1]])
    fully_shard(model)
    return model


def _other_units_body(build: Callable[[], nn.Module]) -> None:
    """Whole steps, then steps of two micro-batches (ours under ``accumulate()``), on units
    FSDP2 builds otherwise: equal, every parameter moved."""
    ours, plain, (optim,), (reference_optim,) = _both(build)
    start = [full(p).detach().clone() for p in ours.parameters()]
    for model, opt in ((ours, optim), (plain, reference_optim)):
        for step in range(4):
            x, y = _batch(step)
            if step < 2:
                _loss(model, x, y).backward()
            else:
                for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                    accumulating = opt is optim and i == 0
                    with optim.accumulate() if accumulating else contextlib.nullcontext():
                        (_loss(model, xm, ym) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert_match(ours, plain)
    for param, first in zip(ours.parameters(), start, strict=True):
        assert not torch.equal(full(param), first)


def _spmd_mesh_body(shape: tuple[int, ...]) -> None:
    """FSDP2 on a full SPMD mesh (``dp_mesh_dims``): the parameters are DTensors replicated
    on the mesh before ``fully_shard``, the batch a DTensor sharded over it, and FSDP2 shards
    on the mesh's ``dp`` dim (replicating on ``rep``, HSDP's layout, where the mesh is 2-D).
    Both loops on the same mesh (FSDP2 keeps one mesh per shape: a second, equal mesh is
    refused as another object): equal, and ours stepped every parameter in backward."""
    names = ("rep", "dp")[-len(shape) :]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard="dp", replicate="rep" if len(shape) == 2 else None)

    def build() -> nn.Module:
        model = _layers()
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                replicated = distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim)
                module.register_parameter(name, nn.Parameter(replicated))
        fully_shard(model[1], mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        return model

    ours, plain, (optim,), (reference_optim,) = _both(build)
    batch_placements = [Shard(0)] * mesh.ndim
    for model, opt in ((ours, optim), (plain, reference_optim)):
        for step in range(3):
            x, y = (DTensor.from_local(t, mesh, batch_placements) for t in _batch(step))
            before = [full(p).clone() for p in model.parameters()]
            _loss(model, x, y).backward()
            if opt is optim:
                moved = zip(ours.parameters(), before, strict=True)
                assert all(not torch.equal(full(p), b) for p, b in moved)
            opt.step()
            opt.zero_grad()
    assert_match(ours, plain)


def _reduction_controls(control: str) -> Callable[[], nn.Module]:
    """The model with one of FSDP2's controls of its gradient reduction set on every unit."""

    def build() -> nn.Module:
        model = _model()
        for unit in (model, model[1]):
            if control == "all-reduce hook":  # edits the reduced gradient in place
                unit.set_all_reduce_hook(lambda output: output.mul_(0.5).add_(1e-3))
            elif control == "sum reductions":
                unit.set_force_sum_reduction_for_comms(True)
            elif control == "input buffers":
                unit.set_reduce_scatter_max_input_buffers(2, recurse=False)
            elif control == "reduce-scatter group":
                unit.set_separate_reduce_scatter_group(True, recurse=False)
        return model

    return build


class _Failing(torch.autograd.Function):
    """The identity, whose backward raises while ``failing[0]`` is set."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, failing: list[bool]) -> torch.Tensor:
        ctx.failing = failing
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.failing[0]:
            raise _BackwardFailed
        return grad, None


class _BackwardFailed(RuntimeError):
    pass


class _FailingAt(nn.Module):
    """The model's layers with :class:`_Failing` after layer ``at``: a backward failing there
    has reduced and stepped the units after it (the child, where ``at`` is 0) and none
    before."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.layers = _layers()
        self.at = at
        self.failing = [False]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.at:
                x = _Failing.apply(x, self.failing)
        return x


def _reset_iter_state_body(at: int, keep: bool) -> None:
    """FSDP2's recovery from a failed backward (torch 2.13): catch it, ``reset_iter_state()`` on
    the root, go on with the next iteration (``zero_grad()`` first), or keep what the failed
    backward reduced with ``step()`` (``keep``). Two of five backwards fail. Equal where the
    failure came before any unit was reduced (after the last layer or the child) or the loop
    keeps the partial step; where the child unit was stepped before the failure (``at=0``)
    and the loop discards it, ``zero_grad()`` refuses, before anything else moves (the plain
    optimizer would drop the child's gradients, which ours stepped in backward). Where the
    failure came after the root's last layer (``at=1``), the root keeps that layer's unreduced
    gradients through the reset and adds them to its next reduction, in both loops (torch
    2.13; see differences.md)."""

    def build() -> nn.Module:
        model = _FailingAt(at)
        fully_shard(model.layers[1])
        fully_shard(model)
        return model

    ours, plain, (optim,), (reference_optim,) = _both(build)
    for model, opt in ((ours, optim), (plain, reference_optim)):
        for step in range(5):
            x, y = _batch(step)
            model.failing[0] = step in (1, 3)
            opt.zero_grad()
            try:
                _loss(model, x, y).backward()
            except _BackwardFailed:
                model.reset_iter_state()
                if keep:
                    opt.step()
                elif opt is optim and at == 0:
                    before = [full(p).clone() for p in ours.parameters()]
                    with pytest.raises(RuntimeError, match="A backward raised after updating"):
                        optim.zero_grad()
                    after = [full(p) for p in ours.parameters()]
                    assert all(map(torch.equal, after, before))
                    optim.step()  # what the message offers: keep the partial step
                    return
                continue
            opt.step()
    assert_match(ours, plain)


def _all_body() -> None:
    controls = ("all-reduce hook", "sum reductions", "input buffers", "reduce-scatter group")
    for build in (_ignored_params, _grouped_unit, *map(_reduction_controls, controls)):
        _other_units_body(build)
    for at in (0, 1, 2):
        for keep in (False, True):
            _reset_iter_state_body(at, keep)
    _hsdp_branch_skipped_body()
    for unsynced in ("root", "child", "frozen child"):
        _no_all_reduce_body(unsynced)
    for unsynced in ("root", "child", "unit beside plain", "frozen child"):
        _partial_no_sync_body(unsynced)
    _no_sync_two_optimizers_body()
    for flag in ("set_requires_gradient_sync", "set_requires_all_reduce"):
        _sync_off_after_a_stepping_backward_body(flag)
    _gathered_before_step_body()
    _not_last_backward_body()
    _gan_frozen_root_body()
    _unfrozen_after_evaluation_body()
    _frozen_after_evaluation_body()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_controls_equal_plain_or_refused(worlds, world_size):
    worlds.run(world_size, _all_body)


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_spmd_mesh_equal_plain(worlds, shape):
    worlds.run(math.prod(shape), _spmd_mesh_body, shape=shape)


def test_not_last_backward_on_one_rank_equal_plain(worlds):
    worlds.run(1, _not_last_backward_body)
