"""What client-level DP costs a round: the same FedRep fit with and without ``ClientLevelDP``, same run, ratios.

Issue 40's target: client-level DP costs at most 1.05x a round without it. The mechanism adds, per round, a
delta and a flat L2 norm per client upload, a float64 sum, one Gaussian draw of the body's size, the
accountant's step and ε (Opacus's RDP at q = 1; dp-accounting's RDP for a cohort drawn without replacement),
and under adaptive clipping one noised count.

The workload is a CIFAR-sized FedRep round: the official FedRep CNN (``CIFAR10CNN``, 307,842 parameters, a
307,192-parameter body) on random tensors of CIFAR's shape (3x32x32, 10 classes, 2 per client), 10 clients of
50 samples, batch 10, 1 head epoch then 1 body epoch a round, 4 rounds, uniform weights. Variants:

* ``no DP``: ``FederatedStrategy(weighting="uniform")``, the baseline;
* ``fixed clip``: ``privacy=ClientLevelDP(clip=1e-3, noise_multiplier=1.0)`` (accounted with RDP; the clip is
  small so that the noise leaves the model trainable: the mechanism's work does not depend on it);
* ``adaptive clip``: the same with ``adaptive=AdaptiveClipping(count_noise_std=2.0)`` (target quantile 0.5; the
  count's noise is set, since the default m/20 is too small for σ = 1 with 10 clients).

each at two participations: every client each round (q = 1, accounted as the Gaussian mechanism) and half of
them (q = 0.5, accounted as sampling without replacement, which dp-accounting's RDP computes each round).

A round's time is read by a callback from its start to its end (``RoundClock``), the GPU's queued work included;
the first round (the accountant's set-up, the runner's first-round work) is printed apart, and "a round" is the
mean of the rounds after it. Each repeat runs every variant once, in turn (a passing load slows all alike); the
table gives each variant's best repeat and the ratio of bests, and every repeat's own ratio is printed too.

Usage (from the repository root)::

    .venv/bin/python benchmarks/privacy/client_level_overhead.py [--repeats 5] [--rounds 4] [--device cuda]
    .venv/bin/python benchmarks/privacy/client_level_overhead.py --small      # a fast smoke run (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RoundClock,
    Stopwatch,
    add_device_argument,
    device_label,
    format_table,
    make_trainer,
    print_footer,
    quiet,
    trainer_device,
)
from lightning_fedrep import FederatedDataModule, FederatedStrategy  # noqa: E402
from lightning_fedrep.data.partition import ShardPartitioner  # noqa: E402
from lightning_fedrep.models import CIFAR10CNN  # noqa: E402
from lightning_fedrep.privacy import AdaptiveClipping, ClientLevelDP  # noqa: E402


@dataclass(frozen=True)
class Workload:
    """The fit every variant runs."""

    clients: int = 10
    samples: int = 50
    rounds: int = 4
    head_epochs: int = 1
    body_epochs: int = 1
    batch_size: int = 10
    seed: int = 0


SMALL = Workload(clients=3, samples=20, rounds=2)
"""``--small``: a smoke run of the whole script (tests)."""
CLIP = 1e-3
"""Small enough that the noise (std σ·C/m per coordinate) leaves the random-data CNN trainable: with C = 1 and
m = 5 it is 0.2 per weight, the weights blow up and clients are left out of rounds (a different workload). The
mechanism's work does not depend on C."""
VARIANTS: dict[str, Callable[[int], ClientLevelDP | None]] = {
    "no DP": lambda rounds: None,
    "fixed clip": lambda rounds: ClientLevelDP(clip=CLIP, noise_multiplier=1.0, rounds=rounds),
    "adaptive clip": lambda rounds: ClientLevelDP(
        clip=CLIP, noise_multiplier=1.0, adaptive=AdaptiveClipping(count_noise_std=2.0), rounds=rounds
    ),
}
"""Each variant's mechanism (a fresh one per fit: it keeps the run's accountant and clip)."""
PARTICIPATION = {"every client (q = 1)": 1.0, "half the clients (q = 0.5)": 0.5}


