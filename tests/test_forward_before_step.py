"""A forward between backward and ``step()``: refused where it would read weights updated in
backward, equal to the plain loop where it reads what the plain loop reads.

The plain loop's weights move at ``step()``, so a forward between backward and ``step()`` (an
evaluation, a logged loss, a second micro-batch, an evaluation after a loop that stopped after
a backward) computes with the weights of before the update. Ours made the update in backward:
that forward would read the updated weights (0.999 logged where the plain loop logs 1.043 and
more), a difference with no error. It is refused before it runs ([Note: a forward between
backward and step()] in ``fused_optim_dist/_protocol.py``). Each test writes the plain loop
first and swaps ours in; the ``*_body`` functions run on gloo ranks with FSDP2.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from _toy import assert_match, batch, full, loss_fn, make_models, rank_slice, shard
from torch import nn
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist._left_updates import LEFT_UPDATES
from fused_optim_dist.checkpoint import export_weights, latest
from fused_optim_dist.checkpoint import save as save_checkpoint

ADAMW = dict(lr=1e-2, weight_decay=0.1)
REFUSED = r"updated in backward with no optimizer\.step\(\) since"


def _x(step: int, sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    return (rank_slice(x), rank_slice(y)) if sharded else (x, y)


def _loops(sharded: bool = False, **fsdp_kwargs) -> list[tuple[nn.Module, Optimizer]]:
    """Ours and plain AdamW, each on one of two identical models (sharded alike if
    ``sharded``)."""
    model, reference = make_models()
    if sharded:
        shard(model, **fsdp_kwargs)
        shard(reference, **fsdp_kwargs)
    return [
        (model, OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)),
        (reference, torch.optim.AdamW(reference.parameters(), **ADAMW)),
    ]


def _evaluate(model: nn.Module, step: int, sharded: bool = False) -> float:
    with torch.no_grad():
        return loss_fn(model, *_x(step + 100, sharded)).item()


def _refused_unmoved(model: nn.Module, forward: Callable[[], object], match: str = REFUSED) -> None:
    """``forward()`` is refused, naming ``step()`` (or ``match``), and no parameter of
    ``model`` moved."""
    before = [full(p).detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=match):
        forward()
    for param, then in zip(model.parameters(), before, strict=True):
        assert torch.equal(full(param).detach(), then)


# ------------------------------------------------------------------ reads that are refused

_SECOND_MICRO_BATCH = lambda model: loss_fn(model, *_x(1))  # noqa: E731
_ONE_LAYER = lambda model: model.head(torch.zeros(1, model.head.in_features))  # noqa: E731
_IN_TRAIN_MODE = lambda model: model.train()(_x(1)[0])  # noqa: E731


@pytest.mark.parametrize(
    "forward",
    [lambda model: _evaluate(model, 0), _SECOND_MICRO_BATCH, _ONE_LAYER, _IN_TRAIN_MODE],
    ids=["evaluation", "second-micro-batch", "one-layer", "train-mode-logging"],
)
def test_forward_between_backward_and_step_refused_before_it_runs(forward):
    """An evaluation, a second micro-batch's forward (plain-style accumulation), one layer's
    forward, a forward for logging in train mode: each read the updated weights (the
    evaluation logged 0.999 where the plain loop logs 1.043, no error). Refused before it
    runs, the model unmoved; ``step()`` then commits the update, and the same forward after it
    reads what the plain loop's reads after its ``step()``."""
    (model, optim), (reference, plain) = _loops()
    loss_fn(model, *_x(0)).backward()
    _refused_unmoved(model, lambda: forward(model))
    optim.step()
    loss_fn(reference, *_x(0)).backward()
    plain.step()
    assert_match(model, reference)
    assert _evaluate(model, 0) == pytest.approx(_evaluate(reference, 0), abs=1e-6)


def _fgsm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, by_grad: bool) -> torch.Tensor:
    """FGSM's adversarial example of ``x``: its gradient taken by ``loss.backward()`` (as
    tutorials write it; the parameters get gradients too, dropped by the next
    ``zero_grad()``), or by ``torch.autograd.grad``."""
    x = x.clone().requires_grad_()
    loss = loss_fn(model, x, y)
    if by_grad:
        (grad,) = torch.autograd.grad(loss, x)
    else:
        loss.backward()
        grad = x.grad
    return (x + 0.1 * grad.sign()).detach()


