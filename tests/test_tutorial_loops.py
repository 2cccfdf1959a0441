"""Loops copied from tutorials and reference scripts, plain first, then ours swapped in.

Each loop is written for plain ``torch.optim`` and run unchanged with ``OptimizerInBackward`` on
an identical model and data, with one bucket per parameter (``bucket_numel=1``), so that every
parameter is stepped in backward on its own, the hardest case for ordering. The parameters (and
buffers: spectral normalisation's power-iteration vectors) must end bit for bit equal to the
plain run's: the same kernels on the same gradients.

* A WGAN-GP critic (Gulrajani et al.): a gradient penalty from ``torch.autograd.grad(...,
  create_graph=True)`` on interpolated inputs, then one backward through the double-backward
  graph, with spectral or weight normalisation (``torch.nn.utils.parametrizations``) and
  StyleGAN2's lazy R1 penalty (a second critic step every few iterations); the generator's
  step with the critic frozen.
* LR schedulers stepped per iteration that also write other group values (``OneCycleLR`` and
  ``CyclicLR`` cycle Adam's ``betas`` or SGD's ``momentum``), with a fractional epoch
  (``CosineAnnealingWarmRestarts.step(epoch + i / iters)``), a warmup from almost zero chained
  into a decay, and ``ReduceLROnPlateau`` fed a metric, over two param groups.

* timm's ``Lookahead`` wrapped around the optimizer: its ``step()`` calls the wrapped one's,
  then every ``k`` steps pulls the weights towards slow copies it keeps in the wrapped
  optimizer's state entries (a key of its own beside the moments) and writes counters into
  the param groups; its ``zero_grad()`` is ``torch.optim.Optimizer``'s, which sets each
  gradient to ``None`` itself, and its ``state_dict()`` the wrapped one's.

* Meta-learning and private training without ``backward()`` on the loss alone: MAML's outer
  loss backpropagated through an inner step (second-order, ``create_graph``, and first-order)
  with ``torch.func.functional_call``; DP-SGD's per-example gradients from
  ``vmap(grad(...))``, clipped, noised and set by hand before ``step()``.
* Truncated backpropagation through time: an LSTM language model over consecutive windows,
  the hidden state carried and detached.
* Iterative magnitude pruning mid-training (``torch.nn.utils.prune``: weights renamed and
  masked by a forward pre-hook, pruned again, then made permanent through ``.data =``); an
  LR range test (state dicts saved, a growing LR under a scheduler of its own, both loaded
  back) before a ``OneCycleLR`` run; stochastic weight averaging (``AveragedModel``, ``SWALR``,
  ``update_bn``) and an EMA of parameters and buffers.

The WGAN-GP loop runs with torch's Adam and with ``CompactAdamW``, and ``OneCycleLR`` cycles
``CompactAdamW``'s betas too: each stepped in backward against the same class stepped plainly.

With FSDP2 the plain optimizer's WGAN-GP loop itself fails in the critic's backward (the
unsharded weights the penalty's double backward reads were freed), so it runs on a plain module
only.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable

import pytest
import torch
from _toy import assert_same_state_dict
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrizations, prune
from torch.optim import Optimizer, swa_utils
from torch.optim import lr_scheduler as schedulers

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW

MakeOptim = Callable[[object, type[Optimizer], dict], Optimizer]


def _plain(params: object, cls: type[Optimizer], kwargs: dict) -> Optimizer:
    return cls(params, **kwargs)


def _ours(params: object, cls: type[Optimizer], kwargs: dict) -> Optimizer:
    return OptimizerInBackward(params, cls, bucket_numel=1, **kwargs)


def _mlp() -> nn.Sequential:
    """The regression MLP of the loops below, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _regression_step(model: nn.Module, optim: Optimizer, data: torch.Generator) -> None:
    """One step of the loops below, as torch's tutorials write it: a batch of 16 drawn from
    ``data``, ``zero_grad()``, the forward and backward, ``step()``."""
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def _linear(fan_in: int, fan_out: int, norm: str) -> nn.Module:
    layer = nn.Linear(fan_in, fan_out)
    if norm == "spectral":
        return parametrizations.spectral_norm(layer)
    if norm == "weight":
        return parametrizations.weight_norm(layer)
    return layer


