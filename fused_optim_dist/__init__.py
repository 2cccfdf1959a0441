"""Optimizer-in-backward for FSDP2 and DTensor: step each shard as soon as its gradient is ready."""

from fused_optim_dist.optimizer import OptimizerInBackward, in_backward

__all__ = ["OptimizerInBackward", "in_backward"]
