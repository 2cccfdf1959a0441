"""CompactAdamW stepped in backward on FSDP2 shards, against CompactAdamW stepped after backward
on the same sharded model (gloo, CPU, real processes).

Both runs see the same gradients (the same reduce-scatter), so every weight and state value
must be equal bit for bit: the step of a local shard does not depend on which other tensors
are stepped with it (see [Note: layout-independent arithmetic]). The model is bfloat16 with rows
of 16, 64 and 70 elements (short last groups, two and three groups per row), a LayerNorm (one-dim
state) and a head of 5 rows, so that shards are uneven and empty on 4 ranks.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _toy import ToyModel, full, holds_gradient, rank_slice
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from fused_optim_dist import OptimizerInBackward, _compact_update, checkpoint
from fused_optim_dist.compact_adamw import CompactAdamW, master_weight, to_adamw_state_dict

IN, DIM, HIDDEN, OUT = 16, 64, 70, 5
GLOBAL_BATCH = 8
STEPS = 4
KWARGS = dict(lr=1e-2, weight_decay=0.1)
SAVE_AT, TOTAL = 2, 5


def _net() -> ToyModel:
    """The toy model with rows long enough for several quantization groups of 32."""
    return ToyModel(2, in_dim=IN, dim=DIM, hidden=HIDDEN, out_dim=OUT)


def _models(seed: int = 0) -> tuple[ToyModel, ToyModel]:
    """A sharded bfloat16 model and a sharded copy with the same weights."""
    torch.manual_seed(seed)
    model = _net().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for layer in m.layers:
            fully_shard(layer)
        fully_shard(m)
    return model, reference


def _groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only; a larger lr for vectors."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2]},
        {"params": [p for _, p in named if p.dim() < 2], "lr": 2e-2, "weight_decay": 0.0},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def _backward(model: nn.Module, step: int, micro_batches: int = 1, index: int = 0) -> None:
    """Micro-batch ``index`` of ``micro_batches`` of this rank's share of batch ``step``."""
    x, y = _batch(step)
    xm = rank_slice(x).chunk(micro_batches)[index]
    ym = rank_slice(y).chunk(micro_batches)[index]
    loss = nn.functional.mse_loss(model(xm.to(torch.bfloat16)).float(), ym)
    (loss / micro_batches).backward()


