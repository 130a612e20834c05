"""The training loss reaches every logger once per round, whatever ``log_every_n_steps`` is.

A Lightning step is one client's local step (sequential) or a whole phase of a group of clients (the vectorized
engine's fused calls: about two a round), so Lightning's per-step logging, every ``log_every_n_steps``-th step
(50 by default), wrote ``train/loss`` once in a 30-round run, and never in a short one. Now ``train/loss`` (the
engine's, a step rule's, or the user's own, as are the other values ``training_step`` logs with Lightning's
default timing) is logged once per round under its own name: the round's mean over every local step of every
client, each step's mean loss weighted by its batch's samples. The reference here is computed from the losses
and batch sizes the user's ``training_step`` saw on the sequential path (the engine trains the same clients on the
same batches), read back from a ``CSVLogger``'s file."""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

ROUNDS = 3


class LoggingNet(TinyNet):
    """Logs its loss as ``train/loss`` (Lightning's default timing) and, with ``record``, records each step's
    round, loss, accuracy and batch size (a side effect the vectorized runner refuses: its run records nothing);
    optionally also logs its accuracy (default timing) and its loss per step (``on_step=True`` given)."""

    fedrep_loss = "cross_entropy"

    def __init__(self, accuracy: bool = False, per_step: bool = False, record: bool = True):
        super().__init__()
        self.accuracy, self.per_step, self.record = accuracy, per_step, record
        self.steps: list[tuple[int, float, float, int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        correct = (logits.argmax(1) == y).double().mean().item()
        self.log("train/loss", loss)
        if self.accuracy:
            self.log_dict({"train/acc": correct})
        if self.per_step:
            self.log("train/step_loss", loss, on_step=True)
        if self.record:
            self.steps.append((self.current_epoch, loss.item(), correct, len(x)))
        return loss


def fit(runner, tmp_path, model, **trainer_kwargs):
    """``model`` (built by the caller right after ``torch.manual_seed(0)``) fitted for three rounds."""
    strategy = FederatedStrategy(
        head="classifier", clients_per_round=3, head_epochs=2, body_epochs=1, seed=1, runner=runner
    )
    logger = CSVLogger(tmp_path, name=runner, version=0)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0, logger=logger, **trainer_kwargs
    )
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6, batch_size=32, seed=2))
    return strategy, trainer, logged(logger)


def logged(logger) -> dict[str, list[tuple[int, float]]]:
    """Every logged key's values with their epoch, in the order the CSV file holds them."""
    with open(f"{logger.log_dir}/metrics.csv") as file:
        rows = list(csv.DictReader(file))
    columns = rows[0].keys() if rows else []
    return {
        key: [(int(r["epoch"]), float(r[key])) for r in rows if r[key] != ""]
        for key in columns
        if key not in ("epoch", "step")
    }


def per_round_means(steps, column: int) -> list[tuple[int, float]]:
    """The reference: each round's mean of a step value, weighted by the step's batch size."""
    means = []
    for r in range(ROUNDS):
        rows = [s for s in steps if s[0] == r]
        means.append((r, sum(s[column] * s[3] for s in rows) / sum(s[3] for s in rows)))
    return means


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    torch.manual_seed(0)
    model = LoggingNet()
    strategy, trainer, columns = fit("sequential", tmp_path_factory.mktemp("sequential"), model)
    return model, strategy, trainer, columns


def test_the_sequential_train_loss_is_logged_once_per_round_as_its_mean(sequential):
    """Fails on the code before: with 27 steps a round and ``log_every_n_steps=50`` the file held one
    ``train/loss`` value (step 49's), not one per round."""
    model, strategy, trainer, columns = sequential
    assert trainer.log_every_n_steps == 50 and trainer.global_step > ROUNDS * 20
    assert strategy.runner_report.runner == "sequential"
    got = columns["train/loss"]
    assert [r for r, _ in got] == list(range(ROUNDS))
    expected = per_round_means(model.steps, 1)
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert not {"train/loss_step", "train/loss_epoch"} & columns.keys()  # no forked duplicate names


def test_the_vectorized_engines_train_loss_is_the_same_round_mean(sequential, tmp_path):
    """The engine (two fused Lightning steps a round, its own loss: the user's step does not run) logs the same
    per-round means. Fails on the code before (no ``train/loss`` column: six Lightning steps in all), and if the
    mean counted only each call's last lockstep step or weighed clients equally regardless of their samples."""
    model, _, _, _ = sequential
    torch.manual_seed(0)
    strategy, trainer, columns = fit("vectorized", tmp_path, LoggingNet(record=False))
    assert strategy.runner_report.runner == "vectorized" and trainer.global_step == 2 * ROUNDS
    got = columns["train/loss"]
    assert [r for r, _ in got] == list(range(ROUNDS))
    expected = per_round_means(model.steps, 1)
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(expected[-1][1], rel=1e-5)


def test_the_users_other_default_timed_values_are_logged_once_per_round(tmp_path):
    """``train/acc`` (through ``log_dict``) gets one value per round, its mean; a value logged with
    ``on_step=True`` keeps Lightning's per-step timing (with ``log_every_n_steps=1``: every step)."""
    torch.manual_seed(0)
    model = LoggingNet(accuracy=True, per_step=True)
    _, trainer, columns = fit("sequential", tmp_path, model, log_every_n_steps=1)
    got = columns["train/acc"]
    assert [r for r, _ in got] == list(range(ROUNDS))
    assert [v for _, v in got] == pytest.approx([v for _, v in per_round_means(model.steps, 2)], rel=1e-6)
    assert [v for _, v in columns["train/step_loss"]] == pytest.approx([s[1] for s in model.steps], rel=1e-6)
    assert len(columns["train/loss"]) == ROUNDS
