"""The base of the reference classifiers: cross-entropy training, strategy-side evaluation, the official SGD."""

from __future__ import annotations

import lightning as L
import torch
from torch.nn import functional as F

from lightning_fedrep.models.optim import fedrep_sgd

__all__ = ["FedRepClassifier"]


class FedRepClassifier(L.LightningModule):
    """Cross-entropy training, strategy-side evaluation and the official SGD recipe.

    ``forward`` is ``forward_head(forward_features(x))`` and ``fedrep_loss`` says what ``training_step``
    computes, so the strategy's vectorized runner applies (and caches features in head phases). A subclass
    builds its layers, saves ``lr``, ``momentum`` and ``weight_decay`` as hyper-parameters
    (``save_hyperparameters``) and defines ``forward_features`` and ``forward_head``.
    """

    fedrep_loss = "cross_entropy"
    """What ``training_step`` computes: cross-entropy of ``self(x)`` against integer labels."""

    fedrep_evaluation = "headline"
    """``validation_step``/``test_step`` log nothing beyond the strategy's headline metrics, so the strategy
    may evaluate many clients per step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output: the head on the body's features."""
        return self.forward_head(self.forward_features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass  # the strategy logs val/acc and val/loss per client from self(x)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass  # the strategy logs test/acc and test/loss per client from self(x)

    def predict_step(self, batch: tuple[torch.Tensor, ...] | torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The predicted class of each sample (``x`` or the first item of an ``(x, y)`` batch)."""
        x = batch[0] if isinstance(batch, tuple | list) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (lr 0.01, momentum 0.5 by default), weight decay (1e-4) on weights only, not biases."""
        hp = self.hparams
        return fedrep_sgd(self, hp.lr, hp.momentum, hp.weight_decay)