def _full_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    named: list[tuple[str, nn.Parameter]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every weight and state value, gathered, by name (of ``named``, default the model's
    parameters now)."""
    out = {}
    for name, param in named or model.named_parameters():
        out[name] = full(param).detach().clone()
        for key, value in optim.state[param].items():
            out[f"{name}/{key}"] = full(value).clone()
    return out


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), f"{key} differs"


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(after[k], v) for k, v in before.items() if "/" not in k)


# -- in backward == after backward ------------------------------------------------------------


def _in_backward_body(
    micro_batches: int, variance_bits: int, kernels: tuple[str, str] = ("auto", "auto")
) -> None:
    """Two param groups, an LR schedule, optionally accumulation over micro-batches; ours and
    the reference on ``kernels``."""
    model, reference = _models()
    kwargs = dict(KWARGS, variance_bits=variance_bits)
    optim = OptimizerInBackward(_groups(model), CompactAdamW, kernel=kernels[0], **kwargs)
    ref_optim = CompactAdamW(_groups(reference), kernel=kernels[1], **kwargs)
    schedulers = [LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (optim, ref_optim)]
    initial = _full_state(reference, ref_optim)
    for step in range(STEPS):
        for index in range(micro_batches):
            last = index == micro_batches - 1
            with contextlib.nullcontext() if last else optim.accumulate():
                _backward(model, step, micro_batches, index)
            if not last:
                assert all(holds_gradient(p) for p in model.parameters()), "grads kept"
            _backward(reference, step, micro_batches, index)
        assert all(not holds_gradient(p) for p in model.parameters()), "stepped in backward"
        grads = [full(p.grad).double() for p in reference.parameters()]
        norm = math.sqrt(sum(g.square().sum().item() for g in grads))
        torch.testing.assert_close(optim.grad_norm().item(), norm, rtol=1e-5, atol=0)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        for s in schedulers:
            s.step()
        _assert_equal(_full_state(model, optim), _full_state(reference, ref_optim))
    assert _moved(initial, _full_state(model, optim))


@pytest.mark.parametrize(
    ("world_size", "micro_batches", "variance_bits"), [(2, 1, 8), (4, 1, 8), (2, 2, 8), (3, 2, 4)]
)
def test_in_backward_equals_after_backward(worlds, world_size, micro_batches, variance_bits):
    worlds.run(
        world_size, _in_backward_body, micro_batches=micro_batches, variance_bits=variance_bits
    )


def _eager_in_chunks_body() -> None:
    """Ours on the eager path in chunks of 16 elements ([Note: chunked updates]), the
    reference on the C kernel: the eager path's bits, with no chunks."""
    saved = _compact_update.CHUNK_NUMEL
    _compact_update.CHUNK_NUMEL = 16
    try:
        _in_backward_body(micro_batches=2, variance_bits=4, kernels=("eager", "c"))
    finally:
        _compact_update.CHUNK_NUMEL = saved


def test_in_backward_eager_in_chunks_equals_the_kernel_after_backward(worlds):
    worlds.run(3, _eager_in_chunks_body)


def _nonfinite_body() -> None:
    """``skip_nonfinite``: a NaN gradient on one rank skips its unit on every rank; the
    reference skips the same unit by dropping its gradients."""
    model, reference = _models()
    poisoned = model.layers[1].up.weight
    poison_step = 1
    state = {"step": 0}

    def poison(param: torch.Tensor) -> None:
        if state["step"] == poison_step and dist.get_rank() == 1:
            param.grad.to_local().fill_(float("nan"))

    poisoned.register_post_accumulate_grad_hook(poison)
    optim = OptimizerInBackward(model.parameters(), CompactAdamW, skip_nonfinite=True, **KWARGS)
    ref_optim = CompactAdamW(reference.parameters(), **KWARGS)
    for step in range(STEPS):
        state["step"] = step
        _backward(model, step)
        _backward(reference, step)
        if step == poison_step:
            for p in reference.layers[1].parameters():
                p.grad = None
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        _assert_equal(_full_state(model, optim), _full_state(reference, ref_optim))
    assert optim.nonfinite_steps == 1


def test_nonfinite_gradient_skips_the_unit(worlds):
    worlds.run(2, _nonfinite_body)


CLIP_NORM = 0.05
CLIP_LR = 1e-3
CLIP_ATOL = 1e-5
"""The reference's clip coefficients are computed in float64, the engine's in float32: the
gradients differ by rounding, which can move a weight by a unit of its 24-bit value or a
momentum by one code step, at ``CLIP_LR`` well under ``CLIP_ATOL``."""


def _clip_body() -> None:
    """``max_grad_norm`` against the reference clipped by the documented per-unit formula
    (README, "Clipping in one backward") on the same units in backward order."""
    model, reference = _models()
    optim = OptimizerInBackward(
        model.parameters(), CompactAdamW, max_grad_norm=CLIP_NORM, lr=CLIP_LR
    )
    ref_optim = CompactAdamW(reference.parameters(), lr=CLIP_LR)
    unclipped, _ = _models()
    unclipped_optim = CompactAdamW(unclipped.parameters(), lr=CLIP_LR)
    units = [*(list(layer.parameters()) for layer in reversed(reference.layers))]
    units.append([*reference.inp.parameters(), *reference.head.parameters()])
    previous: list[float] = []
    for step in range(STEPS):
        for m in (model, reference, unclipped):
            _backward(m, step)
        squares = [sum(full(p.grad).double().square().sum().item() for p in u) for u in units]
        assert math.sqrt(sum(squares)) > 2 * CLIP_NORM, "clipping must engage"
        total_previous, seen, seen_previous = sum(previous), 0.0, 0.0
        for index, (unit, square) in enumerate(zip(units, squares, strict=True)):
            seen += square
            seen_previous += previous[index] if previous else 0.0
            predicted = seen + total_previous - seen_previous
            coefficient = min(1.0, CLIP_NORM / (math.sqrt(predicted) + 1e-6))
            for p in unit:
                p.grad.mul_(coefficient)
        previous = squares
        for o in (optim, ref_optim, unclipped_optim):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        ours = full(master_weight(p, optim.state[p]))
        expected = full(master_weight(q, ref_optim.state[q]))
        torch.testing.assert_close(ours, expected, atol=CLIP_ATOL, rtol=0, msg=name)
    moved = [
        (full(master_weight(p, optim.state[p])) - full(master_weight(r, unclipped_optim.state[r])))
        .abs()
        .max()
        .item()
        for p, r in zip(model.parameters(), unclipped.parameters(), strict=True)
    ]
    assert max(moved) > 10 * CLIP_ATOL, "without clipping the run must end elsewhere"


def test_clipping_in_backward(worlds):
    worlds.run(2, _clip_body)


def _width_changed_body() -> None:
    """``variance_bits`` changed between steps on the group of the root unit's matrices,
    which FSDP2 reduces last: the blocks' units were stepped (and counted their step) before
    the root's bucket refused. Then refused when the backward started stepping, nothing
    moved, but with FSDP2's units left mid-backward (a loop going on after it stepped nothing
    again, no error). Now the backward holds its gradients and ``step()`` refuses, as the
    plain CompactAdamW's does ([Note: a backward held for step()]); the width set back,
    ``step()`` steps them, and both runs go on equal."""
    model, reference = _models()

    def groups(m: ToyModel) -> list[dict]:
        root = [m.inp.weight, m.head.weight]
        return [
            {"params": [p for p in m.parameters() if all(p is not q for q in root)]},
            {"params": root},
        ]

    optim = OptimizerInBackward(groups(model), CompactAdamW, **KWARGS)
    ref_optim = CompactAdamW(groups(reference), **KWARGS)
    _train(model, optim, range(2))
    _train(reference, ref_optim, range(2))
    for m, o in ((model, optim), (reference, ref_optim)):
        o.param_groups[1]["variance_bits"] = 4
        before = _full_state(m, o)
        _backward(m, 2)
        with pytest.raises(ValueError, match=r"another variance_bits than its group's \(4\)"):
            o.step()
        _assert_equal(_full_state(m, o), before)
        o.param_groups[1]["variance_bits"] = 8
        o.step()
        o.zero_grad()
        _train(m, o, range(3, 5))
    _assert_equal(_full_state(model, optim), _full_state(reference, ref_optim))


def test_variance_bits_changed_refused_before_any_unit_moves(worlds):
    worlds.run(2, _width_changed_body)


# -- checkpoints ------------------------------------------------------------------------------


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _backward(model, step)
        optim.step()
        optim.zero_grad()


def _save_body(root: str, variance_bits: int) -> dict[str, torch.Tensor]:
    model, _ = _models()
    optim = OptimizerInBackward(_groups(model), CompactAdamW, variance_bits=variance_bits, **KWARGS)
    _train(model, optim, range(SAVE_AT))
    checkpoint.save(Path(root), model, optim, step=SAVE_AT)
    return _full_state(model, optim)


def _reshard_body(root: str, saved: dict[str, torch.Tensor], variance_bits: int) -> None:
    """Load on another world size, in backward and after backward: the gathered state equals
    what was saved bit for bit, and both continue identically."""
    model, reference = _models(seed=1)
    kwargs = dict(KWARGS, variance_bits=variance_bits)
    optim = OptimizerInBackward(_groups(model), CompactAdamW, **kwargs)
    ref_optim = CompactAdamW(_groups(reference), **kwargs)
    for m, o in ((model, optim), (reference, ref_optim)):
        step, _ = checkpoint.load(Path(root), m, o)
        assert step == SAVE_AT
        _assert_equal(_full_state(m, o), saved)
        _train(m, o, range(SAVE_AT, TOTAL))
    _assert_equal(_full_state(model, optim), _full_state(reference, ref_optim))
    assert _moved(saved, _full_state(model, optim))


@pytest.mark.parametrize(
    ("save_ranks", "load_ranks", "variance_bits"), [(2, 4, 8), (4, 1, 8), (3, 2, 4)]
)
def test_checkpoint_reshards_bit_exact(worlds, tmp_path, save_ranks, load_ranks, variance_bits):
    root = str(tmp_path)
    saved = worlds.run(save_ranks, _save_body, root=root, variance_bits=variance_bits)[0]
    worlds.run(load_ranks, _reshard_body, root=root, saved=saved, variance_bits=variance_bits)


def _exact_resume_body(root: str) -> None:
    """Plain DCP (``get_state_dict``/``set_state_dict``): a run saved and resumed into a fresh
    model and optimizer ends where the uninterrupted run ends, bit for bit."""
    model, _ = _models()
    optim = OptimizerInBackward(model.parameters(), CompactAdamW, **KWARGS)
    _train(model, optim, range(TOTAL))
    uninterrupted = _full_state(model, optim)

    model, _ = _models()
    optim = OptimizerInBackward(model.parameters(), CompactAdamW, **KWARGS)
    _train(model, optim, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)

    model, _ = _models(seed=1)
    optim = OptimizerInBackward(model.parameters(), CompactAdamW, **KWARGS)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, optim, range(SAVE_AT, TOTAL))
    _assert_equal(_full_state(model, optim), uninterrupted)


