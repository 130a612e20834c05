"""The official FedRep CNNs for CIFAR-10 and CIFAR-100 (``lgcollins/FedRep``, ``models/Nets.py``).

Layer names, shapes and order are the official ones (``conv1``, ``conv2``, ``fc1``, ``fc2``, ``fc3``), so
the body is ``conv1, conv2, fc1, fc2`` and the head ``fc3``, as in the official ``w_glob_keys``. Like the
official models these output **log-probabilities** (``log_softmax``); the loss is cross-entropy on them,
which equals the negative log-likelihood because ``log_softmax`` is idempotent, and the strategy's
``val/acc``/``val/loss`` are computed the same way. Neither model has batch norm.

Both are one network, :class:`_OfficialCIFARCNN`, at the widths (and, for CIFAR-100, the dropout) of the
official ``CNNCifar`` and ``CNNCifar100``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.models.classifier import FedRepClassifier

__all__ = ["CIFAR100CNN", "CIFAR10CNN"]


class _OfficialCIFARCNN(FedRepClassifier):
    """The official CIFAR CNN at given widths, for ``(batch, 3, 32, 32)`` inputs.

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→``conv_channels`` (5x5) → ReLU → max-pool 2 →
    flatten → ``fc1`` → ReLU → ``fc2`` → ReLU → (``drop``, where ``dropout`` is given) → ``fc3`` →
    ``log_softmax``. The public models are its subclasses: they fix the widths and save their own arguments
    as hyper-parameters.

    Args:
        num_classes: outputs of the head ``fc3``.
        conv_channels: output channels of ``conv2``.
        hidden: the widths of ``fc1`` and ``fc2``.
        dropout: the probability of the ``Dropout`` between the body and ``fc3``; ``None``: no dropout layer.
    """

    fedrep_head = "fc3"

    def __init__(self, num_classes: int, conv_channels: int, hidden: tuple[int, int], dropout: float | None):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, conv_channels, 5)
        self.fc1 = nn.Linear(conv_channels * 5 * 5, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.drop = None if dropout is None else nn.Dropout(dropout)
        self.fc3 = nn.Linear(hidden[1], num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output (the input of ``fc3``, before any dropout), shape ``(batch, hidden[1])``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.relu(self.fc2(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of shape ``(batch, num_classes)`` (the dropout, where there is one, then ``fc3``)."""
        if self.drop is not None:
            features = self.drop(features)
        return F.log_softmax(self.fc3(features), dim=1)


class CIFAR10CNN(_OfficialCIFARCNN):
    """The official ``CNNCifar``: 307,842 parameters, of which the head ``fc3`` has 650 (0.21%).

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→64 (5x5) → ReLU → max-pool 2 → flatten
    (1600) → ``fc1`` 1600→120 → ReLU → ``fc2`` 120→64 → ReLU → ``fc3`` 64→``num_classes`` →
    ``log_softmax``. Input: ``(batch, 3, 32, 32)``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__(num_classes, conv_channels=64, hidden=(120, 64), dropout=None)
        self.save_hyperparameters()


class CIFAR100CNN(_OfficialCIFARCNN):
    """The official ``CNNCifar100``: 1,075,044 parameters, of which the head ``fc3`` has 12,900 (1.20%).

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→128 (5x5) → ReLU → max-pool 2 → flatten
    (3200) → ``fc1`` 3200→256 → ReLU → ``fc2`` 256→128 → ReLU → ``drop`` Dropout(0.6) → ``fc3``
    128→``num_classes`` → ``log_softmax``. Input: ``(batch, 3, 32, 32)``.
    """

    def __init__(
        self,
        num_classes: int = 100,
        dropout: float = 0.6,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__(num_classes, conv_channels=128, hidden=(256, 128), dropout=dropout)
        self.save_hyperparameters()
