"""Callbacks that plug into the federated strategy through its public surface."""

from lightning_fedrep.callbacks.collapse import NeuralCollapse
from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.callbacks.latency import (
    DynamicExponential,
    FixedExponential,
    LatencyModel,
    TwoClassExponential,
)
from lightning_fedrep.callbacks.participation import AdaptiveParticipation
from lightning_fedrep.callbacks.progress import FederatedProgressBar
from lightning_fedrep.callbacks.summary import RunSummary

__all__ = ["FederatedProgressBar", "HeadFineTuning", "RunSummary"]
__all__ += [
    "AdaptiveParticipation",
    "DynamicExponential",
    "FixedExponential",
    "LatencyModel",
    "TwoClassExponential",
]
__all__ += ["NeuralCollapse"]
