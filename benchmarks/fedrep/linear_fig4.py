"""FedRep paper, Fig. 4: new clients fit only a head over a learned representation.

Claim (Collins et al. 2021, Fig. 4): after training on ``n = 100`` clients with ``m = 10`` samples each
(``d = 20``, ``k = 2``, as in Fig. 1), a *new* client that fits only a head on ``m_new`` samples over
FedRep's representation is accurate as soon as ``m_new >= k``; over FedAvg's representation it stays
poor (FedAvg "does not learn the ground-truth representation"); Local Only, a full ``d``-dimensional
fit on the new client's ``m_new`` samples, needs ``m_new`` of the order of ``d``.

Protocol, all through the library:

* FedRep and FedAvg are trained exactly as in ``linear_fig1.py`` (``train_linear``, ``m = 10``);
  FedAvg takes one full-batch GD step per client per round, as the FedRep notebook's "FedSGD".
  An extra column trains FedAvg with 5 local GD steps per round (step 0.1; 0.5 diverges), the
  setting in which the FedAvg-FT paper (Collins et al. 2022) proves FedAvg *does* learn ``B*``.
* 100 new clients are generated freshly from the same ``B*`` (heads drawn like the training clients',
  ``||w*|| = sqrt(k)``), each with 20 training and 50 test samples (noise std 1e-3).
* ``evaluate_new_clients(model, new_clients, steps=1, samples=m_new)``: each new client keeps
  ``m_new`` of its samples (nested subsets) and fits its head with one full-batch head step, which
  ``LowRankLinear(exact_head=True)`` makes the exact least-squares head (minimum-norm for
  ``m_new < k``) over the frozen body: FedRep's global body, FedAvg's global body, or, for Local Only,
  a fresh full ``d``-dimensional model (``least_squares_model``: identity body, head = ``theta``).

Metric: test MSE = 0.5 * mean squared error on each new client's 50 test points (``test/mse``),
then the mean over new clients (what the paper plots) and the median. The median matters at
``m_new = k``: the head solves a square ``k x k`` Gaussian system, whose inverse has an infinite second
moment, so the mean over clients is dominated by the occasional near-singular client.

Reduced vs the paper's notebook: the training runs of ``linear_fig1.py`` (``T = 200`` rounds, 10%
participation, step 0.5, MoM init, one seed); new clients' heads are normalised like the training
clients' rather than drawn from ``N(0, I_k)``, and their test labels carry the same 1e-3 noise.

Usage (from the repository root)::

    .venv/bin/python benchmarks/fedrep/linear_fig4.py [--rounds 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import (  # noqa: E402
    Stopwatch,
    format_table,
    fresh_linear_clients,
    head_fit_errors,
    least_squares_model,
    linear_datamodule,
    mean,
    median,
    print_footer,
    quiet,
)
from benchmarks.fedrep.linear_fig1 import train_linear  # noqa: E402
from lightning_fedrep.data.low_rank import make_low_rank_problem  # noqa: E402


def fig4(
    new_samples: tuple[int, ...] = (1, 2, 5, 10, 20),
    samples: int = 10,
    dim: int = 20,
    rank: int = 2,
    num_clients: int = 100,
    num_new: int = 100,
    new_test_samples: int = 50,
    rounds: int = 200,
    lr: float = 0.5,
    clients_per_round: float | int = 0.1,
    seed: int = 0,
    noise_std: float = 1e-3,
    extra_fedavg_steps: int | None = 5,
    extra_fedavg_lr: float = 0.1,
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Fig. 4's table: one row per ``m_new`` with the new clients' test MSE per representation
    (``row[method]`` the mean over new clients, ``row[method + "_median"]`` the median).

    With ``extra_fedavg_steps`` a second FedAvg takes that many local GD steps per round (step
    ``extra_fedavg_lr``) instead of one: the FedAvg-FT paper's setting (key ``"fedavg_local"``).
    Returns ``(rows, info)``; ``info`` holds the training runs' distances and wall times.
    """
    problem = make_low_rank_problem(
        dim=dim,
        rank=rank,
        num_clients=num_clients,
        samples_per_client=samples,
        test_samples_per_client=new_test_samples,
        noise_std=noise_std,
        seed=seed,
    )
    trained = {m: train_linear(m, problem, rounds, lr, clients_per_round, seed) for m in ("fedavg", "fedrep")}
    if extra_fedavg_steps is not None:
        trained["fedavg_local"] = train_linear(
            "fedavg", problem, rounds, extra_fedavg_lr, clients_per_round, seed, extra_fedavg_steps
        )
    info = {}
    for name, run in trained.items():
        info[f"{name}_dist"] = run.distance(problem.ground_truth_body)
        info[f"{name}_s"] = run.seconds
    train, test, _ = fresh_linear_clients(
        problem, num_new, max(new_samples), new_test_samples, seed=10_000 + seed
    )
    new_clients = linear_datamodule(train, test)  # batch = max(new_samples): one full batch each
    starting_points = {"local": least_squares_model(dim)}
    starting_points.update({name: run.strategy.new_client_model() for name, run in trained.items()})
    rows = []
    for m_new in new_samples:
        row: dict[str, float] = {"m_new": m_new}
        for name, model in starting_points.items():
            errors = head_fit_errors(model, new_clients, samples=m_new, seed=seed)
            row[name] = mean(errors)
            row[f"{name}_median"] = median(errors)
        rows.append(row)
    return rows, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quiet()
    watch = Stopwatch()
    rows, info = fig4(rounds=args.rounds, lr=args.lr, seed=args.seed)
    print(
        "FedRep Fig. 4: 100 new clients fit only a head on m_new samples; test MSE (0.5 * mean squared "
        f"error on 50 test points, client mean). Representations trained on n=100 clients, m=10, d=20, "
        f"k=2, T={args.rounds} rounds, 10% participation, lr={args.lr}, seed={args.seed}\n"
    )
    methods = ("local", "fedavg", "fedavg_local", "fedrep")
    headers = [
        "m_new",
        "Local Only (full d-dim fit)",
        "FedAvg (1 local step) repr.",
        "FedAvg (5 local steps) repr.",
        "FedRep repr.",
    ]
    print("mean over the new clients (as the paper plots):")
    print(format_table(headers, [[int(r["m_new"]), *(r[m] for m in methods)] for r in rows]))
    print("\nmedian over the new clients:")
    print(format_table(headers, [[int(r["m_new"]), *(r[f"{m}_median"] for m in methods)] for r in rows]))
    print(
        f"\ntraining: dist(B,B*) FedAvg (1 step) {info['fedavg_dist']:.3g} ({info['fedavg_s']:.1f} s), "
        f"FedAvg (5 steps, lr 0.1) {info['fedavg_local_dist']:.3g} ({info['fedavg_local_s']:.1f} s), "
        f"FedRep {info['fedrep_dist']:.3g} ({info['fedrep_s']:.1f} s)"
    )
    print_footer(watch)


if __name__ == "__main__":
    main()
