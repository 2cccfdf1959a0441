"""CompactAdamW's Triton kernel against its eager path under Triton's interpreter, run as
``TRITON_INTERPRET=1 python tests/_triton_interpreted.py OUT.json`` by
``tests/test_compact_triton.py``: Triton decides whether a kernel is interpreted when it is
defined, its own library's included, so the interpreter needs a process of its own. Writes
each case's outcome, ``"ok"`` or what differed."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable

import torch
from _compact_runs import SHAPES, WHOLE_ROWS, assert_same_run, nan_gradient_steps, train
from torch import nn

from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import CompactAdamW

LAYOUTS = {
    "bf16-weights-grads-8bit": (torch.bfloat16, torch.bfloat16, True, True, 8),
    "bf16-weights-no-error-fp32-grads-linear": (torch.bfloat16, torch.float32, False, False, 8),
    "fp32-weights-4bit": (torch.float32, torch.float32, True, True, 4),
    "bf16-weights-linear-4bit": (torch.bfloat16, torch.bfloat16, True, False, 4),
}
"""bfloat16 weights with and without their error, float32 weights, bfloat16 and float32
gradients, companded and linear momentum, 8- and 4-bit variance: each constexpr of the
kernels both ways."""
NONFINITE = {"nan": float("nan"), "inf": float("inf"), "overflowing-square": 1e20}
NAN_PAYLOADS = (0x7FFFFFFF, 0xFFFFFFFF)
"""NaNs whose payload fills their low bits: what CUDA's arithmetic makes (see [Note: 24-bit
weights])."""


def run(
    kernel: str,
    layout: tuple,
    device: str = "cpu",
    nonfinite: float | None = None,
    shapes: list[tuple[int, ...]] = SHAPES,
):
    weight_dtype, grad_dtype, correction, compand, bits = layout
    args = (kernel, weight_dtype, grad_dtype, correction, compand)
    return train(*args, device=device, variance_bits=bits, nonfinite=nonfinite, shapes=shapes)


def same_bits(layout: tuple, device: str = "cpu", shapes: list = SHAPES) -> None:
    """Batches of short groups (the kernel's general form), or with ``WHOLE_ROWS`` its
    aligned form (tensors 16-byte aligned, as torch allocates them)."""
    ours = run("triton", layout, device, shapes=shapes)
    assert_same_run(ours, run("eager", layout, device, shapes=shapes))


def same_bits_where_values_turn_nan(layout: tuple, nonfinite: float, device: str = "cpu") -> None:
    """The same bits but those of NaN weights, NaN in both (see [Note: non-finite values] in
    ``_compact_codes.py``); on CUDA, NaN state values only NaN in both."""
    ours = run("triton", layout, device, nonfinite)
    assert any(p.detach().isnan().any() for p in ours[0]), "no value turned NaN"
    reference = run("eager", layout, device, nonfinite)
    assert_same_run(ours, reference, nan_weight_bits=False, nan_state_bits=device == "cpu")


def in_backward_equals_after_backward(device: str = "cpu") -> None:
    """Stepped by ``OptimizerInBackward`` as each gradient arrives (one launch per bucket):
    the same bits as the same class stepped after backward. Both take the full path (state
    made, tables built) only at their first two steps: then their plans ([Note: reused
    plans] in ``_compact_plan.py``), gradients at new addresses at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 3))
    model = model.to(device, torch.bfloat16)
    reference = copy.deepcopy(model)
    ours = OptimizerInBackward(
        model.parameters(), CompactAdamW, lr=1e-2, kernel="triton", bucket_numel=64 * 41
    )
    plain = CompactAdamW(reference.parameters(), lr=1e-2, kernel="triton")
    full_steps = []
    step_group = CompactAdamW._step_group

    def counted(self: CompactAdamW, group: dict) -> None:
        full_steps.append(step)
        step_group(self, group)

    CompactAdamW._step_group = counted
    try:
        for step in range(5):
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step))
            for net, opt in ((model, ours), (reference, plain)):
                net(x.to(device, torch.bfloat16)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        CompactAdamW._step_group = step_group
    assert full_steps and max(full_steps) == 1, full_steps
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), tuple(p.shape)


CASES: dict[str, Callable[[], None]] = {
    **{
        f"same-bits[{name}]": lambda layout=layout: same_bits(layout)
        for name, layout in LAYOUTS.items()
    },
    **{
        f"nonfinite[{name}-{kind}]": lambda layout=layout, value=value: (
            same_bits_where_values_turn_nan(layout, value)
        )
        for (name, layout), (kind, value) in zip(LAYOUTS.items(), NONFINITE.items(), strict=False)
    },
    **{
        f"whole-rows[{name}]": lambda layout=LAYOUTS[name]: same_bits(layout, shapes=WHOLE_ROWS)
        for name in ("bf16-weights-grads-8bit", "bf16-weights-linear-4bit")
    },
    "in-backward": in_backward_equals_after_backward,
    **{
        f"nan-gradient[{payload:#x}]": lambda payload=payload: nan_gradient_steps("triton", payload)
        for payload in NAN_PAYLOADS
    },
}


def main(out: str) -> None:
    results = {}
    for name, case in CASES.items():
        try:
            case()
            results[name] = "ok"
        except AssertionError as error:
            results[name] = f"differs: {error!r}"
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
