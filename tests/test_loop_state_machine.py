"""Random training loops, driven on a plain and an in-backward optimizer side by side.

A hypothesis ``RuleBasedStateMachine`` interleaves what real loops do: steps, accumulation (and on
FSDP2 its own, with gradient sync off for all micro-batches but the last), gradients held under
``accumulate()`` edited in place before ``step()`` (halved, clipped by value or by norm), freezing
and unfreezing (also between a forward and its backward), groups added later, a backward that
raises, a second backward before ``step()``, gradients read before ``step()``, kept as zeros by the
module or by the optimizer's ``zero_grad(set_to_none=False)`` (then stepped by a backward, one that
misses a layer, under ``accumulate()``, with gradients set by hand or none) or never zeroed, an
optimizer state loaded or an LR set before ``step()``, a second ``step()`` (each refused; the load
then rolled back), activation checkpointing (reentrant or not) and ``save_on_cpu``, ``step()``
without a backward, LR changes (lr 0 included) and weight-decay changes, an LR scheduler,
``state_dict``/``load_state_dict`` and DCP checkpoint round trips (``get_state_dict``'s zero step
on an empty state included), a restart (new optimizers loading their predecessors' state dicts),
``state.clear()``, the head frozen and unfrozen (also before it is added as a group), an evaluation
forward under ``torch.no_grad()`` (on FSDP2 a group added after it is refused until ``reshard()``),
magnitude pruning on a plain module (``torch.nn.utils.prune``: a weight masked, masked again, then
made permanent through ``.data =``), a layer's weights rewritten in place (or through ``.data =``
on a plain module); ``state_dict()``, a deep copy or a pickle of the optimizer between backward and
``step()`` (refused) and under ``accumulate()`` (equal), two backwards on disjoint parameters
before one ``step()`` and gradients set by hand before it (stepped, or refused where the plain step
differs), NaN batches with ``skip_nonfinite``; also with a class that counts steps in its param
groups (NaN batches too: a step skipped whole counts nothing, as the plain loop calling no
``step()``) or on itself (a rolled-back backward counts nothing), with CompactAdamW, and on
bfloat16 models. After every rule both models must hold the same parameters (1e-6) and, between
steps, the same optimizer state, its entries listed in the same order; and at every step both loops
measure the norm of the step's gradients through ``fused_optim_dist.clip_grad_norm_`` (the plain
loop's ``clip_grad_norm_``), which must agree where ours gives one. It runs on one process (a plain
module, many examples) and with FSDP2 (fewer, derandomised so that every rank draws the same
sequence): on 2 ranks, and with NaN batches on 4 (the last rank's shards all empty), a class
counting steps in its groups, one stepped jointly, and every unit kept unsharded after forward
(``reshard_after_forward=False``) on 3, and with matrices sharded by columns
(``shard_placement_fn``) on 2, and with Adafactor stepped whole-tensor on 2 against plain Adafactor
on an unsharded copy fed the global batch. On FSDP2 the accumulation with gradient sync off turns
it off for the whole model or for part of it (the root unit alone, or the last block, frozen or
not)."""

from __future__ import annotations

import copy
import gc
import math
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _toy import (
    GLOBAL_BATCH,
    batch,
    bypassed,
    loss_fn,
    make_models,
    rank_slice,
    shard,
    swapping_conversions,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_never_silent import GlobalClipSGD, GroupStepLamb, InstanceCountSGD, OutOfPlaceMomentum
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint

from fused_optim_dist import InBackwardOptions, OptimizerInBackward, is_freed
from fused_optim_dist.checkpoint import export_weights
from fused_optim_dist.compact_adamw import CompactAdamW
from fused_optim_dist.training import accumulate_grads, clip_grad_norm_

ADAMW = dict(lr=1e-2, weight_decay=0.1)
LAYERS = 3
SNAPSHOTS = ("state_dict", "deepcopy", "pickle")


class _Boom(RuntimeError):
    pass


def _steps(optim: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): float(s["step"]) for p, s in optim.state.items() if "step" in s}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """Both sides are sharded alike, so local shards compare without a collective."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and torch.is_floating_point(value)


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, list | tuple):  # a class's list of tensors
        assert type(actual) is type(expected) and len(actual) == len(expected), what
        for a, e in zip(actual, expected, strict=True):
            _assert_close(a, e, what)
        return
    if not isinstance(expected, torch.Tensor):  # a Python number a class keeps
        assert actual == expected, (what, actual, expected)
        return
    if isinstance(expected, DTensor):  # placed alike, not only the same local values
        assert isinstance(actual, DTensor), f"{what}: a {type(actual).__name__}, not a DTensor"
        assert actual.placements == expected.placements, what
    if isinstance(actual, DTensor) and not isinstance(expected, DTensor):
        actual = actual.full_tensor()  # against a one-process reference (collective)
    torch.testing.assert_close(
        _local(actual).detach(), _local(expected).detach(), atol=1e-6, rtol=1e-5, msg=what
    )


def _assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        _assert_close(param, ref, name)


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.equal(a, b)


def _assert_unchanged(model: nn.Module, before: list[torch.Tensor]) -> None:
    """``model``'s parameters are bitwise those ``_parameters`` took."""
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)


def _take(optim: torch.optim.Optimizer, kind: str) -> dict | torch.optim.Optimizer:
    """``optim.state_dict()``, a deep copy of ``optim``, or ``optim`` pickled and unpickled."""
    if kind == "state_dict":
        return optim.state_dict()
    if kind == "deepcopy":
        return copy.deepcopy(optim)
    return pickle.loads(pickle.dumps(optim))


@contextmanager
def _export_of(model: nn.Module) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
    """A call exporting ``model``'s weights (``export_weights``, collective) into a temporary
    file, returning what rank 0 wrote (an empty dict on the other ranks)."""
    directory = tempfile.mkdtemp(prefix="loop-export-")
    path = os.path.join(directory, "weights.pt")

    def export() -> dict[str, torch.Tensor]:
        export_weights(model, path)
        return torch.load(path, weights_only=True) if os.path.exists(path) else {}

    try:
        yield export
    finally:
        shutil.rmtree(directory)


def _state_dict_of(snapshot: dict | torch.optim.Optimizer) -> dict:
    """The state dict of what ``_take`` returned. A copy's ``step()`` steps the copy, not the
    optimizer an LR scheduler wrapped the ``step`` of."""
    if isinstance(snapshot, dict):
        return snapshot
    assert snapshot.step.__self__ is snapshot
    return snapshot.state_dict()


def _assert_same_state(ours: torch.optim.Optimizer, plain: torch.optim.Optimizer) -> None:
    _assert_same_state_dicts(ours.state_dict(), plain.state_dict())


def _assert_same_state_dicts(a: dict, b: dict) -> None:
    """The same groups, and the same state entries in the same order (code may find an entry by
    its position), equal to 1e-6."""
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"]), (list(a["state"]), list(b["state"]))
    for index, entry in b["state"].items():
        assert entry.keys() == a["state"][index].keys(), index
        for key, value in entry.items():
            _assert_close(a["state"][index][key], value, f"state {index} {key}")


