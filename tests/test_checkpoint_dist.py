"""Sharded checkpoints of OptimizerInBackward: plain DCP and ``fused_optim_dist.checkpoint``.

A run saved after ``SAVE_AT`` steps and resumed on another number of ranks (or with the plain
optimizer instead of the in-backward one, or the reverse) must end where an uninterrupted plain
torch.optim run on an unsharded copy ends (gloo, CPU, real processes).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _toy import (
    DIM,
    HIDDEN,
    ToyModel,
    assert_match,
    assert_same_state_dict,
    batch,
    full,
    holds_gradient,
    loss_fn,
    rank_slice,
    shard,
    train_reference,
)
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from fused_optim_dist import OptimizerInBackward, checkpoint
from fused_optim_dist import _checkpoint_layout as layout

SAVE_AT, TOTAL = 3, 6
RESUME_ATOL = 1e-5
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "AdamW-amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}
COMMIT_TIMEOUT_S = 300
"""How long the async-save test waits for a background commit or for its own release of the
write: a hang detector, sized for a loaded machine (the commit takes well under a second)."""
MOMENTS = {"AdamW": ("step", "exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}


def _lr_factor(epoch: int) -> float:
    return 1.0 / (1.0 + 0.5 * epoch)


class Run(NamedTuple):
    model: nn.Module
    optim: torch.optim.Optimizer
    scheduler: LambdaLR


def _run(
    name: str = "AdamW",
    *,
    in_backward: bool = True,
    sharded: bool = True,
    seed: int = 0,
    model: nn.Module | None = None,
) -> Run:
    """The toy model, two param groups (the blocks; the rest at half the lr, no weight decay)
    and an LR schedule. ``seed`` picks the initial weights, so a resumed run starts elsewhere.
    """
    if model is None:
        torch.manual_seed(seed)
        model = ToyModel()
    if sharded:
        shard(model)
    cls, kwargs = OPTIMIZERS[name]
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.startswith("layers.")]},
        {
            "params": [p for n, p in named if not n.startswith("layers.")],
            "lr": kwargs["lr"] / 2,
            "weight_decay": 0.0,
        },
    ]
    optim = OptimizerInBackward(groups, cls, **kwargs) if in_backward else cls(groups, **kwargs)
    return Run(model, optim, LambdaLR(optim, _lr_factor))


def _train(run: Run, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        loss_fn(run.model, rank_slice(x), rank_slice(y)).backward()
        run.optim.step()
        run.optim.zero_grad()
        run.scheduler.step()


def _reference(name: str, steps: int) -> Run:
    """Plain torch.optim on an unsharded copy, ``steps`` steps on the global batch."""
    ref = _run(name, in_backward=False, sharded=False)
    train_reference(ref.model, ref.optim, steps, ref.scheduler)
    return ref


def _is_root_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -- resharding: save on N ranks, resume on M, against an uninterrupted plain run -------------


class Variant(NamedTuple):
    optimizer: str
    saved_in_backward: bool
    loaded_in_backward: bool
    loaded_sharded: bool

    @property
    def source(self) -> str:
        return f"{self.optimizer}-{'in_backward' if self.saved_in_backward else 'plain'}"


IB, PLAIN, SHARDED, UNSHARDED = True, False, True, False
RESHARD_CASES = {
    "4->2": (
        4,
        2,
        [
            Variant("AdamW", IB, IB, SHARDED),
            Variant("SGD", IB, IB, SHARDED),
            Variant("AdamW", IB, PLAIN, SHARDED),
        ],
    ),
    "2->4": (
        2,
        4,
        [
            Variant("AdamW", IB, IB, SHARDED),
            Variant("SGD", IB, IB, SHARDED),
            Variant("AdamW", PLAIN, IB, SHARDED),
        ],
    ),
    "1->2": (1, 2, [Variant("AdamW", IB, IB, SHARDED), Variant("SGD", IB, IB, SHARDED)]),
    "2->1": (
        2,
        1,
        [
            Variant("AdamW", IB, IB, SHARDED),
            Variant("SGD", IB, IB, UNSHARDED),
            Variant("AdamW", IB, PLAIN, UNSHARDED),
        ],
    ),
}


def _save_body(root: str, variants: list[Variant]) -> None:
    for name, in_backward in sorted({(v.optimizer, v.saved_in_backward) for v in variants}):
        variant = Variant(name, in_backward, in_backward, SHARDED)
        run = _run(name, in_backward=in_backward)
        _train(run, range(SAVE_AT))
        extra = {"scheduler": run.scheduler.state_dict()}
        checkpoint.save(Path(root) / variant.source, *run[:2], step=SAVE_AT, extra=extra)


def _resume_body(root: str, variants: list[Variant]) -> None:
    for variant in variants:
        name = variant.optimizer
        run = _run(
            name, in_backward=variant.loaded_in_backward, sharded=variant.loaded_sharded, seed=1
        )
        step, extra = checkpoint.load(Path(root) / variant.source, run.model, run.optim)
        assert step == SAVE_AT
        run.scheduler.load_state_dict(extra["scheduler"])
        _train(run, range(step, TOTAL))
        assert_match(run.model, _reference(name, TOTAL).model, atol=RESUME_ATOL)
        if variant.loaded_in_backward:
            assert all(not holds_gradient(p) for p in run.model.parameters())


@pytest.mark.parametrize("case", list(RESHARD_CASES))
def test_resume_on_another_world_size_continues_the_run(worlds, tmp_path, case):
    save_ranks, load_ranks, variants = RESHARD_CASES[case]
    worlds.run(save_ranks, _save_body, root=str(tmp_path), variants=variants)
    worlds.run(load_ranks, _resume_body, root=str(tmp_path), variants=variants)
    if case == "2->1":
        # An unsharded model and plain AdamW in a process without any process group.
        _resume_body(str(tmp_path), [Variant("AdamW", IB, PLAIN, UNSHARDED)])


# -- plain DCP: get/set_state_dict with every option, dcp.save / async_save / load ------------

# label: options of get_state_dict, options of set_state_dict (None: not loaded back, as
# torch 2.13 itself fails to load a full flattened optimizer state dict, plain optimizers too:
# KeyError 'param_groups.0.params.0'; with broadcast_from_rank0 as well).
OPTION_SETS = [
    ("sharded", {}, {}),
    ("full", dict(full_state_dict=True), dict(full_state_dict=True)),
    ("flat", dict(flatten_optimizer_state_dict=True), dict(flatten_optimizer_state_dict=True)),
    ("full-flat", dict(full_state_dict=True, flatten_optimizer_state_dict=True), None),
    (
        "rank0-offload-broadcast",
        dict(full_state_dict=True, cpu_offload=True),
        dict(full_state_dict=True, broadcast_from_rank0=True),
    ),
]


def _set(run: Run, model_state: dict, optim_state: dict, options: StateDictOptions) -> None:
    if options.broadcast_from_rank0:
        # Two calls: in torch 2.13 set_state_dict skips the model on ranks that pass an empty
        # model state dict, so they never join rank 0's broadcast (a hang, plain optimizers too).
        set_model_state_dict(run.model, model_state, options=options)
        set_optimizer_state_dict(run.model, run.optim, optim_state, options=options)
    else:
        set_state_dict(
            run.model,
            run.optim,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=options,
        )


def _moments(optim_state: dict, fqn: str, key: str, flat: bool) -> object:
    return optim_state[f"state.{fqn}.{key}"] if flat else optim_state["state"][fqn][key]


def _check_moments(optim_state: dict, reference: Run, options: dict, label: str) -> None:
    """Every trainable parameter's moments, as shards unless a full state dict was asked for."""
    ref_state = get_optimizer_state_dict(reference.model, reference.optim)
    flat = options.get("flatten_optimizer_state_dict", False)
    if options.get("cpu_offload") and not _is_root_rank():
        assert optim_state == {}, f"{label}: only rank 0 holds an offloaded full state dict"
        return
    for fqn, param in reference.model.named_parameters():
        for key in MOMENTS["AdamW"]:
            value = _moments(optim_state, fqn, key, flat)
            expected = ref_state["state"][fqn][key]
            if key != "step" and not options.get("full_state_dict"):
                assert isinstance(value, DTensor), f"{label}: {fqn}.{key} is not a shard"
            elif key != "step":
                assert type(value) is torch.Tensor, f"{label}: {fqn}.{key} is not a full tensor"
            torch.testing.assert_close(
                full(value),
                expected,
                atol=1e-6,
                rtol=1e-5,
                msg=lambda m, f=fqn, k=key: f"{label} {f}.{k}: {m}",
            )
        assert param.shape == full(_moments(optim_state, fqn, "exp_avg", flat)).shape


