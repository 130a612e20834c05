"""A closed round's server-side columns reach every logger once per round, as ``train/loss`` does.

The server step's metrics (``Algorithm.aggregate``), the privacy mechanism's (``privacy/epsilon``, ...) and
``faults`` are written to the round's history row when the round closes; the strategy also logs them with
``module.log`` (once per round), so a CSV, TensorBoard or W&B logger holds the same values per epoch. Each test
reads the values back from a ``CSVLogger``'s file and compares them with the history rows, round by round.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.federation.algorithms.l2gd import L2GD
from lightning_fedrep.privacy import ClientLevelDP
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

ROUNDS = 3


def fit_logged(
    tmp_path: Path, validate: bool = False, **settings
) -> tuple[FederatedStrategy, list[dict[str, str]]]:
    """A FedRep-family fit of ``ROUNDS`` rounds with a CSV logger (``validate``: a validation each round); the
    strategy and the logger's rows."""
    settings = {"head": "classifier", "clients_per_round": 4, "head_epochs": 1, "seed": 3, **settings}
    strategy = FederatedStrategy(**settings)
    logger = CSVLogger(tmp_path, name="run", version="")
    limit = 1.0 if validate else 0
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=limit, logger=logger)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=8, seed=1, batch_size=8))
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        return strategy, list(csv.DictReader(file))


def logged_by_epoch(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    """The value each epoch logged for ``key`` (rows where the logger wrote it)."""
    return {int(r["epoch"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}


def history_by_round(strategy: FederatedStrategy, key: str) -> dict[int, float]:
    return {r["round"]: r[key] for r in strategy.federation.history.rows if key in r}


def test_the_privacy_columns_of_every_round_reach_the_logger(tmp_path):
    """Catches ``privacy/epsilon`` (and the clip, the noise multiplier) kept in the history only, or logged for
    another round than the one that spent it."""
    pytest.importorskip("dp_accounting")
    pytest.importorskip("opacus")
    privacy = ClientLevelDP(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    strategy, rows = fit_logged(tmp_path, weighting="uniform", privacy=privacy)
    for key in ("privacy/epsilon", "privacy/clip", "privacy/noise_multiplier"):
        history = history_by_round(strategy, key)
        assert sorted(history) == list(range(ROUNDS)), (key, history)
        logged = logged_by_epoch(rows, key)
        assert logged.keys() == history.keys(), (key, logged, history)
        for round_index, value in history.items():
            assert math.isclose(logged[round_index], value, rel_tol=1e-6), (key, round_index, logged, history)
    epsilons = [history_by_round(strategy, "privacy/epsilon")[r] for r in range(ROUNDS)]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0  # composition only ever spends more


def test_an_algorithms_server_metrics_reach_the_logger(tmp_path):
    """Catches the server step's own metrics (L2GD's ``l2gd/pulls``) missing from the loggers."""
    l2gd = L2GD(p=0.5, alpha=0.1, lam=0.5)  # a pull with probability 1/2 per round
    strategy, rows = fit_logged(tmp_path, algorithm=l2gd, head=None, head_epochs=10, local_epochs=1)
    history = history_by_round(strategy, "l2gd/pulls")
    assert history, "L2GD recorded no l2gd/pulls column"
    assert logged_by_epoch(rows, "l2gd/pulls") == pytest.approx(history)


def test_a_run_without_server_metrics_logs_no_extra_column(tmp_path):
    """Catches columns logged that the history does not hold (FedRep's server step reports none; the validation
    logs its own every round, so the logger's file exists)."""
    _, rows = fit_logged(tmp_path, validate=True)
    columns = set().union(*(r.keys() for r in rows))
    assert "val/acc" in columns, columns
    assert not {c for c in columns if c.startswith("privacy/") or c in ("faults", "l2gd/pulls")}, columns
