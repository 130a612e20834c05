"""FedCAC (``lightning_fedrep.federation.algorithms.fedcac``) against a plain PyTorch loop restating the authors' Fling
code (``fedcac_client.py``, ``fedcac_group.py``): each sampled client trains its model with the module's optimizer,
then marks per tensor the elements whose ``|(new - old) * new|`` reaches the ``int(tau * numel)``-th largest value
(``torch.topk``, the smallest nonzero value when that is <= 1e-10); the server averages the models (sample-weighted),
computes the masks' overlap rates between the round's clients, ``T = mean + (t + 1) / beta * (max - mean)``, each
client's customized model (the uniform mean over itself and the clients whose overlap reaches ``T``), and sets every
client's model to ``critical * customized + non_critical * global`` (clients not in the round keep their mask and
customized model). Rows in the loader's shuffle order (``tests.fixtures.client_batches``)."""

import copy
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.func import functional_call
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FedCAC, FederatedDataModule, FederatedStrategy
from lightning_fedrep.federation.api.registry import ALGORITHMS
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, BATCH = 4, 3, 4, 4, 2, 3, 64
TAU, BETA = 0.5, 3.0


def datamodule(batch_size=BATCH):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def fling_mask(prev, new, tau, broken=""):
    """``evaluate_critical_parameter`` of one tensor, as Fling writes it."""
    g = new - prev
    c = torch.abs(g if broken == "delta_only" else g * new)
    metric = c.view(-1)
    nz = int(tau * metric.size(0))
    top_values, _ = torch.topk(metric, nz)
    thresh = top_values[-1] if len(top_values) > 0 else np.inf
    if thresh <= 1e-10:
        new_metric = metric[metric > 1e-20]
        if len(new_metric) > 0:
            thresh = new_metric.sort()[0][0]
    return (c >= thresh).float()


def _train(init, start, batches):
    model = copy.deepcopy(init)
    model.load_state_dict(start)
    optimizer = model.configure_optimizers()
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _customize(ends, masks, sizes, r, beta, broken):
    """``get_customized_global_models`` over the round's clients: their customized models and group sizes."""
    clients = sorted(ends)
    flat = {c: torch.cat([masks[c][n].view(-1) for n in masks[c]]) for c in clients}
    overlap = {
        (i, j): 1 - torch.sum(torch.abs(flat[i] - flat[j])) / float(torch.sum(flat[i]) * 2)
        for i in clients
        for j in clients
        if i != j
    }
    values = torch.tensor(list(overlap.values()))
    avg = values.sum() / (len(clients) * (len(clients) - 1))
    t = r if broken == "t_not_plus_one" else r + 1
    threshold = avg + t / beta * (values.max() - avg)
    customized, groups = {}, []
    for i in clients:
        group = [i] + [j for j in clients if j != i and overlap[(i, j)] >= threshold]
        weights = [sizes[j] if broken == "weighted_custom" else 1.0 for j in group]
        customized[i] = {
            n: sum(w * ends[j][n] for w, j in zip(weights, group)) / sum(weights) for n in ends[i]
        }
        groups.append(len(group))
    return customized, groups


def plain_fedcac(init, dm, tau=TAU, beta=BETA, first=True, broken=""):
    """The global model, every client's model and masks, and each round's group sizes."""
    x = {n: t.detach().clone() for n, t in init.state_dict().items()}
    sizes = [len(dm.client_data(c)) for c in range(NUM_CLIENTS)]
    steps = [LOCAL_EPOCHS * math.ceil(n / dm.batch_size) for n in sizes]
    models = {c: dict(x) for c in range(NUM_CLIENTS)}
    masks = {c: {n: torch.zeros_like(t) for n, t in x.items()} for c in range(NUM_CLIENTS)}
    groups = []
    for r in range(ROUNDS):
        ends = {}
        for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            ends[c] = _train(init, models[c], client_batches(dm, DATA_SEED, r, c, steps[c]))
            masks[c] = {n: fling_mask(models[c][n], ends[c][n], tau, broken) for n in x}
        total = sum(sizes[c] for c in ends)
        x = {n: sum(sizes[c] * ends[c][n] for c in ends) / total for n in x}
        if not first and r == 0:
            customized = {c: {n: t.detach().clone() for n, t in init.state_dict().items()} for c in ends}
        else:
            customized, sizes_r = _customize(ends, masks, sizes, r, beta, broken)
            groups.append(sizes_r)
        for c in range(NUM_CLIENTS):
            if c not in customized and broken == "stale_not_remixed":
                continue
            own = customized.get(c, models[c])
            models[c] = {n: masks[c][n] * own[n] + (1 - masks[c][n]) * x[n] for n in x}
    return x, models, masks, groups


def fit(algorithm, runner="sequential", callbacks=(), ckpt_path=None):
    torch.manual_seed(0)
    init = LossNet()
    dm = datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, runner=runner, seed=SEED, local_epochs=LOCAL_EPOCHS
    )
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=ROUNDS,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm, trainer, model