def test_adversarial_training_refused_at_the_adversarial_forward_and_equal_by_grad():
    """Adversarial training as tutorials write it (FGSM): ``loss.backward()`` for the input's
    gradient, ``zero_grad()`` dropping the parameters' gradients, then the forward on the
    adversarial batch, its backward and ``step()``. The first backward updated the parameters
    here: the adversarial forward is refused, naming ``torch.autograd.grad``; taking the
    input's gradient with it, the loop is equal to the plain one."""
    (model, optim), _ = _loops()
    x, y = _x(0)
    x_adv = _fgsm(model, x, y, by_grad=False)
    with pytest.raises(RuntimeError, match=r"torch\.autograd\.grad\(loss, inputs\)"):
        loss_fn(model, x_adv, y)
    loops = _loops()
    for model, optim in loops:
        for step in range(3):
            x, y = _x(step)
            x_adv = _fgsm(model, x, y, by_grad=isinstance(optim, OptimizerInBackward))
            optim.zero_grad()
            loss_fn(model, x_adv, y).backward()
            optim.step()
    assert_match(loops[0][0], loops[1][0], atol=1e-6)


def test_evaluation_after_a_loop_that_stopped_after_a_backward_refused():
    """A step budget checked after backward: the plain loop never applies that backward's
    gradients, and its evaluation reads the weights of before it; ours applied them in
    backward (a warning at exit was all before). The evaluation is refused; ``step()`` first
    keeps the update, as the message says."""
    (model, optim), _ = _loops()
    for step in range(3):
        optim.zero_grad()
        loss_fn(model, *_x(step)).backward()
        if step == 2:
            break
        optim.step()
    _refused_unmoved(model, lambda: _evaluate(model, 0))
    optim.step()
    _evaluate(model, 0)


LEFT = r"holds an update an OptimizerInBackward made in backward that no step\(\) committed"
SAVE_PENDING = r"would save .* updated in backward with no optimizer\.step\(\) since"
SAVE_LEFT = r"would save .* no step\(\) committed"


def _stopped_loop(model: nn.Module, optim: Optimizer, sharded: bool = False) -> dict:
    """Three steps whose budget is checked after backward: the third backward has no
    ``step()``. Returns the model's weights of before that backward."""
    for step in range(3):
        optim.zero_grad()
        saved = copy.deepcopy(model.state_dict())
        loss_fn(model, *_x(step, sharded)).backward()
        if step == 2:
            break
        optim.step()
    return saved


