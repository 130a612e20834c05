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


M_TR_NOTE = [
    "Not as the official code: no m_tr=500 cap. The code keeps the first 500 samples of a client's dealt",
    "shards: at N=50 (shards of 500 on CIFAR-10) that is its first-drawn class only, which cannot give the",
    "paper's accuracy on its test classes; data max_train_samples: 500 caps at a random 500 instead.",
]
"""The header lines of the N=50 columns (FLUTE's and the baselines')."""


def model_and_data(column: str) -> dict:
    """The ``model`` and ``data`` sections of every recipe of ``column`` (FLUTE's and the baselines'): the CNN with
    SGD (lr 0.01, momentum 0.5, weight decay 1e-4) and the column's N clients x S classes, batch 10."""
    setting = COLUMNS[column]
    data = DATA[setting.dataset]
    return {
        "model": {
            "class_path": data.model_class,
            "init_args": {"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": data.data_class,
            "init_args": {
                "num_clients": setting.n,
                "classes_per_client": setting.s,
                "batch_size": 10,
                "seed": 0,
                "root": "data",
                "download": True,
                "assignment": "official",  # sampling.py's shuffled multiset of class slots
            },
        },
    }


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
        **model_and_data(column),
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
        *(M_TR_NOTE if n == 50 else []),
        "Not as the official code: no extra all-client head fine-tuning round (the code's, excluded from its figure).",
        f"Run: lightning-fedrep fit --config recipes/flute/{path}",
    ]
    FACTS[path] = (
        f"FLUTE Table 1, {dataset.upper()} ({n}, {s}): {label}",
        "`val/acc_last10`",
        f"{paper_flute if variant == 'flute' else paper_star}%",
    )
    return path, render("\n".join(header), config, generator="recipes/flute/generate.py")


PAPER_BASELINES: dict[str, tuple[str, ...]] = {
    "fedavg": (
        "34.460 ± 1.083",
        "47.217 ± 0.395",
        "41.584 ± 0.433",
        "51.876 ± 0.675",
        "20.212 ± 0.574",
        "31.533 ± 0.519",
        "34.659 ± 0.482",
        "32.902 ± 0.195",
    ),
    "fedavg_ft": (
        "83.996 ± 0.948",
        "71.465 ± 0.701",
        "84.688 ± 0.437",
        "70.884 ± 0.697",
        "78.342 ± 0.574",
        "66.660 ± 0.370",
        "54.464 ± 0.178",
        "44.858 ± 0.119",
    ),
    "lg_fedavg": (
        "82.724 ± 2.137",
        "61.820 ± 0.409",
        "83.019 ± 0.431",
        "62.957 ± 0.895",
        "72.526 ± 0.692",
        "53.526 ± 0.151",
        "34.445 ± 0.375",
        "22.702 ± 0.315",
    ),
    "fedper": (
        "85.173 ± 1.082",
        "74.015 ± 0.724",
        "86.168 ± 0.703",
        "73.666 ± 0.281",
        "76.001 ± 0.454",
        "67.100 ± 0.229",
        "56.066 ± 0.389",
        "44.689 ± 0.411",
    ),
    "fedrep": (
        "86.133 ± 0.775",
        "71.737 ± 0.296",
        "86.685 ± 0.766",
        "73.808 ± 0.561",
        "78.621 ± 0.159",
        "68.530 ± 0.255",
        "56.360 ± 0.245",
        "43.061 ± 0.476",
    ),
    "fedrep_star": (
        "87.320 ± 1.485",
        "75.766 ± 0.220",
        "87.177 ± 0.489",
        "75.296 ± 0.505",
        "78.892 ± 0.410",
        "68.630 ± 0.705",
        "56.654 ± 0.609",
        "42.025 ± 0.404",
    ),
    "fedrod": (
        "79.476 ± 2.966",
        "68.728 ± 1.750",
        "83.296 ± 1.545",
        "72.116 ± 0.788",
        "74.299 ± 0.338",
        "66.462 ± 0.284",
        "57.280 ± 0.105",
        "48.120 ± 0.186",
    ),
    "fedcp": (
        "85.361 ± 1.605",
        "71.603 ± 0.885",
        "84.798 ± 0.489",
        "71.344 ± 0.587",
        "74.266 ± 0.559",
        "66.426 ± 0.372",
        "57.067 ± 0.483",
        "43.638 ± 0.415",
    ),
}
"""The other rows of Table 1 (shared/reference/flute.md §7.1), in the column order of :data:`COLUMNS`."""


