"""CENTAUR's claim on the digits: DP-FedRep against DP-FedAvg (+ FT) and Local Only over ε, client-level DP.

CENTAUR (Shen et al., ICLR 2023) is DP-FedRep: only the shared body is clipped, noised and released; each head
stays on its client. Its claim is a better privacy-utility trade-off than DP-FedAvg, whose noise falls on the
whole model, head included, and whose fine-tuned variant (+ FT) tunes a head on a body trained under noise.
This script checks it on scikit-learn's digits split with 2 classes per client, at ε ∈ {0.5, 1, 2, 4, 8}
(δ = 1e-5, the rounds fixed), over 3 seeds, and prints a Markdown table (mean ± sample std per method and ε)
and writes a figure (accuracy against ε).

Every run is ``FederatedStrategy(privacy=ClientLevelDP(clip, target_epsilon=ε, delta=1e-5, rounds=T),
weighting="uniform", clients_per_round=1.0)`` on ``DigitsDataModule`` (50 clients, 2 classes each, a 50/50
train/test split: ~18 training and ~18 test samples per client) with ``MLPClassifier`` (a 64-32-16 body, 2,608
parameters, and a 16->10 head; SGD lr 0.05, momentum 0.5, weight decay 1e-4, batch 10):

* DP-FedRep (CENTAUR): 5 head epochs then 1 body epoch a round; the body's updates clipped and noised.
* DP-FedAvg: 1 epoch of the whole model a round; every update clipped and noised; the global model scored.
* DP-FedAvg + FT: the same run, scored after every client fine-tunes a copy of the head for 5 epochs
  (``FineTunedEvaluation`` on the test pass), as CENTAUR's DP-FedAvg-ft.
* Local Only: every client trains its own model (T rounds of 2 epochs), nothing released: no privacy cost,
  so one figure for every ε.
* FedRep without DP, for reference (the same schedule, no ``privacy``).

Every client trains every round (q = 1, as CENTAUR's camera-ready runs), so each round is the Gaussian mechanism
without amplification, and ``target_epsilon`` sets σ for the T rounds before the first (Opacus's RDP); the noise
on the mean has std σ·C/50 per coordinate. The figure is the final round's mean client test accuracy (%); the
table also gives σ and the ε each run's accountant reports after its last round (≤ the target).

Cost (measured on the 2-core development machine, one thread; the ``elapsed`` line says it for each run): about
15 s for the full run (3 seeds x 5 ε x 2 DP fits + 3 x 2 references = 36 fits of 20 rounds x 50 clients, on the
vectorized runner), about 1 s with ``--small`` (1 seed, ε 1 and 8, 5 rounds, 20 clients). The clip, 0.1, is
about the median norm of the clients' body updates without noise here (adaptive clipping at quantile 0.5 settles
near 0.12 over 20 rounds).

``--data low_rank`` runs the same comparison on FedRep's low-rank linear regression (Collins et al. 2021, Sec. 5.1;
``LowRankLinearDataModule``: d = 20, k = 2, 100 clients of 10 training and 50 test samples, noise 1e-3) with
``LowRankLinear`` from a random body (the method-of-moments start reads the clients' data unprivatized), every
client every round for 50 rounds, one full-batch gradient step a phase: DP-FedRep's head is the exact
least-squares fit on the body (Algorithm 2), DP-FedAvg trains (B, w) jointly, its + FT variant takes 50 gradient
steps on the head before the test pass, Local Only fits each client's own (B, w). The figure is the mean client
test MSE (half the squared error, lower is better); about 2.5 minutes for the full run (the exact head keeps the
sequential runner).

Usage (from the repository root)::

    .venv/bin/python benchmarks/privacy/digits_tradeoff.py [--seeds 0 1 2] [--figure digits_tradeoff.png]
    .venv/bin/python benchmarks/privacy/digits_tradeoff.py --data low_rank   # writes low_rank_tradeoff.png
    .venv/bin/python benchmarks/privacy/digits_tradeoff.py --small           # a fast smoke run (tests)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import Stopwatch, format_table, make_trainer, print_footer, quiet  # noqa: E402
from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.callbacks import FineTunedEvaluation  # noqa: E402
from lightning_fedrep.data.digits import DigitsDataModule  # noqa: E402
from lightning_fedrep.data.low_rank import LowRankLinearDataModule  # noqa: E402
from lightning_fedrep.models import LowRankLinear, MLPClassifier  # noqa: E402
from lightning_fedrep.privacy import ClientLevelDP  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
"""The budgets of the full run (issue 40: ε ∈ {0.5, 1, 2, 4, 8})."""
SMALL_EPSILONS = (1.0, 8.0)
DELTA = 1e-5
LABELS = {
    "dp_fedrep": "DP-FedRep (CENTAUR)",
    "dp_fedavg_ft": "DP-FedAvg + FT",
    "dp_fedavg": "DP-FedAvg (global model)",
    "local": "Local Only (no DP needed)",
    "fedrep": "FedRep without DP",
}
PRIVATE = ("dp_fedrep", "dp_fedavg_ft", "dp_fedavg")
"""The methods whose accuracy depends on ε; the others are one figure per seed."""


@dataclass(frozen=True)
class Settings:
    """The federation, model and schedule of every run (see the module's docstring)."""

    rounds: int = 20
    num_clients: int = 50
    classes_per_client: int = 2
    clip: float = 0.1
    head_epochs: int = 5
    body_epochs: int = 1
    finetune_epochs: int = 5
    local_only_epochs: int = 2
    hidden: int = 32
    features: int = 16
    batch_size: int = 10
    test_fraction: float = 0.5
    data: str = "digits"  # or "low_rank"


SMALL = Settings(rounds=5, num_clients=20)
"""``--small``: a smoke run of the whole script (tests)."""
LOW_RANK = Settings(rounds=50, num_clients=100, clip=0.1, data="low_rank")
"""``--data low_rank``: FedRep's linear problem (d = 20, k = 2, 10 training and 50 test samples per client, noise
1e-3), every client every round, one full-batch step a phase, the head exact (least squares)."""
SMALL_LOW_RANK = replace(LOW_RANK, rounds=5, num_clients=20)


@dataclass(frozen=True)
class Metric:
    """The figure a data set is scored by: a logged name (``val/...``, its ``test/...`` twin after fine-tuning),
    a scale, and whether higher is better."""

    name: str
    scale: float
    higher_is_better: bool
    label: str


METRICS = {
    "digits": Metric("acc", 100.0, True, "mean client test accuracy (%)"),
    "low_rank": Metric("mse", 1.0, False, "mean client test MSE (half the squared error)"),
}


@dataclass
class Run:
    """One fit's figures: the final round's score (accuracy % or MSE), and for DP runs σ and the ε spent."""

    accuracy: float
    sigma: float = math.nan
    epsilon: float = math.nan


def datamodule(seed: int, s: Settings) -> DigitsDataModule | LowRankLinearDataModule:
    """One seed's federation (re-split and re-partitioned per seed; the low-rank problem drawn anew)."""
    if s.data == "low_rank":
        return LowRankLinearDataModule(num_clients=s.num_clients, samples_per_client=10, seed=seed)
    return DigitsDataModule(
        num_clients=s.num_clients,
        classes_per_client=s.classes_per_client,
        batch_size=s.batch_size,
        test_fraction=s.test_fraction,
        seed=seed,
    )


def fit(
    algorithm: str,
    seed: int,
    s: Settings,
    epsilon: float | None = None,
    fine_tune: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Run]:
    """Train ``algorithm`` on one seed's federation, with ``ClientLevelDP`` at ``epsilon`` (``None``: no DP).

    Returns ``{"plain": Run}`` (the last round's validation: each client's test split), and with ``fine_tune``
    also ``{"ft": Run}``: the test pass after every client fine-tuned a copy of the head."""
    dm = datamodule(seed, s)
    torch.manual_seed(seed)  # the same initial weights for every method of this seed
    if s.data == "low_rank":  # random init: the method-of-moments one reads the clients' data unprivatized
        model = LowRankLinear(dim=20, rank=2, lr=0.1, exact_head=algorithm == "fedrep", init="random")
    else:
        model = MLPClassifier(hidden=s.hidden, features=s.features)
    privacy = None
    if epsilon is not None:
        privacy = ClientLevelDP(clip=s.clip, target_epsilon=epsilon, delta=DELTA, rounds=s.rounds)
    tune_epochs = 50 if s.data == "low_rank" else s.finetune_epochs  # full-batch gradient steps on the head
    callbacks = [FineTunedEvaluation(epochs=tune_epochs, stages=("test",))] if fine_tune else []
    rounds = strategy_kwargs.pop("rounds", s.rounds)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        seed=seed,
        clients_per_round=1.0,
        weighting="uniform",
        privacy=privacy,
        **strategy_kwargs,
    )
    trainer = make_trainer(rounds, strategy=strategy, callbacks=callbacks, check_val_every_n_epoch=rounds)
    trainer.fit(model, datamodule=dm)
    row = strategy.federation.history.rows[-1]
    sigma, spent = row.get("privacy/noise_multiplier", math.nan), row.get("privacy/epsilon", math.nan)
    metric = METRICS[s.data]
    out = {"plain": Run(metric.scale * strategy.results()["final"][f"val/{metric.name}"], sigma, spent)}
    if fine_tune:
        (tested,) = trainer.test(model, datamodule=dm, verbose=False)
        out["ft"] = Run(metric.scale * tested[f"test/{metric.name}"], sigma, spent)
    return out


