"""The refusal of a Lightning precision plugin's loss scaling, shared by the Trainer callback
and ``InBackwardFabric``."""

from __future__ import annotations


def refuse_loss_scaling(precision: object, owner: str) -> None:
    """Raise if ``precision`` (a Lightning or Fabric precision plugin) holds an enabled
    ``GradScaler``: ``precision="16-mixed"`` on a GPU scales the loss, and each gradient would
    be stepped in backward, scaled, before the scaler unscaled it or skipped a non-finite step.
    ``owner`` names the object built with that precision (``"Trainer"``, ``"Fabric"``)."""
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        raise ValueError(
            f"{owner}(precision='16-mixed') scales the loss with a torch.amp.GradScaler, "
            "which unscales the gradients and checks them for inf/NaN after the backward, "
            "but OptimizerInBackward steps and frees them during it: use "
            "precision='bf16-mixed' (no loss scaling) and skip_nonfinite=True on "
            "OptimizerInBackward to skip non-finite steps"
        )
