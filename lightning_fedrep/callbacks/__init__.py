"""Federated callbacks: each one a :class:`~lightning_fedrep.lightning.callback.FederatedCallback`."""

from lightning_fedrep.callbacks.evaluation_finetuning import FineTunedEvaluation
from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.callbacks.neural_collapse import NeuralCollapse
from lightning_fedrep.callbacks.orthonormal import OrthonormalBody
from lightning_fedrep.callbacks.participation import AdaptiveParticipation
from lightning_fedrep.callbacks.progress import FederatedProgressBar
from lightning_fedrep.callbacks.summary import RunSummary
from lightning_fedrep.callbacks.validation_rounds import ValidateAtRounds

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
