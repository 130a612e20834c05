"""FedDBE (``lightning_fedrep.federation.algorithms.feddbe``) against a plain PyTorch loop restating the rule of
the authors' ``clientDBE.py``/``serverDBE.py`` (github.com/TsingZ0/DBE; PFLlib's ``clientdbe.py``): an
initialization pass (every client trains ``CE(classifier(body(x)), y)`` from the initial model, tracking the
running mean ``r`` of its features; ``r_bar`` is the clients' sample-weighted mean ``r``; the trained weights are
thrown away), then rounds in which each sampled client, per batch, sets ``r = (1 - m) r.detach() + m
mean(body(x))`` (``r`` reset to 0 at its round start) and steps ``CE(classifier(body(x) + b), y) + kappa
mean(0.5 (r - r_bar)^2)``: the module's optimizer the model, plain SGD the bias ``b``; the server takes the
sample-weighted mean of the whole model. Rows in the loader's shuffle order (``tests.fixtures.client_batches``)."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FedDBE, FederatedDataModule, FederatedStrategy
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet, LossNet
from tests.test_fedcp import NoLoss, RefuseAtStep, ScaledOutput

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, D, LR = 3, 2, 4, 3, 2, 3, 8, 0.5
MOMENTUM, KAPPA = 0.5, 5.0


def datamodule(batch_size=256):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _local(init, w, bias, r_bar, batches, m, kappa, dbe, broken="", running=None):
    """One client's local work: the trained weights, its final running mean and bias (``running``: the running
    mean it starts from, 0 by the rule)."""
    model = copy.deepcopy(init)
    model.load_state_dict(w)
    optimizer = model.configure_optimizers()
    lr = optimizer.param_groups[0]["lr"]
    b = bias.clone().requires_grad_(True)
    running = torch.zeros(D) if running is None else running
    for x, y in batches:
        rep = model.body(x)
        running = (1 - m) * running + m * rep.mean(0)
        if dbe:
            loss = F.cross_entropy(model.classifier(rep + b), y)
            loss = loss + kappa * torch.mean(0.5 * (running - r_bar) ** 2)
        else:
            loss = F.cross_entropy(model.classifier(rep + b if broken == "bias_in_pass" else rep), y)
        optimizer.zero_grad()
        b.grad = None
        loss.backward()
        optimizer.step()
        if b.grad is not None:
            with torch.no_grad():
                b -= lr * b.grad
        running = running.detach()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, running, b.detach()


def plain_feddbe(init, dm, m, kappa, rounds=ROUNDS, broken=""):
    """The global model, every client's bias and ``r_bar`` after ``rounds`` rounds (the first one the
    initialization pass). ``broken`` plants a bug in the rule (the tests show each one changes the result)."""
    w = {n: t.detach().clone() for n, t in init.state_dict().items()}
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    steps = [LOCAL_EPOCHS * math.ceil(n / dm.batch_size) for n in sizes]
    biases = {c: torch.zeros(D) for c in range(NUM_CLIENTS)}
    runs, kept = {}, {}
    for client in range(NUM_CLIENTS):  # the initialization pass: round 0, every client, no DBE
        batches = client_batches(dm, DATA_SEED, 0, client, steps[client])
        kept[client], runs[client], biases[client] = _local(
            init, w, biases[client], None, batches, m, kappa, False, broken
        )
    weights = [1.0] * NUM_CLIENTS if broken == "uniform_r_bar" else sizes
    r_bar = sum(wc * runs[c] for c, wc in enumerate(weights)) / sum(weights)
    if broken == "keep_pass_weights":
        w = {n: sum(sizes[c] * kept[c][n] for c in kept) / sum(sizes) for n in w}
    for r in range(1, rounds):
        sums, total = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            batches = client_batches(dm, DATA_SEED, r, client, steps[client])
            start = runs[client] if broken == "no_reset" else None
            trained, runs[client], biases[client] = _local(
                init, w, biases[client], r_bar, batches, m, kappa, True, broken, start
            )
            for n in sums:
                sums[n] += sizes[client] * trained[n]
            total += sizes[client]
        w = {n: t / total for n, t in sums.items()}
    return w, biases, r_bar


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


def _assert_equal(strategy, w, biases, r_bar, atol=1e-6):
    got = strategy.global_tensors()
    for name, value in w.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=atol, msg=name)
    server = strategy.federation.server_tensors
    torch.testing.assert_close(server["global_mean"], r_bar, rtol=1e-5, atol=atol)
    assert float(server["initialized"]) == 1.0
    for client, bias in biases.items():
        state = strategy.federation.store.client_state(client)
        torch.testing.assert_close(state["bias"], bias, rtol=1e-5, atol=atol, msg=str(client))


@pytest.mark.parametrize("m, kappa", [(0.1, 0.0), (MOMENTUM, KAPPA)])
def test_feddbe_equals_a_plain_loop(m, kappa):
    """Golden test (full-batch clients, two local epochs; the initialization pass on all three clients, then two
    rounds of two): the global model, ``r_bar`` and every client's bias, with PFLlib's defaults (``kappa=0``) and
    with the regularizer on. Fails if the pass aggregates the model or samples only the round's clients, if ``r``
    is not reset at a client's round start (no ``start_client``; with ``kappa > 0``), or if the bias trains in the
    pass (each checked by planting it in the module)."""
    strategy, init, dm, trainer, model = fit(FedDBE(momentum=m, kappa=kappa), runner="sequential")
    expected = plain_feddbe(init, dm, m, kappa)
    assert sum(bool((b != 0).any()) for b in expected[1].values()) >= 2  # the biases trained
    assert strategy.round_plan(0).clients == list(range(NUM_CLIENTS))  # planned again: still every client
    assert [len(strategy.round_plan(r).clients) for r in (1, 2)] == [PER_ROUND, PER_ROUND]
    _assert_equal(strategy, *expected)


@pytest.mark.parametrize("broken", ["uniform_r_bar", "keep_pass_weights", "no_reset", "bias_in_pass"])
def test_the_golden_test_sees_each_planted_bug(broken):
    """The reference with a planted bug differs from the strategy beyond the golden test's tolerance: an unweighted
    ``r_bar``, the initialization pass's weights kept as the first global model, ``r`` carried over from the
    client's previous round (no reset), the bias trained in the initialization pass."""
    strategy, init, dm, trainer, model = fit(FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="sequential")
    w, biases, r_bar = plain_feddbe(init, dm, MOMENTUM, KAPPA, broken=broken)
    with pytest.raises(AssertionError):
        _assert_equal(strategy, w, biases, r_bar)


