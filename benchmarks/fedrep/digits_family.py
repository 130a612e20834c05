"""The FedRep family on real data: scikit-learn digits split non-iid, the papers' protocol.

Claims checked (Collins et al. 2021, Table 1 and Sec. 5, qualitatively; the paper's CIFAR/FEMNIST
numbers cannot be reproduced offline): under a label-skewed split, the personalized methods that
share a representation (FedRep, FedPer, FedAvg + fine-tuning) beat one global model (FedAvg) and
training alone (Local Only), and FedRep is at least as good as FedPer and LG-FedAvg.

Everything runs through ``FederatedStrategy`` on ``DigitsDataModule`` (50 clients, 3 classes each,
``ShardPartitioner``; a 50/50 train/test split of the 1,797 digits, so ~18 train and ~18 test samples
per client, ~6 per class) with ``MLPClassifier`` (64-64-32 body, linear ``classifier`` head; SGD lr 0.05,
momentum 0.5, weight decay 1e-4, batch 10), a fresh optimizer per client per round:

* FedRep: ``algorithm="fedrep"``, ``head_epochs`` head epochs then ``local_epochs`` body epochs.
* FedPer: ``algorithm="fedper"`` (head and body jointly, ``local_epochs``), body averaged.
* FedAvg: ``algorithm="fedavg"`` (``local_epochs``), the global model tested on every client.
* FedAvg + FT: the same FedAvg run with ``HeadFineTuning(epochs=10, mode="head")``: after the last
  round every client fine-tunes only the head for 10 epochs (the FedRep paper's protocol).
* LG-FedAvg: ``algorithm="lg_fedavg"`` with the global part ``head=("body.2", "classifier")`` (the
  last hidden layer and the output layer, as LG-FedAvg's code shares for the FEMNIST MLP); the first
  layer is local.
* Local Only: ``algorithm="local"``, every client trains alone on its data (all clients every round).
* FedProx, SCAFFOLD (and + FT): ``algorithm="fedprox"`` / ``"scaffold"`` (the official defaults: mu 0.1;
  lr_g 0.1, clip 10), ``local_epochs``, the global model tested; + FT as FedAvg + FT.
* Fed-MTL, Per-FedAvg, APFL, Ditto: ``algorithm="fed_mtl"`` / ``"per_fedavg"`` / ``"apfl"`` / ``"ditto"``
  with their registered defaults (the official hyper-parameters: Fed-MTL 10^-f; Per-FedAvg 80/20 split,
  inner lr x 0.001, 5 epochs of adaptation before scoring; APFL alpha 0.75; Ditto lam 1), ``local_epochs``.
* L2GD: ``algorithm="l2gd"`` (p 0.9, alpha 1, lam 0.5), full participation as the official code, for
  ``l2gd_rounds = 10`` rounds (as many client trainings as the others' 50 rounds x 10 clients); its local
  steps run at the official lr alpha / (n (1 - p)) = 1 / (50 x 0.1) = 0.2 (the others at the MLP's 0.05).

Protocol: per round 10 of the 50 clients train; validation every round on each client's own test
split; ``strategy.results()`` gives the mean client test accuracy of the last round (``final``) and the
mean over the last 10 rounds (``last10``, the FedRep code's figure); FedAvg + FT reports its single
fine-tuned evaluation. Mean +- std over seeds (each seed re-splits the data, re-partitions and
re-initialises; within a seed every method starts from the same initial weights).

Reduced vs the paper: 50 clients (paper: 100-1000), 10 per round (r = 0.2; paper 0.1), ``T = 50``
rounds (paper 100-200), 5 head epochs for FedRep (paper 10) and 2 local epochs for the representation
/ the other methods (the paper's rule: the baselines' local epochs equal FedRep's body epochs), Local
Only 50 local epochs (25 rounds x 2 epochs), 3 seeds; an MLP on 8x8 digits instead of CNNs on CIFAR.
The 50/50 split (the data module's default is 80/20) gives each client ~18 test samples instead of ~7
and leaves it little training data, the regime in which the paper says federation helps; digits are
easy, so Local Only stays strong (as in the paper's CIFAR10 (100, 2) column, where it wins).

``--data synthetic`` runs the same methods and protocol on the synthetic federation
(:class:`~lightning_fedrep.data.synthetic_classification.SyntheticClassificationDataModule`: 50 clients,
2 of 10 classes each, 20 training and 20 test samples per client of 20-dimensional inputs, labels a
per-client linear classifier of one shared nonlinear representation), with ``MLPClassifier(in_features=20)``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/fedrep/digits_family.py [--rounds 50] [--seeds 0 1 2] [--data synthetic]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import Stopwatch, format_table, make_trainer, print_footer, quiet  # noqa: E402
from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.callbacks import HeadFineTuning  # noqa: E402
from lightning_fedrep.data.digits import DigitsDataModule  # noqa: E402
from lightning_fedrep.data.partition import DirichletPartitioner  # noqa: E402
from lightning_fedrep.data.synthetic_classification import SyntheticClassificationDataModule  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402

LABELS = {
    "fedrep": "FedRep",
    "fedper": "FedPer",
    "fedavg_ft": "FedAvg + FT (head, 10 ep)",
    "fedavg": "FedAvg (global model)",
    "lg_fedavg": "LG-FedAvg",
    "local": "Local Only",
    "fedprox": "FedProx (global model)",
    "fedprox_ft": "FedProx + FT (head, 10 ep)",
    "scaffold": "SCAFFOLD (global model)",
    "scaffold_ft": "SCAFFOLD + FT (head, 10 ep)",
    "fed_mtl": "Fed-MTL",
    "per_fedavg": "Per-FedAvg (5 ep adapted)",
    "l2gd": "L2GD",
    "apfl": "APFL",
    "ditto": "Ditto",
}
METHODS = tuple(LABELS)
"""Every method, in the table's order."""
PERSONALIZED = (
    "fedrep",
    "fedper",
    "fedavg_ft",
    "lg_fedavg",
    "fedprox_ft",
    "scaffold_ft",
    "fed_mtl",
    "per_fedavg",
    "l2gd",
    "apfl",
    "ditto",
)
# one global model each; their "+ FT" rows fine-tune it after the last round
GLOBAL = ("fedavg", "fedprox", "scaffold")
# registered algorithms, run with their defaults (the official hyper-parameters)
PERSONAL = ("fed_mtl", "per_fedavg", "apfl", "ditto")
LG_GLOBAL = ("body.2", "classifier")


