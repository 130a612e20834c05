"""Where the vectorized runner would not train what ``training_step`` trains, or would crash: it falls
back (``runner="auto"``, one line naming the reason) or refuses (``runner="vectorized"``), and its log
line says what it really does (issue 23, items 1, 2 and the engine's messages of item 8).

The engine never runs ``training_step``: it trains the declared ``fedrep_loss``. On probe batches it
now runs the step and compares (``lightning_fedrep.runners.lockstep.probe``). The reference for "what the step
trains" is the sequential path (the user's ``training_step``, itself checked against plain PyTorch loops
in ``tests/test_engine_equivalence.py``), and closed forms where a message is about a number.
"""

from __future__ import annotations

import itertools
import logging
import random

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.module.feature_split import find_feature_split
from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.runners.lockstep import sizing
from lightning_fedrep.runners.lockstep.probe import loss_label, probe_problem, vectorize_problem
from lightning_fedrep.runners.selection import start_engine
from tests.fixtures import quiet_trainer, reference_generator, runner_setting

SIZES = (24, 17, 30, 9)


class Net(L.LightningModule):
    """A body and a ``classifier`` head (called last), declaring cross-entropy."""

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


class SmoothingNet(Net):
    """Declares cross-entropy, trains cross-entropy with label smoothing."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, label_smoothing=0.2)


class LoggingNet(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean())
        return F.cross_entropy(logits, y)


class EngineLogNet(Net):
    """Logs only what the engine logs itself (as the shipped CIFAR CNNs and FEMNIST MLP do)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


class MSEOnLabelsNet(Net):
    """Declares ``"mse"`` on integer labels: every logit would be pulled toward the label."""

    fedrep_loss = "mse"


class TupleNet(Net):
    def forward(self, x):
        features = self.body(x)
        return self.classifier(features), features

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x)[0], y)


class DictBatchNet(Net):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["x"]), batch["y"])


def clients(sizes=SIZES, seed=3, nan=False) -> list[TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = torch.randn(n, 6, generator=g)
        y = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        if nan:
            x[0, 3] = float("nan")
        out.append(TensorDataset(x, y))
    return out


def as_dict(samples):
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}


def fit(runner, model=Net, rounds=2, trainer=None, data=None, ckpt_path=None, **strategy_kwargs):
    torch.manual_seed(0)
    module = model()
    options = dict(head="classifier", clients_per_round=3, seed=5)
    if "algorithm" not in strategy_kwargs:  # FedRep, short
        options.update(head_epochs=2, body_epochs=1)
    settings = {**options, **strategy_kwargs}
    strategy = FederatedStrategy(runner=runner_setting(runner, settings), **settings)
    lightning_trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, **{"limit_val_batches": 0, **(trainer or {})}
    )
    datamodule = data or FederatedDataModule.from_client_datasets(clients(), clients(), batch_size=8, seed=3)
    lightning_trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return strategy, lightning_trainer


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_fedrep: ")]


