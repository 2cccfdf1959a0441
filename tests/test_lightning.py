"""PyTorch Lightning's automatic optimization stepping in backward, against plain optimizers.

Lightning calls ``optimizer.step(closure)`` at every step, the closure running the training
step, ``zero_grad()`` and the backward. ``OptimizerInBackward.step`` calls it first, as
torch.optim's classes do, so ``configure_optimizers`` returns ours unchanged. Every run is
compared with the same ``Trainer.fit`` on the plain optimizer, its state dict bit for bit, each
parameter a bucket of its own where nothing is clipped. What Lightning does outside a step is
refused as in any loop (docs/frameworks.md): ``accumulate_grad_batches`` at the second
micro-batch and ``gradient_clip_val`` at its read of the freed gradients; ``max_grad_norm`` on
the optimizer clips as ``gradient_clip_val`` does. With the ``InBackward`` callback
(``fused_optim_dist.integrations.lightning``) ``accumulate_grad_batches`` is exact, windows that
end inside an epoch and at its end alike, and ``gradient_clip_val`` is refused before anything
moves. ``BackboneFinetuning`` (a frozen backbone added to the optimizer as a group at the second
epoch) is exact, with and without accumulation. Through ``ModelParallelStrategy`` (FSDP2,
``fully_shard`` in ``configure_model``) on 2 and 3 gloo ranks: the same, and a fit saved by
``ModelCheckpoint`` (DCP) and resumed ends on every rank's shards where the uninterrupted plain
fit does.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _toy import assert_same_state_dict, holds_gradient
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW

lightning = pytest.importorskip("lightning")
from fused_optim_dist.integrations.lightning import InBackward  # noqa: E402

MakeOptim = Callable[[nn.Module], Optimizer]


class Regressor(lightning.LightningModule):
    def __init__(self, make_optim: MakeOptim, one_cycle: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
        )
        self.make_optim, self.one_cycle = make_optim, one_cycle

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optim = self.make_optim(self)
        if not self.one_cycle:
            return optim
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1e-2, total_steps=16)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _trainer(**kwargs) -> lightning.Trainer:
    """A CPU Trainer that logs, prints and checkpoints nothing unless ``kwargs`` say so."""
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return lightning.Trainer(**(options | kwargs))


def _fit_one_process(
    module: lightning.LightningModule, root: Path, *tensors: torch.Tensor, **trainer_kwargs
) -> None:
    """Two epochs of batches of 8 of ``tensors`` on one CPU process."""
    trainer = _trainer(devices=1, max_epochs=2, default_root_dir=root, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        trainer.fit(module, DataLoader(TensorDataset(*tensors), batch_size=8))


def _fit(make_optim: MakeOptim, root: Path, one_cycle: bool = False, **trainer_kwargs) -> nn.Module:
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data)
    module = Regressor(make_optim, one_cycle)
    _fit_one_process(module, root, x, y, **trainer_kwargs)
    return module.net


@pytest.fixture(autouse=True)
def _quiet_lightning():
    """Lightning's and Fabric's info messages (GPU available, tips) off: each logger has a
    level of its own."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), False, "32-true"),
    "adamw-one-cycle-per-step": (torch.optim.AdamW, dict(lr=1e-2), True, "32-true"),
    "sgd-bf16-mixed": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), False, "bf16-mixed"),
    "compact-adamw": (CompactAdamW, dict(lr=1e-2), False, "32-true"),
}


