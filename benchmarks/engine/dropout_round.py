"""A round of an MLP with dropout: the vectorized runner (``randomness="per_client"``) against the sequential runner.

The digits MLP (``MLPClassifier``, 64 features) with ``nn.Dropout(--p)`` in its body (``--where body``, the
default: no feature cache, every phase runs the whole model in lockstep) or before its head (``--where head``:
head phases on cached features), ``--clients`` clients of 50 random samples, ``--per-round`` a round, batch 10,
FedRep (10 head + 1 body epochs; ``--algorithm fedavg``: 1 local epoch). Each runner fits ``--rounds`` rounds in
the same run; the table gives each one's median round (epoch start to end, after the first), the path it took,
and the ratio sequential / vectorized. With dropout the two runners draw different masks (the same
distribution), so only the time is compared here; ``tests/test_randomness_per_client.py`` compares accuracy.

Usage (alone on the machine: timings)::

    .venv/bin/python benchmarks/engine/dropout_round.py                  # 100 clients, 10 a round, 4 rounds
    .venv/bin/python benchmarks/engine/dropout_round.py --where head     # dropout in the head: cached features
    .venv/bin/python benchmarks/engine/dropout_round.py --device cuda    # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RoundClock, add_device_argument, device_label, make_trainer, quiet, trainer_device  # noqa: E402
from auto_choice import path_of  # noqa: E402
from scaling import make_data as clients_data  # noqa: E402

from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402


class DropoutMLP(MLPClassifier):
    """The digits MLP with ``nn.Dropout(p)`` after its first layer (``where="body"``) or before its head."""

    def __init__(self, p: float, where: str) -> None:
        super().__init__(lr=0.01)
        self.drop = nn.Dropout(p if where == "head" else 0.0)
        if where == "body":
            self.body.insert(2, nn.Dropout(p))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return super().forward_head(self.drop(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def fit(args: argparse.Namespace, runner: str) -> dict[str, Any]:
    """One fit of ``args.rounds`` rounds on ``runner``: its later rounds' median seconds and its path."""
    data = clients_data(args.clients, shape=(64,))
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=args.algorithm,
        clients_per_round=args.per_round,
        **epoch_settings(args.algorithm, head_epochs=10, body_epochs=1, local_epochs=1),
        runner=runner,
        randomness="per_client",
        seed=0,
    )
    clock = RoundClock()
    trainer = make_trainer(args.rounds, strategy=strategy, callbacks=[clock], **trainer_device(args.device))
    trainer.fit(DropoutMLP(args.p, args.where), datamodule=data)
    return {"runner": runner, "round": statistics.median(clock.seconds[1:]), "path": path_of(strategy)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--p", type=float, default=0.3, help="dropout probability")
    parser.add_argument("--where", choices=["body", "head"], default="body")
    parser.add_argument("--algorithm", choices=["fedrep", "fedavg"], default="fedrep")
    parser.add_argument("--threads", type=int, default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(args.threads)
    print(
        f"digits MLP, dropout {args.p} in the {args.where}, {args.algorithm}, {args.clients} clients x 50 samples, "
        f"{args.per_round} per round, batch 10, {device_label(args.device)}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds a fit; median round after the first"
    )
    rows = [fit(args, runner) for runner in ("sequential", "vectorized")]
    for row in rows:
        print(f"  {row['runner']:10s} | {row['round']:8.3f} s | {row['path']}")
    ratio = rows[0]["round"] / rows[1]["round"]
    print(f"  sequential / vectorized (per_client): {ratio:.2f}x")
    return rows


if __name__ == "__main__":
    main()
