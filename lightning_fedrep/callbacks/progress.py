"""A progress bar that speaks in rounds, clients and phases."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class FederatedProgressBar(TQDMProgressBar):
    """``Round 3: 45%|... client 4/10 (#17), phase head`` instead of epochs and batches.

    The federated strategy puts it in place of Lightning's default progress bar by itself.
    """

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Round {trainer.current_epoch}")

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        strategy = trainer.strategy
        if getattr(strategy, "current_client", None) is not None and trainer.training:
            clients = strategy.round_plan(trainer.current_epoch).clients
            position = clients.index(strategy.current_client) + 1
            items["client"] = f"{position}/{len(clients)} (#{strategy.current_client})"
            items["phase"] = strategy.current_phase
        return items