def _dcp_options_body(root: str) -> None:
    run = _run()
    _train(run, range(SAVE_AT))
    at_save, at_end = _reference("AdamW", SAVE_AT), _reference("AdamW", TOTAL)
    for label, get_options, set_options in OPTION_SETS:
        model_state, optim_state = get_state_dict(
            run.model, run.optim, options=StateDictOptions(**get_options)
        )
        _check_moments(optim_state, at_save, get_options, label)
        if set_options is None:
            continue
        # The loaded optimizer may adopt these tensors as its state (torch.optim's
        # load_state_dict keeps e.g. ``step`` as is): give it copies, not ``run``'s state.
        optim_state = copy.deepcopy(optim_state)
        resumed = _run(seed=1)
        _set(resumed, model_state, optim_state, StateDictOptions(**set_options))
        resumed.scheduler.load_state_dict(run.scheduler.state_dict())
        _train(resumed, range(SAVE_AT, TOTAL))
        assert_match(resumed.model, at_end.model, atol=RESUME_ATOL)
    model_state, optim_state = get_state_dict(run.model, run.optim)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=Path(root) / "sync")
    dcp.async_save(state, checkpoint_id=Path(root) / "async").result()
    if _is_root_rank():
        torch.save(run.scheduler.state_dict(), Path(root) / "scheduler.pt")


