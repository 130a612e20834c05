"""A tiny classifier and a small label-skewed federation, shared by the tests."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule
from lightning_fedrep.data.partition import ShardPartitioner


class TinyNet(L.LightningModule):
    """Two-layer MLP; ``classifier`` is the head."""

    def __init__(
        self, lr: float = 0.05, momentum: float = 0.5, weight_decay: float = 1e-3, dropout: float = 0.0
    ):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.ReLU(), nn.Dropout(dropout), nn.Linear(12, 8), nn.ReLU()
        )
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_ce", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        hp = self.hparams
        return torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )


class MarkedTinyNet(TinyNet):
    fedrep_head = "classifier"


def tiny_datasets(n_train: int = 480, n_test: int = 160, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, 6, generator=g)
    y = ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()).long()
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def tiny_datamodule(
    num_clients: int = 8, classes_per_client: int = 2, batch_size: int = 8, seed: int = 0, **kw
):
    train, test = tiny_datasets(seed=seed)
    return FederatedDataModule(
        train,
        test,
        partitioner=ShardPartitioner(num_clients, classes_per_client),
        batch_size=batch_size,
        seed=seed,
        **kw,
    )


def quiet_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)
