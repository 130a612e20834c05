"""What ``training_step`` writes besides its loss is never lost on the default engine (issue 43, item 1).

The vectorized runner runs no ``training_step``: it trains the declared loss. Before, a torchmetrics metric
updated in the step saw only the probe batches (``train/acc_epoch`` read 0.0 under ``runner="auto"``), and
a counter counted two steps. Now the probe compares the module's state before and after the step
(``runners/lockstep/side_effects.py``): any write sends ``runner="auto"`` to the sequential runner with the
write named in the runner report and the log line, and makes ``runner="vectorized"`` refuse, naming it; and
the probe puts the module back, so the sequential run counts exactly what ``runner="sequential"`` counts.

The references: the sequential runner (``runner="sequential"``, which never probes), and hand counts from
the data (each planned client's samples, once per local epoch) and the round plans (its local steps).
"""

from __future__ import annotations

import logging
import random

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from torchmetrics.classification import Accuracy

from lightning_fedrep import FederatedDataModule, FederatedStrategy
from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.runners.lockstep import side_effects
from lightning_fedrep.runners.lockstep.probe import loss_label, probe_problem
from tests.fixtures import quiet_trainer

SIZES = (24, 17, 30, 9)
LOCAL_EPOCHS = 3  # head_epochs=2, body_epochs=1
ROUNDS = 2


class Net(L.LightningModule):
    """A body and a ``classifier`` head (called last), declaring cross-entropy; its step writes nothing."""

    fedrep_loss = "cross_entropy"

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.ReLU())
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