def _wgan_gp(
    make_optim: MakeOptim, cls: type[Optimizer], norm: str, lazy_r1: bool
) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    critic = nn.Sequential(
        _linear(8, 16, norm), nn.LeakyReLU(0.2), _linear(16, 16, norm), nn.LeakyReLU(0.2),
        _linear(16, 1, norm),
    )  # fmt: skip
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    betas = dict(lr=1e-3, betas=(0.5, 0.9))
    optim_c = make_optim(critic.parameters(), cls, betas)
    optim_g = make_optim(generator.parameters(), cls, betas)
    data = torch.Generator().manual_seed(1)
    for step in range(6):
        real = torch.randn(16, 8, generator=data) + 1
        z = torch.randn(16, 4, generator=data)
        fake = generator(z)

        optim_c.zero_grad()
        mix = torch.rand(16, 1, generator=data)
        between = (mix * real + (1 - mix) * fake.detach()).requires_grad_(True)
        (slope,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
        penalty = 10 * ((slope.norm(2, dim=1) - 1) ** 2).mean()
        (critic(fake.detach()).mean() - critic(real).mean() + penalty).backward()
        optim_c.step()
        if lazy_r1 and step % 3 == 0:
            optim_c.zero_grad()
            real.requires_grad_(True)
            (slope,) = torch.autograd.grad(critic(real).sum(), real, create_graph=True)
            (5 * slope.square().sum(1).mean()).backward()
            optim_c.step()

        critic.requires_grad_(False)
        optim_g.zero_grad()
        (-critic(generator(z)).mean()).backward()
        optim_g.step()
        critic.requires_grad_(True)
    return critic, generator


@pytest.mark.parametrize("lazy_r1", [False, True], ids=["penalty", "lazy-r1"])
@pytest.mark.parametrize("norm", ["plain", "spectral", "weight"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, CompactAdamW], ids=lambda c: c.__name__)
def test_wgan_gp_equal_plain(cls: type[Optimizer], norm: str, lazy_r1: bool):
    for ours, plain in zip(
        _wgan_gp(_ours, cls, norm, lazy_r1), _wgan_gp(_plain, cls, norm, lazy_r1), strict=True
    ):
        assert_same_state_dict(ours.state_dict(), plain.state_dict())


SCHEDULES = {
    "one-cycle-adam-betas": (
        torch.optim.Adam,
        dict(lr=1e-3),
        lambda o: schedulers.OneCycleLR(o, max_lr=1e-2, total_steps=15),
    ),
    "one-cycle-nesterov-momentum": (
        torch.optim.SGD,
        dict(lr=1e-3, momentum=0.9, nesterov=True),
        lambda o: schedulers.OneCycleLR(o, max_lr=1e-2, total_steps=15),
    ),
    "one-cycle-compact-adamw-betas": (
        CompactAdamW,
        dict(lr=1e-3),
        lambda o: schedulers.OneCycleLR(o, max_lr=1e-2, total_steps=15),
    ),
    "cyclic-momentum": (
        torch.optim.SGD,
        dict(lr=1e-3, momentum=0.9),
        lambda o: schedulers.CyclicLR(o, 1e-4, 1e-2, step_size_up=3),
    ),
    "warm-restarts-fractional-epoch": (
        torch.optim.AdamW,
        dict(lr=1e-2),
        lambda o: schedulers.CosineAnnealingWarmRestarts(o, T_0=2),
    ),
    "warmup-from-almost-zero-then-cosine": (
        torch.optim.AdamW,
        dict(lr=1e-2),
        lambda o: schedulers.SequentialLR(
            o,
            [
                schedulers.LinearLR(o, start_factor=1e-8, total_iters=4),
                schedulers.CosineAnnealingLR(o, 10),
            ],
            milestones=[4],
        ),
    ),
    "plateau": (
        torch.optim.NAdam,
        dict(lr=1e-2),
        lambda o: schedulers.ReduceLROnPlateau(o, patience=0, factor=0.5),
    ),
}


def _scheduled(make_optim: MakeOptim, name: str) -> nn.Module:
    cls, kwargs, make_scheduler = SCHEDULES[name]
    model = _mlp()
    groups = [
        {"params": model[0].parameters()},
        {"params": [*model[2].parameters(), *model[4].parameters()], "lr": 2 * kwargs["lr"]},
    ]
    optim = make_optim(groups, cls, kwargs)
    scheduler = make_scheduler(optim)
    data = torch.Generator().manual_seed(1)
    iters = 3
    for epoch in range(5):
        for i in range(iters):
            x, y = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            if isinstance(scheduler, schedulers.ReduceLROnPlateau):
                scheduler.step(round(loss.item(), 1))
            elif isinstance(scheduler, schedulers.CosineAnnealingWarmRestarts):
                scheduler.step(epoch + i / iters)
            else:
                scheduler.step()
    return model


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedulers_stepped_per_iteration_equal_plain(name: str):
    assert_same_state_dict(
        _scheduled(_ours, name).state_dict(), _scheduled(_plain, name).state_dict()
    )


class _Lookahead(Optimizer):
    """Lookahead (Zhang et al., 2019) as timm's ``timm.optim.Lookahead`` wraps an optimizer:
    the wrapped optimizer's groups and state are its own, ``Optimizer.__init__`` is not called
    (so ``zero_grad()`` walks the shared groups itself), and the slow weights are kept in the
    wrapped optimizer's state entries."""

    def __init__(self, base: Optimizer, alpha: float = 0.5, k: int = 3) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = defaultdict(dict)
        # Optimizer.zero_grad() wraps the class's step() in torch's hook-running wrapper,
        # which reads these (timm sets them too).
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def sync(self, group: dict) -> None:
        for fast in group["params"]:
            if fast.grad is None:
                continue
            entry = self.base.state[fast]
            if "lookahead_slow_buff" not in entry:
                entry["lookahead_slow_buff"] = fast.clone()
            slow = entry["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.sync(group)
        return loss

    def state_dict(self) -> dict:
        return self.base.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.base.load_state_dict(state_dict)
        self.param_groups = self.base.param_groups


def _lookahead(make_optim: MakeOptim, cls: type[Optimizer]) -> tuple[nn.Module, dict]:
    """Eight steps of a Lookahead-wrapped ``cls`` with a schedule, as timm's ``train.py``
    loops (``zero_grad()`` before each forward), its state saved and loaded back after the
    fourth, and the weights synced to the slow ones at the end of the epoch, the last step's
    gradients still held (ours: freed, which ``is not None`` as the plain ones); the model and
    the optimizer's state dict."""
    model = _mlp()
    optim = _Lookahead(make_optim(model.parameters(), cls, dict(lr=1e-2, weight_decay=0.01)))
    scheduler = schedulers.StepLR(optim, step_size=2, gamma=0.5)
    data = torch.Generator().manual_seed(1)
    for step in range(8):
        _regression_step(model, optim, data)
        scheduler.step()
        if step == 3:
            optim.load_state_dict(optim.state_dict())
    for group in optim.param_groups:
        optim.sync(group)
    return model, optim.state_dict()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, CompactAdamW], ids=lambda c: c.__name__)
