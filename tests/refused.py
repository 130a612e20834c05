"""Every configuration the package refuses, with the argument its message must name.

``tests/test_refused.py`` runs each case (the error type and the argument in the message) and checks
that the table in docs/faults.md is what this module prints:

    python -m tests.refused    # the table "Refused configurations" of docs/faults.md, with the real messages

A case is Python code run with the names below: ``train``/``test`` are small data sets, ``fit(...)``
runs one round of the tiny model on an 8-client federation (``strategy=``, ``datamodule=``,
``callbacks=``, Trainer flags), so "when" says whether it fails at construction or at the fit's set-up
(before any training step); ``evaluate(datamodule, call)`` runs ``trainer.test`` (or ``call``) of a
checkpoint of such a fit on ``datamodule``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import EarlyStopping  # noqa: F401  (a case's code uses it)
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedrep import (  # noqa: F401  (the cases' code uses these names)
    APFL,
    HFMAML,
    L2GD,
    AdaptiveParticipation,
    Algorithm,
    DirichletPartitioner,
    Ditto,
    DynamicExponential,
    EvaluationSpec,
    FedCP,
    FederatedCallback,
    FederatedDataModule,
    FederatedDDPStrategy,
    FedMTL,
    FedProx,
    FedRep,
    FedRepStrategy,
    FedRoD,
    FineTunedEvaluation,
    FixedExponential,
    HeadFineTuning,
    IIDPartitioner,
    NeuralCollapse,
    Objective,
    OrthonormalBody,
    PerFedAvg,
    Phase,
    RunnerSettings,
    RunSummary,
    ShardPartitioner,
    TwoClassExponential,
    ValidateAtRounds,
)
from lightning_fedrep.app.seeds import parse_seeds, split_seeds  # noqa: F401
from lightning_fedrep.data.digits import DigitsDataModule  # noqa: F401
from lightning_fedrep.data.low_rank import LowRankLinearDataModule  # noqa: F401
from lightning_fedrep.data.pfllib import PFLlibPartitioner  # noqa: F401
from lightning_fedrep.data.sent140 import Sent140DataModule  # noqa: F401
from lightning_fedrep.data.vision import EMNISTDataModule, FashionMNISTDataModule  # noqa: F401
from lightning_fedrep.federation import Stacked
from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.checkpoint.reading import CheckpointError
from lightning_fedrep.federation.module.split import SplitError
from lightning_fedrep.models.sent140 import Sent140RNN  # noqa: F401
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule, tiny_datasets


@dataclass(frozen=True)
class Refused:
    code: str
    error: type[Exception]
    argument: str
    when: str = "construction"


def fit(
    strategy: Any = None,
    datamodule: Any = None,
    callbacks: Any = (),
    model: Any = None,
    ckpt_path: Any = None,
    **flags: Any,
) -> None:
    trainer = quiet_trainer(
        strategy=strategy or FedRepStrategy(head="classifier"),
        max_epochs=1,
        callbacks=list(callbacks),
        **flags,
    )
    trainer.fit(model or TinyNet(), datamodule=datamodule or tiny_datamodule(), ckpt_path=ckpt_path)


def evaluate(datamodule: Any, call: str = "test", model: Any = None, callbacks: Any = ()) -> None:
    """``trainer.<call>(ckpt_path=...)`` of ``model`` (the tiny one by default) with ``callbacks`` on
    ``datamodule``, from a checkpoint of one round on 8 clients."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "8_clients.ckpt"
        trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=1, limit_val_batches=0)
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())
        trainer.save_checkpoint(path)
        trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier"), callbacks=list(callbacks))
        getattr(trainer, call)(model or TinyNet(), datamodule=datamodule, ckpt_path=path)


