"""Reference LightningModules with their head marked (``fedrep_head``)."""

from lightning_fedrep.models.linear import LowRankLinear
from lightning_fedrep.models.mlp import MLPClassifier

__all__ = ["LowRankLinear", "MLPClassifier"]
