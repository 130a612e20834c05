"""Does ``runner="auto"`` pick the faster path? The cross-device workload, ``auto`` run 5 times.

1,000 clients of 50 samples each (random tensors of CIFAR-10's or digits' shape, 10 classes), 100 clients per
round, batch 10, SGD lr 0.01 momentum 0.5; the CIFAR-10 CNN (``CIFAR10CNN``) and the digits MLP
(``MLPClassifier``); FedAvg (1 local epoch) and FedRep (10 head + 1 body epochs, the official epochs). Each
setting fits ``runner="sequential"`` once, then ``--runs`` pairs of ``runner="vectorized"`` and ``runner="auto"``
fits, one right after the other, in turn the vectorized one first and the ``auto`` one first (a load that
comes and goes on this shared machine then slows both of a pair alike), and takes the median of the rounds
after the first (the first pays the fit's start-up and ``auto``'s one-time timing, reported apart): 2 rounds of
the CNN, 40 of the MLP, whose rounds of 0.05-0.3 s a passing hiccup would otherwise decide (the sequential
fit, 10-20 times slower on the MLP, runs 2 rounds after the first). A row says which path ``auto`` chose in
each run (``seq``: the sequential runner, ``lock``: lockstep, ``lock/1``: lockstep with the uncached phases one
client at a time), each run's round time over the faster of the sequential round and its paired vectorized round
(the issue's bar: at most 1.10 in every run) and whether the choice was the same in every run.

Usage (alone on the machine: timings)::

    .venv/bin/python benchmarks/engine/auto_choice.py              # CNN and MLP, FedAvg and FedRep, 5 runs
    .venv/bin/python benchmarks/engine/auto_choice.py --small      # 200 clients, 20 per round, 2 runs (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RoundClock, add_device_argument, device_label, make_trainer, quiet, trainer_device  # noqa: E402
from scaling import make_data as clients_data  # noqa: E402

from lightning_fedrep import FederatedDataModule, FederatedStrategy  # noqa: E402
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402
from lightning_fedrep.models import CIFAR10CNN, MLPClassifier  # noqa: E402

SAMPLES, BATCH, HEAD_EPOCHS, BODY_EPOCHS = 50, 10, 10, 1
ROUNDS = {"cnn": 3, "mlp": 41}
SEQUENTIAL_ROUNDS = 3
MODELS = {"cnn": ((3, 32, 32), lambda: CIFAR10CNN(lr=0.01)), "mlp": ((64,), lambda: MLPClassifier(lr=0.01))}


def make_data(model: str, clients: int) -> FederatedDataModule:
    """``clients`` clients of :data:`SAMPLES` random samples of the model's input shape (iid labels)."""
    return clients_data(clients, shape=MODELS[model][0])


def fit(
    model: str,
    data: FederatedDataModule,
    algorithm: str,
    runner: str,
    per_round: int,
    rounds: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """``rounds`` rounds: the first round's seconds, the later rounds' median and the path the run took."""
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=per_round,
        **epoch_settings(algorithm, head_epochs=HEAD_EPOCHS, body_epochs=BODY_EPOCHS, local_epochs=1),
        runner=runner,
        seed=0,
    )
    clock = RoundClock()
    trainer = make_trainer(rounds, strategy=strategy, callbacks=[clock], **trainer_device(device))
    trainer.fit(MODELS[model][1](), datamodule=data)
    return {
        "first": clock.seconds[0],
        "round": statistics.median(clock.seconds[1:]),
        "path": path_of(strategy),
    }


def path_of(strategy: FederatedStrategy) -> str:
    """``seq`` (the sequential runner), ``lock`` (lockstep) or ``lock/1`` (lockstep, uncached phases one client
    at a time)."""
    if strategy.runner_report.runner == "sequential":
        return "seq"
    return "lock/1" if strategy.runner_settings.get("lane_width") == 1 else "lock"


def setting(
    model: str,
    algorithm: str,
    clients: int,
    per_round: int,
    runs: int,
    rounds: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """One row: the sequential round, then ``runs`` pairs of a vectorized and an ``auto`` fit (in turn
    one and the other first)."""
    data = make_data(model, clients)
    rounds = rounds or ROUNDS[model]
    sequential = fit(model, data, algorithm, "sequential", per_round, min(rounds, SEQUENTIAL_ROUNDS), device)
    vectorized, autos = [], []
    for run in range(runs):
        order = ("vectorized", "auto") if run % 2 == 0 else ("auto", "vectorized")
        pair = {engine: fit(model, data, algorithm, engine, per_round, rounds, device) for engine in order}
        vectorized.append(pair["vectorized"])
        autos.append(pair["auto"])
    return {
        "model": model,
        "algorithm": algorithm,
        "sequential": sequential["round"],
        "vectorized": statistics.median(v["round"] for v in vectorized),
        "auto": [a["round"] for a in autos],
        "auto_first": statistics.median(a["first"] for a in autos),
        "paths": [a["path"] for a in autos],
        "ratios": [a["round"] / min(sequential["round"], v["round"]) for a, v in zip(autos, vectorized)],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="200 clients, 20 per round, 2 runs (tests)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mlp-rounds", type=int, default=ROUNDS["mlp"], help="rounds of each MLP fit")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(args.threads)
    clients, per_round = (200, 20) if args.small else (1000, 100)
    runs = args.runs or (2 if args.small else 5)
    rounds = {"cnn": ROUNDS["cnn"], "mlp": args.mlp_rounds}
    rounds = {model: 3 if args.small else rounds[model] for model in MODELS}
    where = device_label(args.device)
    print(
        f"{clients} clients x {SAMPLES} samples, {per_round} per round, batch {BATCH}, {where}, "
        f"{torch.get_num_threads()} threads; seconds per round (median of the rounds after the first: "
        f"{rounds['cnn'] - 1} of the CNN, {rounds['mlp'] - 1} of the MLP, {SEQUENTIAL_ROUNDS - 1} sequential); "
        f"auto run {runs} times"
    )
    print(
        "  model | algorithm | sequential | vectorized | auto (each run)                  | auto's first round "
        "| auto / faster (max) | choices        | same"
    )
    rows = []
    for model in args.models:
        for algorithm in ("fedavg", "fedrep"):
            row = setting(model, algorithm, clients, per_round, runs, rounds[model], args.device)
            rows.append(row)
            autos = " ".join(f"{s:5.2f}" for s in row["auto"])
            print(
                f"  {model:5s} | {algorithm:9s} | {row['sequential']:10.2f} | {row['vectorized']:10.2f} | "
                f"{autos:32s} | {row['auto_first']:18.2f} | {max(row['ratios']):19.2f} | "
                f"{','.join(row['paths']):14s} | {'yes' if len(set(row['paths'])) == 1 else 'NO'}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
