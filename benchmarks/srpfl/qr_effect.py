"""The QR step of SRPFL's Algorithm 2 (line 14; ``OrthonormalBody`` in the library): its measured effect on
FedRep-SRPFL and FedRep in the synthetic linear setting of the digest's E2 (d=20, k=2, N=100, m=10 fresh
samples per round, sigma=0.5, lr 0.1, MoM initialisation, fixed Exp(1) speeds, n0=10, tau=10).

Runs the plain-PyTorch reference loop (``benchmarks/srpfl/reference.py``) with and without the QR step; the
Trainer with ``OrthonormalBody`` follows that loop round by round (``tests/test_participation.py``). Prints,
per method, the simulated time to reach dist(B, B*) <= target and the final distance (mean over the last 10
rounds), averaged over seeds. Usage (seconds):

    .venv/bin/python benchmarks/srpfl/qr_effect.py [--seeds 5] [--rounds 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.srpfl.reference import srpfl_linear_reference, time_to_reach  # noqa: E402
from lightning_fedrep.callbacks.participation import FixedExponential  # noqa: E402
from lightning_fedrep.data.low_rank import LowRankLinearDataModule  # noqa: E402

TARGETS = (0.2, 0.1, 0.05, 0.03)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"QR step effect: E2 setting, {args.seeds} seeds, {args.rounds} rounds (plain reference loop)")
    header = "| method | QR | " + " | ".join(f"time to {t}" for t in TARGETS) + " | final dist |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for method, n0 in (("FedRep-SRPFL", 10), ("FedRep", None)):
        for qr in (False, True):
            reach = {t: [] for t in TARGETS}
            final = []
            for seed in range(args.seeds):
                dm = LowRankLinearDataModule(20, 2, 100, 10, 10, noise_std=0.5, fresh_samples=True, seed=seed)
                latency = FixedExponential(seed=seed)
                times, distances = srpfl_linear_reference(
                    dm.problem,
                    dm.method_of_moments_init(),
                    lambda r, latency=latency: latency.sample(r, 100),
                    args.rounds,
                    n0,
                    sample_seed=seed,
                    qr=qr,
                )
                for t in TARGETS:
                    reach[t].append(time_to_reach(times, distances, t))
                final.append(statistics.mean(distances[-10:]))
            cells = [f"{statistics.mean(reach[t]):.1f}" for t in TARGETS]
            print(
                f"| {method} | {'yes' if qr else 'no'} | "
                + " | ".join(cells)
                + f" | {statistics.mean(final):.4f} |"
            )
    print(f"\nWall clock: {time.perf_counter() - started:.0f} s (torch {torch.__version__})")


if __name__ == "__main__":
    main()
