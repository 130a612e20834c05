"""FedPAC (``lightning_fedrep.federation.algorithms.fedpac``) against a plain PyTorch loop restating the rule of
PFLlib's ``clientpac.py``/``serverpac.py`` with the intended semantics (heads keyed by client id, snapshots): a
client receives the global body and its combined head, computes ``V_i``/``H_i`` on the new body, trains its head
alone for one epoch, then its body for ``local_epochs`` with ``CE + lamda * MSE(rep, T)`` (T: the global prototypes),
and uploads its local prototypes (evaluation mode); the server averages bodies (sample-weighted), takes plain means
of prototypes over the clients holding a class, and combines heads with ``alpha = argmin a^T (diag(V) + D_i) a`` on
the simplex, solved here in closed form for two clients (the library solves it with scipy)."""

import copy
import itertools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FederatedDataModule, FederatedStrategy, FedPAC
from lightning_fedrep.federation.algorithms.fedpac import head_weights
from tests.fixtures import quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet, LossNet
from tests.test_fedcp import NoLoss, RefuseAtStep, ScaledOutput

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, LR, LAMDA = 3, 2, 4, 3, 2, 3, 0.5, 2.0
BODY = ("body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias")
HEAD = ("classifier.weight", "classifier.bias")


def datamodule(batch_size=256):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def net():
    return DeclaredNet(lr=LR, momentum=0.0)


def statistics(model, x, y):
    """``(V, H)`` of PFLlib's ``statistics_extraction`` on every sample."""
    with torch.no_grad():
        f = model.body(x).double()
    v, h = 0.0, torch.zeros(4, f.shape[1], dtype=torch.float64)
    for k in range(4):
        fk = f[y == k]
        if len(fk) == 0:
            continue
        pi, mu = len(fk) / len(f), fk.mean(0)
        h[k] = pi * mu
        v += pi * torch.trace(fk.T @ fk / len(fk)) - pi**2 * (mu * mu).sum()
    return v / len(x), h


def two_client_weights(p, renormalize=True):
    """The simplex QP ``min a^T p a`` for two clients, in closed form, small weights zeroed."""
    a = float(np.clip((p[1, 1] - p[0, 1]) / (p[0, 0] + p[1, 1] - 2 * p[0, 1]), 0.0, 1.0))
    alpha = torch.tensor([a, 1 - a], dtype=torch.float64)
    alpha = torch.where(alpha > 1e-3, alpha, torch.zeros_like(alpha))
    return alpha / alpha.sum() if renormalize else alpha


