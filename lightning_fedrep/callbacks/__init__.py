"""Callbacks that plug into the federated strategy through its public surface."""

from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.callbacks.progress import FederatedProgressBar
from lightning_fedrep.callbacks.summary import RunSummary

__all__ = ["FederatedProgressBar", "HeadFineTuning", "RunSummary"]
