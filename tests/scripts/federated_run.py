"""One federated fit on 1 or N CPU processes (gloo), run as a standalone script.

Lightning's launcher re-runs this script for every extra rank (``sys.argv``), so multi-process tests
start it with ``subprocess`` and a timeout, never inside the pytest process. Every rank writes what it
holds after the fit to ``<out>.rank<r>.pt``: the global tensors, every client's tensors, the history
and the last validation's per-client accuracy.

    python tests/scripts/federated_run.py --devices 2 --algorithm fedrep --rounds 3 --out /tmp/run
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from lightning_fedrep import (  # noqa: E402
    AdaptiveParticipation,
    FederatedCallback,
    FederatedDataModule,
    FederatedDDPStrategy,
    FederatedStrategy,
    FedRep,  # noqa: E402
    HeadFineTuning,
)
from lightning_fedrep.federation import Stacked  # noqa: E402
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402
from lightning_fedrep.federation.api.registry import register_algorithm  # noqa: E402


class MedianFedRep(FedRep):
    """FedRep whose server takes the coordinate-wise median of the bodies (``--algorithm fedrep_median``;
    ``tests/test_aggregation.py``): every rank must see every rank's updates."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "fedrep_median"

    def aggregator(self, like):
        return Stacked(like)

    def aggregate(self, server, results, failures):
        rows = results.aggregator.stacked()
        return server.replace(shared={name: rows[name].median(dim=0).values for name in server.shared}), {}


register_algorithm(MedianFedRep(), override=True)

SIZES = (7, 41, 13, 22, 30, 9, 55, 18)  # uneven: 1 to 7 batches of 8 per epoch


class Net(L.LightningModule):
    """A body and a ``classifier`` head, its loss declared (so the vectorized runner can run it)."""

    fedrep_head = "classifier"
    fedrep_loss = "cross_entropy"

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU())
        if dropout:  # --dropout: a random layer (randomness='per_client' takes it on the vectorized runner)
            self.body.insert(2, nn.Dropout(dropout))
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5, weight_decay=1e-3)


class ManualNet(Net):
    """Net with manual optimization (refused on several processes)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def client_data(seed: int = 0) -> FederatedDataModule:
    """Clients of uneven sizes, each with its own label skew (labels depend on the client)."""
    generator = torch.Generator().manual_seed(seed)
    train, test = [], []
    for client, n in enumerate(SIZES):
        centers = torch.randn(4, 6, generator=generator)
        for count, sets in ((n, train), (max(3, n // 3), test)):
            y = (torch.arange(count) + client) % 4
            x = centers[y] + 0.7 * torch.randn(count, 6, generator=generator)
            sets.append(TensorDataset(x, y))
    return FederatedDataModule.from_client_datasets(train, test, batch_size=8, eval_batch_size=5)


class KillRank(FederatedCallback):
    """Kills this process (SIGKILL, no clean-up) when ``rank`` starts round ``round_index``."""

    def __init__(self, rank: int, round_index: int):
        self.rank, self.round_index = rank, round_index

    def on_round_start(self, trainer, pl_module, plan):
        if trainer.global_rank == self.rank and plan.round == self.round_index:
            os.kill(os.getpid(), signal.SIGKILL)


class DisagreeingPlan(FederatedCallback):
    """Rank 1 drops the round's last client: the ranks' plans differ (a bug the strategy must catch)."""

    def configure_round(self, trainer, plan):
        if trainer.global_rank == 1:
            return plan.replace(clients=plan.clients[:-1])
        return plan


class ReadsEveryClient(FederatedCallback):
    """A callback declaring that it reads every client's state (refused with a sharded store)."""

    needs_every_client = True


def holdings(strategy: FederatedStrategy, trainer: L.Trainer, rounds: int) -> dict:
    """What this rank holds after a fit (its clients gathered from every rank first): the global tensors,
    every client's tensors and declared state, the server's tensors, the history and per-client accuracy."""
    federation = strategy.federation
    store = federation.store
    held = sorted(set(store.local) | set(store.finetuned))  # before gathering: what this rank holds
    strategy.gather_clients()
    return {
        "held": held,
        "world_size": trainer.world_size,
        "global": strategy.global_tensors(),
        "clients": {c: strategy.client_tensors(c) for c in range(federation.num_clients)},
        "declared": {c: dict(store.client_state(c)) for c in range(federation.num_clients)},
        "server": dict(federation.server_tensors),
        "history": strategy.history,
        "val_acc": strategy.client_metrics["val"].per_client("val/acc"),
        "finetune_val_acc": strategy.client_metrics["finetune/val"].per_client("finetune/val/acc")
        if "finetune/val" in strategy.client_metrics
        else {},
        "global_step": trainer.global_step,
        "runner": strategy.runner_report.runner,
        "participants": [len(strategy.round_plan(r).clients) for r in range(rounds)],
        "results": strategy.results(),
        "train_loss": trainer.callback_metrics["train/loss"].item()
        if "train/loss" in trainer.callback_metrics
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--algorithm", default="fedrep")
    parser.add_argument("--runner", default="sequential")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients-per-round", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None, help="write a checkpoint here after the fit")
    parser.add_argument("--save-every", type=int, default=0, help="also every N steps, into <out>_ckpt/")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-round", type=int, default=1)
    parser.add_argument("--disagree", action="store_true")
    parser.add_argument("--adaptive", action="store_true", help="SRPFL participation by measured latency")
    parser.add_argument(
        "--finetune", choices=["head", "full"], default=None, help="one fine-tuning round after"
    )
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--client-store", default="replicated", choices=["replicated", "sharded"])
    parser.add_argument("--reads-every-client", action="store_true")
    parser.add_argument(
        "--seed-by-rank", action="store_true", help="each rank initializes its module differently"
    )
    parser.add_argument("--manual", action="store_true", help="a module with manual optimization")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout in the body")
    parser.add_argument("--randomness", default="exact", choices=["exact", "per_client"])
    args = parser.parse_args()
    torch.set_num_threads(1)

    settings = dict(
        algorithm=args.algorithm,
        clients_per_round=args.clients_per_round if args.clients_per_round < 1 else 1.0,
        **epoch_settings(args.algorithm, head_epochs=2, body_epochs=1, local_epochs=2),
        runner=args.runner,
        seed=3,
        randomness=args.randomness,
    )
    if args.devices > 1:
        strategy = FederatedDDPStrategy(timeout=args.timeout, client_store=args.client_store, **settings)
    else:
        strategy = FederatedStrategy(**settings)
    callbacks = []
    if args.kill_rank is not None:
        callbacks.append(KillRank(args.kill_rank, args.kill_round))
    if args.disagree:
        callbacks.append(DisagreeingPlan())
    if args.reads_every_client:
        callbacks.append(ReadsEveryClient())
    if args.finetune:
        callbacks.append(HeadFineTuning(epochs=1, mode=args.finetune))
    if args.adaptive:
        callbacks.append(AdaptiveParticipation(initial_clients=2, rounds_per_stage=1))
    if args.save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=f"{args.out}_ckpt",
                every_n_train_steps=args.save_every,
                save_top_k=-1,
                filename="{step}",
            )
        )
    L.seed_everything(int(os.environ.get("LOCAL_RANK", 0)) if args.seed_by_rank else 0, verbose=False)
    model = ManualNet() if args.manual else Net(args.dropout)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.rounds,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=client_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    result = holdings(strategy, trainer, args.rounds)
    torch.save(result, f"{args.out}.rank{trainer.global_rank}.pt")
    if torch.distributed.is_initialized():  # gloo's threads left to interpreter exit can abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