def _left_updates_hooked() -> tuple[int, bool]:
    """How many parameters hold updates left uncommitted, and whether the global forward
    pre-hook refusing reads of them is registered (other hooks aside)."""
    hooked = any(
        getattr(hook, "__self__", None) is LEFT_UPDATES
        for hook in nn.modules.module._global_forward_pre_hooks.values()
    )
    return len(LEFT_UPDATES._left), hooked


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
@pytest.mark.parametrize("leave", ["collected", "detached"])
def test_evaluation_once_the_optimizer_of_a_stopped_loop_was_collected_refused(leave):
    """The loop's function returned after a backward with no ``step()`` and its optimizer was
    collected (or detached, then collected): the plain loop's evaluation reads the weights of
    before that backward, ours read the updated ones (a warning at collection was all). Refused
    before it runs, the model unmoved (so is a next phase's first forward, with a plain
    optimizer of its own); with the weights of before that backward loaded, the evaluation is
    the plain loop's, and with the weights loaded as they are (the update kept on purpose) it
    runs. The global hook goes once no such parameter is left (loaded, or collected with its
    model), at the loop's next construction or ``step()``."""
    gc.collect()
    _loops()  # a construction: a hook left with nothing noted goes
    assert _left_updates_hooked() == (0, False)
    (model, optim), (reference, plain) = _loops()
    saved = _stopped_loop(model, optim)
    _stopped_loop(reference, plain)
    if leave == "detached":
        optim.detach()
    del optim, plain
    gc.collect()
    _refused_unmoved(model, lambda: _evaluate(model, 0), match=LEFT)
    # A next phase with a plain optimizer of its own: refused at its first forward.
    torch.optim.AdamW(model.parameters(), **ADAMW)
    _refused_unmoved(model, lambda: loss_fn(model, *_x(3)).backward(), match=LEFT)
    model.load_state_dict(saved)
    assert _evaluate(model, 0) == _evaluate(reference, 0)
    assert_match(model, reference, atol=0)
    for then in ("kept", "collected"):
        (other, optim), _ = _loops()
        _stopped_loop(other, optim)
        del optim
        gc.collect()
        assert _left_updates_hooked() == (len(list(other.parameters())), True)
        if then == "kept":
            _refused_unmoved(other, functools.partial(_evaluate, other, 0), match=LEFT)
            other.load_state_dict(other.state_dict())
            _evaluate(other, 0)
        del other
        gc.collect()
        # Nothing is left: the hook goes at the next construction (or step()), not from the
        # garbage collector's callback.
        _loops()
        assert _left_updates_hooked() == (0, False)


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
def test_stopped_loop_optimizer_collected_while_a_model_compiles():
    """The garbage collector may collect a stopped loop's optimizer while Dynamo compiles
    another model (here in the backend's call, before Dynamo checks the guards it built):
    the model compiles, its results those of its eager forward, and the stopped loop's
    compiled evaluation is refused from then on."""
    (model, optim), _ = _loops()
    _stopped_loop(model, optim)
    held = [optim]
    del optim

    def backend(graph: torch.fx.GraphModule, _inputs: list) -> Callable:
        held.clear()  # the last reference: collected now, inside the compilation
        return graph.forward

    other, _ = make_models(seed=1)
    expected = _evaluate(other, 0)
    torch._dynamo.reset()
    assert _evaluate(torch.compile(other, backend=backend), 0) == expected
    assert not held and LEFT_UPDATES._armed
    compiled = torch.compile(model, backend="eager")
    _refused_unmoved(model, lambda: _evaluate(compiled, 0), LEFT)
    torch._dynamo.reset()


def test_forward_of_a_module_built_on_another_parameter_object_is_not_a_read():
    """Modules reading parameters that are not the updated ones: a teacher copy, and the model
    called through ``torch.func.functional_call`` with its weights of before the update
    passed in. Neither reads an update: they run, equal to the plain loop."""
    loops = _loops()
    teacher = copy.deepcopy(loops[0][0])
    logged: list[list[float]] = [[], []]
    for (model, optim), log in zip(loops, logged, strict=True):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(3):
            optim.zero_grad()
            loss_fn(model, *_x(step)).backward()
            with torch.no_grad():
                log.append(teacher(_x(step)[0]).sum().item())
                out = torch.func.functional_call(model, before, (_x(step)[0],))
                log.append(out.sum().item())
            optim.step()
    assert logged[0] == logged[1]
    assert_match(loops[0][0], loops[1][0])


def test_forward_after_a_rollback_reads_the_restored_weights():
    """A loss spike rolled back: the model and the optimizer restored from a copy taken before
    the backward, an evaluation (reading the restored weights, as the plain loop's does), then
    ``zero_grad()`` and on. Equal to the plain loop, the evaluation too."""
    logged: list[list[float]] = [[], []]
    loops = _loops()
    for (model, optim), log in zip(loops, logged, strict=True):
        for step in range(4):
            saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())
            optim.zero_grad()
            loss_fn(model, *_x(step)).backward()
            if step == 1:
                model.load_state_dict(saved[0])
                optim.load_state_dict(saved[1])
                log.append(_evaluate(model, step))
                optim.zero_grad()
                continue
            optim.step()
            log.append(_evaluate(model, step))
    assert logged[0] == pytest.approx(logged[1], abs=1e-6)
    assert_match(loops[0][0], loops[1][0])


WRITTEN = r"updated in backward with no optimizer\.step\(\) since and then written"


