"""PFLlib's CNN for its image leaderboard (``TsingZ0/PFLlib``, ``system/flcore/trainmodel/models.py``).

Parameter names are PFLlib's (``conv1.0``, ``conv2.0``, ``fc1.0``, ``fc``), so a PFLlib ``state_dict``
loads as it is. PFLlib splits the model with ``BaseHeadSplit`` into the base (everything but ``fc``) and the
head ``fc``; here ``fedrep_head = "fc"`` marks the same split. The model outputs logits, trained with
cross-entropy, and PFLlib's optimizer is plain SGD (``torch.optim.SGD(params, lr)``, lr 0.005 in its
leaderboard: no momentum, no weight decay).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fedrep.models.classifier import FedRepClassifier

__all__ = ["FedAvgCNN"]


def _features_after_convs(image_size: int) -> int:
    """The flattened width after two (5x5 conv, 2x2 max-pool) stages on ``image_size`` square images."""
    side = ((image_size - 4) // 2 - 4) // 2
    if side < 1:
        raise ValueError(
            f"FedAvgCNN(image_size={image_size}) is too small for two 5x5 convolutions and 2x2 poolings; use "
            "images of at least 16x16 (PFLlib: 28 for FMNIST, 32 for CIFAR)."
        )
    return 64 * side * side


class FedAvgCNN(FedRepClassifier):
    """PFLlib's ``FedAvgCNN``: two conv stages and a 512-wide hidden layer, the head ``fc``.

    ``conv1`` (``in_channels``→32, 5x5) → ReLU → max-pool 2 → ``conv2`` (32→64, 5x5) → ReLU → max-pool 2 →
    flatten (``dim``: 1024 for 1x28x28, 1600 for 3x32x32) → ``fc1`` (``dim``→512) → ReLU → ``fc``
    (512→``num_classes``), logits. The body is everything before ``fc`` (PFLlib's base), the head is ``fc``.
    FMNIST: ``FedAvgCNN(1, 10, 28)`` (582,026 parameters); CIFAR-10: ``FedAvgCNN(3, 10, 32)`` (878,538);
    CIFAR-100: ``FedAvgCNN(3, 100, 32)`` (924,708).

    Args:
        in_channels: image channels (1 for FMNIST, 3 for CIFAR).
        num_classes: outputs of the head ``fc``.
        image_size: the side of the square input images (28 or 32).
        lr: the SGD learning rate (PFLlib's ``-lr``, its leaderboard 0.005).
        momentum: SGD momentum (PFLlib: none).
        weight_decay: SGD weight decay on weights (PFLlib: none).
    """

    fedrep_head = "fc"

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        lr: float = 0.005,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ):
        super().__init__()
        for name, value in (
            ("in_channels", in_channels),
            ("num_classes", num_classes),
            ("image_size", image_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FedAvgCNN({name}={value!r}) must be a positive int.")
        dim = _features_after_convs(image_size)
        self.conv1 = nn.Sequential(nn.Conv2d(in_channels, 32, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)
        self.save_hyperparameters()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The base's output (the input of ``fc``), shape ``(batch, 512)``."""
        return self.fc1(self.conv2(self.conv1(x)).flatten(1))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.fc(features)
