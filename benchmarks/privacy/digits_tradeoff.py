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

Usage (from the repository root)::

    .venv/bin/python benchmarks/privacy/digits_tradeoff.py [--seeds 0 1 2] [--figure digits_tradeoff.png]
    .venv/bin/python benchmarks/privacy/digits_tradeoff.py --small      # a fast smoke run (tests)
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
from lightning_fedrep.models import MLPClassifier  # noqa: E402
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


SMALL = Settings(rounds=5, num_clients=20)
"""``--small``: a smoke run of the whole script (tests)."""


@dataclass
class Run:
    """One fit's figures: the final round's accuracy (%), and for DP runs σ and the ε spent."""

    accuracy: float
    sigma: float = math.nan
    epsilon: float = math.nan


def datamodule(seed: int, s: Settings) -> DigitsDataModule:
    """One seed's federation (re-split and re-partitioned per seed)."""
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
    model = MLPClassifier(hidden=s.hidden, features=s.features)
    privacy = None
    if epsilon is not None:
        privacy = ClientLevelDP(clip=s.clip, target_epsilon=epsilon, delta=DELTA, rounds=s.rounds)
    callbacks = [FineTunedEvaluation(epochs=s.finetune_epochs, stages=("test",))] if fine_tune else []
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
    out = {"plain": Run(100 * strategy.results()["final"]["val/acc"], sigma, spent)}
    if fine_tune:
        (tested,) = trainer.test(model, datamodule=dm, verbose=False)
        out["ft"] = Run(100 * tested["test/acc"], sigma, spent)
    return out


def run_seed(seed: int, s: Settings, epsilons: Sequence[float]) -> dict[str, dict[float | None, Run]]:
    """Every method on one seed: ``{method: {ε: Run}}`` (ε ``None`` for the methods without DP)."""
    out: dict[str, dict[float | None, Run]] = {m: {} for m in LABELS}
    fedrep = {"head_epochs": s.head_epochs, "body_epochs": s.body_epochs}
    for epsilon in epsilons:
        out["dp_fedrep"][epsilon] = fit("fedrep", seed, s, epsilon, **fedrep)["plain"]
        fedavg = fit("fedavg", seed, s, epsilon, fine_tune=True, local_epochs=s.body_epochs)
        out["dp_fedavg"][epsilon], out["dp_fedavg_ft"][epsilon] = fedavg["plain"], fedavg["ft"]
    out["local"][None] = fit("local", seed, s, local_epochs=s.local_only_epochs)["plain"]
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
    print(
        f"\nClient-level DP on the digits: {s.num_clients} clients x {s.classes_per_client} classes, every client every "
        f"round, T={s.rounds} rounds, clip {s.clip}, δ={DELTA:g}; final mean client test accuracy (%), mean ± std over "
        f"seeds {list(seeds)}\n"
    )
    headers = ["method", *(f"ε = {e:g}" for e in epsilons)]
    rows = [
        [LABELS[m], *(f"{summary[m][e][0]:.1f} ± {summary[m][e][1]:.1f}" for e in epsilons)] for m in LABELS
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
    print("\nDP-FedRep's margin (percentage points, mean ± std over seeds):\n")
    margins = []
    for baseline in ("dp_fedavg", "dp_fedavg_ft", "local"):
        cells = [f"vs {LABELS[baseline]}"]
        for e in epsilons:
            key = e if baseline in PRIVATE else None
            diffs = [r["dp_fedrep"][e].accuracy - r[baseline][key].accuracy for r in per_seed]
            mean, std = mean_std(diffs)
            cells.append(f"{mean:+.1f} ± {std:.1f}")
        margins.append(cells)
    print(format_table(["", *(f"ε = {e:g}" for e in epsilons)], margins))
    return summary


def write_figure(
    summary: dict[str, dict[float, tuple[float, float]]], epsilons: Sequence[float], path: str
) -> None:
    """Accuracy against ε (log scale): the DP methods with ±1 std error bars, the references as flat lines."""
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
    ax.set_ylabel("mean client test accuracy (%)")
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
    parser.add_argument("--figure", default="digits_tradeoff.png", help="where to write the figure (PNG/PDF)")
    args = parser.parse_args(argv)
    quiet()
    watch = Stopwatch()
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
    write_figure(summary, epsilons, args.figure)
    print(f"\nfigure written to {args.figure}")
    print_footer(watch)
    return summary


if __name__ == "__main__":
    main()
