"""Writes the recipes of PFLlib's leaderboard setting: every registered algorithm on FMNIST, CIFAR-10 and
CIFAR-100, pathological and practical (Dirichlet 0.1) label skew.

    python recipes/generate.py          # rewrites every recipe, these included
    python recipes/generate.py --check  # exit 1 if a recipe differs from its table

The setting is PFLlib's (``TsingZ0/PFLlib``; ``shared/reference/baselines-2026.md`` §1, §13): the train and
test sets pooled and split over 20 clients by ``dataset/generate_*.py`` (``np.random.seed(1)``; ``pat``:
2 classes per client on FMNIST and CIFAR-10, 10 on CIFAR-100; ``dir``: Dirichlet α = 0.1), each client's
samples 75/25 train/test; every client every round, 2000 rounds, batch 10, plain SGD lr 0.005, 1 local epoch
(FedRep's head epochs: ``-pls`` 1), PFLlib's ``FedAvgCNN``, ``ToTensor + Normalize(0.5, 0.5)``, evaluation every
round on each client's 25%. Hyper-parameters: ``system/main.py``'s defaults where PFLlib has the algorithm and
its defaults do not switch the method off, else the package's registered defaults (each header says which).

PFLlib's leaderboard number is the *best round's* pooled accuracy (mean ± std over 3 runs); the headline here
stays the package's ``val/acc_last10``, and ``val/acc_weighted_best`` is PFLlib's figure (the header's
``Leaderboard:`` line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from writer import render, trainer_section  # recipes/, put on sys.path by recipes/generate.py


@dataclass(frozen=True)
class Data:
    """A data set: its data module, PFLlib's model arguments, the pathological classes per client and the
    leaderboard's column name (``None``: not on the leaderboard)."""

    label: str
    data_class: str
    model_args: dict
    classes_per_client: int  # PFLlib's generate_*.py class_per_client ('pat')
    script: str
    leaderboard: str | None


DATA = {
    "fmnist": Data(
        "FMNIST",
        "lightning_fedrep.data.vision.FashionMNISTDataModule",
        {"in_channels": 1, "num_classes": 10, "image_size": 28},
        2,
        "generate_FashionMNIST.py",
        "FMNIST",
    ),
    "cifar10": Data(
        "CIFAR-10",
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"in_channels": 3, "num_classes": 10, "image_size": 32},
        2,
        "generate_Cifar10.py",
        None,
    ),
    "cifar100": Data(
        "CIFAR-100",
        "lightning_fedrep.data.vision.CIFAR100DataModule",
        {"in_channels": 3, "num_classes": 100, "image_size": 32},
        10,
        "generate_Cifar100.py",
        "Cifar100",
    ),
}
SPLITS = {"pat": "pathological label skew", "dir01": "practical label skew (Dirichlet alpha 0.1)"}
ROUNDS = 2000


@dataclass(frozen=True)
class Method:
    """An algorithm in PFLlib's setting: its leaderboard row (``None``: not on it), the registered
    algorithm's arguments (``{}``: the registered instance by name) and where they come from."""

    label: str
    row: str | None
    args: dict = field(default_factory=dict)
    source: str = "the package's registered defaults (PFLlib has no such algorithm)"
    phases: tuple[dict, ...] = ()  # instead of local_epochs: 1
    class_path: str = ""  # lightning_fedrep.<Class>, when args are given


def _pfllib(text: str = "") -> str:
    return "PFLlib's system/main.py defaults" + (f" ({text})" if text else "")


