"""Hugging Face Trainer (and TRL's SFTTrainer) stepping in backward, against plain AdamW.

Every run is compared with the same Trainer run on plain AdamW: parameters at ``PARITY_ATOL``,
logged ``grad_norm`` (Trainer's ``clip_grad_norm_`` in the plain run) at ``NORM_RTOL``. Clipped
runs are compared exactly where the model is one bucket (one process, or FSDP2 with the root
as the only unit); with several FSDP units clipping is the documented per-bucket scheme, and
there the test is that a resumed run equals the uninterrupted one, clipping history included.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _frameworks import (
    NORM_RTOL,
    PARITY_ATOL,
    VOCAB,
    OneUnitLlama,
    TokenDataset,
    accelerate_on_cpu,
    full_params,
    local_params,
    max_difference,
    tiny_llama,
)
from _schedule_free import ScheduleFreeSGD
from _toy import holds_gradient
from test_never_silent import GroupStepLamb
from torch import nn

transformers = pytest.importorskip("transformers")
from fused_optim_dist import OptimizerInBackward, in_backward  # noqa: E402
from fused_optim_dist.compact_adamw import CompactAdamW  # noqa: E402
from fused_optim_dist.integrations.transformers import (  # noqa: E402
    GRADIENT_STATE_NAME,
    InBackwardTrainerMixin,
    in_backward_trainer,
)

STEPS = 4
SAVE_AT = 2
CLIP = 0.05
"""Below every gradient norm of these runs (checked), so each step is clipped."""
ONE_UNIT = {"version": 2, "auto_wrap_policy": "NO_WRAP"}
"""With ``OneUnitLlama``: FSDP2 on the root only, one bucket, so clipping in backward is exact.
(On a ``LlamaForCausalLM`` accelerate also shards the embedding and the norm and head apart.)"""
PER_LAYER = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
"""FSDP2 per decoder layer and the root: several units."""


class StepProbe(transformers.TrainerCallback):
    """Records, per optimizer step, whether the update happened in backward: before
    ``optimizer.step()`` the parameters have already changed and no gradient is held."""

    def __init__(self) -> None:
        self.in_backward: list[bool] = []
        self._before: list[torch.Tensor] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        self._before = local_params(model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        after = local_params(model)
        changed = any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True))
        no_grads = all(not holds_gradient(p) for p in model.parameters())
        self.in_backward.append(changed and no_grads)


def _args(out: Path, **overrides: Any) -> transformers.TrainingArguments:
    kwargs = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def _train(
    trainer_cls: type,
    out: Path,
    resume: str | None = None,
    one_unit: bool = False,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
    dtype: torch.dtype = torch.float32,
    model_fn: Callable[[], nn.Module] | None = None,
    **overrides: Any,
) -> dict:
    """Train a fresh tiny Llama with ``trainer_cls``, its parameters in ``dtype``; its
    parameters, norms and probe.

    ``optimizer`` builds the optimizer passed in ``optimizers=`` from the model (or the
    optimizer and its scheduler);
    ``optimizer_cls_and_kwargs`` is passed as is (a class, or Trainer's optimizer factory);
    ``model_fn``, if given, builds the model instead (``dtype`` and ``one_unit`` unused)."""
    with accelerate_on_cpu():
        probe = StepProbe()
        if model_fn is not None:
            model = model_fn()
        else:
            model = (OneUnitLlama() if one_unit else tiny_llama()).to(dtype)
        trainer = trainer_cls(
            model=model,
            args=_args(out, **overrides),
            train_dataset=TokenDataset(),
            eval_dataset=TokenDataset() if "eval_strategy" in overrides else None,
            callbacks=[probe],
            optimizers=_optimizers(None if optimizer is None else optimizer(model)),
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        trainer.train(resume_from_checkpoint=resume)
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
        optim = trainer.optimizer.optimizer  # accelerate's wrapper of the optimizer
        gradient_state = (
            optim.gradient_state_dict() if isinstance(optim, OptimizerInBackward) else None
        )
        return {
            "params": full_params(trainer.model),
            "norms": norms,
            "in_backward": probe.in_backward,
            "gradient_state": gradient_state,
            "logs": trainer.state.log_history,
        }


def _optimizers(built: Any) -> tuple[Any, Any]:
    """Trainer's ``optimizers=`` of what ``_train``'s ``optimizer`` built: an optimizer, or an
    optimizer and its scheduler."""
    return built if isinstance(built, tuple) else (built, None)


def _logged(run: dict, key: str) -> list[float]:
    return [log[key] for log in run["logs"] if key in log]


def _assert_parity(ours: dict, plain: dict, *, steps: int = STEPS) -> float:
    """Ours equals plain; every step of ours ran in backward. Returns the largest difference."""
    difference = max_difference(ours["params"], plain["params"])
    assert difference < PARITY_ATOL, difference
    assert len(ours["norms"]) == len(plain["norms"]) == steps
    torch.testing.assert_close(ours["norms"], plain["norms"], rtol=NORM_RTOL, atol=0)
    assert ours["in_backward"] == [True] * steps, ours["in_backward"]
    return difference


# ---------------------------------------------------------------------------------- 1 process


@pytest.mark.parametrize(
    ("accumulation", "clip"), [(1, 0.0), (2, 0.0), (1, CLIP)], ids=["ga1", "ga2", "ga1-clip"]
)
def test_trainer_matches_plain(tmp_path, accumulation, clip):
    kwargs = dict(gradient_accumulation_steps=accumulation, max_grad_norm=clip)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    difference = _assert_parity(ours, plain)
    if clip:
        assert min(plain["norms"]) > clip, plain["norms"]
    print(f"ga={accumulation} clip={clip}: max parameter difference {difference:.2e}")


def test_trainer_with_accumulation_and_a_tight_clip_bit_for_bit(tmp_path):
    """Accumulation 2 and ``max_grad_norm=0.01``, every step clipped: the clipping coefficient's
    last bit decides the result. docs/differences.md listed ours 1.3-1.7e-6 apart here; with
    the norm summed in Trainer's group order it is 6.0e-8 apart (measured with
    ``set_norm_order`` turned off). Taken in the model's order, as Trainer's
    ``clip_grad_norm_`` takes it: bit for bit, the logged norms too. Twelve steps, and
    CompactAdamW's run, where a last-bit change flips 8-bit codes, at 0.05."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=0.01, max_steps=12)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    assert min(plain["norms"]) > 0.01, plain["norms"]
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert ours["norms"] == plain["norms"]
    plain, ours = _compact_runs(tmp_path / "compact", **{**kwargs, "max_grad_norm": 0.05})
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert ours["norms"] == plain["norms"]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_trainer_with_gradient_checkpointing_matches_plain(tmp_path, reentrant):
    """``gradient_checkpointing=True`` (transformers' ``gradient_checkpointing_enable``: each
    decoder layer recomputed in backward, reentrant or not), with accumulation and every step
    clipped: equal to plain AdamW, norms included."""
    kwargs = dict(
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        gradient_accumulation_steps=2,
        max_grad_norm=CLIP,
    )
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    _assert_parity(ours, plain)
    assert min(plain["norms"]) > CLIP, plain["norms"]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _adamw_in_backward(model: nn.Module) -> torch.optim.Optimizer:
    return OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP
    )


def test_plain_trainer_clipping_with_an_in_backward_optimizer_refused(tmp_path):
    """Trainer without the integration, given an in-backward optimizer, with its default
    clipping: its ``clip_grad_norm_`` after backward would clip nothing (the gradients were
    stepped and freed); refused at the first step, naming the integration."""
    with pytest.raises(RuntimeError, match=r"in_backward_trainer"):
        _train(
            transformers.Trainer,
            tmp_path / "plain",
            optimizer=lambda m: OptimizerInBackward(m.parameters(), torch.optim.AdamW, lr=1e-2),
            max_grad_norm=1.0,
        )