class LoopMachine(RuleBasedStateMachine):
    sharded = False
    fsdp_kwargs: ClassVar[dict] = {}
    """``fully_shard``'s keyword arguments, for every unit."""
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    optimizer_kwargs: ClassVar[dict] = ADAMW
    dtype = torch.float32
    """Of the models' parameters and of the batches."""
    max_grad_norm: float | None = None
    """Clip by norm: ours in backward, the plain loop with ``clip_grad_norm_`` before step."""
    bucket_numel: int | None = 24
    stepping: str | None = None
    """The ``stepping`` option: ``None``, as declared (an undeclared class is stepped
    jointly)."""
    skip_nonfinite: bool = False
    """Ours skips non-finite buckets; the plain loop skips a step whose gradients are not all
    finite (the same where a non-finite loss reaches every bucket)."""
    reference_sharded = True
    """With ``sharded``: whether the plain loop's model is sharded as ours is. If not (a class
    plain PyTorch cannot step on DTensors), it is an unsharded copy fed the global batch, and
    the rule loading each loop's state dict into the other is off."""
    second_pass_refused = False
    """Whether ours refuses a second pass (a backward, or ``step()`` stepping gradients set by
    hand) after a backward's updates before ``step()``: when clipping by norm, with a class
    stepped jointly or one that counts steps in its param groups, whose one plain ``step()``
    depends on all the step's gradients or advances once."""

    @initialize()
    def build(self) -> None:
        if self.sharded and not self.reference_sharded:
            # FSDP2 averages the ranks' gradients of their shares' mean losses: the gradient of
            # the global batch's mean only where the shares are equal.
            world = dist.get_world_size()
            assert GLOBAL_BATCH % world == 0, f"{world} ranks split a batch of {GLOBAL_BATCH}"
        ours_model, plain_model = make_models()
        self.models: tuple[nn.Module, nn.Module] = (
            ours_model.to(self.dtype),
            plain_model.to(self.dtype),
        )
        for model in self.models:
            if self._sharded(model):
                shard(model, **self.fsdp_kwargs)
        ours_model, plain_model = self.models
        body = [p for n, p in ours_model.named_parameters() if not n.startswith("head")]
        ref_body = [p for n, p in plain_model.named_parameters() if not n.startswith("head")]
        self.ours, self.plain = self._optimizers(body, ref_body)
        self.head_added = False
        self.pending = False  # gradients accumulated, not yet stepped
        self.step = 0
        self.schedulers: tuple[torch.optim.lr_scheduler.LRScheduler, ...] = ()
        # Each loop's norm of the gradients of its last step, until compared.
        self.norms: dict[str, torch.Tensor | None] = {}

    def _optimizers(
        self, params: list, ref_params: list
    ) -> tuple[OptimizerInBackward, torch.optim.Optimizer]:
        """Ours on ``params`` and the plain optimizer on ``ref_params`` (tensors or groups)."""
        cls, kwargs = self.optimizer_cls, self.optimizer_kwargs
        options = InBackwardOptions(
            max_grad_norm=self.max_grad_norm,
            bucket_numel=self.bucket_numel,
            stepping=self.stepping,
            skip_nonfinite=self.skip_nonfinite,
        )
        return OptimizerInBackward(params, cls, options=options, **kwargs), cls(
            ref_params, **kwargs
        )

    def _loss(self, model: nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
        """The loss of ``step``'s batch (this rank's share on FSDP2), its inputs scaled by
        ``scale``."""
        x, y = (t.to(self.dtype) for t in batch(step))
        if self._sharded(model):
            x, y = rank_slice(x), rank_slice(y)
        return loss_fn(model, x * scale, y)

    def _sharded(self, model: nn.Module) -> bool:
        """Whether ``model`` is sharded by FSDP2 (each rank its share of a batch)."""
        return self.sharded and (self.reference_sharded or model is self.models[0])

    def _mean_loss(self, model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as both loops compare it: the global batch's where only ours is sharded
        (the ranks' shares are equal)."""
        if not self._sharded(model) or self.reference_sharded:
            return loss
        total = loss.clone()
        dist.all_reduce(total)
        return total / dist.get_world_size()

    def _backward(self, model: nn.Module, step: int, scale: float = 1.0) -> None:
        self._loss(model, step, scale).backward()

    def _step(self, optim: torch.optim.Optimizer) -> None:
        """``optim.step()``, the step's norm first measured (and the plain loop's gradients
        clipped) through ``fused_optim_dist.clip_grad_norm_``; the plain loop with
        ``skip_nonfinite`` skips the step where their norm is not finite.

        Ours may refuse to measure after a backward that raised having stepped some
        parameters (``step()`` completes its norm)."""
        if optim is self.plain:
            norm = self.norms["plain"] = clip_grad_norm_(optim, self.max_grad_norm)
            # Not finite: an inf/NaN gradient, or finite ones whose norm overflows (torch's
            # error_if_nonfinite criterion; see [Note: a non-finite step] in _gradients.py).
            if self.skip_nonfinite and not bool(torch.isfinite(norm)):
                return
            optim.step()
            return
        try:
            norm = clip_grad_norm_(optim, self.max_grad_norm)
        except RuntimeError as error:
            if "a backward that raised" not in str(error):
                raise
            norm = None
        optim.step()
        self.norms["ours"] = norm

    @rule()
    def train(self) -> None:
        ours_model, plain_model = self.models
        self._backward(ours_model, self.step)
        self._step(self.ours)
        self.ours.zero_grad()
        self._backward(plain_model, self.step)
        self._step(self.plain)
        self.plain.zero_grad()
        self.pending = False
        self.step += 1

    @rule()
    def train_with_closure(self) -> None:
        """``step(closure)`` as torch's documentation writes it (the closure zeroes the
        gradients, runs the forward and the backward; PyTorch Lightning calls it so), against
        the plain loop written out: the same parameters, and the closure's loss returned."""
        ours_model, plain_model = self.models

        def closure() -> torch.Tensor:
            self.ours.zero_grad()
            loss = self._loss(ours_model, self.step)
            loss.backward()
            return loss

        with torch.no_grad():
            loss = self.ours.step(closure)
        self.ours.zero_grad()
        self.plain.zero_grad()
        plain_loss = self._loss(plain_model, self.step)
        plain_loss.backward()
        self._step(self.plain)
        self.plain.zero_grad()
        torch.testing.assert_close(self._mean_loss(ours_model, loss.detach()), plain_loss.detach())
        self.pending = False
        self.step += 1

    @rule()
    def accumulate(self) -> None:
        ours_model, plain_model = self.models
        with self.ours.accumulate():
            self._backward(ours_model, self.step)
        self._backward(plain_model, self.step)
        self.pending = True
        self.step += 1

    @precondition(lambda self: self.pending)
    @rule(edit=st.sampled_from(["scale", "clip_value", "clip_norm"]))
    def edit_held_gradients(self, edit: str) -> None:
        """The gradients held under ``accumulate()`` edited in place before ``step()``, as a
        loop averages or clips them: halved, ``clip_grad_value_``, or ``clip_grad_norm_`` over
        the optimizer's parameters (the plain loop's, which ours holds real until ``step()``).
        The plain loop then steps the edited gradients; so does ours."""
        for optim in (self.ours, self.plain):
            params = [p for g in optim.param_groups for p in g["params"] if p.grad is not None]
            if edit == "scale":
                for param in params:
                    param.grad.mul_(0.5)
            elif edit == "clip_value":
                torch.nn.utils.clip_grad_value_(params, 0.05)
            else:
                torch.nn.utils.clip_grad_norm_(params, 0.5)

    @precondition(lambda self: self.sharded and not self.pending)
    @rule(micro_batches=st.integers(2, 3), off=st.sampled_from(["model", "root", "layer"]))
    def accumulate_sync_off(self, micro_batches: int, off: str) -> None:
        """FSDP2's own accumulation, as torchtitan and accelerate write it: every micro-batch's
        backward but the last with gradient sync off (``set_requires_gradient_sync(False)``:
        each rank sums its unreduced gradients), the last with it on, then ``step()``. Sync
        turned off for the whole model, or for part of it only: the root unit alone
        (``recurse=False``) or the last block (frozen or not), the other units reducing and
        summing their sharded gradients every micro-batch."""
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                if not self._sharded(model):
                    pass  # a plain module sums its gradients
                elif off == "model":
                    model.set_requires_gradient_sync(last)
                elif off == "root":
                    model.set_requires_gradient_sync(last, recurse=False)
                else:
                    model.layers[-1].set_requires_gradient_sync(last)
                self._backward(model, self.step + micro)
            self._step(optim)
            optim.zero_grad()
        self.step += micro_batches

    @precondition(lambda self: not self.pending)
    @rule(layer=st.integers(0, LAYERS - 1))
    def freeze_between_forward_and_backward(self, layer: int) -> None:
        """``layer`` frozen after the forward, unfrozen after the backward, then ``step()``:
        autograd accumulates no gradient into a leaf that no longer requires grad, so neither
        optimizer steps it in this step. (Holding gradients accumulated before, it is refused
        at that backward: a frozen parameter holding a gradient.)"""
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            params = list(model.layers[layer].parameters())
            trainable = [p.requires_grad for p in params]
            loss = self._loss(model, self.step)
            model.layers[layer].requires_grad_(False)
            loss.backward()
            for param, flag in zip(params, trainable, strict=True):
                param.requires_grad_(flag)
            self._step(optim)
            optim.zero_grad()
        self.pending = False
        self.step += 1

    @rule(between=st.booleans())
    def convert(self, between: bool) -> None:
        """``model.cpu()`` on both models under ``set_swap_module_params_on_conversion(True)``
        (a new C++ tensor swapped into each parameter object, as for DTensor parameters
        always), in a training step between backward and ``step()``, or after it.

        The conversion follows a backward that completed: torch keeps the graph of a backward
        that raised (ours refuses some in other rules) until the next backward completes, and
        its nodes hold the parameters, which ``swap_tensors`` then refuses, in the plain loop
        as in ours. A conversion after ``step()`` is followed by a training step: on a plain
        module the swap leaves our hooks on the old C++ tensors, so the next backward is not
        stepped in backward (its ``step()`` hooks them again), which the expectations of the
        other rules (refusals of what an update made in backward forbids) do not know."""
        with swapping_conversions():
            for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
                self._backward(model, self.step)
                if between:
                    model.cpu()
                self._step(optim)
                optim.zero_grad()
                if not between:
                    model.cpu()
        self.pending = False
        self.step += 1
        if not between:
            self.train()

    @rule()
    def step_without_backward(self) -> None:
        # With accumulated gradients this steps them, as the plain optimizer does.
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
        self.pending = False

    @precondition(lambda self: not self.pending)
    @rule(layer=st.integers(0, LAYERS - 1), trainable=st.booleans())
    def set_requires_grad(self, layer: int, trainable: bool) -> None:
        for model in self.models:
            model.layers[layer].requires_grad_(trainable)

    @rule()
    def evaluate(self) -> None:
        """An evaluation forward under ``torch.no_grad()`` (under ``accumulate()`` too): on
        FSDP2 it leaves the root unit unsharded, its modules listing the all-gathered copies
        of its parameters until a backward or ``reshard()``. Against an unsharded reference,
        which holds no such copy, ours is resharded after it."""
        for model in self.models:
            model.eval()
            with torch.no_grad():
                self._loss(model, self.step + 100)
            model.train()
        if self.sharded and not self.reference_sharded:
            self.models[0].reshard()

    @precondition(lambda self: not self.head_added)
    @rule(lr=st.sampled_from([1e-3, 5e-2]))
    def add_head_group(self, lr: float) -> None:
        """The head added as a group. After an evaluation on FSDP2 its modules list the
        root unit's all-gathered copies, which a plain optimizer would hold and never step:
        ours refuses them before anything changes, and the loop calls ``reshard()``."""
        ours_model, plain_model = self.models
        if self.sharded and not isinstance(ours_model.head.weight, DTensor):
            with pytest.raises(ValueError, match=r"all-gathered copy .* model\.reshard\(\)"):
                self.ours.add_param_group({"params": ours_model.head.parameters(), "lr": lr})
            assert len(self.ours.param_groups) == 1
            for model in self.models:
                model.reshard()
        self.ours.add_param_group({"params": ours_model.head.parameters(), "lr": lr})
        self.plain.add_param_group({"params": plain_model.head.parameters(), "lr": lr})
        self.head_added = True

    @rule(lr=st.sampled_from([0.0, 1e-3, 2e-2]))
    def set_lr(self, lr: float) -> None:
        for optim in (self.ours, self.plain):
            optim.param_groups[0]["lr"] = lr

    @precondition(lambda self: "weight_decay" in self.ours.param_groups[0])
    @rule(weight_decay=st.sampled_from([0.0, 0.1, 0.3]))
    def set_weight_decay(self, weight_decay: float) -> None:
        """The first group's weight decay changed (under ``accumulate()`` too), as a loop
        ramping it writes it: the next update uses it, in both loops."""
        for optim in (self.ours, self.plain):
            optim.param_groups[0]["weight_decay"] = weight_decay

    @precondition(lambda self: "betas" in self.ours.param_groups[0])
    @rule(betas=st.sampled_from([(0.9, 0.999), (0.8, 0.99), (0.95, 0.9)]))
    def set_betas(self, betas: tuple[float, float]) -> None:
        """The first group's betas changed (under ``accumulate()`` too), as ``OneCycleLR`` and
        ``CyclicLR`` cycle them: the next update uses them, in both loops (the bias
        corrections of the steps counted so far included)."""
        for optim in (self.ours, self.plain):
            optim.param_groups[0]["betas"] = betas

    @precondition(
        lambda self: (
            not self.pending
            and isinstance(self.plain, torch.optim.Adam)
            and not self.plain.param_groups[0]["amsgrad"]
        )
    )
    @rule()
    def turn_on_amsgrad(self) -> None:
        """AMSGrad turned on in the first group mid-run, which needs a state entry the class
        makes only at a parameter's first step: the plain ``step()`` raises ``KeyError``, ours
        refuses at ``step()`` before anything moves (its backward held the gradients); the
        entry added as the error says, both step them (and keep AMSGrad from then on)."""
        for optim in (self.ours, self.plain):
            optim.param_groups[0]["amsgrad"] = True
        for model, optim, error in zip(
            self.models, (self.ours, self.plain), (RuntimeError, KeyError), strict=True
        ):
            # Ours checks the parameters that require a gradient before its backward steps
            # any; the plain step reads the state of those holding one.
            missing = [p for p in optim.param_groups[0]["params"] if optim.state.get(p)]
            if optim is self.ours:
                missing = [p for p in missing if p.requires_grad]
            self._backward(model, self.step)
            if optim is self.plain:
                missing = [p for p in missing if p.grad is not None]
            if missing:
                before = _parameters(model)
                with pytest.raises(error, match="max_exp_avg_sq"):
                    self._step(optim)
                _assert_unchanged(model, before)
            # The entry added to every parameter of the group holding state, as the error
            # says: a frozen one's is read once it trains again.
            for param in optim.param_groups[0]["params"]:
                state = optim.state.get(param)
                if state and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
            if missing and optim is self.plain:  # clipped, its norm taken, by the refused step
                optim.step()
            else:
                self._step(optim)
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending and self.reference_sharded)
    @rule()
    def load_state_dicts(self) -> None:
        # Ours loads the plain optimizer's state dict (interchangeable), and the reverse.
        plain_state = copy.deepcopy(self.plain.state_dict())
        self.plain.load_state_dict(copy.deepcopy(self.ours.state_dict()))
        self.ours.load_state_dict(plain_state)

    def _failing_backward(self, layer: int) -> None:
        """A backward raising in ``layer``'s backward hook, on both loops."""

        def boom(*_):
            raise _Boom("bad batch")

        for model in self.models:
            handle = model.layers[layer].register_full_backward_hook(boom)
            try:
                with pytest.raises(_Boom):
                    self._backward(model, self.step)
            finally:
                handle.remove()

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1), new_lr=st.booleans())
    def failing_backward(self, layer: int, new_lr: bool) -> None:
        """A backward that raises part-way, on both sides. Ours refuses to discard the
        updates it made (zero_grad() raises); step() accepts them, as the plain optimizer
        steps the same partial gradients. Not on FSDP2 models: torch 2.13's
        ``reset_iter_state()`` recovers from it, but keeps the gradients units had not
        reduced, which the next backward adds in (both loops;
        ``tests/test_fsdp2_controls_dist.py`` tests it apart). With ``new_lr``, the loop
        then triples every group's lr: ours refuses that step() where the backward made
        updates (with the old lr), and the loop sets the lr back and steps; where it made
        none, both step with the new lr."""

        self._failing_backward(layer)
        if self.ours._pending:
            with pytest.raises(RuntimeError, match="A backward raised after updating them"):
                self.ours.zero_grad()
        if new_lr:
            old = [[group["lr"] for group in o.param_groups] for o in (self.ours, self.plain)]
            for optim in (self.ours, self.plain):
                for group in optim.param_groups:
                    group["lr"] *= 3
            if self.ours._pending and any(old[0]):
                before = _parameters(self.models[0])
                with pytest.raises(RuntimeError, match=r"\['lr'\] was changed between"):
                    self._step(self.ours)
                _assert_unchanged(self.models[0], before)
                for optim, lrs in zip((self.ours, self.plain), old, strict=True):
                    for group, lr in zip(optim.param_groups, lrs, strict=True):
                        group["lr"] = lr
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1))
    def failing_backward_retried(self, layer: int) -> None:
        """A backward that raises part-way, on both sides, and the loop runs the batch's
        backward again, without ``zero_grad()``: the plain loop adds the partial gradients to
        the new ones. Where ours updated parameters, the retry is refused before anything
        moves, at its forward, which would read the updated weights; the loop then steps both
        as after the failure alone, drops the gradients and goes on. Where ours only held
        buckets, both step the summed gradients."""
        self._failing_backward(layer)
        ours_model = self.models[0]
        refused = bool(self.ours._pending)
        if refused:
            before = _parameters(ours_model)
            message = r"updated in backward with no optimizer\.step\(\) since"
            with pytest.raises(RuntimeError, match=message):
                self._backward(ours_model, self.step)
            _assert_unchanged(ours_model, before)
        else:
            for model in self.models:
                self._backward(model, self.step)
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            self._step(optim)
            optim.zero_grad()
            model.zero_grad()
        if refused:
            self._level_forward_side_effects()
        self.step += 1

    def _level_forward_side_effects(self) -> None:
        """After ours refused a forward or a backward the plain loop ran between backward and
        ``step()`` (a retry, a second backward, the next backward without ``zero_grad()``, an
        evaluation), what that forward left on the plain loop's modules differs from ours: a
        pruning hook's masked weight, by which the next pruning ranks the weights (found by
        random seeds: two entries of a mask apart, norms 2.4% and 7% apart). A forward of
        both puts it level."""
        with torch.no_grad():
            for model in self.models:
                self._loss(model, self.step)

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1))
    def failing_backward_rolled_back(self, layer: int) -> None:
        """A backward that raises part-way, on both sides, and the loop rolls back: the model
        and the optimizer loaded from a checkpoint taken before it, then ``zero_grad()``.
        Ours accepts the rollback (the updates it made are overwritten) and both loops go on
        from the checkpoint."""

        saved = [
            (copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict()))
            for model, optim in zip(self.models, (self.ours, self.plain), strict=True)
        ]
        self._failing_backward(layer)
        for model, optim, (weights, state) in zip(
            self.models, (self.ours, self.plain), saved, strict=True
        ):
            model.load_state_dict(weights)
            optim.load_state_dict(state)
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule()
    def second_backward(self) -> None:
        """Two backwards before step(): ours refuses the second before it moves anything; the
        loop then drops its gradients and steps once, as the plain loop that backs once."""
        ours_model, plain_model = self.models
        self._backward(ours_model, self.step)
        refused = bool(self.ours._pending)
        if refused:
            before = _parameters(ours_model)
            with pytest.raises(RuntimeError, match=r"accumulate\(\)"):
                self._backward(ours_model, self.step + 1)
            _assert_unchanged(ours_model, before)
        self._step(self.ours)
        self.ours.zero_grad()
        ours_model.zero_grad()
        self._backward(plain_model, self.step)
        self._step(self.plain)
        # Both models drop every gradient, those of parameters outside the optimizers too.
        plain_model.zero_grad()
        if refused:
            self._level_forward_side_effects()
        self.step += 2

    @precondition(lambda self: not self.pending)
    @rule(recompute=st.sampled_from(["reentrant", "non_reentrant", "save_on_cpu"]))
    def train_checkpointed(self, recompute: str) -> None:
        """A step under activation checkpointing of every layer (reentrant: one backward, one
        pass; non-reentrant: saved-tensor hooks, recomputed in backward), or with the saved
        tensors kept through ``save_on_cpu``'s hooks."""
        ours_model, plain_model = self.models
        for model, optim in ((ours_model, self.ours), (plain_model, self.plain)):
            forward = model.forward

            def checkpointed(x, model=model):
                h = model.inp(x)
                for layer in model.layers:
                    h = checkpoint(layer, h, use_reentrant=recompute == "reentrant")
                return model.head(h)

            def offloaded(x, forward=forward):
                with torch.autograd.graph.save_on_cpu():
                    return forward(x)

            model.forward = offloaded if recompute == "save_on_cpu" else checkpointed
            try:
                self._backward(model, self.step)
            finally:
                model.forward = forward
            self._step(optim)
            optim.zero_grad()
        self.step += 1

    def _plain_holds(self, which: str) -> bool:
        """Whether ``which`` (``"any"``/``"all"``) trainable parameter of the plain optimizer
        holds a gradient: those ours stepped in backward, and holds freed gradients for."""
        holds = [
            p.grad is not None
            for g in self.plain.param_groups
            for p in g["params"]
            if p.requires_grad
        ]
        return any(holds) if which == "any" else bool(holds) and all(holds)

    @precondition(lambda self: not self.pending)
    @rule()
    def clip_model_parameters(self) -> None:
        """``clip_grad_norm_(model.parameters())`` between backward and step (at an infinite
        max_norm, which leaves the plain loop's gradients as they are): refused for ours at
        the read, naming max_grad_norm; both loops then step as usual."""
        ours_model, plain_model = self.models
        self._backward(plain_model, self.step)
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), math.inf)
        self._backward(ours_model, self.step)
        if self._plain_holds("any"):
            with pytest.raises(RuntimeError, match=r"max_grad_norm="):
                torch.nn.utils.clip_grad_norm_(ours_model.parameters(), math.inf)
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending)
    @rule()
    def module_keeps_zeros(self) -> None:
        """A step, then the module's ``zero_grad(set_to_none=False)``: refused for ours at the
        call, nothing moved; both loops then drop the gradients (``set_to_none=True``)."""
        ours_model, plain_model = self.models
        for model, optim in ((plain_model, self.plain), (ours_model, self.ours)):
            self._backward(model, self.step)
            self._step(optim)
        if self._plain_holds("any"):
            with pytest.raises(RuntimeError, match=r"set_to_none=False"):
                ours_model.zero_grad(set_to_none=False)
        for model in self.models:
            model.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending)
    @rule()
    def load_between_backward_and_step(self) -> None:
        """A checkpoint loaded between backward and ``step()`` (a rollback): ``step()`` refused
        for ours once the optimizer's state was loaded; loading the model too and zeroing
        rolls both loops back alike."""
        saved = [
            (copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict()))
            for model, optim in zip(self.models, (self.ours, self.plain), strict=True)
        ]
        ours_model, plain_model = self.models
        self._backward(plain_model, self.step)
        self._backward(ours_model, self.step)
        self.ours.load_state_dict(saved[0][1])
        if self._plain_holds("any"):
            with pytest.raises(RuntimeError, match=r"optimizer state was loaded while"):
                self.ours.step()
        for model, optim, (model_state, optim_state) in zip(
            self.models, (self.ours, self.plain), saved, strict=True
        ):
            model.load_state_dict(model_state)
            optim.load_state_dict(optim_state)
            optim.zero_grad()
            model.zero_grad()

    @precondition(lambda self: not self.pending)
    @rule(lr=st.sampled_from([1e-3, 3e-2]))
    def set_lr_between_backward_and_step(self, lr: float) -> None:
        """The LR set between backward and ``step()``: refused for ours; the loop sets it back,
        steps (as the plain one at the old LR), then sets it for the next step."""
        ours_model, plain_model = self.models
        self._backward(plain_model, self.step)
        self._backward(ours_model, self.step)
        old = [g["lr"] for g in self.ours.param_groups]
        for group in self.ours.param_groups:
            group["lr"] = lr
        # Refused where a group's LR changed and it holds an update made in backward (its
        # plain counterpart holds a gradient).
        stepped = [any(q.grad is not None for q in g["params"]) for g in self.plain.param_groups]
        if any(o != lr and s for o, s in zip(old, stepped, strict=True)):
            with pytest.raises(RuntimeError, match=r"was changed between backward and step"):
                self.ours.step()
        for group, value in zip(self.ours.param_groups, old, strict=True):
            group["lr"] = value
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
            for group in optim.param_groups:
                group["lr"] = lr
        self.step += 1

    @precondition(lambda self: not self.pending)
    @rule()
    def step_twice(self) -> None:
        """A second ``step()`` on one backward's gradients: refused for ours (the plain
        optimizer would step them again); both loops then zero and go on."""
        ours_model, plain_model = self.models
        for model, optim in ((plain_model, self.plain), (ours_model, self.ours)):
            self._backward(model, self.step)
            self._step(optim)
        if self._plain_holds("any"):
            with pytest.raises(RuntimeError, match=r"step\(\) called again with no backward"):
                self.ours.step()
        for optim in (self.ours, self.plain):
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule(layer=st.sampled_from([None, *range(LAYERS)]))
    def forget_zero_grad(self, layer: int | None) -> None:
        """A step with no ``zero_grad()`` after it, then a backward of the whole model or, as
        an actor's loss after a critic's step, of one layer only (``backward(inputs=...)``):
        the plain loop would add the next backward's gradients to the kept ones, and step the
        kept ones the backward does not reach a second time; ours refuses that backward
        before anything moves, wherever a parameter holds a gradient it stepped and freed
        (not where a parameter holds the zeros ``zero_grad(set_to_none=False)`` kept, which
        it steps as the plain one). Both loops then zero and go on."""
        ours_model, plain_model = self.models
        for model, optim in ((plain_model, self.plain), (ours_model, self.ours)):
            self._backward(model, self.step)
            self._step(optim)
        refused = any(is_freed(p.grad) for group in self.ours.param_groups for p in group["params"])
        if refused:
            before = _parameters(ours_model)
            part = [] if layer is None else ours_model.layers[layer].parameters()
            inputs = [p for p in part if p.requires_grad] or None
            with pytest.raises(RuntimeError, match=r"never dropped|an earlier step\(\) commit"):
                self._loss(ours_model, self.step + 1).backward(inputs=inputs)
            _assert_unchanged(ours_model, before)
        for model, optim in ((ours_model, self.ours), (plain_model, self.plain)):
            optim.zero_grad()
            model.zero_grad()
        if refused:
            self._level_forward_side_effects()
        self.step += 2

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule()
    def evaluate_between_backward_and_step(self) -> None:
        """An evaluation forward between backward and ``step()``: the plain loop's reads the
        weights of before ``step()``. Ours is refused where it holds updates made in backward,
        before the forward runs and with nothing moved; where it made none (every bucket held
        for ``step()``), it reads the same weights: the same loss. Both loops then step and
        zero. (On FSDP2, units still holding the copy gathered before their update are read as
        plain: ``tests/test_forward_before_step.py``.)"""
        ours_model, plain_model = self.models
        self._backward(plain_model, self.step)
        self._backward(ours_model, self.step)
        refused = bool(self.ours._pending)
        with torch.no_grad():
            plain_loss = self._loss(plain_model, self.step + 100)
            if refused:
                before = _parameters(ours_model)
                with pytest.raises(RuntimeError, match=r"with no optimizer\.step\(\) since"):
                    self._loss(ours_model, self.step + 100)
                _assert_unchanged(ours_model, before)
            else:
                ours_loss = self._loss(ours_model, self.step + 100)
                torch.testing.assert_close(ours_loss, plain_loss, rtol=1e-5, atol=1e-6)
        # An export of the weights there: refused as that forward is, or the plain loop's.
        with _export_of(ours_model) as export:
            if refused:
                with pytest.raises(RuntimeError, match=r"with no optimizer\.step\(\) since"):
                    export()
                _assert_unchanged(ours_model, before)
            else:
                plain_state = plain_model.state_dict()
                for name, value in export().items():
                    _assert_close(value, plain_state[name], name)
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
        if refused:
            self._level_forward_side_effects()
        self.step += 1

    @precondition(lambda self: not self.pending)
    @rule(kind=st.sampled_from(SNAPSHOTS))
    def snapshot_between_backward_and_step(self, kind: str) -> None:
        """``state_dict()``, a deep copy or a pickle of the optimizer between backward and
        ``step()``: refused for ours (the plain one's would hold the state before this step's
        update), nothing moved. Both loops then step and zero, and the same snapshot of each
        is equal."""
        ours_model, plain_model = self.models
        self._backward(plain_model, self.step)
        self._backward(ours_model, self.step)
        if self._plain_holds("any"):
            before = _parameters(ours_model)
            with pytest.raises(RuntimeError, match=r"await step\(\)"):
                _take(self.ours, kind)
            _assert_unchanged(ours_model, before)
        snapshots = []
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
            snapshots.append(_state_dict_of(_take(optim, kind)))
        _assert_same_state_dicts(*snapshots)
        self.step += 1

    @precondition(lambda self: self.pending)
    @rule(kind=st.sampled_from(SNAPSHOTS), load=st.booleans())
    def snapshot_under_accumulate(self, kind: str, load: bool) -> None:
        """Under ``accumulate()`` no update was made: ``state_dict()``, a deep copy and a pickle
        of ours are allowed and equal to the plain optimizer's; with ``load`` each optimizer
        then loads its snapshot's state dict, the accumulated gradients still to step. No deep
        copy on FSDP2: torch cannot deep-copy a DTensor parameter holding a gradient (the
        plain optimizer's neither)."""
        if kind == "deepcopy" and self.sharded:
            return
        states = [_state_dict_of(_take(optim, kind)) for optim in (self.ours, self.plain)]
        _assert_same_state_dicts(*states)
        if load:
            for optim, state in zip((self.ours, self.plain), states, strict=True):
                optim.load_state_dict(copy.deepcopy(state))

    @precondition(lambda self: not self.pending)
    @rule(clear=st.booleans())
    def dcp_round_trip(self, clear: bool) -> None:
        """A checkpoint through DCP, as torchtitan writes one: ``get_state_dict`` (with its
        zero step where an optimizer holds no state: ``clear`` empties both first),
        ``dcp.save``, then ``dcp.load`` and ``set_state_dict`` into the same model and
        optimizer, not strict (a trainable parameter never stepped has no state to load, in
        both loops)."""
        first = not self.sharded or dist.get_rank() == 0
        directory = [tempfile.mkdtemp(prefix="loop-dcp-") if first else None]
        if self.sharded:
            dist.broadcast_object_list(directory, src=0)
        options = StateDictOptions(strict=False)
        pairs = zip(self.models, (self.ours, self.plain), strict=True)
        for index, (model, optim) in enumerate(pairs):
            if clear:
                optim.state.clear()
            path = os.path.join(directory[0], str(index))
            model_state, optim_state = get_state_dict(model, optim)
            saved = {"model": model_state, "optim": optim_state}
            dcp.save(saved, checkpoint_id=path, no_dist=not self.sharded)
            model_state, optim_state = get_state_dict(model, optim)
            loaded = {"model": model_state, "optim": optim_state}
            dcp.load(loaded, checkpoint_id=path, no_dist=not self.sharded)
            set_state_dict(
                model,
                optim,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
                options=options,
            )
        if self.sharded:
            dist.barrier()
        if first:
            shutil.rmtree(directory[0])

    @precondition(lambda self: not self.pending)
    @rule()
    def state_dict_round_trip(self) -> None:
        """Each optimizer loads (a copy of) its own state dict."""
        for optim in (self.ours, self.plain):
            optim.load_state_dict(copy.deepcopy(optim.state_dict()))

    @precondition(lambda self: not self.pending)
    @rule()
    def restart(self) -> None:
        """A resumed run: new optimizers on the same groups, each loading its predecessor's
        state dict (ours once the old one is detached, as a restarted process holds none);
        the schedulers are not rebuilt (the groups' lr is in the state dicts)."""
        saved = [copy.deepcopy(optim.state_dict()) for optim in (self.ours, self.plain)]
        groups = [
            [{"params": list(group["params"])} for group in optim.param_groups]
            for optim in (self.ours, self.plain)
        ]
        self.ours.detach()
        self.ours, self.plain = self._optimizers(*groups)
        for optim, state_dict in zip((self.ours, self.plain), saved, strict=True):
            optim.load_state_dict(state_dict)
        self.schedulers = ()

    @precondition(lambda self: not self.pending)
    @rule(then=st.sampled_from(["step", "load", "evaluate"]))
    def leave_after_backward(self, then: str) -> None:
        """A phase ended after a backward with no ``step()`` (its step budget checked after
        backward): ours detached and a new ``OptimizerInBackward`` built for the next phase,
        which is refused wherever that backward moved a weight (the plain loop would drop its
        gradients). Then the phase is ended as it should be: ``"step"``, the old optimizer's
        ``step()`` (detached, it commits the update), attached again, and the plain loop's
        ``step()``; or ``"load"``, the weights of before that backward loaded (the plain loop
        needs no load: its backward moved nothing) and the next phase given new optimizers on
        both sides, whose ``zero_grad()`` drops that backward's gradients (a parameter outside
        the optimizers keeps its own, in both loops); or ``"evaluate"``, the old optimizer
        collected, then an evaluation, refused wherever that backward's updates stand (the
        plain loop's reads the weights of before it), before the load and the new phase."""
        ours_model, plain_model = self.models
        held = [p for group in self.ours.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in held]  # the sharded ones, after an evaluation too
        saved = copy.deepcopy(ours_model.state_dict())
        self._backward(ours_model, self.step)
        moved = torch.tensor(float(any(map(_differ, (p.detach() for p in held), before))))
        if self.sharded:
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        self.ours.detach()
        groups = [
            [{"params": list(group["params"])} for group in optim.param_groups]
            for optim in (self.ours, self.plain)
        ]
        try:
            new = self._optimizers(*groups)
        except ValueError as error:
            assert "no step() committed" in str(error), error
        else:
            assert not moved, "a new optimizer built over weights an uncommitted update moved"
            new[0].detach()
        self._backward(plain_model, self.step)
        self.step += 1
        if then == "evaluate":
            self.ours, self.schedulers = None, ()  # type: ignore[assignment]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the collected optimizer's
                gc.collect()
            before = _parameters(ours_model)
            ours_model.eval()
            try:
                with torch.no_grad():
                    self._loss(ours_model, self.step + 100)
            except RuntimeError as error:
                assert "no step() committed" in str(error), error
                _assert_unchanged(ours_model, before)
            else:
                assert not moved, "an evaluation of weights an uncommitted update moved"
            ours_model.train()
            with _export_of(ours_model) as export:  # refused as that evaluation is
                try:
                    export()
                except RuntimeError as error:
                    assert "no step() committed" in str(error), error
                    _assert_unchanged(ours_model, before)
                else:
                    assert not moved, "an export of weights an uncommitted update moved"
        if then in ("load", "evaluate"):
            ours_model.load_state_dict(saved)
            self.ours, self.plain = self._optimizers(*groups)
            self.schedulers = ()
            for optim in (self.ours, self.plain):
                optim.zero_grad()
            return
        self._step(self.ours)
        self.ours.attach()
        self.ours.zero_grad()
        self._step(self.plain)
        self.plain.zero_grad()

    @precondition(lambda self: not self.pending)
    @rule()
    def clear_state(self) -> None:
        """``optim.state.clear()``: the next step creates the state afresh (ours in backward's
        order, listed in the plain optimizer's)."""
        for optim in (self.ours, self.plain):
            optim.state.clear()

    @precondition(lambda self: not self.pending)
    @rule(
        layer=st.integers(0, LAYERS - 1),
        how=st.sampled_from(["del", "replace", "clear", "zero"]),
    )
    def reset_layer_state(self, layer: int, how: str) -> None:
        """One layer's optimizer state reset between steps, as a loop re-initialising a layer
        does: its entries deleted, replaced by empty ones (``optim.state[p] = {}``) or emptied
        in place, or their floating-point values but the step zeroed in place."""
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            for param in model.layers[layer].parameters():
                if param not in optim.state:
                    continue
                if how == "del":
                    del optim.state[param]
                elif how == "replace":
                    optim.state[param] = {}
                elif how == "clear":
                    optim.state[param].clear()
                else:
                    for key, value in optim.state[param].items():
                        if key != "step" and _is_float_tensor(value):
                            value.zero_()

    @rule(layer=st.integers(0, LAYERS - 1))
    def rescale_layer(self, layer: int) -> None:
        """A layer's weights rewritten in place between steps (under ``accumulate()`` too),
        as a loop re-initialising or shrinking a layer does under ``torch.no_grad()``. The
        next update steps the new values."""
        for model in self.models:
            with torch.no_grad():
                for param in model.layers[layer].parameters():
                    param.mul_(0.5)

    @precondition(lambda self: not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1))
    def rescale_layer_through_data(self, layer: int) -> None:
        """The same through ``.data =`` (new storage, new values), on a plain module: on an
        FSDP2 parameter (a DTensor) the assignment leaves its local shard as it was, in the
        plain loop as in ours (torch 2.13)."""
        for model in self.models:
            for param in model.layers[layer].parameters():
                param.data = param.data * 0.5

    @precondition(lambda self: not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1), amount=st.sampled_from([0.25, 0.5]))
    def prune_weights(self, layer: int, amount: float) -> None:
        """Magnitude pruning between steps (under ``accumulate()`` too), as
        ``torch.nn.utils.prune`` applies it: the layer's weight renamed ``weight_orig`` (the
        same parameter) and masked by a forward pre-hook; pruned again, the masks compose; a
        third time, the pruning is made permanent (``prune.remove``: the masked values
        assigned to the parameter through ``.data =``). Both loops step the masked entries
        under weight decay and momentum alike."""
        for model in self.models:
            module = model.layers[layer].up
            hooks = module._forward_pre_hooks.values()
            if any(isinstance(hook, prune.PruningContainer) for hook in hooks):
                prune.remove(module, "weight")
            else:
                prune.l1_unstructured(module, "weight", amount=amount)

    @precondition(lambda self: not self.pending)
    @rule(trainable=st.booleans())
    def set_head_requires_grad(self, trainable: bool) -> None:
        """The head frozen or unfrozen, before or after it is added as a group. Frozen, it
        drops the gradient it may hold (accumulated outside the optimizers): ours refuses a
        frozen parameter holding one at ``step()``, see :meth:`hand_set_grad`. After an
        evaluation on FSDP2 the root unit is resharded first, as ours says when it refuses:
        else the flag and ``.grad = None`` reach only the all-gathered copies, and the sharded
        head keeps its gradient, which the plain ``step()`` steps and ours refuses at the next
        backward (``_frozen_after_evaluation_body`` in ``test_fsdp2_controls_dist.py``)."""
        for model in self.models:
            if self._sharded(model) and not isinstance(model.head.weight, DTensor):
                model.reshard()
            model.head.requires_grad_(trainable)
            if not trainable:
                for param in model.head.parameters():
                    param.grad = None

    @precondition(lambda self: not self.pending)
    @rule()
    def scheduler_step(self) -> None:
        """A ``StepLR`` (built at its first use, on the groups there are then) stepped
        between steps: it halves each group's LR every second call."""
        if not self.schedulers:
            self.schedulers = tuple(
                torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
                for optim in (self.ours, self.plain)
            )
        with warnings.catch_warnings():
            # Given alike for both where no step() ran since the scheduler was built.
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            for scheduler in self.schedulers:
                scheduler.step()

    @precondition(lambda self: not self.pending and self.second_pass_refused and not self.sharded)
    @rule(split=st.integers(1, LAYERS - 1))
    def disjoint_backwards(self, split: int) -> None:
        """Two losses, both forwards first, then ``loss1.backward(inputs=A)`` and
        ``loss2.backward(inputs=B)`` before one ``step()`` (an actor and a critic), ``A`` the
        trainable parameters of the first ``split`` layers, ``B`` those of the others: the
        plain loop steps all their gradients at once. Ours refuses the second backward before
        it moves anything: this library (autograd never reaches ``A``'s layers in it), or,
        with a class stepped jointly, autograd's version check first (the joint step of the
        first moved the version counters of ``B``'s parameters too, left as they were). The
        loop drops the gradients the second wrote; both loops step the first. Not on FSDP2:
        its forward reads the unsharded parameters, so ``backward(inputs=...)`` given the
        sharded ones reaches none of them, in the plain loop too."""
        ours_model, plain_model = self.models

        def parts(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
            a, b = [], []
            for index, layer in enumerate(model.layers):
                trainable = [p for p in layer.parameters() if p.requires_grad]
                (a if index < split else b).extend(trainable)
            return a, b

        a, b = parts(ours_model)
        if not a or not b:
            return
        first = self._loss(ours_model, self.step)
        second = self._loss(ours_model, self.step + 1)
        first.backward(inputs=a)
        before = _parameters(ours_model)
        with pytest.raises(RuntimeError, match=r"a second backward|modified by an inplace"):
            second.backward(inputs=b)
        _assert_unchanged(ours_model, before)
        del first, second
        for param in b:
            param.grad = None
        a, _ = parts(plain_model)
        self._loss(plain_model, self.step).backward(inputs=a)
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            self._step(optim)
            optim.zero_grad()
            model.zero_grad()
        self.step += 2

    @precondition(lambda self: not self.pending)
    @rule(layer=st.integers(0, LAYERS - 1), trainable=st.booleans(), with_backward=st.booleans())
    def hand_set_grad(self, layer: int, trainable: bool, with_backward: bool) -> None:
        """Gradients set by hand on a layer before ``step()``, after a backward that did not
        reach it (``with_backward``) or none: the plain optimizer steps them, with the
        backward's. Ours steps them at ``step()`` too, or refuses that ``step()`` before it
        moves anything: where the layer is frozen (this optimizer steps trainable parameters
        only), and after a backward where a second pass is refused. The loop then drops them
        and steps again; the plain loop never sets them. The layer is first frozen or
        unfrozen (``trainable``). After an evaluation on FSDP2 the units are resharded first
        (the root, or every unit kept unsharded after forward): else the flag and the
        gradients reach only their all-gathered copies, and neither loop steps them."""
        ours_model, plain_model = self.models
        for model in self.models:
            if self._sharded(model):
                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
            model.layers[layer].requires_grad_(trainable)
        grads = [
            0.1 * torch.cos(3 * p.detach() + self.step)
            for p in plain_model.layers[layer].parameters()
        ]
        if not trainable:
            refusal = r"is frozen \(requires_grad=False\) but holds a gradient"
        elif with_backward and self.second_pass_refused:
            refusal = r"a second backward \(or a step\(\) stepping gradients set by hand\)"
        else:
            refusal = None

        def set_grads(model: nn.Module) -> None:
            for param, grad in zip(model.layers[layer].parameters(), grads, strict=True):
                if isinstance(param, DTensor) and not isinstance(grad, DTensor):
                    grad = distribute_tensor(grad, param.device_mesh, param.placements)
                param.grad = grad.clone()

        if with_backward:
            with bypassed(ours_model.layers[layer]):
                self._backward(ours_model, self.step)
        set_grads(ours_model)
        if refusal is not None:
            before = _parameters(ours_model)
            with pytest.raises(RuntimeError, match=refusal):
                self._step(self.ours)
            _assert_unchanged(ours_model, before)
            for param in ours_model.layers[layer].parameters():
                param.grad = None
        self._step(self.ours)
        self.ours.zero_grad()
        if with_backward:
            with bypassed(plain_model.layers[layer]):
                self._backward(plain_model, self.step)
        if refusal is None:
            set_grads(plain_model)
        self._step(self.plain)
        self.plain.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending)
    @rule(
        then=st.sampled_from(["backward", "bypassed", "no_backward", "accumulated", "hand_set"]),
        layer=st.integers(0, LAYERS - 1),
    )
    def keep_zeros(self, then: str, layer: int) -> None:
        """A step, then ``optim.zero_grad(set_to_none=False)``: the plain optimizer keeps
        zero gradients and steps them with whatever comes next, the next step's backward
        (``layer`` bypassed by it: its zeros alone), ``step()`` with no backward, a backward
        under ``accumulate()`` then ``step()``, or gradients set by hand on ``layer`` then
        ``step()``. Both loops then drop every gradient."""
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            self._backward(model, self.step)
            self._step(optim)
            optim.zero_grad(set_to_none=False)
            if then in ("backward", "bypassed"):
                with bypassed(model.layers[layer]) if then == "bypassed" else nullcontext():
                    self._backward(model, self.step + 1)
            elif then == "accumulated":
                with accumulate_grads(optim):
                    self._backward(model, self.step + 1)
            elif then == "hand_set":  # on a trainable layer: see hand_set_grad for a frozen one
                for param in model.layers[layer].parameters():
                    if param.requires_grad:
                        param.grad = 0.1 * torch.cos(3 * param.detach() + self.step)
            self._step(optim)
            optim.zero_grad()
            model.zero_grad()
        self.step += 2

    @precondition(lambda self: self.skip_nonfinite and not self.pending)
    @rule()
    def nonfinite_batch(self) -> None:
        """A NaN batch: ours skips every bucket, the plain loop the whole step. Both models then
        drop every gradient, the head's too (outside the optimizers until added)."""
        for model, optim in zip(self.models, (self.ours, self.plain), strict=True):
            self._backward(model, self.step, scale=math.nan)
            self._step(optim)
            optim.zero_grad()
            model.zero_grad()
        self.step += 1

    @invariant()
    def same_norms(self) -> None:
        """The norms both loops measured at their last steps (bfloat16 gradients: ours sums
        in float32 and returns a float32 norm, ``clip_grad_norm_`` rounds each tensor's norm
        to bfloat16)."""
        if not hasattr(self, "norms"):
            return
        ours, plain = self.norms.pop("ours", None), self.norms.pop("plain", None)
        if ours is None or plain is None:
            return
        if not (torch.isfinite(ours) and torch.isfinite(plain)):
            assert not (torch.isfinite(ours) or torch.isfinite(plain)), (ours, plain)
            return
        tolerance = 1e-2 if self.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(ours.float(), plain.float(), rtol=tolerance, atol=1e-6)

    @invariant()
    def same_parameters(self) -> None:
        if hasattr(self, "models"):
            _assert_same_parameters(*self.models)

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "models") and not self.pending:
            _assert_same_state(self.ours, self.plain)


