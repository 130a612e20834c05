"""Evaluation that covers part of the federation says so (issue 23, items 5 and 8): a pass cut by
``limit_val_batches``, clients without evaluation samples, a ``forward`` whose output the headline metrics
cannot read, test classes no client trains on, and whose model ``trainer.predict`` ran. Each check is against
an independent reference (the data module's own splits, a plain PyTorch forward, numpy counts)."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedrep import (
    DirichletPartitioner,
    FederatedDataModule,
    FedRepStrategy,
    IIDPartitioner,
    ShardPartitioner,
)
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule, tiny_datasets


def strategy(**kwargs):
    settings = dict(head="classifier", clients_per_round=1.0, head_epochs=1, body_epochs=1, seed=3)
    return FedRepStrategy(**{**settings, **kwargs})


def client_accuracy(strategy, dm, client, split="test"):
    """A client's accuracy with its own model, by a plain forward over its split."""
    data = dm.client_data(client, split)
    x, y = data.dataset.tensors
    with torch.no_grad():
        output = strategy.client_model(client)(x[data.indices])
    logits = output[0] if isinstance(output, tuple) else output
    return (logits.argmax(-1) == y[data.indices]).double().mean().item()


def messages(record):
    return [str(w.message) for w in record]


# ----------------------------------------------------------------------------- a pass cut short


@pytest.mark.parametrize(
    ("runner", "flags", "cause"),
    [
        ("sequential", {"limit_val_batches": 1}, "limit_val_batches=1"),
        ("auto", {"fast_dev_run": True}, "fast_dev_run"),
    ],
)
def test_a_cut_pass_says_its_summaries_are_over_the_clients_it_evaluated(runner, flags, cause):
    """Catches the silent cut: drop ``_partial_pass_note`` from ``_log_evaluation``'s notes and a
    pass over one client of six logs ``val/acc`` without a word. The value logged is that client's accuracy
    (a plain forward), which the warning names (per batch, and on the batched path, where a step is a chunk)."""
    from lightning_fedrep.models import (
        MLPClassifier,
    )  # declares fedrep_evaluation = "headline": batched on auto

    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=6, eval_batch_size=1000 if runner == "sequential" else 16)
    fedrep = strategy(runner=runner)
    model = MLPClassifier(in_features=6, hidden=12, features=8, num_classes=4)
    trainer = quiet_trainer(strategy=fedrep, max_epochs=1, **flags)
    with pytest.warns(UserWarning) as record:
        trainer.fit(model, datamodule=dm)
    evaluated = sorted(fedrep.client_metrics["val"].samples)
    note = [m for m in messages(record) if "val/acc and every val summary" in m]
    assert note and f"over {len(evaluated)} of 6 clients ({cause})" in note[0], messages(record)
    assert len(evaluated) < 6 and f"clients {evaluated}" in note[0]
    expected = np.mean([client_accuracy(fedrep, dm, c) for c in evaluated])
    assert trainer.callback_metrics["val/acc"].item() == pytest.approx(expected, abs=1e-6)


def test_a_pass_cut_inside_a_client_names_the_samples_it_scored():
    """Catches a partly evaluated client passing as whole: drop the ``cut`` part of ``coverage_note`` and
    client 0, scored on 8 of its samples, is listed like a fully evaluated client."""
    dm = tiny_datamodule(num_clients=6, eval_batch_size=8)
    dm.setup()
    size = len(dm.client_data(0, "test"))
    assert size > 8
    trainer = quiet_trainer(strategy=strategy(runner="sequential"), max_epochs=1, limit_val_batches=1)
    with pytest.warns(UserWarning, match=rf"over 1 of 6 clients .*cut short: 0 \(8 of {size} samples\)"):
        trainer.fit(TinyNet(), datamodule=dm)


def test_a_whole_pass_says_nothing_about_coverage():
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    assert not [m for m in messages(record) if "summary over clients" in m or "have no" in m]


# ----------------------------------------------------------------------------- clients without samples


def test_clients_without_evaluation_samples_are_named_when_the_data_is_loaded():
    """Catches the silent omission: remove ``_warn_clients_without_data(dataloader)`` from
    ``process_dataloader`` and clients 1 and 4, which have no test samples, vanish from every summary."""
    train, test = tiny_datasets()
    trains = [TensorDataset(*(t[i * 80 : (i + 1) * 80] for t in train.tensors)) for i in range(6)]
    tests = [TensorDataset(*(t[i * 20 : (i + 1) * 20] for t in test.tensors)) for i in range(6)]
    for empty in (1, 4):
        tests[empty] = TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))
    dm = FederatedDataModule.from_client_datasets(trains, tests, batch_size=8)
    fedrep, model = strategy(runner="sequential"), TinyNet()
    trainer = quiet_trainer(strategy=fedrep)
    with pytest.warns(UserWarning, match=r"val: 2 of 6 clients have no val samples .*clients \[1, 4\]"):
        trainer.validate(model, datamodule=dm, verbose=False)
    with pytest.warns(UserWarning, match=r"test: 2 of 6 clients have no test samples .*clients \[1, 4\]"):
        trainer.test(model, datamodule=dm, verbose=False)
    assert sorted(fedrep.client_metrics["test"].samples) == [0, 2, 3, 5]