@pytest.mark.parametrize("given", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_with_the_optimizer_given(tmp_path, given):
    """Built by the user (``optimizers=``) or from ``optimizer_cls_and_kwargs`` with
    ``in_backward(AdamW)`` (Trainer's two weight-decay groups): as plain AdamW given the same
    way, with accumulation and clipping."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    if given == "optimizers":
        plain_kwargs, ours_kwargs = dict(optimizer=_adamw), dict(optimizer=_adamw_in_backward)
    else:
        adamw = {"lr": 1e-2, "betas": (0.9, 0.99)}
        plain_kwargs = dict(optimizer_cls_and_kwargs=(torch.optim.AdamW, adamw))
        ours_kwargs = dict(optimizer_cls_and_kwargs=(in_backward(torch.optim.AdamW), adamw))
    plain = _train(transformers.Trainer, tmp_path / "plain", **plain_kwargs, **kwargs)
    ours = _train(
        in_backward_trainer(transformers.Trainer), tmp_path / "ours", **ours_kwargs, **kwargs
    )
    print(f"given by {given}: {_assert_parity(ours, plain):.2e}")


def test_trainer_with_bfloat16_weights_matches_plain(tmp_path):
    """A bfloat16 model with Trainer's AdamW, accumulation 2: AdamW's own kernel, rounding
    every op to bfloat16 as in the plain loop (the fused one, rounding once, ended 2e-3 away).
    The logged norms within bfloat16's rounding (docs/gradients.md)."""
    kwargs = dict(gradient_accumulation_steps=2, dtype=torch.bfloat16)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert ours["in_backward"] == [True] * STEPS
    torch.testing.assert_close(ours["norms"], plain["norms"], rtol=2**-8, atol=0)


@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["no-clip", "clip"])
def test_trainer_with_bf16_autocast_matches_plain(tmp_path, clip):
    """``bf16=True`` (float32 weights, bfloat16 autocast): autocast rounds the weights to
    bfloat16 in every forward, so a one-ulp difference in a weight flips roundings and grows
    (measured while a fused kernel replaced AdamW's unset default: 4e-5 after four steps).
    With the plain optimizer's own kernel the runs are the same bit for bit; clipped, the
    coefficient is the norm's, summed in another order (docs/gradients.md), within
    ``PARITY_ATOL``. See [Note: the plain optimizer's own kernel] in
    ``fused_optim_dist/_stepping.py``."""
    kwargs = dict(bf16=True, max_grad_norm=clip)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    if clip:
        _assert_parity(ours, plain)
        return
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert ours["in_backward"] == [True] * STEPS
    torch.testing.assert_close(ours["norms"], plain["norms"], rtol=NORM_RTOL, atol=0)


def test_trainer_with_compact_adamw_clipped(tmp_path):
    """CompactAdamW (float32 weights) with Trainer's clipping: Trainer's two weight-decay groups
    hold the parameters in another order than its ``clip_grad_norm_(model.parameters())``,
    so the coefficient differed in its last bit and codes flipped (5.2e-5 apart). The
    integration takes the norm in the model's order (``set_norm_order``): bit for bit, the
    logged norms too."""
    plain, ours = _compact_runs(tmp_path, max_grad_norm=0.05)
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert ours["norms"] == plain["norms"]


def _compact_runs(tmp_path: Path, **kwargs: Any) -> tuple[dict, dict]:
    """Trainer's own loop with CompactAdamW, and ours with it in backward."""
    compact = {"lr": 1e-2, "weight_decay": 0.1}
    plain = _train(
        transformers.Trainer,
        tmp_path / "plain",
        optimizer_cls_and_kwargs=(CompactAdamW, compact),
        **kwargs,
    )
    ours = _train(
        in_backward_trainer(transformers.Trainer),
        tmp_path / "ours",
        optimizer_cls_and_kwargs=(in_backward(CompactAdamW), compact),
        **kwargs,
    )
    return plain, ours


def test_trainer_with_compact_adamw(tmp_path):
    """CompactAdamW (bfloat16 weights, five bytes per parameter) given as Trainer's
    ``optimizer_cls_and_kwargs``, with accumulation: stepped in backward it ends where
    Trainer's own loop with CompactAdamW after backward ends, bit for bit. The logged norms
    are within bfloat16's rounding of each other: Trainer's is rounded to the gradients' dtype,
    ours summed in float32 (docs/gradients.md)."""
    plain, ours = _compact_runs(tmp_path, gradient_accumulation_steps=2, dtype=torch.bfloat16)
    assert max_difference(ours["params"], plain["params"]) == 0.0
    assert all(value.dtype == torch.bfloat16 for value in ours["params"].values())
    assert ours["in_backward"] == [True] * STEPS
    torch.testing.assert_close(ours["norms"], plain["norms"], rtol=2**-8, atol=0)


def test_trainer_with_a_class_counting_in_its_groups(tmp_path):
    """A class counting steps in its param groups (timm's Lamb), stepped jointly: the callback
    hooking the swapped parameters called ``step()``, which ran the class's step on every
    group before training, so it started one count ahead (8.1e-4 apart here, no error)."""
    lamb = {"lr": 1e-2}
    plain = _train(
        transformers.Trainer, tmp_path / "plain", optimizer_cls_and_kwargs=(GroupStepLamb, lamb)
    )
    ours = _train(
        in_backward_trainer(transformers.Trainer),
        tmp_path / "ours",
        optimizer_cls_and_kwargs=(in_backward(GroupStepLamb), lamb),
    )
    _assert_parity(ours, plain)


@pytest.mark.filterwarnings("ignore:ScheduleFreeSGD is not declared")
def test_trainer_with_a_schedule_free_optimizer(tmp_path):
    """Trainer calls ``optimizer.train()`` before each training step and ``optimizer.eval()``
    before evaluating, where the optimizer has them: before, ours had neither, the class was
    never put in train mode and refused to step; with train mode on from the start the run
    evaluated at the training point (8.1e-3 apart, other eval losses, no error). See [Note: the
    wrapped class's own methods]."""
    kwargs = dict(
        optimizer_cls_and_kwargs=(ScheduleFreeSGD, {"lr": 0.5}),
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
    )
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    _assert_parity(ours, plain)
    assert len(_logged(plain, "eval_loss")) == STEPS // 2
    assert _logged(ours, "eval_loss") == _logged(plain, "eval_loss")