def _dcp_load_body(root: str) -> None:
    at_end = _reference("AdamW", TOTAL)
    for folder in ("sync", "async"):
        for in_backward in (True, False):
            run = _run(in_backward=in_backward, seed=1)
            model_state, optim_state = get_state_dict(run.model, run.optim)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=Path(root) / folder)
            set_state_dict(
                run.model,
                run.optim,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
            run.scheduler.load_state_dict(torch.load(Path(root) / "scheduler.pt"))
            _train(run, range(SAVE_AT, TOTAL))
            assert_match(run.model, at_end.model, atol=RESUME_ATOL)


def test_plain_dcp_with_every_option_and_resharding(worlds, tmp_path):
    worlds.run(4, _dcp_options_body, root=str(tmp_path))
    worlds.run(2, _dcp_load_body, root=str(tmp_path))


# -- a save that dies before its commit ---------------------------------------------------------


def _write_then_fail(self, plan, planner):
    written = _ORIGINAL_WRITE(self, plan, planner)
    written.wait()
    raise OSError("simulated death of this rank after writing its shard")


_ORIGINAL_WRITE = FileSystemWriter.write_data


def _assert_resumes_at(root: Path, step: int) -> None:
    run = _run(seed=1)
    loaded_step, extra = checkpoint.load(root, run.model, run.optim)
    assert loaded_step == step
    reference = _reference("AdamW", step)
    assert extra == {"scheduler": reference.scheduler.state_dict()}
    assert_match(run.model, reference.model, atol=RESUME_ATOL)


def _crash_body(root: str) -> None:
    root = Path(root)
    run = _run()
    _train(run, range(2))
    checkpoint.save(root, *run[:2], step=2, extra={"scheduler": run.scheduler.state_dict()})
    _train(run, range(2, 4))
    extra = {"scheduler": run.scheduler.state_dict()}
    tmp = layout.tmp_dir(layout.step_dir(root, 4))

    # Rank 1 dies after writing its shard: DCP reports it on every rank, nothing is committed.
    with (
        mock.patch.object(
            FileSystemWriter,
            "write_data",
            _write_then_fail if dist.get_rank() == 1 else _ORIGINAL_WRITE,
        ),
        # Rank 0's outcome on every rank, named once (see [Note: async commit]).
        pytest.raises(
            RuntimeError,
            match=r"^on rank 0: writing checkpoint step 4 into .* failed, so it was not "
            r"committed: ",
        ),
    ):
        checkpoint.save(root, *run[:2], step=4, extra=extra)
    assert (tmp / f"__{dist.get_rank()}_0.distcp").is_file(), "the shard was written"
    assert checkpoint.latest(root) == layout.step_dir(root, 2)
    _assert_resumes_at(root, 2)

    # Every shard and DCP's .metadata are written; rank 0 dies before the commit.
    with (
        mock.patch.object(layout, "commit", side_effect=OSError("simulated death before commit")),
        pytest.raises(OSError, match=r"^on rank 0: simulated death before commit$"),
    ):
        checkpoint.save(root, *run[:2], step=4, extra=extra)
    assert (tmp / ".metadata").is_file()
    assert checkpoint.latest(root) == layout.step_dir(root, 2)
    _assert_resumes_at(root, 2)

    # The next save of the same step succeeds and clears the debris; keep_last prunes.
    checkpoint.save(root, *run[:2], step=4, extra=extra)
    _assert_resumes_at(root, 4)
    _train(run, range(4, 6))
    checkpoint.save(
        root, *run[:2], step=6, extra={"scheduler": run.scheduler.state_dict()}, keep_last=2
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]
    _assert_resumes_at(root, 6)
    with pytest.raises(FileExistsError, match="step_000006 already exists"):
        checkpoint.save(root, *run[:2], step=6)


def test_save_killed_before_commit_leaves_the_previous_checkpoint(worlds, tmp_path):
    worlds.run(2, _crash_body, root=str(tmp_path))


# -- mismatches: named, raised before anything changes ------------------------------------------


def _wide_block_model() -> ToyModel:
    """The toy model with a wider hidden layer in block 1."""
    torch.manual_seed(0)
    model = ToyModel()
    model.layers[1].up = nn.Linear(DIM, HIDDEN + 1)
    model.layers[1].down = nn.Linear(HIDDEN + 1, DIM)
    return model


class _Bfloat16Model(ToyModel):
    """The toy model in bfloat16 (inputs cast to it, outputs back), the same tensor names."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(torch.bfloat16)).float()


def _frozen_inp_model() -> ToyModel:
    torch.manual_seed(0)
    model = ToyModel()
    model.inp.weight.requires_grad_(False)
    return model


# label: how the run loading the (AdamW, all trainable, 3 blocks) checkpoint differs; the error
MISMATCHES = [
    (
        "missing",
        lambda: _run(model=ToyModel(n_layers=4)),
        r"'layers\.3\.up\.weight' is in the model but not in the checkpoint",
    ),
    (
        "unexpected",
        lambda: _run(model=ToyModel(n_layers=2)),
        r"'layers\.2\.up\.weight' is in the checkpoint but not in the model",
    ),
    (
        "shape",
        lambda: _run(model=_wide_block_model()),
        r"'layers\.1\.up\.weight' has shape \(4, 6\) in the model but \(3, 6\) in the checkpoint",
    ),
    (
        "optimizer",
        lambda: _run("SGD"),
        r"holds torch\.optim\.adamw\.AdamW state but .* runs torch\.optim\.sgd\.SGD",
    ),
    (
        "model_dtype",
        lambda: _run(model=_Bfloat16Model()),
        r"'inp\.weight' has dtype bfloat16 in the model but float32 in the checkpoint",
    ),
    (
        # The same class, and DCP would fail halfway: no max_exp_avg_sq in the checkpoint.
        "state_keys",
        lambda: _run("AdamW-amsgrad"),
        r"optimizer state 'inp\.weight\.max_exp_avg_sq' is in the optimizer but not in the "
        "checkpoint",
    ),
]
# label: the checkpoint (written by the plain optimizer) a default run refuses; the error
STATE_MISMATCHES = [
    (
        "state_extra_keys",
        "AdamW-amsgrad",
        lambda state: None,
        r"optimizer state 'inp\.weight\.max_exp_avg_sq' is in the checkpoint but not in the "
        "optimizer",
    ),
    (
        "state_dtype",
        "AdamW",
        lambda state: state.update(exp_avg_sq=state["exp_avg_sq"].double()),
        r"optimizer state 'inp\.weight\.exp_avg_sq' is float32 \(6, 4\) in the optimizer but "
        r"float64 \(6, 4\) in the checkpoint",
    ),
    (
        "state_shape",
        "AdamW",
        lambda state: state.update(step=state["step"].reshape(1)),
        r"optimizer state 'inp\.weight\.step' is float32 \(\) in the optimizer but float32 "
        r"\(1,\) in the checkpoint",
    ),
]


def _snapshot(run: Run) -> dict:
    return {
        "params": {n: full(p).clone() for n, p in run.model.named_parameters()},
        "state": {
            id(p): {k: full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in run.optim.state.items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in run.optim.param_groups],
    }


def _assert_unchanged(run: Run, before: dict, label: str) -> None:
    after = _snapshot(run)
    assert after.keys() == before.keys()
    for key in before:
        assert_same_state_dict(after[key], before[key], path=label)
    assert all(not holds_gradient(p) for p in run.model.parameters()), label


def _tampered_checkpoint(root: Path, name: str, tamper) -> Path:
    """A checkpoint of the plain optimizer ``name`` after one step, each parameter's state
    changed by ``tamper`` before saving."""
    run = _run(name, in_backward=False)
    _train(run, range(1))
    for state in run.optim.state.values():
        tamper(state)
    checkpoint.save(root, *run[:2], step=1)
    return root


def _mismatch_body(root: str) -> None:
    root = Path(root)
    saved = _run()
    _train(saved, range(1))
    checkpoint.save(root / "full", *saved[:2], step=1)
    frozen = _run(model=_frozen_inp_model())
    _train(frozen, range(1))
    checkpoint.save(root / "frozen", *frozen[:2], step=1)
    cases = [(label, make, root / "full", pattern) for label, make, pattern in MISMATCHES]
    cases.append(
        (
            "unfrozen",
            _run,
            root / "frozen",
            r"'inp\.weight' requires grad but was frozen when the checkpoint was written",
        )
    )
    for label, name, tamper, pattern in STATE_MISMATCHES:
        cases.append((label, _run, _tampered_checkpoint(root / label, name, tamper), pattern))
    for label, make, source, pattern in cases:
        for trained in (False, True):  # a fresh optimizer has no state, which DCP would create
            run = make()
            if trained:
                _train(run, range(1))
            before = _snapshot(run)
            # ValueError: an ordinary Exception, never DCP's CheckpointException (a
            # BaseException that `except Exception` misses).
            with pytest.raises(ValueError, match=pattern) as refused:
                checkpoint.load(source, run.model, run.optim)
            assert str(source) in str(refused.value), f"{label}: the checkpoint is not named"
            _assert_unchanged(run, before, f"{label}, trained={trained}")


def test_mismatched_checkpoint_is_refused_by_name_and_changes_nothing(worlds, tmp_path):
    worlds.run(2, _mismatch_body, root=str(tmp_path))


def _frozen_after_training_body(root: str) -> None:
    """A layer trained, then frozen, then saved: the checkpoint holds its optimizer state,
    which a run with the layer frozen has none of. It was refused ('in the checkpoint but not
    in the optimizer'), where DCP's own load leaves that state out; now loaded the same way,
    and the resumed run goes on as the uninterrupted one."""
    saved = _run()
    _train(saved, range(2))
    saved.model.inp.requires_grad_(False)
    _train(saved, range(2, 3))
    checkpoint.save(root, *saved[:2], step=3, extra={"scheduler": saved.scheduler.state_dict()})
    resumed = _run(seed=1)
    resumed.model.inp.requires_grad_(False)
    _, extra = checkpoint.load(root, resumed.model, resumed.optim)
    resumed.scheduler.load_state_dict(extra["scheduler"])
    for run in (saved, resumed):
        _train(run, range(3, 5))
    pairs = zip(saved.model.named_parameters(), resumed.model.parameters(), strict=True)
    for (name, p), q in pairs:
        assert torch.equal(full(p), full(q)), name


def test_checkpoint_of_a_layer_frozen_after_training_loads(worlds, tmp_path):
    worlds.run(2, _frozen_after_training_body, root=str(tmp_path))


# -- async save ---------------------------------------------------------------------------------


def _load_state(root: Path) -> dict:
    run = _run(seed=1)
    checkpoint.load(root, run.model, run.optim)
    model_state, optim_state = get_state_dict(run.model, run.optim)
    return {"model": model_state, "optimizer": optim_state}


def _wait_for_commit(root: Path, step: int) -> None:
    """Poll the folder (local, no collective) until the checkpoint of ``step`` is committed."""
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    while checkpoint.latest(root) != layout.step_dir(root, step):
        assert time.monotonic() < deadline, f"step {step} not committed in {COMMIT_TIMEOUT_S} s"
        time.sleep(0.02)


def _async_body(root: str) -> None:
    root = Path(root)
    run = _run()
    _train(run, range(SAVE_AT))
    extra = {"scheduler": run.scheduler.state_dict()}
    checkpoint.save(root / "sync", *run[:2], step=SAVE_AT, extra=extra)

    release = threading.Event()

    def gated_write(self, plan, planner):
        assert release.wait(timeout=COMMIT_TIMEOUT_S), "the test never released the write"
        return _ORIGINAL_WRITE(self, plan, planner)

    with mock.patch.object(FileSystemWriter, "write_data", gated_write):
        handle = checkpoint.save(root / "async", *run[:2], step=SAVE_AT, extra=extra, async_=True)
        # Training goes on while the background thread has not written anything.
        _train(run, range(SAVE_AT, SAVE_AT + 1))
        assert not handle.done()
        assert checkpoint.latest(root / "async") is None
        release.set()
        # Committed as soon as every rank has written, while training goes on: no further
        # save, load or wait() on any rank.
        _train(run, range(SAVE_AT + 1, TOTAL))
        _wait_for_commit(root / "async", SAVE_AT)
    assert handle.wait() == layout.step_dir(root / "async", SAVE_AT)
    assert_match(run.model, _reference("AdamW", TOTAL).model, atol=RESUME_ATOL)

    synced, overlapped = _load_state(root / "sync"), _load_state(root / "async")
    assert_same_state_dict(overlapped, synced)
    _assert_resumes_at(root / "async", SAVE_AT)

    # keep_last prunes in the background too, after the commit.
    checkpoint.save(root / "async", *run[:2], step=TOTAL, extra=extra, async_=True, keep_last=1)
    _wait_for_commit(root / "async", TOTAL)
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    while layout.step_dir(root / "async", SAVE_AT).exists():
        assert time.monotonic() < deadline, "keep_last=1 did not prune the older checkpoint"
        time.sleep(0.02)
    step, _ = checkpoint.load(root / "async", *_run(seed=1)[:2])
    assert step == TOTAL


def test_async_save_overlaps_training_and_matches_a_sync_save(worlds, tmp_path):
    worlds.run(2, _async_body, root=str(tmp_path))


def _over_only_once_committed_body(root: str) -> None:
    root = Path(root)
    run = _run()
    _train(run, range(1))
    commit = layout.commit

    def slow_commit(*args, **kwargs):
        # Rank 0 commits a while after every rank has written.
        time.sleep(1.0)
        commit(*args, **kwargs)

    with mock.patch.object(layout, "commit", slow_commit):
        handle = checkpoint.save(root, *run[:2], step=1, async_=True)
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        while not handle.done():
            assert time.monotonic() < deadline, "the async save never ended"
            time.sleep(0.01)
        # Over on this rank (rank 1 included: its own write ended a second before): committed.
        assert checkpoint.latest(root) == layout.step_dir(root, 1)
    assert handle.wait() == layout.step_dir(root, 1)


def test_an_async_save_is_over_on_every_rank_only_once_committed(worlds, tmp_path):
    """A rank that leaves (or aborts leaving) once its save is over cannot cost the commit: see
    [Note: async commit]."""
    worlds.run(2, _over_only_once_committed_body, root=str(tmp_path))


def _subgroup_destroyed_body(root: str) -> None:
    run = _run()
    _train(run, range(1))
    handle = checkpoint.save(root, *run[:2], step=1, async_=True)
    subgroup = dist.new_group([0])
    if dist.get_rank() == 0:
        # Only its members destroy a subgroup: the pending save's teardown, which meets every
        # rank in a barrier, waits for the default group's destruction.
        dist.destroy_process_group(subgroup)
    _train(run, range(1, 2))
    assert handle.wait() == layout.step_dir(Path(root), 1)


def test_destroying_a_subgroup_leaves_a_pending_async_save_alone(worlds, tmp_path):
    worlds.run(2, _subgroup_destroyed_body, root=str(tmp_path))


# -- exported weights ---------------------------------------------------------------------------


def _export_body(path: str) -> None:
    run = _run()
    _train(run, range(SAVE_AT))
    checkpoint.export_weights(run.model, path)


def _init_from_body(path: str) -> None:
    expected = _reference("AdamW", SAVE_AT).model
    run = _run(seed=1)
    checkpoint.load_weights(run.model, path)
    assert_match(run.model, expected)
    wrong = _run(model=_wide_block_model())
    before = _snapshot(wrong)
    with pytest.raises(
        ValueError,
        match=r"'layers\.1\.up\.weight' has shape \(4, 6\) in the model but "
        r"\(3, 6\) in the file",
    ):
        checkpoint.load_weights(wrong.model, path)
    _assert_unchanged(wrong, before, "load_weights")


def test_exported_weights_load_sharded_and_into_plain_pytorch(worlds, tmp_path):
    path = str(tmp_path / "weights.pt")
    worlds.run(2, _export_body, path=path)
    worlds.run(4, _init_from_body, path=path)
    plain = ToyModel()
    plain.load_state_dict(torch.load(path, weights_only=True))
    assert_match(plain, _reference("AdamW", SAVE_AT).model)
