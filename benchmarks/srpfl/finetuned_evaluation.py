"""SRPFL's fine-tuned evaluation of 100 CIFAR-shaped clients: cached features vs full forward passes.

``FineTunedEvaluation(epochs=10)`` (the SRPFL recipes' ``--FT_epoch 10``, batch size 10, the module's
SGD) fine-tunes every client's head of the ``CIFAR10CNN`` before ``trainer.test`` scores it. Timed in
one run, the same trainer and federation, the callback with ``cache_features=False`` (every step a full
forward pass, as before) and ``cache_features=True`` (one feature pass per client, then the head steps
on the cached features), each repeated and the fastest taken; the per-client metrics must agree
(accuracy equal, loss within float error: the features of a sample computed in a batch of 1,024 and
in a batch of 10 may differ in the last bits).

The data are synthetic tensors of CIFAR's shape (3x32x32, 10 classes). Each client holds 20 training
samples (CIFAR-10 over 100 clients gives 500 each: fewer here to keep the run within a few minutes on 2 CPU
cores; both paths' costs grow with the samples alike, the cached one saving 9 of the 10 forward passes)
and 10 test samples.

Usage::

    .venv/bin/python benchmarks/srpfl/finetuned_evaluation.py             # 100 clients, 20 samples each
    .venv/bin/python benchmarks/srpfl/finetuned_evaluation.py --clients 20 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_device_argument, device_label, make_trainer, quiet, synchronize, trainer_device  # noqa: E402

from lightning_fedrep import FederatedDataModule, FedRepStrategy, IIDPartitioner  # noqa: E402
from lightning_fedrep.callbacks import FineTunedEvaluation  # noqa: E402
from lightning_fedrep.models import CIFAR10CNN  # noqa: E402

EPOCHS, BATCH = 10, 10
"""The SRPFL recipes' fine-tuning epochs and batch size."""


def make_data(clients: int, train: int, test: int) -> FederatedDataModule:
    """``clients`` IID clients of synthetic CIFAR-shaped samples."""
    g = torch.Generator().manual_seed(0)
    n_train, n_test = clients * train, clients * test
    x = torch.randn(n_train + n_test, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    dm = FederatedDataModule(
        TensorDataset(x[:n_train], y[:n_train]),
        TensorDataset(x[n_train:], y[n_train:]),
        IIDPartitioner(clients),
        batch_size=BATCH,
        seed=0,
    )
    dm.setup("fit")
    return dm


class TimedFineTuning(FineTunedEvaluation):
    """``FineTunedEvaluation`` that records how long its fine-tuning (before the scoring) took."""

    seconds = 0.0

    def _fine_tune(self, trainer, pl_module) -> None:
        synchronize()
        start = time.perf_counter()
        super()._fine_tune(trainer, pl_module)
        synchronize()
        self.seconds = time.perf_counter() - start


def timed_test(trainer, model, dm, callback: TimedFineTuning, cached: bool) -> tuple[float, float, dict]:
    """Seconds of one ``trainer.test`` and of its fine-tuning, and its per-client ``test/acc`` and
    ``test/loss``."""
    callback.cache_features = cached
    synchronize()
    start = time.perf_counter()
    trainer.test(model, datamodule=dm, verbose=False)
    synchronize()
    seconds = time.perf_counter() - start
    metrics = trainer.strategy.client_metrics["test"]
    return seconds, callback.seconds, {m: metrics.per_client(f"test/{m}") for m in ("acc", "loss")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--train", type=int, default=20, help="training samples per client")
    parser.add_argument("--test", type=int, default=10, help="test samples per client")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(args.threads)
    dm = make_data(args.clients, args.train, args.test)
    torch.manual_seed(0)
    strategy = FedRepStrategy(clients_per_round=min(10, args.clients), head_epochs=1, body_epochs=1, seed=0)
    callback = TimedFineTuning(epochs=EPOCHS, stages=("test",))
    trainer = make_trainer(1, callbacks=[callback], strategy=strategy, **trainer_device(args.device))
    model = CIFAR10CNN()
    trainer.fit(model, datamodule=dm)  # one round: a trained body, 10 trained heads
    full, cached, full_tuning, cached_tuning = [], [], [], []
    for _ in range(args.repeats):
        seconds, tuning, full_metrics = timed_test(trainer, model, dm, callback, cached=False)
        full.append(seconds)
        full_tuning.append(tuning)
        seconds, tuning, cached_metrics = timed_test(trainer, model, dm, callback, cached=True)
        cached.append(seconds)
        cached_tuning.append(tuning)
    print(
        f"FineTunedEvaluation({EPOCHS} epochs, batch {BATCH}) + trainer.test, CIFAR10CNN, {args.clients} "
        f"clients x {args.train} training samples, "
        f"{device_label(args.device)}, {torch.get_num_threads()} threads, min of "
        f"{args.repeats}"
    )
    print("                      | fine-tuning s | trainer.test s (fine-tuning + scoring)")
    print(f"  full forward passes | {min(full_tuning):13.2f} | {min(full):7.2f}")
    print(f"  cached features     | {min(cached_tuning):13.2f} | {min(cached):7.2f}")
    print(
        f"  speed-up            | {min(full_tuning) / min(cached_tuning):12.1f}x | {min(full) / min(cached):6.1f}x"
    )
    print(f"  ({callback.cache_decision})")
    same_acc = full_metrics["acc"] == cached_metrics["acc"]
    loss_gap = max(
        abs(full_metrics["loss"][c] - cached_metrics["loss"][c]) / max(abs(full_metrics["loss"][c]), 1e-12)
        for c in full_metrics["loss"]
    )
    print(f"  per-client accuracy equal: {same_acc}; largest relative loss difference: {loss_gap:.1e}")
    if not same_acc or loss_gap > 1e-5:
        raise SystemExit("the cached fine-tuning's per-client metrics differ from the full passes'")


if __name__ == "__main__":
    main()
