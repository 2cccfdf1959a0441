"""Optimizer-in-backward for FSDP2 and DTensor: step each shard as soon as its gradient is ready."""

from fused_optim_dist._freed import is_freed
from fused_optim_dist._kinds import Stepping, declare_stepping
from fused_optim_dist._options import InBackwardOptions
from fused_optim_dist.compact_adamw import CompactAdamW
from fused_optim_dist.optimizer import OptimizerInBackward, in_backward
from fused_optim_dist.training import (
    accumulate_grads,
    backward_micro_batches,
    build_optimizer,
    clip_grad_norm_,
)

__all__ = [
    "CompactAdamW",
    "InBackwardOptions",
    "OptimizerInBackward",
    "Stepping",
    "accumulate_grads",
    "backward_micro_batches",
    "build_optimizer",
    "clip_grad_norm_",
    "declare_stepping",
    "in_backward",
    "is_freed",
]