def test_exact_resume_with_dcp(worlds, tmp_path):
    worlds.run(2, _exact_resume_body, root=str(tmp_path))


def _adamw_interchange_body(variance_bits: int) -> None:
    """A sharded fp32 AdamW state loads into the in-backward CompactAdamW (quantized shard by
    shard, placed like the parameters) and exports back to AdamW's layout within the
    documented error."""
    torch.manual_seed(0)
    fp32 = _net()
    for layer in fp32.layers:
        fully_shard(layer)
    fully_shard(fp32)
    adamw = torch.optim.AdamW(fp32.parameters(), **KWARGS)
    _train_fp32(fp32, adamw)
    model, _ = _models()
    optim = OptimizerInBackward(
        model.parameters(), CompactAdamW, variance_bits=variance_bits, **KWARGS
    )
    optim.load_state_dict(adamw.state_dict())
    for p in model.parameters():
        entry = optim.state[p]
        assert isinstance(entry["exp_avg_code" if p.dim() >= 2 else "exp_avg"], DTensor)
    exported = to_adamw_state_dict(optim.state_dict())
    for pid, entry in adamw.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            expected, actual = full(entry[key]), full(exported["state"][pid][key])
            bound = _export_bound(expected, key, variance_bits)
            assert ((actual - expected).abs() <= bound).all(), (pid, key)
    back = torch.optim.AdamW(fp32.parameters(), **KWARGS)
    back.load_state_dict(exported)
    _train_fp32(fp32, back)


