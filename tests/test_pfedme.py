"""pFedMe (``lightning_fedrep.federation.algorithms.pfedme``) against a plain PyTorch loop restating the rule of the
authors' ``userpFedMe.py``/``serverpFedMe.py``/``pFedMeOptimizer`` (github.com/CharlieDinh/pFedMe; PFLlib's
``clientpFedMe.py``): each sampled client sets its local model ``w`` and personalized model ``theta`` to the global
model ``x``; per batch, ``K`` steps ``theta <- theta - eta_p (grad f(theta) + lam (theta - w) + mu theta)`` (theta
carried across batches), then ``w <- w - eta lam (w - theta)``; the server sets ``x <- (1 - beta) x + beta
mean_n(w_i)``. Rows in the loader's shuffle order (``tests.fixtures.client_batches``), several batches per epoch.
"""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.func import functional_call
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy, PFedMe
from lightning_fedrep.federation.api.registry import ALGORITHMS
from tests.fixtures import client_batches, quiet_trainer, reference_clients
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet
from tests.test_feddbe import DATA_SEED, NUM_CLIENTS, PER_ROUND, SEED, datamodule

ROUNDS, LOCAL_EPOCHS, LR, BATCH = 3, 2, 0.1, 64
LAM, K, ETA_P, BETA, MU = 2.0, 3, 0.05, 0.7, 0.01
RULE = dict(lam=LAM, inner_steps=K, personal_lr=ETA_P, beta=BETA, mu=MU)


def net():
    return LossNet(lr=LR, momentum=0.0, weight_decay=0.0)  # plain SGD: the paper's w update


def _client(init, x, batches, theta0, broken):
    """One client's round: its final local and personalized models."""
    w = {n: t.clone() for n, t in x.items()}
    theta = {n: t.clone() for n, t in (theta0 if broken == "no_restart" else x).items()}
    for xb, yb in batches:
        if broken == "reset_theta":
            theta = {n: t.clone() for n, t in w.items()}
        for _ in range(K):
            live = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
            grads = torch.autograd.grad(
                F.cross_entropy(functional_call(init, live, (xb,)), yb), list(live.values())
            )
            mu = 0.0 if broken == "no_mu" else MU
            with torch.no_grad():
                theta = {
                    n: t - ETA_P * (g + LAM * (t - w[n]) + mu * t) for (n, t), g in zip(theta.items(), grads)
                }
        w = {n: t - LR * LAM * (t - theta[n]) for n, t in w.items()}
    return w, theta


def plain_pfedme(init, dm, broken=""):
    """The global model and every client's (local, personalized) models after ``ROUNDS`` rounds. ``broken`` plants
    a bug in the rule (the tests show each one changes the result)."""
    x = {n: t.detach().clone() for n, t in init.named_parameters()}
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    steps = [LOCAL_EPOCHS * math.ceil(n / dm.batch_size) for n in sizes]
    thetas = {c: dict(x) for c in range(NUM_CLIENTS)}
    locals_ = {c: dict(x) for c in range(NUM_CLIENTS)}
    for r in range(ROUNDS):
        sums, total = {n: torch.zeros_like(t) for n, t in x.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            batches = client_batches(dm, DATA_SEED, r, client, steps[client])
            w, thetas[client] = _client(init, x, batches, thetas[client], broken)
            locals_[client] = w
            for n in sums:
                sums[n] += sizes[client] * w[n]
            total += sizes[client]
        beta = 1.0 if broken == "no_mixing" else BETA
        x = {n: (1 - beta) * x[n] + beta * sums[n] / total for n in x}
    return x, locals_, thetas


def fit(algorithm, runner="sequential", rounds=ROUNDS, callbacks=(), ckpt_path=None):
    torch.manual_seed(0)
    init = net()
    dm = datamodule(BATCH)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, runner=runner, seed=SEED, local_epochs=LOCAL_EPOCHS
    )
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm, trainer, model


def _assert_equal(strategy, x, thetas, atol=1e-6):
    got = strategy.global_tensors()
    for name, value in x.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=atol, msg=name)
    for client, theta in thetas.items():
        state = strategy.federation.store.client_state(client)
        for name, value in theta.items():
            torch.testing.assert_close(
                state[f"personal.{name}"], value, rtol=1e-5, atol=atol, msg=(client, name)
            )


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_pfedme_equals_a_plain_loop(runner):
    """Golden test (three clients of unequal sizes, two sampled per round, batches of 64, two epochs): the global
    model and every client's personalized model, on both runners (the lockstep runner on zero-padded batches, with
    idle lanes). Fails if ``theta`` is reset to ``w`` per batch, is not restarted from the global model at the
    client's round start, drops ``mu``, or if the server skips the ``beta`` mixing (planted below)."""
    strategy, init, dm, trainer, model = fit(PFedMe(**RULE), runner=runner)
    assert strategy.runner_report.runner == runner
    x, _, thetas = plain_pfedme(init, dm)
    assert sum(1 for c in range(NUM_CLIENTS) if any((thetas[c][n] != x[n]).any() for n in x)) >= 2
    _assert_equal(strategy, x, thetas, atol=1e-6 if runner == "sequential" else 1e-5)


