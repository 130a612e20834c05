"""Federated callbacks: each one a :class:`~lightning_fedrep.lightning.callback.FederatedCallback`."""

from lightning_fedrep.callbacks.evaluation_finetuning import FineTunedEvaluation
from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.callbacks.neural_collapse import NeuralCollapse
from lightning_fedrep.callbacks.orthonormal import OrthonormalBody
from lightning_fedrep.callbacks.participation import AdaptiveParticipation
from lightning_fedrep.callbacks.summary import RunSummary
from lightning_fedrep.callbacks.validation_rounds import ValidateAtRounds
from lightning_fedrep.lightning.progress import FederatedProgressBar

__all__ = [
    "AdaptiveParticipation",
    "FederatedProgressBar",
    "FineTunedEvaluation",
    "HeadFineTuning",
    "NeuralCollapse",
    "OrthonormalBody",
    "RunSummary",
    "ValidateAtRounds",
]
