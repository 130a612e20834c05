"""``FederatedStrategy(randomness="per_client")``: the vectorized runner with dropout in train mode.

The contract (docs/engine.md, "Random layers"): under ``"exact"`` (the default) the vectorized runner computes
what the sequential runner computes, draw for draw, and refuses random layers, naming the fix; under
``"per_client"`` it takes them, every client of a lockstep step drawing its own random numbers from a generator
keyed by the seed, round, phase, step and the step's clients: the same distribution as the sequential runner,
not the same draws, bit-identical for a seed and across a resume. Each test says what it catches.
"""

from __future__ import annotations

import logging
import math
import statistics

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy, RunnerSettings
from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.federation.api.epochs import epoch_settings
from lightning_fedrep.runners.lockstep.randomness import keyed_generator, step_seed
from tests.fixtures import quiet_trainer

SIZES = (16, 24, 9, 30, 12, 20)


class DropoutMLP(L.LightningModule):
    """A small MLP with ``nn.Dropout`` in its body (``p``) and before its head (``head_p``, inside the declared
    head: the body stays a fixed function of its tensors, so head phases may run on cached features)."""

    fedrep_loss = "cross_entropy"

    def __init__(
        self, p: float = 0.3, head_p: float = 0.0, inputs: int = 6, classes: int = 4, lr: float = 0.1
    ):
        super().__init__()
        self.lr = lr
        self.body = nn.Sequential(
            nn.Linear(inputs, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 12), nn.ReLU()
        )
        self.drop = nn.Dropout(head_p)
        self.classifier = nn.Linear(12, classes)

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(self.drop(features))

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_ce", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)


class NumpyNoiseMLP(DropoutMLP):
    """Random in ``forward`` from numpy's generator: no per-client draws can come of it."""

    def forward(self, x):
        noise = torch.as_tensor(np.random.standard_normal(x.shape), dtype=x.dtype) if self.training else 0
        return super().forward(x + 0.1 * noise)


class FunctionalDropoutMLP(DropoutMLP):
    """Random in ``forward`` without an ``nn.Dropout`` module (``F.dropout``): torch's generator."""

    def __init__(self):
        super().__init__(p=0.0)

    def forward(self, x):
        return self.classifier(F.dropout(self.body(x), 0.2, self.training))


def datamodule(sizes=SIZES, seed=3, same=False) -> FederatedDataModule:
    """Clients of ``sizes`` samples; ``same``: every client the same samples."""
    g = torch.Generator().manual_seed(seed)
    clients = []
    for n in sizes:
        if not (same and clients):
            x = torch.randn(n, 6, generator=g)
            data = TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())
        clients.append(data)
    return FederatedDataModule.from_client_datasets(clients, clients, batch_size=8, seed=seed)


def strategy(runner="vectorized", randomness="per_client", algorithm="fedrep", **kwargs) -> FederatedStrategy:
    options = dict(head="classifier", clients_per_round=4, seed=5, algorithm=algorithm)
    options.update(epoch_settings(algorithm, head_epochs=2, body_epochs=1, local_epochs=2))
    return FederatedStrategy(runner=runner, randomness=randomness, **{**options, **kwargs})


def fit(
    runner="vectorized", randomness="per_client", model=None, dm=None, rounds=3, trainer=None, ckpt=None, **kw
):
    torch.manual_seed(0)
    module = model() if model is not None else DropoutMLP()
    fed = strategy(runner, randomness, **kw)
    lightning_trainer = quiet_trainer(
        strategy=fed, max_epochs=rounds, **{"limit_val_batches": 0, **(trainer or {})}
    )
    lightning_trainer.fit(module, datamodule=dm or datamodule(), ckpt_path=ckpt)
    return fed, lightning_trainer


def tensors(fed: FederatedStrategy) -> dict[str, torch.Tensor]:
    """The global tensors and every client's, by ``"global name"`` / ``"client name"``."""
    out = {f"global {n}": t for n, t in fed.global_tensors().items()}
    for client in range(fed.num_clients):
        out.update({f"{client} {n}": t for n, t in fed.client_tensors(client).items()})
    return out


def assert_identical(a: FederatedStrategy, b: FederatedStrategy) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for name, value in ta.items():
        assert torch.equal(tb[name], value), name


def largest_difference(a: FederatedStrategy, b: FederatedStrategy) -> float:
    ta, tb = tensors(a), tensors(b)
    return max((ta[n] - tb[n]).abs().max().item() for n in ta)


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lightning_fedrep:" in r.getMessage()]


# ----------------------------------------------------------------------------- settings and refusals