def _adafactor_with_its_schedule(in_backward_: bool) -> Callable[[nn.Module], tuple]:
    """transformers' documented Adafactor recipe: its own relative step size, reported by
    ``AdafactorSchedule`` (which calls the class's static ``_get_lr``)."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    def build(model: nn.Module) -> tuple:
        kwargs = dict(scale_parameter=True, relative_step=True, warmup_init=False, lr=None)
        if in_backward_:
            optim = OptimizerInBackward(model.parameters(), Adafactor, **kwargs)
        else:
            optim = Adafactor(model.parameters(), **kwargs)
        return optim, AdafactorSchedule(optim)

    return build


def test_trainer_with_adafactor_and_its_schedule(tmp_path):
    """Before: ``AttributeError: 'OptimizerInBackward' object has no attribute '_get_lr'`` at
    the first ``lr_scheduler.step()``, after the first update (1.0e-2 moved)."""
    kwargs = dict(gradient_accumulation_steps=2)
    plain = _train(
        transformers.Trainer,
        tmp_path / "plain",
        optimizer=_adafactor_with_its_schedule(False),
        **kwargs,
    )
    ours = _train(
        in_backward_trainer(transformers.Trainer),
        tmp_path / "ours",
        optimizer=_adafactor_with_its_schedule(True),
        **kwargs,
    )
    _assert_parity(ours, plain)
    assert _logged(ours, "learning_rate") == _logged(plain, "learning_rate")


def test_trainer_resume_matches_uninterrupted_plain(tmp_path):
    """Accumulation 2, clipping: saved at step 2 and resumed to step 4, as plain AdamW."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    trainer_cls = in_backward_trainer(transformers.Trainer)
    saved = dict(kwargs, save_strategy="steps", save_steps=SAVE_AT)
    ours = _train(trainer_cls, tmp_path / "ours", **saved)
    checkpoint = tmp_path / "ours" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / GRADIENT_STATE_NAME).is_file()
    resumed = _train(trainer_cls, tmp_path / "ours", resume=str(checkpoint), **saved)
    _assert_parity(ours, plain)
    difference = max_difference(resumed["params"], plain["params"])
    assert difference < PARITY_ATOL, difference
    # The log history of the first steps is restored from the checkpoint.
    torch.testing.assert_close(resumed["norms"], plain["norms"], rtol=NORM_RTOL, atol=0)
    assert resumed["in_backward"] == [True] * (STEPS - SAVE_AT)
    assert resumed["gradient_state"] == ours["gradient_state"]
    print(f"resumed: max parameter difference {difference:.2e}")


class MeanSquareLogitLoss(transformers.Trainer):
    """A Trainer subclass with its own loss, as a user's would be."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        loss = outputs.logits.float().pow(2).mean()
        return (loss, outputs) if return_outputs else loss


class MeanSquareLogitLossInBackward(InBackwardTrainerMixin, MeanSquareLogitLoss):
    """The mixin first among the bases: the subclass's loss, stepped in backward."""


def test_trainer_subclass_with_its_own_loss(tmp_path):
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    plain = _train(MeanSquareLogitLoss, tmp_path / "plain", **kwargs)
    ours = _train(MeanSquareLogitLossInBackward, tmp_path / "ours", **kwargs)
    print(f"compute_loss subclass: {_assert_parity(ours, plain):.2e}")


class AuxiliaryBackwardLoss(transformers.Trainer):
    """A ``compute_loss`` running a backward of its own (an auxiliary loss, the graph kept)
    and returning the main loss for Trainer's backward: the plain Trainer steps the sum."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        (1e-2 * outputs.logits.float().square().mean()).backward(retain_graph=True)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class AuxiliaryBackwardLossInBackward(InBackwardTrainerMixin, AuxiliaryBackwardLoss):
    pass


def test_trainer_compute_loss_with_a_backward_of_its_own(tmp_path):
    """The auxiliary backward stepped every bucket it completed on a micro-batch ending a
    step, and Trainer's backward then failed in autograd's check of the saved weights, after
    they moved. Run under ``accumulate()`` (the mixin's ``compute_loss``): equal."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    plain = _train(AuxiliaryBackwardLoss, tmp_path / "plain", **kwargs)
    ours = _train(AuxiliaryBackwardLossInBackward, tmp_path / "ours", **kwargs)
    print(f"compute_loss with its own backward: {_assert_parity(ours, plain):.2e}")


def _own_training_step(self, model, inputs, num_items_in_batch=None):
    """A ``training_step`` of a user's subclass: its own backward, not Trainer's step."""
    model.train()
    inputs = self._prepare_inputs(inputs)
    loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    self.accelerator.backward(loss / self.current_gradient_accumulation_steps)
    return loss.detach()


class OwnTrainingStep(transformers.Trainer):
    training_step = _own_training_step


class OwnTrainingStepInBackward(in_backward_trainer(transformers.Trainer)):
    """The step overridden below the mixin, in a subclass of the in-backward Trainer."""

    training_step = _own_training_step


def _own_training_step_loss_backward(self, model, inputs, num_items_in_batch=None):
    """A ``training_step`` calling ``loss.backward()`` itself, not ``accelerator.backward``."""
    model.train()
    inputs = self._prepare_inputs(inputs)
    loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    (loss / self.current_gradient_accumulation_steps).backward()
    return loss.detach()


class LossBackwardStep(transformers.Trainer):
    training_step = _own_training_step_loss_backward


class LossBackwardStepInBackward(InBackwardTrainerMixin, LossBackwardStep):
    """The mixin first among the bases of a subclass whose step calls ``loss.backward()``."""


def test_trainer_subclass_calling_loss_backward(tmp_path):
    """``in_backward_trainer(MyTrainer)`` where ``MyTrainer.training_step`` calls
    ``loss.backward()`` with accumulation: with only ``accelerator.backward`` wrapped, its
    first micro-batch was stepped in backward; the mixin's ``training_step`` runs the whole
    step under ``accumulate()`` on such micro-batches: as plain."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    plain = _train(LossBackwardStep, tmp_path / "plain", **kwargs)
    ours = _train(LossBackwardStepInBackward, tmp_path / "ours", **kwargs)
    print(f"loss.backward() subclass: {_assert_parity(ours, plain):.2e}")


def test_trainer_subclass_with_its_own_training_step(tmp_path):
    """A subclass of ``in_backward_trainer(Trainer)`` whose ``training_step`` calls
    ``self.accelerator.backward`` itself, with accumulation: the mixin's ``training_step`` was
    bypassed, the first micro-batch was stepped in backward and the second refused (1.0e-2
    moved). ``accelerator.backward`` accumulates on micro-batches that do not end a step: as
    plain."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)
    plain = _train(OwnTrainingStep, tmp_path / "plain", **kwargs)
    ours = _train(OwnTrainingStepInBackward, tmp_path / "ours", **kwargs)
    assert min(plain["norms"]) > CLIP, plain["norms"]
    print(f"training_step subclass: {_assert_parity(ours, plain):.2e}")


class LogitBiasLoss(transformers.Trainer):
    """A Trainer subclass whose loss adds a learnable logit bias kept on the Trainer, outside
    the model (as a temperature or a projector for the loss would be)."""

    def __init__(self, *args: Any, logit_bias: nn.Parameter, **kwargs: Any) -> None:
        self.logit_bias = logit_bias
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits = outputs.logits[:, :-1] + self.logit_bias
        labels = inputs["labels"][:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return (loss, outputs) if return_outputs else loss


class LogitBiasLossInBackward(InBackwardTrainerMixin, LogitBiasLoss):
    pass


@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["no-clip", "clip"])
def test_optimizer_parameters_outside_the_model(tmp_path, clip):
    """An optimizer holding a trainable parameter outside the model (the logit bias): Trainer
    clips and logs the norm over the model's parameters, ours over the optimizer's (8.4e-4
    apart after four clipped steps; logged norms up to 1.7e-2 relative apart, clipped or
    not), so refused before the first backward, nothing moved."""
    model = tiny_llama()
    before = full_params(model)
    bias = nn.Parameter(torch.zeros(VOCAB))
    optim = OptimizerInBackward(
        [*model.parameters(), bias], torch.optim.AdamW, lr=1e-2, max_grad_norm=clip or None
    )
    with accelerate_on_cpu():
        trainer = LogitBiasLossInBackward(
            model=model,
            args=_args(tmp_path, max_grad_norm=clip),
            train_dataset=TokenDataset(),
            optimizers=(optim, None),
            logit_bias=bias,
        )
        with pytest.raises(ValueError, match=r"not the model's \(shapes \(64,\)\).*Make them"):
            trainer.train()
    assert max_difference(full_params(model), before) == 0.0
    assert torch.equal(bias.detach(), torch.zeros(VOCAB))


def _word_tokenizer() -> Any:
    """A word-level tokenizer over the model's vocabulary, built here (nothing downloaded)."""
    from _frameworks import VOCAB
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>"
    )


