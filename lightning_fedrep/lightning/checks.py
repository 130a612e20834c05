"""Refuse Trainer settings and LR schedulers that would silently break rounds (checked at ``setup``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def check_lr_schedulers(lr_scheduler_configs: Sequence[Any], automatic_optimization: bool) -> None:
    """Refuse an LR scheduler that Lightning steps at every training step (``interval="step"``): a Lightning
    step is one client's local step (on the vectorized engine, a step of every client of a group), so the
    schedule would tick across the round's clients, and each client would train at another point of it, by
    its place in the round. Under manual optimization Lightning steps no scheduler (the module does)."""
    stepped = [c for c in lr_scheduler_configs if c.interval == "step"] if automatic_optimization else []
    if stepped:
        name = type(stepped[0].scheduler).__name__
        raise ValueError(
            f"The LR scheduler {name} has interval='step': Lightning would step it at every training step, "
            "across clients, so in one round each client would train at another learning rate (the first "
            "client at the schedule's start, the last one after every earlier client's steps). Return "
            "{'scheduler': ..., 'interval': 'epoch'} from configure_optimizers: it steps once per round (one "
            "Lightning epoch is one communication round), and every client of a round trains at the same rate."
        )