def test_the_regularizer_and_the_momentum_matter():
    """With ``kappa > 0`` the model differs from ``kappa = 0`` and from another ``momentum``: the golden test with
    the regularizer on checks a term that moves the weights."""
    init = DeclaredNet(lr=LR)
    dm = datamodule()
    dm.setup()
    reference = plain_feddbe(init, dm, MOMENTUM, KAPPA)[0]
    for m, kappa in ((MOMENTUM, 0.0), (0.1, KAPPA)):
        other = plain_feddbe(init, dm, m, kappa)[0]
        assert max((other[n] - reference[n]).abs().max() for n in reference) > 1e-4


def test_the_initialization_pass_keeps_the_initial_model():
    """After the first round (the initialization pass on every client, though two of three are sampled per round):
    the global model is the initial one, the biases are 0, ``r_bar`` is the plain loop's. Fails if the pass
    aggregates the model or samples two clients."""
    strategy, init, dm, trainer, model = fit(
        FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="sequential", rounds=1
    )
    assert strategy.round_plan(0).clients == list(range(NUM_CLIENTS))
    w, biases, r_bar = plain_feddbe(init, dm, MOMENTUM, KAPPA, rounds=1)
    for name, value in init.state_dict().items():
        assert torch.equal(strategy.global_tensors()[name], value), name
    _assert_equal(strategy, w, biases, r_bar)
    assert all(not b.any() for b in biases.values()) and r_bar.abs().max() > 1e-3


