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

from dataclasses import dataclass

from writer import render, trainer_section  # recipes/, put on sys.path by recipes/generate.py


@dataclass(frozen=True)
class Column:
    """One column of Table 1: the data set, ``n`` clients with ``s`` classes each, and the paper's
    FLUTE and FLUTE* results (mean ± std %)."""

    dataset: str
    n: int
    s: int
    flute: str
    flute_star: str


COLUMNS = {
    "cifar10_50_2": Column("cifar10", n=50, s=2, flute="87.012 ± 0.453", flute_star="87.713 ± 1.365"),
    "cifar10_50_5": Column("cifar10", n=50, s=5, flute="76.478 ± 0.484", flute_star="76.543 ± 0.921"),
    "cifar10_100_2": Column("cifar10", n=100, s=2, flute="86.128 ± 1.007", flute_star="88.567 ± 0.457"),
    "cifar10_100_5": Column("cifar10", n=100, s=5, flute="76.918 ± 0.712", flute_star="78.255 ± 0.688"),
    "cifar100_100_5": Column("cifar100", n=100, s=5, flute="77.750 ± 0.615", flute_star="79.560 ± 0.627"),
    "cifar100_100_10": Column("cifar100", n=100, s=10, flute="70.598 ± 0.282", flute_star="70.844 ± 0.419"),
    "cifar100_100_20": Column("cifar100", n=100, s=20, flute="59.243 ± 0.334", flute_star="59.714 ± 0.448"),
    "cifar100_100_40": Column("cifar100", n=100, s=40, flute="48.169 ± 0.597", flute_star="48.170 ± 0.440"),
}


@dataclass(frozen=True)
class Dataset:
    """A data set's data module, its FedRep CNN and FLUTE's joint epochs per round on it."""

    data_class: str
    model_class: str
    joint_epochs: int


DATA = {
    "cifar10": Dataset(
        data_class="lightning_fedrep.data.vision.CIFAR10DataModule",
        model_class="lightning_fedrep.models.CIFAR10CNN",
        joint_epochs=1,
    ),
    "cifar100": Dataset(
        data_class="lightning_fedrep.data.vision.CIFAR100DataModule",
        model_class="lightning_fedrep.models.CIFAR100CNN",
        joint_epochs=5,
    ),
}
VARIANTS = ("flute", "flute_star")
FACTS: dict[str, tuple[str, str, str]] = {}
"""Per recipe file: what it reproduces, the figure to read, the paper's number (``recipes/README.md``)."""


def recipe(column: str, variant: str) -> tuple[str, str]:
    setting = COLUMNS[column]
    dataset, n, s = setting.dataset, setting.n, setting.s
    data = DATA[dataset]
    joint = data.joint_epochs
    phases = [{"train": "all", "epochs": joint}]
    if variant == "flute_star":
        phases.insert(0, {"train": "head", "epochs": 10})
    callback: dict = {"server_step": True, "server_lr": 0.5, "lam": 0.25, "mu": 0.0025, "nu": 0.0005}
    callback["local_classes"] = s  # Averaged Local NC2 with the code's S = shard_per_user
    if dataset == "cifar100":
        callback["features_module"] = "drop"  # φ(X) before the dropout, as the official code
    strategy = {
        "algorithm": "fedrep",
        "clients_per_round": 0.1,
        "seed": 0,
        "phases": phases,
        "first_state": "average",  # the official code's aliasing of w_locals to the global model
    }
    collapse = {"class_path": "lightning_fedrep.callbacks.NeuralCollapse", "init_args": callback}
    config = {
        "seed_everything": 0,
        "trainer": trainer_section(f"flute/{column}", f"flute-{column}-{variant}", 100, strategy, [collapse]),
        "model": {
            "class_path": data.model_class,
            "init_args": {"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": data.data_class,
            "init_args": {
                "num_clients": n,
                "classes_per_client": s,
                "batch_size": 10,
                "seed": 0,
                "root": "data",
                "download": True,
                "assignment": "official",  # sampling.py's shuffled multiset of class slots
            },
        },
    }
    label = "FLUTE" if variant == "flute" else "FLUTE*"
    schedule = (
        f"{joint} joint epoch(s) (body and head) per round"
        if variant == "flute"
        else f"10 head-only epochs, then {joint} joint epoch(s) per round (the code's order)"
    )
    paper_flute, paper_star = setting.flute, setting.flute_star
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
        "As the official code: classes dealt as its sampling.py (assignment: official: a client may draw a class",
        "twice); a client that has not trained starts from the average of every head (first_state: average).",
        *(
            [
                "Not as the official code: no m_tr=500 cap. The code keeps the first 500 samples of a client's dealt",
                "shards: at N=50 (shards of 500 on CIFAR-10) that is its first-drawn class only, which cannot give the",
                "paper's accuracy on its test classes; data max_train_samples: 500 caps at a random 500 instead.",
            ]
            if n == 50
            else []
        ),
        "Not as the official code: no extra all-client head fine-tuning round (the code's, excluded from its figure).",
        f"Run: lightning-fedrep fit --config recipes/flute/{path}",
    ]
    FACTS[path] = (
        f"FLUTE Table 1, {dataset.upper()} ({n}, {s}): {label}",
        "`val/acc_last10`",
        f"{paper_flute if variant == 'flute' else paper_star}%",
    )
    return path, render("\n".join(header), config, generator="recipes/flute/generate.py")


def all_recipes() -> dict[str, str]:
    return dict(recipe(c, v) for c in COLUMNS for v in VARIANTS)
