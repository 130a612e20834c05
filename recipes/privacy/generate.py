"""Writes the client-level DP recipes: CENTAUR (DP-FedRep) and DP-FedAvg + FT with the official code's settings,
an offline client-level DP pair on the digits, and an offline sample-level (DP-SGD) demo there.

    python recipes/generate.py          # rewrites every recipe, these included
    python recipes/generate.py --check  # exit 1 if a recipe differs from its table

Settings are the official CENTAUR code's camera-ready scripts (``shenzebang/CENTAUR-Privacy-Federated-
Representation-Learning`` @71e092e, ``script/user-level-DP/camera-ready-ICLR2023/small-epoch-data-augmentation-
fine-tune/``; ``shared/reference/privacy.md`` §3): user-level (client-level) DP at ε = 1, δ = 1e-5, every client
every round (``--frac_participate 1``), batch 100, SGD lr 1e-2 with momentum 0.9 and weight decay 1e-4
(``options.py`` defaults), 15 head epochs at lr 1e-2, CIFAR 200 rounds of 1 local epoch, EMNIST-digits 40 rounds
of 2, the clip per data set (``--dp_clip``). The numbers quoted are the official repository's (privacy.md §4:
the interim CIFAR-10 results of Sep 2022 and the submission-era EMNIST figure); the paper's own tables are not
in the digest.
"""

from __future__ import annotations

from dataclasses import dataclass

from writer import render, trainer_section  # recipes/, put on sys.path by recipes/generate.py

EPSILON, DELTA = 1.0, 1e-5
"""The camera-ready scripts' budget (``--epsilon 1 --delta 1e-5``)."""
HEAD_EPOCHS = 15
"""``--local_head_ep 15`` (DP-FedRep's head before the body; DP-FedAvg's fine-tuning before evaluation)."""


@dataclass(frozen=True)
class Column:
    """One camera-ready setting: the data set, ``n`` clients with ``s`` classes each, the official ``--dp_clip``,
    and the official repository's numbers where it has them (mean test accuracy %, (std))."""

    dataset: str
    n: int
    s: int
    clip: float
    centaur: str = ""
    dp_fedavg: str = ""
    source: str = ""


INTERIM = "the official repository's interim CIFAR-10 results (cifar10_result.md @e8f906c, Sep 2022: the same ε, C and T)"
EMNIST_FIGURE = (
    "the official repository's submission-era utility-privacy figure (plot_utility_privacy_tradeoff.py\n"
    "@a345f8c: EMNIST-digits N=2000 S=5, 40 rounds, C=0.25, ε=1)"
)
COLUMNS = {
    "cifar10_500_2": Column("cifar10", 500, 2, 0.01, "78.54 (0.54)", "72.12 (0.77)", INTERIM),
    "cifar10_500_5": Column("cifar10", 500, 5, 0.01, "52.55 (0.69)", "38.04 (1.97)", INTERIM),
    "cifar10_1000_2": Column("cifar10", 1000, 2, 0.01, "75.75 (0.20)", "57.02 (1.36)", INTERIM),
    "cifar10_1000_5": Column("cifar10", 1000, 5, 0.01, "47.67 (1.62)", "37.15 (1.22)", INTERIM),
    "cifar100_500_5": Column("cifar100", 500, 5, 0.02),
    "cifar100_500_20": Column("cifar100", 500, 20, 0.02),
    "cifar100_1000_5": Column("cifar100", 1000, 5, 0.02),
    "cifar100_1000_20": Column("cifar100", 1000, 20, 0.01),
    "emnist_1000_5": Column("emnist", 1000, 5, 0.25),
    "emnist_2000_5": Column("emnist", 2000, 5, 0.25, "92.79", "86.85", EMNIST_FIGURE),
}


@dataclass(frozen=True)
class Dataset:
    """A data set's data module and model, the official rounds and local epochs, and the model difference."""

    label: str
    data_class: str
    data_args: dict
    model_class: str
    model_args: dict
    rounds: int  # --epochs
    local_epochs: int  # --local_ep
    model_note: str