def test_lookahead_wrapper_equal_plain(cls: type[Optimizer]):
    (ours, ours_state), (plain, plain_state) = _lookahead(_ours, cls), _lookahead(_plain, cls)
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert_same_state_dict(ours_state, plain_state)
    assert all("lookahead_slow_buff" in entry for entry in plain_state["state"].values())


def _maml(
    make_optim: MakeOptim, cls: type[Optimizer], second_order: bool
) -> tuple[nn.Module, dict]:
    """MAML (Finn et al.) as ``torch.func`` writes it: one inner SGD step on a task's support
    set through ``functional_call`` with the adapted weights, the outer loss on its query set
    backpropagated through that step (``create_graph``: the second-order terms read the
    weights the inner forward saved, so a weight stepped before they run would be read
    updated); four tasks a meta-batch, their outer losses summed into one backward."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    optim = make_optim(model.parameters(), cls, dict(lr=1e-2))
    data = torch.Generator().manual_seed(1)
    for _ in range(5):
        optim.zero_grad()
        outer = 0.0
        for _ in range(4):
            amplitude, phase = torch.rand(2, generator=data) * 3
            x = torch.rand(16, 4, generator=data) * 4 - 2
            y = amplitude * torch.sin(x.sum(1, keepdim=True) + phase)
            support, query = (x[:8], y[:8]), (x[8:], y[8:])
            weights = dict(model.named_parameters())
            inner = nn.functional.mse_loss(functional_call(model, weights, support[0]), support[1])
            grads = torch.autograd.grad(inner, list(weights.values()), create_graph=second_order)
            adapted = {
                name: w - 0.1 * g for (name, w), g in zip(weights.items(), grads, strict=True)
            }
            outer = outer + nn.functional.mse_loss(
                functional_call(model, adapted, query[0]), query[1]
            )
        outer.backward()
        optim.step()
    return model, optim.state_dict()


@pytest.mark.parametrize("second_order", [True, False], ids=["second-order", "first-order"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, CompactAdamW], ids=lambda c: c.__name__)
def test_maml_meta_training_equal_plain(cls: type[Optimizer], second_order: bool):
    (ours, ours_state), (plain, plain_state) = (
        _maml(make, cls, second_order) for make in (_ours, _plain)
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert_same_state_dict(ours_state, plain_state)


def _dp_sgd(make_optim: MakeOptim, cls: type[Optimizer], kwargs: dict) -> tuple[nn.Module, dict]:
    """DP-SGD (Abadi et al.) as Opacus computes it with ``torch.func``: per-example gradients
    (``vmap(grad(...))``, no ``backward()``), each clipped to norm 1, summed, noised and
    averaged, set by hand on the parameters, then ``step()`` and ``zero_grad()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optim = make_optim(model.parameters(), cls, kwargs)
    data = torch.Generator().manual_seed(1)

    def example_loss(weights: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, weights, x[None]), y[None])

    per_example_grads = vmap(grad(example_loss), in_dims=(None, 0, 0))
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=data), torch.randint(0, 2, (16,), generator=data)
        weights = {name: w.detach() for name, w in model.named_parameters()}
        grads = per_example_grads(weights, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for name, param in model.named_parameters():
            clipped = torch.einsum("n,n...->...", factors, grads[name])
            noise = 0.5 * torch.randn(param.shape, generator=data)
            param.grad = (clipped + noise) / len(x)
        optim.step()
        optim.zero_grad()
    return model, optim.state_dict()


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(torch.optim.SGD, dict(lr=0.5, momentum=0.9)), (CompactAdamW, dict(lr=1e-2))],
    ids=["SGD", "CompactAdamW"],
)
def test_dp_sgd_per_example_gradients_equal_plain(cls: type[Optimizer], kwargs: dict):
    (ours, ours_state), (plain, plain_state) = (
        _dp_sgd(make, cls, kwargs) for make in (_ours, _plain)
    )
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert_same_state_dict(ours_state, plain_state)


