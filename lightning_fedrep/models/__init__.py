"""Reference LightningModules with their head marked (``fedrep_head``)."""

from lightning_fedrep.models.centaur import CENTAURCNN, CENTAURMLP
from lightning_fedrep.models.cnn import CIFAR10CNN, CIFAR100CNN
from lightning_fedrep.models.femnist import FEMNISTMLP
from lightning_fedrep.models.linear import LowRankLinear
from lightning_fedrep.models.mlp import MLPClassifier
from lightning_fedrep.models.pfllib import FedAvgCNN
from lightning_fedrep.models.sent140 import Sent140RNN

__all__ = [
    "CENTAURCNN",
    "CENTAURMLP",
    "CIFAR100CNN",
    "CIFAR10CNN",
    "FEMNISTMLP",
    "FedAvgCNN",
    "LowRankLinear",
    "MLPClassifier",
    "Sent140RNN",
]
