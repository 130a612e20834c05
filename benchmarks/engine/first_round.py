"""What does ``runner="auto"``'s one-time timing cost? The cross-device round, first round against the later ones.

1,000 clients of 50 samples each (random tensors of CIFAR-10's shape, 10 classes, iid), 100 clients per round,
batch 10, the CIFAR-10 CNN (``CIFAR10CNN``, SGD lr 0.01 momentum 0.5; ``--model mlp``: the digits MLP on 64
features), FedAvg with 1 local epoch (``--algorithm fedrep``: 10 head + 1 body epochs). Fits with
``runner="auto"`` and, as references in the same run, ``runner="sequential"`` and ``runner="vectorized"``, each
``--rounds`` rounds. Per fit it prints the first round, timed from the call of ``Trainer.fit`` to the end of
epoch 0 (so it holds Lightning's start-up and ``auto``'s timing, which runs when the first training loader is
bound, before epoch 0 starts), the median of the later rounds (epoch start to end), their ratio, the path the
fit took and its timing line. The bar (issue 39): ``auto``'s first round at most 1.25 times its later rounds.

Usage (alone on the machine: timings)::

    .venv/bin/python benchmarks/engine/first_round.py                    # CNN, FedAvg, 4 rounds, each runner once
    .venv/bin/python benchmarks/engine/first_round.py --runs 3           # auto 3 times (spread)
    .venv/bin/python benchmarks/engine/first_round.py --small            # 100 clients, 10 per round (tests)
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    RoundClock,
    add_device_argument,
    device_label,
    make_trainer,
    quiet,
    synchronize,
    trainer_device,
)
from auto_choice import BODY_EPOCHS, HEAD_EPOCHS, MODELS, make_data, path_of  # noqa: E402

from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402

BAR = 1.25


class FirstRoundClock(RoundClock):
    """:class:`RoundClock`'s epochs, and the first round from :attr:`fit_start` (set just before ``Trainer.fit``)
    to the end of epoch 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fit_start = 0.0
        self.first = 0.0

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if len(self.seconds) == 1:
            self.first = time.perf_counter() - self.fit_start


def timing_line(strategy: FederatedStrategy) -> str:
    """The measured step times of ``auto``'s log line (empty where nothing was measured)."""
    found = re.search(r"\(one step of .*?\)", strategy.runner_report.reason)
    return found.group(0) if found else ""


def fit(
    model: str, algorithm: str, runner: str, clients: int, per_round: int, rounds: int, device: str
) -> dict[str, Any]:
    """One fit of ``rounds`` rounds: its first round, the later rounds' median, their ratio, path and timing."""
    data = make_data(model, clients)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=per_round,
        **epoch_settings(algorithm, head_epochs=HEAD_EPOCHS, body_epochs=BODY_EPOCHS, local_epochs=1),
        runner=runner,
        seed=0,
    )
    clock = FirstRoundClock()
    trainer = make_trainer(rounds, strategy=strategy, callbacks=[clock], **trainer_device(device))
    module = MODELS[model][1]()
    synchronize()
    clock.fit_start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    later = statistics.median(clock.seconds[1:])
    return {
        "runner": runner,
        "first": clock.first,
        "later": later,
        "ratio": clock.first / later,
        "path": path_of(strategy),
        "timing": timing_line(strategy),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="100 clients, 10 per round, 3 rounds (tests)")
    parser.add_argument("--model", choices=list(MODELS), default="cnn")
    parser.add_argument("--algorithm", choices=["fedavg", "fedrep"], default="fedavg")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per fit (default 4; --small 3)")
    parser.add_argument("--runs", type=int, default=1, help="auto fits (the references run once)")
    parser.add_argument("--runners", nargs="+", default=["sequential", "vectorized"], help="references")
    parser.add_argument("--threads", type=int, default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(args.threads)
    clients, per_round = (100, 10) if args.small else (1000, 100)
    rounds = args.rounds or (3 if args.small else 4)
    print(
        f"{args.model}, {args.algorithm}, {clients} clients x 50 samples, {per_round} per round, batch 10, "
        f"{device_label(args.device)}, {torch.get_num_threads()} threads, {rounds} rounds a fit; first round: "
        "Trainer.fit called to the end of epoch 0; later: median epoch"
    )
    print("  runner     | first s | later s | first/later | path   | timing")
    rows = []
    for runner in ["auto"] * args.runs + list(args.runners):
        row = fit(args.model, args.algorithm, runner, clients, per_round, rounds, args.device)
        rows.append(row)
        flag = "" if runner != "auto" or row["ratio"] <= BAR else f"  (over {BAR})"
        print(
            f"  {runner:10s} | {row['first']:7.2f} | {row['later']:7.2f} | {row['ratio']:11.2f} | "
            f"{row['path']:6s} | {row['timing']}{flag}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
