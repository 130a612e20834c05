"""Refuse Trainer settings that would silently break rounds (checked at ``setup``)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_fedrep.lightning.internals import reload_data_every_round


def check_trainer_flags(trainer: L.Trainer) -> None:
    """Refuse settings that would cut or merge rounds; make Lightning re-read each round's length."""
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise ValueError(
            "GradientAccumulationScheduler would accumulate gradients across different clients' batches. "
            "Remove it and use a larger batch_size in the data module instead."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} would accumulate gradients across "
            "different clients' batches. Use a larger batch_size in the data module instead."
        )
    if trainer.overfit_batches:
        raise ValueError("overfit_batches is not supported: rounds are planned per client, not per batch.")
    limit = trainer.limit_train_batches
    if not trainer.fast_dev_run and (isinstance(limit, int) or limit != 1.0):
        raise ValueError(
            f"limit_train_batches={trainer.limit_train_batches} would cut every round short, so later "
            "clients of the round would never train. Use clients_per_round or fewer local epochs/steps "
            "for shorter rounds (fast_dev_run=True is allowed for smoke tests)."
        )
    reload_data_every_round(trainer)
