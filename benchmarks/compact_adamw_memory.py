"""Bytes per parameter of weights plus optimizer state: fp32 AdamW against CompactAdamW.

On ``--nproc`` CPU ranks (gloo, FSDP2, one unit per block), for each model shape and method:

* ``adamw-fp32-plain``: ``torch.optim.AdamW`` after backward, float32 weights;
* ``adamw-fp32-in-backward``: ``OptimizerInBackward(AdamW, fused=True)``, float32 weights;
* ``compact-in-backward``: ``OptimizerInBackward(CompactAdamW)``, bfloat16 weights;
* ``compact-4bit-in-backward``: the same with ``variance_bits=4``.

After two warm-up steps (state created), each rank sums the bytes of its local shards of the
parameters and of every tensor in the optimizer state, and divides by its local parameter
count: the persistent bytes per parameter. Then one step runs under ``FSDPMemTracker``
(``benchmarks/_memory.StepTracker``): the peak of the step per rank, by kind. The analytic
figure is computed from the shapes: 12 B/param for AdamW; for CompactAdamW 5 B per element of a
matrix plus 2 x 2 B per group of 32 in a row, 9 B per element of a one-dim parameter; with a
4-bit variance, 4 B per element of a matrix plus its packed rows of roots (half a byte per
element, a row rounded up to whole bytes).

    python benchmarks/compact_adamw_memory.py                 # 12x256 and 8x1024, ~3 min
    python benchmarks/compact_adamw_memory.py --shapes 12x256 --out /tmp/mem
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks._memory import StepTracker
from fused_optim_dist import OptimizerInBackward
from fused_optim_dist.compact_adamw import GROUP_SIZE, CompactAdamW
from fused_optim_dist_recipes.launch import spawn
from fused_optim_dist_recipes.metrics import describe_machine, machine_summary
from fused_optim_dist_recipes.models import PRESETS, Llama, apply_fsdp

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "12x256": PRESETS["12x256"],
    "8x1024": dataclasses.replace(
        PRESETS["12x256"], dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=2816
    ),
}
"""The scaling benchmark's Llama, and a larger one (about 90M parameters)."""
COMPACT = {"compact-in-backward": 8, "compact-4bit-in-backward": 4}
"""CompactAdamW's methods, by ``variance_bits``."""
METHODS = ("adamw-fp32-plain", "adamw-fp32-in-backward", *COMPACT)
BATCH, SEQ = 4, 64
MIB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def analytic_bytes_per_param(model: nn.Module, method: str) -> float:
    """Weights plus state per parameter from the shapes alone (``step`` counters left out)."""
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    if method not in COMPACT:
        return 12.0
    total = 0
    for p in params:
        if p.dim() >= 2:
            groups = p.shape[0] * math.ceil(p[0].numel() / GROUP_SIZE)
            roots = p.numel() if COMPACT[method] == 8 else p.shape[0] * math.ceil(p[0].numel() / 2)
            total += 4 * p.numel() + roots + 2 * 2 * groups
        else:
            total += 9 * p.numel()
    return total / numel


def _build(config: Any, method: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Llama(config)
    if method in COMPACT:
        model = model.to(torch.bfloat16)
    apply_fsdp(model)
    if method == "adamw-fp32-plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if method in COMPACT:
        return model, OptimizerInBackward(
            model.parameters(), CompactAdamW, lr=1e-4, variance_bits=COMPACT[method]
        )
    return model, OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)


def _step(model: nn.Module, optim: torch.optim.Optimizer, vocab: int, step: int) -> None:
    g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
    tokens = torch.randint(vocab, (BATCH, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()


def _measure(shape: str) -> dict[str, Any]:
    config = SHAPES[shape]
    out: dict[str, Any] = {}
    for method in METHODS:
        model, optim = _build(config, method)
        for step in range(2):
            _step(model, optim, config.vocab_size, step)
        params = list(model.parameters())
        state = [v for entry in optim.state.values() for v in entry.values()]
        state = [v for v in state if isinstance(v, torch.Tensor)]
        local_numel = sum(_local(p).numel() for p in params)
        weights = sum(_nbytes(p) for p in params)
        state_bytes = sum(_nbytes(v) for v in state)
        tracker = StepTracker(model, [_local(v) for v in state], "cpu")
        with tracker:
            _step(model, optim, config.vocab_size, 2)
        peak, by_kind, _ = tracker.peak()
        rank = {
            "local_params": local_numel,
            "weight_bytes": weights,
            "state_bytes": state_bytes,
            "bytes_per_param": (weights + state_bytes) / local_numel,
            "peak_bytes": peak,
            "peak_by_kind": by_kind,
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rank)
        out[method] = {
            "analytic_bytes_per_param": analytic_bytes_per_param(model, method),
            "ranks": gathered,
            "num_params": sum(p.numel() for p in params),
        }
        del model, optim
    return out


def _body(shapes: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {shape: _measure(shape) for shape in shapes}


def markdown(results: dict[str, Any], nproc: int, machine: str) -> str:
    lines = [
        f"# Weights + optimizer state per parameter ({nproc} CPU ranks, {machine})",
        "",
        "Measured: bytes of each rank's local parameter shards plus every optimizer state "
        "tensor, over its local parameter count, after two steps. Peak: `FSDPMemTracker` "
        f"peak of the third step (batch {BATCH} x {SEQ} tokens per rank), per rank.",
        "",
        "| shape | params | method | analytic B/param | measured B/param (per rank) | "
        "weights+state MiB / rank | peak MiB / rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, methods in results.items():
        for method, r in methods.items():
            ranks = r["ranks"]
            per_rank = ", ".join(f"{x['bytes_per_param']:.3f}" for x in ranks)
            held = ", ".join(f"{(x['weight_bytes'] + x['state_bytes']) / MIB:.1f}" for x in ranks)
            peaks = ", ".join(f"{x['peak_bytes'] / MIB:.1f}" for x in ranks)
            lines.append(
                f"| {shape} | {r['num_params'] / 1e6:.2f}M | {method} | "
                f"{r['analytic_bytes_per_param']:.3f} | {per_rank} | {held} | {peaks} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    results = spawn(args.nproc, _body, args.shapes)
    machine = describe_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"config": {"nproc": args.nproc, "batch": BATCH, "seq": SEQ}, "machine": machine}
    payload["results"] = results
    (args.out / "compact_adamw_memory.json").write_text(json.dumps(payload, indent=1))
    text = markdown(results, args.nproc, machine_summary(machine))
    (args.out / "compact_adamw_memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
