"""Federated data: the data module, the per-round client iterables and the partitioners."""

from lightning_fedrep.data.leaf import LEAFDataModule
from lightning_fedrep.data.partition import NaturalPartitioner
from lightning_fedrep.data.sent140 import Sent140DataModule
from lightning_fedrep.data.synthetic_classification import SyntheticClassificationDataModule
from lightning_fedrep.data.vision import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    FashionMNISTDataModule,
    MNISTDataModule,
)

__all__ = [
    "CIFAR100DataModule",
    "CIFAR10DataModule",
    "EMNISTDataModule",
    "FashionMNISTDataModule",
    "LEAFDataModule",
    "MNISTDataModule",
    "NaturalPartitioner",
    "Sent140DataModule",
    "SyntheticClassificationDataModule",
]
