"""Fine-tune a language model with FSDP2, the optimizer stepped inside backward.

The default run fine-tunes the ``small`` Llama preset on the Python standard library's own
source (byte tokens, read at run time, nothing downloaded); on two CPU cores it takes about two
minutes and writes its outputs to ``outputs/finetune``::

    torchrun --nproc_per_node 2 scripts/finetune.py
    python scripts/finetune.py --model tiny --max-steps 50           # one process, no torchrun
    torchrun --nproc_per_node 2 scripts/finetune.py --resume  # continue from the newest checkpoint
    torchrun --nproc_per_node 2 scripts/finetune.py --no-in-backward  # plain optimizer, same loop
    torchrun --nproc_per_node 8 scripts/finetune.py --model 1b --seq-len 2048 --batch-size 64 \\
        --mixed-precision bf16 --activation-checkpointing             # GPUs: CUDA + NCCL
    torchrun --nproc_per_node 2 scripts/finetune.py --hf-model DIR --data corpus.jsonl

The job needs the application extra, ``pip install -e '.[recipes]'`` (the README's set-up
command installs it). Two nodes (here both on one machine; on a cluster put node 0's address
in ``--rdzv-endpoint`` and run one command per node)::

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id job1 scripts/finetune.py
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id job1 scripts/finetune.py

``--batch-size`` is the GLOBAL batch: sequences per optimizer step over all ranks and
micro-batches. Each step's batch depends only on (seed, step), so results do not depend on how
it is split, and a resumed run sees the batches the uninterrupted run would have seen.

Held-out loss and samples: a block of the data fixed by ``--seed`` (``--eval-tokens``) is kept
out of training; its mean loss is computed every ``--eval-every`` steps and at the end, the same
on every rank and for any world size. Before and after training the model continues
``--sample-prompt`` (greedy, and with ``--sample-top-k`` also sampled), still sharded: every
rank runs the same generation and rank 0 prints and saves it.

Outputs (rank 0 writes them): ``config.json`` (the resolved configuration), ``metrics.jsonl``
(one JSON object per step: step, loss, lr, grad_norm, tokens_per_s, peak_mem_bytes, and
heldout_loss on the steps it was computed at), ``loss.png`` (training and held-out loss),
``samples.txt``, ``summary.json``, ``checkpoints/step_<N>/`` (sharded; resumable with or without
``--no-in-backward``, on any number of ranks) and the final weights: ``weights.pt`` (for
``--init-from``) or, with ``--hf-model``, ``hf_model/`` in transformers format.

Clipping: with ``--max-grad-norm`` the in-backward optimizer clips each FSDP unit as it steps,
predicting the norm of the units not yet reduced from the previous step (see
``fused_optim_dist._gradients``). Runs then differ slightly from ``--no-in-backward``, which
clips exactly; a resumed run still equals the uninterrupted one, as checkpoints carry that
history. ``--max-grad-norm 0`` turns clipping off. ``--clip-grad-value`` and ``--skip-nonfinite``
are the in-backward optimizer's other gradient options.

The flags build one ``JobConfig`` (``parse_args``); everything after that takes the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from fused_optim_dist import build_optimizer, checkpoint, clip_grad_norm_
from fused_optim_dist._checkpoint_layout import DCP_METADATA_FILE
from fused_optim_dist._validation import resolve_optimizer_class
from fused_optim_dist.training import backward_micro_batches
from fused_optim_dist_recipes import hf
from fused_optim_dist_recipes.data import (
    BatchSampler,
    ByteTokenizer,
    Tokenizer,
    read_documents,
    split_held_out,
    tokenize,
)
from fused_optim_dist_recipes.evaluation import evaluating, generate, held_out_loss
from fused_optim_dist_recipes.memory_estimate import estimate_job_memory
from fused_optim_dist_recipes.metrics import (
    HELD_OUT_KEY,
    MetricsLog,
    ProgressLine,
    format_bytes,
    memory_budget_bytes,
    peak_memory_bytes,
    plot_loss_curve,
)
from fused_optim_dist_recipes.models import PRESETS, Llama, LlamaConfig, apply_fsdp

if os.environ.get("FUSED_OPTIM_DIST_FAULT"):  # tests only: kill a rank at a chosen point
    from _faults import inject as inject_fault
else:

    def inject_fault(when: str, **_: Any) -> None:
        """No fault injection: the switch is unset."""


DEFAULT_MODEL = "small"
CHECKPOINT_SUBDIR = "checkpoints"
CONFIG_FILE, METRICS_FILE, SUMMARY_FILE = "config.json", "metrics.jsonl", "summary.json"
LOSS_PLOT_FILE, WEIGHTS_FILE, HF_EXPORT_DIR = "loss.png", "weights.pt", "hf_model"
SAMPLES_FILE = "samples.txt"
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
MIN_LR_RATIO = 0.1
"""The cosine schedule decays the learning rate to this fraction of --lr."""
DEFAULT_WARMUP_STEPS = 20
"""Warmup when --warmup-steps is not given, at most a tenth of --max-steps."""
DEFAULT_EVAL_TOKENS = 16384
"""Held-out tokens when --eval-tokens is not given, at most a tenth of the corpus: 128
sequences of 128 tokens, about a second per evaluation of the default job on two CPU ranks."""
HELD_OUT_CORPUS_SHARE = 10
"""The default held-out split is at most 1/10 of the corpus."""
OPTIMIZER_SHORT_NAMES = {
    name.lower(): f"torch.optim.{name}"
    for name in torch.optim.__all__
    if isinstance(cls := getattr(torch.optim, name), type)
    and issubclass(cls, Optimizer)
    and cls is not Optimizer
}
OPTIMIZER_SHORT_NAMES["compactadamw"] = "fused_optim_dist.compact_adamw.CompactAdamW"
COMPACT_OPTIMIZERS = ("fused_optim_dist.compact_adamw.CompactAdamW",)
"""Optimizers made for bfloat16 weights: ``--param-dtype`` defaults to bfloat16 with them."""


# ---------------------------------------------------------------------------------- config


@dataclasses.dataclass(kw_only=True)
class JobConfig:
    """The whole job, built once from the flags by ``parse_args`` (or directly, in tests).

    Field names are the flags' (``--seq-len`` is ``seq_len``); ``in_backward`` is the inverse
    of ``--no-in-backward``. Checks between fields run in ``__post_init__`` and raise
    ``ValueError`` naming the flags.
    """

    # model
    model: str = DEFAULT_MODEL
    """Llama preset (``fused_optim_dist_recipes.models.PRESETS``); unused with ``hf_model``."""
    dim: int | None = None
    """Width overriding the preset's; the feed-forward width scales with it."""
    n_layers: int | None = None
    """Depth overriding the preset's."""
    hf_model: Path | None = None
    """A local transformers causal-LM directory to fine-tune instead of a preset."""
    init_from: Path | None = None
    """Initial weights: a checkpoint directory or a file written by ``export_weights``."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    mixed_precision: str = "none"
    """``none`` or ``bf16`` (compute in bfloat16, reduce gradients in float32)."""
    param_dtype: str | None = None
    """``float32`` or ``bfloat16``: the dtype of the model's weights, which the optimizer
    steps; ``None``: bfloat16 with ``compactadamw`` (``COMPACT_OPTIMIZERS``), else float32."""
    # data
    data: Path | None = None
    """Text file, ``.jsonl`` file with a ``text`` field, or directory of them; ``None``: the
    standard library's ``.py`` files."""
    seq_len: int = 128
    """Tokens per sequence."""
    batch_size: int = 16
    """GLOBAL sequences per optimizer step, over all ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    eval_tokens: int | None = None
    """Tokens held out of training for the held-out loss, in whole sequences; ``None``:
    ``DEFAULT_EVAL_TOKENS``, at most a tenth of the corpus; 0: no held-out split."""
    eval_every: int = 50
    """Held-out loss every N steps and at the end; 0: at the end only."""
    # samples
    sample_prompt: str = "class Stack:\n    def push(self, "
    """Text the model continues before and after training (empty: the start of a document)."""
    sample_tokens: int = 200
    """Tokens generated per sample; 0: no samples."""
    sample_top_k: int | None = None
    """Also sample from the K most likely tokens (seeded by ``seed``), besides greedy."""
    # optimization
    max_steps: int = 300
    """Optimizer steps of the whole run (a resumed run continues to it)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int | None = None
    """Linear warmup steps, then cosine decay; ``None``: ``DEFAULT_WARMUP_STEPS``, at most a
    tenth of ``max_steps``."""
    optimizer: str = "torch.optim.AdamW"
    """Dotted path of the optimizer class."""
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of the optimizer class (not ``lr``)."""
    in_backward: bool = True
    """Step inside backward (``OptimizerInBackward``), or after it (the plain optimizer)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (in backward over several FSDP units: unit by unit,
    by the norm seen so far and the rest's from the previous step; docs/gradients.md); 0: no
    clipping."""
    clip_grad_value: float | None = None
    """In backward: clamp every gradient element to ``[-v, v]`` instead of clipping by norm."""
    skip_nonfinite: bool = False
    """In backward: skip the update of a unit whose gradient holds inf/NaN (on any rank)."""
    # run
    output_dir: Path = Path("outputs/finetune")
    """Where config, metrics, plot, checkpoints and weights go."""
    save_every: int = 100
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 3
    """Keep only the newest N checkpoints."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``output_dir``."""
    seed: int = 0
    """Model initialisation and data order."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""
    backend: str = "auto"
    """``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""
    log_every: int = 10
    """Print a progress line every N steps when not on a terminal."""
    estimate_memory: bool = False
    """Print the simulated peak memory per rank of this job, then exit without training."""

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            compact = self.optimizer in COMPACT_OPTIMIZERS
            self.param_dtype = "bfloat16" if compact else "float32"
        # A class with a fused kernel (torch.optim's AdamW, the default) on float32 weights
        # runs it unless --optimizer-kwargs chooses a kernel: one kernel per bucket, where the
        # class's default on the CPU is a per-tensor loop, several times slower per update. In
        # and after backward alike, so the two runs take the same update; resolved here so
        # that config.json and the memory estimate see it.
        if (
            self.param_dtype == "float32"
            and not {"foreach", "fused"} & self.optimizer_kwargs.keys()
            and _has_fused_kernel(self.optimizer)
        ):
            self.optimizer_kwargs = {**self.optimizer_kwargs, "fused": True}
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"--batch-size {self.batch_size} is not a multiple of --grad-accum "
                f"{self.grad_accum}; each micro-batch must hold the same number of sequences"
            )
        if self.warmup_steps is None:
            self.warmup_steps = min(DEFAULT_WARMUP_STEPS, self.max_steps // 10)
        elif self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"--warmup-steps {self.warmup_steps} must be below --max-steps {self.max_steps}"
            )
        if self.max_grad_norm < 0 or not math.isfinite(self.max_grad_norm):
            raise ValueError(
                f"--max-grad-norm must be a finite number >= 0, got {self.max_grad_norm}"
            )
        if not self.in_backward and (self.clip_grad_value is not None or self.skip_nonfinite):
            raise ValueError(
                "--clip-grad-value and --skip-nonfinite are options of the in-backward "
                "optimizer; drop them or --no-in-backward"
            )
        if self.clip_grad_value is not None and self.max_grad_norm:
            raise ValueError(
                "--clip-grad-value clamps gradients instead of clipping their norm; pass "
                "--max-grad-norm 0 with it"
            )
        if "lr" in self.optimizer_kwargs:
            raise ValueError("--optimizer-kwargs sets 'lr'; set the learning rate with --lr")
        if self.eval_tokens and self.eval_tokens < self.seq_len:
            raise ValueError(
                f"--eval-tokens {self.eval_tokens} holds no whole sequence of --seq-len "
                f"{self.seq_len}; hold out at least {self.seq_len} tokens, or 0 for none"
            )
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError(
                "--backend nccl needs CUDA tensors; use --backend gloo with --device cpu"
            )

    def optimizer_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``build_optimizer`` besides the class and ``in_backward``."""
        options: dict[str, Any] = {"max_grad_norm": self.max_grad_norm or None}
        if self.clip_grad_value is not None:
            options["clip_grad_value"] = self.clip_grad_value
        if self.skip_nonfinite:
            options["skip_nonfinite"] = True
        return {"lr": self.lr, **self.optimizer_kwargs, **options}


def _has_fused_kernel(optimizer: str) -> bool:
    """Whether the class at ``optimizer`` takes ``fused=``; ``False`` for a path that does not
    name an optimizer class (the argument check reports it)."""
    try:
        return "fused" in inspect.signature(resolve_optimizer_class(optimizer)).parameters
    except (TypeError, ValueError):
        return False


def _default(field: str) -> Any:
    return JobConfig.__dataclass_fields__[field].default


# ---------------------------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object like '{{\"betas\": [0.9, 0.95]}}', got {text}"
        )
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the ``None`` of optional flags."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Fine-tune a language model with FSDP2 and the optimizer step in backward.",
        formatter_class=_HelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help=f"Llama preset (default {DEFAULT_MODEL})",
    )
    model.add_argument(
        "--dim",
        type=_positive_int,
        help="override the preset's width (the feed-forward width scales with it)",
    )
    model.add_argument("--n-layers", type=_positive_int, help="override the preset's depth")
    model.add_argument(
        "--hf-model",
        type=Path,
        metavar="DIR",
        help="fine-tune a local transformers causal LM directory instead",
    )
    model.add_argument(
        "--init-from",
        type=Path,
        metavar="PATH",
        help="initial weights: a checkpoint directory or an exported weights file",
    )
    model.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward",
    )
    model.add_argument(
        "--mixed-precision",
        choices=("none", "bf16"),
        default=_default("mixed_precision"),
        help="bf16: compute in bfloat16, reduce gradients in float32",
    )
    model.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default=_default("param_dtype"),
        help="dtype of the weights the optimizer steps (default: bfloat16 with "
        "--optimizer compactadamw, float32 otherwise)",
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="text file, .jsonl file with a "
        "'text' field, or directory of them (default: the stdlib's .py files)",
    )
    data.add_argument(
        "--seq-len", type=_positive_int, default=_default("seq_len"), help="tokens per sequence"
    )
    data.add_argument(
        "--batch-size",
        type=_positive_int,
        default=_default("batch_size"),
        help="GLOBAL sequences per optimizer step (all ranks, all micro-batches)",
    )
    data.add_argument(
        "--grad-accum",
        type=_positive_int,
        default=_default("grad_accum"),
        help="micro-batches per optimizer step",
    )
    data.add_argument(
        "--eval-tokens",
        type=_non_negative_int,
        metavar="N",
        help="tokens held out of training for the held-out loss, a block fixed by --seed, in "
        f"whole sequences (default {DEFAULT_EVAL_TOKENS}, at most a tenth of the data; 0: none)",
    )
    data.add_argument(
        "--eval-every",
        type=_non_negative_int,
        default=_default("eval_every"),
        metavar="N",
        help="held-out loss every N steps and at the end (0: at the end only)",
    )
    sample = p.add_argument_group("samples (before and after training)")
    sample.add_argument(
        "--sample-prompt",
        default=_default("sample_prompt"),
        metavar="TEXT",
        help="text the model continues (empty: the start of a document)",
    )
    sample.add_argument(
        "--sample-tokens",
        type=_non_negative_int,
        default=_default("sample_tokens"),
        metavar="N",
        help="tokens generated per sample (0: no samples)",
    )
    sample.add_argument(
        "--sample-top-k",
        type=_positive_int,
        metavar="K",
        help="besides the greedy text, sample from the K most likely tokens (seeded by --seed)",
    )
    optim = p.add_argument_group("optimization")
    optim.add_argument(
        "--max-steps",
        type=_positive_int,
        default=_default("max_steps"),
        help="optimizer steps of the whole run (a resumed run continues to it)",
    )
    optim.add_argument(
        "--lr", type=_positive_float, default=_default("lr"), help="peak learning rate"
    )
    optim.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        help="linear warmup, then cosine decay to "
        f"{MIN_LR_RATIO:g} x lr at --max-steps (default {DEFAULT_WARMUP_STEPS}, "
        "at most a tenth of --max-steps)",
    )
    optim.add_argument(
        "--optimizer",
        default="adamw",
        help="short name (" + ", ".join(sorted(OPTIMIZER_SHORT_NAMES)) + ") or dotted class path",
    )
    optim.add_argument(
        "--optimizer-kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help="extra keyword arguments for the optimizer, as a JSON object",
    )
    optim.add_argument(
        "--no-in-backward",
        dest="in_backward",
        action="store_false",
        help="step the plain optimizer after backward (same loop; same results unless clipping)",
    )
    optim.add_argument(
        "--max-grad-norm",
        type=float,
        default=_default("max_grad_norm"),
        help="clip the gradient norm to this (in backward, unit by unit: docs/gradients.md); "
        "0 disables clipping",
    )
    optim.add_argument(
        "--clip-grad-value",
        type=_positive_float,
        metavar="V",
        help="in backward: clamp every gradient element to [-V, V] (with --max-grad-norm 0)",
    )
    optim.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="in backward: skip the update of a unit whose gradient holds inf/NaN",
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--output-dir",
        type=Path,
        default=_default("output_dir"),
        help="where config, metrics, plot, checkpoints and weights go",
    )
    run.add_argument(
        "--save-every",
        type=_non_negative_int,
        default=_default("save_every"),
        help="checkpoint every N steps (0: only at the end)",
    )
    run.add_argument(
        "--keep-last",
        type=_positive_int,
        default=_default("keep_last"),
        help="keep only the newest N checkpoints",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --output-dir",
    )
    run.add_argument(
        "--seed", type=int, default=_default("seed"), help="model initialisation and data order"
    )
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=_default("device"),
        help="auto: CUDA when available",
    )
    run.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default=_default("backend"),
        help="auto: nccl on CUDA, gloo on CPU",
    )
    run.add_argument(
        "--log-every",
        type=_positive_int,
        default=_default("log_every"),
        help="print a progress line every N steps when not on a terminal",
    )
    run.add_argument(
        "--estimate-memory",
        action="store_true",
        help="print this job's simulated peak memory per rank (plain and in backward), then "
        "exit; see scripts/estimate_memory.py",
    )
    return p


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The job's configuration from the flags, checked; errors exit with argparse's usage
    message (status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hf_model is not None:
        if args.model or args.dim or args.n_layers:
            parser.error("--hf-model fine-tunes the model in DIR; drop --model/--dim/--n-layers")
        if not (args.hf_model / "config.json").is_file():
            parser.error(
                f"--hf-model {args.hf_model}: no config.json there; pass the "
                "directory that model.save_pretrained() wrote"
            )
    args.model = args.model or DEFAULT_MODEL
    for flag in ("data", "init_from"):
        path = getattr(args, flag)
        if path is not None and not path.exists():
            parser.error(f"--{flag.replace('_', '-')} {path} does not exist")
    optimizer = args.optimizer
    if "." not in optimizer and optimizer.lower() not in OPTIMIZER_SHORT_NAMES:
        parser.error(
            f"--optimizer {optimizer!r}: expected one of "
            f"{sorted(OPTIMIZER_SHORT_NAMES)} or a dotted path like torch.optim.AdamW"
        )
    args.optimizer = OPTIMIZER_SHORT_NAMES.get(optimizer.lower(), optimizer)
    try:
        cfg = JobConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
    if cfg.hf_model is None:
        try:
            _llama_config(cfg)
        except ValueError as error:
            parser.error(f"--model {cfg.model} with --dim/--n-layers: {error}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")
    newest = checkpoint.latest(cfg.output_dir / CHECKPOINT_SUBDIR)
    if newest is not None and not cfg.resume:
        parser.error(
            f"--output-dir {cfg.output_dir} already holds checkpoints (newest: "
            f"{newest.name}); pass --resume to continue that run, or choose another "
            "--output-dir"
        )
    try:  # the class and every keyword argument, tried on a stand-in parameter
        build_optimizer(
            [torch.zeros(1, requires_grad=True)],
            cfg.optimizer,
            in_backward=cfg.in_backward,
            **cfg.optimizer_arguments(),
        )
    except (TypeError, ValueError) as error:
        parser.error(
            f"--optimizer {optimizer} --optimizer-kwargs "
            f"'{json.dumps(cfg.optimizer_kwargs)}': {error}"
        )
    return cfg


# ---------------------------------------------------------------------------------- wiring


def _setup_distributed(cfg: JobConfig) -> tuple[torch.device, bool]:
    """Pick the device, join (or create) the process group; return (device, created_group)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else (torch.device("cpu"))
    )
    if use_cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if "RANK" in os.environ:  # launched by torchrun
        # Joins torchrun's shared store under a per-attempt prefix: restarts survive.
        checkpoint.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    else:  # plain `python`: a one-rank group, so FSDP2 and checkpoints work unchanged
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT
        )
    return device, True