@dataclass(frozen=True)
class Settings:
    rounds: int = 50
    num_clients: int = 50
    classes_per_client: int = 3
    clients_per_round: float | int = 10
    head_epochs: int = 5
    local_epochs: int = 2
    finetune_epochs: int = 10
    local_only_rounds: int = 25
    local_only_epochs: int = 2
    l2gd_rounds: int = 10  # full participation: 10 rounds x 50 clients = 50 rounds x 10 clients
    batch_size: int = 10
    test_fraction: float = 0.5
    data: str = "digits"
    synthetic_samples: int = 20  # training and test samples per synthetic client
    dirichlet_alpha: float | None = None  # digits only: DirichletPartitioner(alpha) instead of the shards
    min_samples_per_client: int = 5  # the Dirichlet split's least training samples per client


DATA = ("digits", "synthetic")


def _datamodule(seed: int, s: Settings) -> DigitsDataModule | SyntheticClassificationDataModule:
    """One seed's federation: digits (re-split and re-partitioned per seed: ``classes_per_client`` shards, or
    ``DirichletPartitioner`` where ``dirichlet_alpha`` is set) or the synthetic one."""
    if s.data == "synthetic":
        return SyntheticClassificationDataModule(
            num_clients=s.num_clients,
            samples_per_client=s.synthetic_samples,
            test_samples_per_client=s.synthetic_samples,
            classes_per_client=2,
            batch_size=s.batch_size,
            seed=seed,
        )
    partitioner = None
    if s.dirichlet_alpha is not None:
        partitioner = DirichletPartitioner(s.num_clients, s.dirichlet_alpha, s.min_samples_per_client)
    return DigitsDataModule(
        num_clients=s.num_clients,
        classes_per_client=s.classes_per_client,
        partitioner=partitioner,
        batch_size=s.batch_size,
        test_fraction=s.test_fraction,
        seed=seed,
    )


