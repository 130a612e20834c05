"""The vectorized runner against the sequential path: more optimizers and head shapes, and where it
does not run.

Every equivalence test fits the same module twice — ``runner="sequential"`` (the user's
``training_step``, one client step per Lightning step) and ``runner="vectorized"`` (a round's clients in
lockstep) — and compares the global tensors and every client's tensors. The engine is asserted to have
run (else the comparison would be vacuous). Here: AdamW, SGD parameter groups, multi-layer heads, epoch
LR schedulers, explicit step phases, a round-end checkpoint moving between engines, every fallback and
refusal with its reason, groups of two, ``global_step`` and mid-round validation on the engine (the
algorithm matrix, mid-round resume and ``max_steps``/``EarlyStopping``: ``tests/test_engine_equivalence.py``).
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy, Phase, RunnerSettings
from lightning_fedrep.federation.api.epochs import epoch_settings
from lightning_fedrep.lightning.constraints import constraints_of
from lightning_fedrep.runners.lockstep import module_reasons, trainer_reasons
from tests.fixtures import quiet_trainer, runner_setting

EQUAL = (24,) * 6
UNEQUAL = (7, 41, 13, 22, 30, 9)  # 1 to 6 batches of 8 per epoch, a partial last batch for most
ATOL, RTOL = 1e-5, 1e-4


class Net(L.LightningModule):
    """A body and a ``classifier`` head, declaring its loss; the engine detects the feature split
    (the head module is called last)."""

    fedrep_loss = "cross_entropy"

    def __init__(self, optimizer: str = "sgd", scheduler: bool = False, deep_head: bool = False):
        super().__init__()
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.ReLU())
        self.classifier = (
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)) if deep_head else nn.Linear(8, 4)
        )

    def forward(self, x):
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        name = self.optimizer_name
        if name == "sgd":  # momentum and weight decay: StackedSGD on the engine
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        elif name == "sgd_groups":  # a group per part, each with its own hyper-parameters
            optimizer = torch.optim.SGD(
                [
                    {"params": self.body.parameters(), "lr": 0.02},
                    {"params": self.classifier.parameters(), "weight_decay": 0.0, "nesterov": True},
                ],
                lr=0.1,
                momentum=0.5,
                weight_decay=1e-2,
            )
        elif name == "adam":  # per-client views on the engine
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=1e-3)
        elif name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, amsgrad=True)
        else:
            raise ValueError(name)
        if not self.scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class DeclaredNet(Net):
    """Declares its feature split."""

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(features)


def datamodule(sizes=UNEQUAL, seed=3) -> FederatedDataModule:
    g = torch.Generator().manual_seed(seed)
    clients = []
    for n in sizes:
        x = torch.randn(n, 6, generator=g)
        clients.append(TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()))
    return FederatedDataModule.from_client_datasets(clients, clients, batch_size=8, seed=seed)


def make_strategy(runner, **kwargs) -> FederatedStrategy:
    options = dict(
        head="classifier", clients_per_round=4, head_epochs=2, body_epochs=1, local_epochs=2, seed=5
    )
    settings = {**options, **kwargs}
    epochs = {n: settings.pop(n) for n in ("head_epochs", "body_epochs", "local_epochs")}
    if settings.get("phases") is None:  # only the shorthands the algorithm reads (the others are refused)
        settings.update(epoch_settings(settings.get("algorithm", "fedrep"), **epochs))
    return FederatedStrategy(runner=runner_setting(runner, settings), **settings)


def fit(runner, model=Net, sizes=UNEQUAL, rounds=3, trainer=None, ckpt_path=None, **strategy_kwargs):
    torch.manual_seed(0)
    module = model()
    strategy = make_strategy(runner, **strategy_kwargs)
    lightning_trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, **{"limit_val_batches": 0, **(trainer or {})}
    )
    lightning_trainer.fit(module, datamodule=datamodule(sizes), ckpt_path=ckpt_path)
    return strategy, lightning_trainer


def initial_tensors(model=Net) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in model().named_parameters()}


def assert_same(expected: FederatedStrategy, got: FederatedStrategy, exact: bool = False) -> None:
    """The global tensors and every client's tensors agree (``exact``: bit for bit)."""

    def check(a, b, what):
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")

    assert expected.global_tensors().keys() == got.global_tensors().keys()
    for name, value in expected.global_tensors().items():
        check(got.global_tensors()[name], value, f"global {name}")
    assert expected.num_clients == got.num_clients
    for client in range(expected.num_clients):
        mine, theirs = expected.client_tensors(client), got.client_tensors(client)
        assert mine.keys() == theirs.keys()
        for name, value in mine.items():
            check(theirs[name], value, f"client {client} {name}")


