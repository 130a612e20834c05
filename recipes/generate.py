"""Writes every recipe YAML from one table of settings, so the recipes cannot drift apart.

    python recipes/generate.py          # rewrite recipes/*/*.yaml
    python recipes/generate.py --check  # exit 1 if a committed recipe differs (run by the tests)

Settings are the official FedRep code's (`lgcollins/FedRep`, see ../shared/reference/fedrep.md and
pfl-libraries.md §4): SGD lr 0.01, momentum 0.5, weight decay 1e-4 on weights, batch size 10,
participation 0.1, FedRep 10 head epochs + 1 body epoch (CIFAR-10 (100,2)) or + 5 (all others),
baselines with the same number of local epochs as FedRep's body epochs (the paper's rule), FedAvg + FT
fine-tuning for 10 epochs in one extra round over all clients (all layers on CIFAR, as the official code;
the head on FEMNIST), Local Only as the official main_local.py (10 epochs, first 100 clients scored; the
paper's-text reading is the `local_paper` variant). Paper recipes deal classes as the official sampling.py
(`assignment: official`) and start untrained clients from the average (`first_state: average`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flute.generate import FACTS as FLUTE_FACTS  # noqa: E402
from flute.generate import all_recipes as flute_recipes  # noqa: E402  (the FLUTE table lives beside its recipes)
from pfllib.generate import BEST_ROUND as PFLLIB_BEST_ROUND  # noqa: E402
from pfllib.generate import FACTS as PFLLIB_FACTS  # noqa: E402
from pfllib.generate import all_recipes as pfllib_recipes  # noqa: E402  (PFLlib's leaderboard setting)
from pfllib.generate import readme_section as pfllib_readme_section  # noqa: E402
from privacy.generate import FACTS as PRIVACY_FACTS  # noqa: E402
from privacy.generate import all_recipes as privacy_recipes  # noqa: E402  (CENTAUR's table, beside its recipes)
from writer import load_beside, render, trainer_section  # noqa: E402

# recipes/transformers/ would shadow (or be shadowed by) the Hugging Face package as `transformers.generate`
_transformers_table = load_beside("transformers/generate.py", "transformers_recipes")
TRANSFORMERS_FACTS, transformers_recipes = _transformers_table.FACTS, _transformers_table.all_recipes

FACTS: dict[str, tuple[str, str, str]] = {}
"""Per recipe path: what it reproduces, the logged figure to read, the paper's number (recipes/README.md)."""


def headline_figure(method: Method, headline: str = "val/acc") -> str:
    """The logged figure that is the paper's number for ``method`` (see :func:`headline_note`)."""
    if method.algorithm == "local":
        return f"`{headline}` of the last round" + (" (first 100 clients)" if method.official_local else "")
    if method.callbacks:
        return f"`finetune/{headline}`"
    if method.last_round:
        return f"`{headline}` of the last round"
    return f"`{headline}_last10`"


@dataclass(frozen=True)
class Table1Column:
    """One column of the FedRep paper's Table 1: its data, model and schedule, and the paper's results."""

    folder: str  # recipes/<folder>/ and runs/<folder>/
    data_class: str
    data_args: dict
    model_class: str
    lg_shared: tuple[str, ...]  # LG-FedAvg's shared (averaged) modules
    rounds: int
    body_epochs: int  # FedRep's body epochs, and FedPer's / LG-FedAvg's / Local Only's local epochs
    paper: dict[str, float]  # mean client test accuracy (%) per method
    fedavg_script: tuple[str, int]  # the official FedAvg script (as the digest names it), its local_ep
    model_args: dict = field(default_factory=dict)  # beyond lr/momentum/weight_decay
    headline: str = "val/acc"  # the logged metric the paper's number is (before _last10, finetune/)
    note: str = ""  # what else a reader must know (data, model quirks)
    ft_mode: str = "full"  # FedAvg + FT: what the official code's last round fine-tunes (HeadFineTuning mode)
    ft_note: str = ""  # replaces FT_NOTE[ft_mode] where the official code's rule differs by data set
    batch_size: int = 10  # the official local_bs
    name: str = ""  # the column's label in headers and recipes/README.md (default: "<FOLDER> (n=.., S=..)")
    local_note: str = ""  # what the official main_local.py does differently for this column
    step_rule_model_args: dict = field(default_factory=dict)  # model_args overrides for StepRule algorithms
    step_rule_note: str = ""  # why (header line of those recipes)


SENT140_LAYOUT_NOTE = (
    "Model: layout: official keeps the official emb.view(300, 4, 25) (sic: LSTM input 25 over 300 steps, each row\n"
    "mixing the batch's 4 tweets), so evaluation runs in batches of 4 (eval_batch_size: 4) as the official test\n"
    "loop; layout: tokens reads one word per step."
)
"""The Sent140 header's model sentence; recipes of step-rule algorithms replace it (``step_rule_note``)."""


