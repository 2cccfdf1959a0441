"""Peak GPU memory per rank of an FSDP2 fine-tuning step, simulated before renting the GPUs.

The job's own code runs on one CPU process: the model is built under ``FakeTensorMode`` (no
weights, only shapes and dtypes), ``fully_shard`` shards it over a fake process group of the
target world size (``init_process_group("fake")``: each collective returns at once, with the
right shapes), and the optimizer, plain or in backward, runs as it would on the GPUs. Every
tensor the step creates is accounted by :class:`~fused_optim_dist_recipes.memory_tracking.
StepMemoryTracker`. One warm-up step runs untracked (it creates the optimizer state, and under
fake mode a plain optimizer's first step counts DTensor sharding propagation as allocations:
108 GiB on step 1 of an 8B model); the next step is tracked.

What this does not model, and why a margin is added on top (see ``docs/memory_estimation.md``):
the CUDA caching allocator's reserved-but-unallocated memory and fragmentation, the CUDA
context, NCCL's and cuBLAS's workspaces, and which kernels CUDA picks (foreach or fused
optimizer kernels, attention kernels): a CPU build of torch cannot fake a CUDA device, so the
simulation runs CPU kernels on a ``cpu`` fake device. The figures are estimates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import inspect
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from fused_optim_dist import build_optimizer, clip_grad_norm_
from fused_optim_dist._validation import resolve_optimizer_class
from fused_optim_dist.training import backward_micro_batches
from fused_optim_dist_recipes import hf
from fused_optim_dist_recipes.memory_tracking import KINDS, Peak, StepMemoryTracker
from fused_optim_dist_recipes.models import PRESETS, Llama, LlamaConfig, apply_fsdp

__all__ = [
    "DEFAULT_METHODS",
    "GIB",
    "METHODS",
    "SHAPES",
    "EstimateConfig",
    "Margin",
    "Measured",
    "MethodEstimate",
    "OptimizerMethod",
    "estimate",
    "estimate_job_memory",
    "fake_world",
    "format_report",
    "measure",
    "run_tracked_steps",
    "train_step",
    "verdict",
]

GIB = 2**30
"""Bytes per GiB: every figure is printed in GiB."""

GPU_80GB_GIB = 81559 * 2**20 / GIB
"""An 80 GB A100/H100 as ``nvidia-smi`` reports it: 81,559 MiB (79.6 GiB)."""

SHAPES: dict[str, LlamaConfig] = {
    **PRESETS,
    # Real-scale shapes, to be simulated only (``Llama`` with these vocabularies and widths).
    "llama2-7b": LlamaConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_hidden=11008,
        max_seq_len=4096,
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
"""The fine-tuning presets plus the layer shapes of Llama-2 7B, Llama-3 8B and Llama-3 70B."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerMethod:
    """One way of stepping the optimizer, as the estimate compares them."""

    description: str
    """One line for the report."""
    in_backward: bool
    """Stepped inside backward (``OptimizerInBackward``) or by ``step()`` after it."""
    optimizer: str | None = None
    """Dotted path of the optimizer class this method always uses (a compact-state optimizer),
    with its default arguments; ``None``: the configured class, arguments and kernel."""
    param_dtype: str | None = None
    """Weight dtype this method needs (``bfloat16`` for the compact state); ``None``: the
    configured one."""
    optimizer_kwargs: tuple[tuple[str, Any], ...] = ()
    """Arguments of ``optimizer`` (with a fixed ``optimizer`` only)."""


METHODS: dict[str, OptimizerMethod] = {
    "plain": OptimizerMethod(description="optimizer.step() after backward", in_backward=False),
    "in-backward": OptimizerMethod(
        description="OptimizerInBackward: each unit stepped when reduced", in_backward=True
    ),
    "compact": OptimizerMethod(
        description="CompactAdamW in backward: bf16 weights + int8 error, 8-bit moments",
        in_backward=True,
        optimizer="fused_optim_dist.compact_adamw.CompactAdamW",
        param_dtype="bfloat16",
        # The update a GPU runs: the C kernel is the CPU's, and it needs no temporaries, so a
        # CPU run with it would understate the peak of the same step on a GPU.
        optimizer_kwargs=(("kernel", "eager"),),
    ),
    "compact-4bit": OptimizerMethod(
        description="CompactAdamW in backward, the second moment in 4 bits (variance_bits=4)",
        in_backward=True,
        optimizer="fused_optim_dist.compact_adamw.CompactAdamW",
        param_dtype="bfloat16",
        optimizer_kwargs=(("kernel", "eager"), ("variance_bits", 4)),
    ),
}
"""The methods the estimate can compare, by name. A new optimizer (a compact-state AdamW) is
one more entry with its ``optimizer`` path; nothing else changes."""

