"""Strategy overhead: FedRep through ``FederatedStrategy`` vs plain PyTorch loops doing the same arithmetic.

All run the same rounds on the digits federation (same clients, same batches, same optimizer steps).
Two pairs, each measured in the same run:

* one client step at a time: the strategy's sequential runner vs the fastest straightforward plain
  loop (one model, heads swapped in with ``copy_``, a fresh SGD per client per round, tensor-indexed
  batches, no Lightning), and a plain Lightning fit of the same steps;
* a round's clients in lockstep: the strategy's vectorized runner vs a plain loop doing the engine's
  arithmetic by hand (features cached for the head epochs, every client's step in one
  ``torch.func.vmap``, SGD with momentum and weight decay masked per client), no Lightning.

Usage:

    .venv/bin/python benchmarks/overhead.py [--rounds 10] [--repeats 3] [--device cuda]

On a GPU (``--device cuda``) the plain loops keep the whole data set on the GPU (the cheapest way to feed
it), the strategy is fed by Lightning as usual (each batch moved from host memory), and every timing waits
for the GPU's queued work.
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
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.federation.plan import round_generator, sample_clients
from lightning_fedrep.models import MLPClassifier

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_device_argument, device_label, synchronize, trainer_device  # noqa: E402

HEAD_EPOCHS, BODY_EPOCHS, PER_ROUND, SEED = 5, 1, 10, 0


def plain_loop(dm: DigitsDataModule, rounds: int, device: str = "cpu") -> tuple[float, int]:
    torch.manual_seed(0)
    model = MLPClassifier().to(device)
    head = list(model.classifier.parameters())
    body = list(model.body.parameters())
    global_body = [p.detach().clone() for p in body]
    heads: dict[int, list[torch.Tensor]] = {}
    init_head = [p.detach().clone() for p in head]
    x_all, y_all = (t.to(device) for t in dm.train_set.tensors)
    steps = 0
    synchronize()
    start = time.perf_counter()
    for r in range(rounds):
        total, weight = [torch.zeros_like(p) for p in body], 0.0
        for cid in sample_clients(dm.num_clients, PER_ROUND, SEED, r):
            data = dm.client_data(cid)
            indices = data.indices.to(device)
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
                perm = perm.to(device)
                for j in range(per_epoch):
                    idx = indices[perm[j * dm.batch_size : (j + 1) * dm.batch_size]]
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
    synchronize()
    return time.perf_counter() - start, steps


def plain_vectorized_loop(
    dm: DigitsDataModule, rounds: int, device: str = "cpu"
) -> tuple[float, dict[str, torch.Tensor]]:
    """The engine's arithmetic by hand: per round, one feature pass, the heads of all clients in
    lockstep on cached features, then the body epoch of all clients in lockstep (``vmap``); SGD with
    momentum and weight decay (weights only) applied to the clients that step. Returns the seconds
    and the final global body."""
    torch.manual_seed(0)
    model = MLPClassifier().to(device)
    hp = model.hparams
    loader = dm.train_dataloader()
    x_all, y_all = (t.to(device) for t in dm.train_set.tensors)
    named = dict(model.named_parameters())
    head_names = ["classifier.weight", "classifier.bias"]
    body_names = [n for n in named if n not in head_names]
    global_body = {n: named[n].detach().clone() for n in body_names}
    heads: dict[int, dict[str, torch.Tensor]] = {}
    init_head = {n: named[n].detach().clone() for n in head_names}

    def sgd(params: dict, buffers: dict, grads: dict, active: torch.Tensor) -> None:
        for n, p in params.items():
            shape = (-1,) + (1,) * (p.dim() - 1)
            d = grads[n] + (hp.weight_decay * p if not n.endswith("bias") else 0.0)
            buf = buffers.get(n)
            new = d if buf is None else hp.momentum * buf + d
            on = active.view(shape)
            buffers[n] = torch.where(on, new, buf) if buf is not None else new * on
            p.sub_(hp.lr * buffers[n] * on)

    head_module = _Method(model, "forward_head")

    def step_loss(tensors: dict, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor, head_only: bool):
        if head_only:
            out = torch.func.functional_call(
                head_module, {"module." + n: t for n, t in tensors.items()}, (x,)
            )
        else:
            out = torch.func.functional_call(model, tensors, (x,))
        per_sample = F.cross_entropy(out, y, reduction="none")
        return (per_sample * m).sum() / m.sum().clamp_min(1.0)

    synchronize()
    start = time.perf_counter()
    for r in range(rounds):
        clients = sample_clients(dm.num_clients, PER_ROUND, SEED, r)
        k = len(clients)
        sizes = [len(dm.client_data(c)) for c in clients]
        per_epoch = [math.ceil(n / dm.batch_size) for n in sizes]
        head_steps = [HEAD_EPOCHS * e for e in per_epoch]
        body_steps = [BODY_EPOCHS * e for e in per_epoch]
        positions = [
            [p.to(device) for p in loader.client_positions(c, r, 0, h + b)]
            for c, h, b in zip(clients, head_steps, body_steps)
        ]
        indices = [dm.client_data(c).indices.to(device) for c in clients]
        with torch.no_grad():
            features = model_features(model, global_body, x_all[torch.cat(indices)]).split(sizes)
        longest = max(sizes)
        feats = torch.zeros(k, longest, features[0].shape[1], device=device)
        labels = torch.zeros(k, longest, dtype=torch.long, device=device)
        for i, (f, idx) in enumerate(zip(features, indices)):
            feats[i, : len(f)] = f
            labels[i, : len(f)] = y_all[idx]
        head = {
            n: torch.stack([heads.get(c, init_head)[n] for c in clients]).requires_grad_(True)
            for n in head_names
        }
        body = {n: v.expand(k, *v.shape).clone() for n, v in global_body.items()}
        buffers: dict = {}
        rows = torch.arange(k, device=device)[:, None]
        head_loss = torch.func.vmap(lambda t, x, y, m: step_loss(t, x, y, m, True))
        for step in range(max(head_steps)):
            active = torch.tensor([step < h for h in head_steps], device=device)
            pos, mask = _batch_positions(positions, step, [0] * k, active, dm.batch_size)
            loss = head_loss(head, feats[rows, pos], labels[rows, pos], mask).sum()
            grads = dict(zip(head, torch.autograd.grad(loss, list(head.values()))))
            with torch.no_grad():
                sgd(head, buffers, grads, active)
        head = {n: t.detach() for n, t in head.items()}
        buffers = {}
        body = {n: t.requires_grad_(True) for n, t in body.items()}
        full_loss = torch.func.vmap(lambda b, h, x, y, m: step_loss({**b, **h}, x, y, m, False))
        for step in range(max(body_steps)):
            active = torch.tensor([step < b for b in body_steps], device=device)
            pos, mask = _batch_positions(positions, step, head_steps, active, dm.batch_size)
            x = torch.stack([x_all[idx[p]] for idx, p in zip(indices, pos)])
            y = torch.stack([y_all[idx[p]] for idx, p in zip(indices, pos)])
            loss = full_loss(body, head, x, y, mask).sum()
            grads = dict(zip(body, torch.autograd.grad(loss, list(body.values()))))
            with torch.no_grad():
                sgd(body, buffers, grads, active)
        weights = torch.tensor(sizes, dtype=torch.float64, device=device)
        global_body = {
            n: (t.detach().double() * weights.view(-1, *([1] * (t.dim() - 1))))
            .sum(0)
            .div(weights.sum())
            .float()
            for n, t in body.items()
        }
        for i, c in enumerate(clients):
            heads[c] = {n: t[i].clone() for n, t in head.items()}
    synchronize()
    return time.perf_counter() - start, global_body


class _Method(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, method: str):
        super().__init__()
        self.module, self.method = module, method

    def forward(self, *args):
        return getattr(self.module, self.method)(*args)


def model_features(model: MLPClassifier, body: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(
        _Method(model, "forward_features"), {"module." + k: v for k, v in body.items()}, (x,)
    )


def _batch_positions(positions, step, offsets, active, batch_size):
    """Each client's batch positions at its ``offset + step`` (zero-padded) and the padding mask."""
    pos = torch.zeros(len(positions), batch_size, dtype=torch.long, device=active.device)
    mask = torch.zeros(len(positions), batch_size, device=active.device)
    for i, on in enumerate(active.tolist()):
        if on:
            p = positions[i][offsets[i] + step]
            pos[i, : len(p)] = p
            mask[i, : len(p)] = 1.0
    return pos, mask