def assert_kept_states_equal(expected: FederatedStrategy, got: FederatedStrategy) -> None:
    kept, theirs = expected.federation.store.optimizer_states, got.federation.store.optimizer_states
    assert kept.keys() == theirs.keys()
    for client, per_optimizer in kept.items():
        assert per_optimizer.keys() == theirs[client].keys(), client
        for index, entries in per_optimizer.items():
            assert entries.keys() == theirs[client][index].keys(), (client, index)
            for param, state in entries.items():
                assert state.keys() == theirs[client][index][param].keys(), (client, param)
                for key, value in state.items():
                    torch.testing.assert_close(
                        torch.as_tensor(theirs[client][index][param][key]),
                        torch.as_tensor(value),
                        atol=ATOL,
                        rtol=RTOL,
                        msg=lambda m, c=client, p=param, k=key: f"client {c} param {p} {k}: {m}",
                    )


# ----------------------------------------------------------------------------- 1. equivalence

CASES = [
    # algorithm, optimizer, client_optimizer_state, client sizes, model
    ("fedrep", "sgd", "reset", "equal", "detected"),
    ("fedrep", "sgd", "keep", "unequal", "declared"),
    ("fedrep", "adam", "keep", "unequal", "detected"),
    ("fedrep", "adam", "reset", "equal", "declared"),
    ("fedper", "sgd", "keep", "equal", "detected"),
    ("fedper", "adam", "reset", "unequal", "declared"),
    ("lg_fedavg", "sgd", "reset", "unequal", "detected"),
    ("lg_fedavg", "adam", "keep", "equal", "declared"),
    ("fedavg", "sgd", "keep", "unequal", "declared"),
    ("fedavg", "adam", "reset", "equal", "detected"),
    ("local", "sgd", "reset", "equal", "declared"),
    ("local", "adam", "keep", "unequal", "detected"),
    ("fedrep", "adamw", "keep", "unequal", "detected"),
    ("fedrep", "sgd_groups", "keep", "unequal", "deep_head"),
]
MODELS = {"detected": Net, "declared": DeclaredNet, "deep_head": lambda **kw: Net(deep_head=True, **kw)}


@pytest.mark.parametrize(
    "algorithm,optimizer,state,sizes,model", CASES, ids=["-".join(case) for case in CASES]
)
def test_vectorized_equals_sequential(algorithm, optimizer, state, sizes, model):
    def build():
        return MODELS[model](optimizer=optimizer)

    kwargs = dict(
        algorithm=algorithm,
        model=build,
        sizes=EQUAL if sizes == "equal" else UNEQUAL,
        client_optimizer_state=state,
    )
    sequential, seq_trainer = fit("sequential", **kwargs)
    vectorized, vec_trainer = fit("vectorized", **kwargs)

    engine = vectorized.lockstep_engine
    assert sequential.runner_report.runner == "sequential" and engine is not None
    assert vec_trainer.global_step < seq_trainer.global_step  # the clients really ran in lockstep
    if algorithm == "fedrep":  # a head phase: on cached features, through the expected split
        assert engine.caching
        how = (
            "forward_features/forward_head" if model == "declared" else "head module 'classifier' called last"
        )
        assert engine.split.how == how
    assert_same(sequential, vectorized)
    # and something was trained (the comparison is not of two untouched models)
    start = initial_tensors(build)
    moved = {**vectorized.global_tensors(), **vectorized.client_tensors(vectorized.round_plan(2).clients[0])}
    assert any(not torch.equal(value, start[name]) for name, value in moved.items())
    if state == "keep":
        assert_kept_states_equal(sequential, vectorized)
        if algorithm != "fedavg":  # fedavg keeps nothing local, so no optimizer state either
            assert vectorized.federation.store.optimizer_states


