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
        if path.parent.name == "transformers":  # the LoRA 'local' split, not FedRep's main_local
            continue
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
    # test_flag = iter % test_freq == test_freq - 1 or iter >= epochs - 3
    assert callbacks["ValidateAtRounds"] == {"every": 10, "last": 3}
    model = recipe["model"]["init_args"]
    assert (model["lr"], model["momentum"], model["weight_decay"]) == (0.01, 0.5, 1e-4)
    data_args = recipe["data"]["init_args"]
    assert data_args["batch_size"] == 10
    # sampling.py draws test shards with replacement when the test set has < 100 samples per client:
    # EMNIST's 8,000 test letters a-j over 100 clients (CIFAR: 10,000 over 100, disjoint)
    assert data_args.get("test_draws") == (50 if data == "emnist" else None)
    if SRPFL_SHARDS[data]:
        assert data_args["num_clients"] == 100 and data_args["classes_per_client"] == SRPFL_SHARDS[data]
    else:
        assert data_args["max_clients"] == 100


def test_the_recipes_readme_lists_every_recipe_as_its_header_says():
    """recipes/README.md: one row per recipe, its figure and the paper's number as the recipe's header says."""
    rows = {}
    for line in (RECIPES / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            path, reproduces, figure, paper, _seeds = (cell.strip() for cell in line.strip("|").split("|"))
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


# The FLUTE code's settings (RenpuLiu/flute; restated from shared/reference/flute.md §4.2-4.4, §6.3-6.4):
# per data set, the joint (body + head) epochs of FLUTE (``--local_rep_ep``); FLUTE* adds 10 head-only epochs,
# which the code runs first. Table 1 (§7.1): (FLUTE, FLUTE*) mean ± std % per column (N clients, S classes).
FLUTE_JOINT_EPOCHS = {"cifar10": 1, "cifar100": 5}
FLUTE_TABLE_1 = {
    ("cifar10", 50, 2): ("87.012 ± 0.453", "87.713 ± 1.365"),
    ("cifar10", 50, 5): ("76.478 ± 0.484", "76.543 ± 0.921"),
    ("cifar10", 100, 2): ("86.128 ± 1.007", "88.567 ± 0.457"),
    ("cifar10", 100, 5): ("76.918 ± 0.712", "78.255 ± 0.688"),
    ("cifar100", 100, 5): ("77.750 ± 0.615", "79.560 ± 0.627"),
    ("cifar100", 100, 10): ("70.598 ± 0.282", "70.844 ± 0.419"),
    ("cifar100", 100, 20): ("59.243 ± 0.334", "59.714 ± 0.448"),
    ("cifar100", 100, 40): ("48.169 ± 0.597", "48.170 ± 0.440"),
}


@pytest.mark.parametrize("variant", ["flute", "flute_star"])
@pytest.mark.parametrize("column", sorted(FLUTE_TABLE_1), ids=lambda c: f"{c[0]}_{c[1]}_{c[2]}")
def test_flute_recipes_follow_the_official_code(column, variant):
    """Each FLUTE / FLUTE* recipe against the official code's settings and the paper's Table 1, restated
    here (not read from ``recipes/flute/generate.py``): 100 rounds, participation 0.1, validation every
    round, SGD lr 0.01 / momentum 0.5 / weight decay 1e-4, batch 10, the loss weights 0.25 / 0.0025 /
    0.0005, the server NC step at lr 0.5 over the participants, the joint epochs (1 on CIFAR-10, 5 on
    CIFAR-100), FLUTE*'s 10 head-only epochs first, the pre-dropout features of the CIFAR-100 CNN, and the
    paper's number in the header. Catches any one setting changed in ``generate.py``'s table, e.g.
    ``joint_epochs=1`` for CIFAR-100 or FLUTE*'s head epochs appended after the joint ones."""
    dataset, n, s = column
    path = RECIPES / "flute" / f"{dataset}_{n}_{s}_{variant}.yaml"
    text = path.read_text()
    recipe = yaml.safe_load(text)
    trainer = recipe["trainer"]
    assert trainer["max_epochs"] == 100 and trainer["check_val_every_n_epoch"] == 1  # --epochs 100
    strategy = trainer["strategy"]["init_args"]
    assert strategy["algorithm"] in ("fedrep", "fedper")  # body averaged, heads local
    assert strategy["clients_per_round"] == 0.1  # --frac 0.1
    joint = FLUTE_JOINT_EPOCHS[dataset]
    expected = [("all", joint)] if variant == "flute" else [("head", 10), ("all", joint)]
    assert [(p["train"], p["epochs"]) for p in strategy["phases"]] == expected
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    collapse = callbacks["NeuralCollapse"]
    assert (collapse["lam"], collapse["mu"], collapse["nu"]) == (0.25, 0.0025, 0.0005)  # r1, r2, r3
    assert collapse["server_step"] is True and collapse["server_lr"] == 0.5  # --server_update 1, lr 0.5
    assert collapse.get("server_weighting", "participants") == "participants"  # 1/|S_t|
    assert collapse["local_classes"] == s
    assert collapse.get("features_module") == ("drop" if dataset == "cifar100" else None)
    model = recipe["model"]
    models = {"cifar10": "CIFAR10CNN", "cifar100": "CIFAR100CNN"}
    assert model["class_path"].rsplit(".", 1)[-1] == models[dataset]
    assert (model["init_args"]["lr"], model["init_args"]["momentum"], model["init_args"]["weight_decay"]) == (
        0.01,
        0.5,
        1e-4,
    )
    data = recipe["data"]["init_args"]
    assert (data["num_clients"], data["classes_per_client"], data["batch_size"]) == (n, s, 10)
    flute, star = FLUTE_TABLE_1[column]
    label, number = ("FLUTE", flute) if variant == "flute" else ("FLUTE*", star)
    assert f"Paper: {label} {number} %" in text and f"(FLUTE {flute}, FLUTE* {star})" in text
    assert f"(N={n} clients, S={s} classes per client)" in text


def test_flute_recipes_are_the_sixteen_of_table_1():
    expected = {f"{d}_{n}_{s}_{v}.yaml" for d, n, s in FLUTE_TABLE_1 for v in ("flute", "flute_star")}
    assert {p.name for p in (RECIPES / "flute").glob("*_flute*.yaml")} == expected  # the rest: baselines


def test_the_cifar100_cnn_feeds_its_head_through_the_dropout_named_drop():
    """``features_module="drop"`` penalises the input of ``drop``: the official ``CNNCifar100``'s post-ReLU
    fc2 output (restated here layer by layer), before the Dropout(0.6) that feeds fc3, in training mode.
    Catches the ReLU after fc2 dropped (``return self.fc2(x)`` in ``CIFAR100CNN.forward_features``): the
    penalised features would not be the official code's."""
    from lightning_fedrep.models import CIFAR100CNN

    torch.manual_seed(0)
    model = CIFAR100CNN()
    assert isinstance(model.drop, torch.nn.Dropout) and model.drop.p == 0.6
    seen = {}
    model.drop.register_forward_pre_hook(lambda module, args: seen.setdefault("drop", args[0]))
    x = torch.randn(4, 3, 32, 32)
    model.train()
    model(x)
    m = model
    h = F.max_pool2d(F.relu(m.conv1(x)), 2)
    h = F.max_pool2d(F.relu(m.conv2(h)), 2).flatten(1)
    expected = F.relu(m.fc2(F.relu(m.fc1(h))))
    torch.testing.assert_close(seen["drop"], expected)
