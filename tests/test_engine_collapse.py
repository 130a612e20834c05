"""The neural-collapse (FLUTE) penalties on the vectorized runner equal the sequential path's (FedRep and
FLUTE schedules, the server step, unequal clients whose padding rows must not count, clients with
different classes); a callback's ``objective(phase)`` terms on both runners (client ids, phases, the
features check); a term that cannot be vmapped keeps runs sequential."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep import (
    FederatedCallback,
    FederatedDataModule,
    FederatedStrategy,
    Objective,
    Phase,
)
from lightning_fedrep.callbacks import NeuralCollapse
from lightning_fedrep.callbacks.neural_collapse_metrics import class_masks, nc_regularizer
from lightning_fedrep.federation.api.objective import LossTerm, StepView
from tests.fixtures import quiet_trainer
from tests.test_engine_equivalence import DeclaredNet, LossNet, assert_same

FLUTE = [Phase("all", epochs=1)]
FLUTE_STAR = [Phase("head", epochs=1), Phase("all", epochs=1), Phase("head", epochs=1)]
SIZES = [7, 41, 13, 22, 30, 9]
CLASSES = [(0, 1), (1, 2, 3), (2,), (0, 3), (0, 1, 2, 3), (1, 3)]


def skewed_datamodule(seed=3, wrap=None):
    """Six clients of 7 to 41 samples (padding rows in every lockstep step), each with its own classes."""
    g = torch.Generator().manual_seed(seed)
    clients = []
    for n, classes in zip(SIZES, CLASSES):
        x = torch.randn(n, 6, generator=g)
        y = torch.tensor(classes)[torch.randint(len(classes), (n,), generator=g)]
        clients.append(TensorDataset(x, y) if wrap is None else wrap(TensorDataset(x, y)))
    return FederatedDataModule.from_client_datasets(clients, clients, batch_size=8, seed=seed)


def fit(runner, phases=None, callback=None, model_cls=DeclaredNet, rounds=3, data=None):
    torch.manual_seed(0)
    callback = callback or NeuralCollapse(lam=0.3, mu=0.01, nu=0.002, server_step=True, log_metrics=False)
    strategy = FederatedStrategy(
        head="classifier",
        clients_per_round=4,
        **({"head_epochs": 2} if phases is None else {}),
        phases=phases,
        seed=5,
        runner=runner,
        client_optimizer_state="keep",
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=[callback])
    trainer.fit(model_cls(), datamodule=data or skewed_datamodule())
    return strategy


PENALTY_CASES = [
    (None, False),  # FedRep: head epochs on cached features, then the body epoch with nu
    (None, True),
    (FLUTE, True),  # FLUTE: joint epochs only
    (FLUTE_STAR, True),  # FLUTE*: head-only epochs around a joint one
]


@pytest.mark.parametrize(
    "phases,server_step", PENALTY_CASES, ids=["fedrep", "fedrep-server", "flute-server", "flute-star-server"]
)
def test_penalties_on_the_engine_equal_the_sequential_path(phases, server_step):
    def callback():
        return NeuralCollapse(lam=0.3, mu=0.01, nu=0.002, server_step=server_step, log_metrics=False)

    sequential = fit("sequential", phases, callback())
    vectorized = fit("vectorized", phases, callback())
    engine = vectorized.lockstep_engine
    assert engine is not None and {t.name for t in engine.loss_terms} == {"NeuralCollapse penalties"}
    assert engine.needs_features
    assert engine.split is not None and engine.caching
    assert_same(sequential, vectorized)
    # the penalties did something: without them the run ends elsewhere
    plain = fit("vectorized", phases, NeuralCollapse(lam=0, mu=0, nu=0, log_metrics=False))
    body = "body.0.weight"
    assert not torch.allclose(plain.global_tensors()[body], vectorized.global_tensors()[body], atol=1e-6)


def test_the_feature_penalty_ignores_padding_rows():
    # unequal clients have padded rows in every lockstep step: only nu touches the features
    only_nu = NeuralCollapse(lam=0.0, mu=0.0, nu=0.05, log_metrics=False)
    sequential = fit("sequential", callback=only_nu)
    vectorized = fit("vectorized", callback=NeuralCollapse(lam=0.0, mu=0.0, nu=0.05, log_metrics=False))
    assert_same(sequential, vectorized)
    no_penalty = fit("vectorized", callback=NeuralCollapse(lam=0.0, mu=0.0, nu=0.0, log_metrics=False))
    body = "body.0.weight"
    assert not torch.allclose(no_penalty.global_tensors()[body], vectorized.global_tensors()[body], atol=1e-6)


class Sharpness(FederatedCallback):
    """A callback's loss term that says it cannot run inside the lockstep runner's ``vmap``."""

    def objective(self, phase):
        def sharpness(view):
            return 0.01 * view.tensors["classifier.weight"].square().sum()

        return Objective(terms=(LossTerm(sharpness, "Sharpness term", vmappable=False),))


def test_a_callback_term_that_cannot_be_vmapped_keeps_the_run_sequential(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto", callback=Sharpness(), rounds=1)
    assert strategy.runner_report.runner == "sequential"
    assert "Sharpness term cannot run in lockstep" in caplog.text
    with pytest.raises(ValueError, match="Sharpness term cannot run in lockstep"):
        fit("vectorized", callback=Sharpness(), rounds=1)


def test_the_base_callback_adds_nothing():
    assert all(FederatedCallback().objective(phase).empty for phase in ("head", "body", "all"))


def test_feature_penalty_on_another_module_keeps_the_run_sequential(caplog):
    # phi = the input of `body` (the raw x) is not the head's input: the engine's probe sees it
    def callback():
        return NeuralCollapse(nu=0.01, features_module="body", log_metrics=False)

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        assert fit("auto", callback=callback(), rounds=1).lockstep_engine is None
    assert "takes the input of 'body' as its features, which is not the head's input" in caplog.text
    with pytest.raises(ValueError, match="takes the input of 'body' as its features"):
        fit("vectorized", callback=callback(), rounds=1)


class DroppedNet(DeclaredNet):
    """The classifier's input goes through a `drop` module first (CIFAR100CNN's layout, with dropout
    off): its features are the input of `drop`, not of the classifier."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = nn.Identity()

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_head(self, features):
        return self.classifier(self.drop(features))