DEFAULT_METHODS = ("plain", "in-backward", "compact")
"""What the estimate compares unless told (``compact-4bit`` on request)."""

KERNELS = ("foreach", "fused", "for-loop")
"""How the optimizer's update runs: CUDA's default for AdamW is foreach (fused only on request
or with ``capturable``); foreach keeps scratch the size of the tensors it steps at once."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Margin:
    """Memory a GPU needs beyond the tensors the simulation counts (guesses, configurable)."""

    fixed_gib: float = 2.0
    """CUDA context (~0.5 GiB), NCCL buffers and cuBLAS workspaces (~1 GiB), per GPU."""
    fraction: float = 0.10
    """Caching-allocator reserved-but-unallocated memory and fragmentation, as a share of the
    tracked peak (torchtitan saw ~3 GiB of this kind on an 8B model, PR #705)."""

    def __post_init__(self) -> None:
        if self.fixed_gib < 0 or not 0 <= self.fraction < 1:
            raise ValueError(
                f"the margin must be >= 0 GiB and a fraction in [0, 1), got {self.fixed_gib} "
                f"GiB and {self.fraction}"
            )

    def bytes_for(self, peak: int) -> int:
        """The margin added to a tracked peak of ``peak`` bytes."""
        return int(self.fixed_gib * GIB + self.fraction * peak)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateConfig:
    """The training step to simulate; field names follow ``scripts/finetune.py``'s flags."""

    model: str = "small"
    """A name of ``SHAPES``; unused with ``hf_model``."""
    llama: LlamaConfig | None = None
    """A Llama shape overriding ``model`` (finetune's ``--dim``/``--n-layers``)."""
    hf_model: Path | None = None
    """A transformers model directory: only its ``config.json`` is read."""
    world_size: int = 8
    """Ranks of the job."""
    hsdp_replicas: int = 1
    """Replica groups of HSDP (a 2-D mesh, replicas x world_size / replicas); 1: FSDP."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    mixed_precision: str = "none"
    """``none`` or ``bf16`` (FSDP2 computes in bfloat16 and reduces in float32)."""
    param_dtype: str = "float32"
    """``float32`` or ``bfloat16`` (pure bf16: weights, gradients and state in bf16)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    batch_size: int = 8
    """GLOBAL sequences per optimizer step, over all ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    optimizer: str = "torch.optim.AdamW"
    """Dotted path of the optimizer class."""
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of the optimizer class."""
    kernel: str = "foreach"
    """One of ``KERNELS``, for both methods, unless ``optimizer_kwargs`` sets it."""
    max_grad_norm: float | None = None
    """Clip by global norm (in backward for the in-backward method)."""
    methods: tuple[str, ...] = DEFAULT_METHODS
    """Names of ``METHODS`` to compare; the first is the baseline of the savings."""
    gloo_reduce_scatter_buffer: bool = False
    """Add gloo's reduce-scatter buffer (to compare with a gloo run; never for a GPU job)."""

    def __post_init__(self) -> None:
        if self.hf_model is None and self.llama is None and self.model not in SHAPES:
            raise ValueError(f"unknown model {self.model!r}; expected one of {sorted(SHAPES)}")
        if self.world_size < 1 or self.hsdp_replicas < 1 or self.world_size % self.hsdp_replicas:
            raise ValueError(
                f"--hsdp-replicas {self.hsdp_replicas} must divide --world-size "
                f"{self.world_size} (both >= 1)"
            )
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(f"mixed_precision must be none or bf16, not {self.mixed_precision}")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"param_dtype must be float32 or bfloat16, not {self.param_dtype}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {self.kernel!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods {unknown or '()'}: expected names of {sorted(METHODS)}")
        if self.batch_size % (self.grad_accum * self.world_size):
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of --grad-accum x "
                f"--world-size = {self.grad_accum} x {self.world_size}"
            )

    @property
    def micro_batch(self) -> int:
        """Sequences per rank per micro-batch."""
        return self.batch_size // (self.grad_accum * self.world_size)

    def describe(self) -> str:
        """One line with what the estimate assumes."""
        model = str(self.hf_model) if self.hf_model is not None else self.model
        mesh = (
            f"HSDP {self.hsdp_replicas} x {self.world_size // self.hsdp_replicas}"
            if self.hsdp_replicas > 1
            else "FSDP"
        )
        precision = f"{self.param_dtype} params" + (
            ", bf16 compute, fp32 reduce" if self.mixed_precision == "bf16" else ""
        )
        clip = f", clip {self.max_grad_norm:g}" if self.max_grad_norm else ""
        return (
            f"{model}, {self.world_size} ranks ({mesh}), {precision}, "
            f"AC {'on' if self.activation_checkpointing else 'off'}, micro-batch "
            f"{self.micro_batch} x {self.seq_len} tokens x {self.grad_accum} per step, "
            f"{self.optimizer.rsplit('.', 1)[-1]} ({self.kernel}){clip}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodEstimate:
    """The simulated peak of one method on rank 0 (the largest shards of uneven splits)."""

    method: str
    num_params: int
    peak: Peak | None
    """``None`` when the method could not be simulated (``skipped`` says why)."""
    seconds: float
    """Wall-clock time of the simulation (build, warm-up and tracked step)."""
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        peak = self.peak
        return {
            "method": self.method,
            "num_params": self.num_params,
            "peak_bytes": peak and peak.total,
            "peak_by_kind": peak and peak.by_kind,
            "peak_phase": peak and peak.phase,
            "peak_module": peak and peak.module,
            "seconds": self.seconds,
            "skipped": self.skipped,
        }


# ------------------------------------------------------------------------------- simulation


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Be rank 0 of a fake process group of ``world_size`` ranks, in this process.

    The fake group needs only a rank and a world size: 512 ranks cost what 2 do.

    Raises:
        RuntimeError: if this process already has a default process group.
    """
    # Importing it registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialized in this process; run the memory "
            "estimate before joining one (finetune.py --estimate-memory exits before it does)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(config: EstimateConfig, device: str) -> DeviceMesh:
    if config.hsdp_replicas == 1:
        return init_device_mesh(device, (config.world_size,))
    return init_device_mesh(
        device,
        (config.hsdp_replicas, config.world_size // config.hsdp_replicas),
        mesh_dim_names=("replicate", "shard"),
    )


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # A fake model cannot be cast with .to() afterwards: it is built in its dtype.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


LossFn = Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
_TRACKED_STEP = "fused_optim_dist_recipes::tracked_step"


def _build(
    config: EstimateConfig, mesh: DeviceMesh, param_dtype: str
) -> tuple[nn.Module, LossFn, int]:
    """The model sharded as the fine-tuning job shards it; its loss; its vocabulary size."""
    with _default_dtype(_dtype(param_dtype)):
        if config.hf_model is not None:
            transformers = importlib.import_module("transformers")
            hf_config = transformers.AutoConfig.from_pretrained(
                config.hf_model, local_files_only=True
            )
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config, dtype=_dtype(param_dtype)
            )
            blocks, vocab = hf.decoder_blocks(model), hf_config.vocab_size

            def logits(tokens: torch.Tensor) -> torch.Tensor:
                return hf.hf_logits(model, tokens)
        else:
            shape = config.llama or SHAPES[config.model]
            shape = dataclasses.replace(shape, max_seq_len=max(shape.max_seq_len, config.seq_len))
            model = Llama(shape)
            blocks, vocab, logits = list(model.layers), shape.vocab_size, model
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.mixed_precision == "bf16"
        else None
    )
    apply_fsdp(
        model,
        blocks=blocks,
        mesh=mesh,
        mp_policy=mp_policy,
        activation_checkpointing=config.activation_checkpointing,
    )

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The fine-tuning job's loss: logits cast to float32 for the cross-entropy.
        inputs, targets = batch
        return F.cross_entropy(logits(inputs).flatten(0, 1).float(), targets.flatten())

    return model, loss_fn, vocab


def _optimizer(model: nn.Module, config: EstimateConfig, method: OptimizerMethod) -> Optimizer:
    path = method.optimizer or config.optimizer
    kwargs = dict(method.optimizer_kwargs) if method.optimizer else dict(config.optimizer_kwargs)
    accepted = inspect.signature(resolve_optimizer_class(path)).parameters
    # The kernel choice applies to classes that offer one (torch.optim's), unless set already.
    if {"foreach", "fused"} <= accepted.keys() and not {"foreach", "fused"} & kwargs.keys():
        kwargs |= {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(
            config.kernel, {"foreach": False}
        )
    if method.in_backward:
        kwargs["max_grad_norm"] = config.max_grad_norm
    return build_optimizer(
        model.parameters(), path, in_backward=method.in_backward, lr=1e-4, **kwargs
    )


def train_step(
    optim: Optimizer,
    loss_fn: LossFn,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float | None,
    tracker: StepMemoryTracker | None = None,
) -> None:
    """The fine-tuning job's step: ``backward_micro_batches``, ``clip_grad_norm_``, ``step()``,
    ``zero_grad()``; what follows backward is labelled for ``tracker``. Fake or real tensors."""
    backward_micro_batches(optim, loss_fn, micro_batches)
    with tracker.after_backward() if tracker is not None else contextlib.nullcontext():
        clip_grad_norm_(optim, max_grad_norm)
        optim.step()
        optim.zero_grad()


def run_tracked_steps(
    model: nn.Module,
    optim: Optimizer,
    loss_fn: LossFn,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float | None,
    steps: int = 1,
    gloo_reduce_scatter_buffer: bool = False,
) -> list[Peak]:
    """Run one ``train_step`` untracked (warm-up), then track ``steps`` more, each on its own
    (and in its own ``torch.profiler`` range); return their peaks."""
    train_step(optim, loss_fn, micro_batches, max_grad_norm=max_grad_norm)
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    peaks = []
    for _ in range(steps):
        tracker = StepMemoryTracker(
            model, state, gloo_reduce_scatter_buffer=gloo_reduce_scatter_buffer
        )
        with tracker, torch.profiler.record_function(_TRACKED_STEP):
            train_step(optim, loss_fn, micro_batches, max_grad_norm=max_grad_norm, tracker=tracker)
        peaks.append(tracker.peak())
    return peaks


def _micro_batches(config: EstimateConfig, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (config.micro_batch, config.seq_len)
    return [
        (torch.randint(0, vocab, shape), torch.randint(0, vocab, shape))
        for _ in range(config.grad_accum)
    ]


def _simulate(config: EstimateConfig, name: str) -> MethodEstimate:
    started = time.perf_counter()
    method = METHODS[name]
    with fake_world(config.world_size):
        mesh = _mesh(config, "cpu")  # outside fake mode: the mesh holds real rank ids
        # Built and sharded on the meta device, then given fake storage: fully_shard cuts each
        # parameter into world_size chunks, which costs about 1 ms per chunk under fake mode
        # (5 minutes per method for an 8B model on 512 ranks) and microseconds on meta.
        with torch.device("meta"):
            model, loss_fn, vocab = _build(config, mesh, method.param_dtype or config.param_dtype)
        # Non-fake inputs allowed: to_empty reads the meta tensors it replaces.
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            num_params = sum(p.numel() for p in model.parameters())
            optim = _optimizer(model, config, method)
            try:
                (peak,) = run_tracked_steps(
                    model,
                    optim,
                    loss_fn,
                    _micro_batches(config, vocab),
                    max_grad_norm=config.max_grad_norm,
                    gloo_reduce_scatter_buffer=config.gloo_reduce_scatter_buffer,
                )
                skipped = None
            except DataDependentOutputException as error:
                # Fake tensors hold no values: code reading one on the host cannot run.
                peak, skipped = None, f"reads a tensor's value on the host ({error.func})"
    return MethodEstimate(
        method=name,
        num_params=num_params,
        peak=peak,
        seconds=time.perf_counter() - started,
        skipped=skipped,
    )


def estimate(config: EstimateConfig) -> list[MethodEstimate]:
    """Simulate each of ``config.methods``; return their peaks on rank 0, in that order.

    A method whose step reads a tensor's value on the host (``.item()``, ``.tolist()``) cannot
    run on fake tensors: it is returned without a peak, with the reason in ``skipped``. Runs
    in this process, which must not have joined a process group (see ``fake_world``).
    """
    return [_simulate(config, name) for name in config.methods]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """One rank's peaks of the tracked steps of a real run, measured two ways."""

    allocator_peaks: list[int]
    """Per tracked step: the peak of the bytes the CPU allocator had handed out since the
    model was built (``torch.profiler`` allocation events)."""
    tracker: list[Peak]
    """Per tracked step: the tracker's peak on the real tensors."""


def measure(config: EstimateConfig, name: str, *, steps: int = 3) -> Measured:
    """Run ``name``'s warm-up and ``steps`` tracked steps on real CPU tensors, in this
    process's gloo group.

    Collective: every rank of a ``config.world_size`` group calls it (``config.hsdp_replicas``
    must be 1). The model is the simulated one, initialised from the default RNG.

    The allocator peak is independent of the tracker: c10's CPU allocator reports every
    allocation and free to the profiler, whichever thread or C++ code asks (gloo's
    reduce-scatter buffer included), so it is what a GPU run's ``max_memory_allocated`` is.
    It varies from step to step by when gloo's worker thread releases its buffers, hence
    several steps.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if dist.get_world_size() != config.world_size or config.hsdp_replicas != 1:
        raise ValueError(
            f"measure needs a {config.world_size}-rank gloo group and FSDP; got "
            f"{dist.get_world_size()} ranks and {config.hsdp_replicas} replicas"
        )
    gc.collect()  # free what earlier runs left in cycles before counting
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        method = METHODS[name]
        model, loss_fn, vocab = _build(
            config, _mesh(config, "cpu"), method.param_dtype or config.param_dtype
        )
        optim = _optimizer(model, config, method)
        peaks = run_tracked_steps(
            model,
            optim,
            loss_fn,
            _micro_batches(config, vocab),
            max_grad_norm=config.max_grad_norm,
            steps=steps,
        )
    windows: list[tuple[int, int]] = []
    events: list[tuple[int, int, int]] = []  # (time, address, bytes: negative for a free)
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        elif event.name == _TRACKED_STEP:
            windows.append((event.start_time_ns, event.end_time_ns))
        pending.extend(event.children)
    assert len(windows) == steps, f"found {len(windows)} tracked-step ranges, not {steps}"
    windows.sort()
    events.sort()
    # An address handed out again without a free in between was freed unreported: by a
    # thread the profiler does not follow, such as gloo's worker releasing a collective's
    # buffer. When is not known, only that it was before the reuse and, for a buffer of a
    # tracked step, by that step's end (the step waits for its collectives). So such a
    # buffer counts until its address is reused or its step ends, whichever comes first,
    # never into the next step, where it would otherwise stay as long as the address is
    # not reused: 4% of the peak per buffer, up to 14% in a loaded test run.
    freed_unreported: set[int] = set()
    last: dict[int, int] = {}
    for index, (_, address, size) in enumerate(events):
        if size > 0 and events[last.get(address, index)][2] > 0 and address in last:
            freed_unreported.add(last[address])
        last[address] = index
    # The allocator's own running total counts since the process first profiled (earlier
    # runs' leftovers included): sum this run's allocations that are still live instead.
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, event index)
    current = 0
    allocator_peaks = [0] * steps
    step = 0
    for index, (time_ns, address, size) in enumerate(events):
        while step < steps and time_ns > windows[step][1]:
            start = windows[step][0]
            for stale, (stale_size, allocated) in list(live.items()):
                if allocated in freed_unreported and events[allocated][0] >= start:
                    current -= stale_size
                    del live[stale]
            step += 1
        if size > 0:
            current += size - live.get(address, (0, 0))[0]
            live[address] = (size, index)
        else:
            current -= live.pop(address, (0, 0))[0]
        if step < steps and windows[step][0] <= time_ns:
            allocator_peaks[step] = max(allocator_peaks[step], current)
    return Measured(allocator_peaks=allocator_peaks, tracker=peaks)


# ---------------------------------------------------------------------------------- report


def verdict(peak: int, margin: Margin, gpu_gib: float) -> str:
    """Whether ``peak`` tracked bytes plus ``margin`` fit a GPU of ``gpu_gib`` GiB."""
    need = peak + margin.bytes_for(peak)
    left = gpu_gib * GIB - need
    gpu = f"{gpu_gib:.1f} GiB GPU"
    if left >= 0:
        return f"fits a {gpu} with {left / GIB:.1f} GiB to spare (est.)"
    return f"does not fit a {gpu}: {-left / GIB:.1f} GiB short (est.)"


def format_report(
    config: EstimateConfig, results: list[MethodEstimate], margin: Margin, gpu_gib: float
) -> str:
    """The estimate as text: each method's peak per rank, its breakdown and where it sits, the
    saving against the first method, the verdict, and what the figures leave out."""
    simulated = [r for r in results if r.peak is not None]
    base = simulated[0].peak if simulated else None
    unit, scale = ("GiB", GIB) if base is None or base.total >= GIB else ("MiB", 2**20)

    def size(n: float) -> str:
        return f"{n / scale:.2f}"

    lines = [
        f"Estimated peak memory per rank (simulated rank 0; {results[0].num_params / 1e6:,.1f}M "
        f"parameters): {config.describe()}",
        "",
        f"| method | peak {unit} (est.) | "
        + " | ".join(k.replace("_", " ") for k in KINDS)
        + f" | saving vs {simulated[0].method if simulated else '-'} | peak at (phase, module) |",
        "|---|---|" + "---|" * len(KINDS) + "---|---|",
    ]
    for r in results:
        if r.peak is None:
            lines.append(f"| {r.method} | not simulated: {r.skipped} |" + " |" * (len(KINDS) + 2))
            continue
        saving = base.total - r.peak.total
        share = (
            f"{size(saving)} {unit} ({saving / base.total:.0%})" if r is not simulated[0] else "-"
        )
        lines.append(
            f"| {r.method} | {size(r.peak.total)} | "
            + " | ".join(size(r.peak.by_kind[k]) for k in KINDS)
            + f" | {share} | {r.peak.phase}, {r.peak.module} |"
        )
    lines += [""] + [f"  {r.method}: {METHODS[r.method].description}" for r in results]
    lines += [
        "",
        f"Verdict, with a margin of {margin.fixed_gib:g} GiB + {margin.fraction:.0%} of the "
        "peak for what is not simulated:",
    ]
    lines += [f"  {r.method}: {verdict(r.peak.total, margin, gpu_gib)}" for r in simulated]
    lines += [
        "",
        "Not simulated (covered only by the margin): the CUDA caching allocator's reserved "
        "memory and fragmentation, the CUDA context, NCCL and cuBLAS workspaces, and the "
        "kernels CUDA picks (the simulation runs CPU kernels; the optimizer kernel is "
        f"'{config.kernel}', as set). Every figure is an estimate.",
    ]
    return "\n".join(lines)


def estimate_job_memory(job: Any, *, llama: LlamaConfig | None) -> dict[str, Any]:
    """Print the estimate for a fine-tuning job as configured; return it (rank 0 only).

    ``job`` is ``scripts/finetune.py``'s ``JobConfig`` (read by field name: model, hf_model,
    activation_checkpointing, mixed_precision, param_dtype, seq_len, batch_size, grad_accum,
    optimizer, optimizer_kwargs, max_grad_norm, in_backward); ``llama`` its resolved preset,
    ``None`` with ``hf_model``. The world size is torchrun's ``WORLD_SIZE`` (1 without
    torchrun); the GPU is this machine's first CUDA device, or an 80 GB one. Under torchrun
    only rank 0 simulates, and the other ranks return an empty dict. Call it before joining a
    process group.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    config = EstimateConfig(
        model=job.model,
        llama=llama,
        hf_model=job.hf_model,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        activation_checkpointing=job.activation_checkpointing,
        mixed_precision=job.mixed_precision,
        param_dtype=job.param_dtype,
        seq_len=job.seq_len,
        batch_size=job.batch_size,
        grad_accum=job.grad_accum,
        optimizer=job.optimizer,
        optimizer_kwargs=job.optimizer_kwargs,
        max_grad_norm=job.max_grad_norm or None,
        # The kernel the job runs, where its optimizer arguments choose one.
        **({"kernel": "fused"} if job.optimizer_kwargs.get("fused") else {}),
    )
    gpu_gib = (
        torch.cuda.get_device_properties(0).total_memory / GIB
        if torch.cuda.is_available()
        else GPU_80GB_GIB
    )
    results = estimate(config)
    margin = Margin()
    print(format_report(config, results, margin, gpu_gib), flush=True)
    method = "in-backward" if job.in_backward else "plain"
    print(
        f"This job steps the optimizer {'in' if job.in_backward else 'after'} backward ({method}).",
        flush=True,
    )
    return {
        "config": config.describe(),
        "job_method": method,
        "results": [r.as_dict() for r in results],
    }
