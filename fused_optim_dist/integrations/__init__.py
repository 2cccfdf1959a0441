"""Integrations with training frameworks, one module each, imported only when used.

``fused_optim_dist.integrations.accelerate`` (needs ``accelerate``),
``fused_optim_dist.integrations.transformers`` (needs ``transformers``),
``fused_optim_dist.integrations.lightning`` (Lightning's Trainer) and
``fused_optim_dist.integrations.fabric`` (Lightning Fabric; both need ``lightning``): importing
``fused_optim_dist`` imports none of them.
"""