def _train_trl(
    trainer_cls: type,
    out: Path,
    config: str,
    rows: dict,
    model: nn.Module,
    config_kwargs: dict | None = None,
    **kwargs: Any,
) -> dict:
    """Train ``model`` with a TRL trainer class (``trl.<config>`` its arguments, with
    ``config_kwargs``) on ``rows``, accumulation 2 and clipped; its parameters, norms and
    probe."""
    import datasets
    import trl

    with accelerate_on_cpu():
        probe = StepProbe()
        args = _args(out, gradient_accumulation_steps=2, max_grad_norm=CLIP).to_dict()
        args.pop("push_to_hub_token", None)
        args.update(config_kwargs or {})
        trainer = trainer_cls(
            model=model,
            args=getattr(trl, config)(**{k: v for k, v in args.items() if not k.startswith("_")}),
            train_dataset=datasets.Dataset.from_dict(rows),
            processing_class=_word_tokenizer(),
            callbacks=[probe],
            **kwargs,
        )
        trainer.train()
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
        params = full_params(trainer.model)
        return {"params": params, "norms": norms, "in_backward": probe.in_backward}


def _train_sft(trainer_cls: type, out: Path) -> dict:
    from _frameworks import EXAMPLES, token_ids

    rows = {"input_ids": [token_ids(i).tolist() for i in range(EXAMPLES)]}
    return _train_trl(trainer_cls, out, "SFTConfig", rows, tiny_llama())


def test_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    plain = _train_sft(trl.SFTTrainer, tmp_path / "plain")
    ours = _train_sft(in_backward_trainer(trl.SFTTrainer), tmp_path / "ours")
    print(f"SFTTrainer: {_assert_parity(ours, plain):.2e}")


def _words(seed: int, count: int) -> str:
    """``count`` words of the tokenizer's vocabulary, drawn with ``seed``."""
    from _frameworks import VOCAB

    drawn = torch.randint(2, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
    return " ".join(f"w{int(i)}" for i in drawn)


LORA_DPO_CLIP = 0.02
"""Below every gradient norm of the LoRA adapters' DPO run (checked; CLIP is above them)."""


def _train_dpo(trainer_cls: type, out: Path, lora: bool) -> dict:
    """DPO on 16 preference pairs: against a frozen copy of the initial model, or, with LoRA
    adapters, against the model with its adapters disabled (TRL's reference under PEFT);
    every step clipped."""
    import peft

    rows = {
        "prompt": [_words(i, 4) for i in range(16)],
        "chosen": [_words(100 + i, 3) for i in range(16)],
        "rejected": [_words(200 + i, 3) for i in range(16)],
    }
    torch.manual_seed(0)
    model = tiny_llama()
    reference = None if lora else copy.deepcopy(model)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, config)
    clip = {"max_grad_norm": LORA_DPO_CLIP} if lora else {}
    return _train_trl(trainer_cls, out, "DPOConfig", rows, model, clip, ref_model=reference)


@pytest.mark.parametrize("lora", [False, True], ids=["reference-copy", "lora"])
def test_trl_dpo_trainer(tmp_path, lora):
    """TRL's DPOTrainer (two forwards a step: the policy's and the reference's, which is a
    frozen copy or the same model with its adapters disabled): bit for bit."""
    import trl

    plain = _train_dpo(trl.DPOTrainer, tmp_path / "plain", lora)
    ours = _train_dpo(in_backward_trainer(trl.DPOTrainer), tmp_path / "ours", lora)
    assert _assert_parity(ours, plain) == 0
    assert min(plain["norms"]) > (LORA_DPO_CLIP if lora else CLIP), plain["norms"]


def _completion_length(completions: list[str], **_: Any) -> list[float]:
    """A reward: longer completions are better."""
    return [len(completion) / 10 for completion in completions]


def _train_grpo(trainer_cls: type, out: Path) -> dict:
    """GRPO on 16 prompts: two completions each, generated by the model being trained between
    steps, two updates per generation (``num_iterations=2``: the second against the first's
    log-probabilities)."""
    rows = {"prompt": [_words(i, 4) for i in range(16)]}
    torch.manual_seed(0)
    generation = dict(
        num_generations=2, max_completion_length=6, generation_batch_size=4, num_iterations=2
    )
    return _train_trl(
        trainer_cls, out, "GRPOConfig", rows, tiny_llama(), generation,
        reward_funcs=_completion_length,
    )  # fmt: skip


def test_trl_grpo_trainer(tmp_path):
    """TRL's GRPOTrainer, generating with the model between steps: bit for bit."""
    import trl

    plain = _train_grpo(trl.GRPOTrainer, tmp_path / "plain")
    ours = _train_grpo(in_backward_trainer(trl.GRPOTrainer), tmp_path / "ours")
    assert _assert_parity(ours, plain) == 0
    assert min(plain["norms"]) > CLIP, plain["norms"]


def _peft_llama(**lora: Any) -> Callable[[], nn.Module]:
    """A builder of the tiny Llama wrapped by PEFT with adapters of ``lora``
    (``peft.LoraConfig``'s arguments) on the attention's and the MLP's projections: the base
    weights frozen, the adapters trained."""
    import peft

    def build() -> nn.Module:
        torch.manual_seed(0)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, **lora
        )
        return peft.get_peft_model(tiny_llama(), config)

    return build


LORA_TARGETS = ["q_proj", "v_proj", "gate_proj"]
LORA_RUNS = {
    "lora-ga2-clip": ({}, dict(gradient_accumulation_steps=2, max_grad_norm=CLIP)),
    "dora-clip": ({"use_dora": True}, dict(max_grad_norm=CLIP)),
    "lora-head-saved-ga2": ({"modules_to_save": ["lm_head"]}, dict(gradient_accumulation_steps=2)),
}
"""PEFT runs: the adapters' arguments and Trainer's. ``use_dora``: DoRA's magnitude vectors and
a weight norm computed in the forward; ``modules_to_save``: a trained copy of the head beside
the frozen original."""


@pytest.mark.parametrize("run", LORA_RUNS)
def test_trainer_with_peft_adapters_matches_plain(tmp_path, run):
    """LoRA fine-tuning through PEFT (the optimizer built on the adapters, the base frozen):
    bit for bit with the plain Trainer, every step clipped where ``max_grad_norm`` is set."""
    lora, overrides = LORA_RUNS[run]
    kwargs = dict(model_fn=_peft_llama(**lora), **overrides)
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    assert _assert_parity(ours, plain) == 0
    if overrides.get("max_grad_norm"):
        assert min(plain["norms"]) > CLIP, plain["norms"]


def test_given_optimizer_must_be_in_backward_and_clip_as_the_arguments(tmp_path):
    model = tiny_llama()
    args = _args(tmp_path, max_grad_norm=1.0)
    trainer_cls = in_backward_trainer(transformers.Trainer)
    with accelerate_on_cpu(), pytest.raises(TypeError, match="expected an OptimizerInBackward"):
        plain = torch.optim.AdamW(model.parameters())
        trainer_cls(model=model, args=args, optimizers=(plain, None))
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, max_grad_norm=0.5)
    with accelerate_on_cpu(), pytest.raises(ValueError, match=r"max_grad_norm=1\.0 but the"):
        trainer_cls(model=model, args=args, optimizers=(optim, None))
    with pytest.raises(TypeError, match=r"expected a transformers\.Trainer subclass"):
        in_backward_trainer(torch.optim.AdamW)


