"""GPFL (``lightning_fedrep.federation.algorithms.gpfl``) against a plain PyTorch loop restating the rule of the
authors' ``clientgp.py``/``servergp.py`` (github.com/TsingZ0/GPFL; PFLlib's ``clientgpfl.py``/``servergpfl.py``):
``nn.Embedding`` GCE and ``nn.Module`` CoV objects per client, each sampled client training ``CE(classifier(CoV(f,
p)), y) + GCE_loss(CoV(f, g), y) + lamda ||CoV(f, g) - E_frozen[y]||`` with the module's optimizer for the model and
``SGD(lr, weight_decay=mu)`` for its GCE and CoV; the server averages the bodies, GCEs and CoVs (sample-weighted), then
``set_GCE`` on every client (conditional inputs from the client's own GCE, then the global one copied in) and
``set_CoV``. Rows in the loader's shuffle order (``tests.fixtures.client_batches``); the initial GCE and CoV are the
strategy's (read at fit start)."""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import GPFL, DirichletPartitioner, FederatedDataModule, FederatedStrategy
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet, LossNet
from tests.test_fedcp import NoLoss, RefuseAtStep, ScaledOutput

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, D, C, LR = 3, 2, 0, 3, 2, 3, 8, 4, 0.5
LAMDA, MU = 0.5, 0.1


def datamodule(batch_size=256):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


class Start(Callback):
    """Keeps the strategy's server tensors at fit start (the initial GCE and CoV)."""

    def on_train_start(self, trainer, module):
        self.server = {n: t.clone() for n, t in trainer.strategy.federation.server_tensors.items()}


class CoV(nn.Module):
    """The authors' conditional valve."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))
        self.beta = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))

    def forward(self, x, context):
        return F.relu(x * (self.gamma(context) + 1) + self.beta(context))


def gce_loss(embedding, x, y):
    cosine = F.linear(F.normalize(x), F.normalize(embedding.weight))
    one_hot = F.one_hot(y, C).float()
    return -torch.mean(torch.sum(one_hot * F.log_softmax(cosine, dim=1), dim=1))


def initial_modules(server):
    gce = nn.Embedding(C, D)
    cov = CoV(D)
    with torch.no_grad():
        gce.weight.copy_(server["gce"])
        for branch in ("gamma", "beta"):
            layers = getattr(cov, branch)
            for key, tensor in (("weight", layers[0].weight), ("bias", layers[0].bias)):
                tensor.copy_(server[f"cov.{branch}.{key}"])
                getattr(layers[2], key).copy_(server[f"cov.{branch}.norm.{key}"])
    return gce, cov


def _mean(modules, sizes):
    """The sample-weighted mean of ``modules``' state dicts."""
    total = sum(sizes)
    keys = modules[0].state_dict()
    return {k: sum(s * m.state_dict()[k] for m, s in zip(modules, sizes)) / total for k in keys}


class Client:
    """One client of the authors' code: its model, GCE, CoV, frozen GCE, conditional inputs and prior."""

    def __init__(self, init, gce, cov, labels):
        self.model, self.gce, self.cov = copy.deepcopy(init), copy.deepcopy(gce), copy.deepcopy(cov)
        self.frozen = copy.deepcopy(gce)
        self.generic, self.personal = torch.zeros(D), torch.zeros(D)
        counts = torch.bincount(labels, minlength=C).float()
        self.prior = counts / counts.sum()

    def train(self, batches, lamda, mu, broken=""):
        optimizer = self.model.configure_optimizers()
        lr = optimizer.param_groups[0]["lr"]
        decay = 0.0 if broken == "no_weight_decay" else mu
        gce_opt = torch.optim.SGD(self.gce.parameters(), lr=lr, weight_decay=decay)
        cov_opt = torch.optim.SGD(self.cov.parameters(), lr=lr, weight_decay=decay)
        for x, y in batches:
            feat = self.model.body(x)
            loss = F.cross_entropy(self.model.classifier(self.cov(feat, self.personal)), y)
            feat_g = self.cov(feat, self.generic)
            loss = loss + gce_loss(self.gce, feat_g, y)
            target = (self.gce if broken == "trained_target" else self.frozen).weight[y].detach()
            gap = torch.norm(feat_g - target, 2)
            loss = loss + lamda * (gap**2 if broken == "squared_norm" else gap)
            for opt in (optimizer, gce_opt, cov_opt):
                opt.zero_grad()
            loss.backward()
            for opt in (optimizer, gce_opt, cov_opt):
                opt.step()

    def set_gce(self, gce, broken=""):
        source = gce.weight if broken == "global_source" else self.gce.weight
        with torch.no_grad():
            self.generic = source.mean(0).detach().clone()
            self.personal = (self.prior @ source).detach().clone()
        self.gce.load_state_dict(gce.state_dict())
        self.frozen = copy.deepcopy(self.gce)

    def predict(self, x):
        with torch.no_grad():
            return self.model.classifier(self.cov(self.model.body(x), self.personal))