@pytest.mark.parametrize("bad", ["foo", "Per_Client", None, 1])
def test_a_bad_randomness_is_refused_at_construction_naming_the_argument_and_choices(bad):
    """Catches an unchecked setting (fails when ``randomness_setting`` passes anything through)."""
    with pytest.raises(ValueError, match=r"randomness must be 'exact' .* or 'per_client'") as refused:
        FederatedStrategy(head="classifier", randomness=bad)
    assert repr(bad) in str(refused.value)
    assert FederatedStrategy(head="classifier").randomness == "exact"


def test_the_exact_contract_refuses_dropout_naming_the_fix(caplog):
    """Catches the default changing, or a refusal that does not say how to run the module vectorized."""
    fix = "randomness='per_client'"
    with pytest.raises(ValueError, match="random layer 'body.2' \\(Dropout\\) in train mode") as refused:
        fit("vectorized", "exact", rounds=1)
    assert fix in str(refused.value)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fed, _ = fit("auto", "exact", rounds=1)
    assert fed.runner_report.runner == "sequential" and fix in fed.runner_report.reason
    with pytest.raises(ValueError, match="forward is random") as refused:  # F.dropout: found by the probe
        fit("vectorized", "exact", model=FunctionalDropoutMLP, rounds=1)
    assert fix in str(refused.value)


def test_per_client_takes_torch_randomness_in_forward_but_not_numpys():
    """Catches the probe's relaxation going too far (a numpy draw would give every lockstep client the same
    numbers) or not far enough (an ``F.dropout`` in forward is as per-client as an ``nn.Dropout``)."""
    fed, _ = fit("vectorized", model=FunctionalDropoutMLP, rounds=1)
    assert fed.runner_report.runner == "vectorized"
    with pytest.raises(ValueError, match="random outside torch's generator"):
        fit("vectorized", model=NumpyNoiseMLP, rounds=1)


# ----------------------------------------------------------------------------- the exact contract still holds


@pytest.mark.parametrize("algorithm", ["fedrep", "fedavg"])
def test_without_draws_per_client_vectorized_equals_sequential(algorithm):
    """Dropout at p=0 (and validation in eval mode): per_client changes nothing, so the vectorized runner still
    equals the sequential runner (catches the keyed generator or the relaxed checks changing the arithmetic)."""
    kw = dict(algorithm=algorithm, trainer={"limit_val_batches": 1.0})
    model = lambda: DropoutMLP(p=0.0, head_p=0.0)  # noqa: E731
    sequential, _ = fit("sequential", model=model, **kw)
    vectorized, _ = fit("vectorized", model=model, **kw)
    exact, _ = fit("vectorized", "exact", model=model, **kw)
    assert vectorized.runner_report.runner == "vectorized"
    assert vectorized.runner_report.randomness == "per_client"
    assert largest_difference(sequential, vectorized) < 1e-5
    assert_identical(exact, vectorized)
    expected, got = sequential.client_metrics["val"], vectorized.client_metrics["val"]
    for client, value in expected.per_client("val/acc").items():
        assert got.per_client("val/acc")[client] == pytest.approx(value, abs=1e-5)


# ----------------------------------------------------------------------------- reproducible


def test_dropout_on_the_same_seed_twice_is_bit_identical_and_another_seed_is_not():
    """Catches draws taken from the global generator's history (the second fit starts from another global
    state: ``torch.rand`` in between) or a key that ignores the seed; validation runs batched in eval mode (no
    draws: the same scores)."""
    validated = {"limit_val_batches": 1.0}
    first, trainer = fit(trainer=validated)
    assert first.runner_report.runner == "vectorized"
    assert trainer.global_step < first.round_plan(0).length  # lockstep: not a Lightning step per client step
    torch.rand(100)
    second, _ = fit(trainer=validated)
    assert_identical(first, second)
    assert first.history == second.history and first.history
    other, _ = fit(seed=6)
    assert largest_difference(first, other) > 1e-3


def test_the_sequential_runner_with_dropout_is_reproducible_from_the_global_seed():
    """The sequential runner under either setting draws from torch's global generator: the same global seed
    (``fit`` seeds it before building the module), the same model; another global stream, another model."""
    first, _ = fit("sequential")
    second, _ = fit("sequential", "exact")
    assert first.runner_report.runner == "sequential"
    assert_identical(first, second)
    torch.manual_seed(0)
    module = DropoutMLP()
    torch.manual_seed(1)  # the same start, another global stream after it
    fed = strategy("sequential")
    quiet_trainer(strategy=fed, max_epochs=3, limit_val_batches=0).fit(module, datamodule=datamodule())
    assert largest_difference(first, fed) > 1e-3


