"""Seconds per round as clients per round grow, and the cross-device setting (many small clients).

A 64-64-32-10 MLP (``MLPClassifier``), clients of 50 samples each (random features, 10 classes, iid),
batch 10, SGD lr 0.05 momentum 0.5. One round, timed three ways in one run:

  vectorized : ``FederatedStrategy(runner="vectorized")``, whole ``Trainer.fit``
  sequential : ``FederatedStrategy(runner="sequential")``, whole ``Trainer.fit``
  plain      : a plain PyTorch loop, one client after another (one model, tensors swapped with
               ``copy_``, a fresh SGD per client, tensor-indexed batches, no Lightning)

Table 1: FedRep (5 head + 1 body epochs) at 10, 100 and 1,000 clients per round: seconds per round
and clients per second (cost should grow linearly with the work). Table 2: the cross-device setting,
FedAvg (1 local epoch) and FedRep with 1,000 clients per round.

Usage::

    .venv/bin/python benchmarks/engine/scaling.py           # 10, 100, 1000 clients
    .venv/bin/python benchmarks/engine/scaling.py --small   # 10, 40 clients (tests)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import make_trainer, quiet  # noqa: E402

from lightning_fedrep import FederatedDataModule, FederatedStrategy, IIDPartitioner  # noqa: E402
from lightning_fedrep.federation.api.epochs import default_phases, epoch_settings  # noqa: E402
from lightning_fedrep.federation.api.registry import get_algorithm  # noqa: E402
from lightning_fedrep.models import MLPClassifier  # noqa: E402
from lightning_fedrep.models.optim import fedrep_sgd  # noqa: E402

SAMPLES, BATCH, HEAD_EPOCHS, BODY_EPOCHS = 50, 10, 5, 1


def make_data(clients: int, seed: int = 0, shape: tuple[int, ...] = (64,)) -> FederatedDataModule:
    """``clients`` iid clients of :data:`SAMPLES` random samples of ``shape`` (10 classes), set up."""
    g = torch.Generator().manual_seed(seed)
    n = clients * SAMPLES
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    dm = FederatedDataModule(
        TensorDataset(x, y),
        TensorDataset(x[:100], y[:100]),
        IIDPartitioner(clients),
        batch_size=BATCH,
        seed=seed,
    )
    dm.setup("fit")
    return dm


def strategy_round(dm: FederatedDataModule, algorithm: str, runner: str) -> FederatedStrategy:
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=dm.num_clients,
        **epoch_settings(algorithm, head_epochs=HEAD_EPOCHS, body_epochs=BODY_EPOCHS, local_epochs=1),
        runner=runner,
    )
    make_trainer(1, strategy=strategy).fit(MLPClassifier(), datamodule=dm)
    return strategy


def plain_round(dm: FederatedDataModule, algorithm: str) -> dict[str, torch.Tensor]:
    """One round client after client, the strategy's batches; returns the new global shared part."""
    torch.manual_seed(0)
    model = MLPClassifier()
    loader = dm.train_dataloader()
    x_all, y_all = dm.client_data(0).dataset.tensors
    phases = default_phases(
        get_algorithm(algorithm), {"head_epochs": HEAD_EPOCHS, "body_epochs": BODY_EPOCHS, "local_epochs": 1}
    )
    shared = [
        n for n, _ in model.named_parameters() if algorithm == "fedavg" or not n.startswith("classifier")
    ]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = {n: torch.zeros_like(start[n], dtype=torch.float64) for n in shared}
    weight = 0.0
    for client in range(dm.num_clients):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        optimizer = fedrep_sgd(model, 0.05, 0.5, 1e-4)
        data = dm.client_data(client)
        per_epoch = math.ceil(len(data) / BATCH)
        budgets = [(phase.train, phase.num_steps(per_epoch)) for phase in phases]
        positions = iter(loader.client_positions(client, 0, 0, sum(n for _, n in budgets)))
        for part, steps in budgets:
            for n, p in model.named_parameters():
                head = n.startswith("classifier")
                p.requires_grad_(part == "all" or head == (part == "head"))
            for _ in range(steps):
                index = data.indices[next(positions)]
                optimizer.zero_grad()
                F.cross_entropy(model(x_all[index]), y_all[index]).backward()
                optimizer.step()
        named = dict(model.named_parameters())
        for n in shared:
            total[n] += named[n].detach().double() * len(data)
        weight += len(data)
    return {n: (t / weight).float() for n, t in total.items()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(clients: int, algorithm: str) -> dict[str, dict[str, torch.Tensor]]:
    """The three variants' new global shared part after one round (they must be equal)."""
    dm = make_data(clients)
    shared = plain_round(dm, algorithm)
    out = {"plain": shared}
    for engine in ("sequential", "vectorized"):
        tensors = strategy_round(make_data(clients), algorithm, engine).global_tensors()
        out[engine] = {n: tensors[n] for n in shared}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="10 and 40 clients (tests)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    quiet(args.threads)
    sizes = (10, 40) if args.small else (10, 100, 1000)
    print(
        f"MLP, {SAMPLES} samples per client, batch {BATCH}, cpu, {torch.get_num_threads()} threads, one round"
    )
    print("FedRep (5 head + 1 body epochs)")
    print("  clients | vectorized s  clients/s | sequential s  clients/s | plain loop s | seq/vec  plain/vec")
    for k in sizes:
        dm = make_data(k)
        vec = timed(lambda dm=dm: strategy_round(dm, "fedrep", "vectorized"))
        seq = timed(lambda dm=dm: strategy_round(dm, "fedrep", "sequential"))
        plain = timed(lambda dm=dm: plain_round(dm, "fedrep"))
        print(
            f"  {k:7d} | {vec:12.2f} {k / vec:10.0f} | {seq:12.2f} {k / seq:10.0f} | {plain:12.2f} | "
            f"{seq / vec:6.2f}x  {plain / vec:6.2f}x"
        )
    k = sizes[-1]
    print(f"cross-device: {k} clients per round of {SAMPLES} samples")
    print("  algorithm | vectorized s | sequential s | plain loop s | seq/vec  plain/vec")
    for algorithm in ("fedavg", "fedrep"):
        dm = make_data(k)
        vec = timed(lambda dm=dm, a=algorithm: strategy_round(dm, a, "vectorized"))
        seq = timed(lambda dm=dm, a=algorithm: strategy_round(dm, a, "sequential"))
        plain = timed(lambda dm=dm, a=algorithm: plain_round(dm, a))
        print(
            f"  {algorithm:9s} | {vec:12.2f} | {seq:12.2f} | {plain:12.2f} | {seq / vec:6.2f}x  {plain / vec:6.2f}x"
        )


if __name__ == "__main__":
    main()
