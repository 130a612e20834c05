"""The papers' protocols as the recipes run them (issue: "The papers' protocols, exactly")."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from tests.fixtures import TinyNet, client_batches, quiet_trainer, tiny_datamodule

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def one_optimizer_per_client(init, dm, epochs):
    """main_local.py written out: each client trains its own copy for ``epochs`` epochs with one optimizer."""
    models = {}
    for client in range(dm.num_clients):
        model = copy.deepcopy(init)
        optimizer = model.configure_optimizers()
        per_epoch = math.ceil(dm.client_num_samples(client) / dm.batch_size)
        for epoch in range(epochs):  # the strategy's round r is the client's epoch r: same batches
            for x, y in client_batches(dm, dm.seed, epoch, client, per_epoch):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        models[client] = model
    return models


@pytest.mark.parametrize("keep, equal", [("keep", True), ("reset", False)])
def test_local_only_with_the_kept_optimizer_is_one_training_per_client(keep, equal):
    torch.manual_seed(0)
    init = TinyNet(lr=0.05, momentum=0.9, weight_decay=0.0)
    dm = tiny_datamodule(num_clients=4, seed=2)
    strategy = FedRepStrategy(
        algorithm="local", clients_per_round=1.0, local_epochs=1, client_optimizer_state=keep, seed=0
    )
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(
        copy.deepcopy(init), datamodule=dm
    )
    reference = one_optimizer_per_client(init, dm, epochs=3)
    for client, model in reference.items():
        got = strategy.client_state_dict(client)
        same = all(torch.allclose(got[k], v, atol=1e-6) for k, v in model.state_dict().items())
        assert same == equal, client  # "reset" restarts momentum every round: another training


def test_local_only_recipes_follow_main_local():
    for path in sorted(RECIPES.rglob("*local.yaml")):
        text = path.read_text()
        recipe = yaml.safe_load(text)
        strategy = recipe["trainer"]["strategy"]["init_args"]
        assert strategy["algorithm"] == "local" and strategy["client_optimizer_state"] == "keep", path
        assert strategy["clients_per_round"] == 1.0
        assert recipe["model"]["init_args"]["weight_decay"] == 0.0, path
        if "paper Table 1" in text:
            assert "The paper's figure is the accuracy after training: val/acc of the last round" in text, (
                path
            )
