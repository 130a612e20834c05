"""FLUTE's neural-collapse mechanism on offline class-shard data (``shared/reference/flute.md`` §9 E8).

Not a paper experiment (the paper's are CIFAR, Table 1): a Gaussian mixture of K = 10 classes (means
``N(0, I_32)``, isotropic noise std 2), N = 20 clients holding S = 2 classes each (``ShardPartitioner``),
50 training and 25 test samples per client, an MLP 32 → 64 → 16 body with a ``Linear(16, 10)`` head,
SGD lr 0.05 momentum 0.5, batch 10, half the clients per round, 30 rounds. Every run carries the
``NeuralCollapse`` callback for its metrics (over all 20 clients' heads after each round):

* **FLUTE**: one joint epoch, ``λ = 0.25, μ = 0.0025, ν = 0.0005``, server step lr 0.5;
* **FLUTE, no server step**;
* **penalties off**: the same joint epoch, ``λ = μ = ν = 0`` (FedPer);
* **FedRep**: 1 head epoch then 1 body epoch (not the paper's 10 head epochs, to keep it short).

Expected (the digest's mechanism claim): FLUTE ends with the lowest Global NC2, and accuracy no worse
than the baselines within noise.

Usage (from the repository root)::

    .venv/bin/python benchmarks/flute/mechanism.py [--seeds 0 1] [--rounds 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from benchmarks._common import Stopwatch, format_table, make_trainer, print_footer, quiet  # noqa: E402
from lightning_fedrep import FederatedDataModule, FederatedStrategy, Phase  # noqa: E402
from lightning_fedrep.callbacks import NeuralCollapse  # noqa: E402
from lightning_fedrep.data.partition import ShardPartitioner  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402

CLIENTS, TRAIN, TEST, CLASSES, DIM, NOISE = 20, 50, 25, 10, 32, 2.0
METHODS = {
    "FLUTE": (dict(server_step=True), [Phase("all", epochs=1)]),
    "FLUTE, no server step": (dict(), [Phase("all", epochs=1)]),
    "penalties off (FedPer)": (dict(lam=0, mu=0, nu=0), [Phase("all", epochs=1)]),
    "FedRep (1 head + 1 body epoch)": (
        dict(lam=0, mu=0, nu=0),
        [Phase("head", epochs=1), Phase("body", epochs=1)],
    ),
}


def mixture(seed: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(CLASSES, DIM, generator=g)

    def draw(n: int) -> TensorDataset:
        y = torch.arange(CLASSES).repeat_interleave(n // CLASSES)
        return TensorDataset(means[y] + NOISE * torch.randn(len(y), DIM, generator=g), y)

    return draw(CLIENTS * TRAIN), draw(CLIENTS * TEST)


def run(method: str, seed: int, rounds: int) -> list:
    options, phases = METHODS[method]
    torch.manual_seed(seed)
    train, test = mixture(seed)
    dm = FederatedDataModule(train, test, partitioner=ShardPartitioner(CLIENTS, 2), batch_size=10, seed=seed)
    model = MLPClassifier(in_features=DIM, hidden=64, features=16, num_classes=CLASSES, lr=0.05)
    callback = NeuralCollapse(**options)
    strategy = FederatedStrategy(phases=phases, clients_per_round=0.5, seed=seed)
    watch = Stopwatch()
    make_trainer(rounds, [callback], strategy=strategy, check_val_every_n_epoch=rounds).fit(
        model, datamodule=dm
    )
    first, last = callback.history[0], callback.history[-1]
    acc = strategy.results()["final"]["val/acc"]
    return [
        method,
        seed,
        first["nc/global_nc2"],
        last["nc/global_nc2"],
        last["nc/local_nc2"],
        last["nc/nc1"],
        last["nc/nc3"],
        acc,
        f"{watch.elapsed:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(1)
    watch = Stopwatch()
    rows = [run(method, seed, args.rounds) for seed in args.seeds for method in METHODS]
    print(
        f"## Mechanism: {CLIENTS} clients x 2 of {CLASSES} classes, {args.rounds} rounds, half participate\n"
    )
    print(
        format_table(
            [
                "method",
                "seed",
                "Global NC2 round 0",
                "Global NC2 final",
                "Local NC2",
                "NC1",
                "NC3",
                "val/acc",
                "time (s)",
            ],
            rows,
        )
    )
    print_footer(watch)


if __name__ == "__main__":
    main()