@pytest.mark.parametrize("write", ["in-place edit", "model restored alone"])
def test_forward_after_a_write_without_the_optimizer_state_refused(write):
    """A parameter written between backward and ``step()``, then a forward: the plain loop's reads
    the write over the weights of before ``step()``, ours the write over the update (the
    input layer halved in place: the evaluation 1.302 where the plain loop's is 1.444, no
    error until ``step()`` refused the write). Refused at the forward, before it runs,
    unless the optimizer's state was loaded too (the rollback above, equal). A model
    restored alone reads what the plain loop reads, but only a rollback is told from a
    partial write: refused too, naming the rollback."""
    (model, optim), (reference, plain) = _loops()
    saved = copy.deepcopy(model.state_dict())
    for net in (model, reference):
        loss_fn(net, *_x(0)).backward()
        if write == "in-place edit":
            with torch.no_grad():
                net.inp.weight.mul_(0.5)
        else:
            net.load_state_dict(saved)
    _evaluate(reference, 0)
    with pytest.raises(RuntimeError, match=WRITTEN):
        _evaluate(model, 0)
    del optim, plain  # held to here: a collected optimizer steps nothing in backward


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_recomputes_forwards_in_backward_as_plain(reentrant):
    """Activation checkpointing runs the blocks' forwards again in backward, after the blocks
    above them were stepped: a recomputation reads its own block, not yet updated, and is not
    a read between backward and ``step()``. Equal to the plain loop."""
    loops = _loops()
    for model, optim in loops:
        for step in range(3):
            optim.zero_grad()
            x, y = _x(step)
            h = model.inp(x)
            for layer in model.layers:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            nn.functional.mse_loss(model.head(h), y).backward()
            optim.step()
    assert_match(loops[0][0], loops[1][0])


# ------------------------------------------------------------------------------------ FSDP2


def _fsdp_evaluation_refused_body() -> None:
    """FSDP2: the root's forward is refused before it gathers anything, on every rank."""
    (model, optim), (reference, plain) = _loops(sharded=True)
    loss_fn(model, *_x(0, sharded=True)).backward()
    _refused_unmoved(model, lambda: _evaluate(model, 0, sharded=True))
    _refused_unmoved(model, lambda: model.layers[1](torch.zeros(1, model.inp.out_features)))
    optim.step()
    loss_fn(reference, *_x(0, sharded=True)).backward()
    plain.step()
    assert _evaluate(model, 0, sharded=True) == pytest.approx(
        _evaluate(reference, 0, sharded=True), abs=1e-6
    )
    assert_match(model, reference)


def _fsdp_kept_gathered_body() -> None:
    """FSDP2 with ``set_reshard_after_backward(False)``: after backward each unit keeps the
    weights it gathered for it, from before the update, and a forward before ``step()`` reads
    them in both loops: not refused, equal (the evaluations too). Resharded first
    (``model.reshard()``), the forward would gather the updated shards where the plain loop
    gathers those of before ``step()`` (1.0e-2 apart after four steps, no error, before):
    refused."""
    loops = _loops(sharded=True)
    logged: list[list[float]] = [[], []]
    for (model, optim), log in zip(loops, logged, strict=True):
        model.set_reshard_after_backward(False)
        for step in range(3):
            optim.zero_grad()
            loss_fn(model, *_x(step, sharded=True)).backward()
            log.append(_evaluate(model, step, sharded=True))
            optim.step()
    assert logged[0] == pytest.approx(logged[1], abs=1e-6)
    assert_match(loops[0][0], loops[1][0])
    model, optim = loops[0]
    optim.zero_grad()
    loss_fn(model, *_x(3, sharded=True)).backward()
    model.reshard()
    _refused_unmoved(model, lambda: _evaluate(model, 3, sharded=True))


