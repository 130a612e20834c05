"""Old import path of the optimizer helpers: they live in :mod:`lightning_fedrep.models.optim` (re-exported here)."""

from lightning_fedrep.models.optim import fedrep_sgd, weight_decay_groups

__all__ = ["fedrep_sgd", "weight_decay_groups"]
