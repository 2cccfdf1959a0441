"""Random training loops, driven on a plain and an in-backward optimizer side by side.

A hypothesis ``RuleBasedStateMachine`` interleaves what real loops do: steps, accumulation,
freezing and unfreezing, groups added later, a backward that raises, a second backward before
``step()``, gradients read before ``step()``, kept as zeros by the module or never zeroed, an
optimizer state loaded or an LR set before ``step()``, a second ``step()`` (each refused; the
load then rolled back), reentrant activation checkpointing, ``step()`` without a backward, LR
changes (lr 0 included),
``state_dict``/``load_state_dict`` round trips; also with a class that counts steps in its
param groups, with CompactAdamW, and on bfloat16 models. After every rule
both models must hold the same parameters (1e-6) and, between steps, the same optimizer state.
It runs on one process (a plain module, many examples) and on 2 ranks with FSDP2 (fewer,
derandomised so that both ranks draw the same sequence).
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar

import pytest
import torch
from _toy import batch, loss_fn, make_models, rank_slice, shard
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
from test_never_silent import GlobalClipSGD, GroupStepLamb
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fused_optim_dist import InBackwardOptions, OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW

ADAMW = dict(lr=1e-2, weight_decay=0.1)
LAYERS = 3


class _Boom(RuntimeError):
    pass


def _steps(optim: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): float(s["step"]) for p, s in optim.state.items() if "step" in s}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """Both sides are sharded alike, so local shards compare without a collective."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        _local(actual).detach(), _local(expected).detach(), atol=1e-6, rtol=1e-5, msg=what
    )


def _assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        _assert_close(param, ref, name)


def _assert_same_state(ours: torch.optim.Optimizer, plain: torch.optim.Optimizer) -> None:
    a, b = ours.state_dict(), plain.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in b["state"].items():
        assert entry.keys() == a["state"][index].keys(), index
        for key, value in entry.items():
            _assert_close(a["state"][index][key], value, f"state {index} {key}")


