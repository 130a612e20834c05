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
            assert "The paper's figure is the accuracy after training: val/acc" in text, path
            assert "of the last round (results()['final'])" in text, path


def test_leaf_users_are_in_file_order_as_the_official_code_or_by_id(tmp_path):
    from lightning_fedrep.data.leaf import LEAFDataModule
    from tests.fixtures import leaf_user, write_leaf_file

    order = ["f_0300", "f_0007", "f_0150"]  # not sorted: the order LEAF wrote them
    write_leaf_file(tmp_path / "train" / "a.json", {u: leaf_user(i, 4) for i, u in enumerate(order)})
    write_leaf_file(tmp_path / "test" / "a.json", {u: leaf_user(i, 2) for i, u in enumerate(order)})
    for user_order, expected in (("file", order), ("id", sorted(order))):
        data = LEAFDataModule(
            str(tmp_path / "train"), str(tmp_path / "test"), user_order=user_order, max_clients=2
        )
        data.setup()
        assert data.users == expected[:2]


def test_femnist_recipes_keep_the_official_softmax_and_read_the_weighted_accuracy():
    for path in sorted((RECIPES / "femnist").glob("*.yaml")):
        text = path.read_text()
        recipe = yaml.safe_load(text)
        assert recipe["model"]["init_args"]["output"] == "softmax", path
        assert recipe["data"]["init_args"]["user_order"] == "file", path
        assert "val/acc_weighted" in text and "my_sample.py" in text, path


def test_the_weighted_accuracy_has_a_last10_mean_logged():
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    expected = sum(row["val/acc_weighted"] for row in strategy.history) / 3
    assert float(trainer.callback_metrics["val/acc_weighted_last10"]) == pytest.approx(expected, abs=1e-6)


# the official SRPFL scripts (experiments/full-participation/fixed-computation-time/<data>.sh): FEDREP_local_rep_ep
SRPFL_REP_EPOCHS = {"cifar10": 1, "cifar100": 5, "emnist": 5, "femnist": 5}
SRPFL_SHARDS = {
    "cifar10": 5,
    "cifar100": 20,
    "emnist": 5,
    "femnist": None,
}  # FEMNIST: 3 classes by construction


@pytest.mark.parametrize("data", sorted(SRPFL_REP_EPOCHS))
@pytest.mark.parametrize("method, n0", [("fedrep_srpfl", 10), ("fedrep", None)])
def test_srpfl_paper_recipes_follow_the_official_scripts(data, method, n0):
    recipe = yaml.safe_load((RECIPES / "srpfl" / f"{data}_{method}.yaml").read_text())
    trainer = recipe["trainer"]
    assert trainer["max_epochs"] == 150 and trainer["check_val_every_n_epoch"] == 10  # --epochs, --test_freq
    strategy = trainer["strategy"]["init_args"]
    assert strategy["clients_per_round"] == 1.0  # --frac 1: every client in the pool
    phases = [(p["train"], p["epochs"]) for p in strategy["phases"]]
    assert phases == [("head", 10), ("body", 1)] * SRPFL_REP_EPOCHS[data]
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    participation = callbacks["AdaptiveParticipation"]
    assert (
        participation["initial_clients"] == n0 and participation["rounds_per_stage"] == 10
    )  # --init_clients, --double_freq
    assert participation["latency"]["class_path"].endswith(
        "FixedExponential"
    )  # iid-hyper: Exp(1), drawn once
    assert participation["latency"]["init_args"]["rate"] == 1.0
    assert callbacks["FineTunedEvaluation"]["epochs"] == 10  # --FT_epoch 10, from the averaged model
    assert callbacks["FineTunedEvaluation"].get("start", "average") == "average"
    model = recipe["model"]["init_args"]
    assert (model["lr"], model["momentum"], model["weight_decay"]) == (0.01, 0.5, 1e-4)
    data_args = recipe["data"]["init_args"]
    assert data_args["batch_size"] == 10
    if SRPFL_SHARDS[data]:
        assert data_args["num_clients"] == 100 and data_args["classes_per_client"] == SRPFL_SHARDS[data]
    else:
        assert data_args["max_clients"] == 100


def test_the_recipes_readme_lists_every_recipe_as_its_header_says():
    """recipes/README.md: one row per recipe, its figure and the paper's number as the recipe's header says."""
    rows = {}
    for line in (RECIPES / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            path, reproduces, figure, paper = (cell.strip() for cell in line.strip("|").split("|"))
            rows[path.strip("`")] = (reproduces, figure, paper)
    recipes = {str(p.relative_to(RECIPES)) for p in RECIPES.glob("*/*.yaml")}
    assert set(rows) == recipes
    for path, (_reproduces, figure, paper) in rows.items():
        header = " ".join(
            line[2:] for line in (RECIPES / path).read_text().splitlines() if line.startswith("# ")
        )
        for name in (t for t in figure.split("`")[1::2] if "/" in t):  # every logged name the row cites
            assert name in header, (path, name)
        number = paper.split("%")[0].split(" ±")[0]
        if number[:1].isdigit():
            assert number in header, (path, number)