class AccuracyNet(Net):
    """The standard Lightning pattern: a torchmetrics accuracy updated in ``training_step``, logged and reset
    in ``on_train_epoch_end`` (one epoch is one round). Also keeps each round's value and sample count."""

    def __init__(self):
        super().__init__()
        self.train_acc = Accuracy(task="multiclass", num_classes=4)
        self.rounds: list[tuple[float, int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc.update(logits.argmax(-1), y)
        return F.cross_entropy(logits, y)

    def on_train_epoch_end(self):
        seen = int(self.train_acc.tp.sum() + self.train_acc.fn.sum())  # micro accuracy: one tp or fn a sample
        accuracy = self.train_acc.compute()
        self.log("train/acc_epoch", accuracy)
        self.rounds.append((float(accuracy), seen))
        self.train_acc.reset()


class CounterNet(Net):
    """Counts its steps and samples in plain attributes."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.samples = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.samples += len(batch[0])
        return super().training_step(batch, batch_idx)


class InPlaceBufferNet(Net):
    """Counts the labels it trained on in a registered buffer, in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("label_counts", torch.zeros(4))

    def training_step(self, batch, batch_idx):
        self.label_counts += torch.bincount(batch[1], minlength=4)
        return super().training_step(batch, batch_idx)


class RebindingBufferNet(InPlaceBufferNet):
    """Counts the labels in the buffer by assigning a new tensor to it."""

    def training_step(self, batch, batch_idx):
        self.label_counts = self.label_counts + torch.bincount(batch[1], minlength=4)
        return Net.training_step(self, batch, batch_idx)


class CachingNet(Net):
    """What must not be flagged: a cache its forward fills once (the probe's own forwards fill it before the
    step runs), reads of Lightning's state from the step, ``self.log`` of the engine's own metric, and a
    metric it owns but updates only in ``validation_step``."""

    def __init__(self):
        super().__init__()
        self.val_acc = Accuracy(task="multiclass", num_classes=4)
        self.scale_cache: dict[int, torch.Tensor] = {}
        self.settings = {"lr": 0.1}

    def forward(self, x):
        if x.shape[-1] not in self.scale_cache:
            self.scale_cache[x.shape[-1]] = torch.ones(x.shape[-1])
        return super().forward(x * self.scale_cache[x.shape[-1]])

    def training_step(self, batch, batch_idx):
        assert self.trainer.global_step >= 0 and self.device.type == "cpu"
        assert self.optimizers() is not None
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_acc.update(self(batch[0]).argmax(-1), batch[1])


def clients() -> list[TensorDataset]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in SIZES:
        x = torch.randn(n, 6, generator=g)
        out.append(TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()))
    return out


def fit(runner: str, model: type[Net], rounds: int = ROUNDS):
    torch.manual_seed(0)
    module = model()
    strategy = FederatedStrategy(
        runner=runner, head="classifier", clients_per_round=3, seed=5, head_epochs=2, body_epochs=1
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(
        module, datamodule=FederatedDataModule.from_client_datasets(clients(), clients(), batch_size=8)
    )
    return strategy, trainer, module


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_fedrep: ")]


def samples_by_hand(strategy: FederatedStrategy, round_index: int) -> int:
    """The samples a round trains: each planned client's whole training set, once per local epoch."""
    return sum(SIZES[c] * LOCAL_EPOCHS for c in strategy.round_plan(round_index).clients)


# ----------------------------------------------------------------------------- the fits


def test_an_accuracy_updated_in_training_step_is_the_sequential_runners_under_auto(caplog):
    """Catches the issue's case (fails when ``side_effects`` returns ``[]``: the engine keeps the fit, the
    metric sees no batch of it and ``train/acc_epoch`` is computed on nothing). The reference: the same fit
    on ``runner="sequential"``, and the samples each round trains, counted from the data."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, trainer, module = fit("auto", AccuracyNet)
    report = auto.runner_report
    assert report.runner == "sequential" and report.decided_at == "first loader"
    named = "updates the torchmetrics metric 'train_acc' (MulticlassAccuracy)"
    assert named in report.reason
    (line,) = engine_lines(caplog)
    assert (
        line.startswith("lightning_fedrep: sequential runner (training_step has side effects")
        and named in line
    )
    _, sequential_trainer, sequential = fit("sequential", AccuracyNet)
    assert module.rounds == sequential.rounds  # bit for bit: the probe left the metric as it was
    assert [seen for _, seen in module.rounds] == [samples_by_hand(auto, r) for r in range(ROUNDS)]
    assert all(accuracy > 0 for accuracy, _ in module.rounds)
    assert (
        trainer.callback_metrics["train/acc_epoch"] == sequential_trainer.callback_metrics["train/acc_epoch"]
    )


def test_a_counter_in_training_step_counts_every_local_step_under_auto(caplog):
    """Catches a counter that counts the probe's two calls, or none of the fit's (fails when ``side_effects``
    returns ``[]``: the engine counts 2 steps; and when ``restored`` puts nothing back: the fallback counts 2
    more than the fit's steps). The reference: the round plans' local steps and the data's samples."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, trainer, module = fit("auto", CounterNet)
    assert auto.runner_report.runner == "sequential"
    assert "writes the attribute 'calls' (int)" in auto.runner_report.reason
    assert "writes the attribute 'samples' (int)" in auto.runner_report.reason
    (line,) = engine_lines(caplog)
    assert "writes the attribute 'calls' (int)" in line
    assert module.calls == sum(auto.round_plan(r).length for r in range(ROUNDS)) == trainer.global_step
    assert module.samples == sum(samples_by_hand(auto, r) for r in range(ROUNDS))


@pytest.mark.parametrize("model", [InPlaceBufferNet, RebindingBufferNet], ids=["in place", "rebinding"])
def test_a_buffer_written_in_training_step_falls_back_and_ends_as_on_the_sequential_runner(model, caplog):
    """Catches a buffer written by the step (fails when ``side_effects`` returns ``[]``: the engine never
    writes it; and, rebinding, when ``restored`` puts nothing back: the module keeps the probe's tensor).
    The reference: the same fit on ``runner="sequential"`` (the buffer is shared with the body, by the
    strategy's buffer policy, on both)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, _, module = fit("auto", model)
    assert auto.runner_report.runner == "sequential"
    assert "writes the buffer 'label_counts'" in auto.runner_report.reason
    _, _, sequential = fit("sequential", model)
    assert sequential.label_counts.sum() > 0
    assert torch.equal(module.label_counts, sequential.label_counts)


@pytest.mark.parametrize(
    "model,named",
    [
        (CounterNet, "writes the attribute 'calls' (int)"),
        (AccuracyNet, "updates the torchmetrics metric 'train_acc' (MulticlassAccuracy)"),
    ],
    ids=["counter", "metric"],
)
def test_vectorized_refuses_naming_what_training_step_writes_and_the_fix(model, named):
    """Catches ``runner="vectorized"`` running a step with side effects silently (fails when
    ``side_effects`` returns ``[]``: the fit runs)."""
    with pytest.raises(ValueError) as refused:
        fit("vectorized", model, rounds=1)
    message = str(refused.value)
    assert message.startswith("runner='vectorized' cannot run here: training_step has side effects")
    assert named in message and "runner='sequential'" in message and "on_client_end" in message


@pytest.mark.parametrize("model", [Net, CachingNet], ids=["plain", "cache, Lightning reads, val metric"])
def test_a_step_without_side_effects_still_runs_on_the_engine(model):
    """Catches over-eager detection (fails when the probe compares Lightning's bookkeeping or a cache the
    forward filled before the step: the fit would fall back)."""
    auto, _, _ = fit("auto", model, rounds=1)
    assert auto.runner_report.runner == "vectorized", auto.runner_report.reason


# ----------------------------------------------------------------------------- the probe, write by write


class Recorder:
    """A plain object a module holds (its attributes are compared one level down)."""

    def __init__(self):
        self.count = 0


class Writes(Net):
    """``training_step`` runs ``self.write(self, batch)`` once (set per case) before its loss."""

    def __init__(self, write):
        super().__init__()
        self.write = write
        self.history: list[float] = []
        self.stats = {"steps": 0, "per_class": [0, 0, 0, 0]}
        self.recorder = Recorder()
        self.array = np.zeros(3)
        self.total = torch.zeros(2)
        self.register_buffer("counts", torch.zeros(4))
        self.noise = torch.Generator().manual_seed(1)
        self.numpy_noise = np.random.default_rng(1)
        self.python_noise = random.Random(1)
        self.body[0].seen = 0

    def training_step(self, batch, batch_idx):
        self.write(self, batch)
        return super().training_step(batch, batch_idx)


def _hook(module, args, output):
    return None


WRITES = {
    "list append": (lambda m, b: m.history.append(1.0), "writes the attribute 'history' (list)"),
    "dict value": (lambda m, b: m.stats.update(steps=m.stats["steps"] + 1), "writes the attribute 'stats'"),
    "list in a dict": (
        lambda m, b: m.stats["per_class"].__setitem__(0, 1),
        "writes the attribute 'stats' (dict)",
    ),
    "object attribute": (
        lambda m, b: setattr(m.recorder, "count", m.recorder.count + 1),
        "writes the attribute 'recorder' (Recorder)",
    ),
    "tensor in place": (lambda m, b: m.total.add_(1.0), "writes the attribute 'total' (Tensor)"),
    "buffer in place": (
        lambda m, b: m.counts.add_(torch.bincount(b[1], minlength=4)),
        "writes the buffer 'counts'",
    ),
    "numpy array": (lambda m, b: m.array.__iadd__(1.0), "writes the attribute 'array' (ndarray)"),
    "torch generator": (
        lambda m, b: torch.rand(1, generator=m.noise),
        "writes the attribute 'noise' (Generator)",
    ),
    "numpy generator": (
        lambda m, b: m.numpy_noise.random(),
        "writes the attribute 'numpy_noise' (Generator)",
    ),
    "python generator": (
        lambda m, b: m.python_noise.random(),
        "writes the attribute 'python_noise' (Random)",
    ),
    "new attribute": (lambda m, b: setattr(m, "last_x", b[0]), "sets a new attribute 'last_x' (Tensor)"),
    "submodule attribute": (
        lambda m, b: setattr(m.body[0], "seen", m.body[0].seen + 1),
        "writes the attribute 'body.0.seen' (int)",
    ),
    "forward hook": (
        lambda m, b: m.classifier.register_forward_hook(_hook),
        "registers 1 forward hook on 'classifier'",
    ),
    "new buffer": (
        lambda m, b: m.register_buffer("seen_x", b[0].sum(0)),
        "sets a new buffer 'seen_x' (Tensor)",
    ),
}


def state_of(module: Writes) -> dict:
    """What the cases write, as values (compared before and after the probe)."""
    return {
        "history": list(module.history),
        "stats": repr(module.stats),
        "recorder": module.recorder.count,
        "array": module.array.tolist(),
        "total": module.total.tolist(),
        "counts": module.counts.tolist(),
        "noise": module.noise.get_state().tolist(),
        "numpy_noise": repr(module.numpy_noise.bit_generator.state),
        "python_noise": module.python_noise.getstate(),
        "attributes": sorted(vars(module)),
        "seen": module.body[0].seen,
        "hooks": len(module.classifier._forward_hooks),
        "buffers": [n for n, _ in module.named_buffers()],
    }


@pytest.mark.parametrize("case", sorted(WRITES))
def test_the_probe_names_each_write_and_puts_it_back(case):
    """Catches each kind of write going unseen (fails when ``state_prints`` leaves out that kind: the probe
    then passes the step) or staying after the probe (fails when ``restored`` leaves it: the module differs
    from before the probe). The reference: the module's values read before the probe."""
    write, named = WRITES[case]
    torch.manual_seed(0)
    module = Writes(write)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))
    before = state_of(module)
    problem = probe_problem(
        module, declared_loss(module), loss_label(module.fedrep_loss), [(batch, 0, "a batch")]
    )
    assert problem is not None and problem.startswith("training_step has side effects")
    assert named in problem and "(a batch)" in problem
    assert state_of(module) == before


def test_what_the_probe_compares_is_cheap_and_leaves_lightnings_bookkeeping_out():
    """Pins the Lightning attributes the probe leaves out to those a ``LightningModule`` has (fails when a
    Lightning release adds one: decide whether a step writes it, and add it to the list or not); and a step
    that only reads is no write."""
    lightning_own = set(vars(L.LightningModule())) - set(vars(nn.Module()))
    assert lightning_own == side_effects.LIGHTNING_BOOKKEEPING
    module = Writes(lambda m, b: (len(m.history), m.stats["steps"], m.recorder.count, m.array.sum()))
    before = side_effects.state_prints(module)
    module.write(module, None)
    assert side_effects.side_effects(before, side_effects.state_prints(module)) == []


class LogsAndCounts(CounterNet):
    """Logs a metric the engine would not log, and counts."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_acc", 0.5)
        return loss


def test_a_step_that_logs_and_writes_is_refused_naming_both_with_both_fixes():
    """Catches one reason hiding the other (fails when ``_step_problem`` returns the logs' reason alone: the
    user removes the log and meets the next refusal)."""
    with pytest.raises(ValueError) as refused:
        fit("vectorized", LogsAndCounts, rounds=1)
    message = str(refused.value)
    assert "training_step logs 'train_acc'" in message and "writes the attribute 'calls' (int)" in message
    assert "logs only 'train/loss'" in message and "on_client_end" in message