@dataclass(frozen=True)
class Baseline:
    """A baseline row of Table 1: its label, the registered algorithm that runs it and its header line
    (``{joint}``: the data set's joint epochs, FLUTE's; ``{head}``: FedRep's head epochs)."""

    label: str
    algorithm: str
    description: str
    head_epochs: dict[str, int] | None = None  # FedRep's head epochs per data set (then body = joint)
    fine_tune: bool = False  # FedAvg-FT: one extra all-client round of 10 epochs after the last
    aliased: bool = True  # first_state: average (the official w_locals aliasing), for split algorithms


BASELINES = {
    "fedavg": Baseline(
        "FedAvg",
        "fedavg",
        "one global model, {joint} local epoch(s), everything averaged (global model evaluated)",
        aliased=False,
    ),
    "fedavg_ft": Baseline(
        "FedAvg-FT",
        "fedavg",
        "FedAvg ({joint} local epoch(s)), then one extra round in which every client fine-tunes every layer for\n"
        "10 epochs (HeadFineTuning mode: full)",
        fine_tune=True,
        aliased=False,
    ),
    "lg_fedavg": Baseline(
        "Fed-LG",
        "lg_fedavg",
        "LG-FedAvg, trained jointly for {joint} epoch(s); fc2+fc3 averaged, conv1, conv2, fc1 local",
    ),
    "fedper": Baseline(
        "FedPer", "fedper", "head and body trained jointly for {joint} epoch(s); body averaged, heads local"
    ),
    "fedrep": Baseline(
        "FedRep",
        "fedrep",
        "{head} head epoch(s) (body frozen), then {joint} body epoch(s) (head frozen); body averaged, heads local",
        head_epochs={"cifar10": 1, "cifar100": 5},
    ),
    "fedrep_star": Baseline(
        "FedRep*",
        "fedrep",
        "FedRep with more head updates: {head} head epochs, then {joint} body epoch(s); body averaged, heads local",
        head_epochs={"cifar10": 10, "cifar100": 10},
    ),
    "fedrod": Baseline(
        "FedRoD",
        "fedrod",
        "generic + personalized heads on a shared body, {joint} local epoch(s)",
        aliased=False,
    ),
    "fedcp": Baseline(
        "FedCP",
        "fedcp",
        "a conditional policy network in the local model, {joint} local epoch(s)",
        aliased=False,
    ),
}
"""Table 1's baselines; a row's recipes are written only for algorithms registered when the generator runs."""
FINE_TUNE_NOTE = (
    "Fine-tuning: every layer (HeadFineTuning mode: full), as the official code's last round (its freeze test\n"
    "compares names with a list of lists and never matches); the paper does not describe FedAvg-FT: set mode: head\n"
    "for the head-only reading. Its figure: finetune/val/acc (after the extra round); val/acc_last10 is FedAvg's."
)


def registered(algorithm: str) -> bool:
    """Whether ``algorithm`` is in the package's registry (importing ``lightning_fedrep`` registers them)."""
    from lightning_fedrep import ALGORITHMS

    return algorithm in ALGORITHMS