def assert_same(expected: FederatedStrategy, got: FederatedStrategy, exact: bool = False) -> None:
    """The global tensors and every client's tensors agree (``exact``: bit for bit)."""
    pairs = [(expected.global_tensors(), got.global_tensors(), "global")] + [
        (expected.client_tensors(c), got.client_tensors(c), f"client {c}")
        for c in range(expected.num_clients)
    ]
    for mine, theirs, who in pairs:
        assert mine.keys() == theirs.keys()
        for name, value in mine.items():
            if exact:
                assert torch.equal(theirs[name], value), f"{who} {name}"
            else:
                torch.testing.assert_close(theirs[name], value, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- item 1: the declared loss


def test_label_smoothing_in_training_step_falls_back_and_trains_what_the_step_trains(caplog):
    """Catches the engine training the declared loss instead of ``training_step``'s (fails when
    ``LockstepEngine.bind_loader`` does not run ``probe_problem``: the engine then trains plain
    cross-entropy, a different model)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, trainer = fit("auto", model=SmoothingNet)
    assert auto.runner_report.runner == "sequential"
    assert trainer.global_step == sum(auto.round_plan(r).length for r in range(2))  # one client step each
    (line,) = engine_lines(caplog)
    assert line.startswith("lightning_fedrep: sequential runner (training_step's loss ")
    assert "differs from the declared fedrep_loss='cross_entropy'" in line
    # the numbers in the line are the two losses on client 0's first batch, computed here by hand
    torch.manual_seed(0)
    start = SmoothingNet()
    x, y = first_batch(0)
    with torch.no_grad():
        logits = start(x)
        smoothed = F.cross_entropy(logits, y, label_smoothing=0.2).item()
        plain = F.cross_entropy(logits, y).item()
    assert f"loss {smoothed:.6g} differs" in line and f"'cross_entropy' {plain:.6g}" in line
    sequential, _ = fit("sequential", model=SmoothingNet)
    assert_same(sequential, auto, exact=True)  # the probe changed nothing (RNG, weights)
    with pytest.raises(ValueError, match="runner='vectorized' cannot run here: training_step's loss"):
        fit("vectorized", model=SmoothingNet)


def first_batch(client: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``client``'s first batch of round 0, as the documented seeding rule (docs/concepts.md, *Rounds*) draws it (its first
    reshuffled pass; ``reference_generator`` restates the rule)."""
    x, y = clients()[client].tensors
    perm = torch.randperm(len(x), generator=reference_generator(3, 0, client, 0))[:8]
    return x[perm], y[perm]


def test_training_step_logs_fall_back_and_reach_the_logger(caplog):
    """Catches the step's own ``self.log`` calls vanishing on the engine (fails when ``_logs_problem``
    returns ``None``: ``train_acc`` is then missing from the callback metrics); logging only
    ``train/loss``, as the engine does, keeps the engine."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, trainer = fit("auto", model=LoggingNet)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "training_step logs 'train_acc', which the engine would not log" in line
    assert "train_acc" in trainer.callback_metrics
    with pytest.raises(ValueError, match="training_step logs 'train_acc'"):
        fit("vectorized", model=LoggingNet)

    kept, trainer = fit("auto", model=EngineLogNet)
    assert kept.runner_report.runner == "vectorized" and "train/loss" in trainer.callback_metrics


def test_mse_declared_on_integer_labels_falls_back_naming_the_shapes(caplog):
    """Catches ``fedrep_loss="mse"`` broadcasting every logit toward an integer label (fails when the
    shape check in ``_declared_losses`` is removed: the reason is then only the loss values)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", model=MSEOnLabelsNet, rounds=1)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "fedrep_loss='mse' compares outputs of shape (8, 4) with targets of shape (8,)" in line
    with pytest.raises(ValueError, match="compares outputs of shape"):
        fit("vectorized", model=MSEOnLabelsNet, rounds=1)


class LaterTermNet(Net):
    """Matches the declared loss on its first batch only: adds a term from the second batch on."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.1 if batch_idx > 0 else loss


def test_the_probe_compares_on_a_later_batch_too(caplog):
    """Catches a probe of the first batch only (fails when ``_probe_batches`` returns just client 0's
    first batch: the engine then trains without the term)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", model=LaterTermNet, rounds=1)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "differs from the declared fedrep_loss='cross_entropy'" in line
    assert f"(client {len(SIZES) - 1}'s second batch)" in line


class FunctionalDropoutNet(Net):
    """Random in ``forward`` without an ``nn.Dropout`` module (which the engine's set-up checks list)."""

    def forward(self, x):
        return self.classifier(F.dropout(self.body(x), 0.3, self.training))


def test_a_random_forward_falls_back(caplog):
    """Catches a random op inside ``forward`` reaching the engine's ``vmap`` (fails when ``_step_problem``
    skips its second-seed forward: vmap then raises on randomness)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", model=FunctionalDropoutNet, rounds=1)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "the module's forward is random" in line


# ----------------------------------------------------------------------------- item 2: crashes


def test_forward_returning_a_tuple_falls_back(caplog):
    """Catches ``TypeError: equal(): argument 'other' must be Tensor, not tuple`` in engine/contract.py
    (fails when ``_step_problem`` and ``find_feature_split`` stop checking for a tensor output)."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", model=TupleNet, rounds=1)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "the module's forward returns a tuple, not a tensor" in line
    with pytest.raises(ValueError, match="forward returns a tuple"):
        fit("vectorized", model=TupleNet, rounds=1)