class ShardedLoopMachine(LoopMachine):
    sharded = True


class ClippedLoopMachine(LoopMachine):
    """The same loops clipped by norm, the plain module one bucket (the default when
    clipping): each step clipped by exactly ``clip_grad_norm_``'s coefficient, also after the
    trainable set changed."""

    max_grad_norm = 0.05
    bucket_numel = None
    second_pass_refused = True


class SkipNonfiniteLoopMachine(LoopMachine):
    """The same loops skipping non-finite gradients, with NaN batches."""

    skip_nonfinite = True


class ClippedSkipNonfiniteLoopMachine(ClippedLoopMachine):
    """The clipped loops skipping non-finite gradients, with NaN batches: a skipped step clips
    nothing, and the next one is clipped as the plain loop's."""

    skip_nonfinite = True


class GroupCounterLoopMachine(LoopMachine):
    """The same loops with a class that counts steps in its param groups (timm's Lamb),
    declared to step bucket by bucket: its group state tracked across buckets."""

    optimizer_cls = GroupStepLamb
    optimizer_kwargs: ClassVar[dict] = {"lr": 1e-2}
    stepping = "dtensor"
    second_pass_refused = True


class ClippedGroupCounterSkipNonfiniteLoopMachine(GroupCounterLoopMachine):
    """The class counting steps in its groups, clipped (one bucket), with NaN batches: a step
    every bucket of which is skipped is skipped whole, as the plain loop's (no ``step()``),
    and counts nothing; a backward that raised before its bucket completed, dropped with
    ``zero_grad()``, is no step, and the next ``step()`` counts one."""

    max_grad_norm = 0.05
    bucket_numel = None
    skip_nonfinite = True


