"""CompactAdamW's Triton kernel (``kernel="triton"``, what ``"auto"`` takes on CUDA) against its
eager path: the same bits on every layout, where values turn non-finite, and with step counts
that differ within a batch. On the CPU under Triton's interpreter (``TRITON_INTERPRET=1``:
numpy's float32 arithmetic, correctly rounded as the GPU's ``div_rn``, ``sqrt_rn`` and unfused
``+ - *``), which checks the kernel's logic and arithmetic on every run; on CUDA compiled
(marked ``gpu``), which checks that Triton compiles it as written. See [Note: the Triton
kernel] in ``fused_optim_dist/_compact_triton.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _compact_runs import WHOLE_ROWS, nan_gradient_steps
from _triton_interpreted import (
    CASES,
    LAYOUTS,
    NAN_PAYLOADS,
    NONFINITE,
    in_backward_equals_after_backward,
    same_bits,
    same_bits_where_values_turn_nan,
)
from torch import nn

from fused_optim_dist import compact_adamw
from fused_optim_dist.compact_adamw import CompactAdamW

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str]:
    """Every case of ``_triton_interpreted.py``, run once in a process under the interpreter."""
    out = tmp_path_factory.mktemp("triton") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("_triton_interpreted.py")
    subprocess.run([sys.executable, str(script), str(out)], env=env, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_same_bits_as_eager(interpreted, case):
    assert interpreted[case] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel,layout",
    [
        ("_grouped_kernel", dict(COMPAND=True, ROOT4=True, ALIGNED=False)),
        ("_grouped_kernel", dict(COMPAND=False, ROOT4=False, ALIGNED=True)),
        ("_flat_kernel", dict(ALIGNED=False)),
    ],
)
def test_compiles_for_hopper_as_written(kernel, layout):
    """Compiled for sm_90 (Triton compiles without a GPU): no FMA contraction, divisions and
    square roots correctly rounded (``div.rn``, ``sqrt.rn``; Triton's ``/`` would be
    ``div.full``), no flush of subnormals to zero; the aligned form moves 16-byte vectors.
    What the interpreter cannot check."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_optim_dist import _compact_triton

    function = getattr(_compact_triton, kernel)
    tile = 32 if kernel == "_grouped_kernel" else 1024
    constants = dict(WEIGHT_BF16=True, ERROR=True, GRAD_BF16=True, **layout, TILE=tile)
    signature = {"table_ptr": "*i64", "count": "i32", **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(
        fn=function,
        signature=signature,
        constexprs={(function.arg_names.index(k),): v for k, v in constants.items()},
    )
    options = {"num_warps": 4, "enable_fp_fusion": False}
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    for unwanted in ("fma.", "div.full", "div.approx", "sqrt.approx", ".ftz"):
        assert unwanted not in ptx, unwanted
    assert ("ld.global.v4" in ptx and "st.global.v4" in ptx) == layout["ALIGNED"]


def test_refuses_tensors_it_cannot_step():
    """Compiled (no interpreter), the kernel takes CUDA tensors only: ``kernel="triton"``
    raises on CPU ones before anything moves, and says what to do."""
    weight = nn.Parameter(torch.randn(4, 32, dtype=torch.bfloat16))
    weight.grad = torch.randn_like(weight)
    before = weight.detach().clone()
    optim = CompactAdamW([weight], kernel="triton")
    with pytest.raises(RuntimeError, match=r"kernel='triton'.*contiguous CUDA tensors"):
        optim.step()
    assert torch.equal(weight.detach(), before)


def test_refused_where_triton_is_missing(monkeypatch):
    monkeypatch.setattr(compact_adamw, "_triton_module", lambda: None)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        CompactAdamW([nn.Parameter(torch.zeros(2, 32))], kernel="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_same_bits_as_eager_on_cuda(layout):
    same_bits(layout, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_same_bits_as_eager_on_cuda_with_whole_rows(layout):
    same_bits(layout, "cuda", WHOLE_ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(NONFINITE))
def test_same_bits_as_eager_on_cuda_where_values_turn_nan(kind):
    """NaN weights were -0.0 with a zero error: see [Note: 24-bit weights]."""
    same_bits_where_values_turn_nan(LAYOUTS["bf16-weights-grads-8bit"], NONFINITE[kind], "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("payload", NAN_PAYLOADS)
def test_a_nan_gradient_leaves_weights_nan_on_cuda(payload):
    """A NaN gradient on CUDA: arithmetic makes 0x7FFFFFFF there, whatever the input's NaN."""
    nan_gradient_steps("triton", payload, "cuda")


@pytest.mark.gpu
def test_in_backward_equals_after_backward_on_cuda():
    in_backward_equals_after_backward("cuda")


@pytest.mark.gpu
def test_auto_takes_the_kernel_on_cuda(monkeypatch):
    """``kernel="auto"`` steps CUDA tensors with the Triton kernel (one launch per batch) and
    bumps the weights' version counters, as an in-place op would."""
    module = compact_adamw._triton_module()
    launches = []
    original = module.TritonTable._launch

    def counted(self, *args, **kwargs):
        launches.append(kwargs.get("warmup", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(module.TritonTable, "_launch", counted)
    params = [nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in ((4, 32), (7,))]
    optim = CompactAdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    versions = [p._version for p in params]
    optim.step()
    assert launches.count(False) == 2  # one launch per batch: the matrix and the vector
    assert all(p._version > v for p, v in zip(params, versions, strict=True))
