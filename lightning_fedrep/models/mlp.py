"""A small MLP classifier for flat features (the digits quickstart)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.models.classifier import FedRepClassifier


class MLPClassifier(FedRepClassifier):
    """``body`` (two hidden layers) then the ``classifier`` head, trained with FedRep's SGD recipe.

    SGD with momentum 0.5 and weight decay on weights only (not biases), as the official FedRep code.
    Outputs logits; unlike the paper models, its ``training_step`` logs nothing (it returns the loss).
    """

    fedrep_head = "classifier"

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

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output, shape ``(batch, features)``."""
        return self.body(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """The classifier's logits."""
        return self.classifier(features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)