TABLE1 = {
    "cifar10_100_2": Table1Column(
        folder="cifar10",
        data_class="lightning_fedrep.data.vision.CIFAR10DataModule",
        data_args={"num_clients": 100, "classes_per_client": 2},
        model_class="lightning_fedrep.models.CIFAR10CNN",
        lg_shared=("fc2", "fc3"),
        rounds=100,
        body_epochs=1,
        fedavg_script=("the official FedAvg script", 1),
        paper={
            "local": 89.79,
            "fedavg": 42.65,
            "fedavg_ft": 87.65,
            "lg_fedavg": 84.14,
            "fedper": 87.13,
            "fedrep": 87.70,
        },
    ),
    "cifar10_100_5": Table1Column(
        folder="cifar10",
        data_class="lightning_fedrep.data.vision.CIFAR10DataModule",
        data_args={"num_clients": 100, "classes_per_client": 5},
        model_class="lightning_fedrep.models.CIFAR10CNN",
        lg_shared=("fc2", "fc3"),
        rounds=100,
        body_epochs=5,
        fedavg_script=("the official scripts/FedAvg_cifar10_5shards.sh", 1),
        paper={
            "local": 70.68,
            "fedavg": 51.78,
            "fedavg_ft": 73.68,
            "lg_fedavg": 63.02,
            "fedper": 73.84,
            "fedrep": 75.68,
        },
    ),
    "cifar10_1000_2": Table1Column(
        folder="cifar10",
        data_class="lightning_fedrep.data.vision.CIFAR10DataModule",
        data_args={"num_clients": 1000, "classes_per_client": 2},
        model_class="lightning_fedrep.models.CIFAR10CNN",
        lg_shared=("fc2", "fc3"),
        rounds=100,
        body_epochs=5,
        fedavg_script=("the official FedAvg script", 5),
        paper={
            "local": 78.30,
            "fedavg": 44.31,
            "fedavg_ft": 82.04,
            "lg_fedavg": 77.48,
            "fedper": 81.73,
            "fedrep": 83.27,
        },
    ),
    "cifar100_100_5": Table1Column(
        folder="cifar100",
        data_class="lightning_fedrep.data.vision.CIFAR100DataModule",
        data_args={"num_clients": 100, "classes_per_client": 5},
        model_class="lightning_fedrep.models.CIFAR100CNN",
        lg_shared=("fc2", "fc3"),
        rounds=100,
        body_epochs=5,
        fedavg_script=("the official scripts/FedAvg_cifar100_*.sh", 1),
        paper={
            "local": 75.29,
            "fedavg": 23.94,
            "fedavg_ft": 79.34,
            "lg_fedavg": 72.44,
            "fedper": 76.00,
            "fedrep": 79.15,
        },
    ),
    "cifar100_100_20": Table1Column(
        folder="cifar100",
        data_class="lightning_fedrep.data.vision.CIFAR100DataModule",
        data_args={"num_clients": 100, "classes_per_client": 20},
        model_class="lightning_fedrep.models.CIFAR100CNN",
        lg_shared=("fc2", "fc3"),
        rounds=100,
        body_epochs=5,
        fedavg_script=("the official scripts/FedAvg_cifar100_*.sh", 1),
        paper={
            "local": 41.29,
            "fedavg": 31.97,
            "fedavg_ft": 55.44,
            "lg_fedavg": 38.76,
            "fedper": 55.68,
            "fedrep": 56.10,
        },
    ),
    "femnist_150_3": Table1Column(
        folder="femnist",
        data_class="lightning_fedrep.data.leaf.LEAFDataModule",
        data_args={
            "train_dir": "data/femnist/train",
            "test_dir": "data/femnist/test",
            "max_clients": 150,
            "user_order": "file",
        },
        model_class="lightning_fedrep.models.FEMNISTMLP",
        lg_shared=("layer_hidden2", "layer_out"),
        rounds=200,
        body_epochs=5,
        fedavg_script=("the official FedAvg script", 5),
        model_args={"output": "softmax"},
        headline="val/acc_weighted",
        ft_mode="head",
        note=(
            "Model: the official MLP applies softmax before CrossEntropyLoss (a double softmax); output: softmax keeps it.\n"
            "Data: the paper's FEMNIST is the official my_sample.py re-sampling of LEAF's output (10 lowercase letters,\n"
            "200 users with 3 classes each, lognormal sample counts, 90/10 split), not LEAF's 62-class FEMNIST; point\n"
            "train_dir/test_dir at that re-sampling's output. Users in file order (user_order: file), as the official code.\n"
            "The official FEMNIST accuracy is weighted by test samples: val/acc_weighted."
        ),
        paper={
            "local": 60.86,
            "fedavg": 51.64,
            "fedavg_ft": 72.41,
            "lg_fedavg": 62.08,
            "fedper": 76.91,
            "fedrep": 78.56,
        },
    ),
    "sent140_183_2": Table1Column(
        folder="sent140",
        name="Sent140 (n=183 clients, 2 classes)",
        data_class="lightning_fedrep.data.sent140.Sent140DataModule",
        data_args={
            "train_dir": "data/sent140/train",
            "test_dir": "data/sent140/test",
            "glove_path": "data/glove.6B.300d.txt",
            "max_clients": 183,
            "user_order": "file",
            "eval_batch_size": 4,
        },
        model_class="lightning_fedrep.models.Sent140RNN",
        model_args={"glove_path": "data/glove.6B.300d.txt", "layout": "official"},
        lg_shared=("rnn.weight_ih_l0", "decoder"),
        rounds=50,
        body_epochs=5,
        batch_size=4,
        fedavg_script=("the official scripts/FedAvg_sent140.sh", 10),
        headline="val/acc_weighted",
        ft_mode="head",
        step_rule_model_args={"layout": "tokens"},
        step_rule_note="Model: layout: tokens, one word per LSTM step (LSTM input 300 over 25 steps), NOT the official\n"
        "emb.view(300, 4, 25): that layout mixes the tweets of a batch, so Sent140RNN(layout: official) declares no\n"
        "per-sample loss (fedrep_loss = None), and this algorithm's step rule needs one (it splits batches and is\n"
        "refused at setup without it); the RNN's sizes, initialisation and body/head split are the official ones.\n",
        ft_note="Fine-tuning: only the head (HeadFineTuning mode: head), as the official Sent140 branch of the last round\n"
        "(rnn and fc frozen, the decoder trained for 10 epochs) and the paper's text.",
        local_note="Sent140: main_local.py's Sent140 branch calls LocalUpdate.train --epochs times instead (local_ep epochs\n"
        "each, a fresh SGD with weight decay 1e-4 per call; no script sets them); this recipe keeps the other columns' reading.",
        note=(
            "Data: LEAF's Sent140 (preprocess.sh -s niid --sf 0.3 -k 50 -tf 0.8 -t sample), the first 183 users in file\n"
            "order (user_order: file, --num_users 183), tweets as 25 GloVe word ids (the official tokenisation); batch 4.\n"
            "Word vectors: glove_path (model and data: the same file) is GloVe's glove.6B.300d.txt or LEAF's embs.json;\n"
            "nothing is downloaded.\n"
            + SENT140_LAYOUT_NOTE
            + " The LSTM state starts at zero every batch (the official code\n"
            "carries it across a client's batches) and a client's last incomplete batch is kept (the official drops it).\n"
            "The official Sent140 accuracy is weighted by test samples: val/acc_weighted."
        ),
        paper={
            "local": 69.88,
            "fedavg": 52.75,
            "fedavg_ft": 71.92,
            "lg_fedavg": 70.37,
            "fedper": 72.12,
            "fedrep": 72.41,
        },
    ),
}


def head_fine_tuning(epochs: int, mode: str = "head") -> dict:
    """FedAvg + FT's extra round: every client fine-tunes the head (``mode="head"``) or every layer
    (``"full"``) for ``epochs`` epochs."""
    return {
        "class_path": "lightning_fedrep.callbacks.HeadFineTuning",
        "init_args": {"epochs": epochs, "mode": mode},
    }


FT_NOTE = {
    "full": "Fine-tuning: every layer (HeadFineTuning mode: full), as the official CIFAR code's last round (its\n"
    "freeze test compares names with a list of lists and never matches); the paper describes fine-tuning only\n"
    "the head: set mode: head for that.",
    "head": "Fine-tuning: only the head (HeadFineTuning mode: head), the paper's text (the official FEMNIST branch\n"
    "of that round reads undefined names, so the code gives no rule); set mode: full to train every layer.",
}
FIRST_STATE_NOTE = (
    "First state: first_state: average, as the official code (clients alias the global model, into which\n"
    "every key is averaged): a client that has not trained yet starts from the average of its local part."
)
ASSIGNMENT_NOTE = (
    "Data: assignment: official, the official sampling.py's deal (a shuffled multiset of class slots, so a\n"
    "client may draw a class twice and hold fewer than S distinct classes)."
)


@dataclass(frozen=True)
class Method:
    """A method of the FedRep family as a recipe: the strategy's algorithm, the callbacks it adds (each
    built from the setting's head epochs) and its header line (``{body}``, ``{lg}``, ``{local_rounds}``
    filled in per setting)."""

    algorithm: str
    description: str
    callbacks: tuple[Callable[..., dict], ...] = ()
    official_local: bool = False  # Local Only as main_local.py: one round of 10 epochs, 100 clients scored
    class_path: str = ""  # the algorithm's class, written with ``args`` (official hyper-parameters) in YAML
    args: dict = field(default_factory=dict)
    strategy_args: dict = field(default_factory=dict)  # beyond the common ones (e.g. the official weighting)
    step_rule: bool = False  # trains through a StepRule: needs the module's per-sample loss (fedrep_loss)
    last_round: bool = False  # the paper's figure is the last round's (the official final round), not last10
    note: str = ""  # where the recipe follows the paper's text or the official code, and the deviations
    weight_decay: float | None = None  # the official optimizer's, where it is not the family's 1e-4
    rounds: Callable[[int], int] | None = None  # the rounds for the column's T, where they differ
    lr: Callable[[int], float] | None = None  # the official learning rate for n clients, where not 0.01


METHODS = {
    "fedrep": Method(
        algorithm="fedrep",
        description="FedRep: {head} head epochs (body frozen) then {body} body epoch(s) (head frozen); body averaged",
    ),
    "fedper": Method(
        algorithm="fedper",
        description="FedPer: head and body trained jointly for {body} epoch(s); body averaged, heads local",
    ),
    "lg_fedavg": Method(
        algorithm="lg_fedavg",
        description="LG-FedAvg: trained jointly for {body} epoch(s); {lg} averaged, the rest stays local",
    ),
    "fedavg": Method(
        algorithm="fedavg",
        description="FedAvg: one global model, {body} local epoch(s), everything averaged (global model evaluated)",
    ),
    "fedavg_ft": Method(
        algorithm="fedavg",
        description="FedAvg + FT: FedAvg, then one extra round in which every client fine-tunes {ft} for {ft_epochs} epochs",
        callbacks=(head_fine_tuning,),
    ),
    "local": Method(
        algorithm="local",
        description="Local Only, as the official main_local.py: no communication; every client trains its own model from\n"
        "the same initial model for 10 epochs (--epochs, default 10) in one round, with one optimizer and no weight\n"
        "decay; the figure is the unweighted mean over the first min(100, n) clients (evaluate_clients: 100)",
        official_local=True,
    ),
    "local_paper": Method(
        algorithm="local",
        description="Local Only, the paper's text read for it (the official main_local.py is the `local` recipe): no\n"
        "communication; every client trains its own model for {local_rounds} epochs in all ({body} a round, every client;\n"
        "{local_rounds} = the expected local epochs of a client under {share} participation), with one optimizer kept\n"
        "across rounds (never reset) and no weight decay, as main_local.py",
    ),
}
DIGITS_SERVER_LR = 0.01
"""FedAdam's η in the digits demo of a composed server optimizer (the package's default 0.1, Flower's, moves every
weight of this small MLP by up to 0.1 a round; the paper grid-searches η per task)."""
COMPOSED = {
    "fedrep_fedadam": Method(
        algorithm="fedrep",
        description="FedRep + FedAdam: {head} head epochs (body frozen) then {body} body epoch(s) (head frozen); the\n"
        "averaged body is FedAdam's pseudo-gradient (server_optimizer: FedAdam, η "
        + f"{DIGITS_SERVER_LR:g}"
        + ", β1 0.9, β2 0.99, τ 1e-3, the paper's start),\n"
        "the server steps the body from the round's start; heads local",
        strategy_args={
            "server_optimizer": {
                "class_path": "lightning_fedrep.FedAdam",
                "init_args": {"lr": DIGITS_SERVER_LR},
            }
        },
    ),
}
"""Methods composed from the strategy's settings (an algorithm plus ``server_optimizer``), digits demos only."""
DIGITS_METHODS = [m for m in METHODS if m != "local_paper"] + list(COMPOSED)

