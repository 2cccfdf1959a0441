"""Integrations with training frameworks, one module each, imported only when used.

``fused_optim_dist.integrations.accelerate`` (needs ``accelerate``),
``fused_optim_dist.integrations.transformers`` (needs ``transformers``) and
``fused_optim_dist.integrations.lightning`` (needs ``lightning``): importing
``fused_optim_dist`` imports none of them.
"""
