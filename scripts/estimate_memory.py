"""Estimate the peak GPU memory per rank of a fine-tuning job before renting the GPUs.

Simulates the job's step on this machine's CPU (fake tensors on a fake process group of the
target size; nothing is allocated for real, no weights are read) for the plain optimizer and the
in-backward one, and prints each peak per rank with its breakdown, where it sits, the saving and
whether it fits the GPU. The flags are those of ``scripts/finetune.py`` plus the target::

    python scripts/estimate_memory.py --model llama3-8b --world-size 8 --seq-len 2048 \\
        --batch-size 8 --mixed-precision bf16 --activation-checkpointing  # ~20 s CPU per method
    python scripts/estimate_memory.py --model llama3-70b --world-size 64 --hsdp-replicas 8 \\
        --seq-len 2048 --batch-size 64 --mixed-precision bf16 --activation-checkpointing
    python scripts/estimate_memory.py --hf-model DIR --world-size 16 --json estimate.json
    torchrun --nproc_per_node 8 scripts/finetune.py ... --estimate-memory  # the job's own

Presets: the fine-tuning presets plus ``llama2-7b``, ``llama3-8b`` and ``llama3-70b``. With
``--hf-model`` only the directory's ``config.json`` is read. What the simulation leaves out
(CUDA context, NCCL/cuBLAS workspaces, the caching allocator's reserve) is covered by a margin,
``--margin-gib`` plus ``--margin-fraction`` of the peak: see ``docs/memory_estimation.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from fused_optim_dist_recipes.memory_estimate import (
    DEFAULT_METHODS,
    GPU_80GB_GIB,
    KERNELS,
    METHODS,
    SHAPES,
    EstimateConfig,
    Margin,
    estimate,
    format_report,
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Estimate peak GPU memory per rank of an FSDP2 fine-tuning step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b", help="Llama preset")
    p.add_argument("--hf-model", type=Path, metavar="DIR", help="a transformers model directory")
    p.add_argument("--world-size", type=_positive_int, default=8, help="ranks of the job")
    p.add_argument(
        "--hsdp-replicas", type=_positive_int, default=1, help="HSDP replica groups (1: FSDP)"
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    p.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: pure bf16 (weights, gradients and optimizer state)",
    )
    p.add_argument("--seq-len", type=_positive_int, default=2048)
    p.add_argument("--batch-size", type=_positive_int, default=8, help="GLOBAL sequences per step")
    p.add_argument("--grad-accum", type=_positive_int, default=1)
    p.add_argument("--optimizer", default="torch.optim.AdamW", help="dotted class path")
    p.add_argument(
        "--optimizer-kwargs", type=json.loads, default={}, metavar="JSON", help="as a JSON object"
    )
    p.add_argument(
        "--kernel",
        choices=KERNELS,
        default="foreach",
        help="optimizer kernels (CUDA picks foreach for AdamW unless told)",
    )
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(DEFAULT_METHODS))
    p.add_argument("--gpu-memory-gib", type=float, default=GPU_80GB_GIB, help="memory of one GPU")
    p.add_argument(
        "--margin-gib",
        type=_non_negative_float,
        default=Margin().fixed_gib,
        help="added per GPU for the CUDA context, NCCL and cuBLAS workspaces",
    )
    p.add_argument(
        "--margin-fraction",
        type=_non_negative_float,
        default=Margin().fraction,
        help="share of the peak added for the caching allocator's reserve and fragmentation",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> str:
    """Print the estimate; return its text."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = EstimateConfig(
            model=args.model,
            hf_model=args.hf_model,
            world_size=args.world_size,
            hsdp_replicas=args.hsdp_replicas,
            activation_checkpointing=args.activation_checkpointing,
            mixed_precision=args.mixed_precision,
            param_dtype=args.param_dtype,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            grad_accum=args.grad_accum,
            optimizer=args.optimizer,
            optimizer_kwargs=args.optimizer_kwargs,
            kernel=args.kernel,
            max_grad_norm=args.max_grad_norm or None,
            methods=tuple(args.methods),
        )
        margin = Margin(fixed_gib=args.margin_gib, fraction=args.margin_fraction)
    except ValueError as error:
        parser.error(str(error))
    results = estimate(config)
    text = format_report(config, results, margin, args.gpu_memory_gib)
    print(text, flush=True)
    if args.json is not None:
        payload = {
            "config": {
                k: str(v) if isinstance(v, Path) else v
                for k, v in dataclasses.asdict(config).items()
            },
            "margin": dataclasses.asdict(margin),
            "gpu_memory_gib": args.gpu_memory_gib,
            "results": [r.as_dict() for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return text


if __name__ == "__main__":
    main()