def _decoder_layers(model: nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if ".layers." in name]


def test_trainable_parameters_outside_the_optimizer(tmp_path):
    """An optimizer given on part of the model (its decoder layers), the rest trainable:
    Trainer clips and logs the norm over every trainable parameter, ours over the optimizer's
    (it was 3e-3 apart, logged norm 0.39 against 1.58), so refused before the first backward,
    nothing moved. With the rest frozen, as plain."""
    model = tiny_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optim = OptimizerInBackward(
        _decoder_layers(model), torch.optim.AdamW, lr=1e-2, max_grad_norm=CLIP
    )
    with accelerate_on_cpu():
        trainer = in_backward_trainer(transformers.Trainer)(
            model=model,
            args=_args(tmp_path / "refused", max_grad_norm=CLIP),
            train_dataset=TokenDataset(),
            optimizers=(optim, None),
        )
        with pytest.raises(ValueError, match=r"not in the optimizer.*Freeze"):
            trainer.train()
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), f"{name} moved"

    def frozen_but_layers(model: nn.Module, cls: Callable[..., torch.optim.Optimizer]):
        model.requires_grad_(False)
        for param in _decoder_layers(model):
            param.requires_grad_(True)
        return cls(_decoder_layers(model))

    kwargs = dict(max_grad_norm=CLIP)
    plain = _train(
        transformers.Trainer,
        tmp_path / "plain",
        optimizer=lambda m: frozen_but_layers(m, lambda p: torch.optim.AdamW(p, lr=1e-2)),
        **kwargs,
    )
    ours = _train(
        in_backward_trainer(transformers.Trainer),
        tmp_path / "ours",
        optimizer=lambda m: frozen_but_layers(
            m, lambda p: OptimizerInBackward(p, torch.optim.AdamW, lr=1e-2, max_grad_norm=CLIP)
        ),
        **kwargs,
    )
    print(f"decoder layers trained, the rest frozen: {_assert_parity(ours, plain):.2e}")


def test_trainer_max_grad_norm_inf_measures_without_clipping(tmp_path):
    """``max_grad_norm=inf``: Trainer's own "measure the norm, never clip" (it still logs
    ``grad_norm``). It was passed on to the optimizer, which refused it at ``create_optimizer``;
    it now means no clipping, as 0 does, and the logged norms are Trainer's."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=float("inf"))
    plain = _train(transformers.Trainer, tmp_path / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), tmp_path / "ours", **kwargs)
    print(f"max_grad_norm=inf: {_assert_parity(ours, plain):.2e}")


class _GradScalerAtConstruction(transformers.Trainer):
    """``fp16=True`` on a GPU: accelerate's ``Accelerator`` builds a ``torch.amp.GradScaler``
    (only off the CPU). Put one on the accelerator where Trainer builds it."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu")
        self.accelerator.native_amp = True


def test_trainer_grad_scaler_is_refused_before_any_update(tmp_path):
    """A GradScaler on the accelerator scales the loss, and each gradient would be stepped in
    backward, scaled, before it could unscale it: the refusal came at the first optimizer step,
    after the parameters moved (1.0e-2). Refused when the Trainer is built, or, for one put on
    the accelerator afterwards, before the first backward; nothing moved."""
    trainer_cls = in_backward_trainer(_GradScalerAtConstruction)
    model = tiny_llama()
    before = full_params(model)
    with accelerate_on_cpu(), pytest.raises(ValueError, match=r"GradScaler.*bf16"):
        trainer_cls(model=model, args=_args(tmp_path / "built"), train_dataset=TokenDataset())
    with accelerate_on_cpu():
        trainer = in_backward_trainer(transformers.Trainer)(
            model=model,
            args=_args(tmp_path / "afterwards", max_grad_norm=CLIP),
            train_dataset=TokenDataset(),
        )
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
        with pytest.raises(ValueError, match=r"GradScaler.*bf16"):
            trainer.train()
    assert max_difference(full_params(model), before) == 0.0


class AdamWFactory:
    """Trainer's optimizer-factory protocol, which transformers uses for Muon and Dion:
    ``optimizer_cls_and_kwargs=(AdamWFactory, kwargs)``, and Trainer builds
    ``AdamWFactory()(model, **kwargs)``. Groups of its own: the matrices decayed, the rest at a
    tenth of the LR, undecayed (in another order than ``model.parameters()``)."""

    def groups(self, model: nn.Module, lr: float) -> list[dict[str, Any]]:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        return [
            {"params": others, "lr": lr / 10, "weight_decay": 0.0},
            {"params": matrices, "weight_decay": 0.1},
        ]

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.groups(model, lr), lr=lr, betas=(0.9, 0.99))


class AdagradFactory(AdamWFactory):
    """A class that makes state when built (Adagrad's sums, from ``initial_accumulator_value``)."""

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.groups(model, lr), lr=lr, initial_accumulator_value=0.1)


class InBackwardFactory(AdamWFactory):
    """A factory building the in-backward optimizer itself (where it mixes classes per group,
    as a Muon factory would): used as it is."""

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return OptimizerInBackward(
            self.groups(model, lr), torch.optim.AdamW, lr=lr, betas=(0.9, 0.99), max_grad_norm=CLIP
        )


def _train_factories(
    tmp_path: Path,
    plain_factory: type,
    ours_factory: type,
    lr: float = 1e-2,
    max_grad_norm: float = 1.0,
) -> tuple[dict, dict]:
    """Train with Trainer and ``plain_factory``, and with the in-backward Trainer and
    ``ours_factory`` (``optimizer_cls_and_kwargs``), two micro-batches a step, clipping."""
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=max_grad_norm)
    plain = _train(
        transformers.Trainer,
        tmp_path / "plain",
        optimizer_cls_and_kwargs=(plain_factory, {"lr": lr}),
        **kwargs,
    )
    ours = _train(
        in_backward_trainer(transformers.Trainer),
        tmp_path / "ours",
        optimizer_cls_and_kwargs=(ours_factory, {"lr": lr}),
        **kwargs,
    )
    return plain, ours


@pytest.mark.parametrize(
    ("plain_factory", "ours_factory"),
    [
        (AdamWFactory, AdamWFactory),
        (AdagradFactory, AdagradFactory),
        (AdamWFactory, InBackwardFactory),
    ],
    ids=["adamw-groups", "adagrad", "in-backward"],
)
def test_trainer_optimizer_factory_matches_plain(tmp_path, plain_factory, ours_factory):
    """Trainer's optimizer factory (``optimizer_cls_and_kwargs=(Factory, kwargs)``): the
    optimizer it builds is built again as an in-backward optimizer of its class, on its param
    groups (state made at construction carried over), clipping at ``max_grad_norm``; a factory
    building an ``OptimizerInBackward`` is used as it is. It raised ``TypeError: optimizer_cls
    must be a torch.optim.Optimizer subclass`` at ``create_optimizer``. As plain, with
    accumulation and clipping."""
    plain, ours = _train_factories(tmp_path, plain_factory, ours_factory, max_grad_norm=CLIP)
    assert min(plain["norms"]) > CLIP, plain["norms"]
    print(f"optimizer factory {ours_factory.__name__}: {_assert_parity(ours, plain):.2e}")