METHODS = {
    "apfl": Method(
        "APFL",
        "APFL",
        source="the package's registered defaults (alpha 0.75, fixed); PFLlib's -al 1.0 is the start of an adaptive "
        "alpha, which this APFL does not learn",
    ),
    "ditto": Method(
        "Ditto",
        "Ditto",
        source="the package's registered default lam 1.0: PFLlib's -mu 0.0 leaves the personal models unpulled "
        "(Ditto = FedAvg + Local); personal epochs 1 (PFLlib's -pls 1)",
    ),
    "fed_mtl": Method(
        "Fed-MTL",
        None,
        source="the package's registered defaults (PFLlib's FedMTL is not on the leaderboard)",
    ),
    "fedadagrad": Method("FedAdagrad", None),
    "fedadam": Method("FedAdam", None),
    "fedala": Method(
        "FedALA",
        "FedALA",
        source=_pfllib("eta 1.0, rand_percent 80, layer_idx 2; the registered defaults are the same"),
    ),
    "fedas": Method(
        "FedAS",
        None,
        source="PFLlib's hard-coded alignment (lr 0.01, 1 epoch, batch 16), the registered defaults",
    ),
    "fedavg": Method("FedAvg", "FedAvg", source=_pfllib()),
    "fedbabu": Method(
        "FedBABU",
        "FedBABU",
        {"fine_tuning_epochs": 10},
        _pfllib(
            "-fte 10; the registered default is 5, the paper's); every evaluation fine-tunes each client for 10 epochs "
            "(PFLlib fine-tunes once, after the last round, and appends that evaluation to the rounds max() reads"
        ),
        class_path="lightning_fedrep.FedBABU",
    ),
    "fedbn": Method(
        "FedBN",
        None,
        source="PFLlib has no FedBN flags; FedAvgCNN has no BatchNorm, so FedBN is FedAvg here",
    ),
    "fedcac": Method(
        "FedCAC",
        None,
        source="the package's registered defaults (tau 0.5, beta 100): PFLlib's -tau 1.0 shares nothing and its -bt 0 "
        "fails FedCAC's beta >= 1 assertion",
    ),
    "fedcp": Method(
        "FedCP",
        "FedCP",
        {"lamda": 1.0},
        _pfllib("-lam 1.0; the registered default is 5.0"),
        class_path="lightning_fedrep.FedCP",
    ),
    "feddbe": Method(
        "FedDBE", "FedDBE", source=_pfllib("-mo 0.1, -klw 0.0; the registered defaults are the same")
    ),
    "fedpac": Method(
        "FedPAC",
        None,
        source=_pfllib(
            "-lam 1.0, the registered default; the package's FedPAC combines heads as the paper, not with "
            "PFLlib's head-order bugs"
        ),
    ),
    "fedper": Method("FedPer", "FedPer", source=_pfllib()),
    "fedproto": Method("FedProto", "FedProto", source=_pfllib("-lam 1.0, the registered default")),
    "fedprox": Method(
        "FedProx",
        "FedProx",
        source="the package's registered default mu 0.1: PFLlib's -mu 0.0 makes FedProx FedAvg",
    ),
    "fedrep": Method(
        "FedRep",
        "FedRep",
        source=_pfllib("-pls 1 head epoch, then 1 body epoch"),
        phases=({"train": "head", "epochs": 1}, {"train": "body", "epochs": 1}),
    ),
    "fedrod": Method("FedRoD", "FedRoD", source=_pfllib("no FedRoD flags; the registered defaults")),
    "fedyogi": Method("FedYogi", None),
    "gpfl": Method(
        "GPFL",
        "GPFL",
        {"lamda": 1.0, "mu": 0.0},
        _pfllib(
            "-lam 1.0, -mu 0.0; the registered defaults are lamda 0.01, mu 0.1, the GPFL README's for this CNN"
        ),
        class_path="lightning_fedrep.GPFL",
    ),
    "hf_maml": Method(
        "HF-MAML",
        None,
        source="the package's registered defaults (alpha 0.01, delta 0.001, parts 3: each batch of 10 in three parts)",
    ),
    "l2gd": Method("L2GD", None),
    "lg_fedavg": Method(
        "LG-FedAvg", None, source="PFLlib's LG-FedAvg shares the head fc (the model's declared head), as here"
    ),
    "local": Method("Local", None, source="PFLlib's Local: 1 epoch a round, nothing shared"),
    "per_fedavg": Method(
        "Per-FedAvg",
        "Per-FedAvg",
        source="the package's registered defaults: PFLlib's -bt 0.0 makes both of its steps use lr, a rule this "
        "Per-FedAvg does not have",
    ),
    "pfedme": Method(
        "pFedMe",
        "pFedMe",
        {"lam": 1.0, "inner_steps": 5, "personal_lr": 0.01, "beta": 1.0},
        _pfllib(
            "-lam 1.0, -K 5, -lrp 0.01); beta 1.0, the registered default: PFLlib's -bt 0.0 never moves the "
            "global model (the maintainer's example: -bt 1 -lam 15"
        ),
        class_path="lightning_fedrep.PFedMe",
    ),
    "scaffold": Method(
        "SCAFFOLD",
        None,
        {"lr_g": 1.0},
        _pfllib(
            "-slr 1.0; the registered default is 0.1); clip 10, the registered default (PFLlib does not clip"
        ),
        class_path="lightning_fedrep.Scaffold",
    ),
}
"""Every registered algorithm in PFLlib's setting (``_ddp`` names aside); recipes are written for those registered."""

