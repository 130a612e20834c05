"""Every registered algorithm on the offline digits federation, two label-skewed splits, one table each.

What it answers (issue 41): on real data that needs no download, which of the package's algorithms beat one
global model (FedAvg) and training alone (Local Only), by how much, at what cost, and where a method fails.
Every name in ``lightning_fedrep.federation.api.registry.ALGORITHMS`` (what ``import lightning_fedrep``
registers) gets a row, run with its registered defaults, plus the "+ FT" rows of the FedRep family and FedAvg
on FedBN's model; a newly registered algorithm gets a row without an edit here.

The machinery is ``benchmarks/fedrep/digits_family.py``'s (its ``Settings``, ``_fit``, ``run_seed`` and
``summarize``): the same ``FederatedStrategy`` fit of ``MLPClassifier`` (64-64-32 body, linear ``classifier``
head; SGD lr 0.05, momentum 0.5, weight decay 1e-4, batch 10) on ``DigitsDataModule`` with a 50/50
train/test split, every method of a seed from the same initial weights, validation every round on each
client's own test split, ``runner="auto"`` (the vectorized runner where an algorithm supports it; the table
says which runner each fit used). The two splits:

* ``shard``: 50 clients with 2 classes each (``ShardPartitioner``), ~18 training and ~18 test samples per
  client, 10 clients a round (r = 0.2).
* ``dirichlet``: 20 clients, ``DirichletPartitioner(alpha=0.1, min_samples_per_client=5)`` (PFLlib's
  leaderboard split: 20 clients, Dir(0.1)), 5-153 training samples per client (median ~42, 3-4 classes),
  4 clients a round (r = 0.2, as the shards; PFLlib trains every client every round). At alpha = 0.1 the 898
  training digits cannot give 50 clients 3 samples each, nor 20 clients 10 each on seed 1 (100 draws), hence
  20 clients and at least 5.

Per algorithm (the FedRep family's protocol, ``digits_family.py``'s docstring):

* ``T = 50`` rounds of ``local_epochs = 2``; FedRep 5 head epochs then 2 body epochs; LG-FedAvg shares
  ``body.2`` and ``classifier``; Local Only trains every client for 25 rounds x 2 epochs.
* FedAvg, FedProx and SCAFFOLD also give a "+ FT" row: 10 head epochs per client after the last round
  (``HeadFineTuning``), scored once (no last-10 mean).
* L2GD with full participation for the same number of client trainings (``rounds x clients per round / clients``
  rounds: 10 for both splits; the official protocol), at its official lr alpha / (n (1 - p)): 0.2 for 50 clients,
  0.5 for 20.
* FedBN runs on ``BatchNormMLP`` (the MLP with ``BatchNorm1d`` after each hidden layer); on ``MLPClassifier``,
  which has no BatchNorm, FedBN is FedAvg. The row "FedAvg (BN MLP)" is FedAvg on that same model, FedBN's
  reference. BatchNorm needs the sequential runner.
* Every other registered algorithm: ``FederatedStrategy(algorithm=name, clients_per_round=r,
  local_epochs=2)`` (``local_epochs`` where the algorithm declares it), everything else its registered
  default (the reference hyper-parameters: see each algorithm's page).

Reported: the final round's and the last 10 rounds' mean client test accuracy (%), mean +- std over seeds
(each seed re-splits, re-partitions and re-initialises), each method's margin over FedAvg's global model and
over Local Only (final, percentage points, mean +- std of the per-seed differences), and the wall seconds of
one run (indicative: other processes share the machine). Sorted by final accuracy.

A NaN (a diverged run: L2GD at lr 0.5 on the Dirichlet split) shows as n/a in the table and as nan per seed.
``runner="auto"`` chooses partly by timing, so a loaded machine can run a fit on the other runner; the two compute
the same thing up to float rounding, and every accuracy came out the same in two runs but FedAdam's (server lr 0.1
amplifies the rounding: 88.02% against 80.72% on one Dirichlet seed).

Cost: 29 fits per split and seed; measured 445 s (shard) and 573 s (Dirichlet) for 3 seeds on a shared 2-core
machine at load ~10, 635 s for both in a second run, so the family's protocol needed no reduction. Measured tables:
``docs/benchmarks.md`` (*Every algorithm on digits*) and ``benchmarks/fedrep/RESULTS_family.md`` (section 6).

Usage (from the repository root)::

    .venv/bin/python benchmarks/algorithms/digits_all.py [--splits shard dirichlet] [--seeds 0 1 2] [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks._common import Stopwatch, format_table, print_footer, quiet  # noqa: E402
from benchmarks.fedrep import digits_family as family  # noqa: E402
from lightning_fedrep.federation.api.registry import ALGORITHMS  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402

SPLITS: dict[str, family.Settings] = {
    "shard": family.Settings(classes_per_client=2),
    "dirichlet": family.Settings(num_clients=20, clients_per_round=4, dirichlet_alpha=0.1),
}
"""Each split's settings (``digits_family.Settings``: 50 rounds, 2 local epochs, batch 10, 50/50 split)."""