def plain_gpfl(init, dm, server, lamda, mu, rounds=ROUNDS, broken=""):
    """Every client of the authors' loop after ``rounds`` rounds, and the global GCE and CoV. ``broken`` plants a bug
    in the rule (the tests show each one changes the result)."""
    gce, cov = initial_modules(server)
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    steps = [LOCAL_EPOCHS * math.ceil(n / dm.batch_size) for n in sizes]
    clients = [Client(init, gce, cov, _xy(dm, c)[1]) for c in range(NUM_CLIENTS)]
    if broken == "prior_inputs_in_round_0":
        for client in clients:
            client.set_gce(gce)
    body = {n: t.clone() for n, t in init.body.state_dict().items()}
    for r in range(rounds):
        selected = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)
        for c in selected:
            clients[c].model.body.load_state_dict(body)
            clients[c].train(client_batches(dm, DATA_SEED, r, c, steps[c]), lamda, mu, broken)
        weights = [1.0] * len(selected) if broken == "uniform" else [sizes[c] for c in selected]
        body = _mean([clients[c].model.body for c in selected], weights)
        gce.load_state_dict(_mean([clients[c].gce for c in selected], weights))
        cov.load_state_dict(_mean([clients[c].cov for c in selected], weights))
        for client in clients:
            client.model.body.load_state_dict(body)
            client.set_gce(gce, broken)
            client.cov.load_state_dict(cov.state_dict())
    return clients, gce, cov


def fit(algorithm, runner="auto", batch_size=256, model=None, callbacks=(), rounds=ROUNDS, **strategy_args):
    torch.manual_seed(0)
    init = model or DeclaredNet(lr=LR)
    strategy_args.setdefault("head", "classifier")
    strategy_args.setdefault("seed", SEED)
    strategy_args.setdefault("local_epochs", LOCAL_EPOCHS)
    dm = datamodule(batch_size)
    start = Start()
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, runner=runner, **strategy_args
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=[start, *callbacks]
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model, start.server


def _assert_equal(strategy, clients, gce, cov, atol=1e-6):
    close = dict(rtol=1e-5, atol=atol)
    got = strategy.global_tensors()
    for name, value in clients[0].model.body.state_dict().items():
        torch.testing.assert_close(got[f"body.{name}"], value, **close, msg=name)
    server = strategy.federation.server_tensors
    torch.testing.assert_close(server["gce"], gce.weight.detach(), **close)
    for branch in ("gamma", "beta"):
        layers = getattr(cov, branch)
        torch.testing.assert_close(server[f"cov.{branch}.weight"], layers[0].weight.detach(), **close)
        torch.testing.assert_close(server[f"cov.{branch}.norm.bias"], layers[2].bias.detach(), **close)
    for c, client in enumerate(clients):
        state = strategy.federation.store.client_state(c)
        source = state["conditional_source"]
        torch.testing.assert_close(source.mean(0), client.generic, **close, msg=f"g of {c}")
        if state["prior"].sum() > 0:  # a client that trained: its own prior and head
            torch.testing.assert_close(state["prior"], client.prior, **close, msg=f"prior of {c}")
            torch.testing.assert_close(state["prior"] @ source, client.personal, **close, msg=f"p of {c}")
            head = strategy.client_model(c).classifier
            torch.testing.assert_close(
                head.weight, client.model.classifier.weight, **close, msg=f"head of {c}"
            )


def _trained_clients(rounds):
    return sorted({c for r in range(rounds) for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)})


def test_gpfl_equals_a_plain_loop():
    """Golden test (full-batch clients, two local epochs, two of three clients per round, three rounds): the global
    body, GCE and CoV, every client's conditional inputs, prior and head. The client left out of the first round
    trains later from the template (its inputs from the previous global GCE)."""
    assert _trained_clients(1) != _trained_clients(ROUNDS) == list(range(NUM_CLIENTS))
    strategy, init, dm, trainer, model, server = fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential")
    _assert_equal(strategy, *plain_gpfl(init, dm, server, LAMDA, MU))