def _truncated_bptt(make_optim: MakeOptim) -> tuple[nn.Module, dict]:
    """A language model's truncated backpropagation through time, as PyTorch's
    ``word_language_model`` example trains it: a two-layer LSTM over consecutive windows of one
    long sequence, its hidden state carried from window to window and detached, one
    ``backward()`` and ``step()`` per window. Each weight is read at every time step of the
    window, so its gradient is complete only when the backward reaches the window's start."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        dict(embed=nn.Embedding(12, 8), lstm=nn.LSTM(8, 16, num_layers=2), head=nn.Linear(16, 12))
    )
    optim = make_optim(model.parameters(), torch.optim.Adam, dict(lr=1e-2))
    tokens = torch.randint(0, 12, (41, 4), generator=torch.Generator().manual_seed(1))
    hidden = None
    for start in range(0, 40, 8):
        x, y = tokens[start : start + 8], tokens[start + 1 : start + 9]
        if hidden is not None:
            hidden = tuple(h.detach() for h in hidden)
        out, hidden = model["lstm"](model["embed"](x), hidden)
        loss = nn.functional.cross_entropy(model["head"](out).flatten(0, 1), y.flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model, optim.state_dict()


def test_truncated_bptt_equal_plain():
    (ours, ours_state), (plain, plain_state) = (_truncated_bptt(make) for make in (_ours, _plain))
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert_same_state_dict(ours_state, plain_state)


def _pruned(make_optim: MakeOptim, cls: type[Optimizer]) -> tuple[nn.Module, dict]:
    """Iterative magnitude pruning as PyTorch's pruning tutorial applies it, mid-training:
    after two steps the hidden layers' weights are pruned globally by magnitude (each weight
    becomes ``weight_orig``, the same parameter renamed, times a mask buffer a forward
    pre-hook applies), a layer is pruned again two steps later (the masks compose), then the
    pruning is made permanent (``prune.remove`` assigns the masked values to the parameter
    through ``.data =``), and training goes on. The masked entries keep moving under weight
    decay and momentum while masked, as the plain optimizer moves them. The structured prune
    draws its rows from torch's generator, seeded by ``_mlp``: the same rows in both loops
    unless the optimizer draws from it in between."""
    model = _mlp()
    optim = make_optim(model.parameters(), cls, dict(lr=1e-2, weight_decay=0.1))
    hidden = [model[0], model[2]]
    data = torch.Generator().manual_seed(1)
    for step in range(8):
        if step == 2:
            prune.global_unstructured(
                [(layer, "weight") for layer in hidden], prune.L1Unstructured, amount=0.4
            )
        if step == 4:
            prune.random_structured(model[2], "weight", amount=0.25, dim=0)
        if step == 6:
            for layer in hidden:
                prune.remove(layer, "weight")
        _regression_step(model, optim, data)
    return model, optim.state_dict()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, CompactAdamW], ids=lambda c: c.__name__)
def test_pruning_mid_training_equal_plain(cls: type[Optimizer]):
    (ours, ours_state), (plain, plain_state) = (_pruned(make, cls) for make in (_ours, _plain))
    assert_same_state_dict(ours.state_dict(), plain.state_dict())
    assert_same_state_dict(ours_state, plain_state)


def _lr_range_test(make_optim: MakeOptim, cls: type[Optimizer], kwargs: dict) -> nn.Module:
    """An LR range test before training, as ``torch-lr-finder`` and fastai's ``lr_find`` run
    it: the model's and optimizer's state dicts saved, a few steps at a learning rate growing
    exponentially from 1e-5 under a scheduler of its own (written over the one the loop built),
    both state dicts loaded back, then training under the loop's ``OneCycleLR``."""
    model = _mlp()
    optim = make_optim(model.parameters(), cls, kwargs)
    scheduler = schedulers.OneCycleLR(optim, max_lr=5e-2, total_steps=10)
    saved_model, saved_optim = copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())
    for group in optim.param_groups:
        group["lr"] = 1e-5
    finder = schedulers.ExponentialLR(optim, gamma=4.0)
    data = torch.Generator().manual_seed(1)
    for _ in range(5):
        _regression_step(model, optim, data)
        finder.step()
    model.load_state_dict(saved_model)
    optim.load_state_dict(saved_optim)
    for _ in range(8):
        _regression_step(model, optim, data)
        scheduler.step()
    return model


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (CompactAdamW, dict(lr=1e-2)),
    ],
    ids=["Adam-amsgrad", "SGD", "CompactAdamW"],
)
def test_lr_range_test_then_training_equal_plain(cls: type[Optimizer], kwargs: dict):
    assert_same_state_dict(
        _lr_range_test(_ours, cls, kwargs).state_dict(),
        _lr_range_test(_plain, cls, kwargs).state_dict(),
    )


