"""FedRep paper, Fig. 1: test MSE of Local Only, FedAvg and FedRep on the low-rank linear problem.

Claim (Collins et al. 2021, Fig. 1): with ``d = 20``, ``k = 2``, ``n = 100`` clients and
``m in {5, 10, 20}`` training samples per client, Local Only is poor until ``m`` reaches ``d``,
FedAvg (one global model) is poor at every ``m``, and FedRep is accurate at every ``m``.

Everything trains through ``FederatedStrategy`` on a ``FederatedDataModule`` with one full batch per
client (batch size = ``m``):

* **FedRep** (Algorithm 2): ``algorithm="fedrep"``, ``phases=[Phase("head", steps=1),
  Phase("body", steps=1)]`` on :class:`LowRankLinear` with ``exact_head=True`` (the head step solves
  least squares exactly, then one GD step on ``B``); method-of-moments init of ``B``; uniform averaging.
* **FedAvg**: the same ``LowRankLinear`` with *everything* shared (``algorithm="fedavg"``), one
  full-batch GD step per client per round (``Phase("all", steps=1)``, the FedRep notebook's "FedSGD"),
  same MoM init; evaluated as the paper does, with the **global** model on every client's test points.
  An extra column, FedAvg + FT, refits each client's head exactly on its training data over FedAvg's
  body (``evaluate_new_clients(..., steps=1)`` on the federation's own clients).
* **Local Only**: each client fits its own ``d``-dimensional linear regressor ``theta_i`` on its
  fixed ``m`` samples, with no communication (``algorithm="local"``). The model is
  ``LowRankLinear(rank=d)`` with the body fixed to ``I_d`` so the head is ``theta_i``; its head step is
  the exact least-squares fit, which for ``m < d`` (infinitely many interpolants) is the
  **minimum-norm** one, i.e. the limit of full-batch gradient descent from ``theta_i = 0`` (and what
  the paper's code's ridge(1e-5) fit gives).

Metric: the **test MSE = 0.5 * mean squared error** on each client's 100 fresh test points, averaged
over clients (``LowRankLinear`` logs it as ``test/mse``; the strategy's ``test/loss`` is the plain
mean squared error, twice as large). Also printed: ``dist(B, B*)``, the principal-angle distance of
the learned global representation.

Reduced vs the paper / its notebook: ``T = 200`` rounds with 10% participation (10 clients per round)
instead of ``T = 500`` with all clients (r = 1); step size 0.5 in our normalisation (gradients averaged
over samples, bodies averaged over clients), MoM init for FedRep (Algorithm 2) and FedAvg; one seed.
Noise std 1e-3, ``||w_i*|| = sqrt(k)`` as in the paper.

Usage (from the repository root)::

    .venv/bin/python benchmarks/fedrep/linear_fig1.py [--rounds 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    QuietLowRankLinear,
    Stopwatch,
    format_table,
    global_body,
    head_fit_errors,
    least_squares_model,
    linear_datamodule,
    make_trainer,
    mean,
    print_footer,
    quiet,
)
from lightning_fedrep import FederatedDataModule, FederatedStrategy, Phase  # noqa: E402
from lightning_fedrep.data.low_rank import LowRankLinearProblem, make_low_rank_problem  # noqa: E402
from lightning_fedrep.data.subspace import method_of_moments_init, principal_angle_distance  # noqa: E402

METHODS = ("local", "fedavg", "fedrep")


@dataclass
class Trained:
    """One method trained through the strategy on one problem."""

    method: str
    model: L.LightningModule
    strategy: FederatedStrategy
    trainer: L.Trainer
    datamodule: FederatedDataModule
    seconds: float

    def test_mse(self) -> float:
        """Client-mean test MSE (0.5 * mean squared error) of the personalized (or global) models."""
        return self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)[0]["test/mse"]

    def distance(self, truth: torch.Tensor) -> float:
        """``dist(B, B*)`` of the global representation (NaN for Local Only, which shares none)."""
        if self.method == "local":
            return float("nan")
        return principal_angle_distance(global_body(self.strategy), truth)


def train_linear(
    method: str,
    problem: LowRankLinearProblem,
    rounds: int = 200,
    lr: float = 0.5,
    clients_per_round: float | int = 0.1,
    seed: int = 0,
    fedavg_steps: int = 1,
) -> Trained:
    """Train ``method`` ("fedrep", "fedavg" or "local") on ``problem`` through ``FederatedStrategy``."""
    watch = Stopwatch()
    dm = linear_datamodule(problem.train, problem.test)  # one full batch per client
    torch.manual_seed(seed)
    if method == "local":
        model = least_squares_model(problem.dim)
        strategy = FederatedStrategy(
            algorithm="local", clients_per_round=1.0, phases=[Phase("head", steps=1)], seed=seed
        )
        rounds = 1  # the exact fit needs one step; nothing is communicated anyway
    elif method in ("fedrep", "fedavg"):
        model = QuietLowRankLinear(
            dim=problem.dim,
            rank=problem.rank,
            lr=lr,
            ground_truth_body=problem.ground_truth_body,
            init_body=method_of_moments_init(problem.train, problem.rank),
        )
        phases = (
            [Phase("head", steps=1), Phase("body", steps=1)]
            if method == "fedrep"
            else [Phase("all", steps=fedavg_steps)]
        )
        strategy = FederatedStrategy(
            algorithm=method,
            clients_per_round=clients_per_round,
            phases=phases,
            weighting="uniform",
            seed=seed,
        )
    else:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    trainer = make_trainer(rounds, strategy=strategy)
    trainer.fit(model, datamodule=dm)
    return Trained(method, model, strategy, trainer, dm, watch.elapsed)


def fedavg_finetuned_mse(fedavg: Trained) -> float:
    """FedAvg + FT: every training client refits its head exactly on its own training data over
    FedAvg's global body (one full-batch head step), then is tested on its test points."""
    return mean(head_fit_errors(fedavg.strategy.new_client_model(), fedavg.datamodule))