@pytest.mark.parametrize(
    "broken",
    [
        "global_source",
        "prior_inputs_in_round_0",
        "squared_norm",
        "trained_target",
        "no_weight_decay",
        "uniform",
    ],
)
def test_the_golden_test_sees_each_planted_bug(broken):
    """The reference with a planted bug differs from the strategy beyond the golden test's tolerance: conditional
    inputs from the new global GCE (not the client's own), nonzero inputs in the first round, a squared norm, the
    distance to the client's trained GCE (not the frozen round-start one), no weight decay on the GCE and CoV, an
    unweighted server mean."""
    strategy, init, dm, trainer, model, server = fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential")
    with pytest.raises(AssertionError):
        _assert_equal(strategy, *plain_gpfl(init, dm, server, LAMDA, MU, broken=broken))


def test_the_lockstep_runner_equals_the_plain_loop():
    """The rule inside the lockstep runner's ``vmap`` on zero-padded batches of 64 (unequal step counts, idle
    lanes). Fails if the padded rows enter the norm or the means."""
    strategy, init, dm, trainer, model, server = fit(
        GPFL(lamda=LAMDA, mu=MU), runner="vectorized", batch_size=64
    )
    assert strategy.runner_report.runner == "vectorized"
    _assert_equal(strategy, *plain_gpfl(init, dm, server, LAMDA, MU), atol=1e-5)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_evaluation_scores_the_head_on_the_personalized_feature(runner):
    """``strategy.client_model(c)(x)`` and the logged test accuracy are ``classifier(CoV(body(x), p_c))`` with the
    global body and CoV. Fails if evaluation scores the plain model or the generic input."""
    strategy, init, dm, trainer, model, server = fit(GPFL(lamda=LAMDA, mu=MU), runner=runner)
    clients = plain_gpfl(init, dm, server, LAMDA, MU)[0]
    accuracies = []
    for c, client in enumerate(clients):
        x, y = _xy(dm, c, "test")
        logits = client.predict(x)
        with torch.no_grad():
            torch.testing.assert_close(strategy.client_model(c)(x), logits, rtol=1e-5, atol=1e-5)
        accuracies.append((logits.argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_a_client_that_never_trained_is_scored_with_the_generic_input():
    """After one round the client left out has no prior yet (the store's shared template): it is scored with the
    initial head on ``CoV(body(x), g)``, ``g`` the initial GCE's mean (the documented deviation: the authors use its
    own prior)."""
    strategy, init, dm, trainer, model, server = fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential", rounds=1)
    (left_out,) = set(range(NUM_CLIENTS)) - set(_trained_clients(1))
    clients, gce, cov = plain_gpfl(init, dm, server, LAMDA, MU, rounds=1)
    client = clients[left_out]
    torch.testing.assert_close(client.generic, server["gce"].mean(0))
    x, _ = _xy(dm, left_out, "test")
    with torch.no_grad():
        expected = client.model.classifier(client.cov(client.model.body(x), client.generic))
        torch.testing.assert_close(strategy.client_model(left_out)(x), expected, rtol=1e-5, atol=1e-5)


def test_the_initial_modules_are_nn_defaults_drawn_from_the_strategy_seed():
    """The GCE starts ``N(0, 1)`` (``nn.Embedding``), the CoV's linear layers ``U(-1/sqrt(d), 1/sqrt(d))``
    (``nn.Linear``), its norms ones and zeros; another seed draws others."""
    server = fit(GPFL(), runner="sequential", rounds=1)[-1]
    other = fit(GPFL(), runner="sequential", rounds=1, seed=SEED + 1)[-1]
    assert server["gce"].shape == (C, D) and 0.5 < float(server["gce"].std()) < 1.5
    bound = 1 / math.sqrt(D)
    for key in ("gamma.weight", "gamma.bias", "beta.weight", "beta.bias"):
        value = server[f"cov.{key}"]
        assert value.abs().max() <= bound and value.abs().max() > 0.5 * bound, key
        assert not torch.equal(other[f"cov.{key}"], value)
    torch.testing.assert_close(server["cov.gamma.norm.weight"], torch.ones(D))
    torch.testing.assert_close(server["cov.beta.norm.bias"], torch.zeros(D))
    assert not torch.equal(other["gce"], server["gce"])


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Fit two rounds, save, resume to three: the server tensors and every client's declared tensors equal the
    three-round run's (the conditional sources and priors checkpointed)."""
    full = fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential")[0]
    trainer = fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential", rounds=2)[3]
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=GPFL(lamda=LAMDA, mu=MU),
        clients_per_round=PER_ROUND,
        local_epochs=LOCAL_EPOCHS,
        head="classifier",
        seed=SEED,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        DeclaredNet(lr=LR), datamodule=datamodule(), ckpt_path=path
    )
    for name, value in full.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for c in range(NUM_CLIENTS):
        mine, theirs = strategy.federation.store.client_state(c), full.federation.store.client_state(c)
        for name in ("conditional_source", "prior", "fresh"):
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=f"{name} of {c}")