@pytest.mark.parametrize("case", CASES)
def test_automatic_optimization_equal_plain(tmp_path: Path, case: str):
    cls, kwargs, one_cycle, precision = CASES[case]
    ours = _fit(
        lambda m: OptimizerInBackward(m.parameters(), cls, bucket_numel=1, **kwargs),
        tmp_path / "ours",
        one_cycle,
        precision=precision,
    )
    plain = _fit(
        lambda m: cls(m.parameters(), **kwargs), tmp_path / "plain", one_cycle, precision=precision
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


def test_max_grad_norm_clips_as_gradient_clip_val(tmp_path: Path):
    def clipped(module: nn.Module) -> Optimizer:
        return OptimizerInBackward(
            module.parameters(), torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05
        )

    ours = _fit(clipped, tmp_path / "ours")
    plain = _fit(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        tmp_path / "plain",
        gradient_clip_val=0.05,
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


def _loss_scaling() -> dict:
    """``precision="16-mixed"`` as on a GPU: on the CPU Lightning runs ``"bf16-mixed"``, with
    no scaler, so the plugin is given its scaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])


@pytest.mark.parametrize(
    ("trainer_kwargs", "match"),
    [
        (
            dict(accumulate_grad_batches=2),
            r"updated in backward with no optimizer\.step\(\) since.*accumulate",
        ),
        (dict(gradient_clip_val=0.05), r"max_grad_norm="),
        (_loss_scaling(), r"backward started from a loss that GradScaler.scale\(\) scaled"),
    ],
    ids=["accumulate_grad_batches", "gradient_clip_val", "16-mixed"],
)
def test_what_lightning_does_outside_a_step_is_refused(tmp_path: Path, trainer_kwargs, match):
    make = lambda m: OptimizerInBackward(m.parameters(), torch.optim.AdamW, lr=1e-2)  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        _fit(make, tmp_path, **trainer_kwargs)


@pytest.mark.parametrize(
    ("window", "clip"),
    [(2, None), (3, None), (4, 0.1)],
    ids=["windows-in-the-epoch", "a-window-ends-the-epoch", "clipped"],
)
def test_accumulate_grad_batches_exact_with_the_callback(
    tmp_path: Path, window: int, clip: float | None
):
    """8 batches an epoch: windows of 2 end inside it; of 3, the epoch's last two batches are a
    window Lightning ends early; of 4 with clipping, the loop of docs/frameworks.md (one bucket,
    ``max_grad_norm`` against ``gradient_clip_val``; here 0.1 changes the plain result, 1.0 not)."""
    buckets = dict(bucket_numel=1) if clip is None else dict(max_grad_norm=clip)
    ours = _fit(
        lambda m: OptimizerInBackward(m.parameters(), torch.optim.AdamW, lr=1e-2, **buckets),
        tmp_path / "ours",
        accumulate_grad_batches=window,
        callbacks=[InBackward()],
    )
    plain = _fit(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        tmp_path / "plain",
        accumulate_grad_batches=window,
        gradient_clip_val=clip,
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


@pytest.mark.parametrize(
    ("trainer_kwargs", "match"),
    [
        (dict(gradient_clip_val=0.05), r"max_grad_norm=.*leave gradient_clip_val unset"),
        (_loss_scaling(), r"GradScaler.*bf16-mixed.*skip_nonfinite=True"),
    ],
    ids=["gradient_clip_val", "16-mixed"],
)
def test_refused_by_the_callback_before_anything_moves(tmp_path: Path, trainer_kwargs, match):
    """Without the callback both are refused after the first backward moved: the clip's read
    of the freed gradients, and the scaler's ``unscale_``."""
    initial: list[torch.Tensor] = []
    modules: list[nn.Module] = []

    def make(module: nn.Module) -> Optimizer:
        modules.append(module)
        initial.extend(p.detach().clone() for p in module.parameters())
        return OptimizerInBackward(module.parameters(), torch.optim.AdamW, lr=1e-2)

    with pytest.raises(ValueError, match=match):
        _fit(make, tmp_path, callbacks=[InBackward()], **trainer_kwargs)
    for param, before in zip(modules[0].parameters(), initial, strict=True):
        assert torch.equal(param, before)


def _fit_again(make_optim: MakeOptim, root: Path, how: str, callbacks: list) -> nn.Module:
    """Two fits on one module (``_fit``'s data, an epoch each): ``Tuner.lr_find`` then ``fit``
    on one Trainer, the same Trainer's ``fit`` twice (``max_epochs`` raised), or two Trainers
    in turn, the first still referenced."""
    from lightning.pytorch.tuner import Tuner

    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data)
    module = Regressor(make_optim, one_cycle=False)
    trainers = [
        _trainer(devices=1, max_epochs=1, default_root_dir=root, callbacks=callbacks)
        for _ in range(2 if how == "two trainers" else 1)
    ]
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        if how == "lr_find then fit":
            Tuner(trainers[0]).lr_find(module, loader, num_training=4, update_attr=False)
        else:
            trainers[0].fit(module, loader)
            trainers[-1].fit_loop.max_epochs = 2
        trainers[-1].fit(module, loader)
    return module.net


@pytest.mark.parametrize("how", ["lr_find then fit", "fit twice", "two trainers"])
def test_a_second_fit_on_the_module_equal_plain(tmp_path: Path, how: str):
    """Each fit builds its optimizer (``configure_optimizers``); the last fit's, still
    referenced by the Trainer, held the parameters in backward, and the next was refused as a
    second optimizer in backward where the plain ones train. The callback detaches a fit's
    optimizers when it ends: equal."""
    ours = _fit_again(
        lambda m: OptimizerInBackward(m.parameters(), torch.optim.AdamW, lr=1e-2, bucket_numel=1),
        tmp_path / "ours",
        how,
        [InBackward()],
    )
    plain = _fit_again(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path / "plain", how, []
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


class Finetuned(lightning.LightningModule):
    """Transfer learning as Lightning's ``BackboneFinetuning`` callback runs it: the backbone
    (with a batch norm) frozen before ``configure_optimizers``, which takes the trainable
    parameters (the head), then unfrozen at the second epoch and added to the optimizer as
    a param group at a tenth of the LR, raised at every epoch after, beside a ``StepLR``."""

    def __init__(self, make_optim: Callable[[list[nn.Parameter]], Optimizer]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 16)
        )
        self.head = nn.Linear(16, 1)
        self.make_optim = make_optim

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        optim = self.make_optim([p for p in self.parameters() if p.requires_grad])
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, 1, 0.7)}