def test_dict_batches_fall_back(caplog):
    """Catches ``'str' object has no attribute 'to'`` in runners/lockstep/engine.py (fails when
    ``federation.module.batches.batch_problem`` returns ``None``)."""

    def data():
        return FederatedDataModule.from_client_datasets(
            clients(), clients(), batch_size=8, seed=3, collate_fn=as_dict
        )

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", model=DictBatchNet, rounds=1, data=data(), headline_metrics=False)
    assert strategy.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert "the training batches are a dict with keys ['x', 'y'], not (inputs, targets) tensors" in line
    with pytest.raises(ValueError, match="not \\(inputs, targets\\) tensors"):
        fit("vectorized", model=DictBatchNet, rounds=1, data=data(), headline_metrics=False)


class LSTMNet(Net):
    """An ``nn.LSTM`` of size 2 as the body (each sample's 6 numbers read as 3 steps of 2), for which
    ``torch.func.vmap`` has no batching rule (``aten::lstm``); declares cross-entropy, which its step trains."""

    def __init__(self):
        super().__init__()
        self.body = nn.LSTM(2, 2, batch_first=True)
        self.classifier = nn.Linear(2, 4)

    def forward(self, x):
        out, _ = self.body(x.reshape(len(x), 3, 2))
        return self.classifier(out[:, -1])


def plain_vmap_error() -> str:
    """The first line of torch's own error for a ``vmap`` over an ``nn.LSTM`` (the reference for the reason)."""
    lstm = nn.LSTM(2, 2, batch_first=True)
    with pytest.raises(RuntimeError) as error:
        torch.func.vmap(lambda x: lstm(x)[0])(torch.zeros(2, 4, 3, 2))
    return str(error.value).splitlines()[0]


