"""Every recipe of PFLlib's leaderboard setting (``recipes/pfllib/``) runs through the CLI on tiny data written
in each data set's real on-disk format (``fast_dev_run``: one step of training and of validation), with
PFLlib's pooled clients, its CNN and its preprocessing."""

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_fedrep import PFLlibPartitioner
from lightning_fedrep.app.cli import build_cli
from lightning_fedrep.models import FedAvgCNN
from tests.fixtures import write_cifar10, write_cifar100
from tests.test_datasets import write_fashion_mnist
from tests.test_recipes_vision import assert_runs_the_recipes_algorithm

pytest.importorskip("torchvision")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPE_FILES = sorted(p.name for p in (RECIPES / "pfllib").glob("*.yaml"))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Tiny sets big enough for PFLlib's 20 clients (least_samples: min(40, pool / 40) each): 1,400 pooled
    FMNIST and CIFAR-10 images, 2,000 CIFAR-100 ones (20 per class: 2 holders each in the 10-class split)."""
    root = tmp_path_factory.mktemp("pfllib-data")
    write_fashion_mnist(root, np.arange(1000) % 10, np.arange(400) % 10)
    write_cifar10(root, per_batch=200, n_test=400)
    write_cifar100(root, n_train=1500, n_test=500)
    return root


@pytest.fixture(autouse=True)
def _no_md5(monkeypatch):
    from torchvision.datasets import cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: Path(fpath).is_file())


def test_every_algorithm_has_its_six_recipes():
    from lightning_fedrep import ALGORITHMS

    algorithms = {  # the package's own (a test may register one of its own in this process, e.g. fedrep_median)
        name
        for name, algorithm in ALGORITHMS.items()
        if not name.endswith("_ddp") and type(algorithm).__module__.startswith("lightning_fedrep.")
    }
    expected = {
        f"{d}_{s}_{a}.yaml"
        for d in ("fmnist", "cifar10", "cifar100")
        for s in ("pat", "dir01")
        for a in algorithms
    }
    assert set(RECIPE_FILES) == expected


def cli_args(recipe: str, data_root: Path) -> list[str]:
    args = ["--config", str(RECIPES / "pfllib" / recipe), "--trainer.accelerator=cpu"]
    args += [f"--data.init_args.root={data_root}", "--data.init_args.download=false"]
    if recipe.endswith("_per_fedavg.yaml"):  # 5 adaptation epochs per scored client: 4 clients suffice here
        args.append("--trainer.strategy.init_args.evaluate_clients=4")
    return args


@pytest.mark.parametrize("recipe", RECIPE_FILES)
def test_pfllib_recipe_builds_its_federation(recipe, data_root, tmp_path, monkeypatch):
    """Every recipe: the CLI builds its model, data (PFLlib's 20 pooled clients, on the real-format files) and
    strategy with the recipe's algorithm."""
    monkeypatch.chdir(tmp_path)
    cli = build_cli(cli_args(recipe, data_root), run=False)
    cli.datamodule.setup("fit")
    assert_runs_the_recipes_algorithm(cli.trainer.strategy.algorithm, RECIPES / "pfllib" / recipe)
    assert isinstance(cli.model, FedAvgCNN) and isinstance(cli.datamodule.partitioner, PFLlibPartitioner)
    assert cli.datamodule.num_clients == 20 and cli.datamodule.partitioner.seed == 1
    x, _ = cli.datamodule.client_data(0, "test").dataset[0]
    assert cli.model(x[None]).shape == (1, cli.model.fc.out_features)


SETTINGS = [(d, s) for d in ("fmnist", "cifar10", "cifar100") for s in ("pat", "dir01")]
ALGORITHMS = sorted({name.split("_", 2)[2].removesuffix(".yaml") for name in RECIPE_FILES})
TRAINED = [f"{d}_{s}_{a}.yaml" for i, a in enumerate(ALGORITHMS) for d, s in [SETTINGS[i % len(SETTINGS)]]]
"""The recipes a smoke run trains: every algorithm once, the data sets and splits in turn (each of the six
settings at least four times); every recipe is built above. ``LIGHTNING_FEDREP_SMOKE_ALL=1`` trains them all
(168 runs, about 3 s each on an idle core)."""
if os.environ.get("LIGHTNING_FEDREP_SMOKE_ALL"):
    TRAINED = RECIPE_FILES


@pytest.mark.parametrize("recipe", TRAINED)
def test_pfllib_recipe_smoke(recipe, data_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", *cli_args(recipe, data_root), "--trainer.fast_dev_run=true"])
    assert cli.trainer.global_step >= 1
    assert_runs_the_recipes_algorithm(cli.trainer.strategy.algorithm, RECIPES / "pfllib" / recipe)
    assert "val/acc" in cli.trainer.callback_metrics


@pytest.mark.parametrize("recipe", RECIPE_FILES)
def test_pfllib_recipe_setting_and_figures(recipe):
    """PFLlib's setting restated (baselines-2026.md §1): 20 clients every round, 2000 rounds, evaluation every
    round, batch 10, plain SGD lr 0.005, 1 local epoch; the header names both figures."""
    text = (RECIPES / "pfllib" / recipe).read_text()
    config = yaml.safe_load(text)
    trainer, strategy = config["trainer"], config["trainer"]["strategy"]["init_args"]
    assert trainer["max_epochs"] == 2000 and trainer["check_val_every_n_epoch"] == 1
    assert strategy["clients_per_round"] == 1.0
    assert strategy.get("local_epochs", 1) == 1 and all(p["epochs"] == 1 for p in strategy.get("phases", []))
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert (model["lr"], model["momentum"], model["weight_decay"]) == (0.005, 0.0, 0.0)
    assert data["batch_size"] == 10 and data["preprocessing"] == "pfllib"
    split = data["partitioner"]["init_args"]
    assert split["num_clients"] == 20 and split["seed"] == 1
    dataset, partition = recipe.split("_")[:2]
    if partition == "pat":
        assert split["classes_per_client"] == {"fmnist": 2, "cifar10": 2, "cifar100": 10}[dataset]
    else:
        assert (split["partition"], split["alpha"]) == ("dir", 0.1)
    assert "# Leaderboard: figure val/acc_weighted_best; PFLlib" in text
    assert "# Seeds table: figure val/acc_last10; paper " in text
