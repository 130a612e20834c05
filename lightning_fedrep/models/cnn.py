"""The official FedRep CNNs for CIFAR-10 and CIFAR-100 (``lgcollins/FedRep``, ``models/Nets.py``).

Layer names, shapes and order are the official ones (``conv1``, ``conv2``, ``fc1``, ``fc2``, ``fc3``), so
the body is ``conv1, conv2, fc1, fc2`` and the head ``fc3``, as in the official ``w_glob_keys``. Like the
official models these output **log-probabilities** (``log_softmax``); the loss is cross-entropy on them,
which equals the negative log-likelihood because ``log_softmax`` is idempotent, and the strategy's
``val/acc``/``val/loss`` are computed the same way. Neither model has batch norm.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.models.optim import fedrep_sgd

__all__ = ["CIFAR100CNN", "CIFAR10CNN"]


class _FedRepClassifier(L.LightningModule):
    """Cross-entropy training, strategy-side evaluation and the official SGD recipe.

    ``forward`` is ``forward_head(forward_features(x))`` and ``fedrep_loss`` says what ``training_step``
    computes, so the strategy's vectorized engine applies (and caches features in head phases).
    """

    fedrep_loss = "cross_entropy"
    """What ``training_step`` computes: cross-entropy of ``self(x)`` against integer labels."""

    fedrep_evaluation = "headline"
    """``validation_step``/``test_step`` log nothing beyond the strategy's headline metrics, so the strategy
    may evaluate many clients per step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output: the head on the body's features."""
        return self.forward_head(self.forward_features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass  # the strategy logs val/acc and val/loss per client from self(x)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass  # the strategy logs test/acc and test/loss per client from self(x)

    def predict_step(self, batch: tuple[torch.Tensor, ...] | torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The predicted class of each sample (``x`` or the first item of an ``(x, y)`` batch)."""
        x = batch[0] if isinstance(batch, tuple | list) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (lr 0.01, momentum 0.5 by default), weight decay (1e-4) on weights only, not biases."""
        hp = self.hparams
        return fedrep_sgd(self, hp.lr, hp.momentum, hp.weight_decay)


class CIFAR10CNN(_FedRepClassifier):
    """The official ``CNNCifar``: 307,842 parameters, of which the head ``fc3`` has 650 (0.21%).

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→64 (5x5) → ReLU → max-pool 2 → flatten
    (1600) → ``fc1`` 1600→120 → ReLU → ``fc2`` 120→64 → ReLU → ``fc3`` 64→``num_classes`` →
    ``log_softmax``. Input: ``(batch, 3, 32, 32)``.
    """

    fedrep_head = "fc3"

    def __init__(
        self,
        num_classes: int = 10,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 64)
        self.fc3 = nn.Linear(64, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output (the input of ``fc3``), shape ``(batch, 64)``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.relu(self.fc2(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of shape ``(batch, num_classes)``."""
        return F.log_softmax(self.fc3(features), dim=1)


class CIFAR100CNN(_FedRepClassifier):
    """The official ``CNNCifar100``: 1,075,044 parameters, of which the head ``fc3`` has 12,900 (1.20%).

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→128 (5x5) → ReLU → max-pool 2 → flatten
    (3200) → ``fc1`` 3200→256 → ReLU → ``fc2`` 256→128 → ReLU → ``drop`` Dropout(0.6) → ``fc3``
    128→``num_classes`` → ``log_softmax``. Input: ``(batch, 3, 32, 32)``.
    """

    fedrep_head = "fc3"

    def __init__(
        self,
        num_classes: int = 100,
        dropout: float = 0.6,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 128, 5)
        self.fc1 = nn.Linear(128 * 5 * 5, 256)
        self.fc2 = nn.Linear(256, 128)
        self.drop = nn.Dropout(dropout)
        self.fc3 = nn.Linear(128, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output before the dropout, shape ``(batch, 128)``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.relu(self.fc2(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of shape ``(batch, num_classes)`` (dropout, then ``fc3``)."""
        return F.log_softmax(self.fc3(self.drop(features)), dim=1)