class LoopMachine(RuleBasedStateMachine):
    sharded = False
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

    @initialize()
    def build(self) -> None:
        ours_model, plain_model = make_models()
        self.models: tuple[nn.Module, nn.Module] = (
            ours_model.to(self.dtype),
            plain_model.to(self.dtype),
        )
        if self.sharded:
            for model in self.models:
                shard(model)
        ours_model, plain_model = self.models
        body = [p for n, p in ours_model.named_parameters() if not n.startswith("head")]
        ref_body = [p for n, p in plain_model.named_parameters() if not n.startswith("head")]
        cls, kwargs = self.optimizer_cls, self.optimizer_kwargs
        options = InBackwardOptions(
            max_grad_norm=self.max_grad_norm, bucket_numel=self.bucket_numel, stepping=self.stepping
        )
        self.ours = OptimizerInBackward(body, cls, options=options, **kwargs)
        self.plain = cls(ref_body, **kwargs)
        self.head_added = False
        self.pending = False  # gradients accumulated, not yet stepped
        self.step = 0

    def _backward(self, model: nn.Module, step: int) -> None:
        x, y = (t.to(self.dtype) for t in batch(step))
        if self.sharded:
            x, y = rank_slice(x), rank_slice(y)
        loss_fn(model, x, y).backward()

    def _step(self, optim: torch.optim.Optimizer) -> None:
        """``optim.step()``; the plain loop clips its optimizer's gradients first."""
        if optim is self.plain and self.max_grad_norm is not None:
            params = [p for group in optim.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        optim.step()

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
    def accumulate(self) -> None:
        ours_model, plain_model = self.models
        with self.ours.accumulate():
            self._backward(ours_model, self.step)
        self._backward(plain_model, self.step)
        self.pending = True
        self.step += 1

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

    @precondition(lambda self: not self.head_added)
    @rule(lr=st.sampled_from([1e-3, 5e-2]))
    def add_head_group(self, lr: float) -> None:
        ours_model, plain_model = self.models
        self.ours.add_param_group({"params": ours_model.head.parameters(), "lr": lr})
        self.plain.add_param_group({"params": plain_model.head.parameters(), "lr": lr})
        self.head_added = True

    @rule(lr=st.sampled_from([0.0, 1e-3, 2e-2]))
    def set_lr(self, lr: float) -> None:
        for optim in (self.ours, self.plain):
            optim.param_groups[0]["lr"] = lr

    @precondition(lambda self: not self.pending)
    @rule()
    def load_state_dicts(self) -> None:
        # Ours loads the plain optimizer's state dict (interchangeable), and the reverse.
        plain_state = copy.deepcopy(self.plain.state_dict())
        self.plain.load_state_dict(copy.deepcopy(self.ours.state_dict()))
        self.ours.load_state_dict(plain_state)

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule(layer=st.integers(0, LAYERS - 1))
    def failing_backward(self, layer: int) -> None:
        """A backward that raises part-way, on both sides. Ours refuses to discard the updates
        it made (zero_grad() raises); step() accepts them, as the plain optimizer steps the
        same partial gradients (FSDP2 itself does not recover from an exception inside its
        backward)."""

        def boom(*_):
            raise _Boom("bad batch")

        for model in self.models:
            handle = model.layers[layer].register_full_backward_hook(boom)
            try:
                with pytest.raises(_Boom):
                    self._backward(model, self.step)
            finally:
                handle.remove()
        if self.ours._pending:
            with pytest.raises(RuntimeError, match="A backward raised after updating them"):
                self.ours.zero_grad()
        for optim in (self.ours, self.plain):
            self._step(optim)
            optim.zero_grad()
        self.step += 1

    @precondition(lambda self: not self.pending and not self.sharded)
    @rule()
    def second_backward(self) -> None:
        """Two backwards before step(): ours refuses the second before it moves anything; the
        loop then drops its gradients and steps once, as the plain loop that backs once."""
        ours_model, plain_model = self.models
        self._backward(ours_model, self.step)
        if self.ours._pending:
            before = [p.detach().clone() for p in ours_model.parameters()]
            with pytest.raises(RuntimeError, match=r"accumulate\(\)"):
                self._backward(ours_model, self.step + 1)
            for param, old in zip(ours_model.parameters(), before, strict=True):
                assert torch.equal(param.detach(), old)
        self._step(self.ours)
        self.ours.zero_grad()
        ours_model.zero_grad()
        self._backward(plain_model, self.step)
        self._step(self.plain)
        # Both models drop every gradient, those of parameters outside the optimizers too.
        plain_model.zero_grad()
        self.step += 2

    @precondition(lambda self: not self.pending)
    @rule()
    def train_reentrant(self) -> None:
        """A step under reentrant activation checkpointing: one backward, one pass."""
        ours_model, plain_model = self.models
        for model, optim in ((ours_model, self.ours), (plain_model, self.plain)):
            forward = model.forward

            def checkpointed(x, model=model):
                h = model.inp(x)
                for layer in model.layers:
                    h = checkpoint(layer, h, use_reentrant=True)
                return model.head(h)

            model.forward = checkpointed
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
    @rule()
    def forget_zero_grad(self) -> None:
        """A step with no ``zero_grad()`` after it: the plain loop would add the next
        backward's gradients to the kept ones; ours refuses that backward before anything
        moves (when every parameter holds a freed gradient: one without would be stepped
        first). Both loops then zero and go on."""
        ours_model, plain_model = self.models
        for model, optim in ((plain_model, self.plain), (ours_model, self.ours)):
            self._backward(model, self.step)
            self._step(optim)
        if self._plain_holds("all"):
            before = [p.detach().clone() for p in ours_model.parameters()]
            with pytest.raises(RuntimeError, match=r"never dropped"):
                self._backward(ours_model, self.step + 1)
            for param, old in zip(ours_model.parameters(), before, strict=True):
                assert torch.equal(param.detach(), old)
        for model, optim in ((ours_model, self.ours), (plain_model, self.plain)):
            optim.zero_grad()
            model.zero_grad()
        self.step += 2

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


class GroupCounterLoopMachine(LoopMachine):
    """The same loops with a class that counts steps in its param groups (timm's Lamb),
    declared to step bucket by bucket: its group state tracked across buckets."""

    optimizer_cls = GroupStepLamb
    optimizer_kwargs: ClassVar[dict] = {"lr": 1e-2}
    stepping = "dtensor"


class JointLoopMachine(LoopMachine):
    """The same loops with an undeclared class clipping by the norm of all its gradients
    inside ``step()``: stepped jointly, once per backward."""

    optimizer_cls = GlobalClipSGD
    optimizer_kwargs: ClassVar[dict] = {"lr": 0.05}


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


def _run(machine: type[RuleBasedStateMachine], examples: int, steps: int) -> None:
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


def test_random_loops_plain_module():
    _run(LoopMachine, examples=25, steps=15)


def test_random_loops_clipped():
    _run(ClippedLoopMachine, examples=15, steps=15)


def test_random_loops_group_counter():
    _run(GroupCounterLoopMachine, examples=6, steps=10)


def test_random_loops_joint():
    _run(JointLoopMachine, examples=6, steps=10)


def test_random_loops_compact_adamw():
    _run(CompactLoopMachine, examples=8, steps=12)


def test_random_loops_bfloat16_parameters():
    _run(BFloat16LoopMachine, examples=6, steps=10)


def test_random_loops_compact_adamw_bfloat16():
    _run(CompactBFloat16LoopMachine, examples=6, steps=10)


def test_random_loops_fsdp2(worlds):
    worlds.run(2, _run, machine=ShardedLoopMachine, examples=4, steps=8)


def test_random_loops_fsdp2_bfloat16(worlds):
    worlds.run(2, _run, machine=ShardedBFloat16LoopMachine, examples=3, steps=8)
