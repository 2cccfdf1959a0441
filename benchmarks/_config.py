"""The sweep's configuration: one frozen object, sent to every rank of every world."""

from __future__ import annotations

import dataclasses

SCALINGS = ("strong", "weak")
"""strong: the global batch is fixed and split over ranks; weak: the per-rank batch is fixed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What to run. Defaults are the full CPU sweep; ``scaling.py`` builds the others."""

    world_sizes: tuple[int, ...] = (1, 2, 4)
    """Number of ranks of each world, launched one world at a time."""
    shapes: tuple[str, ...] = ("many-small", "few-large", "llama-12x256")
    """Model shapes, keys of ``_shapes.SHAPES``."""
    methods: tuple[str, ...] = (
        "plain",
        "per-param",
        "ours",
        "plain+accum+clip",
        "ours+accum+clip",
        "torchtune",
    )
    """Methods, keys of ``_methods.METHODS``; unavailable ones are recorded as skipped."""
    scalings: tuple[str, ...] = SCALINGS
    """Which of ``SCALINGS`` to run (at one rank both are the same run, done once)."""
    warmup_steps: int = 1
    """Untimed steps per method before the memory step (optimizer state is created here)."""
    timed_steps: int = 5
    """Timed steps per method after the memory step; the median is reported."""
    device: str = "cpu"
    """``cpu`` (gloo, one process per rank) or ``cuda`` (nccl, one GPU per rank)."""
    bf16: bool = False
    """FSDP2 mixed precision: bf16 parameters and gradients in compute, fp32 reduction."""
    micro_batches: int = 2
    """Micro-batches per step for the ``+accum`` methods (the same global batch, split)."""
    max_grad_norm: float = 1.0
    """Clipping norm of the ``+clip`` methods."""
    lr: float = 1e-4
    """AdamW learning rate of every method."""
    seed: int = 0
    """Seed of model weights and batches: every method gets the same ones."""
    quick: bool = False
    """Use the reduced shapes of ``_shapes.QUICK_SHAPES`` (a smoke run)."""

    def __post_init__(self) -> None:
        for name in ("world_sizes", "shapes", "methods", "scalings"):
            if not getattr(self, name):
                raise ValueError(f"SweepConfig.{name} is empty; give at least one value")
        if any(n < 1 for n in self.world_sizes):
            raise ValueError(f"world sizes must be positive, not {self.world_sizes}")
        unknown = set(self.scalings) - set(SCALINGS)
        if unknown:
            raise ValueError(f"unknown scalings {sorted(unknown)}; choose from {SCALINGS}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.warmup_steps < 1 or self.timed_steps < 1 or self.micro_batches < 1:
            raise ValueError(
                "warmup_steps, timed_steps and micro_batches must be >= 1 (warm-up creates the "
                f"optimizer state), not {self.warmup_steps}, {self.timed_steps}, "
                f"{self.micro_batches}"
            )