def test_a_forward_of_head_of_body_runs_as_the_declared_split():
    """``LossNet`` declares no split; its ``forward`` is ``classifier(body(x))``: it trains and scores bit for bit as
    ``DeclaredNet``."""
    runs = []
    for model_class in (LossNet, DeclaredNet):
        torch.manual_seed(0)
        runs.append(fit(GPFL(lamda=LAMDA, mu=MU), runner="sequential", model=model_class(lr=LR)))
    (detected, _, dm, *_), (declared, *_) = runs
    for name, value in declared.global_tensors().items():
        assert torch.equal(detected.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        x, _ = _xy(dm, client, "test")
        with torch.no_grad():
            assert torch.equal(detected.client_model(client)(x), declared.client_model(client)(x)), client


@pytest.mark.parametrize(
    "model, message",
    [
        (ScaledOutput, "GPFL needs the module as head\\(features\\(x\\)\\)"),
        (NoLoss, "fedrep_loss"),
    ],
)
def test_a_module_gpfl_cannot_run_is_refused_at_setup(model, message):
    with pytest.raises(ValueError, match=message):
        fit(GPFL(), runner="sequential", model=model(), callbacks=[RefuseAtStep()])


@pytest.mark.parametrize("arguments", [{"lamda": -0.1}, {"mu": -1.0}, {"lamda": float("nan")}])
def test_bad_arguments_name_themselves(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        GPFL(**arguments)


def test_gpfl_by_name():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["gpfl"]
    assert isinstance(algorithm, GPFL) and (algorithm.lamda, algorithm.mu) == (0.01, 0.1)
    assert algorithm.shares == {"body"}


def test_gpfl_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """GPFL (``tests/scripts/algorithms_run.py``: ``lamda=0.5, mu=0.1``, two rounds, every client) on 2 processes
    equals the 1-process run: the global body, GCE and CoV (both processes' uploads in one weighted mean), every
    client's declared tensors (the server step's client map applied on the process holding the client), the
    validation accuracy scored through GPFL's forward."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    single = singles["gpfl"]
    assert single["server"]["gce"].abs().max() > 0
    assert all(float(t["prior"].sum()) > 0 for t in single["declared"].values())
    for held in (rank["gpfl"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held, atol=1e-6)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=1e-6, atol=1e-7)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)


def test_sample_level_dp_is_refused_naming_the_step_rule():
    """Sample-level DP computes every local step as DP-SGD: GPFL's step rule is refused, naming it (its start would
    also read the client's labels outside the accounting)."""
    from lightning_fedrep.privacy import SampleLevelDP

    privacy = SampleLevelDP(clip=1.0, noise_multiplier=1.0, accountant=None)
    with pytest.raises(ValueError, match="SampleLevelDP.*step rule 'GPFL"):
        fit(GPFL(), runner="sequential", rounds=1, weighting="uniform", privacy=privacy)


class ThreeClasses(DeclaredNet):
    """A head of 3 outputs on 4-class data."""

    def __init__(self):
        super().__init__(lr=LR)
        self.classifier = nn.Linear(8, 3)


def test_labels_the_head_cannot_embed_are_refused_before_a_step():
    """The strategy's label check refuses them at set-up; without it (``headline_metrics=False``) GPFL's count of the
    client's labels does, at the client's start (before its first step)."""
    with pytest.raises(ValueError, match="has label 3, but the model outputs 3 classes"):
        fit(GPFL(), runner="sequential", model=ThreeClasses(), callbacks=[RefuseAtStep()])
    with pytest.raises(ValueError, match="GPFL embeds the head's 3 classes.*labels outside 0..2"):
        fit(GPFL(), runner="sequential", model=ThreeClasses(), headline_metrics=False)