def fig1(
    samples: tuple[int, ...] = (5, 10, 20),
    dim: int = 20,
    rank: int = 2,
    num_clients: int = 100,
    test_samples: int = 100,
    rounds: int = 200,
    lr: float = 0.5,
    clients_per_round: float | int = 0.1,
    seed: int = 0,
    noise_std: float = 1e-3,
    methods: tuple[str, ...] = METHODS,
    finetune: bool = True,
) -> list[dict[str, float]]:
    """Fig. 1's table: one row per ``m`` with each method's test MSE, distance and wall time."""
    rows = []
    for m in samples:
        problem = make_low_rank_problem(
            dim=dim,
            rank=rank,
            num_clients=num_clients,
            samples_per_client=m,
            test_samples_per_client=test_samples,
            noise_std=noise_std,
            seed=seed,
        )
        row: dict[str, float] = {"m": m}
        for method in methods:
            run = train_linear(method, problem, rounds, lr, clients_per_round, seed)
            row[method] = run.test_mse()
            row[f"{method}_dist"] = run.distance(problem.ground_truth_body)
            row[f"{method}_s"] = run.seconds
            if method == "fedavg" and finetune:
                row["fedavg_ft"] = fedavg_finetuned_mse(run)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clients-per-round", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quiet()
    watch = Stopwatch()
    rows = fig1(rounds=args.rounds, lr=args.lr, clients_per_round=args.clients_per_round, seed=args.seed)
    print(
        f"FedRep Fig. 1: test MSE (0.5 * mean squared error, mean over the 100 clients' 100 test points); "
        f"d=20, k=2, n=100, T={args.rounds} rounds, {args.clients_per_round:g} participation, "
        f"lr={args.lr}, seed={args.seed}\n"
    )
    headers = ["m", "Local Only", "FedAvg (global model)", "FedAvg + FT (exact head)", "FedRep"]
    headers += ["dist(B,B*) FedAvg", "dist(B,B*) FedRep", "wall s (Local / FedAvg / FedRep)"]
    table = [
        [
            int(r["m"]),
            r["local"],
            r["fedavg"],
            r["fedavg_ft"],
            r["fedrep"],
            r["fedavg_dist"],
            r["fedrep_dist"],
            f"{r['local_s']:.1f} / {r['fedavg_s']:.1f} / {r['fedrep_s']:.1f}",
        ]
        for r in rows
    ]
    print(format_table(headers, table))
    print_footer(watch)


if __name__ == "__main__":
    main()