def _assert_equal(strategy, x, models, masks, atol=1e-6):
    got = strategy.global_tensors()
    for name, value in x.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=atol, msg=name)
    for client in range(NUM_CLIENTS):
        state = strategy.federation.store.client_state(client)
        for name in x:
            torch.testing.assert_close(state[f"personal.{name}"], models[client][name], rtol=1e-5, atol=atol)
            assert torch.equal(state[f"critical.{name}"], masks[client][name]), (client, name)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedcac_equals_a_plain_loop(runner):
    """Golden test (four clients, three per round, four rounds, ``beta = 3`` so that the collaboration groups shrink
    from round to round): the global model, every client's model and critical masks, on both runners. Fails if the
    mask reads ``|new - old|``, the threshold uses ``t`` for ``t + 1``, the customized mean is sample-weighted, or
    the clients left out of a round keep their model (not re-mixed with the new global model) (planted below)."""
    strategy, init, dm, trainer, model = fit(FedCAC(tau=TAU, beta=BETA), runner)
    assert strategy.runner_report.runner == runner
    x, models, masks, groups = plain_fedcac(init, dm)
    assert any(1 < g < PER_ROUND for sizes in groups for g in sizes)  # some clients collaborate, not all
    assert groups[-1] == [1] * PER_ROUND  # at t + 1 >= beta the threshold is the maximum overlap: alone
    _assert_equal(strategy, x, models, masks, atol=1e-6 if runner == "sequential" else 1e-5)


@pytest.mark.parametrize("broken", ["delta_only", "t_not_plus_one", "weighted_custom", "stale_not_remixed"])
def test_the_golden_test_sees_each_planted_bug(broken):
    strategy, init, dm, trainer, model = fit(FedCAC(tau=TAU, beta=BETA))
    with pytest.raises(AssertionError):
        _assert_equal(strategy, *plain_fedcac(init, dm, broken=broken)[:3])


def test_pfllibs_first_round_restarts_the_critical_parameters_from_the_initial_model():
    """``customize_first_round=False`` (PFLlib): round 0's customized models are the initial model; it differs from
    the authors' default."""
    strategy, init, dm, trainer, model = fit(FedCAC(tau=TAU, beta=BETA, customize_first_round=False))
    x, models, masks, _ = plain_fedcac(init, dm, first=False)
    _assert_equal(strategy, x, models, masks)
    with pytest.raises(AssertionError):
        _assert_equal(strategy, *plain_fedcac(init, dm)[:3])


def test_evaluation_scores_each_clients_model():
    """``client_model(c)`` and the logged test loss are client ``c``'s re-mixed model."""
    strategy, init, dm, trainer, model = fit(FedCAC(tau=TAU, beta=BETA))
    _, models, _, _ = plain_fedcac(init, dm)
    losses = []
    for client in range(NUM_CLIENTS):
        xs, ys = _xy(dm, client, "test")
        with torch.no_grad():
            expected = functional_call(init, models[client], (xs,))
            torch.testing.assert_close(strategy.client_model(client)(xs), expected, rtol=1e-5, atol=1e-5)
        losses.append(F.cross_entropy(expected, ys).item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/loss"] - sum(losses) / NUM_CLIENTS) < 1e-4


def test_the_mask_follows_the_authors_rule_on_edge_cases():
    """``critical_mask`` against Fling's code: ties, all-zero changes (the smallest nonzero value), ``tau = 0``."""
    from lightning_fedrep.federation.algorithms.fedcac import critical_mask

    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    sparse = old.clone()
    sparse[0, :3] += 1.0
    for tau in (0.0, 0.1, 0.5, 0.9, 1.0):
        for prev in (old, sparse, new):
            torch.testing.assert_close(
                critical_mask(prev, new, tau), fling_mask(prev, new, tau), rtol=0, atol=0
            )


def test_fedcac_by_name_has_flings_cifar10_defaults():
    algorithm = ALGORITHMS["fedcac"]
    assert isinstance(algorithm, FedCAC)
    assert (algorithm.tau, algorithm.beta, algorithm.customize_first_round) == (0.5, 100.0, True)
    assert "fedcac" in StrategyRegistry and "fedcac_ddp" in StrategyRegistry


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tau": 1.5}, ValueError, "tau"),
        ({"tau": -0.1}, ValueError, "tau"),
        ({"beta": 0.0}, ValueError, "beta"),
        ({"beta": 0.5}, ValueError, "beta"),
        ({"customize_first_round": 1}, TypeError, "customize_first_round"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        FedCAC(**kwargs)


def test_a_run_resumed_mid_round_equals_the_uninterrupted_one(tmp_path):
    """Checkpoints after every step; the run resumed from one inside a client's round (its declared tensors half
    written) ends with the uninterrupted run's global model and every client's declared tensors, exactly."""
    whole = fit(FedCAC(tau=TAU, beta=BETA))[0]
    first = fit(
        FedCAC(tau=TAU, beta=BETA),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)],
    )[0]
    step = first.round_plan(0).length + 3  # inside round 1
    (ckpt,) = tmp_path.glob(f"*step={step}.ckpt")
    resumed = fit(FedCAC(tau=TAU, beta=BETA), ckpt_path=ckpt)[0]
    for name, value in whole.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        for name, value in whole.federation.store.client_state(client).items():
            assert torch.equal(resumed.federation.store.client_state(client)[name], value), (client, name)


def test_fedcac_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedCAC (``tests/scripts/algorithms_run.py``), 2 rounds, every client: the global model, every client's model,
    masks and index on 2 processes equal the 1-process run. Fails when the server step sees only its rank's
    uploads or re-mixes only the clients its rank trained."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedcac"]
    assert all(float(t["id"]) == c + 1 for c, t in single["declared"].items())
    for held in (rank["fedcac"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)