@pytest.mark.parametrize("window", [1, 2], ids=["no-accumulation", "accumulate_grad_batches"])
def test_backbone_finetuning_equal_plain(tmp_path: Path, window: int):
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit(make_optim: Callable[[list[nn.Parameter]], Optimizer], ours: bool) -> Finetuned:
        data = torch.Generator().manual_seed(1)
        x, y = torch.randn(48, 8, generator=data), torch.randn(48, 1, generator=data)
        module = Finetuned(make_optim)
        unfreeze = BackboneFinetuning(
            unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, verbose=False
        )
        callbacks = [unfreeze, InBackward()] if ours else [unfreeze]
        root = tmp_path / ("ours" if ours else "plain")
        _fit_one_process(module, root, x, y, accumulate_grad_batches=window, callbacks=callbacks)
        return module

    ours = fit(lambda p: OptimizerInBackward(p, torch.optim.AdamW, lr=1e-2, bucket_numel=1), True)
    plain = fit(lambda p: torch.optim.AdamW(p, lr=1e-2), False)
    optims = [module.trainer.optimizers[0] for module in (ours, plain)]
    assert [len(optim.param_groups) for optim in optims] == [2, 2]
    assert_same_state_dict(optims[0].state_dict(), optims[1].state_dict())
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


class GAN(lightning.LightningModule):
    """Lightning's GAN tutorial in manual optimization: each network's step inside
    ``toggle_optimizer`` (which freezes the parameters of the other optimizer), or, without
    it, the generator's loss also reaching the discriminator's parameters."""

    def __init__(self, make_optim: MakeOptim, toggle: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.make_optim, self.toggle = make_optim, toggle
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [self.make_optim(self.g), self.make_optim(self.d)]

    def _step(self, optim: Any, loss: Callable[[], torch.Tensor]) -> None:
        if self.toggle:
            self.toggle_optimizer(optim)
        self.manual_backward(loss())
        optim.step()
        optim.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(optim)

    def training_step(self, batch: list[torch.Tensor], index: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(real), 4, generator=torch.Generator().manual_seed(index))
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        self._step(opt_g, lambda: bce(self.d(self.g(z)), ones))
        self._step(opt_d, lambda: bce(self.d(real), ones) + bce(self.d(self.g(z).detach()), zeros))


def _fit_gan(make_optim: MakeOptim, root: Path, toggle: bool) -> GAN:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    module = GAN(make_optim, toggle)
    _fit_one_process(module, root, x)
    return module


@pytest.mark.parametrize("cls", [torch.optim.Adam, CompactAdamW])
def test_manual_optimization_gan_equal_plain(tmp_path: Path, cls: type[Optimizer]):
    kwargs = dict(lr=2e-3, betas=(0.5, 0.999))
    ours = _fit_gan(
        lambda net: OptimizerInBackward(net.parameters(), cls, bucket_numel=1, **kwargs),
        tmp_path / "ours",
        toggle=True,
    )
    plain = _fit_gan(lambda net: cls(net.parameters(), **kwargs), tmp_path / "plain", True)
    assert_same_state_dict(ours.state_dict(), plain.state_dict())


def test_manual_optimization_gan_without_toggle_refused(tmp_path: Path):
    """The generator's backward steps the discriminator's parameters in backward (not
    frozen by ``toggle_optimizer``); the discriminator's own loss then runs its forward on the
    updated weights, where the plain loop's reads them before its ``step()``, which steps the
    sum of both gradients: refused at that forward."""
    make = lambda net: OptimizerInBackward(net.parameters(), torch.optim.Adam, lr=2e-3)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"updated in backward with no optimizer\.step\(\)"):
        _fit_gan(make, tmp_path, toggle=False)