def write_checkpoint(name: str) -> None:
    """Write ``name`` in the working folder: a checkpoint of one round on 8 clients cut in half
    (``truncated.ckpt``), with its federated state's version set to 99 (``version_99.ckpt``) or its global
    ``body.0.weight`` of another shape (``damaged.ckpt``); or of one epoch without a federated strategy
    (``plain.ckpt``)."""
    if name == "plain.ckpt":
        trainer = quiet_trainer(max_epochs=1)
        trainer.fit(TinyNet(), DataLoader(tiny_datasets()[0], batch_size=32))
        trainer.save_checkpoint(name)
        return
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=1, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule())
    trainer.save_checkpoint(name)
    if name == "truncated.ckpt":
        data = Path(name).read_bytes()
        Path(name).write_bytes(data[: len(data) // 2])
        return
    checkpoint = torch.load(name, weights_only=True)
    if name == "version_99.ckpt":
        checkpoint["lightning_fedrep"]["version"] = 99
    else:
        checkpoint["lightning_fedrep"]["global"][0] = torch.zeros(12, 7)
    torch.save(checkpoint, name)


def resume(name: str) -> None:
    """``fit`` resumed from the checkpoint ``name`` (:func:`write_checkpoint`), written in a temporary folder
    that is the working folder meanwhile, so the message names it the same way in every run."""
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        write_checkpoint(name)
        fit(ckpt_path=name)


def resume_stored(name: str, algorithm: str) -> None:
    """``fit`` with ``algorithm`` resumed from the stored checkpoint ``tests/data/<name>``, copied into a
    temporary working folder (so the message names it the same way in every run)."""
    stored = Path(__file__).resolve().parent / "data" / name
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        Path(name).write_bytes(stored.read_bytes())
        fit(strategy=FedRepStrategy(algorithm=algorithm), ckpt_path=name)


def predict(strategy: Any, dataloaders: Any) -> None:
    """``trainer.predict`` of the tiny model on ``dataloaders``."""
    quiet_trainer(strategy=strategy).predict(TinyNet(), dataloaders=dataloaders)


class UnbatchedProx(FedProx):
    """FedProx whose proximal term says it cannot run inside the lockstep runner's ``vmap``."""

    def objective(self, phase: str) -> Objective:
        (term,) = super().objective(phase).terms
        return Objective(terms=(dataclasses.replace(term, vmappable=False),))


class LegacyLossTerm(Algorithm):
    """An algorithm still written for the removed loss-term route."""

    def __init__(self) -> None:
        super().__init__("legacy_loss_term", {"body", "head"}, "an algorithm of the removed loss-term route")

    def loss_term(self, module: Any, global_state: Any) -> Any:
        return None


class LegacyCallbackTerm(FederatedCallback):
    """A callback still written for the removed loss-term route."""

    def loss_term(self, trainer: Any, pl_module: Any, batch: Any, step: Any) -> Any:
        return None


class LegacyObjectiveCallback(FederatedCallback):
    """A callback whose objective still takes the Trainer and the module."""

    def objective(self, trainer: Any, pl_module: Any, phase: str) -> Objective:
        return Objective()


class SmoothingNet(TinyNet):
    """Declares cross-entropy (what the vectorized runner trains); its ``training_step`` smooths the labels.
    Its initial weights are seeded: the refusal quotes both losses."""

    fedrep_loss = "cross_entropy"

    def __init__(self) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            super().__init__()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, label_smoothing=0.2)


class CountingStepsNet(TinyNet):
    """Declares cross-entropy; its ``training_step`` counts its calls in an attribute (a write the engine,
    which runs no ``training_step``, would make on its probe batches only)."""

    fedrep_loss = "cross_entropy"

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)


class LSTMNet(TinyNet):
    """Declares cross-entropy; its body is an ``nn.LSTM`` (6 inputs read as 3 steps of 2), which
    ``torch.func.vmap`` cannot batch."""

    fedrep_loss = "cross_entropy"

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.LSTM(2, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.body(x.reshape(len(x), 3, 2))
        return self.classifier(out[:, -1])


class AdamNet(TinyNet):
    fedrep_loss = "cross_entropy"

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class ScaledOutputNet(TinyNet):
    """Declares its loss, but its output is not ``head(features(x))``: the head's output is doubled."""

    fedrep_loss = "cross_entropy"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.classifier(self.body(x))


class StepScheduledNet(TinyNet):
    """An ``ExponentialLR`` that Lightning steps at every training step (``interval="step"``)."""

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BodyOptimizerNet(TinyNet):
    """Its optimizer holds the body only (the head is never trained)."""

    fedrep_loss = "cross_entropy"

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.body.parameters(), lr=0.05)