PAPER_ROWS: dict[str, tuple[float, ...]] = {
    "fedprox": (39.92, 50.99, 21.93, 20.17, 28.52, 52.33, 18.89),
    "fedprox_ft": (85.81, 72.75, 75.41, 78.52, 55.09, 71.21, 53.54),
    "scaffold": (37.72, 47.33, 33.79, 20.32, 22.52, 51.31, 17.65),
    "scaffold_ft": (86.35, 68.23, 78.24, 78.88, 44.34, 71.49, 52.11),
    "fed_mtl": (80.46, 58.31, 76.53, 71.47, 41.25, 71.20, 54.11),
    "per_fedavg": (82.27, 67.20, 67.36, 72.05, 52.49, 68.45, 71.51),
    "l2gd": (81.04, 59.98, 71.96, 72.13, 42.84, 70.67, 66.18),
    "apfl": (83.77, 72.29, 82.39, 78.20, 55.44, 69.87, 70.74),
    "ditto": (85.39, 70.34, 80.36, 78.91, 56.34, 71.04, 68.28),
}
"""Table 1's other rows (shared/reference/fedrep.md §6.1), in the paper's column order :data:`PAPER_COLUMNS`."""
PAPER_COLUMNS = (
    "cifar10_100_2",
    "cifar10_100_5",
    "cifar10_1000_2",
    "cifar100_100_5",
    "cifar100_100_20",
    "sent140_183_2",
    "femnist_150_3",
)

FT_DESCRIPTION = "\nthen one extra round in which every client fine-tunes {ft} for {ft_epochs} epochs\n(the protocol of FedAvg + FT)"
WEIGHTING_NOTE = "Server: the unweighted mean of the uploads (weighting: uniform), as {script}'s w / m."
BASELINES = {
    "fedprox": Method(
        algorithm="fedprox",
        class_path="lightning_fedrep.FedProx",
        args={"mu": 0.1},
        description="FedProx: FedAvg whose local loss adds mu/2 ||w - w_global||^2 (mu = 0.1, the official --mu default);\n"
        "{body} local epoch(s), everything averaged (global model evaluated)",
        note="FedProx: the proximal gradient goes through the recipe's SGD (momentum 0.5) into its momentum buffer, as\n"
        "the official FedProx.py optimizer adds mu (w - w_0) into its own; that optimizer also decays the biases\n"
        "(weight decay 1e-4 on every tensor), the recipe's the weights only.",
    ),
    "fedprox_ft": Method(
        algorithm="fedprox",
        class_path="lightning_fedrep.FedProx",
        args={"mu": 0.1},
        description="FedProx + FT: FedProx (mu = 0.1, {body} local epoch(s))," + FT_DESCRIPTION,
        callbacks=(head_fine_tuning,),
    ),
    "scaffold": Method(
        algorithm="scaffold",
        class_path="lightning_fedrep.Scaffold",
        args={"lr_g": 0.1, "clip": 10.0},
        description="SCAFFOLD, the official main_scaffold.py: gradients corrected by the control variates (c - c_i), clipped\n"
        "to norm 10, server lr lr_g = 0.1 (the official default), unweighted mean; {body} local epoch(s) (global model evaluated)",
    ),
    "scaffold_ft": Method(
        algorithm="scaffold",
        class_path="lightning_fedrep.Scaffold",
        args={"lr_g": 0.1, "clip": 10.0},
        description="SCAFFOLD + FT: SCAFFOLD (lr_g = 0.1, clip 10, {body} local epoch(s))," + FT_DESCRIPTION,
        callbacks=(head_fine_tuning,),
    ),
    "ditto": Method(
        algorithm="ditto",
        class_path="lightning_fedrep.Ditto",
        args={"lam": 1.0},
        strategy_args={"weighting": "uniform"},
        description="Ditto, the official main_ditto.py: {body} FedAvg epoch(s) on the global model, then {body} epoch(s) on the\n"
        "client's personal model, each step pulled towards the global model (lam = 1, the official --lam_ditto);\n"
        "the personal models are evaluated",
        note=WEIGHTING_NOTE.format(script="main_ditto.py")
        + "\nPersonal models start from the initial model (the paper's Algorithm 1); the official w_locals alias the\n"
        "global model until a client first trains.",
    ),
    "apfl": Method(
        algorithm="apfl",
        class_path="lightning_fedrep.APFL",
        args={"alpha": 0.75, "mixture": "paper"},
        strategy_args={"weighting": "uniform"},
        step_rule=True,
        description="APFL, the official main_apfl.py: a global model w and a personal model v per client, v trained on the\n"
        "mixture alpha v + (1 - alpha) w (alpha = 0.75, the official --alpha_apfl), {body} local epoch(s); the mixture\n"
        "alpha v + (1 - alpha) w_global is evaluated",
        note="Mixture: mixture: paper, the paper's rule: alpha v + (1 - alpha) w, v's step plain SGD. The official code\n"
        "trains on alpha v + alpha w (a typo for 1 - alpha) and steps v with the SGD just stepped for w (one\n"
        "momentum-0.5 buffer for both, weight decay 1e-4 on the weights): mixture: official reproduces both.\n"
        + WEIGHTING_NOTE.format(script="main_apfl.py"),
    ),
    "per_fedavg": Method(
        algorithm="per_fedavg",
        class_path="lightning_fedrep.PerFedAvg",
        args={"step": "maml", "inner_scale": 0.001, "support": 0.8, "adapt_epochs": 5},
        step_rule=True,
        last_round=True,
        description="Per-FedAvg, the official --alg maml: every local step a MAML step on the batch's 80/20 support/query split,\n"
        "inner lr = lr x 0.001; {body} local epoch(s), everything averaged; each client is scored after 5 epochs of\n"
        "all-parameter adaptation on its training data",
        note="Step: step: maml, the paper's meta-gradient; the official code builds the adapted weights but backpropagates\n"
        "L_support(w) + L_query(w) at w (step: official reproduces it). The 5 adaptation epochs (plain SGD) run before\n"
        "every evaluation; the official code runs them once, in its extra last round, with its momentum-0.5 SGD, and\n"
        "reports that round (so the figure here is the last round's, not a last-10 mean).",
    ),
    "fed_mtl": Method(
        algorithm="fed_mtl",
        class_path="lightning_fedrep.FedMTL",
        args={"chunk": 4000, "strength": None},
        weight_decay=0.0,
        description="Fed-MTL, the official main_mtl.py: every client keeps its whole model, trained {body} local epoch(s) on\n"
        "loss + 10^-f (||W||^2 + tr(W Omega W^T)) over the sampled clients' flattened weights W, Omega = (I - 11^T/m)^2,\n"
        "f = int(log10(d) + 1) + 1 (strength: null); nothing averaged; each client's own model is evaluated",
        note="Optimizer: no weight decay, as LocalUpdateMTL (every weight is in its w_glob_keys, which it spares).\n"
        "One process, sequential runner (the regularizer reads the other sampled clients' weights).",
    ),
    "l2gd": Method(
        algorithm="l2gd",
        class_path="lightning_fedrep.L2GD",
        args={"p": 0.9, "alpha": 1.0, "lam": 0.5},
        strategy_args={"clients_per_round": 1.0},
        rounds=lambda t: round(t * (1 - 0.9)),
        lr=lambda n: round(1.0 / (n * (1 - 0.9)), 6),
        last_round=True,
        description="L2GD, the official main_l2gd.py: full participation; each iteration, with probability 1 - p every client\n"
        "trains its own model ({body} local epoch(s)), else the models are averaged and pulled towards the mean,\n"
        "w_i <- (1 - lr lam) w_i + lr lam w_mean (p = 0.9, alpha = 1, lam = 0.5); each client's own model is evaluated",
        note="Schedule: the official T iterations are coin flips, about T(1 - p) of them local; a round here is a run of\n"
        "local iterations and the aggregations after it, so this recipe runs T(1 - p) rounds (max_epochs) and reads\n"
        "the last round (the official last-10-iteration mean is over mostly aggregation iterations, after the last\n"
        "local one). Learning rate: the official lr = alpha / (n (1 - p)) for the local steps as for the pull (model lr).\n"
        "Average: the plain mean of the n models. The official main_l2gd.py adds the first client's model to its\n"
        "average twice (it starts from w_1/n, then adds every w_i/n), so the average is about 1/n too large (~1.25%\n"
        "with 80 clients, 1% with 100) at every aggregation and the models pulled towards it inflate; run beside this\n"
        "recipe on a digits federation its accuracy collapses. Kept here: the plain mean.",
    ),
}
"""Table 1's rows on the algorithm API; a row's recipes are written only once its algorithm is registered."""