def _llama_config(cfg: JobConfig) -> LlamaConfig:
    """The preset with the flags' overrides; ``--dim`` scales the feed-forward width too."""
    preset = PRESETS[cfg.model]
    dim = cfg.dim or preset.dim
    return dataclasses.replace(
        preset,
        dim=dim,
        n_layers=cfg.n_layers or preset.n_layers,
        ffn_hidden=preset.ffn_hidden * dim // preset.dim,
        max_seq_len=max(preset.max_seq_len, cfg.seq_len),
    )


@dataclasses.dataclass
class _Model:
    module: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: Tokenizer
    description: dict[str, Any]


def _build_model(cfg: JobConfig, device: torch.device) -> _Model:
    """Build the model on ``device`` (same weights on every rank) and shard it with FSDP2."""
    torch.manual_seed(cfg.seed)
    if cfg.hf_model is not None:
        # Parameters on the meta device until each rank reads its shards, after apply_fsdp.
        module = hf.empty_causal_lm(cfg.hf_model)
        blocks = hf.decoder_blocks(module)
        tokenizer = hf.load_tokenizer(cfg.hf_model, module.config.vocab_size)
        description = {"hf_model": str(cfg.hf_model), **module.config.to_diff_dict()}
        logits = lambda tokens: hf.hf_logits(module, tokens)  # noqa: E731
    else:
        config = _llama_config(cfg)
        with device:
            module = Llama(config)
        blocks, tokenizer = list(module.layers), ByteTokenizer()
        description = {"preset": cfg.model, **dataclasses.asdict(config)}
        logits = module
    description["num_params"] = sum(p.numel() for p in module.parameters())
    module.to(getattr(torch, cfg.param_dtype))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision == "bf16"
        else None
    )
    apply_fsdp(
        module,
        blocks=blocks,
        mp_policy=mp_policy,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    if cfg.hf_model is not None:
        hf.load_local_shards(module, cfg.hf_model, device)
    return _Model(module, logits, tokenizer, description)


def warmup_cosine(warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear from 1/(warmup+1) to 1, then cosine down to ``MIN_LR_RATIO``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")


def _init_from(path: Path, model: nn.Module) -> None:
    """Load model weights (only) from an exported weights file or a checkpoint. Collective."""
    if path.is_file():
        checkpoint.load_weights(model, path)
        return
    found = checkpoint.latest(path) or path
    if not (found / DCP_METADATA_FILE).is_file():
        raise FileNotFoundError(
            f"--init-from {path}: no checkpoint there; pass a run's checkpoints/ folder, one "
            "of its step_<N> folders, or a weights file written by checkpoint.export_weights"
        )
    state = {checkpoint.MODEL_KEY: get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=found)
    set_model_state_dict(model, state[checkpoint.MODEL_KEY])


def _train_step(
    cfg: JobConfig,
    model: _Model,
    optim: Optimizer,
    sampler: BatchSampler,
    step: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on the global batch of ``step``; return (mean loss, grad norm).

    The same code for the in-backward and the plain optimizer. Each rank's loss is its
    micro-batch mean divided by the number of micro-batches, and FSDP2 averages gradients over
    ranks, so the gradient is that of the mean loss over the global batch. The returned loss is
    this rank's share of that mean (not yet averaged over ranks).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_batches = [
        sampler.micro_batch(step, micro=m, grad_accum=cfg.grad_accum, rank=rank, world_size=world)
        for m in range(cfg.grad_accum)
    ]

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = (t.to(device) for t in batch)
        return F.cross_entropy(model.logits(inputs).flatten(0, 1).float(), targets.flatten())

    loss = backward_micro_batches(optim, loss_fn, micro_batches)
    grad_norm = clip_grad_norm_(optim, cfg.max_grad_norm or None)
    optim.step()
    optim.zero_grad()
    return loss, grad_norm


def _split_data(
    cfg: JobConfig, tokens: torch.Tensor, tokenizer: Tokenizer
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training stream and the held-out windows (``None``: no held-out split)."""
    wanted = cfg.eval_tokens
    if wanted is None:
        wanted = min(DEFAULT_EVAL_TOKENS, tokens.numel() // HELD_OUT_CORPUS_SHARE)
        if wanted < cfg.seq_len:  # a corpus of under ten sequences: all of it trains
            return tokens, None
    if wanted == 0:
        return tokens, None
    return split_held_out(
        tokens,
        held_out_tokens=wanted,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        eos_id=tokenizer.eos_id,
    )


def _held_out_loss(
    cfg: JobConfig, model: _Model, windows: torch.Tensor, device: torch.device
) -> float:
    """Mean loss over the whole held-out split, in the training micro-batch size. Collective."""
    with evaluating(model.module):
        return held_out_loss(
            model.logits,
            windows,
            batch_size=cfg.batch_size // (cfg.grad_accum * dist.get_world_size()),
            device=device,
        )


def _samples(cfg: JobConfig, model: _Model, device: torch.device, step: int) -> dict[str, Any]:
    """The prompt continued greedily, and from the top-k tokens with ``--sample-top-k``: whole
    texts, prompt included. Collective: every rank generates; all get the same texts."""
    prompt = [int(i) for i in model.tokenizer.encode(cfg.sample_prompt)]
    texts: dict[str, Any] = {"step": step}
    kinds = {"greedy": None} | ({} if cfg.sample_top_k is None else {"top_k": cfg.sample_top_k})
    with evaluating(model.module):
        for kind, top_k in kinds.items():
            continuation = generate(
                model.logits,
                prompt,
                max_new_tokens=cfg.sample_tokens,
                context=cfg.seq_len,
                vocab_size=model.tokenizer.vocab_size,
                eos_id=model.tokenizer.eos_id,
                device=device,
                top_k=top_k,
                seed=cfg.seed,
            )
            texts[kind] = model.tokenizer.decode(prompt + continuation)
    return texts


def _samples_text(samples: dict[str, Any], cfg: JobConfig) -> str:
    parts = []
    for kind in ("greedy", "top_k"):
        if kind in samples:
            how = "greedy" if kind == "greedy" else f"top-{cfg.sample_top_k}, seed {cfg.seed}"
            parts.append(f"--- sample at step {samples['step']} ({how}) ---\n{samples[kind]}\n")
    return "".join(parts)


def _banner(
    cfg: JobConfig,
    model: _Model,
    sampler: BatchSampler,
    held_out: torch.Tensor | None,
    device: torch.device,
    start_step: int,
) -> str:
    world = dist.get_world_size()
    steps = (
        f"steps {start_step + 1}..{cfg.max_steps}"
        if start_step < cfg.max_steps
        else "no steps left"
    )
    held = (
        f"{held_out.shape[0] * cfg.seq_len + 1:,} held out ({held_out.shape[0]} sequences)"
        if held_out is not None
        else "none held out"
    )
    return (
        f"fine-tuning {model.description['num_params'] / 1e6:.2f}M parameters on {world} "
        f"rank(s), {device} ({format_bytes(memory_budget_bytes(device))} per device), "
        f"{dist.get_backend()}\n"
        f"  optimizer {cfg.optimizer} {'after' if not cfg.in_backward else 'in'} backward, "
        f"{cfg.batch_size * cfg.seq_len:,} tokens/step ({cfg.batch_size} x {cfg.seq_len}, "
        f"{cfg.grad_accum} micro-batch(es)), {sampler.tokens.numel():,} tokens to train on, "
        f"{held}\n"
        f"  {steps}"
        + (
            f" (resumed from step {start_step})"
            if start_step
            else " (--resume: no checkpoint yet)"
            if cfg.resume
            else ""
        )
    )


def _summary_text(summary: dict[str, Any], cfg: JobConfig, outputs: list[str]) -> str:
    if summary["steps"]:
        trained = (
            f"done: {summary['steps']} steps in {summary['seconds']:.1f} s, loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, peak memory "
            f"{format_bytes(summary['peak_mem_bytes'])} (rank 0)"
        )
        held_out = summary["heldout_losses"]
        if held_out:
            ends = held_out[:1] + held_out[1:][-1:]  # the first and the last, if two or more
            trained += ", held-out loss " + " -> ".join(
                f"{loss:.4f} (step {step})" for step, loss in ends
            )
    else:
        trained = f"nothing to train: the checkpoint is already at --max-steps {cfg.max_steps}"
    return f"{trained}\noutputs in {cfg.output_dir}/: {', '.join(outputs)}"


# ---------------------------------------------------------------------------------- the job


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fine-tuning job; return the final summary (the same on every rank)."""
    cfg = parse_args(argv)
    if cfg.estimate_memory:  # simulated on this CPU: no process group, no training
        return estimate_job_memory(cfg, llama=None if cfg.hf_model else _llama_config(cfg))
    device, created_group = _setup_distributed(cfg)
    try:
        return _run(cfg, device)
    finally:
        if created_group:
            # The model and optimizer are garbage once _run returns, but in reference cycles
            # (FSDP2's hooks), holding the process groups and the last collectives' work: freed
            # now, while the groups exist, not during interpreter finalization, where a rank
            # once aborted after finishing (see [Note: a rank ends without interpreter
            # finalization] in fused_optim_dist_recipes/launch.py).
            gc.collect()
            dist.destroy_process_group()


def _run(cfg: JobConfig, device: torch.device) -> dict[str, Any]:
    world, is_main = dist.get_world_size(), dist.get_rank() == 0
    if cfg.batch_size % (cfg.grad_accum * world):
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be a multiple of --grad-accum x "
            f"world size = {cfg.grad_accum} x {world}"
        )
    model = _build_model(cfg, device)
    if cfg.init_from is not None:
        _init_from(cfg.init_from, model.module)
    train_tokens, held_out = _split_data(
        cfg, tokenize(read_documents(cfg.data), model.tokenizer), model.tokenizer
    )
    sampler = BatchSampler(
        train_tokens,
        seq_len=cfg.seq_len,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
    )
    optim = build_optimizer(
        model.module.parameters(),
        cfg.optimizer,
        in_backward=cfg.in_backward,
        **cfg.optimizer_arguments(),
    )
    scheduler = LambdaLR(optim, warmup_cosine(cfg.warmup_steps, cfg.max_steps))
    checkpoint_dir = cfg.output_dir / CHECKPOINT_SUBDIR
    start_step = 0
    # parse_args refused existing checkpoints without --resume.
    if checkpoint.latest(checkpoint_dir) is not None:
        start_step, extra = checkpoint.load(checkpoint_dir, model.module, optim)
        scheduler.load_state_dict(extra["scheduler"])

    tokens_per_step = cfg.batch_size * cfg.seq_len
    config = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "world_size": world,
        "device": str(device),
        "tokens_per_step": tokens_per_step,
        "micro_batch_per_rank": cfg.batch_size // (cfg.grad_accum * world),
        "model_config": model.description,
    }
    metrics_path = cfg.output_dir / METRICS_FILE
    if is_main:
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        _write_json(cfg.output_dir / CONFIG_FILE, config)
        metrics = MetricsLog(metrics_path, resume_step=start_step)
        progress = ProgressLine(cfg.max_steps, every=cfg.log_every)
        print(_banner(cfg, model, sampler, held_out, device, start_step), flush=True)

    samples = []
    if cfg.sample_tokens and start_step < cfg.max_steps:
        samples.append(_samples(cfg, model, device, step=start_step))
        if is_main:
            print(_samples_text(samples[-1], cfg), end="", flush=True)

    losses: list[float] = []
    heldout_losses: list[tuple[int, float]] = []
    eval_seconds = 0.0
    pending = None
    started = time.perf_counter()
    for step in range(start_step + 1, cfg.max_steps + 1):
        step_started = time.perf_counter()
        lr = optim.param_groups[0]["lr"]
        loss, grad_norm = _train_step(cfg, model, optim, sampler, step, device)
        inject_fault(
            "after_backward", step=step, rank=dist.get_rank(), checkpoint_dir=checkpoint_dir
        )
        scheduler.step()
        # Host sync, once per step: the global mean loss and the gradient norm for the log.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        losses.append(loss.item() / world)
        row = {
            "step": step,
            "loss": losses[-1],
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / (time.perf_counter() - step_started),
            "peak_mem_bytes": peak_memory_bytes(device),
        }
        if held_out is not None and (
            step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)
        ):
            eval_started = time.perf_counter()
            heldout_losses.append((step, _held_out_loss(cfg, model, held_out, device)))
            row[HELD_OUT_KEY] = heldout_losses[-1][1]
            eval_seconds += time.perf_counter() - eval_started
        if is_main:
            metrics.write(row)
            progress.update(row)
        if step == cfg.max_steps or (cfg.save_every and step % cfg.save_every == 0):
            # Written in the background while training goes on, and committed as soon as every
            # rank has written its part.
            pending = checkpoint.save(
                checkpoint_dir,
                model.module,
                optim,
                step=step,
                async_=True,
                keep_last=cfg.keep_last,
                extra={"scheduler": scheduler.state_dict(), "config": config},
            )
            inject_fault(
                "during_save", step=step, rank=dist.get_rank(), checkpoint_dir=checkpoint_dir
            )
    elapsed = time.perf_counter() - started - eval_seconds
    if cfg.sample_tokens:
        samples.append(_samples(cfg, model, device, step=cfg.max_steps))
        if is_main:
            print(_samples_text(samples[-1], cfg), end="", flush=True)
    if pending is not None:
        pending.wait()

    outputs = [CONFIG_FILE, METRICS_FILE, LOSS_PLOT_FILE, SUMMARY_FILE, f"{CHECKPOINT_SUBDIR}/"]
    if samples:
        outputs.append(SAMPLES_FILE)
    if cfg.hf_model is not None:
        hf.save_pretrained(model.module, cfg.hf_model, cfg.output_dir / HF_EXPORT_DIR)
        outputs.append(f"{HF_EXPORT_DIR}/")
    else:
        checkpoint.export_weights(model.module, cfg.output_dir / WEIGHTS_FILE)
        outputs.append(WEIGHTS_FILE)
    summary = {
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "seconds": elapsed,
        "tokens_per_s": tokens_per_step * len(losses) / elapsed if losses else None,
        "heldout_losses": heldout_losses,
        "eval_seconds": eval_seconds,
        "samples": samples,
        "peak_mem_bytes": peak_memory_bytes(device),
        "output_dir": str(cfg.output_dir),
    }
    if is_main:
        progress.close()
        metrics.close()
        plot_loss_curve(
            metrics_path,
            cfg.output_dir / LOSS_PLOT_FILE,
            title=f"{model.description.get('preset', 'hf')} fine-tuning",
        )
        _write_json(cfg.output_dir / SUMMARY_FILE, summary)
        if samples:
            (cfg.output_dir / SAMPLES_FILE).write_text(
                "".join(_samples_text(texts, cfg) for texts in samples)
            )
        print(_summary_text(summary, cfg, outputs), flush=True)
    return summary


if __name__ == "__main__":
    main()
