"""A progress bar that speaks in rounds, clients and phases."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_fedrep.hooks import FederatedCallback


class FederatedProgressBar(TQDMProgressBar, FederatedCallback):
    """``Round 3: 45%|... client 4/10 (#17), phase head`` instead of epochs and batches.

    The federated strategy puts it in place of Lightning's default progress bar by itself.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        FederatedCallback.setup(self, trainer, pl_module, stage)
        TQDMProgressBar.setup(self, trainer, pl_module, stage)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Round {trainer.current_epoch}")

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        strategy = self.strategy(trainer)
        client = strategy.current_client
        if client is not None and trainer.training:
            clients = strategy.round_plan(trainer.current_epoch).clients
            items["client"] = f"{clients.index(client) + 1}/{len(clients)} (#{client})"
            items["phase"] = strategy.current_phase
        return items