def registered(algorithm: str) -> bool:
    """Whether ``algorithm`` is in the package's registry (importing ``lightning_fedrep`` registers them)."""
    from lightning_fedrep import ALGORITHMS

    return algorithm in ALGORITHMS


def table1_methods() -> dict[str, Method]:
    """Every Table 1 row with a recipe: the family (:data:`METHODS`) and the registered :data:`BASELINES`."""
    return {**METHODS, **{name: m for name, m in BASELINES.items() if registered(m.algorithm)}}


def paper_number(column: str, method: str) -> float:
    """The paper's Table 1 accuracy (%) of ``method`` in ``column``."""
    if method in PAPER_ROWS:
        return PAPER_ROWS[method][PAPER_COLUMNS.index(column)]
    return TABLE1[column].paper["local" if method == "local_paper" else method]


def family_strategy(
    method: Method, participation: float, head_epochs: int, body_epochs: int, lg_shared: tuple[str, ...]
) -> dict:
    """The strategy's arguments for ``method``: FedRep trains ``head_epochs`` then ``body_epochs``, the
    others ``body_epochs`` local epochs; Local Only trains every client every round."""
    algorithm = (
        {"class_path": method.class_path, "init_args": method.args} if method.class_path else method.algorithm
    )
    strategy: dict = {"algorithm": algorithm, "clients_per_round": participation, "seed": 0}
    if method.algorithm == "fedrep":
        strategy.update(head_epochs=head_epochs, body_epochs=body_epochs)
    else:
        strategy["local_epochs"] = body_epochs
    if method.algorithm == "lg_fedavg":
        strategy["head"] = list(lg_shared)
    if method.algorithm == "local":  # main_local.py: every client, one optimizer for all its epochs
        strategy["clients_per_round"] = 1.0
        strategy["client_optimizer_state"] = "keep"
    if method.official_local:  # main_local.py: --epochs 10 passes, the first min(100, n) clients scored
        strategy["local_epochs"] = 10
        strategy["evaluate_clients"] = 100
    strategy.update(method.strategy_args)
    return strategy


def local_epochs_note(method: Method, setting: Table1Column) -> str:
    """Where the local epochs come from: the official FedAvg script of the column (FedAvg, FedAvg + FT),
    or the paper's rule (the others; no official script sets them)."""
    script, epochs = setting.fedavg_script
    if method.algorithm == "fedavg":
        if epochs != setting.body_epochs:
            return (
                f"Local epochs: {epochs}, as {script}; the paper's text says {setting.body_epochs} "
                '("the same number of local epochs as FedRep uses for the representation"). This recipe follows the script.'
            )
        return f"Local epochs: {epochs}, as {script} and the paper's text."
    if method.algorithm not in ("fedrep", "local"):
        return f"Local epochs: {setting.body_epochs}, the paper's rule (as FedRep's body epochs); no official script sets them."
    if method.algorithm == "fedrep":
        return f"Local epochs: 10 head + {setting.body_epochs} body, as the official scripts (local_ep, local_rep_ep)."
    return ""


FT_BASE = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD"}


def headline_note(method: Method, headline: str = "val/acc") -> str:
    """Which logged figure is the paper's number for ``method`` (``headline``: the column's metric)."""
    if method.algorithm == "local":  # main_local.py reports the accuracy after training
        return (
            f"The paper's figure is the accuracy after training: {headline} of the last round (results()['final']),"
            "\nnot the last-10 mean (which averages in the first, barely trained rounds)."
        )
    if method.callbacks:  # FedAvg + FT: the fine-tuned models, after the extra round
        return (
            f"The paper's figure is the fine-tuned accuracy: finetune/{headline} (validation after the fine-tuning round,"
            f"\nresults()['finetune']); {headline}_last10 is plain {FT_BASE[method.algorithm]}'s global model, not this method's figure."
        )
    if method.last_round:
        return f"The paper's figure is the last round's: {headline} of the last round (results()['final'])."
    return (
        f"The paper's figure is the mean over the last 10 rounds: {headline}_last10 (validation runs on each client's"
        "\ntest split, as the paper's code does)."
    )


def weight_decay(method: Method) -> float:
    """The method's own official weight decay, else the family's: none for Local Only (main_local.py), else 1e-4."""
    if method.weight_decay is not None:
        return method.weight_decay
    return 0.0 if method.algorithm == "local" else 1e-4


def column_clients(column: str) -> int:
    """The number of clients n of a Table 1 column (``<data>_<n>_<S>``)."""
    return int(column.rsplit("_", 2)[-2])


TABLE1_HEAD_EPOCHS = 10
TABLE1_FT_EPOCHS = 10
"""FedRep's head epochs and FedAvg + FT's fine-tuning epochs in the Table 1 recipes (the official code's)."""


def table1_recipe(column: str, method: str) -> tuple[str, str]:
    setting, spec = TABLE1[column], table1_methods()[method]
    script, script_epochs = setting.fedavg_script
    local_epochs = script_epochs if spec.algorithm == "fedavg" else setting.body_epochs
    strategy = family_strategy(
        spec,
        participation=0.1,
        head_epochs=TABLE1_HEAD_EPOCHS,
        body_epochs=local_epochs,
        lg_shared=setting.lg_shared,
    )
    if spec.algorithm in ("fedrep", "fedper", "lg_fedavg"):  # the official aliasing of w_locals
        strategy["first_state"] = "average"
    local_rounds = max(1, round(setting.rounds * 0.1))
    rounds = local_rounds if spec.algorithm == "local" else setting.rounds
    if spec.rounds:
        rounds = spec.rounds(setting.rounds)
    if spec.official_local:
        rounds, local_epochs = 1, 10
    headline = "val/acc" if spec.official_local else setting.headline  # main_local.py: unweighted
    path = f"{setting.folder}/{column.split('_', 1)[1]}_{method}.yaml"
    callbacks = [make(TABLE1_FT_EPOCHS, setting.ft_mode) for make in spec.callbacks]
    model_args = {**setting.model_args, **(setting.step_rule_model_args if spec.step_rule else {})}
    recipe = {
        "seed_everything": 0,
        "trainer": trainer_section(setting.folder, f"{column}-{method}", rounds, strategy, callbacks),
        "model": {
            "class_path": setting.model_class,
            "init_args": {
                **model_args,
                "lr": spec.lr(column_clients(column)) if spec.lr else 0.01,
                "momentum": 0.5,
                "weight_decay": weight_decay(spec),
            },
        },
        "data": {
            "class_path": setting.data_class,
            "init_args": {**setting.data_args, "batch_size": setting.batch_size, "seed": 0},
        },
    }
    cifar = setting.data_class.endswith(("CIFAR10DataModule", "CIFAR100DataModule"))
    if cifar:
        recipe["data"]["init_args"]["root"] = "data"
        recipe["data"]["init_args"]["download"] = True
        recipe["data"]["init_args"]["assignment"] = "official"
    n, s = column.rsplit("_", 2)[-2:]
    note = setting.note
    if spec.step_rule and setting.step_rule_note:
        assert f"{SENT140_LAYOUT_NOTE} " in note, column  # the sentence the step-rule recipes replace
        note = note.replace(f"{SENT140_LAYOUT_NOTE} ", setting.step_rule_note)
    protocol = [
        spec.note,
        ASSIGNMENT_NOTE if cifar else "",
        FIRST_STATE_NOTE if "first_state" in strategy else "",
        (setting.ft_note or FT_NOTE[setting.ft_mode]) if spec.callbacks else "",
        setting.local_note if spec.algorithm == "local" else "",
        "main_local.py scores the unweighted mean (val/acc), unlike this column's other recipes."
        if spec.official_local and setting.headline != "val/acc"
        else "",
    ]
    label = setting.name or f"{setting.folder.upper()} (n={n} clients, S={s} classes per client)"
    header = (
        f"FedRep paper Table 1, {label}, r=0.1, T={setting.rounds} rounds.\n"
        + spec.description.format(
            body=local_epochs,
            lg="+".join(setting.lg_shared),
            local_rounds=local_rounds,
            share="10%",
            ft="every layer" if setting.ft_mode == "full" else "only the head",
            ft_epochs=TABLE1_FT_EPOCHS,
            head=TABLE1_HEAD_EPOCHS,
        )
        + f".\nPaper: {paper_number(column, method):.2f}% mean client test accuracy (FedRep {paper_number(column, 'fedrep'):.2f}%)."
        + (f"\n{epochs}" if (epochs := local_epochs_note(spec, setting)) else "")
        + (f"\n{note}" if note else "")
        + "".join(f"\n{line}" for line in protocol if line)
        + f"\n{headline_note(spec, headline)}"
        + f"\nRun: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        f"FedRep Table 1, {setting.name.split(' (')[0] or setting.folder.upper()} ({n}, {s}): {method}",
        headline_figure(spec, headline),
        f"{paper_number(column, method):.2f}%",
    )
    return path, render(header, recipe)