FAMILY_ALGORITHMS = frozenset(
    ("fedrep", "fedper", "fedavg", "lg_fedavg", "local", "fedprox", "scaffold") + family.PERSONAL + ("l2gd",)
)
"""Registered algorithms that ``digits_family.run_seed`` runs in the family's protocol."""
BATCH_NORM = ("fedbn", "fedavg_bn")
"""Rows trained on :class:`BatchNormMLP` (``fedavg_bn``: FedAvg on it, FedBN's reference)."""

LABELS = {
    **family.LABELS,
    "fedavg_bn": "FedAvg (BN MLP)",
    "fedbn": "FedBN (BN MLP)",
    "hf_maml": "HF-MAML",
    "fedrod": "FedRoD",
    "fedcp": "FedCP",
    "fedbabu": "FedBABU",
    "feddbe": "FedDBE",
    "fedala": "FedALA",
    "gpfl": "GPFL",
    "fedas": "FedAS",
    "fedadam": "FedAdam (global model)",
    "fedyogi": "FedYogi (global model)",
    "fedadagrad": "FedAdagrad (global model)",
    "pfedme": "pFedMe",
    "fedcac": "FedCAC",
    "fedproto": "FedProto",
    "fedpac": "FedPAC",
}
"""Table labels; a registered name without one is shown as is."""