def test_the_lockstep_runner_equals_the_plain_loop():
    """The rule inside the lockstep runner's ``vmap`` on zero-padded batches of 64 (unequal step counts, idle
    lanes), with the regularizer. Fails if the running mean averages over the padded rows (``rep.mean(0)``)."""
    strategy, init, dm, trainer, model = fit(
        FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="vectorized", batch_size=64
    )
    assert strategy.runner_report.runner == "vectorized"
    _assert_equal(strategy, *plain_feddbe(init, dm, MOMENTUM, KAPPA), atol=1e-5)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_evaluation_scores_the_global_model_with_the_client_bias(runner):
    """``strategy.client_model(c)(x)`` and the logged test accuracy are ``classifier(body(x) + b_c)`` with the
    global model. Fails if evaluation drops the bias (``return module.forward_head(rep)``)."""
    strategy, init, dm, trainer, model = fit(FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner=runner)
    w, biases, _ = plain_feddbe(init, dm, MOMENTUM, KAPPA)
    net = copy.deepcopy(init)
    net.load_state_dict(w)
    accuracies = []
    for client in range(NUM_CLIENTS):
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            logits = net.classifier(net.body(x) + biases[client])
            torch.testing.assert_close(strategy.client_model(client)(x), logits, rtol=1e-5, atol=1e-5)
        accuracies.append((logits.argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_a_forward_of_head_of_body_runs_as_the_declared_split():
    """``LossNet`` declares no split; its ``forward`` is ``classifier(body(x))``, found as the vectorized runner
    finds it: it trains and scores bit for bit as ``DeclaredNet``."""
    runs = []
    for model_class in (LossNet, DeclaredNet):
        torch.manual_seed(0)
        runs.append(
            fit(FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="sequential", model=model_class(lr=LR))
        )
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
        (ScaledOutput, "FedDBE needs the module as head\\(features\\(x\\)\\)"),
        (NoLoss, "fedrep_loss"),
    ],
)
def test_a_module_feddbe_cannot_run_is_refused_at_setup(model, message):
    with pytest.raises(ValueError, match=message):
        fit(FedDBE(), runner="sequential", model=model(), callbacks=[RefuseAtStep()])


@pytest.mark.parametrize(
    "arguments", [{"momentum": -0.1}, {"momentum": 1.5}, {"kappa": -1.0}, {"kappa": float("nan")}]
)
def test_bad_arguments_name_themselves(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        FedDBE(**arguments)


def test_feddbe_by_name():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["feddbe"]
    assert isinstance(algorithm, FedDBE) and (algorithm.momentum, algorithm.kappa) == (0.1, 0.0)
    assert algorithm.shares == {"body", "head"}


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Fit two rounds (the initialization pass and one FedDBE round), save, resume to three: the global model,
    ``r_bar``, the initialization flag and every client's bias equal the three-round run's. Fails if the resumed
    run plans its first round as an initialization pass again (the flag not checkpointed)."""
    full = fit(FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="sequential")[0]
    trainer = fit(FedDBE(momentum=MOMENTUM, kappa=KAPPA), runner="sequential", rounds=2)[3]
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=FedDBE(momentum=MOMENTUM, kappa=KAPPA),
        clients_per_round=PER_ROUND,
        local_epochs=LOCAL_EPOCHS,
        head="classifier",
        seed=SEED,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        DeclaredNet(lr=LR), datamodule=datamodule(), ckpt_path=path
    )
    assert strategy.round_plan(2).clients == full.round_plan(2).clients
    for name, value in full.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)
    for client in range(NUM_CLIENTS):
        torch.testing.assert_close(
            strategy.federation.store.client_state(client)["bias"],
            full.federation.store.client_state(client)["bias"],
            rtol=0,
            atol=0,
        )


def test_feddbe_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedDBE (``tests/scripts/algorithms_run.py``: ``momentum=0.5, kappa=5``, the initialization pass and one
    round, every client) on 2 processes equals the 1-process run: the global model, ``r_bar`` (the running means
    of both processes' clients in one weighted mean), every client's bias and running mean, the validation
    accuracy scored through FedDBE's forward. Fails when a process's clients are left out of ``r_bar``."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    single = singles["feddbe"]
    assert float(single["server"]["initialized"]) == 1.0 and single["server"]["global_mean"].abs().max() > 0
    for held in (rank["feddbe"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held, atol=1e-6)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=1e-6, atol=1e-7)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)
