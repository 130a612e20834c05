"""Straggler-resilient participation (SRPFL / FLANP): the callback and the latency models it draws from."""

from lightning_fedrep.callbacks.participation.adaptive import AdaptiveParticipation
from lightning_fedrep.callbacks.participation.latency import (
    DynamicExponential,
    FixedExponential,
    LatencyModel,
    TwoClassExponential,
    exponential_order_statistic_mean,
)

__all__ = [
    "AdaptiveParticipation",
    "DynamicExponential",
    "FixedExponential",
    "LatencyModel",
    "TwoClassExponential",
    "exponential_order_statistic_mean",
]