class TwoOptimizerNet(TinyNet):
    """Manual optimization with SGD for the body and the head's weight, Adam for the head's bias."""

    fedrep_loss = "cross_entropy"

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD([*self.body.parameters(), self.classifier.weight], lr=0.05),
            torch.optim.Adam([self.classifier.bias], lr=0.01),
        ]


class StackedFedRep(FedRep):
    """FedRep keeping every client's body (``Stacked``) within ``max_bytes``: the tiny body is 752 bytes."""

    def __init__(self, max_bytes: int = 2**30) -> None:
        super().__init__()
        self.max_bytes = max_bytes

    def aggregator(self, like: Any) -> Stacked:
        return Stacked(like, max_bytes=self.max_bytes)


class DictAggregatorFedRep(FedRep):
    """Its ``aggregator`` returns a plain dict, not an ``Aggregator``."""

    def aggregator(self, like: Any) -> Any:
        return {}


class V1AggregateFedRep(FedRep):
    """Its ``aggregate`` is the removed v1 server step ``(global_state, average)``."""

    def aggregate(self, global_state: Any, average: Any) -> Any:
        return average.mean(global_state)


def shifted(dataset: TensorDataset, by: int) -> TensorDataset:
    """``dataset`` with every label raised by ``by``."""
    return TensorDataset(dataset.tensors[0], dataset.tensors[1] + by)


def named(dataset: TensorDataset) -> TensorDataset:
    """``dataset`` with class names as labels (its ``targets``)."""
    relabelled = TensorDataset(*dataset.tensors)
    relabelled.targets = [("north", "east", "south", "west")[int(y)] for y in dataset.tensors[1]]
    return relabelled