def run_seed(seed: int, s: Settings, epsilons: Sequence[float]) -> dict[str, dict[float | None, Run]]:
    """Every method on one seed: ``{method: {ε: Run}}`` (ε ``None`` for the methods without DP)."""
    out: dict[str, dict[float | None, Run]] = {m: {} for m in LABELS}
    if s.data == "low_rank":  # one full-batch step a phase, as FedRep's Algorithm 2 (the exact head first)
        fedrep: dict = {"phases": [{"train": "head", "steps": 1}, {"train": "body", "steps": 1}]}
        joint: dict = {"phases": [{"train": "all", "steps": 1}]}
        local = joint
    else:
        fedrep = {"head_epochs": s.head_epochs, "body_epochs": s.body_epochs}
        joint = {"local_epochs": s.body_epochs}
        local = {"local_epochs": s.local_only_epochs}
    for epsilon in epsilons:
        out["dp_fedrep"][epsilon] = fit("fedrep", seed, s, epsilon, **fedrep)["plain"]
        fedavg = fit("fedavg", seed, s, epsilon, fine_tune=True, **joint)
        out["dp_fedavg"][epsilon], out["dp_fedavg_ft"][epsilon] = fedavg["plain"], fedavg["ft"]
    out["local"][None] = fit("local", seed, s, **local)["plain"]
    out["fedrep"][None] = fit("fedrep", seed, s, **fedrep)["plain"]
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(
    per_seed: list[dict[str, dict[float | None, Run]]], epsilons: Sequence[float]
) -> dict[str, dict[float, tuple[float, float]]]:
    """``{method: {ε: (mean, std)}}`` over seeds; the methods without DP repeat their one figure at every ε."""
    out: dict[str, dict[float, tuple[float, float]]] = {}
    for method in LABELS:
        keys = {e: (e if method in PRIVATE else None) for e in epsilons}
        out[method] = {e: mean_std([r[method][k].accuracy for r in per_seed]) for e, k in keys.items()}
    return out


