"""The Lightning side of binding the data (the strategy's ``process_dataloader``): the Trainer's facts the label
checks read (:class:`~lightning_fedrep.data.binding.ModelProbe`), handed to the Lightning-free session
(its ``_bind_loader``), which binds the loaders."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedrep.data.binding import ModelProbe


def model_probe(
    trainer: L.Trainer, module: L.LightningModule, device: torch.device, headline: bool
) -> ModelProbe:
    """The module, device, precision conversion, headline setting and declared classes the checks use."""
    declared = getattr(trainer.datamodule, "num_classes", None)
    return ModelProbe(module, device, trainer.precision_plugin.convert_input, headline, declared)


def warn(note: str | None) -> None:
    """Warn with ``note`` (rank zero), if any."""
    if note is not None:
        rank_zero_warn(note)