class TwoListSGD(torch.optim.SGD):
    """A class built from two parameter lists (as an optimizer combining two could be): it
    cannot be built again from its param groups."""

    def __init__(self, matrices: list[torch.Tensor], others: list[torch.Tensor], lr: float):
        super().__init__([{"params": matrices}, {"params": others, "lr": lr / 10}], lr=lr)


class TwoListFactory:
    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        return TwoListSGD(matrices, [p for p in model.parameters() if p.ndim != 2], lr)


def test_trainer_optimizer_factory_not_rebuildable_is_refused(tmp_path):
    """A factory's optimizer whose class cannot be built again from its param groups: refused
    at ``create_optimizer``, naming the way out (the factory builds an ``OptimizerInBackward``),
    before anything moved."""
    model = tiny_llama()
    before = full_params(model)
    with accelerate_on_cpu():
        trainer = in_backward_trainer(transformers.Trainer)(
            model=model,
            args=_args(tmp_path),
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(TwoListFactory, {"lr": 1e-2}),
        )
        with pytest.raises(TypeError, match=r"TwoListSGD.*param groups.*OptimizerInBackward"):
            trainer.train()
    assert max_difference(full_params(model), before) == 0.0


class ScaledMomentumSGD(torch.optim.SGD):
    """SGD whose learning rate is multiplied by ``lr_scale``, an argument of its constructor
    kept on the instance, outside the groups (as bitsandbytes keeps ``min_8bit_size``)."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, lr_scale: float = 1.0):
        super().__init__(params, lr=lr, momentum=momentum)
        self.lr_scale = lr_scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] *= self.lr_scale
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, lrs, strict=True):
                group["lr"] = lr


class ScaledMomentumSGDFactory:
    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return ScaledMomentumSGD(model.parameters(), lr=lr, momentum=0.9, lr_scale=0.1)


@pytest.mark.filterwarnings("ignore:ScaledMomentumSGD is not declared")
def test_trainer_optimizer_factory_attributes_are_carried(tmp_path):
    """A factory's optimizer keeping a constructor argument on itself (``lr_scale``, not in
    its groups nor its defaults): built again from its class and groups, it stepped with the
    constructor's default (3.6e-2 apart after four steps, no error). The attributes it keeps
    that the one built again lacks are carried: as plain."""
    plain, ours = _train_factories(
        tmp_path, ScaledMomentumSGDFactory, ScaledMomentumSGDFactory, lr=1e-1
    )
    print(f"factory attribute carried: {_assert_parity(ours, plain):.2e}")


def _clamp_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step post-hook constraining every parameter to [-0.05, 0.05]."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.clamp_(-0.05, 0.05)


def _centralize_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook subtracting each matrix gradient's row mean (gradient centralization)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.ndim > 1:
                param.grad.sub_(param.grad.mean(dim=1, keepdim=True))


class _HookedAdamWFactory:
    """An AdamW with ``hook`` registered on it by its method ``register``."""

    register: str
    hook: Callable[..., None]

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        optim = torch.optim.AdamW(model.parameters(), lr=lr)
        getattr(optim, self.register)(self.hook)
        return optim


class ClampedAdamWFactory(_HookedAdamWFactory):
    register, hook = "register_step_post_hook", staticmethod(_clamp_weights)


class ClampedInBackwardFactory:
    """The way out the refusal names: the factory builds the in-backward optimizer and
    registers the post-hook on it."""

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=lr, max_grad_norm=1.0)
        optim.register_step_post_hook(_clamp_weights)
        return optim


class CentralizedAdamWFactory(_HookedAdamWFactory):
    register, hook = "register_step_pre_hook", staticmethod(_centralize_gradients)


class GroupsOnItselfFactory:
    """An attribute referring to the optimizer's own groups: the one built again holds
    others, so it cannot be carried."""

    def __call__(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        optim = torch.optim.AdamW(model.parameters(), lr=lr)
        optim.first_group = optim.param_groups[0]
        return optim


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (ClampedAdamWFactory, r"hooks registered on it \(step_post_hooks\)"),
        (CentralizedAdamWFactory, r"hooks registered on it \(step_pre_hooks\)"),
        (GroupsOnItselfFactory, r"keeps first_group on itself"),
    ],
    ids=["post-hook", "pre-hook", "attribute-on-its-groups"],
)
def test_trainer_optimizer_factory_what_cannot_be_carried_is_refused(tmp_path, factory, match):
    """A factory's optimizer with hooks registered on it (a weight clamp after each step, 0.97
    apart after four steps; gradient centralization before it) or an attribute that cannot be
    carried: built again from its class and groups, the hooks were dropped, no error. Refused
    at ``create_optimizer``, naming the way out, before anything moved."""
    model = tiny_llama()
    before = full_params(model)
    with accelerate_on_cpu():
        trainer = in_backward_trainer(transformers.Trainer)(
            model=model,
            args=_args(tmp_path, max_grad_norm=1.0),
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(factory, {"lr": 1e-2}),
        )
        with pytest.raises(TypeError, match=rf"{match}.*return an OptimizerInBackward"):
            trainer.train()
    assert max_difference(full_params(model), before) == 0.0


def test_trainer_optimizer_factory_post_hook_on_the_in_backward_optimizer(tmp_path):
    """The refusal's way out: the factory returns an ``OptimizerInBackward`` with the step
    post-hook on it, which runs at ``step()``, after the backward's updates: as plain."""
    plain, ours = _train_factories(tmp_path, ClampedAdamWFactory, ClampedInBackwardFactory)
    # The hook clamped: the largest weight is at the bound.
    clamped = max(value.abs().max().item() for value in plain["params"].values())
    assert clamped == pytest.approx(0.05), clamped
    print(f"post-hook on the in-backward optimizer: {_assert_parity(ours, plain):.2e}")


_BITSANDBYTES_OPTIM = '''
"""A stand-in for bitsandbytes' optim module: what Trainer's create_optimizer calls, and an
8-bit AdamW whose first moment is rounded to 8 bits but for the parameters the manager's
overrides keep in 32-bit state."""
import torch


class GlobalOptimManager:
    _instance = None

    def __init__(self):
        self.module_overrides = {}

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def register_module_override(self, module, param_name, config):
        self.module_overrides[id(getattr(module, param_name))] = dict(config)


class AdamW8bit(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, weight_decay=1e-2, optim_bits=8):
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.optim_bits = optim_bits

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        overrides = GlobalOptimManager.get_instance().module_overrides
        for group in self.param_groups:
            for p in group["params"]:
                bits = overrides.get(id(p), {}).get("optim_bits", self.optim_bits)
                if bits == 8 and p in self.state:
                    m = self.state[p]["exp_avg"]
                    scale = m.abs().max().clamp_min(1e-30) / 127
                    m.copy_((m / scale).round() * scale)
        return loss
'''


@pytest.fixture
def bitsandbytes(tmp_path, monkeypatch):
    """A stand-in ``bitsandbytes`` package (``bitsandbytes.optim``), importable for the test."""
    import importlib
    import sys

    package = tmp_path / "site" / "bitsandbytes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import optim\n")
    (package / "optim.py").write_text(_BITSANDBYTES_OPTIM)
    monkeypatch.syspath_prepend(str(package.parent))
    names = ("bitsandbytes", "bitsandbytes.optim")
    for name in names:  # an installed bitsandbytes imported earlier is not the stand-in
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("bitsandbytes")
    for name in names:
        sys.modules.pop(name, None)


