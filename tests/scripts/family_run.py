"""Every scenario of ``tests/test_distributed_family.py`` in one launch, on 1 or N CPU processes (gloo).

Lightning's launcher re-runs this script for every extra rank once, at the first ``fit``; the later
Trainers reuse the processes and the process group, so one launch runs every scenario in sequence:

* ``fedper``, ``lg_fedavg``, ``local``: each built-in algorithm not covered by ``federated_run.py``;
* ``fault``: FedRep with a client raising in round 1 and one turning NaN in round 2 (``on_client_error="skip"``),
  both dealt to rank 1 on 2 processes;
* ``collapse``: FedRep with ``NeuralCollapse`` (penalties, server step on the heads, NC metrics);
* ``finetuned``: FedRep validated with ``FineTunedEvaluation`` every round;
* ``checkpoint``: a FedRep fit that saves a checkpoint, then ``validate``, ``test`` and ``predict``
  (personalized) from that checkpoint, each by a fresh Trainer, strategy and module.

Every rank writes ``{scenario: what it holds}`` to ``<out>.rank<r>.pt``. :func:`run_scenarios` is also
called in the pytest process with ``devices=1`` (the reference the N-process run must equal).

    python tests/scripts/family_run.py --devices 2 --out /tmp/family
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_fedrep import (  # noqa: E402
    ClientFaultWarning,
    FederatedDDPStrategy,
    FederatedStrategy,
    FineTunedEvaluation,
    NeuralCollapse,
)
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402
from tests.scripts.federated_run import Net, client_data  # noqa: E402

ROUNDS = 3
FAULTS = {(1, 4): "raise", (2, 5): "nan"}
"""(round, client) -> what client's training step does at its 2nd step in that round (rank 1's clients
on 2 processes: the test checks it)."""


class FamilyNet(Net):
    """``federated_run.Net`` with a test step, a predict step, and injected faults."""

    def __init__(self, faults: dict[tuple[int, int], str] | None = None) -> None:
        super().__init__()
        self.faults = dict(faults or {})
        self._steps: dict[tuple[int, int], int] = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        key = (self.trainer.current_epoch, self.trainer.strategy.current_client)
        self._steps[key] = self._steps.get(key, 0) + 1
        kind = self.faults.get(key)
        if kind is not None and self._steps[key] == 2:
            if kind == "raise":
                raise RuntimeError("injected failure")
            return loss * float("nan")
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_ce", torch.nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def make_strategy(devices: int, **overrides: Any) -> FederatedStrategy:
    settings = dict(
        algorithm="fedrep",
        clients_per_round=1.0,
        head_epochs=2,
        body_epochs=1,
        local_epochs=2,
        runner="sequential",
        seed=3,
    )
    settings.update(overrides)
    epochs = {n: settings.pop(n) for n in ("head_epochs", "body_epochs", "local_epochs")}
    settings.update(epoch_settings(settings["algorithm"], **epochs))  # the others would be refused
    if devices > 1:
        return FederatedDDPStrategy(timeout=120, **settings)
    return FederatedStrategy(**settings)


def make_trainer(devices: int, strategy: FederatedStrategy, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=ROUNDS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def held(strategy: FederatedStrategy, trainer: L.Trainer) -> dict[str, Any]:
    """What this process holds after a fit: the federation, its history and how rounds were dealt."""
    federation = strategy.federation
    return {
        "world_size": trainer.world_size,
        "global": strategy.global_tensors(),
        "clients": {c: strategy.client_tensors(c) for c in range(federation.num_clients)},
        "history": strategy.history,
        "val_acc": strategy.client_metrics["val"].per_client("val/acc"),
        "faults": [asdict(f) for f in strategy.faults],
        "shares": [[list(s.clients) for s in strategy.round_shares(r)] for r in range(ROUNDS)],
    }


def fit(devices: int, callbacks: list | None = None, faults: dict | None = None, **settings: Any) -> tuple:
    torch.manual_seed(0)  # the module's initialization (the data and the sampling have their own seeds)
    strategy = make_strategy(devices, **settings)
    trainer = make_trainer(devices, strategy, callbacks=callbacks or [])
    trainer.fit(FamilyNet(faults), datamodule=client_data())
    return strategy, trainer


def algorithm(devices: int, name: str) -> dict[str, Any]:
    return held(*fit(devices, algorithm=name))


def fault(devices: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ClientFaultWarning)
        return held(*fit(devices, faults=FAULTS, on_client_error="skip"))


def collapse(devices: int) -> dict[str, Any]:
    callback = NeuralCollapse(server_step=True, server_lr=0.5, metrics_samples=16)
    result = held(*fit(devices, callbacks=[callback]))
    result["nc"] = callback.history
    result["server_round"] = callback.server_round
    return result


def finetuned(devices: int) -> dict[str, Any]:
    return held(*fit(devices, callbacks=[FineTunedEvaluation(epochs=2)]))


def checkpoint(devices: int, path: str) -> dict[str, Any]:
    strategy, trainer = fit(devices)
    trainer.save_checkpoint(path)
    result = held(strategy, trainer)
    for stage in ("validate", "test", "predict"):
        torch.manual_seed(1)  # another initialization: everything must come from the checkpoint
        evaluator = make_strategy(devices, predict="personalized")
        run = getattr(make_trainer(devices, evaluator), stage)
        kwargs = {} if stage == "predict" else {"verbose": False}
        output = run(FamilyNet(), datamodule=client_data(), ckpt_path=path, **kwargs)
        if stage == "predict":
            result["predict"] = {"outputs": output, "clients": list(evaluator.prediction_clients)}
        else:
            split = "val" if stage == "validate" else "test"
            result[stage] = {
                "logged": output,
                "per_client": evaluator.client_metrics[split].per_client(f"{split}/acc"),
                "evaluated": evaluator.evaluated_clients,
            }
    return result


def run_scenarios(devices: int, out: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Every scenario on ``devices`` processes; this process's rank and what it held after each (the
    caller's torch RNG state and thread count are left as they were)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            results = {name: algorithm(devices, name) for name in ("fedper", "lg_fedavg", "local")}
            results["fault"] = fault(devices)
            results["collapse"] = collapse(devices)
            results["finetuned"] = finetuned(devices)
            results["checkpoint"] = checkpoint(devices, f"{out}.ckpt")
    finally:
        torch.set_num_threads(threads)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return rank, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, results = run_scenarios(args.devices, args.out)
    torch.save(results, f"{args.out}.rank{rank}.pt")
    if torch.distributed.is_initialized():  # gloo's threads left to interpreter exit can abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
