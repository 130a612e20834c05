"""The recipes of FLUTE's Table 1 baselines and of SRPFL's Figure 3 legend (issue 26).

Everything expected here is restated from the papers and the official code (shared/reference/flute.md §5.2,
§6.4 and §7.1; srpfl.md §1.10 and §2; ``RenpuLiu/flute``'s ``models/Update.py``, ``shenzebang/SRPFL``'s
``FEDAVG-ray.py``, ``LG-ray.py``, ``HFMAML-ray.py`` and ``experiments/full-participation/
fixed-computation-time/*.sh``), not read from ``recipes/generate.py``. The smoke runs (``fast_dev_run`` on
generated files of the real formats) are ``tests/test_recipes_vision.py::test_paper_recipe_smoke``.
"""

from pathlib import Path

import pytest
import yaml

import lightning_fedrep

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# FLUTE Table 1 (flute.md §7.1): columns (data set, N, S), and each baseline's mean ± std per column.
FLUTE_COLUMNS = (
    ("cifar10", 50, 2),
    ("cifar10", 50, 5),
    ("cifar10", 100, 2),
    ("cifar10", 100, 5),
    ("cifar100", 100, 5),
    ("cifar100", 100, 10),
    ("cifar100", 100, 20),
    ("cifar100", 100, 40),
)
FLUTE_TABLE = {
    "fedavg": ("34.460 ± 1.083", "47.217 ± 0.395", "41.584 ± 0.433", "51.876 ± 0.675")
    + ("20.212 ± 0.574", "31.533 ± 0.519", "34.659 ± 0.482", "32.902 ± 0.195"),
    "fedavg_ft": ("83.996 ± 0.948", "71.465 ± 0.701", "84.688 ± 0.437", "70.884 ± 0.697")
    + ("78.342 ± 0.574", "66.660 ± 0.370", "54.464 ± 0.178", "44.858 ± 0.119"),
    "lg_fedavg": ("82.724 ± 2.137", "61.820 ± 0.409", "83.019 ± 0.431", "62.957 ± 0.895")
    + ("72.526 ± 0.692", "53.526 ± 0.151", "34.445 ± 0.375", "22.702 ± 0.315"),
    "fedper": ("85.173 ± 1.082", "74.015 ± 0.724", "86.168 ± 0.703", "73.666 ± 0.281")
    + ("76.001 ± 0.454", "67.100 ± 0.229", "56.066 ± 0.389", "44.689 ± 0.411"),
    "fedrep": ("86.133 ± 0.775", "71.737 ± 0.296", "86.685 ± 0.766", "73.808 ± 0.561")
    + ("78.621 ± 0.159", "68.530 ± 0.255", "56.360 ± 0.245", "43.061 ± 0.476"),
    "fedrep_star": ("87.320 ± 1.485", "75.766 ± 0.220", "87.177 ± 0.489", "75.296 ± 0.505")
    + ("78.892 ± 0.410", "68.630 ± 0.705", "56.654 ± 0.609", "42.025 ± 0.404"),
    "fedrod": ("79.476 ± 2.966", "68.728 ± 1.750", "83.296 ± 1.545", "72.116 ± 0.788")
    + ("74.299 ± 0.338", "66.462 ± 0.284", "57.280 ± 0.105", "48.120 ± 0.186"),
    "fedcp": ("85.361 ± 1.605", "71.603 ± 0.885", "84.798 ± 0.489", "71.344 ± 0.587")
    + ("74.266 ± 0.559", "66.426 ± 0.372", "57.067 ± 0.483", "43.638 ± 0.415"),
}
FLUTE_ALGORITHM = {"fedavg_ft": "fedavg", "fedrep_star": "fedrep"}
# §5.2: LG, FedPer, FedRoD, FedCP (and FedAvg, assumed): 1 (CIFAR-10) / 5 (CIFAR-100) local epochs;
# FedRep: 1 + 1 / 5 + 5 (head + body), FedRep*: 10 + 1 / 10 + 5.
JOINT = {"cifar10": 1, "cifar100": 5}
FEDREP_HEAD = {"fedrep": {"cifar10": 1, "cifar100": 5}, "fedrep_star": {"cifar10": 10, "cifar100": 10}}
FLUTE_ROWS = [r for r in FLUTE_TABLE if FLUTE_ALGORITHM.get(r, r) in lightning_fedrep.ALGORITHMS]
FLUTE_CASES = [(c, r) for c in FLUTE_COLUMNS for r in FLUTE_ROWS]


def flute_path(column: tuple[str, int, int], row: str) -> Path:
    dataset, n, s = column
    return RECIPES / "flute" / f"{dataset}_{n}_{s}_{row}.yaml"


