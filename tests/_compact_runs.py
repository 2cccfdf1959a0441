"""A short CompactAdamW run over awkward shapes, and the check that two runs end bit for bit
alike: how each of its paths (C kernel, compiled, eager) is tested against the eager one."""

from __future__ import annotations

import torch
from torch import nn

from fused_optim_dist.compact_adamw import CompactAdamW

SHAPES = [(64, 96), (10, 70), (3, 33), (0, 64), (128,), (5,), (2, 3, 16), (), (3, 1100), (2, 2048)]
"""Rows of whole groups, rows ending in a short group, an empty local shard, vectors, a 3-dim
tensor (rows of 48), a scalar, rows longer than the kernel's span of 32 groups (1,024
elements) ending in a short span and a short group, and rows of whole spans."""


WHOLE_ROWS = [(64, 96), (2, 2048), (3, 32), (0, 64), (4, 2, 16), (128,), (5,)]
"""Rows of whole groups only (with an empty shard and vectors): the Triton kernel's aligned
form."""


def train(
    kernel: str,
    weight_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    correction: bool,
    compand: bool,
    device: str = "cpu",
    variance_bits: int = 8,
    nonfinite: float | None = None,
    shapes: list[tuple[int, ...]] = SHAPES,
) -> tuple[list[nn.Parameter], CompactAdamW]:
    """Six steps on two param groups, the learning rate warmed up at every step; with
    ``nonfinite`` (NaN, an infinity, or a value whose square overflows float32), every
    seventh element of the gradients of steps 1 and 3 takes it, and the values it meets
    become non-finite."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s).to(device, weight_dtype)) for s in shapes]
    optim = CompactAdamW(
        [{"params": params[:4]}, {"params": params[4:], "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
        weight_correction=correction,
        compand=compand,
        variance_bits=variance_bits,
        kernel=kernel,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: (step + 1) / 6)
    for step in range(6):
        for index, p in enumerate(params):
            p.grad_dtype = None
            # Gradients from tiny to huge (the codes' whole range), some missing at step 2 so
            # that step counts differ within a batch from then on.
            scale = 10.0 ** (step - 3)
            missing = step == 2 and index % 3 == 1
            grad = torch.randn(p.shape) * scale
            if nonfinite is not None and step in (1, 3):
                grad.view(-1)[::7] = nonfinite
            p.grad = None if missing else grad.to(device, grad_dtype)
        optim.step()
        schedule.step()
    return params, optim


def assert_same_run(
    run: tuple[list[nn.Parameter], CompactAdamW],
    reference: tuple[list[nn.Parameter], CompactAdamW],
    *,
    nan_weight_bits: bool = True,
    nan_state_bits: bool = True,
) -> None:
    """The same weights and the same state, key by key, dtype and bits (a NaN's too; on the
    CPU where the runs' devices differ). ``nan_weight_bits=False``: a NaN weight only NaN in
    both (see [Note: non-finite values] in ``_compact_codes.py``); ``nan_state_bits=False``:
    a NaN state value too (CUDA's eager conversions write other NaNs than the kernels')."""
    (params, optim), (ref_params, ref_optim) = run, reference
    for p, q in zip(params, ref_params, strict=True):
        _assert_same_bits(p.detach(), q.detach(), nan_weight_bits, p.shape)
        state, ref_state = optim.state[p], ref_optim.state[q]
        assert state.keys() == ref_state.keys()
        for key, value in state.items():
            assert value.dtype == ref_state[key].dtype, key
            _assert_same_bits(value, ref_state[key], nan_state_bits, (p.shape, key))


def _assert_same_bits(value: torch.Tensor, reference: torch.Tensor, nan_bits: bool, what) -> None:
    if not nan_bits and value.is_floating_point():
        assert torch.equal(value.isnan(), reference.isnan()), what
        value, reference = value.nan_to_num(), reference.nan_to_num()
    assert torch.equal(_bits(value), _bits(reference)), what


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s values, on the CPU: unlike the values, a NaN equals itself."""
    return tensor.cpu().reshape(-1).view(torch.uint8)


def nan_gradient_steps(kernel: str, payload: int, device: str = "cpu") -> None:
    """Step a matrix and a vector with a gradient whose first element is the NaN of bits
    ``payload``, then with finite ones, beside ``torch.optim.AdamW``: the NaN weights where
    AdamW's are, and still NaN a step later (a group of 32 then NaN whole: its scale is)."""
    nan = torch.tensor([payload], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert nan.isnan().all()
    shapes = ((2, 32), (5,))
    params = [nn.Parameter(torch.ones(s, device=device, dtype=torch.bfloat16)) for s in shapes]
    reference = [nn.Parameter(torch.ones(s, device=device)) for s in shapes]
    optim = CompactAdamW(params, kernel=kernel)
    plain = torch.optim.AdamW(reference)
    for step in range(2):
        for p, q in zip(params, reference, strict=True):
            p.grad_dtype = None
            grad = torch.full(q.shape, 0.5)
            if step == 0:
                grad.view(-1)[0] = nan
            q.grad, p.grad = grad.to(device), grad.to(device)
        optim.step()
        plain.step()
        if step == 0:
            for p, q in zip(params, reference, strict=True):
                assert torch.equal(p.detach().isnan(), q.detach().isnan()), (kernel, p.shape)
    for p in params:
        assert p.detach().view(-1)[0].isnan(), (kernel, p.shape)
