"""The official CENTAUR code's models (Shen et al., ICLR 2023; ``shenzebang/CENTAUR-Privacy-Federated-Representation-
Learning``, ``models/models.py``): the FedRep CNN's convolutions with narrower fully connected layers, and a
narrower MLP than FedRep's. Under client-level DP the body's size matters: the noise falls on every coordinate.

Layer names, shapes and the body/head split are the official ones (the head is the last linear layer, as the
official ``DP_FedRep`` global keys). Like the FedRep CNNs of :mod:`lightning_fedrep.models.cnn`, the CNN outputs
log-probabilities (the official one: logits; cross-entropy is the same on both, since ``log_softmax`` is
idempotent); the MLP outputs logits, as the official one.
"""

from __future__ import annotations

from lightning_fedrep.models.cnn import _OfficialCIFARCNN
from lightning_fedrep.models.femnist import _OfficialMLP

__all__ = ["CENTAURCNN", "CENTAURMLP"]


class CENTAURCNN(_OfficialCIFARCNN):
    """CENTAUR's ``CNNCifar10`` (``hidden=(384, 32)``, the default) and ``CNNCifar100`` (``hidden=(128, 32)``,
    ``num_classes=100``), for ``(batch, 3, 32, 32)`` inputs.

    ``conv1`` 3→64 (5x5) → ReLU → max-pool 2 → ``conv2`` 64→64 (5x5) → ReLU → max-pool 2 → flatten (1600) →
    ``fc1`` 1600→``hidden[0]`` → ReLU → ``fc2`` →``hidden[1]`` → ReLU → ``fc3`` →``num_classes`` →
    ``log_softmax``. The body is ``conv1, conv2, fc1, fc2`` (734,432 parameters at the CIFAR-10 widths, 316,384 at
    the CIFAR-100 ones), the head ``fc3``. No dropout (the official models define one and never apply it).

    Args:
        num_classes: outputs of the head ``fc3``.
        hidden: the widths of ``fc1`` and ``fc2``.
        lr, momentum, weight_decay: the SGD of :class:`~lightning_fedrep.models.classifier.FedRepClassifier`
            (defaults: the official ``options.py``'s lr 0.01, momentum 0.9 and weight decay 1e-4; the decay
            here applies to weights only, the official to every parameter).
    """

    def __init__(
        self,
        num_classes: int = 10,
        hidden: tuple[int, int] = (384, 32),
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
    ):
        super().__init__(num_classes, conv_channels=64, hidden=(int(hidden[0]), int(hidden[1])), dropout=None)
        self.save_hyperparameters()


class CENTAURMLP(_OfficialMLP):
    """CENTAUR's EMNIST ``MLP``: flatten (1x28x28 → 784) → ``layer_input`` 784→256 → ReLU → ``layer_hidden1``
    256→128 → ReLU → ``layer_hidden2`` 128→16 → ReLU → ``layer_out`` 16→``num_classes`` (logits).

    The body is ``layer_input``, ``layer_hidden1``, ``layer_hidden2`` (235,920 parameters), the head
    ``layer_out`` (170 at 10 classes). Input: ``(batch, 1, 28, 28)`` or already flat ``(batch, 784)``.

    Args:
        in_features: the flattened input size.
        num_classes: outputs of the head ``layer_out``.
        lr, momentum, weight_decay: as :class:`CENTAURCNN`.
    """

    def __init__(
        self,
        in_features: int = 784,
        num_classes: int = 10,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
    ):
        super().__init__(in_features, (256, 128, 16), num_classes)
        self.save_hyperparameters()
