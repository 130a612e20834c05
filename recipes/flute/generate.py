"""Writes the FLUTE / FLUTE* recipes for the 8 columns of Table 1 of Liu, Shen & Yang (ICML 2024).

    python recipes/generate.py          # rewrites every recipe, these included
    python recipes/generate.py --check  # exit 1 if a recipe differs from its table

Settings are the official code's (``RenpuLiu/flute``, a fork of ``lgcollins/FedRep``; see
``shared/reference/flute.md`` §4 and §6): the FedRep CNNs, SGD lr 0.01, momentum 0.5, weight decay 1e-4
on weights, batch size 10, participation 0.1, 100 rounds, the loss
``CE + 0.25 R(W_i) + 0.0025 ||W_i||^2 (+ 0.0005 ||φ(X)||^2 in joint epochs)`` and the server NC step
(lr 0.5) that the code's README example turns on. Local epochs (§4.4):

* FLUTE: CIFAR-10 1 joint epoch, CIFAR-100 5 joint epochs;
* FLUTE*: 10 head-only epochs first (the code's order; the paper's text puts them last), then the
  same joint epochs.
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

# column: (dataset, N clients, S classes per client, paper FLUTE, paper FLUTE*)  (Table 1, mean ± std %)
COLUMNS = {
    "cifar10_50_2": ("cifar10", 50, 2, "87.012 ± 0.453", "87.713 ± 1.365"),
    "cifar10_50_5": ("cifar10", 50, 5, "76.478 ± 0.484", "76.543 ± 0.921"),
    "cifar10_100_2": ("cifar10", 100, 2, "86.128 ± 1.007", "88.567 ± 0.457"),
    "cifar10_100_5": ("cifar10", 100, 5, "76.918 ± 0.712", "78.255 ± 0.688"),
    "cifar100_100_5": ("cifar100", 100, 5, "77.750 ± 0.615", "79.560 ± 0.627"),
    "cifar100_100_10": ("cifar100", 100, 10, "70.598 ± 0.282", "70.844 ± 0.419"),
    "cifar100_100_20": ("cifar100", 100, 20, "59.243 ± 0.334", "59.714 ± 0.448"),
    "cifar100_100_40": ("cifar100", 100, 40, "48.169 ± 0.597", "48.170 ± 0.440"),
}
DATA = {
    "cifar10": ("lightning_fedrep.data.vision.CIFAR10DataModule", "lightning_fedrep.models.CIFAR10CNN", 1),
    "cifar100": ("lightning_fedrep.data.vision.CIFAR100DataModule", "lightning_fedrep.models.CIFAR100CNN", 5),
}
VARIANTS = ("flute", "flute_star")


def recipe(column: str, variant: str) -> tuple[str, str]:
    dataset, n, s, paper_flute, paper_star = COLUMNS[column]
    data_class, model_class, joint = DATA[dataset]
    phases = [{"train": "all", "epochs": joint}]
    if variant == "flute_star":
        phases.insert(0, {"train": "head", "epochs": 10})
    callback: dict = {"server_step": True, "server_lr": 0.5, "lam": 0.25, "mu": 0.0025, "nu": 0.0005}
    callback["local_classes"] = s  # Averaged Local NC2 with the code's S = shard_per_user
    if dataset == "cifar100":
        callback["features_module"] = "drop"  # φ(X) before the dropout, as the official code
    name = f"flute-{column}-{variant}"
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "auto",
            "devices": 1,
            "max_epochs": 100,
            "check_val_every_n_epoch": 1,
            "num_sanity_val_steps": 0,
            "default_root_dir": f"runs/flute/{column}",
            "strategy": {
                "class_path": "lightning_fedrep.FedRepStrategy",
                "init_args": {"algorithm": "fedrep", "clients_per_round": 0.1, "seed": 0, "phases": phases},
            },
            "logger": {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {
                    "project": "lightning-fedrep",
                    "name": name,
                    "save_dir": f"runs/flute/{column}",
                },
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"save_last": True},
                },
                {"class_path": "lightning_fedrep.callbacks.NeuralCollapse", "init_args": callback},
                {"class_path": "lightning_fedrep.callbacks.RunSummary"},
            ],
        },
        "model": {
            "class_path": model_class,
            "init_args": {"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": data_class,
            "init_args": {
                "num_clients": n,
                "classes_per_client": s,
                "batch_size": 10,
                "seed": 0,
                "root": "data",
                "download": True,
            },
        },
    }
    label = "FLUTE" if variant == "flute" else "FLUTE*"
    schedule = (
        f"{joint} joint epoch(s) (body and head) per round"
        if variant == "flute"
        else f"10 head-only epochs, then {joint} joint epoch(s) per round (the code's order)"
    )
    path = f"{column}_{variant}.yaml"
    header = [
        f"FLUTE paper (Liu, Shen & Yang, ICML 2024) Table 1, {dataset.upper()} (N={n} clients, S={s} classes "
        "per client), participation 0.1, 100 rounds.",
        f"{label}: {schedule}; loss CE + 0.25 R(W_i) + 0.0025 ||W_i||^2 (+ 0.0005 ||phi(X)||^2 in joint epochs);",
        "server NC step (lr 0.5) on the participants' heads after aggregation; body averaged, heads local.",
        f"Paper: {label} {paper_flute if variant == 'flute' else paper_star} % mean client test accuracy "
        f"(FLUTE {paper_flute}, FLUTE* {paper_star}).",
        "The paper's figure is the mean over the last 10 rounds: val/acc_last10. NC metrics: nc/global_nc2,",
        "nc/local_nc2, nc/nc1, nc/nc3 (NeuralCollapse callback).",
        "Not as the official code: every client uses all its shard samples (the code caps at m_tr=500, which",
        "matters for N=50); no extra all-client head fine-tuning round (the code's, excluded from its figure).",
        f"Run: lightning-fedrep fit --config recipes/flute/{path}",
        "Generated by recipes/flute/generate.py; edit the table there, not this file.",
    ]
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(
        config, sort_keys=False, default_flow_style=False
    )
    return path, text


def all_recipes() -> dict[str, str]:
    return dict(recipe(c, v) for c in COLUMNS for v in VARIANTS)