def load(path: Path) -> tuple[str, dict]:
    assert path.is_file(), f"no recipe {path.relative_to(RECIPES)}"
    text = path.read_text()
    return text, yaml.safe_load(text)


def test_flute_table_rows_have_recipes_in_every_column():
    """Catches: a baseline of FLUTE's table whose algorithm is registered but has no recipe in some column
    (e.g. the generator's baselines left out of ``all_recipes``, or FedRoD not picked up once registered)."""
    assert {"fedavg", "fedavg_ft", "lg_fedavg", "fedper", "fedrep", "fedrep_star"} <= set(FLUTE_ROWS)
    missing = [str(flute_path(c, r)) for c, r in FLUTE_CASES if not flute_path(c, r).is_file()]
    assert not missing, missing
    for row in set(FLUTE_TABLE) - set(FLUTE_ROWS):  # rows of unregistered algorithms: no recipe
        assert not list((RECIPES / "flute").glob(f"*_{row}.yaml")), row


@pytest.mark.parametrize(
    ("column", "row"), FLUTE_CASES, ids=[f"{c[0]}_{c[1]}_{c[2]}_{r}" for c, r in FLUTE_CASES]
)
def test_flute_baseline_recipe_runs_flutes_setting_with_the_rows_method(column, row):
    """Catches: a shifted or swapped paper number (e.g. the CIFAR-100 (100, 5) and (100, 10) cells swapped),
    a baseline off FLUTE's data, model or optimizer in its column (e.g. N=50 written as 100 clients, momentum
    0.9), local epochs off §5.2 (e.g. CIFAR-100 at 1 epoch, FedRep* with FedRep's 1 head epoch), LG sharing
    the wrong layers, or FedAvg-FT without its 10-epoch fine-tuning round."""
    text, recipe = load(flute_path(column, row))
    dataset, n, s = column
    paper = FLUTE_TABLE[row][FLUTE_COLUMNS.index(column)]
    assert text.startswith(
        f"# FLUTE paper (Liu, Shen & Yang, ICML 2024) Table 1, {dataset.upper()} (N={n} clients"
    )
    assert f" {paper} % mean client test accuracy" in text and f"paper {paper}%" in text
    # the same data, model and optimizer as FLUTE's recipe of the column: only the method differs
    _, flute = load(flute_path(column, "flute"))
    assert recipe["model"] == flute["model"] and recipe["data"] == flute["data"]
    assert recipe["model"]["init_args"] == {"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4}
    data = recipe["data"]["init_args"]
    assert (data["num_clients"], data["classes_per_client"], data["batch_size"]) == (n, s, 10)
    trainer = recipe["trainer"]
    assert trainer["max_epochs"] == 100
    strategy = trainer["strategy"]["init_args"]
    assert strategy["algorithm"] == FLUTE_ALGORITHM.get(row, row)
    assert strategy["clients_per_round"] == 0.1
    if row in FEDREP_HEAD:
        assert strategy["phases"] == [
            {"train": "head", "epochs": FEDREP_HEAD[row][dataset]},
            {"train": "body", "epochs": JOINT[dataset]},
        ]
    else:
        assert strategy["local_epochs"] == JOINT[dataset]
    if row == "lg_fedavg":
        assert strategy["head"] == ["fc2", "fc3"]  # the code's LG global keys
    fine_tuning = [c for c in trainer["callbacks"] if c["class_path"].endswith("HeadFineTuning")]
    if row == "fedavg_ft":
        assert fine_tuning == [
            {
                "class_path": "lightning_fedrep.callbacks.HeadFineTuning",
                "init_args": {"epochs": 10, "mode": "full"},
            }
        ]
        assert "figure finetune/val/acc;" in text
    else:
        assert fine_tuning == [] and "figure val/acc_last10;" in text
    assert not [c for c in trainer["callbacks"] if c["class_path"].endswith("NeuralCollapse")]


# SRPFL Figure 3 legend (srpfl.md §2) beyond FedRep(-SRPFL): (algorithm, doubling, fine-tuned evaluation).
SRPFL_LEGEND = {
    "lg_srpfl": ("lg_fedavg", True, True),
    "lg_fedavg": ("lg_fedavg", False, True),
    "flanp": ("fedavg", True, False),
    "flanp_ft": ("fedavg", True, True),
    "fedavg": ("fedavg", False, False),
    "fedavg_ft": ("fedavg", False, True),
    "hf_maml": ("hf_maml", False, False),
}
SRPFL_DATA = ("cifar10", "cifar100", "emnist", "femnist")
# the scripts' local_ep (FEDAVG_local_ep, LG_local_ep): 1 on CIFAR10, 5 on the others; HF-MAML reads
# args.local_ep (default 5) whatever HFMAML_local_ep says.
LOCAL_EP = {"cifar10": 1, "cifar100": 5, "emnist": 5, "femnist": 5}
LG_SHARED = {"cifar10": ["fc2", "fc3"], "cifar100": ["fc2", "fc3"]}  # MLP: layer_hidden2, layer_out
SRPFL_CASES = [
    (d, m) for d in SRPFL_DATA for m, spec in SRPFL_LEGEND.items() if spec[0] in lightning_fedrep.ALGORITHMS
]


def test_srpfl_legend_has_every_curve_for_every_data_set():
    """Catches: a Figure 3 legend curve without a recipe for some data set (e.g. the baselines generated for
    CIFAR10 only), or a registered legend algorithm left out."""
    assert {m for _, m in SRPFL_CASES} == set(SRPFL_LEGEND)  # fedavg, lg_fedavg and hf_maml are registered
    missing = [f"{d}_{m}" for d, m in SRPFL_CASES if not (RECIPES / "srpfl" / f"{d}_{m}.yaml").is_file()]
    assert not missing, missing


@pytest.mark.parametrize(("data", "method"), SRPFL_CASES, ids=[f"{d}_{m}" for d, m in SRPFL_CASES])
def test_srpfl_legend_recipe_follows_the_official_script(data, method):
    """Catches: FLANP without the doubling (or FedAvg with it), momentum 0.5 on FedAvg/LG (the official
    LocalUpdateFEDAVG/LG SGD has none), HF-MAML at lr 0.01 or off alpha 1e-2 / delta 1e-3, HF-MAML's ignored
    HFMAML_local_ep (1 on CIFAR10) used instead of local_ep 5, parts=3 at batch 10 (HFMAML's docstring pairs
    parts 3 with batch 3B), a -FT curve without its 10-epoch fine-tuning (or FLANP/FedAvg with it), LG sharing
    the wrong layers, or a recipe whose data or model differ from the same panel's FedRep recipe."""
    text, recipe = load(RECIPES / "srpfl" / f"{data}_{method}.yaml")
    algorithm, doubling, fine_tuned = SRPFL_LEGEND[method]
    assert text.startswith("# ") and "SRPFL paper Figure 3 (" in text.splitlines()[0]
    assert "seeds the paper averaged: 4" in text
    _, fedrep = load(RECIPES / "srpfl" / f"{data}_fedrep.yaml")
    assert recipe["data"] == fedrep["data"]
    assert recipe["model"]["class_path"] == fedrep["model"]["class_path"]
    trainer, model = recipe["trainer"], recipe["model"]["init_args"]
    assert trainer["max_epochs"] == 150
    strategy = trainer["strategy"]["init_args"]
    assert strategy["clients_per_round"] == 1.0
    callbacks = {c["class_path"].rsplit(".", 1)[1]: c.get("init_args") for c in trainer["callbacks"]}
    assert callbacks["ValidateAtRounds"] == {"every": 10, "last": 3}
    selection = callbacks["AdaptiveParticipation"]
    assert selection["initial_clients"] == (10 if doubling else None)
    assert selection["rounds_per_stage"] == 10
    assert selection["latency"]["init_args"] == {"rate": 1.0, "seed": 1}
    assert ("FineTunedEvaluation" in callbacks) == fine_tuned
    if fine_tuned:  # the official fine_tune: SGD momentum 0.5, weight decay 1e-4, lr 0.01, 10 epochs
        lg = {"cache_features": False} if algorithm == "lg_fedavg" else {}  # LG tunes below the shared layers
        assert callbacks["FineTunedEvaluation"] == {"epochs": 10, "optimizer": "sgd", **lg}
    assert model["momentum"] == 0.0
    if algorithm == "hf_maml":
        assert strategy["algorithm"] == {
            "class_path": "lightning_fedrep.HFMAML",
            "init_args": {"alpha": 0.01, "delta": 0.001, "parts": 1},
        }
        assert recipe["data"]["init_args"]["batch_size"] == 10  # parts 1: batch B
        assert (model["lr"], model["weight_decay"], strategy["local_epochs"]) == (0.1, 0.0, 5)
    else:
        assert strategy["algorithm"] == algorithm
        assert (model["lr"], model["weight_decay"]) == (0.01, 1e-4)
        assert strategy["local_epochs"] == LOCAL_EP[data]
    if algorithm == "lg_fedavg":
        assert strategy["head"] == LG_SHARED.get(data, ["layer_hidden2", "layer_out"])
        # LG-ray.py's local_heads alias net_glob's tensors: an untrained client's local part is the average
        assert strategy["first_state"] == "average"
    else:
        assert "first_state" not in strategy