class InstanceCounterLoopMachine(LoopMachine):
    """The same loops with a class counting steps on itself (``self.t += 1``, in no state
    dict), declared to step bucket by bucket: a rolled-back backward must leave it as the
    plain optimizer's, which never ran that step."""

    optimizer_cls = InstanceCountSGD
    optimizer_kwargs: ClassVar[dict] = {"lr": 0.05}
    stepping = "dtensor"
    second_pass_refused = True


class JointLoopMachine(LoopMachine):
    """The same loops with an undeclared class clipping by the norm of all its gradients
    inside ``step()``: stepped jointly, once per backward."""

    optimizer_cls = GlobalClipSGD
    optimizer_kwargs: ClassVar[dict] = {"lr": 0.05}
    second_pass_refused = True


class CompactLoopMachine(LoopMachine):
    """The same loops with CompactAdamW (its C kernel on the CPU, its tables reused from step
    to step while the parameters and state they point to stay the same)."""

    optimizer_cls = CompactAdamW
    optimizer_kwargs: ClassVar[dict] = ADAMW


class BFloat16LoopMachine(LoopMachine):
    """The same loops on models held in bfloat16: AdamW rounds every op of its update to
    bfloat16, in backward as in the plain loop."""

    dtype = torch.bfloat16


class ShardedBFloat16LoopMachine(ShardedLoopMachine):
    """bfloat16 models sharded by FSDP2: each rank's shards rounded as the plain optimizer's."""

    dtype = torch.bfloat16


