"""The strategy's own progress bar, which speaks in rounds, clients and phases (part of the face: the strategy
installs it in place of Lightning's default bar; ``lightning_fedrep.callbacks`` exports it beside the callbacks)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_fedrep.lightning.callback import FederatedCallback


class FederatedProgressBar(TQDMProgressBar, FederatedCallback):
    """``Round 3: 45%|... client 4/10 (#17), phase head`` instead of epochs and batches (on the
    vectorized runner ``clients 1-10/10``: the clients training together).

    The federated strategy puts it in place of Lightning's default progress bar by itself. It takes
    the arguments of Lightning's ``TQDMProgressBar``: ``refresh_rate`` (update every that many batches),
    ``process_position`` (the bar's line, for several bars) and ``leave`` (keep each round's bar).
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
        training = strategy.current_clients
        if training and trainer.training:
            clients = strategy.round_plan(trainer.current_epoch).clients
            first = clients.index(training[0]) + 1
            if len(training) == 1:
                items["client"] = f"{first}/{len(clients)} (#{training[0]})"
            else:
                items["clients"] = f"{first}-{first + len(training) - 1}/{len(clients)}"
            items["phase"] = strategy.current_phase
        if strategy.faults:
            items["faults"] = len(strategy.faults)
        return items