def test_the_run_leaves_the_global_generator_where_a_run_without_draws_leaves_it():
    """The vectorized runner draws nothing from torch's global generator (catches an unforked step)."""
    fit(model=lambda: DropoutMLP(p=0.0))
    without = torch.rand(3)
    fit(model=lambda: DropoutMLP(p=0.5, head_p=0.5))
    assert torch.equal(torch.rand(3), without)


def test_a_resume_at_a_round_boundary_draws_what_the_uninterrupted_run_drew(tmp_path):
    """Catches per-client state that a checkpoint loses (fails if the draws depended on the global generator
    or a counter kept outside the checkpoint)."""
    uninterrupted, _ = fit(rounds=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    fit(rounds=2, trainer=dict(enable_checkpointing=True, callbacks=[checkpoint]))
    saved = sorted(tmp_path.glob("epoch=1-*.ckpt"))
    assert saved, sorted(p.name for p in tmp_path.iterdir())
    torch.rand(10)  # another global state: the resumed run must not care
    resumed, _ = fit(rounds=3, ckpt=saved[0])
    assert_identical(uninterrupted, resumed)


def test_a_resume_inside_a_round_draws_what_the_uninterrupted_run_drew(tmp_path):
    """Mid-round (unfused, a checkpoint every 3 steps, inside a lockstep group): catches a step key that
    restarts with the resumed group (e.g. counting steps since the process started)."""
    kw = dict(runner=RunnerSettings("vectorized", steps_per_call=1))
    uninterrupted, _ = fit(**kw)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(trainer=dict(enable_checkpointing=True, callbacks=[checkpoint], max_steps=4), **kw)
    saved = tmp_path / "epoch=0-step=3.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    state = torch.load(saved, weights_only=True)["lightning_fedrep"]
    assert state["round"]["open"] and state["round"]["engine"] is not None
    resumed, _ = fit(ckpt=saved, **kw)
    assert_identical(uninterrupted, resumed)


# ----------------------------------------------------------------------------- per client


def test_clients_with_the_same_data_and_weights_draw_different_masks():
    """Every client of a round holds the same samples and starts from the same head; one full batch per
    epoch, so the data order cannot tell them apart. Without dropout their heads end equal within float error;
    with dropout they differ by far more (catches one mask shared by all clients of a lockstep step)."""
    dm = lambda: datamodule(sizes=(8,) * 4, same=True)  # noqa: E731

    def head_spread(p: float) -> float:
        fed, _ = fit(model=lambda: DropoutMLP(p=p, head_p=p), dm=dm(), rounds=1)
        heads = [fed.client_tensors(c)["classifier.weight"] for c in range(4)]
        return max((h - heads[0]).abs().max().item() for h in heads[1:])

    assert head_spread(0.0) < 1e-6
    assert head_spread(0.5) > 1e-3


def test_the_key_and_the_keyed_generator():
    """The key changes with every part, and the keyed generator leaves the global one where it was."""
    base = step_seed(5, 1, 0, 3, (2, 7))
    for other in (
        step_seed(6, 1, 0, 3, (2, 7)),
        step_seed(5, 2, 0, 3, (2, 7)),
        step_seed(5, 1, 1, 3, (2, 7)),
        step_seed(5, 1, 0, 4, (2, 7)),
        step_seed(5, 1, 0, 3, (7, 2)),
        step_seed(5, 1, 0, 3, (2,)),
    ):
        assert other != base
    state = torch.get_rng_state()
    with keyed_generator(base, torch.device("cpu")):
        drawn = torch.rand(4)
    with keyed_generator(base, torch.device("cpu")):
        assert torch.equal(torch.rand(4), drawn)
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- the runner's choice and report


def test_auto_takes_the_vectorized_runner_and_the_report_says_which_contract_ran(caplog):
    """Dropout only in the head: the body is fixed, so head phases run on cached features and ``auto`` gains
    (catches ``auto`` still falling back for the random layer); dropout in the body: no feature cache, said."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fed, _ = fit("auto", model=lambda: DropoutMLP(p=0.0, head_p=0.3), rounds=1)
    report = fed.runner_report
    assert report.runner == "vectorized" and fed.runner_settings["caching"]
    assert report.randomness == "per_client" and report.randomness_contract.startswith("per_client:")
    (line,) = engine_lines(caplog)
    assert "Randomness: per_client" in line and "head phases on cached features" in line

    fed, _ = fit("vectorized", model=lambda: DropoutMLP(p=0.3, head_p=0.0), rounds=1)
    assert not fed.runner_settings["caching"]
    assert "the body is random in train mode" in fed.runner_report.reason

    fed, _ = fit("sequential", rounds=1)
    assert fed.runner_report.randomness_contract.startswith("sequential:")
    fed, _ = fit("vectorized", "exact", model=lambda: DropoutMLP(p=0.0), rounds=1)
    assert fed.runner_report.randomness_contract.startswith("exact:")


# ----------------------------------------------------------------------------- the same distribution


class DigitsMLP(DropoutMLP):
    def __init__(self):
        super().__init__(p=0.3, head_p=0.3, inputs=64, classes=10, lr=0.1)


def digits_accuracy(runner: str, seed: int) -> float:
    torch.manual_seed(seed)
    L.seed_everything(seed, verbose=False)
    module = DigitsMLP()
    dm = DigitsDataModule(num_clients=10, classes_per_client=2, batch_size=20, seed=0)
    fed = FederatedStrategy(
        head="classifier",
        clients_per_round=0.5,
        head_epochs=1,
        body_epochs=1,
        seed=seed,
        runner=runner,
        randomness="per_client",
    )
    trainer = quiet_trainer(strategy=fed, max_epochs=3, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    assert fed.runner_report.runner == runner
    metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    return metrics["test/acc"]


def test_accuracy_over_seeds_matches_the_sequential_runner_within_noise():
    """Five seeds on each runner (digits, 10 clients of two classes, 5 a round, 3 rounds, dropout 0.3 in body
    and head): the mean
    personalized test accuracies agree within two standard errors of their difference, or 0.01 (catches
    draws that are not dropout's distribution: a mask kept for a whole phase, scaled wrong, or shared)."""
    seeds = range(5)
    sequential = [digits_accuracy("sequential", s) for s in seeds]
    vectorized = [digits_accuracy("vectorized", s) for s in seeds]
    print("sequential", sequential, "vectorized", vectorized)
    error = math.sqrt(statistics.variance(sequential) / 5 + statistics.variance(vectorized) / 5)
    gap = abs(statistics.mean(sequential) - statistics.mean(vectorized))
    assert gap <= max(2 * error, 0.01), (sequential, vectorized)
    assert (
        statistics.mean(vectorized) > 0.4
    )  # trained: chance is 0.1 (clients never sampled keep initial heads)


# ----------------------------------------------------------------------------- several processes


def test_two_processes_with_dropout_are_reproducible_and_agree(tmp_path):
    """FedRep with dropout on the vectorized runner over 2 gloo processes (``tests/scripts/federated_run.py``),
    twice: bit-identical runs, and both ranks hold the same federation (catches draws keyed by anything a rank
    does not share, or not keyed at all). Not compared with one process: the draws are a function of the
    lockstep group's clients, and 2 ranks train other groups than 1 (the same distribution, not the same
    draws; with dropout off, ``tests/test_distributed.py`` shows 2 processes equal 1)."""
    from tests.scripts.launcher import run_script
    from tests.test_distributed import SCRIPT

    args = ["--devices", "2", "--rounds", "2", "--runner", "vectorized", "--dropout", "0.3"]
    held = []
    for run in ("a", "b"):
        out = tmp_path / run
        code, output = run_script(
            SCRIPT, ["--out", str(out), *args, "--randomness", "per_client"], tmp_path, 240
        )
        assert code == 0, output[-6000:]
        held.append([torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(2)])
    for first, second in zip(*held):
        for part in ("global", "clients"):
            assert torch.equal(
                torch.cat([t.flatten() for t in _flat(first[part])]),
                torch.cat([t.flatten() for t in _flat(second[part])]),
            ), part
    rank0, rank1 = held[0]
    assert rank0["runner"] == rank1["runner"] == "vectorized"
    for name, value in rank0["global"].items():
        assert torch.equal(rank1["global"][name], value), name


def _flat(tree) -> list[torch.Tensor]:
    """The tensors of a nested dict, in key order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for key in sorted(tree) for t in _flat(tree[key])]


def test_compile_is_skipped_where_random_layers_draw_per_client(caplog):
    """``compile=True`` has no keyed per-client draws in its compiled head step: it compiles nothing, and the
    log line says why (catches a compiled step running a head with dropout under ``vmap``'s error mode)."""
    settings = RunnerSettings("vectorized", compile=True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fed, _ = fit(settings, model=lambda: DropoutMLP(p=0.0, head_p=0.3), rounds=1)
    assert fed.runner_settings["compile"] is False and fed.runner_settings["caching"]
    (line,) = engine_lines(caplog)
    assert (
        "compile=True compiles nothing here (randomness='per_client' with random layers ('drop' (Dropout))"
        in line
    )
