"""FedProto (``lightning_fedrep.federation.algorithms.fedproto``) against a plain PyTorch loop restating PFLlib's
``clientproto.py``/``serverproto.py``: every client keeps its whole model; per batch it steps ``CE(classifier(rep),
y) + lamda * MSE(rep, T)`` (``rep = body(x)``; ``T``'s row the global prototype of the label, or ``rep.detach()``
where there is none) and collects every sample's detached ``rep`` over all its local epochs; its local prototype of
a class is their plain mean; the server's global prototype of a class is the plain mean of the round's clients'
local prototypes of it. Scoring: the nearest global prototype under MSE. Rows in the loader's shuffle order
(``tests.fixtures.client_batches``)."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import (
    DirichletPartitioner,
    FederatedDataModule,
    FederatedStrategy,
    FedProto,
    ShardPartitioner,
)
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet, LossNet
from tests.test_fedcp import NoLoss, RefuseAtStep, ScaledOutput

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, LR, LAMDA = 3, 2, 4, 3, 2, 3, 0.5, 2.0


def datamodule(batch_size=256):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _local(model, protos, batches, lamda, broken, seen):
    """One client's local work on ``model`` (in place): its local prototypes ``{class: mean}`` of the features
    collected in ``seen`` (``{class: [rows]}``, empty by the rule)."""
    optimizer = model.configure_optimizers()
    for epoch_step, (x, y) in enumerate(batches):
        rep = model.body(x)
        loss = F.cross_entropy(model.classifier(rep), y)
        target = rep.detach().clone()
        for i, label in enumerate(y.tolist()):
            if label in protos:
                target[i] = protos[label]
        pull = F.mse_loss(rep, target)
        if broken == "sum_mse":
            pull = F.mse_loss(rep, target, reduction="sum") / rep.shape[0]
        loss = loss + lamda * pull
        if broken != "first_step_only" or epoch_step == 0:
            for i, label in enumerate(y.tolist()):
                seen.setdefault(label, []).append(rep[i].detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {label: torch.stack(rows).mean(0) for label, rows in seen.items()}


def plain_fedproto(init, dm, lamda, rounds=ROUNDS, broken=""):
    """Every client's model and the global prototypes ``{class: P}`` after ``rounds`` rounds. ``broken`` plants a
    bug in the rule (the tests show each one changes the result)."""
    models = {c: copy.deepcopy(init) for c in range(NUM_CLIENTS)}
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    steps = [LOCAL_EPOCHS * math.ceil(n / dm.batch_size) for n in sizes]
    protos, kept = {}, {c: {} for c in range(NUM_CLIENTS)}
    for r in range(rounds):
        uploads = {}
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            batches = client_batches(dm, DATA_SEED, r, client, steps[client])
            seen = kept[client] if broken == "no_reset" else {}
            uploads[client] = _local(models[client], protos, batches, lamda, broken, seen)
        new = {}
        for label in sorted({k for local in uploads.values() for k in local}):
            holders = [c for c in uploads if label in uploads[c]]
            weights = [sizes[c] if broken == "weighted" else 1.0 for c in holders]
            new[label] = sum(w * uploads[c][label] for w, c in zip(weights, holders)) / sum(weights)
        protos = new
    return {c: m.state_dict() for c, m in models.items()}, protos


def fit(algorithm, runner="auto", batch_size=256, model=None, callbacks=(), rounds=ROUNDS, **strategy_args):
    torch.manual_seed(0)
    init = model or DeclaredNet(lr=LR)
    strategy_args.setdefault("head", "classifier")
    strategy_args.setdefault("seed", SEED)
    strategy_args.setdefault("local_epochs", LOCAL_EPOCHS)
    dm = datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, runner=runner, **strategy_args
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=list(callbacks)
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model


def _assert_equal(strategy, models, protos, atol=1e-6):
    server = strategy.federation.server_tensors
    has = server["has_prototype"]
    assert sorted(int(c) for c in has.nonzero()) == sorted(protos)
    for label, value in protos.items():
        torch.testing.assert_close(server["prototypes"][label], value, rtol=1e-5, atol=atol, msg=str(label))
    for client, state in models.items():
        for name, value in strategy.client_model(client).named_parameters():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=atol, msg=(client, name))


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedproto_equals_a_plain_loop(runner):
    """Golden test (full-batch clients, two local epochs, three rounds of two clients of three): every client's
    model and the global prototypes, on both runners. Nothing of the module is shared."""
    strategy, init, dm, trainer, model = fit(FedProto(lamda=LAMDA), runner=runner)
    assert strategy.runner_report.runner == runner
    assert strategy.global_tensors() == {}
    _assert_equal(strategy, *plain_fedproto(init, dm, LAMDA))


def test_the_lockstep_runner_on_padded_batches():
    """Batches of 64 (unequal step counts, zero-padded rows, idle lanes): the padded rows join neither the loss
    nor the prototypes (fails with ``one_hot(y, classes, None, ...)`` for the sums)."""
    strategy, init, dm, trainer, model = fit(FedProto(lamda=LAMDA), runner="vectorized", batch_size=64)
    assert strategy.runner_report.runner == "vectorized"
    _assert_equal(strategy, *plain_fedproto(init, dm, LAMDA), atol=1e-5)


@pytest.mark.parametrize("broken", ["sum_mse", "first_step_only", "weighted", "no_reset"])
def test_the_golden_test_sees_each_planted_bug(broken):
    """The reference with a planted bug differs from the strategy beyond the golden test's tolerance: the MSE
    summed over ``d`` (not averaged over B * d), prototypes from the first step only (not every epoch's samples),
    sample-weighted global prototypes, and a client's features of its earlier rounds kept in its prototypes
    (fails without ``start_client``'s reset)."""
    strategy, init, dm, trainer, model = fit(FedProto(lamda=LAMDA), runner="sequential")
    models, protos = plain_fedproto(init, dm, LAMDA, broken=broken)
    with pytest.raises(AssertionError):
        _assert_equal(strategy, models, protos)


def test_the_prototype_term_matters():
    """With ``lamda = 0`` the models differ: the golden test checks a term that moves the weights."""
    init = DeclaredNet(lr=LR)
    dm = datamodule()
    dm.setup()
    reference, _ = plain_fedproto(init, dm, LAMDA)
    other, _ = plain_fedproto(init, dm, 0.0)
    assert max((other[c][n] - reference[c][n]).abs().max() for c in reference for n in reference[c]) > 1e-4


def _distances(net, protos, x):
    rep = net.body(x)
    out = torch.full((x.shape[0], 4), float("inf"))
    for label, p in protos.items():
        out[:, label] = (rep - p).square().mean(1)
    return out


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_evaluation_scores_the_nearest_global_prototype(runner):
    """``strategy.client_model(c)(x)`` is ``-MSE(body_c(x), P_k)`` per class (``-inf`` without a prototype), and
    the logged test accuracy is the nearest prototype's (the head unused)."""
    strategy, init, dm, trainer, model = fit(FedProto(lamda=LAMDA), runner=runner)
    models, protos = plain_fedproto(init, dm, LAMDA)
    accuracies = []
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(models[client])
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            distance = _distances(net, protos, x)
            torch.testing.assert_close(strategy.client_model(client)(x), -distance, rtol=1e-5, atol=1e-5)
        accuracies.append((distance.argmin(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_the_official_options():
    """``own_classes=True``: distance 100 for the classes of no sample of the client's last training;
    ``scoring="head"``: the client's model as it is (the head's logits)."""
    strategy, init, dm, *_ = fit(FedProto(lamda=LAMDA, own_classes=True), runner="sequential")
    models, protos = plain_fedproto(init, dm, LAMDA)
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(models[client])
        x, _ = _xy(dm, client, "test")
        counts = strategy.federation.store.client_state(client)["proto_counts"]
        with torch.no_grad():
            distance = _distances(net, protos, x)
            distance[:, counts == 0] = 100.0
            torch.testing.assert_close(strategy.client_model(client)(x), -distance, rtol=1e-5, atol=1e-5)
    head, init, dm, *_ = fit(FedProto(lamda=LAMDA, scoring="head"), runner="sequential")
    net = copy.deepcopy(init)
    net.load_state_dict(models[1])
    x, _ = _xy(dm, 1, "test")
    with torch.no_grad():
        torch.testing.assert_close(head.client_model(1)(x), net(x), rtol=1e-5, atol=1e-5)


def test_a_forward_of_head_of_body_runs_as_the_declared_split():
    """``LossNet`` declares no split; its ``forward`` is ``classifier(body(x))``: it trains and scores bit for bit
    as ``DeclaredNet``."""
    runs = []
    for model_class in (LossNet, DeclaredNet):
        torch.manual_seed(0)
        runs.append(fit(FedProto(lamda=LAMDA), runner="sequential", model=model_class(lr=LR)))
    (detected, _, dm, *_), (declared, *_) = runs
    for name, value in declared.federation.server_tensors.items():
        assert torch.equal(detected.federation.server_tensors[name], value), name
    for client in range(NUM_CLIENTS):
        x, _ = _xy(dm, client, "test")
        with torch.no_grad():
            assert torch.equal(detected.client_model(client)(x), declared.client_model(client)(x)), client


@pytest.mark.parametrize(
    "model, message",
    [(ScaledOutput, "FedProto needs the module as head\\(features\\(x\\)\\)"), (NoLoss, "fedrep_loss")],
)
def test_a_module_fedproto_cannot_run_is_refused_at_setup(model, message):
    with pytest.raises(ValueError, match=message):
        fit(FedProto(), runner="sequential", model=model(), callbacks=[RefuseAtStep()])


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"lamda": -1.0}, "lamda"),
        ({"lamda": float("nan")}, "lamda"),
        ({"scoring": "x"}, "scoring"),
        ({"own_classes": 1}, "own_classes"),
    ],
)
def test_bad_arguments_name_themselves(arguments, name):
    with pytest.raises(ValueError, match=name):
        FedProto(**arguments)


def test_fedproto_by_name():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["fedproto"]
    assert isinstance(algorithm, FedProto) and algorithm.lamda == 1.0 and not algorithm.own_classes
    assert algorithm.shares == set() and algorithm.scoring == "prototypes"

    from lightning.pytorch.strategies import StrategyRegistry

    assert "fedproto" in StrategyRegistry and "fedproto_ddp" in StrategyRegistry


def test_fedproto_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedProto (``tests/scripts/algorithms_run.py``, every client, two rounds) on 2 processes equals the 1-process
    run: every client's model, the global prototypes (both processes' uploads in one plain mean), the validation
    accuracy scored by the nearest prototype. Fails when a process's clients are left out of the prototypes."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    single = singles["fedproto"]
    assert float(single["server"]["has_prototype"].sum()) == 4
    for held in (rank["fedproto"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held, atol=1e-6)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=1e-6, atol=1e-7)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Fit two rounds, save, resume to three: the global prototypes and every client's model equal the three-round
    run's."""
    full = fit(FedProto(lamda=LAMDA), runner="sequential")[0]
    trainer = fit(FedProto(lamda=LAMDA), runner="sequential", rounds=2)[3]
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=FedProto(lamda=LAMDA),
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
    for client in range(NUM_CLIENTS):
        for (name, value), (_, resumed) in zip(
            full.client_model(client).named_parameters(), strategy.client_model(client).named_parameters()
        ):
            torch.testing.assert_close(resumed, value, rtol=0, atol=0, msg=(client, name))


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_class_without_a_prototype_is_ruled_out_and_its_samples_still_scored(runner):
    """Under partial participation a round's clients may hold no sample of a class, which then has no global
    prototype (score -inf, as PFLlib's distance inf): every test sample is still scored by its nearest existing
    prototype, so each client's accuracy is a number (not NaN) equal to that rule's; the loss of a sample whose
    class has no prototype is +inf."""
    train, test = tiny_datasets(seed=DATA_SEED)
    dm = FederatedDataModule(train, test, partitioner=ShardPartitioner(4, 2), batch_size=256, seed=DATA_SEED)
    strategy = FederatedStrategy(
        algorithm=FedProto(lamda=LAMDA), clients_per_round=1, runner=runner, head="classifier", seed=SEED
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    model = DeclaredNet(lr=LR)
    trainer.fit(model, datamodule=dm)
    has = strategy.federation.server_tensors["has_prototype"]
    assert 0 < int(has.sum()) < len(has)
    accuracies = []
    for client in range(4):
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            scores = strategy.client_model(client)(x)
        assert torch.isneginf(scores[:, has == 0]).all() and torch.isfinite(scores[:, has > 0]).all()
        nearest = has.nonzero()[:, 0][scores[:, has > 0].argmax(1)]  # the nearest existing prototype's class
        accuracies.append((nearest == y).double().mean().item())
        if not bool(has[y].all()):
            assert math.isinf(F.cross_entropy(scores, y).item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert math.isfinite(metrics["test/acc"])
    assert abs(metrics["test/acc"] - sum(accuracies) / 4) < 1e-6