class CompactBFloat16LoopMachine(CompactLoopMachine):
    """CompactAdamW on bfloat16 weights (with their 8-bit error), as it is meant to run."""

    dtype = torch.bfloat16


class CompactClippedSkipNonfiniteLoopMachine(CompactBFloat16LoopMachine):
    """CompactAdamW on bfloat16 weights, clipped by norm (one bucket), with NaN batches: a
    skipped step moves no weight, code or scale, and the next one is clipped as the plain
    loop's."""

    max_grad_norm = 0.05
    bucket_numel = None
    skip_nonfinite = True
    second_pass_refused = True


class ShardedCompactBFloat16LoopMachine(CompactBFloat16LoopMachine):
    """CompactAdamW on bfloat16 weights sharded by FSDP2: each rank steps its local rows, in
    backward unit by unit, as the same class steps the sharded model after backward."""

    sharded = True


class ShardedSkipNonfiniteLoopMachine(ShardedLoopMachine):
    """NaN batches on FSDP2: ours agrees across ranks to skip a unit, the plain loop skips the
    step where any rank holds a non-finite gradient (on 4 ranks the toy model's shards on the
    last rank are all empty: it holds none of a NaN batch's NaNs)."""

    skip_nonfinite = True


class ShardedGroupCounterLoopMachine(GroupCounterLoopMachine):
    """The class counting steps in its groups, stepped unit by unit on FSDP2's DTensors."""

    sharded = True


