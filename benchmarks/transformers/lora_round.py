"""A tiny transformer's LoRA round, vectorized against sequential against a plain loop, and the store's bytes
per client against the adapters' bytes, at 1,000 and 10,000 clients; all measured in one run.

Workload: a BERT built from a config (``--width`` 64, 2 layers, untrained; nothing downloaded) with LoRA
(rank 8, query/value) and the FedSA split (``lora_split("fedsa")``: B matrices and classifier personal, A
matrices shared, FedPer's schedule), ``--clients`` clients of synthetic keyword sequences (64 samples of 16
tokens each), every client every round, 1 local epoch, batch 16, AdamW lr 1e-3.

  (a) plain loop   : hand-written PyTorch, client after client: load its personal tensors, AdamW over its
                     batches, keep its personal tensors, average the A matrices (the same arithmetic, and
                     the same dropout)
  (b) sequential   : ``FederatedStrategy(runner="sequential")``, a second round of a fit timed
  (c) vectorized   : ``FederatedStrategy(runner="vectorized")``, the same
  store            : a fit's ``strategy.federation.store`` filled with 1,000 and 10,000 clients' personal tensors
                     (``store.put``), measured by ``ClientStore.nbytes()`` (the tensors it holds) and by the
                     process's resident memory, against the adapters' bytes (the split's personal parameters of
                     the module) and against a full model copy per client

``--randomness exact`` (default) switches dropout off, so (b) and (c) compute the same numbers.
``--randomness per_client`` keeps dropout at 0.1 and passes ``FederatedStrategy(randomness="per_client")`` (each
client its own random stream on the vectorized runner: the same distribution, not the same draws).

Usage::

    .venv/bin/python benchmarks/transformers/lora_round.py                  # CPU, 16 clients
    .venv/bin/python benchmarks/transformers/lora_round.py --device cuda --clients 64
    .venv/bin/python benchmarks/transformers/lora_round.py --small          # tests: 4 clients, 100 and 1,000 stored
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "engine")]

from _common import (  # noqa: E402
    RoundClock,
    add_device_argument,
    device_label,
    quiet,
    synchronize,
    trainer_device,
)
from store_memory import release_freed, resident_bytes  # noqa: E402

from lightning_fedrep import FederatedStrategy  # noqa: E402
from lightning_fedrep.data.synthetic_text import PermutedLabelTextDataModule  # noqa: E402
from lightning_fedrep.models.lora import LORA_SPLITS, lora_split  # noqa: E402
from lightning_fedrep.models.transformers import HFSequenceClassifier  # noqa: E402

SPLIT = "fedsa"
SAMPLES, LENGTH, BATCH, LR = 64, 16, 16, 1e-3


def model(width: int, dropout: float) -> HFSequenceClassifier:
    """The tiny BERT with LoRA (same initial values on every call)."""
    torch.manual_seed(0)
    config = {
        "model_type": "bert",
        "vocab_size": 128,
        "hidden_size": width,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 2 * width,
        "max_position_embeddings": LENGTH,
    }
    return HFSequenceClassifier(
        config=config, dropout=dropout, lora_r=8, lr=LR, attn_implementation="eager", pad_token_id=0
    )


def data(clients: int) -> PermutedLabelTextDataModule:
    return PermutedLabelTextDataModule(
        num_clients=clients,
        samples_per_client=SAMPLES,
        test_samples_per_client=8,
        vocab_size=128,
        length=LENGTH,
        batch_size=BATCH,
    )


def strategy_round(runner: str, args: argparse.Namespace) -> tuple[float, Any, Any]:
    """Seconds of the second round of a two-round fit, the strategy and the module."""
    dropout = 0.1 if args.randomness == "per_client" else 0.0
    module = model(args.width, dropout)
    strategy = FederatedStrategy(
        **lora_split(SPLIT).strategy_kwargs(),
        clients_per_round=1.0,
        local_epochs=1,
        seed=0,
        runner=runner,
        randomness=args.randomness,
    )
    clock = RoundClock()
    trainer = _trainer(strategy, clock, args.device)
    trainer.fit(module, datamodule=data(args.clients))
    return clock.seconds[-1], strategy, module


def _trainer(strategy: FederatedStrategy, clock: RoundClock, device: str) -> Any:
    import lightning as L

    return L.Trainer(
        strategy=strategy,
        max_epochs=2,
        limit_val_batches=0,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_device(device),
    )


def plain_round(args: argparse.Namespace) -> float:
    """The same round's arithmetic as a plain loop: per client, its personal tensors in, AdamW steps, out."""
    device = torch.device(args.device)
    module = model(args.width, 0.1 if args.randomness == "per_client" else 0.0).to(device)
    dm = data(args.clients)
    dm.setup("fit")
    named = dict(module.named_parameters())
    personal = LORA_SPLITS[SPLIT].personal(module)
    shared = [n for n, p in named.items() if p.requires_grad and n not in personal]
    kept = {c: {n: named[n].detach().clone() for n in personal} for c in range(args.clients)}
    batches = []
    for c in range(args.clients):
        client = dm.client_data(c)
        x, y = (t[client.indices].to(device) for t in client.dataset.tensors)
        batches.append([(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)])
    start_shared = {n: named[n].detach().clone() for n in shared}
    synchronize()
    began = time.perf_counter()
    total = {n: torch.zeros_like(t) for n, t in start_shared.items()}
    for c in range(args.clients):
        with torch.no_grad():
            for n in shared:
                named[n].copy_(start_shared[n])
            for n in personal:
                named[n].copy_(kept[c][n])
        optimizer = module.configure_optimizers()
        for x, y in batches[c]:
            loss = F.cross_entropy(module(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            for n in personal:
                kept[c][n].copy_(named[n])
            for n in shared:
                total[n] += named[n]
    with torch.no_grad():
        for n in shared:
            named[n].copy_(total[n] / args.clients)
    synchronize()
    return time.perf_counter() - began


def store_rows(strategy: Any, module: Any, sizes: tuple[int, ...]) -> list[dict[str, float]]:
    """The fit's store filled with ``clients`` clients' personal tensors, measured two ways."""
    named = dict(module.named_parameters())
    personal = list(strategy.federation.local_names)
    adapter_bytes = sum(named[n].nbytes for n in personal)
    model_bytes = sum(p.nbytes for p in module.parameters())
    rows = []
    for clients in sizes:
        store = copy.deepcopy(strategy.federation.store)
        store.local.clear()
        template = [named[n].detach().cpu() for n in personal]
        release_freed()
        before = resident_bytes()
        for client in range(clients):
            store.put(client, [t + client for t in template])
        gc.collect()
        resident = resident_bytes() - before
        rows.append(
            {
                "clients": clients,
                "held": store.nbytes(),
                "resident": resident,
                "adapters": adapter_bytes * clients,
                "full": model_bytes * clients,
            }
        )
        del store
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--randomness", choices=["exact", "per_client"], default="exact")
    parser.add_argument("--small", action="store_true", help="4 clients, stores of 100 and 1,000 (tests)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.small:
        args.clients, args.width = 4, 32
    quiet()
    sizes = (100, 1000) if args.small else (1000, 10_000)
    plain = plain_round(args)
    sequential, _, _ = strategy_round("sequential", args)
    vectorized, strategy, module = strategy_round("vectorized", args)
    print(
        f"Tiny BERT (width {args.width}, 2 layers) + LoRA r=8, split {SPLIT!r}, {args.clients} clients x {SAMPLES} "
        f"samples, 1 local epoch, batch {BATCH}, on {device_label(args.device)}, randomness {args.randomness}"
    )
    report = strategy.runner_report
    print(f"  runner report: {report.runner}, randomness {report.randomness} ({report.randomness_contract})")
    print(f"  (a) plain loop  {plain:8.3f} s")
    print(f"  (b) sequential  {sequential:8.3f} s   {sequential / plain:5.2f}x the plain loop")
    print(
        f"  (c) vectorized  {vectorized:8.3f} s   {vectorized / plain:5.2f}x the plain loop, "
        f"{sequential / vectorized:5.2f}x faster than sequential"
    )
    rows = store_rows(strategy, module, sizes)
    mib = 2**20
    print("  store (FedSA: B matrices and classifier per client), measured:")
    print("  clients | held (MiB) | resident (MiB) | adapters (MiB) | held/adapters | full copies (MiB)")
    for row in rows:
        print(
            f"  {row['clients']:7d} | {row['held'] / mib:10.2f} | {row['resident'] / mib:14.2f} | "
            f"{row['adapters'] / mib:14.2f} | {row['held'] / row['adapters']:12.2f}x | {row['full'] / mib:17.1f}"
        )
    return {"plain": plain, "sequential": sequential, "vectorized": vectorized, "store": rows}


if __name__ == "__main__":
    main()