DATA = {
    "cifar10": Dataset(
        "CIFAR-10",
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"augment": False},
        "lightning_fedrep.models.CENTAURCNN",
        {"num_classes": 10, "hidden": [384, 32]},
        200,
        1,
        "Model: CENTAUR's CNNCifar10 (CENTAURCNN: conv 64, conv 64, fc 384, fc 32 -> head 32->10), its output as\n"
        "log-probabilities (the same cross-entropy).",
    ),
    "cifar100": Dataset(
        "CIFAR-100",
        "lightning_fedrep.data.vision.CIFAR100DataModule",
        {"augment": False},
        "lightning_fedrep.models.CENTAURCNN",
        {"num_classes": 100, "hidden": [128, 32]},
        200,
        1,
        "Model: CENTAUR's CNNCifar100 (CENTAURCNN: conv 64, conv 64, fc 128, fc 32 -> head 32->100, no dropout),\n"
        "its output as log-probabilities (the same cross-entropy).",
    ),
    "emnist": Dataset(
        "EMNIST-digits",
        "lightning_fedrep.data.vision.EMNISTDataModule",
        {"split": "digits"},
        "lightning_fedrep.models.CENTAURMLP",
        {},
        40,
        2,
        "Model: CENTAUR's MLP (CENTAURMLP: 784-256-128-16 -> head 16->10).",
    ),
}


@dataclass(frozen=True)
class Method:
    """DP-FedRep (CENTAUR) or DP-FedAvg + FT as a recipe."""

    label: str
    description: str
    number: str  # the Column field holding its official number


METHODS = {
    "dp_fedrep": Method(
        "CENTAUR (DP-FedRep)",
        "CENTAUR (DP-FedRep, the official DP_FedRep): each round every client trains its head for {head} epochs (body\n"
        "frozen), then the body for {body} epoch(s) (head frozen); the server clips each body update to L2 norm\n"
        "{clip} and adds Gaussian noise to their sum (ClientLevelDP); heads never leave their clients",
        "centaur",
    ),
    "dp_fedavg_ft": Method(
        "DP-FedAvg + FT",
        "DP-FedAvg + FT (the official DP_FedAvg_ft): each round every client trains the whole model for {body}\n"
        "epoch(s); the server clips each model update to L2 norm {clip} and adds Gaussian noise to their sum\n"
        "(ClientLevelDP); before each evaluation every client fine-tunes a copy of the head for {head} epochs\n"
        "(FineTunedEvaluation), for evaluation only",
        "dp_fedavg",
    ),
}

DEVIATIONS = (
    "Deviations from the official code:\n"
    "- Heads persist on their clients from round to round (the official code keeps them only under Ray, which\n"
    "  its scripts use; without Ray every head restarts from its initial value each round).\n"
    "- No round is picked on private validation data: read val/acc of the last round. The official figure is\n"
    "  the test accuracy at the round of best mean validation accuracy (10% of each client's training data), a\n"
    "  further release that its ε does not count. No validation split here.\n"
    "- Each client's test data is its own disjoint test shards (the official: all test images of its classes).\n"
    "- The noise is calibrated for the rounds actually run and the sampling accounted as done: every client\n"
    "  every round is the Gaussian mechanism itself (no amplification), σ = {sigma} for T = {rounds} at ε 1,\n"
    "  δ 1e-5 (Opacus RDP), which the official calibration also gives at q = 1.\n"
    "- Evaluation after the round (the new body under each client's new head); the official code evaluates\n"
    "  after the head epochs and before the body update.\n"
    "- Weight decay on weights only (the project's models), the official on every parameter; no data\n"
    "  augmentation (the official DP-FedRep fine-tunes its head on crop+flip-augmented images).\n"
    "- The noise is seeded per round (reproducible, identical on resume), the official draws torch.randn; neither\n"
    "  uses a secure RNG."
)
SIGMA = {200: 57.5, 40: 25.625}
"""σ for ε 1, δ 1e-5 at q = 1 over T rounds (privacy.md §2, Opacus's RDP bisection; the run logs its own)."""
FACTS: dict[str, tuple[str, str, str]] = {}
"""Per recipe file: what it reproduces, the figure to read, the official number (``recipes/README.md``)."""


def privacy(clip: float, rounds: int, epsilon: float = EPSILON) -> dict:
    """``ClientLevelDP`` spending ``epsilon`` at δ 1e-5 over ``rounds`` rounds, clipping at ``clip``."""
    return {
        "class_path": "lightning_fedrep.privacy.ClientLevelDP",
        "init_args": {"clip": clip, "target_epsilon": epsilon, "delta": DELTA, "rounds": rounds},
    }


def strategy(method: str, clip: float, rounds: int, body: int, head: int, epsilon: float = EPSILON) -> dict:
    """The strategy of ``method``: every client every round, uniform weights, ``ClientLevelDP``."""
    args: dict = {"algorithm": "fedrep" if method == "dp_fedrep" else "fedavg", "clients_per_round": 1.0}
    if method == "dp_fedrep":
        args.update(head_epochs=head, body_epochs=body)
    else:
        args["local_epochs"] = body
    args.update(weighting="uniform", seed=0, privacy=privacy(clip, rounds, epsilon))
    return args