def test_an_operation_vmap_cannot_batch_falls_back_or_is_refused(caplog):
    """Catches ``runner="auto"`` choosing lockstep for a module ``torch.func.vmap`` cannot batch (an
    ``nn.LSTM``: fails when ``start_engine`` skips ``_vectorize_problem``, the first round then dies with
    ``Batching rule not implemented for aten::lstm.input``). The fallback trains exactly what
    ``runner="sequential"`` trains (the probe left nothing half-trained), the reason is torch's own error
    naming the submodule, and ``runner="vectorized"`` is refused before any step, naming the same."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, trainer = fit("auto", model=LSTMNet, rounds=1)
    report = auto.runner_report
    assert report.runner == "sequential" and report.decided_at == "first loader"
    expected = f"cannot vectorize: {plain_vmap_error()} (torch.func.vmap of LSTMNet's loss, in 'body' (LSTM),"
    assert report.reason.startswith(expected), report.reason
    assert report.reason.endswith(", body phase)")  # FedRep's head phase runs on cached features
    assert engine_lines(caplog) == [f"lightning_fedrep: sequential runner ({report.reason})."]
    assert trainer.global_step == auto.round_plan(0).length  # one client step per Lightning step
    sequential, _ = fit("sequential", model=LSTMNet, rounds=1)
    assert_same(sequential, auto, exact=True)
    with pytest.raises(ValueError) as refused:
        fit("vectorized", model=LSTMNet, rounds=1)
    message = str(refused.value)
    assert message.startswith(f"runner='vectorized' cannot run here: {expected}")
    assert "pass runner='sequential' (or runner='auto'" in message


@pytest.mark.parametrize("model", [LSTMNet, Net], ids=["lstm", "vmappable"])
def test_the_vmap_probe_leaves_no_trace(model):
    """Catches the vmap probe changing the module it probes (fails when ``vectorize_problem`` leaves
    ``untouched_modes``: the module, in eval mode before, is left in train mode; or when it vmaps views
    of the module's own parameters instead of copies and calls ``backward()``: they then hold gradients).
    Reference: the module's state, modes and torch's generator read before the probe; the verdict is
    torch's (an LSTM fails, Net not)."""
    torch.manual_seed(0)
    module, (x, y) = model(), first_batch(0)
    module.eval()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    rng = torch.get_rng_state()
    names = [n for n, _ in module.named_parameters()]
    problem = vectorize_problem(module, declared_loss(module), (x, y), {"all": names}, names)
    assert (problem is None) == (model is Net), problem
    assert not any(m.training for m in module.modules())
    assert all(p.grad is None for p in module.parameters())
    assert all(torch.equal(module.state_dict()[n], t) for n, t in before.items())
    assert torch.equal(torch.get_rng_state(), rng)


class HeadlineNet(Net):
    """Evaluated by the strategy's headline metrics alone (the batched evaluation applies)."""

    fedrep_evaluation = "headline"

    def validation_step(self, batch, batch_idx):
        pass


def test_float64_precision_runs_on_the_engine_and_equals_sequential():
    """Catches the dtype error in the probes under ``precision="64-true"`` (fails when the engine's own
    batches or the batched evaluation's probe skip ``trainer.precision_plugin.convert_input``: float32
    data into a float64 model)."""
    options = dict(model=HeadlineNet, trainer={"precision": "64-true", "limit_val_batches": None})
    sequential, seq_trainer = fit("sequential", **options)
    vectorized, vec_trainer = fit("vectorized", **options)
    assert vectorized.runner_report.runner == "vectorized" and vectorized.lockstep_engine.caching
    assert vectorized._evaluation.batched is not None
    assert vectorized.global_tensors()["body.0.weight"].dtype == torch.float64
    assert_same(sequential, vectorized)
    for name in ("val/acc", "val/loss"):
        torch.testing.assert_close(vec_trainer.callback_metrics[name], seq_trainer.callback_metrics[name])


@pytest.mark.parametrize("runner", ["auto", "vectorized", "sequential"])
def test_zero_epochs_are_refused_at_set_up_on_every_engine(runner):
    """Catches the ``IndexError`` in engine/runner.py for ``head_epochs=0, body_epochs=0`` (fails when
    the empty-plan check in ``process_dataloader`` runs after ``start_engine``)."""
    with pytest.raises(ValueError, match="The round plan is empty.*head_epochs, body_epochs"):
        fit(runner, head_epochs=0, body_epochs=0, rounds=1)


# ----------------------------------------------------------------------------- item 8: messages


def test_no_head_phase_is_not_called_head_phases_on_cached_features(caplog, monkeypatch):
    """Catches "head phases on cached features" for FedPer, which has no head phase (fails when
    ``start_engine`` keeps ``bind_loader``'s line whatever the plan). ``auto``'s timing is pinned to lockstep
    (a loaded machine could send this tiny run to the sequential runner, whose line says nothing of a cache)."""
    monkeypatch.setattr(sizing, "faster_lane_width", lambda *args, **kwargs: (True, 1.0, 2.0))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", algorithm="fedper", local_epochs=1)
    (line,) = engine_lines(caplog)
    assert "head phases on cached features" not in line
    assert "no head phase in the first round" in line


def test_nan_in_the_data_does_not_hide_the_feature_split():
    """Catches "not head(features(x))" when the probe batch holds a NaN (fails when
    ``find_feature_split`` compares with ``torch.equal``, for which NaN != NaN)."""
    module = Net()
    x = clients(nan=True)[0].tensors[0][:8]
    split = find_feature_split(module, ("classifier.weight", "classifier.bias"), x)
    assert split is not None and split.how == "head module 'classifier' called last"
    tensors = dict(module.named_parameters())
    with torch.no_grad():  # the reference: the model's own layers, called by hand
        expected = module.classifier(module.body(x))
        got = split.head(tensors, split.features(tensors, x))
    assert torch.allclose(got, expected, equal_nan=True) and got.isnan().any()


def test_resumed_engine_line_says_the_widths_come_from_the_checkpoint(tmp_path, caplog):
    """Catches "0 MiB each" after a resume (fails when ``prepare`` prints ``client_bytes`` that a
    resumed run never measured)."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit("vectorized", rounds=1, trainer=dict(enable_checkpointing=True, callbacks=[saver]), width=2)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fit("vectorized", rounds=2, ckpt_path=tmp_path / "epoch=0.ckpt", width=2)
    (line,) = engine_lines(caplog)
    assert "MiB each" not in line
    assert "groups of up to 2 clients (the first round has 3)" in line
    assert "widths as in the checkpoint" in line


# ----------------------------------------------------------------------------- shipped models


def test_shipped_models_pass_the_probe():
    """The shipped models declare what their ``training_step`` computes (and log only ``train/loss``),
    so the recipes keep the engine (fails if the probe rejects any of them)."""
    from lightning_fedrep.models import CIFAR10CNN, FEMNISTMLP, LowRankLinear, MLPClassifier

    g = torch.Generator().manual_seed(0)
    cases = [
        (MLPClassifier(), torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)),
        (FEMNISTMLP(), torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)),
        (CIFAR10CNN(), torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)),
        (LowRankLinear(exact_head=False), torch.randn(8, 20, generator=g), torch.randn(8, generator=g)),
    ]
    for module, x, y in cases:
        loss = declared_loss(module)
        assert loss is not None, type(module).__name__
        problem = probe_problem(module, loss, loss_label(module.fedrep_loss), [((x, y), 0, "a batch")])
        assert problem is None, (type(module).__name__, problem)


# ----------------------------------------------------------------------------- the probe changes nothing


class NoisyClient(Dataset):
    """A map-style data set (not a ``TensorDataset``: batches come through a ``DataLoader``, whose ``iter()``
    draws a seed from the global generator) that augments each sample with noise from torch's, numpy's
    and Python's global generators."""

    def __init__(self, base: TensorDataset):
        self.x, self.y = base.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        noise = 0.1 * torch.randn(6) + 0.1 * float(np.random.randn()) + 0.1 * random.gauss(0.0, 1.0)
        return self.x[index] + noise, self.y[index]


class MixupNet(Net):
    """Mixup, its mixing weight drawn from numpy's generator (as many training scripts draw it)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        lam = float(np.random.beta(0.4, 0.4))
        perm = torch.randperm(len(x))
        logits = self(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])


@pytest.mark.parametrize("model", [SmoothingNet, MixupNet], ids=["smoothing", "mixup"])
def test_the_probe_draws_nothing_from_the_runs_random_generators(model):
    """Catches the engine's probe drawing from the run's global generators (fails when the fetch in
    ``LockstepEngine._probe_batches`` leaves ``untouched_random_state``, or when that context restores
    only torch's generator; with mixup, also when ``bind_loader`` runs ``probe_problem`` outside it: the
    step's ``np.random.beta`` then moves numpy's generator). The sequential training that follows the
    fallback would see other noise. The reference is ``runner="sequential"``, which never probes."""

    def run(runner: str) -> FederatedStrategy:
        np.random.seed(1)
        random.seed(2)
        data = FederatedDataModule.from_client_datasets(
            [NoisyClient(c) for c in clients()], clients(), batch_size=8, seed=3
        )
        return fit(runner, model=model, data=data)[0]

    sequential, auto = run("sequential"), run("auto")
    assert (
        auto.runner_report.runner == "sequential"
    )  # the step's loss is not plain cross-entropy: auto runs sequentially
    assert_same(sequential, auto, exact=True)


# ----------------------------------------------------------------------------- kernels that are not deterministic, several processes


FORWARD_CALLS = itertools.count()
"""``LastBitsNet``'s calls, kept outside the module as a GPU's scheduling is (a count on the module would be
a write of its ``training_step``, which the probe now refuses: ``tests/test_training_step_side_effects.py``)."""


class LastBitsNet(Net):
    """Its head sums over the features in the opposite order on every other call: the two forwards differ
    in the last bits only, as GPU kernels that are not deterministic (atomics) do."""

    def forward(self, x):
        features, weight = self.body(x)[:, None, :], self.classifier.weight
        if next(FORWARD_CALLS) % 2:
            features, weight = features.flip(-1), weight.flip(-1)
        return (features * weight).sum(-1) + self.classifier.bias


def test_a_forward_differing_in_the_last_bits_is_not_called_random():
    """Catches the probe comparing two forwards bit for bit (fails when ``_step_problem`` compares
    ``output`` and ``again`` with ``same_tensor``: it then reports "forward is random", and on several
    processes that rank ran the sequential path while the others ran the engine)."""
    module, (x, y) = LastBitsNet(), first_batch(0)
    with torch.no_grad():
        once, twice = module(x), module(x)
    assert not torch.equal(once, twice)  # the case is real: the orders round differently
    torch.testing.assert_close(once, twice)
    loss = declared_loss(module)
    assert probe_problem(module, loss, loss_label(module.fedrep_loss), [((x, y), 0, "a batch")]) is None


class TwoRanks(Collective):
    """This process as rank 0 of two; rank 1's answer to each all-gather is ``rank1(obj)``."""

    def __init__(self, rank1):
        self.rank1 = rank1

    @property
    def world_size(self) -> int:
        return 2

    def all_gather_object(self, obj):
        return [obj, self.rank1(obj)]


def fit_with_rank1(monkeypatch, rank1, **kwargs):
    """``fit`` where the engine's start gathers from a simulated rank 1 (the rest of the fit is one process)."""
    from lightning_fedrep.runners import selection

    def start(*args, **options):
        return start_engine(*args, **{**options, "collective": TwoRanks(rank1)})

    monkeypatch.setattr(selection, "start_engine", start)
    return fit(**kwargs)


RANDOM = "the module's forward is random (it differs between two seeds: a random op inside forward)"


def test_every_rank_falls_back_when_another_rank_finds_a_problem(monkeypatch, caplog):
    """Catches ranks deciding the probe alone (fails when ``start_engine``/``bind_loader`` do not gather
    the verdict: rank 0, whose probe passed, keeps the engine while rank 1 runs the sequential path, and
    both wait forever for the other's steps). The rule restated: any rank's problem, first by rank, sends
    every rank to the sequential path, which then trains what ``runner="sequential"`` trains."""

    def rank1(obj):
        return {"probe_problem": RANDOM} if "probe_problem" in obj else obj

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        auto, _ = fit_with_rank1(monkeypatch, rank1, runner="auto", rounds=1)
    assert auto.runner_report.runner == "sequential"
    (line,) = engine_lines(caplog)
    assert line == f"lightning_fedrep: sequential runner ({RANDOM})."
    sequential, _ = fit("sequential", rounds=1)
    assert_same(sequential, auto, exact=True)
    with pytest.raises(
        ValueError, match="runner='vectorized' cannot run here: the module's forward is random"
    ):
        fit_with_rank1(monkeypatch, rank1, runner="vectorized", rounds=1)


def test_features_are_cached_only_where_every_rank_can(monkeypatch, caplog):
    """Catches ranks deciding the feature cache alone (fails when ``bind_loader`` keeps its own
    ``caching`` whatever the other ranks found: rank 0 then trains head phases on cached features while
    rank 1 cannot, and their steps differ)."""
    why = "the training data is augmented at random (NoisyClient.transform)"

    def rank1(obj):
        return {**obj, "no_cache": why} if "no_cache" in obj else obj

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit_with_rank1(monkeypatch, rank1, runner="vectorized", rounds=1)
    assert strategy.runner_report.runner == "vectorized" and not strategy.runner_settings["caching"]
    (line,) = engine_lines(caplog)
    assert f"no feature cache: rank 1 cannot: {why}" in line


def test_a_declared_split_whose_features_read_the_tuned_names_is_not_used():
    """``forward_features``/``forward_head`` split the model, but the tuned names (LG-FedAvg's local part, the
    body) are read by ``forward_features``: caching the features would train nothing. ``find_feature_split``
    must refuse it (``None``), and accept the same split for the real head. Fails without ``_features_read``
    (the declared split was trusted for any names)."""
    from lightning_fedrep.federation.module.feature_split import find_feature_split
    from lightning_fedrep.models import MLPClassifier

    torch.manual_seed(0)
    module = MLPClassifier().eval()
    probe = torch.randn(4, 64)
    body = tuple(n for n, _ in module.named_parameters() if n.startswith("body."))
    head = tuple(n for n, _ in module.named_parameters() if not n.startswith("body."))
    assert find_feature_split(module, body, probe) is None
    assert find_feature_split(module, head, probe) is not None
