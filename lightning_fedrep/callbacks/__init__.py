"""Callbacks that plug into the federated strategy through its public surface."""

from lightning_fedrep.callbacks.finetuning import HeadFineTuning

__all__ = ["HeadFineTuning"]
