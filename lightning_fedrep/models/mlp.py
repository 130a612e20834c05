"""A small MLP classifier for flat features (the digits quickstart)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.models.optim import fedrep_sgd


class MLPClassifier(L.LightningModule):
    """``body`` (two hidden layers) then the ``classifier`` head, trained with FedRep's SGD recipe.

    SGD with momentum 0.5 and weight decay on weights only (not biases), as the official FedRep code.
    """

    fedrep_head = "classifier"
    fedrep_loss = "cross_entropy"
    """What ``training_step`` computes (the strategy's vectorized engine needs it)."""
    fedrep_evaluation = "headline"
    """Its evaluation steps log nothing beyond the headline metrics (batched evaluation applies)."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 64,
        features: int = 32,
        num_classes: int = 10,
        lr: float = 0.05,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, features), nn.ReLU()
        )
        self.classifier = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output, shape ``(batch, features)``."""
        return self.body(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """The classifier's logits."""
        return self.classifier(features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass  # the strategy logs val/acc and val/loss per client

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass

    def predict_step(self, batch: tuple[torch.Tensor, ...] | torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The predicted class of each sample (``x`` or the first item of an ``(x, y)`` batch)."""
        x = batch[0] if isinstance(batch, tuple | list) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return fedrep_sgd(self, hp.lr, hp.momentum, hp.weight_decay)
