"""Writes every recipe YAML from one table of settings, so the recipes cannot drift apart.

    python recipes/generate.py          # rewrite recipes/*/*.yaml
    python recipes/generate.py --check  # exit 1 if a committed recipe differs (run by the tests)

Settings are the official FedRep code's (`lgcollins/FedRep`, see ../shared/reference/fedrep.md and
pfl-libraries.md §4): SGD lr 0.01, momentum 0.5, weight decay 1e-4 on weights, batch size 10,
participation 0.1, FedRep 10 head epochs + 1 body epoch (CIFAR-10 (100,2)) or + 5 (all others),
baselines with the same number of local epochs as FedRep's body epochs (the paper's rule), FedAvg + FT
fine-tuning only the head for 10 epochs in one extra round over all clients.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flute.generate import all_recipes as flute_recipes  # noqa: E402  (the FLUTE table lives beside its recipes)

# column: (folder, data class, data args, model class, LG-FedAvg's shared part, rounds, body epochs, Table 1 row)
TABLE1 = {
    "cifar10_100_2": (
        "cifar10",
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"num_clients": 100, "classes_per_client": 2},
        "lightning_fedrep.models.CIFAR10CNN",
        ["fc2", "fc3"],
        100,
        1,
        {
            "local": 89.79,
            "fedavg": 42.65,
            "fedavg_ft": 87.65,
            "lg_fedavg": 84.14,
            "fedper": 87.13,
            "fedrep": 87.70,
        },
    ),
    "cifar10_100_5": (
        "cifar10",
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"num_clients": 100, "classes_per_client": 5},
        "lightning_fedrep.models.CIFAR10CNN",
        ["fc2", "fc3"],
        100,
        5,
        {
            "local": 70.68,
            "fedavg": 51.78,
            "fedavg_ft": 73.68,
            "lg_fedavg": 63.02,
            "fedper": 73.84,
            "fedrep": 75.68,
        },
    ),
    "cifar10_1000_2": (
        "cifar10",
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"num_clients": 1000, "classes_per_client": 2},
        "lightning_fedrep.models.CIFAR10CNN",
        ["fc2", "fc3"],
        100,
        5,
        {
            "local": 78.30,
            "fedavg": 44.31,
            "fedavg_ft": 82.04,
            "lg_fedavg": 77.48,
            "fedper": 81.73,
            "fedrep": 83.27,
        },
    ),
    "cifar100_100_5": (
        "cifar100",
        "lightning_fedrep.data.vision.CIFAR100DataModule",
        {"num_clients": 100, "classes_per_client": 5},
        "lightning_fedrep.models.CIFAR100CNN",
        ["fc2", "fc3"],
        100,
        5,
        {
            "local": 75.29,
            "fedavg": 23.94,
            "fedavg_ft": 79.34,
            "lg_fedavg": 72.44,
            "fedper": 76.00,
            "fedrep": 79.15,
        },
    ),
    "cifar100_100_20": (
        "cifar100",
        "lightning_fedrep.data.vision.CIFAR100DataModule",
        {"num_clients": 100, "classes_per_client": 20},
        "lightning_fedrep.models.CIFAR100CNN",
        ["fc2", "fc3"],
        100,
        5,
        {
            "local": 41.29,
            "fedavg": 31.97,
            "fedavg_ft": 55.44,
            "lg_fedavg": 38.76,
            "fedper": 55.68,
            "fedrep": 56.10,
        },
    ),
    "femnist_150_3": (
        "femnist",
        "lightning_fedrep.data.leaf.LEAFDataModule",
        {"train_dir": "data/femnist/train", "test_dir": "data/femnist/test", "max_clients": 150},
        "lightning_fedrep.models.FEMNISTMLP",
        ["layer_hidden2", "layer_out"],
        200,
        5,
        {
            "local": 60.86,
            "fedavg": 51.64,
            "fedavg_ft": 72.41,
            "lg_fedavg": 62.08,
            "fedper": 76.91,
            "fedrep": 78.56,
        },
    ),
}

METHODS = {
    "fedrep": "FedRep: 10 head epochs (body frozen) then {body} body epoch(s) (head frozen); body averaged",
    "fedper": "FedPer: head and body trained jointly for {body} epoch(s); body averaged, heads local",
    "lg_fedavg": "LG-FedAvg: trained jointly for {body} epoch(s); {lg} averaged, the rest stays local",
    "fedavg": "FedAvg: one global model, {body} local epoch(s), everything averaged (global model evaluated)",
    "fedavg_ft": "FedAvg + FT: FedAvg, then one extra round in which every client fine-tunes only the head for 10 epochs",
    "local": "Local Only: no communication; every client trains its own model ({body} epoch(s) a round, all clients, "
    "{local_rounds} rounds = the expected local epochs of a client under 10% participation)",
}


def trainer_section(folder: str, name: str, rounds: int, strategy: dict, callbacks: list) -> dict:
    return {
        "accelerator": "auto",
        "devices": 1,
        "max_epochs": rounds,
        "check_val_every_n_epoch": 1,
        "num_sanity_val_steps": 0,
        "default_root_dir": f"runs/{folder}",
        "strategy": {"class_path": "lightning_fedrep.FedRepStrategy", "init_args": strategy},
        "logger": {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"project": "lightning-fedrep", "name": name, "save_dir": f"runs/{folder}"},
        },
        "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
            *callbacks,
            {"class_path": "lightning_fedrep.callbacks.RunSummary"},
        ],
    }


def table1_recipe(column: str, method: str) -> tuple[str, dict]:
    folder, data_class, data_args, model_class, lg_shared, rounds, body, paper = TABLE1[column]
    algorithm = "fedavg" if method == "fedavg_ft" else method
    strategy: dict = {"algorithm": algorithm, "clients_per_round": 0.1, "seed": 0}
    callbacks = []
    if method == "fedrep":
        strategy.update(head_epochs=10, body_epochs=body)
    else:
        strategy["local_epochs"] = body
    if method == "lg_fedavg":
        strategy["head"] = lg_shared
    if method == "fedavg_ft":
        callbacks.append(
            {
                "class_path": "lightning_fedrep.callbacks.HeadFineTuning",
                "init_args": {"epochs": 10, "mode": "head"},
            }
        )
    local_rounds = max(1, round(rounds * 0.1))
    if method == "local":
        strategy["clients_per_round"] = 1.0
        rounds = local_rounds
    name = f"{column}-{method}"
    recipe = {
        "seed_everything": 0,
        "trainer": trainer_section(folder, name, rounds, strategy, callbacks),
        "model": {
            "class_path": model_class,
            "init_args": {"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {"class_path": data_class, "init_args": {**data_args, "batch_size": 10, "seed": 0}},
    }
    if data_class.endswith(("CIFAR10DataModule", "CIFAR100DataModule")):
        recipe["data"]["init_args"]["root"] = "data"
        recipe["data"]["init_args"]["download"] = True
    n, s = column.rsplit("_", 2)[-2:]
    header = (
        f"FedRep paper Table 1, {folder.upper()} (n={n} clients, S={s} classes per client), r=0.1, T={TABLE1[column][5]} rounds.\n"
        + METHODS[method].format(body=body, lg="+".join(lg_shared), local_rounds=local_rounds)
        + f".\nPaper: {paper[method]:.2f}% mean client test accuracy (FedRep {paper['fedrep']:.2f}%)."
        + "\nThe paper's figure is the mean over the last 10 rounds: val/acc_last10 (validation runs on each client's"
        + "\ntest split, as the paper's code does)."
        + f"\nRun: lightning-fedrep fit --config recipes/{folder}/{column.split('_', 1)[1]}_{method}.yaml"
    )
    return f"{folder}/{column.split('_', 1)[1]}_{method}.yaml", {"_header": header, **recipe}


def digits_recipe(method: str) -> tuple[str, dict]:
    algorithm = "fedavg" if method == "fedavg_ft" else method
    strategy: dict = {"algorithm": algorithm, "clients_per_round": 0.5, "seed": 0}
    callbacks = []
    rounds = 30
    if method == "fedrep":
        strategy.update(head_epochs=5, body_epochs=1)
    else:
        strategy["local_epochs"] = 1
    if method == "lg_fedavg":
        strategy["head"] = ["body.2", "classifier"]
    if method == "fedavg_ft":
        callbacks.append(
            {
                "class_path": "lightning_fedrep.callbacks.HeadFineTuning",
                "init_args": {"epochs": 5, "mode": "head"},
            }
        )
    if method == "local":
        strategy["clients_per_round"] = 1.0
        rounds = 15
    trainer = trainer_section("digits", f"digits-{method}", rounds, strategy, callbacks)
    trainer["callbacks"] = trainer["callbacks"][1:]  # no checkpoints for the one-minute demo
    trainer["enable_checkpointing"] = False
    trainer["accelerator"] = "cpu"
    header = (
        "Offline demo on scikit-learn's handwritten digits: 20 clients with 2 classes each, "
        + ("every client each round" if method == "local" else "half of them per round")
        + ", a 64-64-32-10 MLP.\n"
        + METHODS[method]
        .format(body=1, lg="body.2+classifier", local_rounds=rounds)
        .replace("10 head epochs", "5 head epochs")
        + ".\nNot a paper setting: a small, real, offline stand-in that runs in about a minute on 2 CPU cores."
        + f"\nRun: lightning-fedrep fit --config recipes/digits/{method}.yaml"
    )
    recipe = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {
            "class_path": "lightning_fedrep.models.MLPClassifier",
            "init_args": {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": "lightning_fedrep.data.digits.DigitsDataModule",
            "init_args": {"num_clients": 20, "classes_per_client": 2, "batch_size": 10, "seed": 0},
        },
    }
    return f"digits/{method}.yaml", {"_header": header, **recipe}


LINEAR = {
    "fedrep": (
        "FedRep (Algorithm 2): exact least-squares head, then one full-batch gradient step on the body",
        [{"train": "head", "steps": 1}, {"train": "body", "steps": 1}],
        "dist(B, B*) ~2e-4 by round 200 (Fig. 3); val/loss (MSE) near the noise floor",
    ),
    "fedavg": (
        "FedAvg: one full-batch gradient step on the shared (B, w) per client, everything averaged",
        [{"train": "all", "steps": 1}],
        "stays far from B* (dist ~1), val/loss (MSE) ~2, i.e. the paper's 1/2 MSE ~1 (Fig. 1); measured 1.95",
    ),
    "local": (
        "Local Only: every client fits its own (B, w) by gradient steps on its 10 samples, no communication",
        [{"train": "all", "steps": 1}],
        "val/loss far above FedRep's: m=10 < d=20 samples cannot pin down a 20-dim model (Fig. 1)",
    ),
}


def linear_recipe(method: str) -> tuple[str, dict]:
    description, phases, expected = LINEAR[method]
    strategy = {
        "algorithm": method,
        "clients_per_round": 1.0 if method == "local" else 10,
        "phases": phases,
        "weighting": "uniform",
        "seed": 0,
    }
    trainer = trainer_section("synthetic", f"synthetic-{method}-linear", 200, strategy, [])
    trainer["callbacks"] = trainer["callbacks"][1:]
    trainer.update(accelerator="cpu", enable_checkpointing=False, check_val_every_n_epoch=20)
    header = (
        "FedRep paper Sec. 5.1: low-rank linear regression, d=20, k=2, n=100 clients with m=10 samples each,\n"
        "noise std 1e-3, method-of-moments init, 10% participation (Local Only: all clients, random init,\n"
        "no communication).\n"
        f"{description}.\nExpected: {expected}; watch val/principal_angle and val/loss (MSE).\n"
        f"Run: lightning-fedrep fit --config recipes/synthetic/{method}_linear.yaml"
    )
    recipe = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {
            "class_path": "lightning_fedrep.models.LowRankLinear",
            "init_args": {
                "dim": 20,
                "rank": 2,
                "lr": 0.1,
                "exact_head": method == "fedrep",
                "init": "random" if method == "local" else "mom",
            },
        },
        "data": {
            "class_path": "lightning_fedrep.data.low_rank.LowRankLinearDataModule",
            "init_args": {
                "dim": 20,
                "rank": 2,
                "num_clients": 100,
                "samples_per_client": 10,
                "test_samples_per_client": 50,
                "noise_std": 1.0e-3,
                "seed": 0,
            },
        },
    }
    return f"synthetic/{method}_linear.yaml", {"_header": header, **recipe}


SRPFL = {"fedrep": "FedRep-SRPFL", "lg_fedavg": "LG-SRPFL", "fedavg": "FLANP"}


def srpfl_recipe(algorithm: str) -> tuple[str, dict]:
    """Digits, full participation, the n fastest clients (n = 5, doubling every 5 rounds), simulated
    Exp(1) client speeds (the SRPFL paper's fixed model); sim/time is the simulated clock."""
    name = SRPFL[algorithm]
    path, recipe = digits_recipe(algorithm)
    strategy = recipe["trainer"]["strategy"]["init_args"]
    strategy["clients_per_round"] = 1.0
    recipe["trainer"]["max_epochs"] = 30
    recipe["trainer"]["logger"]["init_args"]["name"] = f"digits-{name.lower()}"
    participation = {
        "class_path": "lightning_fedrep.callbacks.AdaptiveParticipation",
        "init_args": {
            "initial_clients": 5,
            "rounds_per_stage": 5,
            "latency": {
                "class_path": "lightning_fedrep.callbacks.FixedExponential",
                "init_args": {"rate": 1.0, "seed": 1},
            },
            "communication_cost": 0.0,
        },
    }
    recipe["trainer"]["callbacks"].insert(0, participation)
    recipe["_header"] = (
        f"{name} (SRPFL paper): {algorithm} on the digits (20 clients, 2 classes each), every client in the pool;\n"
        "each round only the n fastest train, n = 5 doubling every 5 rounds (capped at 20). Client speeds are\n"
        "simulated, drawn once from Exp(1) (the paper's fixed model; drop `latency` to measure real step times).\n"
        "Plot val/acc against sim/time (the simulated clock) and compare with initial_clients: null (no selection).\n"
        f"Run: lightning-fedrep fit --config recipes/srpfl/digits_{algorithm}.yaml"
    )
    return f"srpfl/digits_{algorithm}.yaml", recipe


def render(recipe: dict) -> str:
    recipe = dict(recipe)
    header = recipe.pop("_header")
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return (
        comment
        + "# Generated by recipes/generate.py; edit the table there, not this file.\n"
        + yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False)
    )


def all_recipes() -> dict[str, str]:
    recipes = [digits_recipe(m) for m in METHODS] + [table1_recipe(c, m) for c in TABLE1 for m in METHODS]
    recipes += [linear_recipe(m) for m in LINEAR]
    recipes += [srpfl_recipe(a) for a in SRPFL]
    texts = {path: render(recipe) for path, recipe in recipes}
    texts.update({f"flute/{path}": text for path, text in flute_recipes().items()})
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed recipe differs")
    args = parser.parse_args()
    stale = []
    for path, text in all_recipes().items():
        target = HERE / path
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(path)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    if stale:
        print(
            "Recipes differ from recipes/generate.py; run `python recipes/generate.py`:", *stale, sep="\n  "
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
