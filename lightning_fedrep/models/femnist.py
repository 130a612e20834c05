"""The official FedRep MLP for FEMNIST and MNIST (``lgcollins/FedRep``, ``models/Nets.py::MLP``)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.models.classifier import FedRepClassifier

__all__ = ["FEMNISTMLP"]


class _OfficialMLP(FedRepClassifier):
    """The official MLPs' layers (``layer_input``, ``layer_hidden1``, ``layer_hidden2``: the body;
    ``layer_out``: the head) at the ``widths`` of the hidden layers, ReLU between them; the head's logits.
    Subclasses call ``save_hyperparameters()`` themselves (it reads their own arguments)."""

    fedrep_head = "layer_out"

    def __init__(self, in_features: int, widths: tuple[int, int, int], num_classes: int):
        super().__init__()
        self.layer_input = nn.Linear(in_features, widths[0])
        self.layer_hidden1 = nn.Linear(widths[0], widths[1])
        self.layer_hidden2 = nn.Linear(widths[1], widths[2])
        self.layer_out = nn.Linear(widths[2], num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output (the input of ``layer_out``), shape ``(batch, widths[2])``."""
        x = x.flatten(1)
        x = F.relu(self.layer_input(x))
        x = F.relu(self.layer_hidden1(x))
        return F.relu(self.layer_hidden2(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.layer_out(features)


class FEMNISTMLP(_OfficialMLP):
    """The official FEMNIST/MNIST ``MLP``: 550,346 parameters, of which the head ``layer_out`` has 650.

    Flatten (1x28x28 → 784) → ``layer_input`` 784→512 → ReLU → ``layer_hidden1`` 512→256 → ReLU →
    ``layer_hidden2`` 256→64 → ReLU → ``layer_out`` 64→``num_classes``. The body is ``layer_input``,
    ``layer_hidden1``, ``layer_hidden2`` (the official ``w_glob_keys``). The official model's unused
    ``Dropout(0)`` is left out (it has no parameters and does nothing).

    ``output`` picks what :meth:`forward` returns:

    * ``"logits"`` (default): the raw scores; the training loss is the usual cross-entropy.
    * ``"softmax"``: probabilities, as the official code, which then applies ``CrossEntropyLoss`` to
      these probabilities, i.e. a *double* softmax. That loss is bounded and its gradients are much
      smaller than the ordinary ones, so training is slower; choose it only to reproduce the official
      numbers. The strategy's ``val/loss``/``test/loss`` (cross-entropy on ``forward``'s output) then
      carry the same quirk; accuracies are unaffected.

    Input: ``(batch, 1, 28, 28)`` or already flat ``(batch, 784)``.
    """

    def __init__(
        self,
        in_features: int = 784,
        num_classes: int = 10,
        output: Literal["logits", "softmax"] = "logits",
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        if output not in ("logits", "softmax"):
            raise ValueError(f"output must be 'logits' or 'softmax', got {output!r}.")
        super().__init__(in_features, (512, 256, 64), num_classes)
        self.save_hyperparameters()

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits (or probabilities, with ``output="softmax"``) of shape ``(batch, num_classes)``."""
        x = self.layer_out(features)
        return F.softmax(x, dim=1) if self.hparams.output == "softmax" else x
