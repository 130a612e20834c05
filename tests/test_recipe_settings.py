"""The paper recipes use the official code's settings of issue 27, and their headers say so.

Restated here from the official code (not read from ``recipes/generate.py``): ``sampling.py`` deals a
shuffled multiset of class slots (``assignment: official``); clients alias the global model into which
every key is averaged (``first_state: average``, for the methods with a local part that trains); the
official CIFAR FedAvg + FT round fine-tunes every layer (``mode: full``); ``main_local.py`` trains 10 epochs
and scores the first min(100, n) clients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PAPER = sorted(
    p
    for folder in ("cifar10", "cifar100", "femnist", "flute", "srpfl")
    for p in (RECIPES / folder).glob("*.yaml")
    if not p.name.startswith("digits_")
)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_paper_recipes_deal_classes_and_start_clients_as_the_official_code(path):
    """Catches a paper recipe that deals distinct classes or starts untrained clients from the initial
    head without its header saying so."""
    text = path.read_text()
    recipe = yaml.safe_load(text)
    data = recipe["data"]["init_args"]
    strategy = recipe["trainer"]["strategy"]["init_args"]
    if "classes_per_client" in data:
        assert data["assignment"] == "official" and "assignment: official" in text
    trains_local_part = strategy["algorithm"] in ("fedrep", "fedper", "lg_fedavg")
    if trains_local_part:
        assert strategy["first_state"] == "average" and "first_state: average" in text
    else:
        assert "first_state" not in strategy


@pytest.mark.parametrize("folder", ["cifar10", "cifar100", "femnist"])
def test_fedavg_ft_and_local_only_recipes_say_which_protocol_they_run(folder):
    """Catches: the CIFAR FedAvg + FT recipes fine-tuning only the head (the official code trains every
    layer), or Local Only recipes not running main_local.py (1 round of 10 epochs, 100 clients scored)
    with the paper's-text reading kept beside them as ``*_local_paper.yaml``."""
    for path in sorted((RECIPES / folder).glob("*_fedavg_ft.yaml")):
        text = path.read_text()
        (callback,) = (
            c
            for c in yaml.safe_load(text)["trainer"]["callbacks"]
            if c["class_path"].endswith("HeadFineTuning")
        )
        mode = "head" if folder == "femnist" else "full"
        assert callback["init_args"]["mode"] == mode and f"HeadFineTuning mode: {mode}" in text
    for path in sorted((RECIPES / folder).glob("*_local.yaml")):
        recipe = yaml.safe_load(path.read_text())
        strategy = recipe["trainer"]["strategy"]["init_args"]
        assert recipe["trainer"]["max_epochs"] == 1
        assert (strategy["local_epochs"], strategy["evaluate_clients"]) == (10, 100)
        assert path.with_name(path.stem + "_paper.yaml").is_file()