class ShardedKeptAfterForwardLoopMachine(ShardedLoopMachine):
    """Every unit kept unsharded after forward (``reshard_after_forward=False``, ZeRO-2's
    layout): the modules list FSDP2's all-gathered copies from each forward to the end of
    its backward (and after an evaluation, to the next backward)."""

    fsdp_kwargs: ClassVar[dict] = {"reshard_after_forward": False}


def _columns_where_even(param: torch.Tensor) -> Shard:
    """FSDP2's placement of ``param``: its columns (``Shard(1)``) for a matrix whose columns
    divide evenly over the ranks (FSDP2 refuses uneven dim-1 shards), else its rows."""
    return Shard(1) if param.ndim == 2 and param.size(1) % dist.get_world_size() == 0 else Shard(0)


class ShardedColumnsLoopMachine(ShardedLoopMachine):
    """Matrices sharded by columns where they divide evenly (``shard_placement_fn``, as
    torchtitan shards experts), beside others sharded by rows: each rank steps its local
    shards, whatever the placement, as the plain optimizer steps the DTensors."""

    fsdp_kwargs: ClassVar[dict] = {"shard_placement_fn": _columns_where_even}


class ShardedJointLoopMachine(JointLoopMachine):
    """The class clipping by the norm of all its gradients, stepped jointly on FSDP2's
    DTensors at the end of backward."""

    sharded = True


