"""Memory of the per-client store at 1k, 10k and 100k clients of the CIFAR-10 CNN (heads of 650 values).

Fills a :class:`~lightning_fedrep.federation.store.ClientStore` (what ``strategy.federation.store`` is) with
every client's head, as after a run in which every client trained, and measures the process's
resident memory before and after (so Python and tensor overheads count; after a warm-up fill, with
freed heap memory given back first, so neither first-use costs nor reused memory skew a row), against two references
computed from the sizes: the heads' bytes alone (650 float32 values per client) and a full model copy
per client (307,842 float32 values, what per-client ``deepcopy`` simulators keep).

Usage::

    .venv/bin/python benchmarks/engine/store_memory.py            # 1k, 10k, 100k clients
    .venv/bin/python benchmarks/engine/store_memory.py --small    # 100, 1000 clients (tests)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os

import torch

from lightning_fedrep.federation.store import ClientStore
from lightning_fedrep.models import CIFAR10CNN

HEAD = ("fc3.weight", "fc3.bias")


def resident_bytes() -> int:
    """The process's resident memory (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def filled_store(clients: int, template: list[torch.Tensor]) -> ClientStore:
    """A store holding a distinct head for each of ``clients`` clients."""
    store = ClientStore(template)
    for client in range(clients):
        store.put(client, [t + client for t in template])
    return store


def release_freed() -> None:
    """Collect garbage and give freed heap memory back to the system (glibc ``malloc_trim``), so that
    a store filling memory freed earlier in the process still shows as growth."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass


def measure(clients: int) -> dict[str, float]:
    model = CIFAR10CNN()
    named = dict(model.named_parameters())
    template = [named[n].detach() for n in HEAD]
    model_values = sum(p.numel() for p in model.parameters())
    head_values = sum(t.numel() for t in template)
    filled_store(100, template)  # warm-up: first-use costs (lazy code pages, allocator pools) not counted
    release_freed()
    before = resident_bytes()
    store = filled_store(clients, template)
    gc.collect()
    used = resident_bytes() - before
    assert len(store.local) == clients
    return {
        "clients": clients,
        "store_bytes": used,
        "per_client": used / clients,
        "heads_bytes": head_values * 4 * clients,
        "full_copies_bytes": model_values * 4 * clients,
    }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="100 and 1000 clients (tests)")
    args = parser.parse_args(argv)
    sizes = (100, 1000) if args.small else (1000, 10_000, 100_000)
    print("CIFAR-10 CNN (307,842 parameters, head fc3: 650): client store, resident memory measured")
    print("  clients | store (MiB) | per client (B) | heads alone (MiB) | store/heads | full copies (MiB)")
    rows = []
    for clients in sizes:
        row = measure(clients)
        rows.append(row)
        mib = 2**20
        print(
            f"  {clients:7d} | {row['store_bytes'] / mib:11.1f} | {row['per_client']:14.0f} | "
            f"{row['heads_bytes'] / mib:17.1f} | {row['store_bytes'] / row['heads_bytes']:10.2f}x | "
            f"{row['full_copies_bytes'] / mib:17.0f}"
        )
    return rows


if __name__ == "__main__":
    main()
