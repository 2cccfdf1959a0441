"""CompactAdamW's flat update compiled with ``torch.compile`` (``kernel="compile"``).

[Note: compiling the flat update]
The eager update of a batch (``_compact_update.update_flat``) is about fifty whole-tensor ops on
flat buffers. Compiled, Inductor fuses them into a few loops (C++ on the CPU, Triton on CUDA).
The gather of a unit's tensors into the flat buffers and the copies back stay eager: compiling
them would guard on every tensor of the unit. The compiled function must give eager's bits, as
the C kernel does, so that a run can change paths (or devices) and resume exactly; three of
Inductor's defaults would break that, so they are turned off for this function only:

* ``emulate_precision_casts``: by default Inductor drops a round trip through a lower precision
  inside a fused kernel (``x.to(bfloat16).float()`` becomes ``x``), so the rounding error that
  the 24-bit weights keep comes out zero, silently. With it, the casts are kept, and Triton is
  also asked not to contract ``a * b + c`` into an FMA (torch 2.13, ``codegen/triton.py``).
* ``eager_numerics.division_rounding``: Triton lowers ``x / y`` to an approximate division;
  eager's is correctly rounded.
* ``eager_numerics.disable_ftz``: Triton flushes subnormal results to zero; eager keeps them
  (a second moment of a tiny gradient is subnormal).

The graph takes its square roots in float32, not through eager's float64 route on the CPU:
Inductor's are correctly rounded, so the bits are the same (``_compact_codes.sqrt_rn``).

Measured on the CPU, the bits are the same as eager's on every layout
(``tests/test_compact_compiled.py``) and not with Inductor's defaults. On CUDA the same test is
marked ``gpu``.

It is compiled with ``dynamic=True``: sizes and Python floats (hyperparameters, bias
corrections) are graph inputs from the first call, so one graph serves every unit of a model
and every step. With the default, Dynamo makes the floats constants of the graph, and a
learning-rate schedule recompiled at every step. A run needs a handful of graphs (matrices
and vectors, rows that are multiples of 32 or not, one or several step counts in a batch,
weights with or without an error); past Dynamo's limit of graphs per function
(``torch._dynamo.config.recompile_limit``, 8) Dynamo warns and runs the function uncompiled:
the same bits, slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["compiled"]

OPTIONS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}
"""Inductor options of the compiled update. See [Note: compiling the flat update]."""


@functools.cache
def compiled(update_flat: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``update_flat`` (``_compact_update.update_flat``) compiled, once per process."""
    return torch.compile(update_flat, dynamic=True, options=OPTIONS)