class ShardedClippedJointLoopMachine(ShardedJointLoopMachine):
    """The class stepped jointly on FSDP2's units, clipped by norm, with NaN batches: every
    bucket is held to the end of backward, and clipped by exactly ``clip_grad_norm_``'s
    coefficient and skipped together there, as the plain loop clips and skips its step (see
    [Note: held buckets clipped together])."""

    max_grad_norm = 0.05
    skip_nonfinite = True


class ShardedOutOfPlaceLoopMachine(ShardedLoopMachine):
    """A class of one's own declared ``"elementwise"``, written as hand-written optimizers
    often are (state values replaced out of place, a Python count, tensors in a list, a value
    added at a later step), on FSDP2: its state must reach the optimizer's placed like the
    parameter, as the plain optimizer holds it, and resume from a state dict."""

    optimizer_cls = OutOfPlaceMomentum
    optimizer_kwargs: ClassVar[dict] = {"lr": 1e-2}


class ShardedAdafactorLoopMachine(ShardedLoopMachine):
    """Adafactor on FSDP2, stepped whole-tensor (each parameter's update on an owner rank, its
    rows sent back), against plain Adafactor on an unsharded copy of the model fed the global
    batch: plain Adafactor cannot step DTensors. On 2 ranks (the batch splits evenly, so the
    ranks' mean loss is the global one)."""

    optimizer_cls = torch.optim.Adafactor
    optimizer_kwargs: ClassVar[dict] = {"lr": 1e-2}
    reference_sharded = False


