"""Linear FLUTE (Liu, Shen & Yang, ICML 2024, Algorithm 1) on the under-parameterized synthetic problem.

Experiments of ``shared/reference/flute.md`` §9 (the paper's own constants were lost, so every setting
is the digest's; the paper's claims are qualitative):

* **E1**: d = 30, N = 50 clients, M = 300 samples each, σ = 0.1, singular values ``10·0.8^(i-1)``,
  k ∈ {1, 3, 6}, 400 rounds, λ = μ = 1, c = 1/8, sum aggregation, ε = 1e-3, η = 0.05. Claim: from a
  random init FLUTE converges to the optimal rank-k model (after a warm-up). The error is
  ``||UV - Θ_k||_F^2 / N``; its *floor* is that of the empirical rank-k optimum ``Θ̂`` (found
  independently by alternating least squares, :func:`empirical_rank_k_fit`), which finite M and noise
  set. Printed: floor, final error, ``||UV - Θ̂||/||Θ̂||``, the round the error first reaches 1.1 × floor,
  and the error every 20 rounds.
* **E1b**: E1 with k = 3 and the *mean* of the clients' U gradients (``aggregate="mean"``).
* **E2**: d = 30, M = 100, σ = 0.5, k = 3, singular values ``√N·0.8^(i-1)``, η = 0.3/σ_1, 800 rounds,
  N ∈ {25, 50, 100, 200}. Claim (Fig. 3, Thm 5.5): the average error decreases as N grows.
* **E3**: E1 (k = 3, 600 rounds) with (λ, μ) ∈ {(1,1), (0.5,1), (0,1), (1.5,1), (3,1), (1,0.5)}. Claim
  (App. C.1): λ > μ "usually diverges" (never used in the paper). "settled" = the error varied by at
  most 0.1 % over the last 50 rounds.

Usage (from the repository root)::

    .venv/bin/python benchmarks/flute/linear.py [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import Stopwatch, format_table, print_footer  # noqa: E402
from benchmarks.flute.linear_flute import (  # noqa: E402
    empirical_rank_k_fit,
    linear_flute,
    make_linear_flute_problem,
)


def floor_of(problem, rank: int) -> tuple[float, torch.Tensor]:
    optimum = empirical_rank_k_fit(problem, rank)
    return float((optimum - problem.best_rank(rank)).square().sum() / problem.num_clients), optimum


def e1(seed: int) -> None:
    print("## E1: convergence from a random init (d=30, N=50, M=300, sigma=0.1, lam=mu=1, 400 rounds)\n")
    problem = make_linear_flute_problem(30, 50, 300, 0.1, seed=seed)
    rows, curves = [], []
    for k in (1, 3, 6):
        watch = Stopwatch()
        floor, optimum = floor_of(problem, k)
        result = linear_flute(problem, rank=k, rounds=400, seed=seed)
        gap = float(
            torch.linalg.matrix_norm(result.u @ result.v - optimum) / torch.linalg.matrix_norm(optimum)
        )
        reached = result.rounds_to(1.1 * floor)
        rows.append(
            [
                k,
                floor,
                result.errors[-1],
                gap,
                "never" if reached is None else reached,
                f"{watch.elapsed:.2f}",
            ]
        )
        curves.append([k, *(result.errors[t] for t in range(0, 201, 20))])
    print(
        format_table(
            ["k", "floor", "final err", "|UV - opt|/|opt|", "rounds to 1.1 x floor", "time (s)"],
            rows,
        )
    )
    print("\nerror ||UV - Theta_k||^2/N after t rounds:\n")
    print(format_table(["k", *(f"t={t}" for t in range(0, 201, 20))], curves))
    slow = linear_flute(problem, rank=3, rounds=400, aggregate="mean", seed=seed)
    print(
        f"\nE1b (k=3, aggregate='mean'): err {slow.errors[100]:.4g} / {slow.errors[200]:.4g} / {slow.errors[400]:.4g} "
        f"after 100 / 200 / 400 rounds (floor {rows[1][1]:.4g}; 'sum' reaches it by round {rows[1][4]})\n"
    )


def e2(seed: int) -> None:
    print(
        "## E2: error vs number of clients (d=30, M=100, sigma=0.5, k=3, s_i = sqrt(N) 0.8^(i-1), 800 rounds)\n"
    )
    rows = []
    for n in (25, 50, 100, 200):
        watch = Stopwatch()
        problem = make_linear_flute_problem(30, n, 100, 0.5, top_singular_value=math.sqrt(n), seed=seed)
        result = linear_flute(problem, rank=3, rounds=800, lr=0.3 / math.sqrt(n), seed=seed)
        floor, _ = floor_of(problem, 3)
        rows.append([n, result.errors[-1], floor, result.settled(), f"{watch.elapsed:.2f}"])
    print(format_table(["N", "final err", "floor (ALS)", "settled", "time (s)"], rows))
    decreasing = all(a[1] > b[1] for a, b in zip(rows, rows[1:]))
    print(f"\nerror decreases with N: {decreasing}\n")


def e3(seed: int) -> None:
    print("## E3: (lambda, mu) sweep (E1 problem, k=3, 600 rounds)\n")
    problem = make_linear_flute_problem(30, 50, 300, 0.1, seed=seed)
    floor, _ = floor_of(problem, 3)
    rows = []
    for lam, mu in ((1, 1), (0.5, 1), (0, 1), (1.5, 1), (3, 1), (1, 0.5)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = linear_flute(problem, rank=3, rounds=600, lam=lam, mu=mu, seed=seed)
        tail = result.errors[-50:]
        verdict = (
            "settled" if result.settled() else ("diverged" if result.diverged else "unstable (oscillates)")
        )
        rows.append([lam, mu, result.errors[-1], min(tail), max(tail), verdict, "yes" if caught else "no"])
    print(
        format_table(["lambda", "mu", "final err", "min last 50", "max last 50", "behaviour", "warned"], rows)
    )
    print(f"\nfloor (lambda = mu, ALS): {floor:.4g}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    watch = Stopwatch()
    e1(args.seed)
    e2(args.seed)
    e3(args.seed)
    print_footer(watch)


if __name__ == "__main__":
    main()