def _fsdp_stopped_loop_body(
    kept_gathered: bool, compiled: bool = False, directory: str = ""
) -> None:
    """FSDP2, a loop stopped after a backward, its optimizer collected: the root's evaluation
    is refused before it gathers anything, on every rank, also through ``torch.compile`` of
    the whole model, and so are an export of the weights and a checkpoint saved with a plain
    optimizer for the next phase, into ``directory``; with the weights of before that backward
    loaded, the evaluation and the export are the plain loop's. With
    ``set_reshard_after_backward(False)`` each unit keeps the weights it gathered for that
    backward, from before the update, and the evaluation reads them in both loops: not
    refused, equal."""
    loops = _loops(sharded=True)
    saved = []
    for model, optim in loops:
        model.set_reshard_after_backward(not kept_gathered)
        saved.append(_stopped_loop(model, optim, sharded=True))
    (model, _), (reference, _) = loops
    del loops
    gc.collect()
    evaluated = torch.compile(model, backend="eager") if compiled else model
    if kept_gathered:
        assert _evaluate(evaluated, 0, sharded=True) == _evaluate(reference, 0, sharded=True)
        model.reshard()
    _refused_unmoved(model, lambda: _evaluate(evaluated, 0, sharded=True), match=LEFT)
    path = os.path.join(directory, "weights.pt")
    if directory:
        _refused_unmoved(model, lambda: export_weights(model, path), match=SAVE_LEFT)
        next_phase = torch.optim.SGD(model.parameters(), lr=0.1)
        run = os.path.join(directory, "run")
        save = functools.partial(save_checkpoint, run, model, next_phase, step=1)
        _refused_unmoved(model, save, match=SAVE_LEFT)
        assert not os.path.exists(path) and latest(run) is None
    model.load_state_dict(saved[0])
    assert _evaluate(evaluated, 0, sharded=True) == _evaluate(reference, 0, sharded=True)
    assert_match(model, reference, atol=0)
    if directory:
        export_weights(model, path)
        expected = {name: full(param).detach() for name, param in reference.named_parameters()}
        if dist.get_rank() == 0:
            exported = torch.load(path, weights_only=True)
            for name, value in expected.items():
                assert torch.equal(exported[name], value), name
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
def test_forward_between_backward_and_step_on_fsdp2(worlds, tmp_path):
    for world in (2, 3):
        worlds.run(world, _fsdp_evaluation_refused_body)
    worlds.run(2, _fsdp_kept_gathered_body)
    for kept_gathered in (False, True):
        directory = "" if kept_gathered else str(tmp_path)
        worlds.run(3, _fsdp_stopped_loop_body, kept_gathered=kept_gathered, directory=directory)
    worlds.run(2, _fsdp_stopped_loop_body, kept_gathered=False, compiled=True)


def test_compiled_model_forward_between_backward_and_step_refused():
    """A ``torch.compile``d model: Dynamo traces module hooks, and the forward pre-hook is
    registered only while updates await ``step()``, so the loop's forwards find the hooks as
    they were compiled with (one graph, equal to the plain loop), and a forward between
    backward and ``step()`` is refused as an eager one is."""
    from torch._dynamo.utils import counters

    # Optimizers of earlier tests left holding updates in reference cycles take the hook with
    # them when collected: collected during the loop, after it was compiled with the hook, they
    # would make it compile again (two graphs, seen in a full run).
    gc.collect()
    loops = _loops()
    for model, optim in reversed(loops):  # ours last: its compiled model is used below
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager")
        for step in range(3):
            optim.zero_grad()
            nn.functional.mse_loss(compiled(_x(step)[0]), _x(step)[1]).backward()
            optim.step()
        assert counters["stats"]["unique_graphs"] == 1
    assert_match(loops[0][0], loops[1][0])
    model, optim = loops[0]
    optim.zero_grad()
    nn.functional.mse_loss(compiled(_x(3)[0]), _x(3)[1]).backward()
    with torch.no_grad():
        _refused_unmoved(model, lambda: compiled(_x(4)[0]))
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
def test_saves_of_weights_holding_uncommitted_updates_refused(tmp_path):
    """``export_weights`` and ``checkpoint.save`` of weights updated in backward that no
    ``step()`` committed wrote the updated weights, which the plain loop's file does not hold
    (between backward and ``step()``; after a loop that stopped after a backward, with a
    plain optimizer for the next phase). Refused before anything is written; after
    ``step()``, and with the weights of before that backward loaded, the files hold the plain
    loop's weights."""
    (model, optim), (reference, plain) = _loops()
    path = tmp_path / "weights.pt"
    loss_fn(model, *_x(0)).backward()
    _refused_unmoved(model, lambda: export_weights(model, path), match=SAVE_PENDING)
    _refused_unmoved(
        model, lambda: save_checkpoint(tmp_path / "run", model, optim, step=0), SAVE_PENDING
    )
    optim.step()
    loss_fn(reference, *_x(0)).backward()
    plain.step()
    export_weights(model, path)
    exported = torch.load(path, weights_only=True)
    for name, param in reference.named_parameters():
        assert torch.equal(exported[name], param.detach()), name
    saved = _stopped_loop(model, optim)
    _stopped_loop(reference, plain)
    optim = None  # collected
    gc.collect()
    path.unlink()
    _refused_unmoved(model, lambda: export_weights(model, path), match=SAVE_LEFT)
    next_phase = torch.optim.SGD(model.parameters(), lr=0.1)
    _refused_unmoved(
        model, lambda: save_checkpoint(tmp_path / "run", model, next_phase, step=1), SAVE_LEFT
    )
    assert not path.exists() and latest(tmp_path / "run") is None
    model.load_state_dict(saved)
    save_checkpoint(tmp_path / "run", model, next_phase, step=1)
    export_weights(model, path)
    exported = torch.load(path, weights_only=True)
    for name, param in reference.named_parameters():
        assert torch.equal(exported[name], param.detach()), name


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
def test_export_after_a_write_over_an_update_refused_after_a_rollback_as_plain(tmp_path):
    """Between backward and ``step()``, every weight halved in place and then exported: the
    plain loop's file holds half the weights of before the update, ours half the updated ones
    (written since their update, none of them holds it as it was: the export went through
    before). Refused, as a forward there is; after a rollback (the model and the optimizer's
    state loaded from before the backward) the export holds the plain loop's weights."""
    (model, optim), (reference, _) = _loops()
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())
    path = tmp_path / "weights.pt"
    loss_fn(model, *_x(0)).backward()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    _refused_unmoved(model, lambda: export_weights(model, path), match=SAVE_PENDING)
    model.load_state_dict(saved[0])
    optim.load_state_dict(saved[1])
    export_weights(model, path)
    exported = torch.load(path, weights_only=True)
    for name, param in reference.named_parameters():
        assert torch.equal(exported[name], param.detach()), name