def report(
    per_seed: list[dict[str, dict[float | None, Run]]],
    seeds: Sequence[int],
    epsilons: Sequence[float],
    s: Settings,
) -> dict[str, dict[float, tuple[float, float]]]:
    """Print the table (mean ± std per method and ε), σ and the ε spent, and DP-FedRep's margins."""
    summary = summarize(per_seed, epsilons)
    metric = METRICS[s.data]
    federation = (
        f"the low-rank linear problem (d=20, k=2): {s.num_clients} clients x 10 samples"
        if s.data == "low_rank"
        else f"the digits: {s.num_clients} clients x {s.classes_per_client} classes"
    )
    print(
        f"\nClient-level DP on {federation}, every client every round, T={s.rounds} rounds, clip {s.clip}, "
        f"δ={DELTA:g}; final {metric.label}, mean ± std over seeds {list(seeds)}\n"
    )
    fmt = ".1f" if metric.higher_is_better else ".3g"
    headers = ["method", *(f"ε = {e:g}" for e in epsilons)]
    rows = [
        [LABELS[m], *(f"{summary[m][e][0]:{fmt}} ± {summary[m][e][1]:{fmt}}" for e in epsilons)]
        for m in LABELS
    ]
    print(format_table(headers, rows))
    first = per_seed[0]
    print(
        f"\nσ (noise multiplier) and the ε the accountant reports after the last round (seed {seeds[0]}):\n"
    )
    print(
        format_table(
            ["", *(f"ε = {e:g}" for e in epsilons)],
            [
                ["σ", *(f"{first['dp_fedrep'][e].sigma:.3g}" for e in epsilons)],
                ["ε spent", *(f"{first['dp_fedrep'][e].epsilon:.3g}" for e in epsilons)],
            ],
        )
    )
    unit = "percentage points" if metric.higher_is_better else "the baseline's MSE minus DP-FedRep's"
    print(f"\nDP-FedRep's margin ({unit}, mean ± std over seeds; positive: DP-FedRep better):\n")
    sign = 1.0 if metric.higher_is_better else -1.0
    margins = []
    for baseline in ("dp_fedavg", "dp_fedavg_ft", "local"):
        cells = [f"vs {LABELS[baseline]}"]
        for e in epsilons:
            key = e if baseline in PRIVATE else None
            diffs = [sign * (r["dp_fedrep"][e].accuracy - r[baseline][key].accuracy) for r in per_seed]
            mean, std = mean_std(diffs)
            cells.append(f"{mean:+{fmt}} ± {std:{fmt}}")
        margins.append(cells)
    print(format_table(["", *(f"ε = {e:g}" for e in epsilons)], margins))
    return summary


