"""The CENTAUR recipes (issue 40): DP-FedRep and DP-FedAvg + FT with the official camera-ready scripts' settings.

Everything expected here is restated from the official code (``shenzebang/CENTAUR-Privacy-Federated-
Representation-Learning`` @71e092e, ``script/user-level-DP/camera-ready-ICLR2023/small-epoch-data-augmentation-
fine-tune/*/run/DP-Fed{Rep,Avg}-full.sh`` and ``options.py``; shared/reference/privacy.md §3-4), not read from
``recipes/privacy/generate.py``. The smoke runs (``fast_dev_run`` on generated files of the real formats) are
``tests/test_recipes_vision.py::test_paper_recipe_smoke``; the offline digits pair runs in
``tests/test_cli.py::test_every_digits_recipe_smoke``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# (data set, --num_users, --shard_per_user): (--dp_clip, --epochs, --local_ep)
OFFICIAL = {
    ("cifar10", 500, 2): (0.01, 200, 1),
    ("cifar10", 500, 5): (0.01, 200, 1),
    ("cifar10", 1000, 2): (0.01, 200, 1),
    ("cifar10", 1000, 5): (0.01, 200, 1),
    ("cifar100", 500, 5): (0.02, 200, 1),
    ("cifar100", 500, 20): (0.02, 200, 1),
    ("cifar100", 1000, 5): (0.02, 200, 1),
    ("cifar100", 1000, 20): (0.01, 200, 1),
    ("emnist", 1000, 5): (0.25, 40, 2),
    ("emnist", 2000, 5): (0.25, 40, 2),
}
# privacy.md §4: the interim CIFAR-10 results (Sep 2022) and the submission-era EMNIST figure, ε = 1.
NUMBERS = {
    ("cifar10", 500, 2): ("78.54", "72.12"),
    ("cifar10", 500, 5): ("52.55", "38.04"),
    ("cifar10", 1000, 2): ("75.75", "57.02"),
    ("cifar10", 1000, 5): ("47.67", "37.15"),
    ("emnist", 2000, 5): ("92.79", "86.85"),
}
DATA_CLASS = {"cifar10": "CIFAR10DataModule", "cifar100": "CIFAR100DataModule", "emnist": "EMNISTDataModule"}
# models/models.py: CNNCifar10 (fc 384, 32), CNNCifar100 (fc 128, 32), MLP (784-256-128-16)
MODEL = {
    "cifar10": ("CENTAURCNN", {"num_classes": 10, "hidden": [384, 32]}),
    "cifar100": ("CENTAURCNN", {"num_classes": 100, "hidden": [128, 32]}),
    "emnist": ("CENTAURMLP", {}),
}
CASES = [(column, method) for column in OFFICIAL for method in ("dp_fedrep", "dp_fedavg_ft")]


def load(path: Path) -> tuple[str, dict]:
    assert path.is_file(), f"no recipe {path.relative_to(RECIPES)}"
    text = path.read_text()
    return text, yaml.safe_load(text)


def test_every_camera_ready_setting_has_both_recipes_and_nothing_else():
    """Catches a setting of the camera-ready scripts left out of the generator's table (or one it invents)."""
    expected = {f"{d}_{n}_{s}_{m}.yaml" for (d, n, s), m in CASES}
    assert {p.name for p in (RECIPES / "privacy").glob("*.yaml")} == expected


@pytest.mark.parametrize(("column", "method"), CASES, ids=[f"{c[0]}_{c[1]}_{c[2]}_{m}" for c, m in CASES])
def test_centaur_recipe_has_the_official_settings_and_lists_its_deviations(column, method):
    """Catches: a clip, round count or local epochs off the official script (e.g. CIFAR-100 N=1000 S=20 at clip
    0.02 instead of 0.01), a budget other than ε 1 / δ 1e-5, a partial cohort (the scripts train every client
    every round), sample weighting (breaks the sensitivity), the head epochs or fine-tuning epochs off
    ``--local_head_ep 15``, the optimizer off ``options.py`` (momentum 0.9, weight decay 1e-4, lr 1e-2),
    batch size off 100, and a header without the deviations or the official numbers."""
    dataset, n, s = column
    clip, rounds, local_epochs = OFFICIAL[column]
    text, recipe = load(RECIPES / "privacy" / f"{dataset}_{n}_{s}_{method}.yaml")
    trainer = recipe["trainer"]
    strategy = trainer["strategy"]["init_args"]
    assert trainer["max_epochs"] == rounds
    assert strategy["clients_per_round"] == 1.0 and strategy["weighting"] == "uniform"
    assert strategy["privacy"] == {
        "class_path": "lightning_fedrep.privacy.ClientLevelDP",
        "init_args": {"clip": clip, "target_epsilon": 1.0, "delta": 1e-5, "rounds": rounds},
    }
    fine_tuning = [c for c in trainer["callbacks"] if c["class_path"].endswith("FineTunedEvaluation")]
    if method == "dp_fedrep":
        assert strategy["algorithm"] == "fedrep"
        assert (strategy["head_epochs"], strategy["body_epochs"]) == (15, local_epochs)
        assert fine_tuning == []
    else:
        assert strategy["algorithm"] == "fedavg" and strategy["local_epochs"] == local_epochs
        assert [c["init_args"]["epochs"] for c in fine_tuning] == [15]
        assert rounds % trainer["check_val_every_n_epoch"] == 0  # the last round is evaluated
    assert "first_state" not in strategy  # "average" would average the heads into a released state
    model = recipe["model"]["init_args"]
    assert (model.pop("lr"), model.pop("momentum"), model.pop("weight_decay")) == (0.01, 0.9, 1e-4)
    assert (recipe["model"]["class_path"].rsplit(".", 1)[1], model) == MODEL[dataset]
    data = recipe["data"]
    assert data["class_path"].endswith(DATA_CLASS[dataset])
    assert (data["init_args"]["num_clients"], data["init_args"]["classes_per_client"]) == (n, s)
    assert data["init_args"]["batch_size"] == 100
    if dataset == "emnist":
        assert data["init_args"]["split"] == "digits"
    assert "Deviations from the official code:" in text
    if column in NUMBERS:
        number = NUMBERS[column][0 if method == "dp_fedrep" else 1]
        assert "Official number: " in text and f" {number}" in text
        assert f"paper {number}%" in text  # the Seeds table line `lightning-fedrep table` reads
    else:
        assert "has no numbers for this setting" in text


@pytest.mark.parametrize("method", ["dp_fedrep", "dp_fedavg_ft"])
def test_the_offline_digits_pair_runs_client_level_dp_on_every_client(method):
    """The digits pair (the CLI path of the CENTAUR recipes, smoke-run in test_cli.py): uniform weights, every
    client every round, a ClientLevelDP whose rounds are the Trainer's."""
    _, recipe = load(RECIPES / "digits" / f"{method}.yaml")
    strategy = recipe["trainer"]["strategy"]["init_args"]
    assert strategy["weighting"] == "uniform" and strategy["clients_per_round"] == 1.0
    privacy = strategy["privacy"]
    assert privacy["class_path"] == "lightning_fedrep.privacy.ClientLevelDP"
    assert privacy["init_args"]["rounds"] == recipe["trainer"]["max_epochs"]