def _swa(make_optim: MakeOptim, cls: type[Optimizer], ema: bool) -> tuple[nn.Module, ...]:
    """Stochastic weight averaging as PyTorch's SWA recipe writes it: ``AveragedModel`` (a
    deep copy of the model, taken after the optimizer was built), a cosine schedule, then
    ``SWALR`` (which writes ``swa_lr`` into the param groups) from the fourth epoch, the
    average updated once an epoch after ``step()``, and ``update_bn`` on the average at the
    end; or an exponential moving average of parameters and buffers updated after every
    ``step()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    optim = make_optim(model.parameters(), cls, dict(lr=1e-2))
    scheduler = schedulers.CosineAnnealingLR(optim, T_max=10)
    if ema:
        average = swa_utils.AveragedModel(
            model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
        )
    else:
        average = swa_utils.AveragedModel(model)
    swa_scheduler = swa_utils.SWALR(optim, swa_lr=5e-3, anneal_epochs=2)
    data = torch.Generator().manual_seed(1)
    loader = [
        (torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data))
        for _ in range(3)
    ]
    for epoch in range(6):
        for x, y in loader:
            optim.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optim.step()
            if ema:
                average.update_parameters(model)
        if epoch < 3:
            scheduler.step()
            continue
        if not ema:
            average.update_parameters(model)
        swa_scheduler.step()
    swa_utils.update_bn([x for x, _ in loader], average)
    return model, average


@pytest.mark.parametrize("ema", [False, True], ids=["swa", "ema"])
@pytest.mark.parametrize("cls", [torch.optim.SGD, CompactAdamW], ids=lambda c: c.__name__)
def test_weight_averaging_equal_plain(cls: type[Optimizer], ema: bool):
    for ours, plain in zip(_swa(_ours, cls, ema), _swa(_plain, cls, ema), strict=True):
        assert_same_state_dict(ours.state_dict(), plain.state_dict())
