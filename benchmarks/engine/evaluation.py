"""Personalized evaluation of 100, 1,000 and 10,000 clients: batched vs one batch per step.

Each client holds 20 test samples (random features, 10 classes) and, after one short training round
of 10 clients, either its trained head or the initial one. ``trainer.test`` runs each client's own
model on its own split and logs the per-client summaries; timed for ``runner="sequential"`` (the
user's ``test_step`` per batch, head swapped per client) and ``runner="auto"`` (the global body over
many clients' samples at once, every client's head in one ``vmap``), in one run, with the same
per-client metrics.

Usage::

    .venv/bin/python benchmarks/engine/evaluation.py            # 100, 1000, 10000 clients
    .venv/bin/python benchmarks/engine/evaluation.py --small    # 100, 300 clients (tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import make_trainer, quiet  # noqa: E402

from lightning_fedrep import FederatedDataModule, FederatedStrategy, IIDPartitioner  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402

TRAIN, TEST = 20, 20


def make_data(clients: int) -> FederatedDataModule:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(clients * (TRAIN + TEST), 64, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    n = clients * TRAIN
    dm = FederatedDataModule(
        TensorDataset(x[:n], y[:n]),
        TensorDataset(x[n:], y[n:]),
        IIDPartitioner(clients),
        batch_size=10,
        seed=0,
    )
    dm.setup("fit")
    return dm


def evaluated(clients: int, runner: str) -> tuple[float, FederatedStrategy]:
    """Train one round of 10 clients, then time ``trainer.test`` of every client."""
    dm = make_data(clients)
    torch.manual_seed(0)
    strategy = FederatedStrategy(clients_per_round=10, head_epochs=1, body_epochs=1, runner=runner)
    model = MLPClassifier()
    trainer = make_trainer(1, strategy=strategy)
    trainer.fit(model, datamodule=dm)
    start = time.perf_counter()
    trainer.test(model, datamodule=dm, verbose=False)
    return time.perf_counter() - start, strategy


def compare(clients: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per-client test accuracy of the per-batch and the batched evaluation (they must be equal)."""
    per_batch = evaluated(clients, "sequential")[1].client_metrics["test"].per_client("test/acc")
    batched = evaluated(clients, "auto")[1].client_metrics["test"].per_client("test/acc")
    return per_batch, batched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="100 and 300 clients (tests)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    quiet(args.threads)
    sizes = (100, 300) if args.small else (100, 1000, 10_000)
    print(
        f"trainer.test of every client, MLP, {TEST} test samples each, cpu, {torch.get_num_threads()} threads"
    )
    print("  clients | per batch s  ms/client | batched s  ms/client | speed-up")
    for clients in sizes:
        slow, _ = evaluated(clients, "sequential")
        fast, _ = evaluated(clients, "auto")
        print(
            f"  {clients:7d} | {slow:11.2f} {slow / clients * 1e3:10.2f} | {fast:9.2f} {fast / clients * 1e3:10.3f} | "
            f"{slow / fast:7.1f}x"
        )


if __name__ == "__main__":
    main()