def baseline_strategy(spec: Baseline, dataset: str, joint: int) -> dict:
    """The strategy's arguments of baseline ``spec`` on ``dataset`` (``joint``: FLUTE's local epochs there)."""
    strategy: dict = {"algorithm": spec.algorithm, "clients_per_round": 0.1, "seed": 0}
    if spec.head_epochs:
        strategy["phases"] = [
            {"train": "head", "epochs": spec.head_epochs[dataset]},
            {"train": "body", "epochs": joint},
        ]
    else:
        strategy["local_epochs"] = joint
    if spec.algorithm == "lg_fedavg":
        strategy["head"] = ["fc2", "fc3"]  # the code's LG global keys
    if spec.aliased:
        strategy["first_state"] = "average"
    return strategy


def baseline_recipe(column: str, name: str) -> tuple[str, str]:
    """Baseline ``name`` of Table 1 in ``column``: FLUTE's data, model, optimizer and schedule, another method."""
    setting, spec = COLUMNS[column], BASELINES[name]
    dataset, n, s = setting.dataset, setting.n, setting.s
    data = DATA[dataset]
    joint = data.joint_epochs
    strategy = baseline_strategy(spec, dataset, joint)
    callbacks = []
    if spec.fine_tune:
        callbacks.append(
            {
                "class_path": "lightning_fedrep.callbacks.HeadFineTuning",
                "init_args": {"epochs": 10, "mode": "full"},
            }
        )
    config = {
        "seed_everything": 0,
        "trainer": trainer_section(f"flute/{column}", f"flute-{column}-{name}", 100, strategy, callbacks),
        **model_and_data(column),
    }
    paper = PAPER_BASELINES[name][list(COLUMNS).index(column)]
    head = spec.head_epochs[dataset] if spec.head_epochs else 0
    figure = "finetune/val/acc" if spec.fine_tune else "val/acc_last10"
    path = f"{column}_{name}.yaml"
    header = [
        f"FLUTE paper (Liu, Shen & Yang, ICML 2024) Table 1, {dataset.upper()} (N={n} clients, S={s} classes "
        "per client), participation 0.1, 100 rounds.",
        f"{spec.label} (baseline): " + spec.description.format(joint=joint, head=head) + ".",
        f"Local epochs: {dataset.upper()} {joint}, FLUTE's (flute.md §5.2); same data, CNN and SGD (lr 0.01, momentum "
        "0.5, weight decay 1e-4, batch 10) as FLUTE.",
        f"Paper: {spec.label} {paper} % mean client test accuracy (FLUTE {setting.flute}, FLUTE* {setting.flute_star}).",
        f"The paper's figure is {figure}"
        + (" (fine-tuned models)." if spec.fine_tune else " (mean over the last 10 rounds, as FLUTE's)."),
        "As the official code: classes dealt as its sampling.py (assignment: official: a client may draw a class",
        "twice)"
        + (
            "; a client that has not trained starts from the average (first_state: average)."
            if spec.aliased
            else "."
        ),
        *(M_TR_NOTE if n == 50 else []),
        *(FINE_TUNE_NOTE.splitlines() if spec.fine_tune else []),
        *(
            [
                "Algorithm: the registered defaults (the FLUTE code does not release it; see the module's docstring)."
            ]
            if name in ("fedrod", "fedcp")
            else []
        ),
        f"Run: lightning-fedrep fit --config recipes/flute/{path}",
    ]
    FACTS[path] = (f"FLUTE Table 1, {dataset.upper()} ({n}, {s}): {spec.label}", f"`{figure}`", f"{paper}%")
    return path, render("\n".join(header), config, generator="recipes/flute/generate.py")


def baseline_names() -> list[str]:
    """The baselines whose algorithm is registered now (FedRoD, FedCP: once their modules exist)."""
    return [name for name, spec in BASELINES.items() if registered(spec.algorithm)]


def all_recipes() -> dict[str, str]:
    recipes = dict(recipe(c, v) for c in COLUMNS for v in VARIANTS)
    recipes.update(baseline_recipe(c, b) for c in COLUMNS for b in baseline_names())
    return recipes