def write_figure(
    summary: dict[str, dict[float, tuple[float, float]]],
    epsilons: Sequence[float],
    path: str,
    data: str = "digits",
) -> None:
    """The score against ε (log scale): the DP methods with ±1 std error bars, the references as flat lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for method in PRIVATE:
        means, stds = zip(*(summary[method][e] for e in epsilons))
        ax.errorbar(epsilons, means, yerr=stds, marker="o", capsize=3, label=LABELS[method])
    for method, style in (("local", ":"), ("fedrep", "--")):
        mean, _ = summary[method][epsilons[0]]
        ax.axhline(
            mean, linestyle=style, color="gray" if method == "local" else "black", label=LABELS[method]
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(epsilons), [f"{e:g}" for e in epsilons])
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel(METRICS[data].label)
    if data == "low_rank":
        ax.set_yscale("log")
        ax.set_title("Client-level DP on the low-rank linear problem")
    else:
        ax.set_title("Client-level DP on the digits (2 classes per client)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict[float, tuple[float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--small: 0)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None, help="default 0.5 1 2 4 8")
    parser.add_argument("--rounds", type=int, default=None, help=f"default {Settings.rounds}")
    parser.add_argument("--clip", type=float, default=None, help=f"default {Settings.clip}")
    parser.add_argument(
        "--small", action="store_true", help="1 seed, ε 1 and 8, 5 rounds, 20 clients (tests)"
    )
    parser.add_argument(
        "--data",
        choices=tuple(METRICS),
        default="digits",
        help="the digits, or FedRep's low-rank linear problem",
    )
    parser.add_argument(
        "--figure", default=None, help="where to write the figure (default <data>_tradeoff.png)"
    )
    args = parser.parse_args(argv)
    quiet()
    watch = Stopwatch()
    if args.data == "low_rank":
        settings = SMALL_LOW_RANK if args.small else LOW_RANK
    else:
        settings = SMALL if args.small else Settings()
    settings = replace(
        settings, **{k: v for k, v in (("rounds", args.rounds), ("clip", args.clip)) if v is not None}
    )
    seeds = args.seeds or ([0] if args.small else [0, 1, 2])
    epsilons = sorted(args.epsilons or (SMALL_EPSILONS if args.small else EPSILONS))
    per_seed = []
    for seed in seeds:
        per_seed.append(run_seed(seed, settings, epsilons))
        print(f"seed {seed} done after {watch.elapsed:.0f} s", flush=True)
    summary = report(per_seed, seeds, epsilons, settings)
    figure = args.figure or f"{args.data}_tradeoff.png"
    write_figure(summary, epsilons, figure, args.data)
    print(f"\nfigure written to {figure}")
    print_footer(watch)
    return summary


if __name__ == "__main__":
    main()