@pytest.mark.filterwarnings("ignore:OptimizerInBackward ended with:RuntimeWarning")
def test_compiled_evaluation_after_a_stopped_loop_refused():
    """An evaluation through ``torch.compile`` once a stopped loop's optimizer was collected
    read the updated weights, no error: Dynamo traced the forward pre-hook as doing nothing.
    The hook now checks outside the graph while any parameter holds an update left
    uncommitted, so the compiled evaluation is refused before it runs, and with the weights of
    before that backward loaded it equals the plain loop's. Another model compiled meanwhile
    runs, its graph broken at the hooks, with its eager forward's results (compiled with
    ``fullgraph=True``, Dynamo refuses it, naming why); once nothing is left (at the loop's
    next construction) a model compiles into one graph with no break (the hook read
    autograd's graph task id first, which Dynamo cannot trace, in an earlier version: two
    breaks, no graph)."""
    from torch._dynamo.utils import counters

    gc.collect()
    _loops()  # a construction: what earlier tests left and wrote since is forgotten
    assert not LEFT_UPDATES._left, "an earlier test left parameters holding updates alive"
    (model, optim), (reference, plain) = _loops()
    other, _ = make_models(seed=1)
    expected = [_evaluate(other, step) for step in range(2)]
    torch._dynamo.reset()
    compiled, compiled_other = (torch.compile(m, backend="eager") for m in (model, other))
    saved = _stopped_loop(model, optim)
    _stopped_loop(reference, plain)
    del optim
    gc.collect()
    counters.clear()
    _refused_unmoved(model, lambda: _evaluate(compiled, 0), LEFT)
    assert [_evaluate(compiled_other, step) for step in range(2)] == expected
    assert counters["graph_break"], "the check ran in the graph"
    torch._dynamo.reset()  # else the entries compiled above serve it
    whole = torch.compile(other, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"no step\(\) committed"):
        _evaluate(whole, 0)
    model.load_state_dict(saved)
    assert _evaluate(compiled, 0) == _evaluate(reference, 0)
    _loops()
    assert not LEFT_UPDATES._armed
    torch._dynamo.reset()
    counters.clear()
    assert [_evaluate(torch.compile(other, backend="eager"), step) for step in range(2)] == expected
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