LEADERBOARD: dict[tuple[str, str, str], str] = {}
"""PFLlib's number per (row, leaderboard column, split): best-round pooled accuracy, mean ± std over 3 runs."""
_ROWS = {  # FMNIST pat, Cifar100 pat, FMNIST dir 0.1, Cifar100 dir 0.1 (docs/benchmark.html, 4-layer CNN)
    "FedAvg": ("80.41 ± 0.08", "25.98 ± 0.13", "85.85 ± 0.19", "31.89 ± 0.47"),
    "FedProx": ("78.08 ± 0.15", "25.94 ± 0.16", "85.63 ± 0.57", "31.99 ± 0.41"),
    "Per-FedAvg": ("99.18 ± 0.08", "56.80 ± 0.26", "95.10 ± 0.10", "44.28 ± 0.33"),
    "pFedMe": ("99.35 ± 0.14", "58.20 ± 0.14", "97.25 ± 0.17", "47.34 ± 0.46"),
    "Ditto": ("99.44 ± 0.06", "67.23 ± 0.07", "97.47 ± 0.04", "52.87 ± 0.64"),
    "APFL": ("99.41 ± 0.02", "64.26 ± 0.13", "97.25 ± 0.08", "46.74 ± 0.60"),
    "FedALA": ("99.57 ± 0.01", "67.83 ± 0.06", "97.66 ± 0.02", "55.92 ± 0.03"),
    "FedPer": ("99.47 ± 0.03", "63.53 ± 0.21", "97.44 ± 0.06", "49.63 ± 0.54"),
    "FedRep": ("99.56 ± 0.03", "67.56 ± 0.31", "97.56 ± 0.04", "52.39 ± 0.35"),
    "FedRoD": ("99.52 ± 0.05", "62.30 ± 0.02", "97.52 ± 0.04", "50.94 ± 0.11"),
    "FedBABU": ("99.41 ± 0.05", "66.85 ± 0.07", "97.46 ± 0.07", "55.02 ± 0.33"),
    "FedCP": ("99.66 ± 0.04", "71.80 ± 0.16", "97.89 ± 0.05", "59.56 ± 0.08"),
    "GPFL": ("99.85 ± 0.08", "71.78 ± 0.26", "97.81 ± 0.09", "61.86 ± 0.31"),
    "FedDBE": ("99.74 ± 0.04", "73.38 ± 0.18", "97.69 ± 0.05", "64.39 ± 0.27"),
    "FedProto": ("99.49 ± 0.04", "69.18 ± 0.03", "97.40 ± 0.02", "52.70 ± 0.33"),
}
for _row, _numbers in _ROWS.items():
    for (_column, _split), _number in zip(
        (("FMNIST", "pat"), ("Cifar100", "pat"), ("FMNIST", "dir01"), ("Cifar100", "dir01")), _numbers
    ):
        LEADERBOARD[(_row, _column, _split)] = _number

FACTS: dict[str, tuple[str, str, str]] = {}
"""Per recipe file: what it reproduces, our headline figure, the paper's number (``recipes/README.md``)."""
BEST_ROUND: dict[str, str] = {}
"""Per recipe file: PFLlib's number (best round, pooled), or ``"not on the leaderboard"``."""


def leaderboard_number(data: str, split: str, method: str) -> str | None:
    """PFLlib's number for this cell, or ``None`` where the leaderboard has none."""
    row, column = METHODS[method].row, DATA[data].leaderboard
    if row is None or column is None:
        return None
    return LEADERBOARD[(row, column, split)]


def partitioner(data: str, split: str) -> dict:
    """PFLlib's clients: the pooled sets over 20 clients, seed 1 fixed (PFLlib generates them once)."""
    args: dict = {"num_clients": 20}
    if split == "pat":
        args.update(partition="pat", classes_per_client=DATA[data].classes_per_client)
    else:
        args.update(partition="dir", alpha=0.1)
    args["seed"] = 1
    return {"class_path": "lightning_fedrep.PFLlibPartitioner", "init_args": args}


def strategy(method: str) -> dict:
    spec = METHODS[method]
    algorithm: str | dict = method
    if spec.args:
        algorithm = {"class_path": spec.class_path, "init_args": dict(spec.args)}
    config: dict = {"algorithm": algorithm, "clients_per_round": 1.0, "seed": 1}
    if spec.phases:
        config["phases"] = [dict(p) for p in spec.phases]
    else:
        config["local_epochs"] = 1
    if method == "local":  # PFLlib's clients keep one optimizer for the run (plain SGD: no state to keep)
        config["client_optimizer_state"] = "keep"
    return config