def _client(model, body, head, protos, x, y, lamda, broken):
    model.load_state_dict({**body, **head}, strict=False)
    v, h = statistics(model, x, y)
    for p in model.body.parameters():
        p.requires_grad_(False)
    optimizer = model.configure_optimizers()
    for _ in range(LOCAL_EPOCHS if broken == "head_epochs" else 1):
        loss = F.cross_entropy(model.classifier(model.body(x)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for p in model.parameters():
        p.requires_grad_(True)
    for p in model.classifier.parameters():
        p.requires_grad_(False)
    optimizer = model.configure_optimizers()
    for _ in range(LOCAL_EPOCHS):
        rep = model.body(x)
        target = rep.detach().clone()
        for i, label in enumerate(y.tolist()):
            if label in protos:
                target[i] = protos[label]
        loss = F.cross_entropy(model.classifier(rep), y) + lamda * F.mse_loss(rep, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    model.eval()
    with torch.no_grad():
        f = model.body(x)
    local = {k: f[y == k].mean(0) for k in y.unique().tolist()}
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return state, v, h, local


def plain_fedpac(init, dm, lamda=LAMDA, rounds=ROUNDS, renormalize=True, broken="", counts=False):
    """The global body, every client's combined head and the global prototypes after ``rounds`` rounds."""
    state = init.state_dict()
    body = {n: state[n].clone() for n in BODY}
    heads = {c: {n: state[n].clone() for n in HEAD} for c in range(NUM_CLIENTS)}
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    protos, previous = {}, body
    for r in range(rounds):
        clients = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)
        up = {}
        for c in clients:
            x, y = _xy(dm, c)
            stats_body = previous if broken == "stale_statistics" else body
            up[c] = _client(copy.deepcopy(init), body, heads[c], protos, x, y, lamda, broken)
            if broken == "stale_statistics":
                probe = copy.deepcopy(init)
                probe.load_state_dict({**stats_body, **heads[c]}, strict=False)
                up[c] = (up[c][0], *statistics(probe, x, y), up[c][3])
        previous = body
        total = sum(sizes[c] for c in clients)
        body = {n: sum(sizes[c] * up[c][0][n] for c in clients) / total for n in BODY}
        protos = {}
        for k in sorted({k for c in clients for k in up[c][3]}):
            holders = [c for c in clients if k in up[c][3]]
            weight = {c: float((_xy(dm, c)[1] == k).sum()) if counts else 1.0 for c in holders}
            protos[k] = sum(weight[c] * up[c][3][k] for c in holders) / sum(weight.values())
        v = torch.tensor([float(up[c][1]) for c in clients], dtype=torch.float64)
        hs = torch.stack([up[c][2] for c in clients])
        order = clients[::-1] if broken == "upload_order" else clients
        for i, c in enumerate(clients):
            gaps = (hs[i][None] - hs).reshape(len(clients), -1)
            alpha = two_client_weights(torch.diag(v) + gaps @ gaps.T, renormalize)
            heads[c] = {n: sum(a * up[j][0][n].double() for a, j in zip(alpha, order)).float() for n in HEAD}
    return body, heads, protos


def fit(algorithm, runner="auto", batch_size=256, model=None, callbacks=(), rounds=ROUNDS, **strategy_args):
    torch.manual_seed(0)
    init = model or net()
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


def _assert_equal(strategy, body, heads, protos, atol=1e-5):
    got = strategy.global_tensors()
    for name, value in body.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=atol, msg=name)
    server = strategy.federation.server_tensors
    assert sorted(int(c) for c in server["has_prototype"].nonzero()) == sorted(protos)
    for label, value in protos.items():
        torch.testing.assert_close(server["prototypes"][label], value, rtol=1e-4, atol=atol, msg=str(label))
    for client, head in heads.items():
        state = strategy.federation.store.client_state(client)
        for name, value in head.items():
            torch.testing.assert_close(
                state[f"pac_head.{name}"], value, rtol=1e-4, atol=atol, msg=(client, name)
            )


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedpac_equals_a_plain_loop(runner):
    """Golden test (full-batch clients, two local epochs, three rounds of two clients of three): the global body,
    the global prototypes and every client's combined head, on both runners."""
    strategy, init, dm, trainer, model = fit(FedPAC(lamda=LAMDA), runner=runner)
    assert strategy.runner_report.runner == runner
    _assert_equal(strategy, *plain_fedpac(init, dm))
    solved = [r["fedpac/solved"] for r in strategy.federation.history.rows if "fedpac/solved" in r]
    assert solved == [1.0] * ROUNDS


@pytest.mark.parametrize("broken", ["head_epochs", "stale_statistics", "upload_order"])
def test_the_golden_test_sees_each_planted_bug(broken):
    """The reference with a planted bug differs: the head phase for ``local_epochs`` (not exactly one), the
    statistics on the body before the receipt, PFLlib's order mismatch (weights on the other client's head)."""
    strategy, init, dm, trainer, model = fit(FedPAC(lamda=LAMDA), runner="sequential")
    with pytest.raises(AssertionError):
        _assert_equal(strategy, *plain_fedpac(init, dm, broken=broken))


def test_class_count_weighted_prototypes():
    """``prototype_weighting="counts"`` (the official code): each client's prototype of a class weighted by its
    samples of the class; differs from the plain mean."""
    strategy, init, dm, *_ = fit(FedPAC(lamda=LAMDA, prototype_weighting="counts"), runner="sequential")
    _assert_equal(strategy, *plain_fedpac(init, dm, counts=True))
    with pytest.raises(AssertionError):
        _assert_equal(strategy, *plain_fedpac(init, dm))


def test_without_scipy_fedpac_is_refused_at_setup(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(ValueError, match="scipy"):
        fit(FedPAC(), runner="sequential", callbacks=[RefuseAtStep()])


def test_the_prototype_term_matters():
    init = net()
    dm = datamodule()
    dm.setup()
    reference, other = plain_fedpac(init, dm)[0], plain_fedpac(init, dm, lamda=0.0)[0]
    assert max((other[n] - reference[n]).abs().max() for n in reference) > 1e-4


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_evaluation_scores_the_global_body_with_the_combined_head(runner):
    strategy, init, dm, trainer, model = fit(FedPAC(lamda=LAMDA), runner=runner)
    body, heads, _ = plain_fedpac(init, dm)
    accuracies = []
    for client in range(NUM_CLIENTS):
        reference = copy.deepcopy(init)
        reference.load_state_dict({**body, **heads[client]}, strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            logits = reference(x)
            torch.testing.assert_close(strategy.client_model(client)(x), logits, rtol=1e-4, atol=1e-5)
        accuracies.append((logits.argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def _brute_force(p):
    """The simplex QP by enumerating supports (KKT on each: ``a_S = P_SS^-1 1 / 1^T P_SS^-1 1``)."""
    k, best = p.shape[0], (float("inf"), None)
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            solved = np.linalg.solve(p[np.ix_(s, s)], np.ones(size))
            a = np.zeros(k)
            a[s] = solved / solved.sum()
            if (a >= -1e-12).all() and a @ p @ a < best[0]:
                best = (a @ p @ a, a)
    return best[1]


@pytest.mark.parametrize("seed", range(4))
def test_head_weights_solve_the_simplex_qp(seed):
    """Five clients: the scipy solution is the brute-force optimum (small weights zeroed, renormalized)."""
    g = torch.Generator().manual_seed(seed)
    v, h = (
        torch.rand(5, generator=g, dtype=torch.float64),
        torch.randn(5, 4, 3, generator=g, dtype=torch.float64),
    )
    h[3] = h[0] + 0.01  # a near neighbour of client 0
    for i in range(5):
        gaps = (h[i][None] - h).reshape(5, -1)
        expected = _brute_force((torch.diag(v) + gaps @ gaps.T).numpy())
        expected = np.where(expected > 1e-3, expected, 0.0)
        got = head_weights(v, h, i)
        np.testing.assert_allclose(got.numpy(), expected / expected.sum(), atol=2e-5)
        unnormalized = head_weights(v, h, i, renormalize=False)
        assert float(unnormalized.sum()) <= 1.0 + 1e-9


def test_a_forward_of_head_of_body_runs_as_the_declared_split():
    runs = []
    for model_class in (LossNet, DeclaredNet):
        torch.manual_seed(0)
        runs.append(fit(FedPAC(lamda=LAMDA), runner="sequential", model=model_class(lr=LR, momentum=0.0)))
    (detected, *_), (declared, *_) = runs
    for name, value in declared.global_tensors().items():
        assert torch.equal(detected.global_tensors()[name], value), name


@pytest.mark.parametrize(
    "model, message",
    [(ScaledOutput, "FedPAC needs the module as head\\(features\\(x\\)\\)"), (NoLoss, "fedrep_loss")],
)
def test_a_module_fedpac_cannot_run_is_refused_at_setup(model, message):
    with pytest.raises(ValueError, match=message):
        fit(FedPAC(), runner="sequential", model=model(), callbacks=[RefuseAtStep()])


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"lamda": -1.0}, "lamda"),
        ({"prototype_weighting": "x"}, "prototype_weighting"),
        ({"renormalize": 1}, "renormalize"),
        ({"drop_last": "yes"}, "drop_last"),
    ],
)
def test_bad_arguments_name_themselves(arguments, name):
    with pytest.raises(ValueError, match=name):
        FedPAC(**arguments)


def test_fedpac_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["fedpac"]
    assert isinstance(algorithm, FedPAC) and algorithm.lamda == 1.0 and algorithm.shares == {"body"}
    assert (algorithm.renormalize, algorithm.prototype_weighting, algorithm.drop_last) == (
        True,
        "uniform",
        False,
    )
    assert "fedpac" in StrategyRegistry and "fedpac_ddp" in StrategyRegistry


def test_fedpac_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedPAC (``tests/scripts/algorithms_run.py``, every client, two rounds) on 2 processes equals the 1-process
    run: the global body, the prototypes, every client's combined head and statistics (each process solves the
    QPs over both processes' uploads), the validation accuracy."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    single = singles["fedpac"]
    assert float(single["server"]["has_prototype"].sum()) == 4
    for held in (rank["fedpac"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held, atol=1e-6)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=1e-6, atol=1e-7)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-5, atol=1e-6)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Fit two rounds, save, resume to three: the global body, the prototypes and every client's declared tensors
    (combined head, index, statistics) equal the three-round run's."""
    full = fit(FedPAC(lamda=LAMDA), runner="sequential")[0]
    trainer = fit(FedPAC(lamda=LAMDA), runner="sequential", rounds=2)[3]
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=FedPAC(lamda=LAMDA),
        clients_per_round=PER_ROUND,
        local_epochs=LOCAL_EPOCHS,
        head="classifier",
        seed=SEED,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        net(), datamodule=datamodule(), ckpt_path=path
    )
    for name, value in full.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)
    for client in range(NUM_CLIENTS):
        resumed = strategy.federation.store.client_state(client)
        for name, value in full.federation.store.client_state(client).items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=(client, name))


def test_drop_last_reads_the_statistics_as_pfllibs_loader():
    """``drop_last=True``: the statistics of a client of the first round read a shuffled pass in batches of the
    round's size, the last partial one dropped (the order drawn from ``ClientStart.data.generator("statistics")``,
    the documented seeding rule restated), while ``V``'s divisor stays the client's sample count."""
    import zlib

    from tests.fixtures import reference_generator

    strategy, init, dm, *_ = fit(
        FedPAC(lamda=LAMDA, drop_last=True), runner="sequential", batch_size=64, rounds=1
    )
    for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, 0):
        x, y = _xy(dm, client)
        n = len(x)
        key = zlib.crc32(b"statistics")
        order = torch.randperm(n, generator=reference_generator(SEED, 0, 0x57A7, client, key))[
            : 64 * (n // 64)
        ]
        v, h = statistics(init, x[order], y[order])
        state = strategy.federation.store.client_state(client)
        torch.testing.assert_close(state["pac_v"].double(), v * len(order) / n, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["pac_h"].double(), h, rtol=1e-5, atol=1e-6)