class DictSamples(torch.utils.data.Dataset):
    """``dataset``'s samples as ``{"x": input, "y": label}`` dicts, with no ``targets``."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.dataset[index]
        return {"x": x, "y": y}


def floats(dataset: TensorDataset) -> TensorDataset:
    """``dataset`` with its class ids as floats (``3.0``)."""
    return TensorDataset(dataset.tensors[0], dataset.tensors[1].float())


def scoring(spec: Any, algorithm: str = "fedrep") -> Any:
    """A copy of the registered ``algorithm`` whose evaluation scores ``spec`` (an ``EvaluationSpec``)."""
    scored = copy.copy(ALGORITHMS[algorithm])
    scored.evaluation = lambda: spec
    return scored


S = 'fit(FedRepStrategy(head="classifier", '

CASES = [
    # the strategy
    Refused("FedRepStrategy(head=3)", TypeError, "head"),
    Refused("FedRepStrategy(head=[])", TypeError, "head"),
    Refused('FedRepStrategy(algorithm="fedrepp")', ValueError, "algorithm"),
    Refused("FedProx(mu=-0.1)", ValueError, "mu"),
    Refused("Ditto(lam=-1)", ValueError, "lam"),
    Refused('PerFedAvg(step="reptile")', ValueError, "step"),
    Refused("APFL(alpha=1.5)", ValueError, "alpha"),
    Refused("L2GD(p=1.0)", ValueError, "p"),
    Refused("fit(FedRepStrategy(algorithm=L2GD(lam=50.0)))", ValueError, "lam", "set-up"),
    Refused(
        'fit(FedRepStrategy(algorithm=L2GD(), clients_per_round=1.0, phases=[Phase("all", epochs=1)]))',
        ValueError,
        "phases",
        "set-up",
    ),
    Refused('fit(FedRepStrategy(algorithm="per_fedavg"))', ValueError, "fedrep_loss", "set-up"),
    Refused("LegacyLossTerm()", TypeError, "loss_term"),
    Refused("fit(callbacks=[LegacyCallbackTerm()])", TypeError, "loss_term", "set-up"),
    Refused("fit(callbacks=[LegacyObjectiveCallback()])", TypeError, "objective(phase)", "set-up"),
    Refused("HFMAML(parts=2)", ValueError, "parts"),
    Refused("HFMAML(delta=0.0)", ValueError, "delta"),
    Refused("FedMTL(chunk=0)", ValueError, "chunk"),
    Refused("FedMTL(strength=-1.0)", ValueError, "strength"),
    Refused("FedRoD(label_counts=[[1, 2]])", TypeError, "label_counts"),
    Refused('FedRoD(label_counts="labels")', ValueError, "label_counts"),
    Refused("FedRoD(label_counts=torch.tensor([[1.0, -1.0]]))", ValueError, "label_counts"),
    Refused(
        'fit(FedRepStrategy(head="classifier", algorithm=FedRoD(label_counts=torch.ones(2, 4))), model=AdamNet())',
        ValueError,
        "label_counts",
        "set-up",
    ),
    Refused(
        'fit(FedRepStrategy(head="body", algorithm=FedRoD()), model=AdamNet())',
        ValueError,
        "head",
        "set-up",
    ),
    Refused("FedCP(lamda=-1.0)", ValueError, "lamda"),
    Refused("FedCP(tau=0.0)", ValueError, "tau"),
    Refused(
        'fit(FedRepStrategy(head="classifier", algorithm=FedCP()), model=ScaledOutputNet())',
        ValueError,
        "forward_features",
        "set-up",
    ),
    Refused('Phase("all", epochs=1, slot="")', ValueError, "slot"),
    Refused(S + 'phases=[Phase("all", epochs=1, slot="personal")]))', ValueError, "slot", "set-up"),
    Refused('EvaluationSpec("best")', ValueError, "score"),
    Refused('EvaluationSpec("slot")', ValueError, "slot"),
    Refused('EvaluationSpec("mixture", slot="personal")', ValueError, "mix"),
    Refused("EvaluationSpec(adapt_lr=0.1)", ValueError, "adapt_lr"),
    Refused(S + 'algorithm=scoring(EvaluationSpec("global"))))', ValueError, "global", "set-up"),
    Refused(S + 'algorithm=scoring(EvaluationSpec("slot", slot="personal"))))', ValueError, "slot", "set-up"),
    Refused(
        S + 'algorithm=scoring(EvaluationSpec("mixture", slot="phead", mix=dict))))',
        ValueError,
        "slot",
        "set-up",
    ),
    Refused(
        S + 'algorithm=scoring(EvaluationSpec(adapt=Phase("all", steps=1)))))',
        ValueError,
        "fedrep_loss",
        "set-up",
    ),
    Refused("EvaluationSpec(forward=3)", TypeError, "forward"),
    Refused('EvaluationSpec(forward=max, adapt=Phase("all", steps=1))', ValueError, "forward"),
    Refused(
        S + "algorithm=scoring(EvaluationSpec(forward=max))), callbacks=[FineTunedEvaluation(epochs=1)])",
        ValueError,
        "FineTunedEvaluation",
        "set-up",
    ),
    Refused('FedRepStrategy(clients_per_round="0.5")', TypeError, "clients_per_round"),
    Refused("FedRepStrategy(clients_per_round=nan)", ValueError, "clients_per_round"),
    Refused("FedRepStrategy(clients_per_round=inf)", ValueError, "clients_per_round"),
    Refused("FedRepStrategy(clients_per_round=0)", ValueError, "clients_per_round"),
    Refused("FedRepStrategy(clients_per_round=5.0)", ValueError, "clients_per_round"),
    Refused("FedRepStrategy(clients_per_round=True)", TypeError, "clients_per_round"),
    Refused("FedRepStrategy(head_epochs=-1)", ValueError, "head_epochs"),
    Refused("FedRepStrategy(body_epochs=1.5)", TypeError, "body_epochs"),
    Refused('FedRepStrategy(local_epochs="2")', TypeError, "local_epochs"),
    Refused("FedRepStrategy(seed=0.5)", TypeError, "seed"),
    Refused('FedRepStrategy(weighting="size")', ValueError, "weighting"),
    Refused('FedRepStrategy(client_optimizer_state="persist")', ValueError, "client_optimizer_state"),
    Refused('FedRepStrategy(first_state="global")', ValueError, "first_state"),
    Refused("FedRepStrategy(evaluate_clients=0)", ValueError, "evaluate_clients"),
    Refused('FedRepStrategy(buffers="mine")', ValueError, "buffers"),
    Refused('FedRepStrategy(on_nonfinite="ignore")', ValueError, "on_nonfinite"),
    Refused('FedRepStrategy(on_client_error="retry")', ValueError, "on_client_error"),
    Refused('FedRepStrategy(predict="everyone")', ValueError, "predict"),
    Refused('FedRepStrategy(allow_frozen="yes")', TypeError, "allow_frozen"),
    Refused('FedRepStrategy(runner="fast")', ValueError, "runner"),
    Refused('FedRepStrategy(engine="vectorized", engine_width=8)', TypeError, "runner"),
    Refused("FedRepStrategy(runner=RunnerSettings(width=0))", ValueError, "width"),
    Refused("FedRepStrategy(runner=RunnerSettings(memory=-5))", ValueError, "memory"),
    Refused("FedRepStrategy(runner=RunnerSettings(steps_per_call=0))", ValueError, "steps_per_call"),
    Refused(
        'FedRepStrategy(runner=RunnerSettings("sequential", steps_per_call=4))', ValueError, "steps_per_call"
    ),
    Refused('FedRepStrategy(runner=RunnerSettings(compile="yes"))', TypeError, "compile"),
    Refused('FedRepStrategy(runner=RunnerSettings("sequential", compile=True))', ValueError, "compile"),
    Refused('FedRepStrategy(phases=[{"train": "neck", "epochs": 1}])', ValueError, "phases"),
    Refused('FedRepStrategy(phases=[{"train": "head", "epochs": 1, "steps": 2}])', ValueError, "phases"),
    Refused('FedRepStrategy(phases=[{"train": "head", "epoch": 1}])', TypeError, "phases"),
    Refused("FedRepStrategy(phases=[])", ValueError, "phases"),
    Refused('FedRepStrategy(algorithm="fedavg", head_epochs=5)', ValueError, "head_epochs"),
    Refused("FedRepStrategy(local_epochs=3)", ValueError, "local_epochs"),
    Refused(
        'FedRepStrategy(phases=[{"train": "all", "epochs": 1}], head_epochs=2)', ValueError, "head_epochs"
    ),
    Refused('FederatedDDPStrategy(client_store="mine")', ValueError, "client_store"),
    Refused("FederatedDDPStrategy(timeout=0)", ValueError, "timeout"),
    Refused(S + "clients_per_round=1e-9))", ValueError, "clients_per_round", "set-up"),
    Refused(S + "clients_per_round=9))", ValueError, "clients_per_round", "set-up"),
    Refused(S + "head_epochs=0, body_epochs=0))", ValueError, "head_epochs", "set-up"),
    Refused('fit(FedRepStrategy(head="body.1"))', SplitError, "head", "set-up"),
    Refused('fit(FedRepStrategy(head="classifer"))', SplitError, "head", "set-up"),
    Refused("fit(devices=2)", ValueError, "devices", "set-up"),
    Refused("fit(num_nodes=2)", ValueError, "num_nodes", "set-up"),
    Refused("fit(accumulate_grad_batches=2)", ValueError, "accumulate_grad_batches", "set-up"),
    Refused("fit(limit_train_batches=0.5)", ValueError, "limit_train_batches", "set-up"),
    Refused("fit(overfit_batches=2)", ValueError, "overfit_batches", "set-up"),
    Refused("fit(model=StepScheduledNet())", ValueError, "interval", "set-up"),
    Refused("evaluate(tiny_datamodule(classes_per_client=4))", ValueError, "partition", "set-up"),
    Refused('evaluate(tiny_datamodule(num_clients=4), "predict")', ValueError, "num_clients", "set-up"),
    Refused(
        'predict(FedRepStrategy(head="classifier", predict="personalized"), DataLoader(test, batch_size=8))',
        ValueError,
        "predict",
        "set-up",
    ),
    Refused(S + 'runner="vectorized"), model=SmoothingNet())', ValueError, "runner", "set-up"),
    Refused(S + 'runner="vectorized"), model=LSTMNet())', ValueError, "runner", "set-up"),
    Refused(S + 'runner="vectorized"), model=CountingStepsNet())', ValueError, "runner", "set-up"),
    Refused(
        S + "runner=RunnerSettings(steps_per_call=4)), model=AdamNet(), max_steps=3)",
        ValueError,
        "steps_per_call",
        "set-up",
    ),
    Refused(
        S + 'runner="vectorized", algorithm=UnbatchedProx()), model=SmoothingNet())',
        ValueError,
        "runner",
        "set-up",
    ),
    # checkpoints
    Refused('resume("truncated.ckpt")', CheckpointError, "truncated.ckpt", "set-up"),
    Refused('resume("version_99.ckpt")', CheckpointError, "version_99.ckpt", "set-up"),
    Refused('resume("damaged.ckpt")', CheckpointError, "damaged.ckpt", "set-up"),
    Refused('resume("plain.ckpt")', CheckpointError, "plain.ckpt", "set-up"),
    Refused(
        'resume_stored("fedrep_v2_round_end.ckpt", "scaffold")',
        ValueError,
        "fedrep_v2_round_end.ckpt",
        "set-up",
    ),
    # data
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), batch_size=0)", ValueError, "batch_size"
    ),
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), eval_batch_size=0)",
        ValueError,
        "eval_batch_size",
    ),
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), val_fraction=1.0)",
        ValueError,
        "val_fraction",
    ),
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), val_fraction=nan)",
        ValueError,
        "val_fraction",
    ),
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), num_workers=-1)", ValueError, "num_workers"
    ),
    Refused('FederatedDataModule(train, test, partitioner="shards")', TypeError, "partitioner"),
    Refused(
        "FederatedDataModule(train, test, ShardPartitioner(4, 2), max_train_samples=0)",
        ValueError,
        "max_train_samples",
    ),
    Refused("ShardPartitioner(num_clients=0, classes_per_client=2)", ValueError, "num_clients"),
    Refused("ShardPartitioner(num_clients=4, classes_per_client=0)", ValueError, "classes_per_client"),
    Refused('ShardPartitioner(4, 2, assignment="multiset")', ValueError, "assignment"),
    Refused("DirichletPartitioner(4, alpha=0)", ValueError, "alpha"),
    Refused("DirichletPartitioner(4, alpha=nan)", ValueError, "alpha"),
    Refused("IIDPartitioner(num_clients=2.5)", ValueError, "num_clients"),
    Refused("DigitsDataModule(test_fraction=1.0)", ValueError, "test_fraction"),
    Refused("LowRankLinearDataModule(dim=20, rank=30)", ValueError, "rank"),
    Refused("LowRankLinearDataModule(noise_std=nan)", ValueError, "noise_std"),
    Refused(
        "fit(datamodule=FederatedDataModule(shifted(train, 4), shifted(test, 4), ShardPartitioner(8, 2)))",
        ValueError,
        "label",
        "set-up",
    ),
    Refused(
        "fit(datamodule=FederatedDataModule(named(train), test, ShardPartitioner(8, 2)))",
        TypeError,
        "train_set",
        "set-up",
    ),
    Refused(
        "fit(datamodule=FederatedDataModule(DictSamples(train), test, ShardPartitioner(8, 2)))",
        TypeError,
        "targets",
        "set-up",
    ),
    Refused(
        S
        + "clients_per_round=1.0), datamodule=FederatedDataModule.from_client_datasets([floats(train)], [test]))",
        ValueError,
        "y.long()",
        "set-up",
    ),
    Refused(
        "FederatedDataModule.from_client_datasets([train], [test], val=[test], val_fraction=0.2)",
        ValueError,
        "val_fraction",
    ),
    # callbacks
    Refused("HeadFineTuning(epochs=0)", ValueError, "epochs"),
    Refused('HeadFineTuning(mode="body")', ValueError, "mode"),
    Refused("HeadFineTuning(rounds=0)", ValueError, "rounds"),
    Refused("NeuralCollapse(lam=nan)", ValueError, "lam"),
    Refused("NeuralCollapse(lam=-1)", ValueError, "lam"),
    Refused("NeuralCollapse(metrics_batch_size=0)", ValueError, "metrics_batch_size"),
    Refused('NeuralCollapse(metrics_split="validation")', ValueError, "metrics_split"),
    Refused("NeuralCollapse(num_classes=3, local_classes=5)", ValueError, "local_classes"),
    Refused('fit(callbacks=[NeuralCollapse(metrics_split="val")])', ValueError, "metrics_split", "set-up"),
    Refused("fit(callbacks=[NeuralCollapse(local_classes=5)])", ValueError, "local_classes", "set-up"),
    Refused("AdaptiveParticipation(communication_cost=nan)", ValueError, "communication_cost"),
    Refused("AdaptiveParticipation(ema=0)", ValueError, "ema"),
    Refused("AdaptiveParticipation(initial_clients=0)", ValueError, "initial_clients"),
    Refused("AdaptiveParticipation(rounds_per_stage=[])", ValueError, "rounds_per_stage"),
    Refused('AdaptiveParticipation(latency="fast")', TypeError, "latency"),
    Refused("FixedExponential(rate=0)", ValueError, "rate"),
    Refused('FixedExponential(per="epoch")', ValueError, "per"),
    Refused("DynamicExponential(low=2.0, high=1.0)", ValueError, "low"),
    Refused('DynamicExponential(resample="yes")', TypeError, "resample"),
    Refused("TwoClassExponential(straggler_fraction=1.5)", ValueError, "straggler_fraction"),
    Refused("FineTunedEvaluation(epochs=0)", ValueError, "epochs"),
    Refused('FineTunedEvaluation(start="global")', ValueError, "start"),
    Refused("FineTunedEvaluation(lr=0)", ValueError, "lr"),
    Refused('FineTunedEvaluation(cache_features="yes")', TypeError, "cache_features"),
    Refused('FineTunedEvaluation(stages=["fit"])', ValueError, "stages"),
    Refused('FineTunedEvaluation(optimizer="adam")', ValueError, "optimizer"),
    Refused("FineTunedEvaluation(optimizer=torch.optim.Adam, lr=0.1)", ValueError, "lr"),
    Refused("fit(callbacks=[FineTunedEvaluation()])", ValueError, "fedrep_loss", "set-up"),
    Refused(
        "fit(callbacks=[FineTunedEvaluation(momentum=0.9)], model=AdamNet())",
        ValueError,
        "momentum",
        "set-up",
    ),
    Refused(
        "fit(callbacks=[FineTunedEvaluation()], model=TwoOptimizerNet())", ValueError, "optimizer", "set-up"
    ),
    Refused(
        'evaluate(tiny_datamodule(), model=BodyOptimizerNet(), callbacks=[FineTunedEvaluation(stages=["test"])])',
        ValueError,
        "optimizer",
        "set-up",
    ),
    Refused('fit(callbacks=[OrthonormalBody("classifier.bias")])', ValueError, "parameter", "set-up"),
    Refused('EMNISTDataModule(split="letters", first_classes=27)', ValueError, "first_classes"),
    Refused("EMNISTDataModule(partitioner=ShardPartitioner(4, 2), test_draws=50)", ValueError, "test_draws"),
    Refused("ShardPartitioner(4, 2, test_draws=0)", ValueError, "test_draws"),
    Refused(
        'Sent140DataModule("sent140/train", "sent140/test", glove_path="missing/glove.6B.300d.txt")',
        FileNotFoundError,
        "glove_path",
    ),
    Refused('Sent140RNN(glove_path="tests/data/empty_word_vectors.txt")', ValueError, "glove_path"),
    Refused(
        'Sent140RNN(glove_path="tests/data/empty_word_vectors.txt", layout="rows")', ValueError, "layout"
    ),
    Refused("ValidateAtRounds()", ValueError, "every"),
    Refused("ValidateAtRounds(every=0)", ValueError, "every"),
    Refused(
        'fit(callbacks=[EarlyStopping("val/acc"), ValidateAtRounds(every=2)])',
        ValueError,
        "callbacks",
        "set-up",
    ),
    Refused('RunSummary(filename="")', ValueError, "filename"),
    Refused('RunSummary(print_table="no")', TypeError, "print_table"),
    Refused('parse_seeds("1,x")', ValueError, "--seeds"),
    Refused('split_seeds(["test", "--seeds", "1,2"])', ValueError, "--seeds"),
    # aggregation (an algorithm's aggregator, checked when a round opens, before its first step; its server
    # step, at construction)
    Refused(S + "algorithm=StackedFedRep(max_bytes=500)))", ValueError, "max_bytes", "set-up"),
    Refused(S + "algorithm=DictAggregatorFedRep()))", TypeError, "aggregator()", "set-up"),
    Refused("V1AggregateFedRep()", TypeError, "aggregate(global_state, average)"),
    # the vectorized runner's randomness contract and a server optimizer from the strategy's settings
    Refused('FedRepStrategy(randomness="different")', ValueError, "randomness"),
    Refused('FedRepStrategy(server_optimizer="adam")', ValueError, "server_optimizer"),
    Refused('FedRepStrategy(algorithm="local", server_optimizer="fedadam")', ValueError, "server_optimizer"),
    Refused(
        'FedRepStrategy(algorithm="fedadam", server_optimizer="fedyogi")', ValueError, "server_optimizer"
    ),
    # PFLlib's leaderboard setting
    Refused('PFLlibPartitioner(partition="exdir")', ValueError, "partition"),
    Refused("PFLlibPartitioner(alpha=0.0)", ValueError, "alpha"),
    Refused("PFLlibPartitioner(train_fraction=1.0)", ValueError, "train_fraction"),
    Refused('FashionMNISTDataModule(preprocessing="imagenet")', ValueError, "preprocessing"),
]


def namespace() -> dict[str, Any]:
    train, test = tiny_datasets()
    return {**globals(), "train": train, "test": test, "nan": math.nan, "inf": math.inf}


@contextlib.contextmanager
def package_algorithms_only() -> Iterator[None]:
    """The algorithm registry as the package alone fills it: algorithms that tests register in this process
    (``tests/scripts/federated_run.py``'s ``fedrep_median``) would otherwise appear in messages that list the
    registered names, and docs/faults.md shows what a user sees."""
    saved = dict(ALGORITHMS)
    for name, algorithm in saved.items():
        if not type(algorithm).__module__.startswith("lightning_fedrep."):
            del ALGORITHMS[name]
    try:
        yield
    finally:
        ALGORITHMS.clear()
        ALGORITHMS.update(saved)


def message_of(case: Refused) -> str:
    try:
        with package_algorithms_only():
            eval(case.code, namespace())
    except case.error as error:
        return str(error)
    raise AssertionError(f"{case.code} was accepted")


def table() -> str:
    rows = [
        "| configuration | when | error | message (first line, abridged) |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        message = message_of(case).splitlines()[0]
        message = message if len(message) <= 150 else message[:147] + "..."
        message = message.replace("|", "\\|")
        rows.append(f"| `{case.code}` | {case.when} | `{case.error.__name__}` | {message} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