class OneSampleBatchNorm1d(nn.BatchNorm1d):
    """``BatchNorm1d`` that normalizes a training batch of one sample with the running statistics (a single
    sample has no batch variance, and a Dirichlet client's last batch can hold one); otherwise unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] == 1:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        return super().forward(x)


class BatchNormMLP(MLPClassifier):
    """:class:`~lightning_fedrep.models.MLPClassifier` with a BatchNorm layer after each hidden linear layer
    (``body`` = Linear, BN, ReLU, Linear, BN, ReLU): the model FedBN personalizes (its BN layers stay local)."""

    def __init__(self, in_features: int = 64, hidden: int = 64, features: int = 32, **kwargs: float | int):
        super().__init__(in_features=in_features, hidden=hidden, features=features, **kwargs)
        self.body = nn.Sequential(
            nn.Linear(in_features, hidden),
            OneSampleBatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, features),
            OneSampleBatchNorm1d(features),
            nn.ReLU(),
        )


def split_settings(split: str, rounds: int = family.Settings.rounds) -> family.Settings:
    """``SPLITS[split]`` at ``rounds`` rounds, Local Only at half of them and the full-participation rows at
    as many client trainings as the others (``rounds x clients per round / clients``, at least one)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}.")
    s = SPLITS[split]
    full = max(1, round(rounds * s.clients_per_round / s.num_clients))
    return replace(s, rounds=rounds, local_only_rounds=max(1, rounds // 2), l2gd_rounds=full)


def methods() -> tuple[str, ...]:
    """Every row: the FedRep family's (with its "+ FT" rows), then every other registered algorithm in
    registration order, with FedAvg on FedBN's model before FedBN."""
    rows = list(family.METHODS)
    for name in ALGORITHMS:
        if name in FAMILY_ALGORITHMS:
            continue
        rows += ["fedavg_bn", name] if name == "fedbn" else [name]
    return tuple(rows)


def _fit_registered(name: str, seed: int, s: family.Settings) -> dict:
    """One fit of a registered algorithm (or ``fedavg_bn``) outside the family, with its defaults."""
    algorithm = "fedavg" if name == "fedavg_bn" else name
    kwargs: dict = {"clients_per_round": s.clients_per_round}
    if "local_epochs" in type(ALGORITHMS[algorithm]).epochs:
        kwargs["local_epochs"] = s.local_epochs
    if name in BATCH_NORM:
        kwargs["model_class"] = BatchNormMLP
    strategy, seconds = family._fit(algorithm, seed, s, **kwargs)
    results = strategy.results()
    return {
        "final": 100 * results["final"]["val/acc"],
        "last10": 100 * results["last10"]["val/acc"],
        "seconds": seconds,
        "runner": strategy.runner_report.runner,
    }


def run_seed(seed: int, s: family.Settings, rows: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Every row (``methods()`` unless ``rows`` says) on one seed: ``{row: {"final", "last10", "seconds",
    "runner"}}``, accuracies in %."""
    rows = methods() if rows is None else rows
    out = family.run_seed(seed, s, tuple(r for r in rows if r in family.METHODS))
    for row in rows:
        if row not in family.METHODS:
            out[row] = _fit_registered(row, seed, s)
    return {row: out[row] for row in rows}


def _pm(pair: tuple[float, float]) -> str:
    return "n/a" if pair[0] != pair[0] else f"{pair[0]:.2f} ± {pair[1]:.2f}"


def _margin(per_seed: list[dict[str, dict]], row: str, baseline: str) -> str:
    """``row``'s final accuracy minus ``baseline``'s, mean ± std over seeds (points); "—" where ``baseline`` is
    not in the run or is ``row``, n/a where a seed's accuracy is NaN."""
    if baseline not in per_seed[0] or row == baseline:
        return "—"
    diffs = [r[row]["final"] - r[baseline]["final"] for r in per_seed]
    if any(d != d for d in diffs):
        return "n/a"
    return _pm((statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0))


def table(per_seed: list[dict[str, dict]]) -> str:
    """The markdown table of one split: a row per method, sorted by mean final accuracy (NaN last)."""
    summary = family.summarize(per_seed)

    def key(row: str) -> float:
        final = summary[row]["final"][0]
        return float("inf") if final != final else -final

    rows = []
    for row in sorted(summary, key=key):
        runners = sorted({r[row]["runner"] for r in per_seed})
        rows.append(
            [
                LABELS.get(row, row),
                "/".join(runners),
                _pm(summary[row]["final"]),
                _pm(summary[row]["last10"]),
                _margin(per_seed, row, "fedavg"),
                _margin(per_seed, row, "local"),
                f"{summary[row]['seconds']:.1f}",
            ]
        )
    headers = ["method", "runner", "final", "last-10 mean", "vs FedAvg", "vs Local Only", "s per run"]
    return format_table(headers, rows)


def describe(split: str, s: family.Settings, seeds: list[int]) -> str:
    """The table's caption: the split, participation, rounds and seeds."""
    partition = (
        f"Dirichlet alpha={s.dirichlet_alpha} (at least {s.min_samples_per_client} training samples a client)"
        if s.dirichlet_alpha is not None
        else f"{s.classes_per_client} classes per client (shards)"
    )
    return (
        f"digits, {split}: {s.num_clients} clients, {partition}, {s.clients_per_round} clients a round, "
        f"T={s.rounds} rounds; mean client test accuracy (%), mean ± std over seeds {seeds}"
    )


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, dict]]]:
    """Run the splits and seeds ``argv`` asks for (the command line by default), print a table per split and
    return ``{split: [one seed's run_seed result, ...]}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", nargs="+", choices=sorted(SPLITS), default=list(SPLITS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=family.Settings.rounds)
    parser.add_argument("--rows", nargs="+", choices=methods(), help="only these rows (default: every one)")
    parser.add_argument("--json", help="also write each split's per-seed results to JSON.<split>.json")
    args = parser.parse_args(argv)
    quiet()
    watch = Stopwatch()
    rows = tuple(args.rows) if args.rows else None
    results = {}
    for split in args.splits:
        settings = split_settings(split, args.rounds)
        per_seed = []
        for seed in args.seeds:
            per_seed.append(run_seed(seed, settings, rows))
            print(f"{split} seed {seed} done after {watch.elapsed:.0f} s", flush=True)
        print(f"\nper seed (final accuracy %), {split}:")
        for seed, result in zip(args.seeds, per_seed):
            print(f"  seed {seed}: " + ", ".join(f"{row} {r['final']:.2f}" for row, r in result.items()))
        print(f"\n{describe(split, settings, args.seeds)}\n")
        print(table(per_seed), flush=True)
        if args.json:
            Path(args.json).with_suffix(f".{split}.json").write_text(json.dumps(per_seed, indent=1))
        results[split] = per_seed
    print_footer(watch)
    return results


if __name__ == "__main__":
    main()