def datamodule(w: Workload) -> FederatedDataModule:
    """Random tensors of CIFAR's shape, 2 classes per client."""
    g = torch.Generator().manual_seed(w.seed)
    n = w.clients * w.samples
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.arange(n) % 10
    return FederatedDataModule(
        TensorDataset(x, y),
        TensorDataset(x[:20], y[:20]),
        partitioner=ShardPartitioner(w.clients, 2),
        batch_size=w.batch_size,
        seed=w.seed,
    )


def timed_fit(w: Workload, variant: str, participation: float, device: str) -> list[float]:
    """One fit of ``variant``; each round's wall-clock seconds."""
    torch.manual_seed(w.seed)
    model = CIFAR10CNN()
    strategy = FederatedStrategy(
        clients_per_round=participation,
        head_epochs=w.head_epochs,
        body_epochs=w.body_epochs,
        weighting="uniform",
        seed=w.seed,
        privacy=VARIANTS[variant](w.rounds),
    )
    clock = RoundClock()
    trainer = make_trainer(w.rounds, callbacks=[clock], strategy=strategy, **trainer_device(device))
    trainer.fit(model, datamodule=datamodule(w))
    return clock.seconds


def later_rounds(seconds: list[float]) -> float:
    """The mean round after the first (the first round alone when the fit has one)."""
    return statistics.fmean(seconds[1:] or seconds)


def measure(w: Workload, participation: float, repeats: int, device: str) -> dict[str, list[list[float]]]:
    """``{variant: [round seconds of each repeat]}``, the variants interleaved within each repeat."""
    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            times[variant].append(timed_fit(w, variant, participation, device))
    return times


def report(label: str, times: dict[str, list[list[float]]]) -> list[list[str]]:
    """Print one participation's table and per-repeat ratios; returns the table's rows."""
    base = [later_rounds(t) for t in times["no DP"]]
    best_base = min(base)
    rows = []
    for variant, runs in times.items():
        later = [later_rounds(t) for t in runs]
        first = min(t[0] for t in runs)
        rows.append(
            [
                variant,
                f"{min(later) * 1e3:.1f}",
                f"{min(later) / best_base:.3f}x",
                f"{first * 1e3:.1f}",
            ]
        )
    print(f"\n{label}:\n")
    print(
        format_table(
            ["variant", "a round, best (ms)", "ratio to no DP (best)", "first round, best (ms)"], rows
        )
    )
    for variant, runs in times.items():
        if variant == "no DP":
            continue
        ratios = [later_rounds(t) / b for t, b in zip(runs, base)]
        print(f"  {variant}: per-repeat ratios " + ", ".join(f"{r:.3f}x" for r in ratios))
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[list[str]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (--small: 1)")
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"rounds per fit (default {Workload.rounds})"
    )
    parser.add_argument(
        "--small", action="store_true", help="3 clients x 20 samples, 2 rounds, 1 repeat (tests)"
    )
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet()
    watch = Stopwatch()
    workload = SMALL if args.small else Workload()
    if args.rounds is not None:
        workload = replace(workload, rounds=args.rounds)
    repeats = args.repeats or (1 if args.small else 5)
    print(
        f"Client-level DP overhead on {device_label(args.device)}: FedRep, CIFAR10CNN on random CIFAR-shaped data, "
        f"{workload.clients} clients x {workload.samples} samples, {workload.head_epochs} head + {workload.body_epochs} "
        f"body epoch(s), {workload.rounds} rounds, best of {repeats} interleaved repeats"
    )
    out = {}
    for label, participation in PARTICIPATION.items():
        out[label] = report(label, measure(workload, participation, repeats, args.device))
    print("\ntarget: client-level DP <= 1.05x a round without it")
    print_footer(watch)
    return out


if __name__ == "__main__":
    main()