def _fit(algorithm: str, seed: int, s: Settings, **strategy_kwargs) -> tuple[FederatedStrategy, float]:
    """Train one algorithm on one seed's federation (``s.data``); returns the strategy and wall seconds.

    ``strategy_kwargs`` go to ``FederatedStrategy`` but for ``model`` (keywords of the model), ``model_class``
    (``MLPClassifier`` unless given), ``callbacks`` and ``rounds`` (``s.rounds`` unless given)."""
    watch = Stopwatch()
    dm = _datamodule(seed, s)
    torch.manual_seed(seed)  # the same initial weights for every method of this seed
    inputs = {"in_features": 20} if s.data == "synthetic" else {}
    model_class = strategy_kwargs.pop("model_class", MLPClassifier)
    model = model_class(**inputs, **strategy_kwargs.pop("model", {}))
    callbacks = strategy_kwargs.pop("callbacks", [])
    rounds = strategy_kwargs.pop("rounds", s.rounds)
    strategy = FederatedStrategy(algorithm=algorithm, seed=seed, **strategy_kwargs)
    trainer = make_trainer(rounds, strategy=strategy, callbacks=callbacks, check_val_every_n_epoch=1)
    trainer.fit(model, datamodule=dm)
    return strategy, watch.elapsed


def run_seed(seed: int, s: Settings = Settings(), methods: tuple[str, ...] = METHODS) -> dict[str, dict]:
    """Every method on one seed: ``{method: {"final": acc, "last10": acc, "seconds": s, "runner": name}}``
    (acc in %; ``runner``: the runner ``runner="auto"`` chose, ``"vectorized"`` or ``"sequential"``)."""
    out: dict[str, dict] = {}

    def record(name: str, strategy: FederatedStrategy, seconds: float) -> None:
        results = strategy.results()
        out[name] = {
            "final": 100 * results["final"]["val/acc"],
            "last10": 100 * results["last10"]["val/acc"],
            "seconds": seconds,
            "runner": strategy.runner_report.runner,
        }

    per_round = s.clients_per_round
    if "fedrep" in methods:
        record(
            "fedrep",
            *_fit(
                "fedrep",
                seed,
                s,
                clients_per_round=per_round,
                head_epochs=s.head_epochs,
                body_epochs=s.local_epochs,
            ),
        )
    if "fedper" in methods:
        record("fedper", *_fit("fedper", seed, s, clients_per_round=per_round, local_epochs=s.local_epochs))
    for algorithm in GLOBAL:
        if algorithm not in methods and f"{algorithm}_ft" not in methods:
            continue
        tuned = f"{algorithm}_ft" in methods
        finetune = [HeadFineTuning(epochs=s.finetune_epochs, mode="head")] if tuned else []
        strategy, seconds = _fit(
            algorithm,
            seed,
            s,
            clients_per_round=per_round,
            local_epochs=s.local_epochs,
            head="classifier",
            callbacks=finetune,
        )
        record(algorithm, strategy, seconds)
        if finetune:
            accuracy = 100 * strategy.results()["finetune"]["finetune/val/acc"]
            out[f"{algorithm}_ft"] = {**out[algorithm], "final": accuracy, "last10": float("nan")}
    if "lg_fedavg" in methods:
        record(
            "lg_fedavg",
            *_fit(
                "lg_fedavg",
                seed,
                s,
                clients_per_round=per_round,
                local_epochs=s.local_epochs,
                head=LG_GLOBAL,
            ),
        )
    if "local" in methods:
        record(
            "local",
            *_fit(
                "local",
                seed,
                s,
                clients_per_round=1.0,
                local_epochs=s.local_only_epochs,
                rounds=s.local_only_rounds,
            ),
        )
    for algorithm in PERSONAL:
        if algorithm in methods:
            run = _fit(algorithm, seed, s, clients_per_round=per_round, local_epochs=s.local_epochs)
            record(algorithm, *run)
    if "l2gd" in methods:  # every client every round: as many client-rounds as the others in fewer rounds
        record(
            "l2gd",
            *_fit(
                "l2gd",
                seed,
                s,
                clients_per_round=1.0,
                local_epochs=s.local_epochs,
                rounds=s.l2gd_rounds,
                model={"lr": 1.0 / (s.num_clients * (1 - 0.9))},  # the official alpha / (n (1 - p))
            ),
        )
    return out