def _run(machine: type[RuleBasedStateMachine], examples: int, steps: int) -> None:
    # One intra-op thread: on tensors this small, handing ops to a thread pool costs more than
    # the ops (several times the whole run on a busy machine); the ranks of a world run so.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        torch.set_num_threads(threads)


def test_random_loops_plain_module():
    _run(LoopMachine, examples=25, steps=15)


def test_random_loops_clipped():
    _run(ClippedLoopMachine, examples=15, steps=15)


def test_random_loops_group_counter():
    _run(GroupCounterLoopMachine, examples=6, steps=10)


def test_random_loops_skip_nonfinite():
    _run(SkipNonfiniteLoopMachine, examples=8, steps=15)


def test_random_loops_clipped_skip_nonfinite():
    _run(ClippedSkipNonfiniteLoopMachine, examples=8, steps=15)


def test_random_loops_clipped_group_counter_skip_nonfinite():
    _run(ClippedGroupCounterSkipNonfiniteLoopMachine, examples=8, steps=12)


def test_random_loops_instance_counter():
    _run(InstanceCounterLoopMachine, examples=8, steps=12)


def test_random_loops_joint():
    _run(JointLoopMachine, examples=6, steps=10)


def test_random_loops_compact_adamw():
    _run(CompactLoopMachine, examples=8, steps=12)


def test_random_loops_bfloat16_parameters():
    _run(BFloat16LoopMachine, examples=6, steps=10)


def test_random_loops_compact_adamw_bfloat16():
    _run(CompactBFloat16LoopMachine, examples=6, steps=10)


def test_random_loops_compact_adamw_clipped_skip_nonfinite():
    _run(CompactClippedSkipNonfiniteLoopMachine, examples=6, steps=12)


@pytest.mark.parametrize(
    ("machine", "world", "examples", "steps"),
    [
        (ShardedLoopMachine, 2, 6, 30),
        (ShardedCompactBFloat16LoopMachine, 2, 6, 16),
        (ShardedBFloat16LoopMachine, 2, 4, 16),
        (ShardedSkipNonfiniteLoopMachine, 4, 4, 16),
        (ShardedGroupCounterLoopMachine, 3, 4, 12),
        (ShardedJointLoopMachine, 3, 4, 12),
        (ShardedClippedJointLoopMachine, 2, 4, 12),
        (ShardedKeptAfterForwardLoopMachine, 3, 4, 16),
        (ShardedColumnsLoopMachine, 2, 4, 16),
        (ShardedAdafactorLoopMachine, 2, 6, 20),
        (ShardedOutOfPlaceLoopMachine, 2, 6, 16),
    ],
    ids=[
        "adamw",
        "compact-adamw",
        "bfloat16",
        "skip-nonfinite-empty-shards",
        "group-counter",
        "joint",
        "clipped-joint-skip-nonfinite",
        "kept-after-forward",
        "columns",
        "adafactor-whole-tensor",
        "out-of-place-class",
    ],
)
def test_random_loops_fsdp2(worlds, machine, world, examples, steps):
    worlds.run(world, _run, machine=machine, examples=examples, steps=steps)


@pytest.mark.parametrize(
    "machine,sequence",
    [
        (LoopMachine, [("train", {}), ("hand_set_grad", {"layer": 1, "trainable": True})]),
        (
            LoopMachine,
            [
                ("train", {}),
                ("hand_set_grad", {"layer": 1, "trainable": True, "with_backward": True}),
            ],
        ),
        (LoopMachine, [("train", {}), ("keep_zeros", {"then": "no_backward", "layer": 0})]),
        (LoopMachine, [("train", {}), ("step_without_backward", {})]),
        (
            ClippedLoopMachine,
            [("clip_model_parameters", {}), ("failing_backward", {"layer": 0, "new_lr": False})],
        ),
    ],
    ids=["set-by-hand", "set-by-hand-after-a-backward", "kept-zeros", "no-gradient", "held-failed"],
)
def test_loop_helper_norm_where_it_was_the_last_steps(machine, sequence):
    """The sequences in which ``fused_optim_dist.clip_grad_norm_`` returned the last step's
    norm, no error (5.41 for 5.48 with gradients set by hand; 1.57 for 0.93 after a failed
    backward that only held its buckets): each step's norm now the plain loop's, compared
    at every step (both loops measured one)."""
    state = machine()
    state.build()
    for name, kwargs in sequence:
        if name == "hand_set_grad":
            kwargs = {"with_backward": False, **kwargs}
        getattr(state, name)(**kwargs)
        assert state.norms.get("ours") is not None and state.norms.get("plain") is not None
        state.same_norms()
        state.same_parameters()


@pytest.mark.parametrize("recompute", ["non_reentrant", "save_on_cpu"])
def test_hooks_of_the_reference_model_refuse_nothing_of_ours(recompute):
    """A step under saved-tensor hooks in both loops, then gradients set by hand after a
    backward: the plain model's forward, run after ours stepped, saved its own parameters
    through the hooks, and ours refused the next step's second pass as if its parameters had
    been saved so (a refusal where both loops are equal): found by the random machines."""
    state = LoopMachine()
    state.build()
    state.train_checkpointed(recompute=recompute)
    state.hand_set_grad(layer=0, trainable=True, with_backward=True)
    state.same_norms()
    state.same_parameters()
    state.same_state()
