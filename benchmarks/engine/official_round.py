"""One FedRep round of the real official code (github.com/lgcollins/FedRep) beside the strategy's, in one run.

The workload of ``cifar_round.py --full`` (10 clients x 500 CIFAR-shaped samples of 2 classes, 10 head + 1 body
epochs, batch 10, SGD lr 0.01 momentum 0.5, weight decay 1e-4 on weights). The official side runs the official
repository's own code, imported from a checkout you pass (``--official``; this script never downloads it): its
``get_model`` (``CNNCifar``), its ``LocalUpdate.train`` and the body of ``main_fedrep.py``'s round loop (a
``copy.deepcopy`` of the global net per user, the user's head loaded, ``train``, the weighted sums), on the same
tensors (``cifar_round.make_data``); CIFAR-10 itself is not needed (the cost does not depend on the pixels).
The checkout's ``models/test.py`` (evaluation only) does not compile on Python 3.11 (tabs mixed with spaces): an
empty module stands in for it.
The strategy side is ``cifar_round.strategy_round`` with ``runner="vectorized"`` and ``"auto"``. Each is timed
``--repeats`` times, alternating, best of each.

Usage (alone on the machine)::

    git clone https://github.com/lgcollins/FedRep /tmp/FedRep    # once, where the network allows
    .venv/bin/python benchmarks/engine/official_round.py --official /tmp/FedRep --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_device_argument, device_label, quiet, synchronize  # noqa: E402
from cifar_round import Workload, make_data, strategy_round  # noqa: E402


def official_args(w: Workload) -> SimpleNamespace:
    """The options ``scripts/FedRep_cifar10_2shards.sh`` gives ``main_fedrep.py`` (what ``train`` reads)."""
    return SimpleNamespace(
        dataset="cifar10",
        model="cnn",
        num_classes=10,
        alg="fedrep",
        lr=0.01,
        local_bs=w.batch_size,
        local_ep=w.head_epochs + w.body_epochs,
        local_rep_ep=w.body_epochs,
        local_updates=10**6,  # the official default: never reached
        num_users=w.clients,
        device=torch.device(w.device),
    )


def official_round(w: Workload, code: dict[str, Any], dataset: Any, users: dict[int, list[int]]) -> float:
    """``main_fedrep.py``'s round loop over every user, on the official code; returns its seconds."""
    args = official_args(w)
    torch.manual_seed(w.seed)
    net_glob = code["get_model"](args)
    net_glob.train()
    w_glob_keys = list(itertools.chain.from_iterable(net_glob.weight_keys[i] for i in [0, 1, 3, 4]))
    w_locals = {u: dict(net_glob.state_dict()) for u in users}
    synchronize()
    start = time.perf_counter()
    w_glob: dict[str, torch.Tensor] = {}
    total_len = 0
    for idx in users:
        local = code["LocalUpdate"](args=args, dataset=dataset, idxs=users[idx])
        net_local = copy.deepcopy(net_glob)
        w_local = net_local.state_dict()
        for k in w_locals[idx]:
            if k not in w_glob_keys:
                w_local[k] = w_locals[idx][k]
        net_local.load_state_dict(w_local)
        w_local, _, _ = local.train(net=net_local, idx=idx, w_glob_keys=w_glob_keys, lr=args.lr, last=False)
        size = len(users[idx])
        total_len += size
        for key in net_glob.state_dict():
            w_glob[key] = w_local[key] * size if key not in w_glob else w_glob[key] + w_local[key] * size
            w_locals[idx][key] = w_local[key]
    for key in w_glob:
        w_glob[key] = torch.div(w_glob[key], total_len)
    net_glob.load_state_dict(w_glob)
    synchronize()
    return time.perf_counter() - start


def load_official(path: Path) -> dict[str, Any]:
    """The official code's ``get_model`` and ``LocalUpdate``, imported from the checkout at ``path``."""
    if not (path / "main_fedrep.py").is_file():
        raise SystemExit(
            f"--official {path}: not a checkout of github.com/lgcollins/FedRep (no main_fedrep.py)."
        )
    sys.path.insert(0, str(path))
    import models  # the official repository's package

    # models/test.py (evaluation, not part of a round) mixes tabs and spaces, a TabError on Python 3.11: it is
    # replaced by an empty module; models/Update.py imports from it only what its test functions use
    sys.modules["models.test"] = models.test = types.ModuleType("models.test")
    models.test.test_img_local = None
    from models.Update import LocalUpdate
    from utils.train_utils import get_model

    return {"LocalUpdate": LocalUpdate, "get_model": get_model}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--official", type=Path, required=True, help="a checkout of github.com/lgcollins/FedRep"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="3 clients x 20 samples, 2 head epochs (tests)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(None)
    w = Workload(clients=3, samples=20, head_epochs=2) if args.small else Workload()
    w = Workload(**{**w.__dict__, "device": args.device})
    code = load_official(args.official)
    dm = make_data(w)
    dataset = dm.client_data(0).dataset
    users = {c: dm.client_data(c).indices.tolist() for c in range(w.clients)}
    times: dict[str, float] = {"official": float("inf"), "vectorized": float("inf"), "auto": float("inf")}
    for _ in range(args.repeats):
        times["official"] = min(times["official"], official_round(w, code, dataset, users))
        for engine in ("vectorized", "auto"):
            synchronize()
            start = time.perf_counter()
            strategy_round(w, make_data(w), engine)
            synchronize()
            times[engine] = min(times[engine], time.perf_counter() - start)
    print(
        f"FedRep round, {w.clients} clients x {w.samples} samples, {w.head_epochs} head + {w.body_epochs} body "
        f"epochs, batch {w.batch_size}, {device_label(args.device)} "
        f"({torch.get_num_threads()} threads), best of {args.repeats}"
    )
    print(f"  official code (lgcollins/FedRep)  {times['official']:7.2f} s")
    print(f"  strategy vectorized               {times['vectorized']:7.2f} s")
    print(f"  strategy auto                     {times['auto']:7.2f} s")
    print(
        f"  official / vectorized: {times['official'] / times['vectorized']:.2f}x   "
        f"official / auto: {times['official'] / times['auto']:.2f}x"
    )
    return times


if __name__ == "__main__":
    main()