def fine_tuning(method: str, epochs: int) -> list[dict]:
    """DP-FedAvg + FT's evaluation: a copy of the head fine-tuned for ``epochs`` before each evaluation."""
    if method != "dp_fedavg_ft":
        return []
    return [{"class_path": "lightning_fedrep.callbacks.FineTunedEvaluation", "init_args": {"epochs": epochs}}]


def official_number(column: Column, method: str) -> str:
    """The official repository's number for ``method`` in ``column`` (``%``), or ``—``."""
    number = getattr(column, METHODS[method].number)
    return f"{number.split(' (')[0]}%" if number else "—"


def recipe(name: str, method: str) -> tuple[str, str]:
    column, spec = COLUMNS[name], METHODS[method]
    data = DATA[column.dataset]
    path = f"privacy/{name}_{method}.yaml"
    val_every = 1 if method == "dp_fedrep" else 10  # FT before every evaluation: every 10th round (T divides)
    recipe_dict = {
        "seed_everything": 0,
        "trainer": trainer_section(
            "privacy",
            f"{name}-{method.replace('_', '-')}",
            data.rounds,
            strategy(method, column.clip, data.rounds, data.local_epochs, HEAD_EPOCHS),
            fine_tuning(method, HEAD_EPOCHS),
            val_every=val_every,
        ),
        "model": {
            "class_path": data.model_class,
            "init_args": {**data.model_args, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": data.data_class,
            "init_args": {
                "root": "data",
                "download": True,
                **data.data_args,
                "num_clients": column.n,
                "classes_per_client": column.s,
                "batch_size": 100,
                "seed": 0,
                "assignment": "official",
            },
        },
    }
    number = getattr(column, spec.number)
    official = (
        f"Official number: {spec.label} {number}%, the mean test accuracy over 3 runs (std in parentheses), from\n"
        f"{column.source}."
        if number
        else "The official repository has no numbers for this setting (the paper's tables are not in the digest)."
    )
    header = (
        f"CENTAUR (Shen et al., ICLR 2023), client-level DP, {data.label} (n={column.n} clients, S={column.s} classes "
        f"per client):\n{spec.label}, ε = 1, δ = 1e-5, T = {data.rounds} rounds, every client every round, the official "
        "camera-ready\nscripts' settings: batch 100, SGD lr 0.01, momentum 0.9, weight decay 1e-4 (head lr 0.01).\n"
        + spec.description.format(head=HEAD_EPOCHS, body=data.local_epochs, clip=column.clip)
        + ".\nServer: the unweighted mean (weighting: uniform; sample weights would break the sensitivity), noise std\n"
        "σ·C/n on it; privacy/epsilon is logged every round.\n"
        + f"{official}\n"
        + f"{data.model_note}\n"
        + DEVIATIONS.format(sigma=SIGMA[data.rounds], rounds=data.rounds)
        + "\nData: assignment: official (a shuffled multiset of class slots, as the official class assignment, which\n"
        "may give a client a class twice).\n"
        + (
            "Evaluation every 10th round (each costs every client 15 fine-tuning epochs); the figure is the last round's.\n"
            if method == "dp_fedavg_ft"
            else ""
        )
        + "Read val/acc of the last round (results()['final']).\n"
        + f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        f"CENTAUR, {data.label} ({column.n}, {column.s}), ε 1: {spec.label}",
        "`val/acc` of the last round",
        official_number(column, method),
    )
    return path, render(header, recipe_dict)


DIGITS_MODEL_AND_DATA = {
    "model": {
        "class_path": "lightning_fedrep.models.MLPClassifier",
        "init_args": {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4},
    },
    "data": {
        "class_path": "lightning_fedrep.data.digits.DigitsDataModule",
        "init_args": {"num_clients": 20, "classes_per_client": 2, "batch_size": 10, "seed": 0},
    },
}
"""The offline DP demos' model and federation: the digits demos' MLP, 20 clients of 2 classes, batch 10."""
DIGITS_CLIP, DIGITS_EPSILON, DIGITS_ROUNDS = 0.1, 8.0, 30
"""The offline pair's clip, budget and rounds (``benchmarks/privacy/digits_tradeoff.py`` sweeps ε)."""


def digits_recipe(method: str) -> tuple[str, str]:
    """The offline DP demo on scikit-learn's digits: the digits demos' federation and MLP, every client every round."""
    spec = METHODS[method]
    path = f"digits/{method}.yaml"
    trainer = trainer_section(
        "digits",
        f"digits-{method}",
        DIGITS_ROUNDS,
        strategy(method, DIGITS_CLIP, DIGITS_ROUNDS, 1, 5, DIGITS_EPSILON),
        fine_tuning(method, 5),
        accelerator="cpu",
    )
    header = (
        "Offline demo of client-level DP on scikit-learn's handwritten digits: 20 clients with 2 classes each, every\n"
        f"client each round, a 64-64-32-10 MLP, ε = {DIGITS_EPSILON:g} at δ = 1e-5 over {DIGITS_ROUNDS} rounds.\n"
        + spec.description.format(head=5, body=1, clip=DIGITS_CLIP)
        + ".\nNot a paper setting: the CLI path of the CENTAUR recipes (recipes/privacy/), offline and quick on a CPU.\n"
        "With 20 clients the noise on the mean (σ·C/20) is large: the ε sweep over more clients is\n"
        "benchmarks/privacy/digits_tradeoff.py.\n"
        "Read val/acc of the last round.\n"
        f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    recipe_dict = {"seed_everything": 0, "trainer": trainer, **DIGITS_MODEL_AND_DATA}
    FACTS[path] = (
        f"offline demo (not a paper setting): {spec.label}, ε 8",
        "`val/acc` of the last round",
        "—",
    )
    return path, render(header, recipe_dict)


DP_SGD_CLIP, DP_SGD_EPSILON, DP_SGD_ROUNDS, DP_SGD_HEAD_EPOCHS = 1.0, 8.0, 20, 2
"""The sample-level demo's per-example clip, each client's budget, the rounds and the head epochs."""


def dp_sgd_recipe() -> tuple[str, str]:
    """The offline sample-level DP demo on the digits: FedRep with DP-SGD in every local step (``SampleLevelDP``)."""
    path = "digits/dp_sgd_fedrep.yaml"
    privacy = {
        "class_path": "lightning_fedrep.privacy.SampleLevelDP",
        "init_args": {
            "clip": DP_SGD_CLIP,
            "target_epsilon": DP_SGD_EPSILON,
            "delta": DELTA,
            "rounds": DP_SGD_ROUNDS,
        },
    }
    args = {
        "algorithm": "fedrep",
        "clients_per_round": 1.0,
        "head_epochs": DP_SGD_HEAD_EPOCHS,
        "body_epochs": 1,
        "weighting": "uniform",
        "seed": 0,
        "privacy": privacy,
    }
    trainer = trainer_section("digits", "digits-dp_sgd_fedrep", DP_SGD_ROUNDS, args, [], accelerator="cpu")
    header = (
        "Offline demo of sample-level DP (DP-SGD inside clients) on scikit-learn's handwritten digits: 20 clients\n"
        f"with 2 classes each, every client each round, a 64-64-32-10 MLP, FedRep ({DP_SGD_HEAD_EPOCHS} head epochs "
        f"then 1 body epoch a round)\nfor {DP_SGD_ROUNDS} rounds. Every local step is a DP-SGD step (SampleLevelDP): "
        "a Poisson batch (q = 10 / n per example),\n"
        f"each example's gradient clipped to L2 norm {DP_SGD_CLIP:g}, Gaussian noise, divided by the expected batch; "
        f"every client's\nε at most {DP_SGD_EPSILON:g} at δ = 1e-5 (the noise multiplier solved for {DP_SGD_ROUNDS} "
        "rounds; privacy/epsilon is the worst client's).\n"
        "The server needs no trust: the bodies each client uploads, and its head, are DP with respect to its examples.\n"
        "Not a paper setting (CENTAUR is client-level): the CLI path of sample-level DP, offline and quick on a CPU.\n"
        "Read val/acc of the last round.\n"
        f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    recipe_dict = {"seed_everything": 0, "trainer": trainer, **DIGITS_MODEL_AND_DATA}
    FACTS[path] = (
        f"offline demo (not a paper setting): FedRep under sample-level DP (DP-SGD), ε {DP_SGD_EPSILON:g} per client",
        "`val/acc` of the last round",
        "—",
    )
    return path, render(header, recipe_dict)


def all_recipes() -> dict[str, str]:
    """Every privacy recipe, keyed by its path under ``recipes/``."""
    recipes = dict(recipe(name, method) for name in COLUMNS for method in METHODS)
    recipes.update(digits_recipe(method) for method in METHODS)
    recipes.update([dp_sgd_recipe()])
    return recipes
