"""CompactAdamW's update as one C loop on the CPU, built on first use from ``csrc/``.

[Note: the C kernel]
The eager update is about fifty whole-tensor ops, each a pass over memory; the fused fp32
AdamW kernel makes one. ``csrc/compact_adamw.c`` decodes, updates and encodes each group of 32
elements while it is in registers (see [Note: the kernel's loops] in the source): one pass,
no temporaries, no gather of a unit's tensors into flat buffers. It is plain C99 (no torch
headers, no Python API), compiled with the system's C compiler in about a second the first
time a process needs it, cached by source, flags and CPU, and called through ``ctypes`` once
per batch with a table of data pointers.

Its arithmetic is eager's, op for op, in correctly rounded float32 operations and exact
integer ones, so the bits are the same (``tests/test_compact_kernel.py`` checks it on every
layout): compiled with ``-ffp-contract=off`` (no FMA contraction) and without fast-math.

No compiler, a failed build, a non-CPU tensor or a layout the kernel does not take (a
non-contiguous tensor, a gradient that is not bfloat16 or float32, a ``step`` that is not a
float32 CPU scalar) falls back to the eager path; ``CompactAdamW(kernel="c")`` raises instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["FIELDS", "kernel", "takes", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "compact_adamw.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
)
"""``-ffp-contract=off``: GCC contracts ``a * b + c`` into an FMA by default, which rounds
once where eager rounds twice. ``-fno-math-errno`` lets ``sqrtf`` and ``rintf`` be single
instructions; it changes no value. ``-fno-trapping-math``: without it GCC keeps a float
comparison that could raise an exception flag behind a branch, and without AVX-512's mask
registers it then leaves the loop with it scalar (the root's encoding, on an AVX2 CPU: the
kernel took 3.84 ns per element, 2.56 with it, on a Zen 3 VM); no value changes, only when
floating-point exception flags may be raised, which nothing reads."""

FIELDS = 10
"""int64 fields per parameter in the table the kernel reads (``PARAM_FIELDS`` in the source);
the gradients' addresses are a second array, one per parameter."""

FLAG_WEIGHT_BF16, FLAG_GRAD_BF16, FLAG_GROUPED, FLAG_ROOT4 = 1, 2, 4, 8

_ARGTYPES = (
    ctypes.POINTER(ctypes.c_int64),  # the table
    ctypes.POINTER(ctypes.c_int64),  # the gradients' addresses
    ctypes.c_int64,  # parameters
    *(ctypes.c_double,) * 5,  # lr, beta1, beta2, eps, weight_decay
    ctypes.c_int,  # compand
)

_loaded: Callable[..., None] | None = None
_reason: str | None = None
"""Why the kernel is unavailable, once a build was tried and failed."""


def _cache_dir() -> Path:
    root = os.environ.get("FUSED_OPTIM_DIST_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fused_optim_dist"


def _cpu() -> str:
    """What ``-march=native`` depends on: a library built on one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _cpu().encode()]))
    target = _cache_dir() / f"compact_adamw-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: ranks building at once never load a half-written
    # file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def kernel() -> Callable[..., None] | None:
    """The kernel's entry point, built and loaded on first call; ``None`` if it cannot be
    (:func:`unavailable_reason` says why)."""
    global _loaded, _reason
    if _loaded is not None or _reason is not None:
        return _loaded
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _reason = "no C compiler found (set CC, or install cc/gcc)"
        return None
    try:
        path = _build(compiler)
        function = ctypes.CDLL(str(path)).compact_adamw_step
    except subprocess.CalledProcessError as error:
        _reason = f"{compiler} failed: {error.stderr.strip()[-500:]}"
        return None
    except OSError as error:
        _reason = f"building or loading the kernel failed: {error}"
        return None
    function.argtypes = _ARGTYPES
    function.restype = None
    _loaded = function
    return _loaded


def unavailable_reason() -> str | None:
    return _reason


def takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel reads and writes ``tensors`` as they are: CPU, contiguous."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