def summarize(per_seed: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Mean and (sample) std over seeds of ``final``/``last10``, and the mean wall time."""

    def stats(values: list[float]) -> tuple[float, float]:
        if any(v != v for v in values):  # NaN: a figure the method does not have (FedAvg + FT's last10)
            return float("nan"), float("nan")
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    summary = {}
    for method in per_seed[0]:
        final = [r[method]["final"] for r in per_seed]
        last10 = [r[method]["last10"] for r in per_seed]
        summary[method] = {
            "final": stats(final),
            "last10": stats(last10),
            "seconds": statistics.fmean(r[method]["seconds"] for r in per_seed),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", choices=DATA, default="digits")
    args = parser.parse_args()
    quiet()
    watch = Stopwatch()
    settings = Settings(rounds=args.rounds, data=args.data)
    per_seed = []
    for seed in args.seeds:
        per_seed.append(run_seed(seed, settings))
        print(f"seed {seed} done after {watch.elapsed:.0f} s", flush=True)
    report(per_seed, args.seeds, settings)
    print_footer(watch)


def report(per_seed: list[dict[str, dict]], seeds: list[int], settings: Settings) -> None:
    """Print the mean +- std table, the margins and the per-seed accuracies."""
    summary = summarize(per_seed)
    print(
        f"\nFedRep family on {settings.data}: {settings.num_clients} clients x "
        f"{2 if settings.data == 'synthetic' else settings.classes_per_client} classes, "
        f"{settings.clients_per_round} clients/round, T={settings.rounds} rounds; mean client test accuracy (%), "
        f"mean +- std over seeds {seeds}\n"
    )

    def pm(pair: tuple[float, float]) -> str:
        return "n/a" if pair[0] != pair[0] else f"{pair[0]:.2f} +- {pair[1]:.2f}"

    headers = ["method", "final", "last-10-round mean", "wall s per seed"]
    rows = [
        [LABELS[m], pm(summary[m]["final"]), pm(summary[m]["last10"]), f"{summary[m]['seconds']:.1f}"]
        for m in METHODS
        if m in summary
    ]
    print(format_table(headers, rows))
    print(
        "\nX + FT is the X run plus one head-fine-tuning round (its wall time is the shared run's; "
        "it has one evaluation, so no last-10 mean)."
    )
    print(
        "\nmargins of the personalized methods (final accuracy, percentage points, mean +- std over seeds):\n"
    )
    margin_rows = []
    for method in PERSONALIZED:
        if method not in summary:
            continue
        cells = [LABELS[method]]
        for baseline in ("fedavg", "local"):
            diffs = [r[method]["final"] - r[baseline]["final"] for r in per_seed]
            mean_diff = statistics.fmean(diffs)
            std_diff = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            cells.append(f"{mean_diff:+.2f} +- {std_diff:.2f}")
        margin_rows.append(cells)
    print(format_table(["method", "vs FedAvg", "vs Local Only"], margin_rows))
    print("\nper seed (final accuracy %):")
    for seed, result in zip(seeds, per_seed):
        print(
            f"  seed {seed}: "
            + ", ".join(f"{LABELS[m]} {result[m]['final']:.2f}" for m in METHODS if m in result)
        )


if __name__ == "__main__":
    main()
