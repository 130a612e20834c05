"""Best round versus last rounds: how much the leaderboard's figure (the best round) overstates, measured.

PFLlib's leaderboard reports, per run, the maximum over rounds of the pooled test accuracy (total correct
over total test samples of all clients; ``val/acc_weighted`` here), then mean ± std over runs. This
package's headline is the mean over the last 10 rounds (``val/acc_last10``) and the last round
(``final``). The best round is chosen on the test set itself, so it is biased upward: the maximum of noisy
per-round accuracies exceeds their typical value, more so with more rounds and fewer test samples.

Each method trains on the offline digits federation of ``benchmarks/fedrep/digits_family.py`` (50
clients, 3 classes each; MLP; 10 clients per round; validation of every client every round) with the
family's 50/50 train/test split (~18 test samples per client, ~900 in all) and with a 90/10 split (~180 in
all), for 50 and 200 rounds. Per regime and method the script prints mean ± std over seeds of the pooled
accuracy's final round, last-10 mean, best round (``val/acc_weighted_best``) and the gaps: best minus
last-10, and the best of the last 10 rounds minus their mean (the selection effect alone, on rounds where
training has levelled off), with the round the best fell in; and the best-minus-last-10 gap of the mean
over clients (``val/acc``).

Usage (from the repository root)::

    .venv/bin/python benchmarks/evaluation/best_round_bias.py [--rounds 50 200] [--test-fractions 0.5 0.1]
        [--seeds 0 1 2] [--methods fedavg fedper fedrep ditto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import Stopwatch, format_table, make_trainer, print_footer, quiet  # noqa: E402
from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.data.digits import DigitsDataModule  # noqa: E402
from lightning_fedrep.federation.history import LAST_ROUNDS  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402

METHODS: dict[str, tuple[str, dict]] = {
    "fedavg": ("FedAvg (global model)", {"local_epochs": 2, "head": "classifier"}),
    "fedper": ("FedPer", {"local_epochs": 2}),
    "fedrep": ("FedRep", {"head_epochs": 5, "body_epochs": 2}),
    "ditto": ("Ditto", {"local_epochs": 2}),
}
"""Each method's label and strategy settings (``digits_family.py``'s)."""
POOLED, MEAN = "val/acc_weighted", "val/acc"


def fit(algorithm: str, seed: int, rounds: int, test_fraction: float = 0.5) -> FederatedStrategy:
    """One method on one seed's digits federation (the same initial weights for every method of a seed)."""
    data = DigitsDataModule(
        num_clients=50, classes_per_client=3, batch_size=10, test_fraction=test_fraction, seed=seed
    )
    torch.manual_seed(seed)
    model = MLPClassifier()
    strategy = FederatedStrategy(
        algorithm=algorithm, seed=seed, clients_per_round=10, **METHODS[algorithm][1]
    )
    make_trainer(rounds, strategy=strategy, check_val_every_n_epoch=1).fit(model, datamodule=data)
    return strategy


def figures(strategy: FederatedStrategy) -> dict[str, float]:
    """A run's figures (accuracies in %): the pooled accuracy's final, last-10, best and its round, the best
    of the last 10 rounds, the mean over clients' last-10 and best, and the pooled test samples."""
    results = strategy.results()
    last = [row[POOLED] for row in strategy.history if POOLED in row][-LAST_ROUNDS:]
    return {
        "final": 100 * results["final"][POOLED],
        "last10": 100 * results["last10"][POOLED],
        "best": 100 * results["best"][POOLED],
        "best_round": results["best_round"][POOLED],
        "best_of_last10": 100 * max(last),
        "mean_last10": 100 * results["last10"][MEAN],
        "mean_best": 100 * results["best"][MEAN],
        "test_samples": sum(strategy.client_metrics["val"].samples.values()),
    }


Regime = tuple[int, float]
"""Rounds and test fraction."""


def measure(
    seeds: Sequence[int], regime: Regime = (50, 0.5), methods: Sequence[str] = tuple(METHODS)
) -> dict[str, list[dict]]:
    """One regime: ``{method: [figures of each seed]}``."""
    return {method: [figures(fit(method, seed, *regime)) for seed in seeds] for method in methods}


def _pm(values: Sequence[float], sign: str = "") -> str:
    """``mean ± std`` (``sign="+"``: a gap, signed; a rounding error's ``-0.00`` shown as ``+0.00``)."""
    mean = round(statistics.fmean(values), 2) + 0.0
    return f"{mean:{sign}.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:{sign}.2f}"


HEADERS = (
    "rounds",
    "test samples",
    "method",
    "final",
    "last-10 mean (headline)",
    "best round (leaderboard)",
    "best − last-10",
    "best of last 10 − their mean",
    "best round per seed",
    "val/acc: best − last-10",
)


def _row(rounds: int, method: str, runs: list[dict]) -> list[str]:
    column = {key: [run[key] for run in runs] for key in runs[0]}
    gap = [r["best"] - r["last10"] for r in runs]
    plateau = [r["best_of_last10"] - r["last10"] for r in runs]
    mean_gap = [r["mean_best"] - r["mean_last10"] for r in runs]
    return [
        str(rounds),
        "/".join(sorted({str(n) for n in column["test_samples"]})),
        METHODS[method][0],
        _pm(column["final"]),
        _pm(column["last10"]),
        _pm(column["best"]),
        _pm(gap, "+"),
        _pm(plateau, "+"),
        ", ".join(f"{r:.0f}" for r in column["best_round"]),
        _pm(mean_gap, "+"),
    ]


def report(measured: dict[Regime, dict[str, list[dict]]], seeds: Sequence[int]) -> str:
    """The table: per regime and method, mean ± std over seeds (percentage points for the gaps)."""
    rows = [_row(rounds, m, runs) for (rounds, _), per in measured.items() for m, runs in per.items()]
    title = (
        "Pooled test accuracy val/acc_weighted (%), digits, 50 clients x 3 classes, 10 per round, "
        f"mean ± std over seeds {list(seeds)}; gaps in percentage points\n\n"
    )
    return title + format_table(HEADERS, rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--test-fractions", type=float, nargs="+", default=[0.5, 0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    args = parser.parse_args(argv)
    quiet()
    watch = Stopwatch()
    regimes = [(rounds, fraction) for fraction in args.test_fractions for rounds in args.rounds]
    measured = {regime: measure(args.seeds, regime, args.methods) for regime in regimes}
    print(report(measured, args.seeds))
    print_footer(watch)


if __name__ == "__main__":
    main()
