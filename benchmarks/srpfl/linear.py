"""SRPFL digest E2: FedRep-SRPFL vs FedRep on synthetic linear representation learning, simulated time.

Both methods run through ``Trainer.fit`` with ``FederatedStrategy`` (exact head, one body step per round,
plain mean, full participation) and ``AdaptiveParticipation`` with fixed ``Exp(1)`` client speeds:
FedRep-SRPFL keeps the 10 fastest clients, doubling every 10 rounds; FedRep (``initial_clients=None``)
waits for all 100 every round. Settings of the digest: d=20, k=2, N=100, m=10 samples per client,
noise std 0.5, lr 0.1, method-of-moments initialisation, no communication cost. Printed, all measured
in this run:

1. time to reach dist(B, B*) <= target (mean over seeds) with **fresh samples every round**;
2. the same with a **fixed sample per client**;
3. the speed-up as a per-round communication cost C grows (the clock is sum(latency + C), recomputed
   from the same runs; one short run with C=1 checks the callback's clock against this);
4. the final distances (mean over the last 10 rounds), which must agree between the methods.

Seed 0 is also checked round by round against the plain-PyTorch reference of
``benchmarks/srpfl/reference.py``. Usage (about 20 minutes on 2 busy CPU cores with the defaults):

    .venv/bin/python benchmarks/srpfl/linear.py [--seeds 5] [--fixed-seeds 3] [--rounds 80]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.srpfl.reference import srpfl_linear_reference, time_to_reach  # noqa: E402
from lightning_fedrep import FederatedStrategy, Phase  # noqa: E402
from lightning_fedrep.callbacks.participation import AdaptiveParticipation, FixedExponential  # noqa: E402
from lightning_fedrep.data.low_rank import LowRankLinearDataModule  # noqa: E402
from lightning_fedrep.data.subspace import principal_angle_distance  # noqa: E402
from lightning_fedrep.models import LowRankLinear  # noqa: E402

TARGETS = (0.2, 0.1, 0.05, 0.03)
COSTS = (0.0, 1.0, 5.0, 10.0)
METHODS = (("FedRep", None), ("FedRep-SRPFL", 10))


class QuietLowRankLinear(LowRankLinear):
    """``LowRankLinear`` without its per-step ``train/loss`` log (the same arithmetic, less overhead)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.head.weight.requires_grad and not self.body.weight.requires_grad:
            self.fit_head_exactly(x, y)
        return self.loss(x, y)


class Trajectory(Callback):
    """dist(B, B*), the simulated clock and the round's latency after every round."""

    def __init__(self, participation: AdaptiveParticipation, truth: torch.Tensor):
        self.participation, self.truth = participation, truth
        self.distances: list[float] = []
        self.times: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module):
        body = trainer.strategy.global_tensors()["body.weight"].T
        self.distances.append(principal_angle_distance(body, self.truth))
        self.times.append(self.participation.time)


def run(seed: int, fresh: bool, initial_clients: int | None, rounds: int, cost: float = 0.0) -> Trajectory:
    dm = LowRankLinearDataModule(20, 2, 100, 10, 10, noise_std=0.5, fresh_samples=fresh, seed=seed)
    participation = AdaptiveParticipation(
        initial_clients, 10, latency=FixedExponential(seed=seed), communication_cost=cost
    )
    trajectory = Trajectory(participation, dm.problem.ground_truth_body)
    strategy = FederatedStrategy(
        clients_per_round=1.0,
        phases=[Phase("head", steps=1), Phase("body", steps=1)],
        weighting="uniform",
        seed=seed,
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=rounds,
        callbacks=[participation, trajectory],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=10**9,
    )
    model = QuietLowRankLinear(20, 2, 0.1, dm.problem.ground_truth_body, dm.method_of_moments_init())
    trainer.fit(model, datamodule=dm)
    return trajectory