# ------------------------------------- FSDP2 through Lightning's ModelParallelStrategy, 2-3 ranks


class ShardedRegressor(Regressor):
    """The same model, sharded by ``fully_shard`` in ``configure_model`` (what
    ``ModelParallelStrategy`` asks for): each ``Linear`` a unit of its own and the root, or the
    root alone (one unit: one bucket, so ``max_grad_norm`` is ``gradient_clip_val`` exactly)."""

    def __init__(self, make_optim: MakeOptim, units: bool) -> None:
        super().__init__(make_optim, one_cycle=True)
        self.units = units

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        if self.units:
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _fit_sharded(
    make_optim: MakeOptim,
    root: Path,
    units: bool,
    epochs: int,
    checkpoint: bool = False,
    ckpt_path: Path | None = None,
    **trainer_kwargs,
) -> dict[str, torch.Tensor]:
    """``Trainer.fit`` on the world the test runs in: Lightning finds the ranks started
    (``LOCAL_RANK`` set) and the process group made, and joins them."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    world_size = os.environ["WORLD_SIZE"]
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data)
    module = ShardedRegressor(make_optim, units)
    saves = [ModelCheckpoint(dirpath=root, save_top_k=-1)] if checkpoint else []
    probe = StepProbe()
    trainer = _trainer(
        devices=int(world_size),
        strategy=ModelParallelStrategy(data_parallel_size=int(world_size), tensor_parallel_size=1),
        max_epochs=epochs,
        default_root_dir=root,
        enable_checkpointing=checkpoint,
        accumulate_grad_batches=2,
        callbacks=[*saves, probe, *trainer_kwargs.pop("callbacks", [])],
        **trainer_kwargs,
    )
    steps_before = 0 if ckpt_path is None else int(Path(ckpt_path).name.split("step=")[1][:-5])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4), ckpt_path=ckpt_path)
    finally:
        # Lightning's environment removes WORLD_SIZE when the fit ends; the ranks live on.
        os.environ["WORLD_SIZE"] = world_size
    if any(isinstance(o, OptimizerInBackward) for o in trainer.optimizers):
        # Every window's last backward stepped the optimizer (no gradient left for step()).
        assert probe.stepped == trainer.global_step - steps_before, (
            probe.stepped,
            trainer.global_step,
        )
    return module.net.state_dict()


class StepProbe(lightning.Callback):
    """Counts the backwards after which no parameter holds a gradient to step."""

    def __init__(self) -> None:
        self.stepped = 0

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        self.stepped += not any(map(holds_gradient, pl_module.parameters()))


def _model_parallel_body(root: str, units: bool, cls: type[Optimizer], precision: str) -> None:
    """Four epochs of accumulated windows of 2 under a per-step ``OneCycleLR`` on the plain
    optimizer, against ours with the callback trained two epochs, saved by ``ModelCheckpoint``
    (Lightning's distributed checkpoint: DCP), and resumed for two more: every rank's shards
    bit for bit. One unit: ``max_grad_norm=0.1`` against ``gradient_clip_val=0.1``."""
    clip = None if units else 0.1
    plain = _fit_sharded(
        lambda m: cls(m.parameters(), lr=1e-2),
        Path(root) / "plain",
        units,
        epochs=4,
        gradient_clip_val=clip,
        precision=precision,
    )

    def ours(module: nn.Module) -> Optimizer:
        return OptimizerInBackward(module.parameters(), cls, lr=1e-2, max_grad_norm=clip)

    saved = Path(root) / "ours"
    callbacks = [InBackward()]
    _fit_sharded(ours, saved, units, 2, True, callbacks=callbacks, precision=precision)
    (last,) = [p for p in saved.iterdir() if p.name.startswith("epoch=1-")]
    resumed = _fit_sharded(
        ours, saved, units, 4, ckpt_path=last, callbacks=callbacks, precision=precision
    )
    assert_same_state_dict(resumed, plain)


@pytest.mark.parametrize(
    ("world_size", "units", "cls", "precision"),
    [
        (2, True, torch.optim.AdamW, "32-true"),
        (3, True, torch.optim.AdamW, "32-true"),
        (2, False, torch.optim.AdamW, "32-true"),
        (3, True, CompactAdamW, "bf16-true"),
    ],
    ids=["units", "odd-world", "one-unit-clipped", "compact-adamw-bf16"],
)
def test_model_parallel_strategy_fsdp2_equal_plain_and_resumes(
    worlds, tmp_path, world_size, units, cls, precision
):
    worlds.run(
        world_size,
        _model_parallel_body,
        root=str(tmp_path),
        units=units,
        cls=cls,
        precision=precision,
    )


def _ddp_strategy_body() -> None:
    """Lightning's DDP strategy wraps the model in ``DistributedDataParallel`` before
    ``configure_optimizers``: refused there, with nothing moved."""
    initial: list[torch.Tensor] = []

    def make(module: nn.Module) -> Optimizer:
        initial.extend(p.detach().clone() for p in module.parameters())
        return OptimizerInBackward(module.parameters(), torch.optim.AdamW, lr=1e-2)

    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    module = Regressor(make, one_cycle=False)
    world_size = os.environ["WORLD_SIZE"]
    trainer = _trainer(devices=int(world_size), strategy="ddp", max_epochs=1)
    try:
        refused = pytest.raises(ValueError, match=r"DistributedDataParallel.*fully_shard")
        with refused, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    finally:
        os.environ["WORLD_SIZE"] = world_size
    assert initial
    for param, before in zip(module.net.parameters(), initial, strict=True):
        assert torch.equal(param, before)


def test_ddp_strategy_refused_before_anything_moves(worlds):
    worlds.run(2, _ddp_strategy_body)