def recipe(data: str, split: str, method: str) -> tuple[str, str]:
    setting, spec = DATA[data], METHODS[method]
    name = f"{data}_{split}_{method}"
    config = {
        "seed_everything": 1,
        "trainer": trainer_section("pfllib", f"pfllib-{name.replace('_', '-')}", ROUNDS, strategy(method)),
        "model": {
            "class_path": "lightning_fedrep.models.FedAvgCNN",
            "init_args": {**setting.model_args, "lr": 0.005, "momentum": 0.0, "weight_decay": 0.0},
        },
        "data": {
            "class_path": setting.data_class,
            "init_args": {
                "root": "data",
                "download": True,
                "batch_size": 10,
                "seed": 1,
                "preprocessing": "pfllib",
                "partitioner": partitioner(data, split),
            },
        },
    }
    number = leaderboard_number(data, split, method)
    if split == "pat":
        skew = f"pathological, {setting.classes_per_client} classes per client"
    else:
        skew = "practical, Dirichlet alpha 0.1"
    column = (
        f"{setting.leaderboard} column of the {'pathological' if split == 'pat' else 'practical'} label skew setting"
        if setting.leaderboard
        else "not a leaderboard column (CIFAR-10 in the leaderboard's setting)"
    )
    schedule = (
        "1 head epoch then 1 body epoch a round (PFLlib's -pls 1, -ls 1)"
        if spec.phases
        else "1 local epoch a round"
    )
    path = f"{name}.yaml"
    header = [
        f"PFLlib leaderboard (TsingZ0/PFLlib, docs/benchmark.html), {column}: {spec.label} on {setting.label}.",
        f"Setting: {setting.label} train and test sets pooled and split over 20 clients as PFLlib's {setting.script}",
        f"(np.random.seed(1); {skew}), each client's samples 75/25 train/test: PFLlibPartitioner(seed=1) gives",
        "PFLlib's exact clients. Every client every round, 2000 rounds, batch 10, plain SGD lr 0.005 (no momentum,",
        f"no weight decay), {schedule}; PFLlib's FedAvgCNN; ToTensor + Normalize(0.5, 0.5), no augmentation.",
        "Evaluation every round on each client's 25% test split.",
        "Not as PFLlib: an epoch's last partial batch is trained on (PFLlib's loader drops it); each evaluation follows",
        "the round's training (PFLlib scores the models it has just sent, before training, round 0 included).",
        f"{spec.label}: hyper-parameters from {spec.source}.",
        "Figures: our headline is val/acc_last10 (mean client accuracy over the last 10 rounds); PFLlib's number is",
        "the BEST round's pooled accuracy (correct / samples over all clients), val/acc_weighted_best here, mean ±",
        "std over 3 runs on one partition: picking the best of 2000 test evaluations overstates the accuracy.",
        f"Leaderboard: figure val/acc_weighted_best; PFLlib {number} (best round, pooled, 3 runs)"
        if number
        else "Leaderboard: figure val/acc_weighted_best; PFLlib: not on the leaderboard",
        f"Run: lightning-fedrep fit --config recipes/pfllib/{path} (--seeds 1,2,3: PFLlib's 3 runs; the partition",
        "keeps seed 1). 2000 rounds of 20 clients need a GPU; --data.init_args.download true fetches the data.",
    ]
    paper = (
        f"{number}% (PFLlib best round, pooled; ours: last 10)" if number else "not on PFLlib's leaderboard"
    )
    FACTS[path] = (
        f"PFLlib {setting.label} {'pat' if split == 'pat' else 'Dir(0.1)'}: {spec.label}",
        "`val/acc_last10`",
        paper,
    )
    BEST_ROUND[path] = f"{number}%" if number else "not on the leaderboard"
    return path, render("\n".join(header), config, generator="recipes/pfllib/generate.py")


def registered(algorithm: str) -> bool:
    from lightning_fedrep import ALGORITHMS

    return algorithm in ALGORITHMS


def all_recipes() -> dict[str, str]:
    """Every recipe of the setting, for each algorithm registered now."""
    methods = [m for m in METHODS if registered(m)]
    return dict(recipe(d, s, m) for d in DATA for s in SPLITS for m in methods)


README_SECTION = """
## PFLlib's leaderboard setting (`recipes/pfllib/`)

Every algorithm of the package in the setting of PFLlib's leaderboard (`TsingZ0/PFLlib`, `docs/benchmark.html`):
FMNIST, CIFAR-10 and CIFAR-100, pathological (`pat`) and Dirichlet 0.1 (`dir01`) label skew, 20 clients, the
train and test sets pooled and split 75/25 per client exactly as PFLlib's `generate_*.py` (seed 1), 2000 rounds.
Our headline stays `val/acc_last10` (the `Seeds table:` line); PFLlib's number is the best round's pooled
accuracy, `val/acc_weighted_best` (the header's `Leaderboard:` line), mean ± std over 3 runs
(`--seeds 1,2,3`). CIFAR-10 is not on the leaderboard; neither are the algorithms PFLlib lacks.

| recipe | reproduces | our headline | PFLlib (best round, pooled, 3 runs) | PFLlib's figure |
|---|---|---|---|---|
"""


def readme_section() -> str:
    """The recipes README's section for these recipes (call after :func:`all_recipes`)."""
    rows = [
        f"| `pfllib/{path}` | {FACTS[path][0]} | {FACTS[path][1]} | {BEST_ROUND[path]} | `val/acc_weighted_best` |"
        for path in sorted(FACTS)
    ]
    return README_SECTION + "\n".join(rows) + "\n"