def test_feature_penalty_before_the_heads_dropout_runs_on_the_engine():
    def callback():
        return NeuralCollapse(lam=0.2, mu=0.01, nu=0.01, features_module="drop", log_metrics=False)

    sequential = fit("sequential", FLUTE_STAR, callback(), model_cls=DroppedNet)
    vectorized = fit("vectorized", FLUTE_STAR, callback(), model_cls=DroppedNet)
    assert vectorized.lockstep_engine.loss_terms[0].features_of == "drop"
    assert_same(sequential, vectorized)


class ScaledOutput(LossNet):
    """Its output is not its head's output (no feature split can be found)."""

    def forward(self, x):
        return 2.0 * self.classifier(self.body(x))


def test_penalties_need_the_heads_input(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto", model_cls=ScaledOutput, rounds=1)
    assert strategy.runner_report.runner == "sequential"
    assert "loss terms that read features need the head's input" in caplog.text
    with pytest.raises(ValueError, match="loss terms that read features need the head's input"):
        fit("vectorized", model_cls=ScaledOutput, rounds=1)


def test_penalties_without_the_feature_term_need_no_feature_split():
    def callback():
        return NeuralCollapse(lam=0.3, mu=0.01, nu=0.0, log_metrics=False)

    sequential = fit("sequential", FLUTE, callback(), model_cls=ScaledOutput)
    vectorized = fit("vectorized", FLUTE, callback(), model_cls=ScaledOutput)
    engine = vectorized.lockstep_engine
    assert engine.split is None and not engine.needs_features and engine.loss_terms
    assert_same(sequential, vectorized)


class ClientScaled(FederatedCallback):
    """A callback's loss term that depends on the client and the phase: it reads a per-client table by the
    client id (a 0-dim tensor on both runners) and asks for the head's input."""

    def __init__(self):
        self.scale = torch.linspace(0.01, 0.06, len(SIZES))

    def objective(self, phase):
        scale = self.scale

        def term(view):
            assert view.features is not None and view.client.dim() == 0
            if view.mask is not None:  # lockstep: one row of the mask per row of the features
                assert view.features.shape[0] == view.mask.shape[0] and view.mask.dim() == 1
            if view.phase != "head":
                return None
            return scale[view.client] * view.tensors["classifier.weight"].square().sum()

        return Objective(
            terms=(LossTerm(term, "ClientScaled term", needs_features=True, features_of="classifier"),)
        )


def test_a_callback_term_gets_the_client_id_and_the_phase_on_both_runners():
    sequential = fit("sequential", FLUTE_STAR, ClientScaled())
    vectorized = fit("vectorized", FLUTE_STAR, ClientScaled())
    engine = vectorized.lockstep_engine
    assert isinstance(engine.loss_terms[0], LossTerm) and engine.loss_terms[0].needs_features
    assert_same(sequential, vectorized)
    plain = fit("vectorized", FLUTE_STAR, NeuralCollapse(lam=0, mu=0, nu=0, log_metrics=False))
    weight = "classifier.weight"
    assert not torch.allclose(plain.client_tensors(1)[weight], vectorized.client_tensors(1)[weight])


class RandomLooking:
    """An identity transform whose name marks it random: the engine then caches no features."""

    def __call__(self, x):
        return x

    def __repr__(self):
        return "RandomIdentity()"


class Transformed(Dataset):
    def __init__(self, data):
        self.data, self.transform = data, RandomLooking()
        self.targets = data.tensors[1]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return self.transform(x), y


def test_feature_penalty_without_a_feature_cache_uses_the_split_in_every_step():
    def data():
        return skewed_datamodule(wrap=Transformed)

    sequential = fit("sequential", data=data())
    vectorized = fit("vectorized", data=data())
    engine = vectorized.lockstep_engine
    assert engine.split is not None and not engine.caching
    assert_same(sequential, vectorized)


def test_the_vectorized_term_masks_padding_and_indexes_the_class_table():
    """The penalty term under ``vmap`` equals FLUTE's penalties written out on each client's real rows
    alone (value and gradients), with the right client's classes, and drops the feature term in head
    phases. Fails if the mask is dropped (padding rows of 100 dominate) or the table is read by position."""
    callback = NeuralCollapse(lam=0.3, mu=0.01, nu=0.05, log_metrics=False)
    callback.masks = class_masks([torch.tensor(c) for c in CLASSES], 4)

    class Run:  # what objective reads of the run: the head, to find the classifier
        split = type("Split", (), {"head": ("classifier.weight", "classifier.bias")})()

    callback.strategy = lambda trainer: None  # no Trainer here: setup keeps the stand-in below
    callback.federation = lambda trainer: Run()
    callback.setup(SimpleNamespace(lightning_module=DeclaredNet()), None, "fit")
    clients = torch.tensor([4, 0, 2])
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 4, 8, generator=g, requires_grad=True)
    features = torch.randn(3, 5, 8, generator=g)
    sizes = [5, 2, 3]
    mask = torch.stack([(torch.arange(5) < n).float() for n in sizes])
    features[mask == 0] = 100.0  # padding rows that would dominate if they counted
    features.requires_grad_(True)

    def reference(phase):  # FLUTE's penalties on the real rows, the client's own classes
        terms = []
        for k, (client, n) in enumerate(zip(clients.tolist(), sizes)):
            w = weights[k]
            value = 0.3 * nc_regularizer(w, callback.masks[client].float()) + 0.01 * w.square().sum()
            if phase != "head":
                value = value + 0.05 * features[k, :n].square().sum()
            terms.append(value)
        return torch.stack(terms)

    def vectorized(phase, ids):
        (term,) = callback.objective(phase).terms
        assert term.vmappable and term.needs_features and term.features_of == "classifier"

        def one(weight, f, m, c):
            view = StepView({"classifier.weight": weight}, {}, {}, c, phase, 0, 0, features=f, mask=m)
            return term.fn(view)

        return torch.func.vmap(one)(weights, features, mask, ids)

    for phase in ("all", "head"):
        got, want = vectorized(phase, clients), reference(phase)
        torch.testing.assert_close(got, want)
        for a, b in zip(
            torch.autograd.grad(got.sum(), (weights, features), allow_unused=True),
            torch.autograd.grad(want.sum(), (weights, features), allow_unused=True),
        ):
            assert (
                (a is None) == (b is None)
                or (a is not None and not a.any())
                or (b is not None and not b.any())
            )
            if a is not None and b is not None:
                torch.testing.assert_close(a, b)
    # the class table is read by the client id
    assert not torch.allclose(vectorized("head", torch.zeros(3, dtype=torch.long)), reference("head"))


def test_nc_regularizer_under_vmap_equals_the_batched_and_per_client_forms():
    g = torch.Generator().manual_seed(1)
    heads = torch.randn(6, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    masks = class_masks([torch.tensor(c) for c in CLASSES], 4).double()
    order = torch.tensor([3, 0, 5, 1, 4, 2])

    def one(weight, client):
        return nc_regularizer(weight, torch.index_select(masks, 0, client.reshape(1))[0])

    mapped = torch.func.vmap(one)(heads, order)
    batched = nc_regularizer(heads, masks[order])
    looped = torch.stack([nc_regularizer(heads[k], masks[c]) for k, c in enumerate(order.tolist())])
    torch.testing.assert_close(mapped, batched)
    torch.testing.assert_close(mapped, looped)
    (grad_mapped,) = torch.autograd.grad(mapped.sum(), heads)
    (grad_looped,) = torch.autograd.grad(looped.sum(), heads)
    torch.testing.assert_close(grad_mapped, grad_looped)