@pytest.mark.filterwarnings("ignore:AdamW8bit is not declared")
@pytest.mark.parametrize("given", ["class", "in_backward"])
def test_trainer_bitsandbytes_embedding_override(tmp_path, bitsandbytes, given):
    """An 8-bit bitsandbytes class (``optim_bits=8``): Trainer keeps embeddings in 32-bit
    state when ``str(optimizer_cls)`` names ``bitsandbytes``, and the in-backward class's did
    not, so the override was skipped (with this stand-in, 8.7e-3 apart after four steps; with
    bitsandbytes, 8-bit embedding state, no error). Given as the class or as
    ``in_backward(class)``: registered, as plain."""
    adamw8bit = bitsandbytes.optim.AdamW8bit
    kwargs = dict(gradient_accumulation_steps=2, max_grad_norm=1.0)
    adamw = {"lr": 1e-2, "optim_bits": 8}
    runs = {}
    for who, trainer_cls, cls in [
        ("plain", transformers.Trainer, adamw8bit),
        ("ours", in_backward_trainer(transformers.Trainer),
         adamw8bit if given == "class" else in_backward(adamw8bit)),
    ]:  # fmt: skip
        manager = bitsandbytes.optim.GlobalOptimManager._instance = (
            bitsandbytes.optim.GlobalOptimManager()
        )
        runs[who] = _train(
            trainer_cls, tmp_path / who, optimizer_cls_and_kwargs=(cls, adamw), **kwargs
        )
        # The model's one nn.Embedding, kept in 32-bit state.
        assert list(manager.module_overrides.values()) == [{"optim_bits": 32}], who
    print(f"bitsandbytes override, {given}: {_assert_parity(runs['ours'], runs['plain']):.2e}")


class _SigtermDuringStep(transformers.TrainerCallback):
    """What transformers' JIT checkpoint manager does after SIGTERM's grace period, when it
    ends during step ``SAVE_AT + 1``'s forward or backward: it requests the checkpoint, which
    ``JITCheckpointCallback`` saves at the next event, ``on_pre_optimizer_step``."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        handler = trainer.callback_handler
        jit = next(c for c in handler.callbacks if isinstance(c, JITCheckpointCallback))
        self.manager = jit.jit_manager

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step == SAVE_AT:
            self.manager.is_checkpoint_requested = True


@pytest.mark.parametrize("save_only_model", [True, False], ids=["model-only", "full"])
def test_trainer_jit_checkpoint_between_backward_and_step_is_refused(tmp_path, save_only_model):
    """transformers' JIT checkpoint requested during a step's backward saves between backward
    and ``optimizer.step()``, where the plain Trainer saves the weights of before the step:
    with ``save_only_model`` the checkpoint held the next step's weights (5.0e-3 apart, no
    error); without it the optimizer's ``state_dict()`` refused after the weights were
    written. Refused at the save, the model not written. See [Note: saving between backward
    and step()]."""
    import signal

    sigterm = signal.getsignal(signal.SIGTERM)  # the JIT manager's, restored at train end
    try:
        with accelerate_on_cpu():
            trainer = in_backward_trainer(transformers.Trainer)(
                model=tiny_llama(),
                args=_args(tmp_path, enable_jit_checkpoint=True, save_only_model=save_only_model),
                train_dataset=TokenDataset(),
            )
            trainer.add_callback(_SigtermDuringStep(trainer))
            with pytest.raises(RuntimeError, match=r"between step 3's backward.*not saved"):
                trainer.train()
            trainer.optimizer.step()  # the step the refusal interrupted, as the loop's
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    checkpoint = tmp_path / f"checkpoint-{SAVE_AT}"
    assert not any(path.suffix == ".safetensors" for path in checkpoint.iterdir())


def _two_stages(trainer_cls: type, out: Path) -> tuple[dict[str, torch.Tensor], float]:
    """Two-stage fine-tuning with a Trainer each, the first kept: the head with the body
    frozen, then everything; then the first evaluates and trains the head again. The
    parameters, and the first Trainer's last evaluation loss."""
    with accelerate_on_cpu():
        model = tiny_llama()
        model.requires_grad_(False)
        model.lm_head.requires_grad_(True)
        head_trainer = trainer_cls(
            model=model, args=_args(out / "head"), train_dataset=TokenDataset()
        )
        head_trainer.train()
        model.requires_grad_(True)
        full_trainer = trainer_cls(
            model=model, args=_args(out / "full", learning_rate=3e-3), train_dataset=TokenDataset()
        )
        full_trainer.train()
        model.requires_grad_(False)
        model.lm_head.requires_grad_(True)
        head_trainer.train()
        loss = head_trainer.evaluate(TokenDataset())["eval_loss"]
        return full_params(model), loss


def test_trainer_two_stages_on_one_model(tmp_path):
    """A second Trainer on the model while the first is still referenced: the first's optimizer
    kept its hooks on the head after its ``train()``, and the second was refused at its
    ``train()`` as another live optimizer in backward (nothing moved). ``train()`` now
    detaches its optimizer when it ends and attaches it when training begins again (see
    [Note: an idle Trainer holds no hooks]): as plain, the first Trainer trained again too."""
    ours, ours_loss = _two_stages(in_backward_trainer(transformers.Trainer), tmp_path / "ours")
    plain, plain_loss = _two_stages(transformers.Trainer, tmp_path / "plain")
    assert max_difference(ours, plain) < PARITY_ATOL
    assert ours_loss == pytest.approx(plain_loss, rel=1e-6)


class _OutOfMemoryOnce:
    """A tiny Llama that runs out of memory once, in the first batch of 4 examples (the
    first attempt of ``auto_find_batch_size``): in the forward of its embedding, or in the
    backward, at the embedding output's gradient, after the layers and the head had theirs.
    ``weights``: the parameters when the error was raised."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.weights: dict[str, torch.Tensor] | None = None

    def model(self) -> nn.Module:
        model = tiny_llama()
        model.model.embed_tokens.register_forward_hook(self._hook)
        self.model_ = model
        return model

    def _raise(self, *_: Any) -> None:
        self.weights = full_params(self.model_)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def _hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if output.shape[0] != 4 or self.weights is not None:
            return
        if self.where == "forward":
            self._raise()
        output.register_hook(self._raise)


def _adamw_in_buckets(model: nn.Module) -> torch.optim.Optimizer:
    """Several buckets, stepped one by one in backward, as FSDP2 units are."""
    return OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, bucket_numel=600
    )


def _out_of_memory_run(trainer_cls: type, oom: _OutOfMemoryOnce, out: Path) -> dict:
    """``auto_find_batch_size`` from 4 examples, the first attempt out of memory."""
    in_backward_ = issubclass(trainer_cls, InBackwardTrainerMixin)
    return _train(
        trainer_cls,
        out,
        optimizer=_adamw_in_buckets if in_backward_ else _adamw,
        model_fn=oom.model,
        auto_find_batch_size=True,
        per_device_train_batch_size=4,
    )


def test_trainer_auto_find_batch_size_after_an_out_of_memory_error_in_forward(tmp_path):
    """Out of memory in forward: nothing was updated, and the retry with a smaller batch
    trains as plain's."""
    ours_oom, plain_oom = _OutOfMemoryOnce("forward"), _OutOfMemoryOnce("forward")
    ours_cls = in_backward_trainer(transformers.Trainer)
    ours = _out_of_memory_run(ours_cls, ours_oom, tmp_path / "ours")
    plain = _out_of_memory_run(transformers.Trainer, plain_oom, tmp_path / "p")
    assert ours_oom.weights is not None and plain_oom.weights is not None  # both retried
    _assert_parity(ours, plain)


