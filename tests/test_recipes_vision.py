"""Every paper recipe (CIFAR-10, CIFAR-100, FEMNIST) runs through the CLI on tiny data written in
each data set's real on-disk format (``fast_dev_run``: one step of training and of validation)."""

from pathlib import Path

import pytest

from lightning_fedrep.cli import build_cli
from tests.fixtures import leaf_user, write_cifar10, write_cifar100, write_leaf_file

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_cifar10(root, per_batch=400, n_test=2000)  # 2,000 images: 1,000 clients x 2 classes get shards
    write_cifar100(root, n_train=4000, n_test=4000)  # CIFAR-100 (100, 40): 40 shards per class
    users = {f"f_{u:03d}": leaf_user(u, 6) for u in range(12)}
    write_leaf_file(root / "femnist" / "train" / "train.json", users)
    write_leaf_file(
        root / "femnist" / "test" / "test.json", {u: leaf_user(i, 2) for i, u in enumerate(users)}
    )
    return root


@pytest.fixture(autouse=True)
def _no_md5(monkeypatch):
    from torchvision.datasets import cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: Path(fpath).is_file())


RECIPE_FILES = sorted(
    str(p.relative_to(RECIPES))
    for d in ("cifar10", "cifar100", "femnist", "flute")
    for p in (RECIPES / d).glob("*.yaml")
)


@pytest.mark.parametrize("recipe", RECIPE_FILES)
def test_paper_recipe_smoke(recipe, data_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if recipe.startswith("femnist"):
        data_args = [
            f"--data.init_args.train_dir={data_root}/femnist/train",
            f"--data.init_args.test_dir={data_root}/femnist/test",
        ]
    else:
        data_args = [f"--data.init_args.root={data_root}", "--data.init_args.download=false"]
    cli = build_cli(
        [
            "fit",
            "--config",
            str(RECIPES / recipe),
            "--trainer.fast_dev_run=true",
            "--trainer.accelerator=cpu",
            *data_args,
        ]
    )
    assert cli.trainer.global_step >= 1
    assert cli.trainer.strategy.algorithm.name in ("fedrep", "fedper", "fedavg", "lg_fedavg", "local")