def strategy_run(
    dm: DigitsDataModule, rounds: int, runner: str = "sequential", device: str = "cpu"
) -> tuple[float, int]:
    return strategy_fit(dm, rounds, runner, device)[:2]


def strategy_fit(
    dm: DigitsDataModule, rounds: int, runner: str, device: str = "cpu"
) -> tuple[float, int, FederatedStrategy]:
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        clients_per_round=PER_ROUND,
        head_epochs=HEAD_EPOCHS,
        body_epochs=BODY_EPOCHS,
        seed=SEED,
        runner=runner,
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=rounds,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_device(device),
    )
    synchronize()
    start = time.perf_counter()
    trainer.fit(MLPClassifier(), datamodule=dm)
    synchronize()
    return time.perf_counter() - start, trainer.global_step, strategy


def lightning_baseline(dm: DigitsDataModule, steps: int, device: str = "cpu") -> float:
    """Lightning's own per-step cost: a plain Trainer over one DataLoader with the same number of steps."""
    torch.manual_seed(0)
    x, y = dm.train_set.tensors
    idx = torch.arange(steps * dm.batch_size) % len(y)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[idx], y[idx]), batch_size=dm.batch_size
    )
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_device(device),
    )
    synchronize()
    start = time.perf_counter()
    trainer.fit(MLPClassifier(), train_dataloaders=loader)
    synchronize()
    return (time.perf_counter() - start) / trainer.global_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = args.device
    torch.set_num_threads(1)
    dm = DigitsDataModule(num_clients=20, classes_per_client=2, batch_size=10, seed=0)
    dm.setup()
    plain, ours, lightning = [], [], []
    for _ in range(args.repeats):
        seconds, plain_steps = plain_loop(dm, args.rounds, device)
        plain.append(seconds / plain_steps)
        seconds, our_steps = strategy_run(dm, args.rounds, "sequential", device)
        ours.append(seconds / our_steps)
        assert plain_steps == our_steps, (plain_steps, our_steps)
        lightning.append(lightning_baseline(dm, our_steps, device))
    p, o, lt = statistics.median(plain), statistics.median(ours), statistics.median(lightning)
    print(
        f"digits FedRep, {args.rounds} rounds x {PER_ROUND} clients, {plain_steps} optimizer steps, 1 thread, "
        f"{device_label(device)}"
    )
    print(f"plain PyTorch loop : {p * 1e3:7.3f} ms/step")
    print(f"FederatedStrategy  : {o * 1e3:7.3f} ms/step  (whole Trainer.fit, start-up included)")
    print(f"plain Lightning fit: {lt * 1e3:7.3f} ms/step  (one DataLoader, no federation, same steps)")
    print(f"ratio strategy/plain loop: {o / p:.2f}x   strategy/plain Lightning: {o / lt:.2f}x")
    vector_plain, vector_ours = [], []
    for _ in range(args.repeats):
        vector_plain.append(plain_vectorized_loop(dm, args.rounds, device)[0])
        vector_ours.append(strategy_fit(dm, args.rounds, "vectorized", device)[0])
    vp, vo = statistics.median(vector_plain), statistics.median(vector_ours)
    print("a round's clients in lockstep (same rounds, same batches):")
    print(f"plain vectorized loop        : {vp:7.3f} s")
    print(f"FederatedStrategy vectorized : {vo:7.3f} s  (whole Trainer.fit, start-up included)")
    print(
        f"ratio engine/plain vectorized loop: {vo / vp:.2f}x (target <= 1.15x)   sequential strategy/engine: {o * plain_steps / vo:.2f}x"
    )


if __name__ == "__main__":
    main()
