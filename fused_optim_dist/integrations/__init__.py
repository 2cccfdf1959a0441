"""Integrations with training frameworks, one module each, imported only when used.

``fused_optim_dist.integrations.accelerate`` (needs ``accelerate``) and
``fused_optim_dist.integrations.transformers`` (needs ``transformers``): importing
``fused_optim_dist`` imports neither.
"""