@pytest.mark.parametrize("broken", ["reset_theta", "no_restart", "no_mu", "no_mixing"])
def test_the_golden_test_sees_each_planted_bug(broken):
    """The reference with a planted bug differs from the strategy beyond the golden test's tolerance."""
    strategy, init, dm, trainer, model = fit(PFedMe(**RULE))
    x, _, thetas = plain_pfedme(init, dm, broken=broken)
    with pytest.raises(AssertionError):
        _assert_equal(strategy, x, thetas)


@pytest.mark.parametrize("evaluate", ["personalized", "local", "global"])
def test_evaluation_scores_the_chosen_model(evaluate):
    """``strategy.client_model(c)`` and the logged test loss are ``theta_c`` (the default), ``w_c`` or the global
    model, as ``evaluate`` says."""
    strategy, init, dm, trainer, model = fit(PFedMe(evaluate=evaluate, **RULE))
    x, locals_, thetas = plain_pfedme(init, dm)
    chosen = {"personalized": thetas, "local": locals_, "global": {c: x for c in range(NUM_CLIENTS)}}[
        evaluate
    ]
    losses = []
    for client in range(NUM_CLIENTS):
        xs, ys = _xy(dm, client, "test")
        with torch.no_grad():
            expected = functional_call(init, chosen[client], (xs,))
            torch.testing.assert_close(strategy.client_model(client)(xs), expected, rtol=1e-5, atol=1e-5)
        losses.append(F.cross_entropy(expected, ys).item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/loss"] - sum(losses) / NUM_CLIENTS) < 1e-4


def test_pfedme_by_name_has_the_papers_defaults():
    """``Trainer(strategy="pfedme")`` is the paper's/official setting (lam 15, K 5, eta_p 0.01, beta 1, mu 0.001,
    scoring theta), not PFLlib's ``-bt 0`` (a global model that never moves)."""
    algorithm = ALGORITHMS["pfedme"]
    assert isinstance(algorithm, PFedMe)
    assert (algorithm.lam, algorithm.inner_steps, algorithm.personal_lr, algorithm.beta, algorithm.mu) == (
        15.0,
        5,
        0.01,
        1.0,
        0.001,
    )
    assert algorithm.evaluation().slot == "personal"
    assert "pfedme" in StrategyRegistry and "pfedme_ddp" in StrategyRegistry


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"lam": -1.0}, ValueError, "lam"),
        ({"inner_steps": 0}, ValueError, "inner_steps"),
        ({"inner_steps": 2.0}, TypeError, "inner_steps"),
        ({"personal_lr": 0.0}, ValueError, "personal_lr"),
        ({"beta": -0.5}, ValueError, "beta"),
        ({"mu": -1.0}, ValueError, "mu"),
        ({"evaluate": "theta"}, ValueError, "evaluate"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        PFedMe(**kwargs)


def test_a_run_resumed_mid_round_equals_the_uninterrupted_one(tmp_path):
    """Checkpoints after every step; the run resumed from one inside a client's round (its declared tensors half
    written) ends with the uninterrupted run's global model and every client's declared tensors, exactly."""
    whole = fit(PFedMe(**RULE))[0]
    first = fit(
        PFedMe(**RULE), callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)]
    )[0]
    step = first.round_plan(0).length + 3  # inside round 1
    (ckpt,) = tmp_path.glob(f"*step={step}.ckpt")
    resumed = fit(PFedMe(**RULE), ckpt_path=ckpt)[0]
    for name, value in whole.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        for name, value in whole.federation.store.client_state(client).items():
            assert torch.equal(resumed.federation.store.client_state(client)[name], value), (client, name)


def test_pfedme_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """pFedMe (``tests/scripts/algorithms_run.py``), 2 rounds, every client: the global model, every client's
    tensors and personalized slot on 2 processes equal the 1-process run. Fails when a client's slot stays on the
    rank that trained it."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["pfedme"]
    for held in (rank["pfedme"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)
