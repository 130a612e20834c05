"""Regressions for cases a first review broke: unequal rounds, checkpoints during validation,
user logging styles, lazily built modules, buffers, and settings that sneak past setup."""

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedrep import FederatedDataModule, FedRepStrategy
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule


def unequal_datamodule():
    """Four clients of 6, 14, 22 and 11 samples: rounds differ in length."""
    g = torch.Generator().manual_seed(0)
    train, test = [], []
    for n in (6, 14, 22, 11):
        x = torch.randn(n + 6, 6, generator=g)
        y = torch.randint(0, 4, (n + 6,), generator=g)
        train.append(TensorDataset(x[:n], y[:n]))
        test.append(TensorDataset(x[n:], y[n:]))
    return FederatedDataModule.from_client_datasets(train, test, batch_size=4, seed=1)


class BNNet(TinyNet):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.classifier = nn.Linear(8, 4)


def run(root, ckpt=None, callbacks=(), rounds=4, **trainer_kw):
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=3)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        default_root_dir=root,
        **trainer_kw,
    )
    trainer.fit(BNNet(), datamodule=unequal_datamodule(), ckpt_path=ckpt)
    return strategy, trainer


def same_federation(a, b):
    return all(
        torch.equal(x, y) for x, y in zip(a.federation.global_state, b.federation.global_state)
    ) and all(
        torch.equal(x, y)
        for c in a.federation.store.local
        for x, y in zip(a.federation.store.local[c], b.federation.store.local[c])
    )


def test_resume_from_every_round_end_when_rounds_differ_in_length(tmp_path):
    full, _ = run(tmp_path / "full", limit_val_batches=0)
    lengths = [full.round_plan(r).length for r in range(4)]
    assert len(set(lengths)) > 1, lengths
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    run(tmp_path / "a", callbacks=[saver], limit_val_batches=0)
    ends = torch.tensor(lengths).cumsum(0).tolist()[:-1]
    for step in ends + [ends[0] + 1]:
        resumed, trainer = run(
            tmp_path / f"b{step}", ckpt=tmp_path / "ck" / f"step={step}.ckpt", limit_val_batches=0
        )
        assert trainer.global_step == sum(lengths), step
        assert same_federation(full, resumed), f"resume from step {step} differs"


def test_checkpoint_saved_during_mid_round_validation_resumes_exactly(tmp_path):
    full, _ = run(tmp_path / "full", val_check_interval=0.5)
    saver = ModelCheckpoint(
        dirpath=tmp_path / "ck", monitor="val/acc", mode="max", save_top_k=-1, filename="{step}"
    )
    run(tmp_path / "a", callbacks=[saver], val_check_interval=0.5)
    open_rounds = [
        p
        for p in (tmp_path / "ck").glob("*.ckpt")
        if torch.load(p, weights_only=True)["lightning_fedrep"]["round"]["open"]
    ]
    assert open_rounds, "no checkpoint was written inside a round"
    resumed, _ = run(tmp_path / "b", ckpt=open_rounds[0], val_check_interval=0.5)
    assert same_federation(full, resumed)


class MetricNet(TinyNet):
    def __init__(self):
        super().__init__()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val/acc", self.val_acc)
        self.log_dict({"val/ce": F.cross_entropy(self(x), y)}, prog_bar=True)
        self.log("val/count", float(len(y)), reduce_fx="sum")


def test_user_logging_styles_are_respected():
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier", clients_per_round=2), max_epochs=1)
    trainer.fit(MetricNet(), datamodule=tiny_datamodule())
    metrics = trainer.callback_metrics
    assert "val/acc" in metrics and "val/acc_p10" not in metrics  # the user's Metric, logged by Lightning
    assert (
        "val/ce_p10" in metrics and "val/ce" in trainer.progress_bar_metrics
    )  # mean scalar: summarised, prog_bar kept
    assert metrics["val/count"].item() == 160  # reduce_fx="sum" is left to Lightning


class WholeBatchForward(TinyNet):
    def forward(self, batch):
        x, _ = batch
        return super().forward(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_ce", F.cross_entropy(self(batch), batch[1]))


def test_forward_that_takes_the_batch_turns_headline_metrics_off_with_a_warning():
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier", clients_per_round=2), max_epochs=1)
    with pytest.warns(UserWarning, match="Could not compute val/acc"):
        trainer.fit(WholeBatchForward(), datamodule=tiny_datamodule())
    assert "val_ce" in trainer.callback_metrics and "val/acc" not in trainer.callback_metrics


class LazyNet(TinyNet):
    def __init__(self):
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-3, "dropout": 0.0})

    def configure_model(self):
        if not hasattr(self, "classifier"):
            self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
            self.classifier = nn.Linear(8, 4)


def test_modules_built_in_configure_model():
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier", clients_per_round=2), max_epochs=1)
    trainer.fit(LazyNet(), datamodule=tiny_datamodule())
    assert trainer.strategy.split.head == ("classifier.weight", "classifier.bias")


@pytest.mark.parametrize(
    "algorithm,buffers,shared",
    [
        ("fedrep", "shared", True),
        ("fedrep", "local", False),
        ("lg_fedavg", "shared", False),
        ("fedavg", "shared", True),
        ("fedavg", "local", False),
        ("local", "shared", False),
    ],
)
def test_buffers_follow_the_body_unless_local(algorithm, buffers, shared):
    strategy = FedRepStrategy(head="classifier", algorithm=algorithm, buffers=buffers, clients_per_round=2)
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
        BNNet(), datamodule=tiny_datamodule()
    )
    assert ("body.1.running_mean" in strategy.federation.shared_names) == shared
    assert ("body.1.running_mean" in strategy.federation.local_names) != shared


def test_one_batch_limit_and_accumulation_scheduler_are_refused():
    with pytest.raises(ValueError, match="cut every round short"):
        quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=1, limit_train_batches=1).fit(
            TinyNet(), datamodule=tiny_datamodule()
        )
    scheduler = GradientAccumulationScheduler(scheduling={1: 4})
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=2, callbacks=[scheduler]).fit(
            TinyNet(), datamodule=tiny_datamodule()
        )


def test_predict_with_a_plain_loader_uses_the_new_client_model():
    model = TinyNet()
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier", clients_per_round=2), max_epochs=1)
    trainer.fit(model, datamodule=tiny_datamodule())
    x = torch.randn(5, 6)
    out = trainer.predict(model, DataLoader(TensorDataset(x), batch_size=5))
    with torch.no_grad():
        expected = trainer.strategy.new_client_model()(x)
    torch.testing.assert_close(out[0], expected)


class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1