# ----------------------------------------------------------------------------- a forward the headline cannot read


class TupleNet(TinyNet):
    def forward(self, x):
        features = self.body(x)
        return self.classifier(features), features

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x)[0], y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x)[0], y))


class TupleNetLoggingItsOwn(TupleNet):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)[0]
        self.log("val/acc", (logits.argmax(-1) == y).float().mean())
        self.log("val/loss", F.cross_entropy(logits, y))


def test_a_forward_returning_a_tuple_says_the_headline_metrics_are_not_computed():
    """Catches the silent vanishing: return ``None`` from ``_turn_off_headline`` before its warning and
    ``val/acc``/``val/loss`` are simply missing from the logs of a module whose forward returns a tuple."""
    trainer = quiet_trainer(strategy=strategy(runner="sequential"), max_epochs=1)
    with pytest.warns(
        UserWarning, match=r"val/acc and val/loss are not computed: model\(x\) returned a tuple of 2"
    ):
        trainer.fit(TupleNet(), datamodule=tiny_datamodule(num_clients=4))
    assert "val/acc" not in trainer.callback_metrics and "val_ce" in trainer.callback_metrics


def test_a_module_logging_the_headline_keys_itself_is_not_warned():
    fedrep = strategy(runner="sequential")
    trainer = quiet_trainer(strategy=fedrep, max_epochs=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm = tiny_datamodule(num_clients=4)
        trainer.fit(TupleNetLoggingItsOwn(), datamodule=dm)
    assert not [m for m in messages(record) if "not computed" in m]
    expected = np.mean([client_accuracy(fedrep, dm, c) for c in range(4)])
    assert trainer.callback_metrics["val/acc"].item() == pytest.approx(expected, abs=1e-6)


# ----------------------------------------------------------------------------- a class only in the test set


def labels_with_a_test_only_class():
    rng = np.random.default_rng(0)
    train = torch.as_tensor(rng.integers(0, 4, 400))  # classes 0..3
    test = torch.as_tensor(rng.integers(0, 5, 449))  # and class 4, which no client trains on
    return train, test


@pytest.mark.parametrize("partitioner", [ShardPartitioner(6, 2), DirichletPartitioner(6, alpha=0.5)])
def test_test_samples_of_a_class_no_client_trains_on_are_counted_in_a_warning(partitioner):
    """Catches the silent drop: remove ``_warn_test_only_classes(...)`` from ``split`` and class 4's test
    samples disappear from every client without a word. The count is numpy's, on the labels."""
    train, test = labels_with_a_test_only_class()
    dropped = int((test.numpy() == 4).sum())
    with pytest.warns(
        UserWarning, match=rf"{dropped} of 449 test samples are assigned to no client.*class 4 \("
    ):
        split = partitioner.split(train, test, seed=0)
    assert (
        sum(len(t) for t in split.test) == 449 - dropped
    )  # the official sampling: own training classes only


def test_iid_keeps_every_test_sample_and_says_nothing():
    train, test = labels_with_a_test_only_class()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = IIDPartitioner(6).split(train, test, seed=0)
    assert sum(len(t) for t in split.test) == 449


# ----------------------------------------------------------------------------- predict


def fitted(**kwargs):
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=4, eval_batch_size=16)
    fedrep = strategy(**kwargs)
    trainer = quiet_trainer(strategy=fedrep, max_epochs=2)
    trainer.fit(TinyNet(), datamodule=dm)
    return trainer, fedrep, dm


def test_predict_on_a_federated_data_module_personalizes_by_default_and_says_so(caplog):
    """Catches predicting with the untrained head: set ``predict="new_client"`` back as the default and each
    client's predictions come from the initial head instead of its own model (a plain forward of
    ``client_model(i)``), without a word."""
    trainer, fedrep, dm = fitted()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        predictions = trainer.predict(trainer.lightning_module, datamodule=dm)
    assert fedrep.prediction_mode == "personalized"
    assert any("personalized predictions" in r.getMessage() for r in caplog.records)
    for client in range(4):
        data = dm.client_data(client, "test")
        x = data.dataset.tensors[0][data.indices]
        got = torch.cat([p for p, c in zip(predictions, fedrep.prediction_clients) if c == client])
        with torch.no_grad():
            torch.testing.assert_close(got, fedrep.client_model(client)(x))


def test_predict_on_plain_batches_says_it_used_the_new_client_model(caplog):
    trainer, fedrep, _ = fitted()
    x = torch.randn(5, 6)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        (out,) = trainer.predict(trainer.lightning_module, DataLoader(TensorDataset(x), batch_size=5))
    assert fedrep.prediction_mode == "new_client"
    assert any("new-client predictions" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(out, fedrep.new_client_model()(x))


def test_personalized_predictions_of_batches_without_clients_are_refused_naming_predict():
    """Catches the silent fallback: without the check in ``on_predict_start``, ``predict="personalized"``
    on a plain loader predicts with the new-client model."""
    trainer, _, _ = fitted(predict="personalized")
    with pytest.raises(ValueError, match="predict='personalized'"):
        trainer.predict(trainer.lightning_module, DataLoader(TensorDataset(torch.randn(5, 6)), batch_size=5))