def test_trainer_auto_find_batch_size_after_updates_in_backward_is_refused(tmp_path):
    """Out of memory in backward, after buckets were stepped: the plain Trainer retries from
    the weights of before the step; ours had updated those buckets (which cannot be undone),
    and the retry raised at its first backward, naming a missing ``step()`` (1.0e-2 moved).
    Refused at the retry, before it trains: the weights are those of the error. See
    [Note: auto_find_batch_size's retry]."""
    plain_oom = _OutOfMemoryOnce("backward")
    plain = _out_of_memory_run(transformers.Trainer, plain_oom, tmp_path / "p")
    assert plain_oom.weights is not None and len(plain["norms"]) == STEPS  # retried, trained
    oom = _OutOfMemoryOnce("backward")
    with pytest.raises(RuntimeError, match=r"OutOfMemoryError.*cannot be undone.*not started"):
        _out_of_memory_run(in_backward_trainer(transformers.Trainer), oom, tmp_path / "ours")
    assert max_difference(full_params(oom.model_), oom.weights) == 0


# ---------------------------------------------------------------------------------- 2 ranks


def _fsdp2_parity_body(out: str, fsdp_config: dict, clip: float, **overrides: Any) -> float:
    """Trainer on FSDP2, with an evaluation every two steps: its forward under ``no_grad``
    leaves the root unit unsharded, so the model exposes FSDP2's unsharded parameters until
    the next backward (the check that the optimizer holds every trainable parameter refused
    them as outside it)."""
    kwargs = dict(
        gradient_accumulation_steps=2, max_grad_norm=clip, fsdp=True, fsdp_config=fsdp_config,
        one_unit=fsdp_config == ONE_UNIT, eval_strategy="steps", eval_steps=2, **overrides,
    )  # fmt: skip
    plain = _train(transformers.Trainer, Path(out) / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), Path(out) / "ours", **kwargs)
    if clip:
        assert min(plain["norms"]) > clip, plain["norms"]
    return _assert_parity(ours, plain)


REENTRANT_CHECKPOINTING = dict(
    gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
)
"""Each decoder layer's forward run again inside the backward, by a backward nested in the
checkpoint Function's (see [Note: one backward, one BackwardPass] in ``_engine.py``)."""


@pytest.mark.parametrize(
    ("fsdp_config", "clip", "overrides"),
    [(ONE_UNIT, CLIP, {}), (PER_LAYER, 0.0, {}), (PER_LAYER, 0.0, REENTRANT_CHECKPOINTING)],
    ids=["one-unit-clip", "units", "units-reentrant-checkpointing"],
)
def test_trainer_fsdp2_matches_plain(worlds, tmp_path, fsdp_config, clip, overrides):
    differences = worlds.run(
        2, _fsdp2_parity_body, out=str(tmp_path), fsdp_config=fsdp_config, clip=clip, **overrides
    )
    print(f"FSDP2 {fsdp_config}, clip={clip}: max parameter difference {max(differences):.2e}")


def _parity_with_plain(out: Path, **kwargs: Any) -> float:
    """The plain Trainer and ours trained alike (``_train``'s ``kwargs``): equal; the largest
    difference."""
    plain = _train(transformers.Trainer, out / "plain", **kwargs)
    ours = _train(in_backward_trainer(transformers.Trainer), out / "ours", **kwargs)
    return _assert_parity(ours, plain)


def _fsdp2_peft_body(out: str) -> float:
    """LoRA adapters on FSDP2, one unit per decoder layer (frozen and trained parameters in
    each unit), accumulation 2. (Clipped, several units are clipped per bucket: see
    docs/gradients.md.)"""
    return _parity_with_plain(
        Path(out), gradient_accumulation_steps=2, max_grad_norm=0.0, fsdp=True,
        fsdp_config=PER_LAYER, model_fn=_peft_llama(),
    )  # fmt: skip


def test_trainer_fsdp2_with_peft_adapters_matches_plain(worlds, tmp_path):
    differences = worlds.run(2, _fsdp2_peft_body, out=str(tmp_path))
    print(f"FSDP2 with LoRA: max parameter difference {max(differences):.2e}")


def _fsdp2_resume_body(out: str) -> dict[str, float]:
    """Several units, accumulation 2, clipping: resumed at step 2 as if never interrupted."""
    kwargs = dict(
        gradient_accumulation_steps=2, max_grad_norm=CLIP, fsdp=True,
        fsdp_config={**PER_LAYER, "state_dict_type": "SHARDED_STATE_DICT"},
    )  # fmt: skip
    trainer_cls = in_backward_trainer(transformers.Trainer)
    plain = _train(transformers.Trainer, Path(out) / "plain", **kwargs)
    saved = dict(kwargs, save_strategy="steps", save_steps=SAVE_AT)
    ours = _train(trainer_cls, Path(out) / "ours", **saved)
    checkpoint = Path(out) / "ours" / f"checkpoint-{SAVE_AT}"
    history = json.loads((checkpoint / GRADIENT_STATE_NAME).read_text())["previous_sq"]
    assert len(history) > 1, history  # one entry per unit
    resumed = _train(trainer_cls, Path(out) / "ours", resume=str(checkpoint), **saved)
    difference = max_difference(resumed["params"], ours["params"])
    assert difference < PARITY_ATOL, difference
    torch.testing.assert_close(resumed["norms"], ours["norms"], rtol=NORM_RTOL, atol=0)
    assert resumed["gradient_state"] == ours["gradient_state"]
    assert ours["in_backward"] == [True] * STEPS
    assert resumed["in_backward"] == [True] * (STEPS - SAVE_AT)
    # The norms are exact; the clipped update is the per-bucket scheme, close to plain's.
    torch.testing.assert_close(ours["norms"][:1], plain["norms"][:1], rtol=NORM_RTOL, atol=0)
    return {
        "resumed_vs_uninterrupted": difference,
        "vs_plain": max_difference(ours["params"], plain["params"]),
    }


def test_trainer_fsdp2_resume_restores_the_clipping_history(worlds, tmp_path):
    rows = worlds.run(2, _fsdp2_resume_body, out=str(tmp_path))
    print(f"FSDP2 per layer, clipped, resumed: {rows[0]}")


def _native_fsdp2_body(out: str) -> float:
    """transformers' own FSDP2: ``from_pretrained(path, distributed_config=DistributedConfig(
    fsdp_size=2))`` shards the model at load (every parameter a DTensor), and Trainer prepares
    it without wrapping it in DDP. accelerate's type is ``MULTI_CPU`` all the same, which the
    integration refused as DDP at construction; ours equals plain. Accumulation 2 (Trainer
    defers FSDP2's reduce-scatter on the first micro-batch), no clipping (several units)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    path = Path(out) / "tiny_llama"
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()

    def load() -> nn.Module:
        return transformers.LlamaForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(fsdp_size=2)
        )

    return _parity_with_plain(Path(out), gradient_accumulation_steps=2, model_fn=load)


def test_trainer_on_transformers_fsdp2_matches_plain(worlds, tmp_path):
    differences = worlds.run(2, _native_fsdp2_body, out=str(tmp_path))
    print(f"transformers-native FSDP2: max parameter difference {max(differences):.2e}")


def _ddp_refused_body(out: str) -> None:
    with accelerate_on_cpu():
        model = tiny_llama()
        before = full_params(model)
        with pytest.raises(ValueError, match=r"fsdp_version: 2.*replicate"):
            in_backward_trainer(transformers.Trainer)(
                model=model, args=_args(Path(out)), train_dataset=TokenDataset()
            )
        assert max_difference(full_params(model), before) == 0.0


def test_trainer_under_ddp_is_refused_before_any_update(worlds, tmp_path):
    worlds.run(2, _ddp_refused_body, out=str(tmp_path))