def fmt_time(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "not reached"


def table(runs: dict[str, list[Trajectory]], title: str) -> None:
    seeds = len(runs["FedRep"])
    print(f"\n### {title} ({seeds} seeds)\n")
    print("| target | FedRep time | FedRep-SRPFL time | speed-up | per-seed speed-ups |")
    print("|---|---|---|---|---|")
    for target in TARGETS:
        per = {m: [time_to_reach(t.times, t.distances, target) for t in runs[m]] for m, _ in METHODS}
        means = {m: statistics.mean(v) if all(map(math.isfinite, v)) else math.inf for m, v in per.items()}
        ratio = means["FedRep"] / means["FedRep-SRPFL"] if math.isfinite(means["FedRep-SRPFL"]) else math.nan
        seeds_up = ", ".join(
            f"{a / b:.1f}" if math.isfinite(a) and math.isfinite(b) else "-"
            for a, b in zip(per["FedRep"], per["FedRep-SRPFL"])
        )
        ratio_text = f"**{ratio:.1f}x**" if math.isfinite(ratio) else "-"
        print(
            f"| {target} | {fmt_time(means['FedRep'])} | {fmt_time(means['FedRep-SRPFL'])} | {ratio_text} | {seeds_up} |"
        )
    floors = {m: statistics.mean(statistics.mean(t.distances[-10:]) for t in runs[m]) for m, _ in METHODS}
    initial = statistics.mean(t.distances[0] for t in runs["FedRep"])
    print(
        f"\nFinal distance (mean of the last 10 rounds): FedRep {floors['FedRep']:.4f}, "
        f"FedRep-SRPFL {floors['FedRep-SRPFL']:.4f} (ratio {floors['FedRep-SRPFL'] / floors['FedRep']:.3f}); "
        f"distance after the first round: {initial:.3f}. Total simulated time of the run: FedRep "
        f"{statistics.mean(t.times[-1] for t in runs['FedRep']):.1f}, FedRep-SRPFL "
        f"{statistics.mean(t.times[-1] for t in runs['FedRep-SRPFL']):.1f}."
    )


def cost_table(runs: dict[str, list[Trajectory]], target: float = 0.1) -> None:
    print(f"\n### Speed-up to dist {target} vs communication cost C per round (fresh samples)\n")
    print("| C | FedRep time | FedRep-SRPFL time | speed-up |")
    print("|---|---|---|---|")
    for cost in COSTS:
        means = {}
        for method, _ in METHODS:
            values = []
            for t in runs[method]:
                shifted = [time + cost * (r + 1) for r, time in enumerate(t.times)]
                values.append(time_to_reach(shifted, t.distances, target))
            means[method] = statistics.mean(values)
        ratio = means["FedRep"] / means["FedRep-SRPFL"] if math.isfinite(means["FedRep-SRPFL"]) else math.nan
        ratio_text = f"**{ratio:.1f}x**" if math.isfinite(ratio) else "-"
        print(
            f"| {cost:g} | {fmt_time(means['FedRep'])} | {fmt_time(means['FedRep-SRPFL'])} | {ratio_text} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds with fresh samples every round")
    parser.add_argument("--fixed-seeds", type=int, default=3, help="seeds with a fixed sample per client")
    parser.add_argument("--rounds", type=int, default=80)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    print(
        f"SRPFL E2: d=20, k=2, N=100, m=10, sigma=0.5, lr=0.1, fixed Exp(1) speeds, C=0, n0=10, tau=10, "
        f"{args.rounds} rounds; torch {torch.__version__}, lightning {L.__version__}"
    )
    results = {}
    for fresh, seeds in ((True, args.seeds), (False, args.fixed_seeds)):
        runs: dict[str, list[Trajectory]] = {m: [] for m, _ in METHODS}
        for seed in range(seeds):
            for method, n0 in METHODS:
                tic = time.perf_counter()
                runs[method].append(run(seed, fresh, n0, args.rounds))
                print(
                    f"  {'fresh' if fresh else 'fixed'} samples, seed {seed}, {method}: "
                    f"{time.perf_counter() - tic:.0f} s wall clock",
                    flush=True,
                )
        results[fresh] = runs

    # seed 0 against the independent plain-PyTorch reference
    for fresh in (True, False):
        for method, n0 in METHODS:
            trajectory = results[fresh][method][0]
            dm = LowRankLinearDataModule(20, 2, 100, 10, 10, noise_std=0.5, fresh_samples=fresh, seed=0)
            latency = FixedExponential(seed=0)
            times, distances = srpfl_linear_reference(
                dm.problem,
                dm.method_of_moments_init(),
                lambda r, latency=latency: latency.sample(r, 100),
                args.rounds,
                n0,
                sample_seed=0,
                fresh=fresh,
            )
            gap = max(abs(a - b) for a, b in zip(trajectory.distances, distances))
            clock = max(abs(a - b) / b for a, b in zip(trajectory.times, times))
            print(
                f"  reference check (seed 0, {'fresh' if fresh else 'fixed'}, {method}): max |dist - ref| "
                f"{gap:.1e}, max relative clock difference {clock:.1e}"
            )
            assert gap < 1e-4 and clock < 1e-9, "the Trainer run departs from the plain-loop reference"
    # the callback's clock with C > 0 equals the recomputation used in the cost table
    short = run(0, True, 10, 20, cost=1.0)
    recomputed = [t + (r + 1) for r, t in enumerate(results[True]["FedRep-SRPFL"][0].times[:20])]
    assert max(abs(a - b) for a, b in zip(short.times, recomputed)) < 1e-9
    print("  clock check: a 20-round run with C=1 equals the C=0 clock + C per round")

    table(results[True], "Fresh samples every round (Algorithm 2), fixed Exp(1) speeds, C=0")
    table(
        results[False], "Fixed sample per client (10 samples, reused every round), fixed Exp(1) speeds, C=0"
    )
    cost_table(results[True], 0.1)
    cost_table(results[True], 0.05)
    print(f"\nTotal wall clock: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
