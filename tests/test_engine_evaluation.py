"""Batched personalized evaluation gives the per-batch path's per-client metrics, in a few steps."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy
from lightning_fedrep.callbacks import HeadFineTuning
from lightning_fedrep.federation.api.epochs import epoch_settings
from tests.fixtures import TinyNet, quiet_trainer


class HeadlineNet(TinyNet):
    """Declares its loss and that its evaluation steps log only the strategy's headline metrics."""

    fedrep_loss = "cross_entropy"
    fedrep_evaluation = "headline"

    def validation_step(self, batch, batch_idx):
        pass

    def test_step(self, batch, batch_idx):
        pass


class Regressor(HeadlineNet):
    fedrep_loss = "mse"

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(8, 1)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(features).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)


class EvaluationSteps(Callback):
    def __init__(self):
        self.steps = 0

    def on_test_batch_end(self, *args, **kwargs):
        self.steps += 1


def client_sets(regression=False, seed=0):
    """Eight clients of 5 to 40 samples (unequal), train and test."""
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for i, n in enumerate([5, 40, 12, 23, 31, 8, 17, 26]):
        x = torch.randn(2 * n, 6, generator=g)
        y = x[:, :2].sum(1) + 0.1 * i if regression else (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        train.append(TensorDataset(x[:n], y[:n]))
        test.append(TensorDataset(x[n:], y[n:]))
    return FederatedDataModule.from_client_datasets(train, test, batch_size=4, seed=seed)


def trained_checkpoint(tmp_path, model_cls, algorithm="fedrep", callbacks=(), regression=False):
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=3,
        seed=1,
        **epoch_settings(algorithm, head_epochs=1, body_epochs=1),
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[checkpoint, *callbacks],
    )
    trainer.fit(model_cls(), datamodule=client_sets(regression))
    if not callbacks:
        assert len(strategy.federation.store.local) < 8  # some clients never trained: initial heads
    return tmp_path / "last.ckpt"


def test_metrics(ckpt, model_cls, runner, algorithm="fedrep", regression=False):
    counter = EvaluationSteps()
    strategy = FederatedStrategy(head="classifier", algorithm=algorithm, runner=runner)
    trainer = quiet_trainer(strategy=strategy, callbacks=[counter])
    logged = trainer.test(model_cls(), datamodule=client_sets(regression), ckpt_path=ckpt, verbose=False)[0]
    return strategy, logged, counter.steps


test_metrics.__test__ = False  # a helper, not a test


def assert_same_metrics(per_batch, batched):
    (a, logged_a, _), (b, logged_b, _) = per_batch, batched
    metrics_a, metrics_b = a.client_metrics["test"], b.client_metrics["test"]
    assert sorted(metrics_a.names) == sorted(metrics_b.names) and metrics_a.names
    for name in metrics_a.names:
        expected, got = metrics_a.per_client(name), metrics_b.per_client(name)
        assert expected.keys() == got.keys() == set(range(8))
        for client in expected:
            assert got[client] == pytest.approx(expected[client], rel=1e-5, abs=1e-6), (name, client)
    assert logged_a.keys() == logged_b.keys()
    for key, value in logged_a.items():
        assert logged_b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("algorithm", ["fedrep", "lg_fedavg", "ditto"])
def test_batched_classification_metrics_equal_the_per_batch_path(tmp_path, algorithm):
    ckpt = trained_checkpoint(tmp_path, HeadlineNet, algorithm)
    per_batch = test_metrics(ckpt, HeadlineNet, "sequential", algorithm)
    batched = test_metrics(ckpt, HeadlineNet, "auto", algorithm)
    assert per_batch[0]._evaluation.batched is None
    assert batched[0]._evaluation.batched is not None
    assert batched[2] == 1 < per_batch[2] == 8  # one step for all eight clients, one per client before
    assert "test/acc" in batched[1] and "test/loss_p10" in batched[1]
    assert_same_metrics(per_batch, batched)


def test_batched_regression_metrics_equal_the_per_batch_path(tmp_path):
    ckpt = trained_checkpoint(tmp_path, Regressor, regression=True)
    per_batch = test_metrics(ckpt, Regressor, "sequential", regression=True)
    batched = test_metrics(ckpt, Regressor, "auto", regression=True)
    assert batched[2] == 1 and "test/loss" in batched[1] and "test/acc" not in batched[1]
    assert_same_metrics(per_batch, batched)


def test_fine_tuned_bodies_are_evaluated_with_their_own_body(tmp_path):
    ckpt = trained_checkpoint(tmp_path, HeadlineNet, callbacks=[HeadFineTuning(epochs=1, mode="full")])
    per_batch = test_metrics(ckpt, HeadlineNet, "sequential")
    batched = test_metrics(ckpt, HeadlineNet, "auto")
    assert batched[0].federation.store.finetuned  # whole models fine-tuned per client
    assert_same_metrics(per_batch, batched)


def test_validation_during_fit_is_batched_and_matches(tmp_path):
    def fit(runner):
        torch.manual_seed(0)
        strategy = FederatedStrategy(
            head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=1, runner=runner
        )
        trainer = quiet_trainer(strategy=strategy, max_epochs=2)
        trainer.fit(HeadlineNet(), datamodule=client_sets())
        return strategy, trainer

    per_batch, _ = fit("sequential")
    batched, trainer = fit("vectorized")
    assert trainer.num_val_batches == [1]
    assert [row["round"] for row in batched.history] == [0, 1]
    for row_a, row_b in zip(per_batch.history, batched.history):
        assert row_b["val/acc"] == pytest.approx(row_a["val/acc"], abs=1e-5)
        assert row_b["val/loss"] == pytest.approx(row_a["val/loss"], rel=1e-4)


def test_a_module_that_logs_its_own_metrics_keeps_the_per_batch_path(tmp_path):
    class Logging(HeadlineNet):
        fedrep_evaluation = None

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_ce", F.cross_entropy(self(x), y))

    ckpt = trained_checkpoint(tmp_path, Logging)
    strategy, logged, steps = test_metrics(ckpt, Logging, "auto")
    assert strategy._evaluation.batched is None and steps == 8  # one batch per client
    assert "test_ce" in logged and "test/acc" in logged
