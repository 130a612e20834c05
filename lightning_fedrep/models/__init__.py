"""Example LightningModules for lightning_fedrep."""

from lightning_fedrep.models.linear import LowRankLinear

__all__ = ["LowRankLinear"]
