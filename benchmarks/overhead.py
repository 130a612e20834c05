"""Strategy overhead: FedRep through ``FederatedStrategy`` vs a plain PyTorch loop doing the same arithmetic.

Both run the same rounds on the digits federation (same clients, same batches, same optimizer steps):
the plain loop is the fastest straightforward implementation (one model, heads swapped in with
``copy_``, a fresh SGD per client per round, tensor-indexed batches, no Lightning). Prints the time per
optimizer step of each and their ratio, measured in the same run. Usage:

    .venv/bin/python benchmarks/overhead.py [--rounds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import lightning as L
import torch
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.models import MLPClassifier
from lightning_fedrep.plan import round_generator, sample_clients

HEAD_EPOCHS, BODY_EPOCHS, PER_ROUND, SEED = 5, 1, 10, 0


def plain_loop(dm: DigitsDataModule, rounds: int) -> tuple[float, int]:
    torch.manual_seed(0)
    model = MLPClassifier()
    head = list(model.classifier.parameters())
    body = list(model.body.parameters())
    global_body = [p.detach().clone() for p in body]
    heads: dict[int, list[torch.Tensor]] = {}
    init_head = [p.detach().clone() for p in head]
    x_all, y_all = dm.train_set.tensors
    steps = 0
    start = time.perf_counter()
    for r in range(rounds):
        total, weight = [torch.zeros_like(p) for p in body], 0.0
        for cid in sample_clients(dm.num_clients, PER_ROUND, SEED, r):
            data = dm.client_data(cid)
            with torch.no_grad():
                for p, v in zip(body, global_body):
                    p.copy_(v)
                for p, v in zip(head, heads.get(cid, init_head)):
                    p.copy_(v)
            opt = model.configure_optimizers()
            per_epoch = math.ceil(len(data) / dm.batch_size)
            for epoch_pass in range(HEAD_EPOCHS + BODY_EPOCHS):
                train_head = epoch_pass < HEAD_EPOCHS
                for p in head:
                    p.requires_grad_(train_head)
                for p in body:
                    p.requires_grad_(not train_head)
                perm = torch.randperm(len(data), generator=round_generator(dm.seed, r, cid, epoch_pass))
                for j in range(per_epoch):
                    idx = data.indices[perm[j * dm.batch_size : (j + 1) * dm.batch_size]]
                    opt.zero_grad()
                    F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
                    opt.step()
                    steps += 1
            heads[cid] = [p.detach().clone() for p in head]
            with torch.no_grad():
                for t, p in zip(total, body):
                    t.add_(p, alpha=len(data))
            weight += len(data)
        global_body = [t / weight for t in total]
    return time.perf_counter() - start, steps


def strategy_run(dm: DigitsDataModule, rounds: int) -> tuple[float, int]:
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        clients_per_round=PER_ROUND, head_epochs=HEAD_EPOCHS, body_epochs=BODY_EPOCHS, seed=SEED
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(MLPClassifier(), datamodule=dm)
    return time.perf_counter() - start, trainer.global_step


def lightning_baseline(dm: DigitsDataModule, steps: int) -> float:
    """Lightning's own per-step cost: a plain Trainer over one DataLoader with the same number of steps."""
    torch.manual_seed(0)
    x, y = dm.train_set.tensors
    idx = torch.arange(steps * dm.batch_size) % len(y)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[idx], y[idx]), batch_size=dm.batch_size
    )
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(MLPClassifier(), train_dataloaders=loader)
    return (time.perf_counter() - start) / trainer.global_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dm = DigitsDataModule(num_clients=20, classes_per_client=2, batch_size=10, seed=0)
    dm.setup()
    plain, ours, lightning = [], [], []
    for _ in range(args.repeats):
        seconds, plain_steps = plain_loop(dm, args.rounds)
        plain.append(seconds / plain_steps)
        seconds, our_steps = strategy_run(dm, args.rounds)
        ours.append(seconds / our_steps)
        assert plain_steps == our_steps, (plain_steps, our_steps)
        lightning.append(lightning_baseline(dm, our_steps))
    p, o, lt = statistics.median(plain), statistics.median(ours), statistics.median(lightning)
    print(
        f"digits FedRep, {args.rounds} rounds x {PER_ROUND} clients, {plain_steps} optimizer steps, 1 thread, CPU"
    )
    print(f"plain PyTorch loop : {p * 1e3:7.3f} ms/step")
    print(f"FederatedStrategy  : {o * 1e3:7.3f} ms/step  (whole Trainer.fit, start-up included)")
    print(f"plain Lightning fit: {lt * 1e3:7.3f} ms/step  (one DataLoader, no federation, same steps)")
    print(f"ratio strategy/plain loop: {o / p:.2f}x   strategy/plain Lightning: {o / lt:.2f}x")


if __name__ == "__main__":
    main()
