"""Old import path of server-side aggregation: it lives in :mod:`lightning_fedrep.federation.aggregation`
(re-exported here)."""

from lightning_fedrep.federation.aggregation import (
    Aggregator,
    ClientUpdate,
    Stacked,
    WeightedAverage,
    WeightedMean,
)

__all__ = ["Aggregator", "ClientUpdate", "Stacked", "WeightedAverage", "WeightedMean"]