@pytest.mark.parametrize("optimizer,state", [("sgd", "reset"), ("adam", "keep")])
def test_epoch_lr_scheduler_on_the_engine_equals_sequential(optimizer, state):
    def build():
        return DeclaredNet(optimizer=optimizer, scheduler=True)

    kwargs = dict(model=build, client_optimizer_state=state, algorithm="fedper")
    sequential, _ = fit("sequential", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vectorized, vec_trainer = fit("vectorized", **kwargs)
    assert vectorized.runner_report.runner == "vectorized"
    assert_same(sequential, vectorized)
    if state == "keep":
        assert_kept_states_equal(sequential, vectorized)
    # the schedule ticked once per round: 3 rounds of StepLR(gamma=0.5) on the user's optimizer
    base = 0.05 if optimizer == "sgd" else 0.01
    assert vec_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(base * 0.5**3)
    # the engine steps the clients' optimizers, not the user's: the scheduler must not think it ran first
    assert not [w for w in caught if "lr_scheduler.step()` before `optimizer.step()" in str(w.message)]


def test_explicit_step_phases_on_the_engine_equal_sequential():
    phases = [Phase("body", epochs=1), Phase("head", steps=9), Phase("all", steps=2)]
    sequential, _ = fit("sequential", phases=phases, client_optimizer_state="keep")
    vectorized, _ = fit("vectorized", phases=phases, client_optimizer_state="keep")
    assert vectorized.runner_report.runner == "vectorized"
    assert_same(sequential, vectorized)
    assert_kept_states_equal(sequential, vectorized)


# ----------------------------------------------------------------------------- 2. checkpoint / resume

RESUME = dict(
    model=lambda: Net(optimizer="adam", scheduler=True),
    clients_per_round=5,
    width=2,
    client_optimizer_state="keep",
)


def test_round_boundary_checkpoint_moves_between_engines(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit("vectorized", trainer=dict(enable_checkpointing=True, callbacks=[saver]), rounds=1, **RESUME)
    sequential, _ = fit("sequential", ckpt_path=tmp_path / "epoch=0.ckpt", **RESUME)
    vectorized, _ = fit("vectorized", **RESUME)
    assert_same(vectorized, sequential)

    # the other way round, mid-round: a sequential checkpoint does not resume on the engine
    saver = ModelCheckpoint(dirpath=tmp_path / "seq", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    fit("sequential", trainer=dict(enable_checkpointing=True, callbacks=[saver], max_steps=5), **RESUME)
    with pytest.raises(ValueError, match="by the sequential runner, but this run uses the vectorized one"):
        fit("vectorized", ckpt_path=tmp_path / "seq" / "step=5.ckpt", **RESUME)


# ----------------------------------------------------------------------------- 3. fallback and refusal


class DropoutNet(Net):
    def __init__(self):
        super().__init__()
        self.body.insert(2, nn.Dropout(0.3))


class BatchNormNet(Net):
    def __init__(self):
        super().__init__()
        self.body.insert(1, nn.BatchNorm1d(10))


class ManualNet(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y))
        optimizer.step()


class ScaledSGD(torch.optim.SGD):
    """Not in the engine's list of element-wise optimizers (a subclass may change the update)."""


class SubclassOptimizerNet(Net):
    def configure_optimizers(self):
        return ScaledSGD(self.parameters(), lr=0.05)


class LBFGSNet(Net):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


class HookNet(Net):
    def on_before_optimizer_step(self, optimizer):
        pass


class BufferNet(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        return self.classifier(self.body(x * self.scale))


class NoLossNet(Net):
    fedrep_loss = None


FALLBACKS = [
    # id, model, trainer kwargs, strategy kwargs, the reason's words
    ("dropout", DropoutNet, {}, {}, "random layer 'body.2' (Dropout) in train mode"),
    ("batch_norm", BatchNormNet, {}, {}, "batch norm in train mode ('body.1'"),
    ("manual", ManualNet, {}, {}, "manual optimization"),
    ("sgd_subclass", SubclassOptimizerNet, {}, {}, "ScaledSGD is not an optimizer the engine knows"),
    ("lbfgs", LBFGSNet, {}, {}, "LBFGS is not an optimizer the engine knows"),
    ("clipping", Net, {"gradient_clip_val": 1.0}, {}, "gradient clipping"),
    ("no_loss", NoLossNet, {}, {}, "declares no pure loss"),
    ("hook", HookNet, {}, {}, "overrides on_before_optimizer_step"),
    ("local_buffers", BufferNet, {}, {"buffers": "local"}, "buffers kept per client"),
]
SMALL = dict(rounds=1, clients_per_round=2, head_epochs=1, sizes=EQUAL)  # no batch of 1 (batch norm)


@pytest.mark.parametrize(
    "model,trainer_kwargs,strategy_kwargs,reason", [f[1:] for f in FALLBACKS], ids=[f[0] for f in FALLBACKS]
)
def test_auto_falls_back_naming_the_reason_and_vectorized_refuses(
    model, trainer_kwargs, strategy_kwargs, reason, caplog
):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, trainer = fit("auto", model=model, trainer=trainer_kwargs, **SMALL, **strategy_kwargs)
    assert strategy.runner_report.runner == "sequential"
    assert trainer.global_step == strategy.round_plan(0).length  # one client step per Lightning step
    lines = [r.getMessage() for r in caplog.records if "lightning_fedrep:" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lightning_fedrep: sequential runner (")
    assert reason in lines[0]
    facts = constraints_of(trainer, strategy.lightning_module, trainer.optimizers)
    found = module_reasons(strategy.lightning_module, strategy.federation.layout, facts) + trainer_reasons(
        facts
    )
    assert any(reason in r for r in found), found

    with pytest.raises(ValueError, match="runner='vectorized' would not compute") as refused:
        fit("vectorized", model=model, trainer=trainer_kwargs, **SMALL, **strategy_kwargs)
    assert reason in str(refused.value)


def test_auto_runs_the_engine_where_exact_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, _ = fit("auto", **SMALL)
    assert strategy.runner_report.runner == "vectorized"
    lines = [r.getMessage() for r in caplog.records if "lightning_fedrep:" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lightning_fedrep: vectorized runner (")
    assert "head phases on cached features" in lines[0]
    module = strategy.lightning_module
    facts = constraints_of(module.trainer, module, module.trainer.optimizers)
    assert module_reasons(module, strategy.federation.layout, facts) == []


@pytest.mark.parametrize(
    "runner,match",
    [
        ("fast", "runner must be 'auto', 'vectorized' or 'sequential', or a RunnerSettings"),
        ("Vectorized", "runner must be"),
        (None, "runner must be"),
        (
            lambda: RunnerSettings("fast"),
            "RunnerSettings.choice must be 'auto', 'vectorized' or 'sequential'",
        ),
        (lambda: RunnerSettings(width=0), "RunnerSettings.width must be"),
        (lambda: RunnerSettings(width=-2), "RunnerSettings.width must be"),
        (lambda: RunnerSettings(width=2.0), "RunnerSettings.width must be"),
        (lambda: RunnerSettings(width=True), "RunnerSettings.width must be"),
        (lambda: RunnerSettings(width="2"), "RunnerSettings.width must be"),
        (lambda: RunnerSettings(memory=0), "RunnerSettings.memory must be"),
    ],
    ids=str,
)
def test_bad_runner_settings_are_refused_at_construction(runner, match):
    with pytest.raises(ValueError, match=match):
        FederatedStrategy(head="classifier", runner=runner() if callable(runner) else runner)


@pytest.mark.parametrize(
    "old,new",
    [
        ({"engine": "vectorized"}, "engine= -> runner=<choice>"),
        ({"engine_width": 2}, "engine_width= -> runner=RunnerSettings(width=...)"),
        ({"engine_memory": 2**20}, "engine_memory= -> runner=RunnerSettings(memory=...)"),
        ({"engine_steps_per_call": 1}, "engine_steps_per_call= -> runner=RunnerSettings(steps_per_call=...)"),
        ({"engine_compile": True}, "engine_compile= -> runner=RunnerSettings(compile=...)"),
    ],
    ids=str,
)
def test_the_old_engine_keywords_are_refused_naming_the_runner_setting(old, new):
    """Catches the runner keywords before 0.x (``engine=``, ``engine_width=``, ...) reaching Lightning's
    strategy as an unexplained unexpected keyword, or being accepted and ignored."""
    with pytest.raises(TypeError, match="one argument, runner") as refused:
        FederatedStrategy(head="classifier", **old)
    assert new in str(refused.value)


def test_a_choice_name_stands_for_its_default_settings():
    assert FederatedStrategy(runner="vectorized").runner == RunnerSettings("vectorized")
    settings = RunnerSettings("auto", width=3, memory=2**20, steps_per_call=1, compile=True)
    assert FederatedStrategy(runner=settings).runner is settings
    assert FederatedStrategy().runner == RunnerSettings()


# ----------------------------------------------------------------------------- 4. chunked groups


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_groups_of_two_over_five_clients_equal_sequential(optimizer):
    kwargs = dict(model=lambda: Net(optimizer=optimizer), clients_per_round=5, client_optimizer_state="keep")
    sequential, _ = fit("sequential", **kwargs)
    chunked, _ = fit("vectorized", width=2, **kwargs)
    engine = chunked.lockstep_engine
    assert engine.group_width == 2
    for r in range(3):
        segments = engine.schedule(chunked.round_plan(r)).segments
        assert sorted({s.group for s in segments}) == [0, 1, 2]
        assert all(len(s.group_clients) <= 2 for s in segments)
    assert_same(sequential, chunked)
    assert_kept_states_equal(sequential, chunked)


# ----------------------------------------------------------------------------- 5. Lightning features


def test_global_step_counts_lockstep_steps():
    """Unfused (``steps_per_call=1``); fused calls: tests/test_engine_fused.py."""
    sequential, seq_trainer = fit("sequential")
    vectorized, vec_trainer = fit("vectorized", steps_per_call=1)
    engine = vectorized.lockstep_engine
    assert vec_trainer.global_step == sum(engine.schedule(vectorized.round_plan(r)).length for r in range(3))
    assert seq_trainer.global_step == sum(sequential.round_plan(r).length for r in range(3))
    # one lockstep step advances every client: a round lasts as long as its longest client's phases
    for r in range(3):
        plan = vectorized.round_plan(r)
        longest = [max(w.phases[p][1] for w in plan.work) for p in range(len(plan.phases))]
        assert engine.schedule(plan).length == sum(longest)
    assert "train/loss" in vec_trainer.callback_metrics


def test_mid_round_validation_leaves_the_engines_training_untouched():
    plain, _ = fit("vectorized")
    validated, trainer = fit("vectorized", trainer=dict(val_check_interval=0.5, limit_val_batches=None))
    assert validated.runner_report.runner == "vectorized" and len(validated.history) == 3
    assert_same(plain, validated, exact=True)