def _train_fp32(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for step in range(2):
        x, y = _batch(step)
        nn.functional.mse_loss(model(rank_slice(x)), rank_slice(y)).backward()
        optim.step()
        optim.zero_grad()


def _export_bound(expected: torch.Tensor, key: str, variance_bits: int) -> torch.Tensor:
    """The documented decoding error of ``expected`` (float32 AdamW moments, gathered):
    per row group of 32, half a code step of the group's scale plus the bfloat16 rounding of
    the scale (and of the loaded value); about 2**-15 relative for one-dim moments. A 4-bit
    root is within half of 1/15 of the square root of its ratio to the scale, so within 1/15
    of the scale."""
    if expected.dim() < 2:
        return expected.abs() * 2**-7 + 1e-30
    rows = expected.reshape(expected.shape[0], -1)
    pad = -rows.shape[1] % 32
    groups = nn.functional.pad(rows, (0, pad)).view(rows.shape[0], -1, 32)
    root = key == "exp_avg_sq"
    groups = groups.sqrt() if root else groups.abs()
    scale = groups.amax(dim=2, keepdim=True)
    # One code step at most (the companded step is at most 2/127 of the scale near 1), plus
    # the bfloat16 roundings of scale and value (2**-8 relative each).
    root_step = 1 / 255 if variance_bits == 8 else 1 / 15
    step = scale * (root_step if root else 2 / 127) + groups * 2**-7 + scale * 2**-7
    if root:
        step = step * (2 * scale + step)  # error of r**2 from an error of r
    bound = step.expand_as(groups).reshape(rows.shape[0], -1)[:, : rows.shape[1]]
    return bound.reshape(expected.shape)


@pytest.mark.parametrize("variance_bits", [8, 4])
def test_adamw_state_interchange(worlds, variance_bits):
    worlds.run(2, _adamw_interchange_body, variance_bits=variance_bits)