DIGITS_LG_SHARED = ("body.2", "classifier")
DIGITS_HEAD_EPOCHS = 5
DIGITS_FT_EPOCHS = 5
"""FedRep's head epochs and FedAvg + FT's fine-tuning epochs in the digits demos."""


def digits_model_and_data() -> dict:
    """The offline digits demo's model and data: a 64-64-32-10 MLP, 20 clients with 2 classes each."""
    return {
        "model": {
            "class_path": "lightning_fedrep.models.MLPClassifier",
            "init_args": {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": {
            "class_path": "lightning_fedrep.data.digits.DigitsDataModule",
            "init_args": {"num_clients": 20, "classes_per_client": 2, "batch_size": 10, "seed": 0},
        },
    }


def digits_recipe(method: str) -> tuple[str, str]:
    spec = METHODS[method] if method in METHODS else COMPOSED[method]
    strategy = family_strategy(
        spec, participation=0.5, head_epochs=DIGITS_HEAD_EPOCHS, body_epochs=1, lg_shared=DIGITS_LG_SHARED
    )
    rounds = (1 if spec.official_local else 15) if spec.algorithm == "local" else 30
    callbacks = [make(DIGITS_FT_EPOCHS) for make in spec.callbacks]
    # checkpoints/last.ckpt after every round: what `lightning-fedrep test --ckpt_path` reads in the docs
    trainer = trainer_section("digits", f"digits-{method}", rounds, strategy, callbacks, accelerator="cpu")
    header = (
        "Offline demo on scikit-learn's handwritten digits: 20 clients with 2 classes each, "
        + ("every client each round" if spec.algorithm == "local" else "half of them per round")
        + ", a 64-64-32-10 MLP.\n"
        + spec.description.format(
            head=DIGITS_HEAD_EPOCHS,
            body=1,
            lg="+".join(DIGITS_LG_SHARED),
            local_rounds=rounds,
            share="50%",
            ft="only the head",
            ft_epochs=DIGITS_FT_EPOCHS,
        )
        + ".\nNot a paper setting: a small, real, offline stand-in, quick on a CPU."
        + f"\nRead {headline_figure(spec).replace('`', '')}, as in this method's paper recipes."
        + f"\nRun: lightning-fedrep fit --config recipes/digits/{method}.yaml"
    )
    recipe = {"seed_everything": 0, "trainer": trainer, **digits_model_and_data()}
    if spec.algorithm == "local":
        recipe["model"]["init_args"]["weight_decay"] = 0.0
    FACTS[f"digits/{method}.yaml"] = (
        f"offline demo (not a paper setting): {method}",
        headline_figure(spec),
        "—",
    )
    return f"digits/{method}.yaml", render(header, recipe)


@dataclass(frozen=True)
class LinearMethod:
    """A method on the synthetic low-rank linear problem: its local phases and the expected outcome."""

    description: str
    phases: tuple[dict, ...]
    expected: str


LINEAR = {
    "fedrep": LinearMethod(
        description="FedRep (Algorithm 2): exact least-squares head, then one full-batch gradient step on the body",
        phases=({"train": "head", "steps": 1}, {"train": "body", "steps": 1}),
        expected="dist(B, B*) ~2e-4 by round 200 (Thm. 1's linear convergence; the paper's Fig. 3, d=10 with the\n"
        "GD-GD baselines, is benchmarks/fedrep/fig3.py); val/loss (MSE) near the noise floor",
    ),
    "fedavg": LinearMethod(
        description="FedAvg: one full-batch gradient step on the shared (B, w) per client, everything averaged",
        phases=({"train": "all", "steps": 1},),
        expected="stays far from B* (dist ~1), val/loss (MSE) ~2, i.e. the paper's 1/2 MSE ~1 (Fig. 1); measured 1.95",
    ),
    "local": LinearMethod(
        description="Local Only: every client fits its own (B, w) by gradient steps on its 10 samples, no communication",
        phases=({"train": "all", "steps": 1},),
        expected="val/loss far above FedRep's: m=10 < d=20 samples cannot pin down a 20-dim model (Fig. 1);\n"
        "the paper's Local Only fits each client's d-dim regressor by least squares (benchmarks/fedrep/fig3.py)",
    ),
}


def linear_recipe(method: str) -> tuple[str, str]:
    spec = LINEAR[method]
    strategy = {
        "algorithm": method,
        "clients_per_round": 1.0 if method == "local" else 10,
        "phases": [dict(phase) for phase in spec.phases],
        "weighting": "uniform",
        "seed": 0,
    }
    trainer = trainer_section(
        "synthetic",
        f"synthetic-{method}-linear",
        200,
        strategy,
        accelerator="cpu",
        val_every=20,
        checkpoints=False,
    )
    header = (
        "FedRep paper Sec. 5.1: low-rank linear regression, d=20, k=2, n=100 clients with m=10 samples each,\n"
        "noise std 1e-3, method-of-moments init, 10% participation (Local Only: all clients, random init,\n"
        "no communication).\n"
        f"{spec.description}.\nExpected: {spec.expected}; watch val/principal_angle and val/loss (MSE).\n"
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
    FACTS[f"synthetic/{method}_linear.yaml"] = (
        f"FedRep Sec. 5.1 / Thm. 1 linear setting (d=20, k=2): {method}",
        "`val/principal_angle`, `val/loss`",
        spec.expected.split(" (")[0].split(";")[0],
    )
    return f"synthetic/{method}_linear.yaml", render(header, recipe)


SRPFL = {"fedrep": "FedRep-SRPFL", "lg_fedavg": "LG-SRPFL", "fedavg": "FLANP"}


def srpfl_recipe(algorithm: str) -> tuple[str, str]:
    """Digits, full participation, the n fastest clients (n = 5, doubling every 5 rounds), simulated
    Exp(1) client speeds (the SRPFL paper's fixed model); sim/time is the simulated clock."""
    name, spec = SRPFL[algorithm], METHODS[algorithm]
    strategy = family_strategy(
        spec, participation=1.0, head_epochs=5, body_epochs=1, lg_shared=DIGITS_LG_SHARED
    )
    participation = {
        "class_path": "lightning_fedrep.callbacks.AdaptiveParticipation",
        "init_args": {
            "initial_clients": 5,
            "rounds_per_stage": 5,
            "latency": {
                "class_path": "lightning_fedrep.callbacks.participation.FixedExponential",
                "init_args": {"rate": 1.0, "seed": 1},
            },
            "communication_cost": 0.0,
        },
    }
    callbacks = [participation, *(make(5) for make in spec.callbacks)]
    trainer = trainer_section(
        "digits", f"digits-{name.lower()}", 30, strategy, callbacks, accelerator="cpu", checkpoints=False
    )
    header = (
        f"{name} (SRPFL paper): {algorithm} on the digits (20 clients, 2 classes each), every client in the pool;\n"
        "each round only the n fastest train, n = 5 doubling every 5 rounds (capped at 20). Client speeds are\n"
        "simulated, drawn once from Exp(1) (the paper's fixed model; drop `latency` to measure real step times).\n"
        "Plot val/acc against sim/time (the simulated clock: figures/accuracy_vs_time.png) and compare with\n"
        "initial_clients: null (no selection).\n"
        f"Run: lightning-fedrep fit --config recipes/srpfl/digits_{algorithm}.yaml"
    )
    recipe = {"seed_everything": 0, "trainer": trainer, **digits_model_and_data()}
    FACTS[f"srpfl/digits_{algorithm}.yaml"] = (
        f"SRPFL demo on the digits (not a paper setting): {name}",
        "`figures/accuracy_vs_time.png` (`val/acc` vs `sim/time`)",
        "—",
    )
    return f"srpfl/digits_{algorithm}.yaml", render(header, recipe)


@dataclass(frozen=True)
class SRPFLSetting:
    """One data set of the SRPFL paper's Figures 3-6 as the official scripts run it
    (``experiments/full-participation/fixed-computation-time/<data>.sh``)."""

    data_class: str
    data_args: dict
    model_class: str
    model_args: dict
    rep_epochs: int  # FEDREP_local_rep_ep: how many (10 head epochs + 1 body epoch) blocks per round
    panel: str  # the paper's panel of Figure 3 (y-range of the curves)
    note: str = ""


SRPFL_PAPER = {
    "cifar10": SRPFLSetting(
        "lightning_fedrep.data.vision.CIFAR10DataModule",
        {"root": "data", "download": True, "num_clients": 100, "classes_per_client": 5},
        "lightning_fedrep.models.CIFAR10CNN",
        {},
        1,
        "CIFAR10, N=100, Shard=5 (accuracy 20-80%)",
    ),
    "cifar100": SRPFLSetting(
        "lightning_fedrep.data.vision.CIFAR100DataModule",
        {"root": "data", "download": True, "num_clients": 100, "classes_per_client": 20},
        "lightning_fedrep.models.CIFAR100CNN",
        {},
        5,
        "CIFAR100, N=100, Shard=20 (accuracy 10-60%)",
        "CIFAR100CNN has dropout, so this recipe runs on the sequential path.",
    ),
    "emnist": SRPFLSetting(
        "lightning_fedrep.data.vision.EMNISTDataModule",
        {
            "root": "data",
            "download": True,
            "split": "letters",
            "first_classes": 10,
            "num_clients": 100,
            "classes_per_client": 5,
            "test_draws": 50,
        },
        "lightning_fedrep.models.FEMNISTMLP",
        {"output": "softmax"},
        5,
        "EMNIST, N=100, Shard=5 (accuracy 20-90%)",
        "EMNIST: the official code's letters split, its first 10 letters (the paper says 'balanced').\n"
        "Test sets: test_draws: 50, as the official sampling.py (fewer than 100 test samples per client): each\n"
        "client's 5 class slots draw 50 test shards of 16 images each, with replacement, so 4,000 test samples\n"
        "per client (the disjoint cut would give 80).",
    ),
    "femnist": SRPFLSetting(
        "lightning_fedrep.data.leaf.LEAFDataModule",
        {
            "train_dir": "data/femnist_srpfl/train",
            "test_dir": "data/femnist_srpfl/test",
            "max_clients": 100,
            "user_order": "file",
        },
        "lightning_fedrep.models.FEMNISTMLP",
        {"output": "softmax"},
        5,
        "FEMNIST, N=100, Shard=3 (accuracy 10-90%)",
        "FEMNIST: the SRPFL code's re-sampling, 100 users of 150 samples (3 letters of a-j each), made by\n"
        "python scripts/femnist_sample.py RAW_DIR data/femnist_srpfl --srpfl (see the README).",
    ),
}
SRPFL_METHODS = {"fedrep_srpfl": ("FedRep-SRPFL", 10), "fedrep": ("FedRep", None)}


def srpfl_data(setting: SRPFLSetting) -> dict:
    """The ``data`` section of an SRPFL recipe: the panel's data set, batch 10, the official shard assignment
    where clients hold shards of classes."""
    init_args = {**setting.data_args, "batch_size": 10, "seed": 0}
    if "classes_per_client" in setting.data_args:
        init_args["assignment"] = "official"
    return {"class_path": setting.data_class, "init_args": init_args}


def srpfl_paper_recipe(data: str, method: str) -> tuple[str, str]:
    """The SRPFL paper's Figure 3 setting (full participation, fixed Exp(1) speeds, C.T. = 0) as the official
    scripts run it: M=100, n0=10 doubling every 10 rounds, 150 rounds, FedRep with (10 head + 1 body epoch)
    x rep_epochs per round, SGD lr 0.01 / momentum 0.5 / wd 1e-4, batch 10, evaluation at the official points
    (``ValidateAtRounds(every=10, last=3)``) after 10 epochs of head fine-tuning from the averaged model
    (``FineTunedEvaluation``); EMNIST test sets drawn with replacement (``test_draws=50``)."""
    setting, (name, n0) = SRPFL_PAPER[data], SRPFL_METHODS[method]
    phases = [
        {"train": part, "epochs": n}
        for _ in range(setting.rep_epochs)
        for part, n in (("head", 10), ("body", 1))
    ]
    strategy = {
        "algorithm": "fedrep",
        "clients_per_round": 1.0,
        "seed": 0,
        "phases": phases,
        "first_state": "average",
    }
    participation = {
        "class_path": "lightning_fedrep.callbacks.AdaptiveParticipation",
        "init_args": {
            "initial_clients": n0,
            "rounds_per_stage": 10,
            "latency": {
                "class_path": "lightning_fedrep.callbacks.participation.FixedExponential",
                "init_args": {"rate": 1.0, "seed": 1},
            },
            "communication_cost": 0.0,
        },
    }
    evaluation = {"class_path": "lightning_fedrep.callbacks.FineTunedEvaluation", "init_args": {"epochs": 10}}
    points = {
        "class_path": "lightning_fedrep.callbacks.ValidateAtRounds",
        "init_args": {"every": 10, "last": 3},
    }
    path = f"srpfl/{data}_{method}.yaml"
    recipe = {
        "seed_everything": 0,
        "trainer": trainer_section(
            "srpfl",
            f"{data}-{name.lower()}",
            150,
            strategy,
            [points, participation, evaluation],
            val_every=10,
        ),
        "model": {
            "class_path": setting.model_class,
            "init_args": {**setting.model_args, "lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
        },
        "data": srpfl_data(setting),
    }
    shards = "classes_per_client" in setting.data_args
    selection = (
        "each round only the n fastest of the M=100 clients train, n = 10 doubling every 10 rounds"
        if n0
        else "every round all M=100 clients train and the round waits for the slowest (the straggler-prone baseline)"
    )
    header = (
        f"{name}, SRPFL paper Figure 3 ({setting.panel}): full participation, fixed speeds, C.T. = 0;\n"
        f"{selection};\nclient speeds drawn once from Exp(1). FedRep: {setting.rep_epochs} x (10 head epochs + 1 body "
        "epoch) a round, 150 rounds,\n"
        "SGD lr 0.01 (the official scripts' default; the paper says 0.1), momentum 0.5, weight decay 1e-4,\n"
        "batch 10, aggregation weighted by samples (the code; the paper: a plain mean).\n"
        "Evaluation at the official code's 17 points, iter % 10 == 9 or iter >= 147 (ValidateAtRounds(every=10,\n"
        "last=3), which replaces check_val_every_n_epoch): every client fine-tunes the averaged head for 10\n"
        "epochs before it is scored (FineTunedEvaluation, the official --FT_epoch 10).\n"
        "The paper gives curves, no table: read val/acc_weighted (sample-weighted, as the official figures)\n"
        "against sim/time in history.csv (figures/accuracy_vs_time.png draws the unweighted val/acc) beside the\n"
        "other method's run; the x-axis values are not reproducible (an earlier code version). The official\n"
        "curves average 4 seeds (10, 20, 30, 40): run this with --seeds 10,20,30,40 (each seed sets seed_everything,\n"
        "the strategy's and the data's seed). The speeds come from the seeded FixedExponential (seed 1 in every\n"
        "run, as the official np.random.seed(1) draw, which this does not reproduce value for value).\n"
        + (f"{setting.note}\n" if setting.note else "")
        + (f"{ASSIGNMENT_NOTE}\n" if shards else "")
        + f"{FIRST_STATE_NOTE}\n"
        + f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        f"SRPFL Fig. 3, {setting.panel.split(' (')[0]}: {name}",
        "`val/acc_weighted` vs `sim/time` (`history.csv`)",
        f"curves only ({setting.panel.split(' (')[1].rstrip(')')})",
    )
    return path, render(header, recipe)


@dataclass(frozen=True)
class SRPFLBaseline:
    """A curve of the SRPFL paper's Figure 3 legend beyond FedRep(-SRPFL), as the official scripts run it."""

    label: str
    algorithm: str  # the registered algorithm
    script: str  # the official script (its --flanp flag: the doubling)
    doubling: bool  # n0 = 10 fastest, doubling every 10 rounds (FLANP's / SRPFL's selection)
    fine_tune: bool  # FineTunedEvaluation before each evaluation (the -FT curves, LG's local part)
    description: str


SRPFL_BASELINES = {
    "lg_srpfl": SRPFLBaseline(
        "LG-SRPFL",
        "lg_fedavg",
        "LG-ray.py --flanp",
        True,
        True,
        "LG-FedAvg wrapped by SRPFL: {shared} averaged, the rest local, trained jointly",
    ),
    "lg_fedavg": SRPFLBaseline(
        "LG-FedAvg",
        "lg_fedavg",
        "LG-ray.py",
        False,
        True,
        "LG-FedAvg: {shared} averaged, the rest local, trained jointly",
    ),
    "flanp": SRPFLBaseline(
        "FLANP",
        "fedavg",
        "FEDAVG-ray.py --flanp",
        True,
        False,
        "FedAvg with FLANP's adaptive doubling; global model",
    ),
    "flanp_ft": SRPFLBaseline(
        "FLANP-FT",
        "fedavg",
        "FEDAVG-ray.py --flanp",
        True,
        True,
        "FLANP (FedAvg with the adaptive doubling), each client's head fine-tuned before it is scored",
    ),
    "fedavg": SRPFLBaseline(
        "FedAvg", "fedavg", "FEDAVG-ray.py", False, False, "FedAvg; global model evaluated"
    ),
    "fedavg_ft": SRPFLBaseline(
        "FedAvg-FT",
        "fedavg",
        "FEDAVG-ray.py",
        False,
        True,
        "FedAvg, each client's head fine-tuned before it is scored",
    ),
    "hf_maml": SRPFLBaseline(
        "HFMAML",
        "hf_maml",
        "HFMAML-ray.py",
        False,
        False,
        "HF-MAML (alpha = 1e-2, beta = 1e-1, delta = 1e-3), not wrapped by SRPFL; everything averaged",
    ),
}
"""SRPFL's Figure 3 legend beyond :data:`SRPFL_METHODS` (shared/reference/srpfl.md §2); recipes are written
only for registered algorithms."""
SRPFL_LG_SHARED = {"cifar10": ("fc2", "fc3"), "cifar100": ("fc2", "fc3")}  # the code's LG global keys
SRPFL_MLP_LG_SHARED = ("layer_hidden2", "layer_out")  # EMNIST / FEMNIST MLP


def srpfl_baseline_strategy(spec: SRPFLBaseline, data: str, local_epochs: int) -> dict:
    """The strategy of an SRPFL baseline: full participation, ``local_epochs`` epochs (all parameters)."""
    if spec.algorithm == "hf_maml":  # parts: 1, the official D = D' = D'' (batch 10, as HFMAML's docstring)
        algorithm: str | dict = {
            "class_path": "lightning_fedrep.HFMAML",
            "init_args": {"alpha": 0.01, "delta": 0.001, "parts": 1},
        }
    else:
        algorithm = spec.algorithm
    strategy: dict = {
        "algorithm": algorithm,
        "clients_per_round": 1.0,
        "seed": 0,
        "local_epochs": local_epochs,
    }
    if spec.algorithm == "lg_fedavg":
        strategy["head"] = list(SRPFL_LG_SHARED.get(data, SRPFL_MLP_LG_SHARED))
        strategy["first_state"] = "average"  # LG-ray.py's local_heads alias net_glob's tensors
    return strategy


def srpfl_baseline_recipe(data: str, method: str) -> tuple[str, str]:
    """A Figure 3 legend curve other than FedRep(-SRPFL): the setting of :func:`srpfl_paper_recipe`, the
    official script's method. FedAvg / FLANP and LG: plain SGD lr 0.01, no momentum, weight decay 1e-4,
    ``local_ep`` 1 (CIFAR10) or 5; HF-MAML: SGD lr beta = 0.1 without momentum or weight decay, 5 epochs (the
    official ``args.local_ep``; its ``HFMAML_local_ep`` flag is ignored)."""
    setting, spec = SRPFL_PAPER[data], SRPFL_BASELINES[method]
    hf_maml = spec.algorithm == "hf_maml"
    local_epochs = (
        5 if hf_maml else setting.rep_epochs
    )  # rep_epochs: the scripts' local_ep (1 CIFAR10, else 5)
    strategy = srpfl_baseline_strategy(spec, data, local_epochs)
    participation = {
        "class_path": "lightning_fedrep.callbacks.AdaptiveParticipation",
        "init_args": {
            "initial_clients": 10 if spec.doubling else None,
            "rounds_per_stage": 10,
            "latency": {
                "class_path": "lightning_fedrep.callbacks.participation.FixedExponential",
                "init_args": {"rate": 1.0, "seed": 1},
            },
            "communication_cost": 0.0,
        },
    }
    points = {
        "class_path": "lightning_fedrep.callbacks.ValidateAtRounds",
        "init_args": {"every": 10, "last": 3},
    }
    callbacks = [points, participation]
    if (
        spec.fine_tune
    ):  # the official fine_tune: SGD momentum 0.5, weight decay 1e-4, lr 0.01, whatever trained
        callbacks.append(
            {
                "class_path": "lightning_fedrep.callbacks.FineTunedEvaluation",
                "init_args": {"epochs": 10, "optimizer": "sgd"},
            }
        )
        if spec.algorithm == "lg_fedavg":  # the tuned local part is not a declared head: full passes
            callbacks[-1]["init_args"]["cache_features"] = False
    path = f"srpfl/{data}_{method}.yaml"
    recipe = {
        "seed_everything": 0,
        "trainer": trainer_section(
            "srpfl", f"{data}-{method.replace('_', '-')}", 150, strategy, callbacks, val_every=10
        ),
        "model": {
            "class_path": setting.model_class,
            "init_args": {
                **setting.model_args,
                "lr": 0.1 if hf_maml else 0.01,
                "momentum": 0.0,
                "weight_decay": 0.0 if hf_maml else 1e-4,
            },
        },
        "data": srpfl_data(setting),
    }
    shards = "classes_per_client" in setting.data_args
    shared = "+".join(SRPFL_LG_SHARED.get(data, SRPFL_MLP_LG_SHARED))
    selection = (
        "each round only the n fastest of the M=100 clients train, n = 10 doubling every 10 rounds"
        if spec.doubling
        else "every round all M=100 clients train and the round waits for the slowest"
    )
    if hf_maml:
        optimizer = (
            "HF-MAML: HFMAML(alpha: 0.01, delta: 0.001, parts: 1); the outer step is the model's SGD at beta = 0.1, no\n"
            "momentum, no weight decay; 5 local epochs for every data set (the official LocalUpdateHFMAML reads\n"
            "args.local_ep, default 5: the scripts' --HFMAML_local_ep is ignored). parts: 1 with batch 10 is the official\n"
            "computation (D = D' = D'' = the batch); parts: 3 with batch_size: 30 gives the paper's independent batches.\n"
            "Evaluation: the global model after one SGD step (alpha) on one batch of each client's training data, as the\n"
            "official test_MAML (the algorithm's own evaluation; the stored model is unchanged)."
        )
    else:
        optimizer = (
            f"{local_epochs} local epoch(s) a round (the script's --{'LG' if spec.algorithm == 'lg_fedavg' else 'FEDAVG'}"
            "_local_ep) of plain SGD: lr 0.01, no momentum, weight decay 1e-4\n"
            "(the official LocalUpdate"
            + ("LG" if spec.algorithm == "lg_fedavg" else "FEDAVG")
            + "; the paper says lr 0.1)."
        )
    evaluation = ""
    if spec.fine_tune:
        tuned = "the local part (all but " + shared + ")" if spec.algorithm == "lg_fedavg" else "the head"
        evaluation = (
            f"Evaluation: every client fine-tunes {tuned} of the averaged model for 10 epochs before it is scored\n"
            "(FineTunedEvaluation, optimizer: sgd: the official fine_tune's SGD, momentum 0.5, weight decay 1e-4, lr 0.01)."
        )
        if spec.algorithm == "lg_fedavg":
            evaluation += (
                "\ncache_features: false: LG tunes the layers below the shared ones, so the features cannot be cached (the\n"
                "MLP's declared forward_features/forward_head split is not that one)."
            )
    elif not hf_maml:
        evaluation = "Evaluation: the global model, no fine-tuning (the official global_accs)."
    header = (
        f"{spec.label}, SRPFL paper Figure 3 ({setting.panel}): full participation, fixed speeds, C.T. = 0;\n"
        f"{selection};\nclient speeds drawn once from Exp(1). "
        + spec.description.format(shared=shared)
        + f", 150 rounds, batch 10,\naggregation weighted by samples, as the official {spec.script}.\n"
        + f"{optimizer}\n"
        + (f"{evaluation}\n" if evaluation else "")
        + "Evaluation at the official code's 17 points (ValidateAtRounds(every=10, last=3)).\n"
        "The paper gives curves, no table: read val/acc_weighted (sample-weighted, as the official figures)\n"
        "against sim/time in history.csv beside the other legend curves' runs. The official curves average 4 seeds\n"
        "(10, 20, 30, 40): run this with --seeds 10,20,30,40.\n"
        + (f"{setting.note}\n" if setting.note else "")
        + (f"{ASSIGNMENT_NOTE}\n" if shards else "")
        + (f"{FIRST_STATE_NOTE}\n" if "first_state" in strategy else "")
        + f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        f"SRPFL Fig. 3, {setting.panel.split(' (')[0]}: {spec.label}",
        "`val/acc_weighted` vs `sim/time` (`history.csv`)",
        f"curves only ({setting.panel.split(' (')[1].rstrip(')')})",
    )
    return path, render(header, recipe)


def srpfl_baselines() -> list[str]:
    """The :data:`SRPFL_BASELINES` whose algorithm is registered now."""
    return [name for name, spec in SRPFL_BASELINES.items() if registered(spec.algorithm)]


RECIPES_README = """# Recipes

Every recipe is a LightningCLI config: `lightning-fedrep fit --config recipes/<path>`. Each file's header says
what it reproduces, which logged figure is the paper's number and where the recipe follows the official code
rather than the paper's text. This table is written by `recipes/generate.py` from the same tables as the
headers (`python recipes/generate.py --check` is run by the tests). The paper recipes need the data sets
(CIFAR downloads with `--data.download true`; FEMNIST and Sent140 from LEAF, Sent140's GloVe vectors from
Stanford, see `docs/recipes.md`) and a GPU to finish in hours; only the digits and synthetic recipes were run
to the end here (see `docs/benchmarks.md` for their measured results and costs); every recipe is smoke-run by the
test suite on generated files in the real formats.

The last column is how many seeds (independent repeats, each with a new partition) the paper's number
averages. Run a recipe over seeds with `lightning-fedrep fit --config recipes/<path> --seeds 1,2,3` and read
mean ± std (sample std, ddof=1) beside the paper's number with `lightning-fedrep table runs/<folder>`; each
header's `Seeds table:` line tells `table` the figure to read and the paper's number.

| recipe | reproduces | figure to read | paper | seeds the paper averaged |
|---|---|---|---|---|
"""


def paper_seeds(path: str) -> str:
    """How many seeds the paper behind recipe ``path`` averaged (shared/reference/fedrep.md §5,
    flute.md §6, srpfl.md §2; CENTAUR: the camera-ready scripts' ``--n_runs``, privacy.md §3)."""
    if path == "sent140/183_2_fedrep.yaml":
        return "2 (the official FedRep_sent140.sh: `for RUN in 1 2`; the paper does not say)"
    if path.startswith(("cifar10/", "cifar100/", "femnist/", "sent140/")):
        return "5 (the official scripts' `for RUN in 1 2 3 4 5`; the paper does not say)"
    if path.startswith("flute/"):
        return "not stated (the paper gives mean ± std)"
    if path.startswith("srpfl/") and not path.startswith("srpfl/digits_"):
        return "4 (the official scripts: seeds 10, 20, 30, 40)"
    if path.startswith("synthetic/"):
        return "not stated"
    if path.startswith("privacy/cifar100_1000_20_"):
        return "1 (the official camera-ready script: `--n_runs 1`)"
    if path.startswith("privacy/"):
        return "3 (the official camera-ready scripts: `--n_runs 3`)"
    if (
        path.startswith("pfllib/")
        and PFLLIB_BEST_ROUND[path.removeprefix("pfllib/")] == "not on the leaderboard"
    ):
        return "— (not on PFLlib's leaderboard)"
    if path.startswith("pfllib/"):
        return "3 (PFLlib's leaderboard: 3 runs on one generated partition)"
    return "— (not a paper setting)"


def table_figure(figure: str) -> str:
    """The logged name ``lightning-fedrep table`` reads for a README "figure to read" cell: its first
    backquoted metric (``val/acc_last10``, ``finetune/val/acc``; a plain name is the last round's)."""
    return next(t for t in figure.split("`")[1::2] if not t.startswith("figures/"))


def table_line(path: str) -> str:
    """The header line ``lightning-fedrep table`` reads: the figure, the paper's number, the paper's seeds."""
    _, figure, paper = FACTS[path]
    return f"Seeds table: figure {table_figure(figure)}; paper {paper}; seeds the paper averaged: {paper_seeds(path)}"


def recipes_readme() -> str:
    """``recipes/README.md``: one row per recipe from :data:`FACTS` (call after the recipes are built)."""
    rows = [
        f"| `{path}` | {a} | {b} | {c} | {paper_seeds(path)} |"
        for path, (a, b, c) in sorted(FACTS.items())
        if not path.startswith("pfllib/")  # their own section, with PFLlib's best-round figure beside ours
    ]
    return RECIPES_README + "\n".join(rows) + "\n" + pfllib_readme_section()


def all_recipes() -> dict[str, str]:
    recipes = [digits_recipe(m) for m in DIGITS_METHODS]
    recipes += [table1_recipe(c, m) for c in TABLE1 for m in table1_methods()]
    recipes += [linear_recipe(m) for m in LINEAR]
    recipes += [srpfl_recipe(a) for a in SRPFL]
    recipes += [srpfl_paper_recipe(d, m) for d in SRPFL_PAPER for m in SRPFL_METHODS]
    recipes += [srpfl_baseline_recipe(d, m) for d in SRPFL_PAPER for m in srpfl_baselines()]
    texts = dict(recipes)
    texts.update({f"flute/{path}": text for path, text in flute_recipes().items()})
    FACTS.update({f"flute/{path}": facts for path, facts in FLUTE_FACTS.items()})
    texts.update(privacy_recipes())  # paths under recipes/ (privacy/ and the offline pair in digits/)
    FACTS.update(PRIVACY_FACTS)
    texts.update({f"pfllib/{path}": text for path, text in pfllib_recipes().items()})
    FACTS.update({f"pfllib/{path}": facts for path, facts in PFLLIB_FACTS.items()})
    texts.update(transformers_recipes())  # paths under recipes/transformers/
    FACTS.update(TRANSFORMERS_FACTS)
    for path in FACTS:  # the line `lightning-fedrep table` reads, above the generator's note
        texts[path] = texts[path].replace("# Generated by", f"# {table_line(path)}\n# Generated by", 1)
    texts["README.md"] = recipes_readme()
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
