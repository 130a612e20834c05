"""HF-MAML (``lightning_fedrep.federation.algorithms.hf_maml``) against a plain PyTorch loop written from the
official SRPFL code's ``LocalUpdateHFMAML`` (``models/Update.py``) with its update carried from step to step
(the intended semantics, not its ``state_dict`` aliasing): with ``D, D', D''`` the three consecutive thirds of
the batch (``parts=3``) or the whole batch thrice (``parts=1``, the official code's)::

    w_tmp = w - alpha grad f_D(w);  d = grad f_D'(w_tmp)
    hvp = (grad f_D''(w + delta d) - grad f_D''(w - delta d)) / (2 delta);  w <- w - beta (d - alpha hvp)

with ``beta`` the module's plain-SGD learning rate; the server takes the sample-weighted mean
(``HFMAML-ray.py``). Evaluation restates ``test_MAML``: one SGD step at ``alpha`` on one training batch of each
client, then its test data. Shuffled batches re-derived by ``tests.fixtures.client_batches``."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import HFMAML, DirichletPartitioner, FederatedDataModule, FederatedStrategy
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED = 3, 2, 4, 2, 2, 3
BETA, ALPHA, DELTA = 0.1, 0.5, 0.05  # alpha, delta large enough to see the Hessian term in float32


def datamodule(batch_size=256):
    """Full-batch clients of unequal sizes (Dirichlet); ``batch_size=64`` gives them different step counts
    (lockstep lanes that idle) and each pass a padded last batch whose real rows split unevenly in three."""
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=1.0, min_samples_per_client=100)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def net():
    """TinyNet with the official optimizer: plain SGD at ``beta`` (no momentum, no weight decay)."""
    return LossNet(lr=BETA, momentum=0.0, weight_decay=0.0)


def _grad(model, w, x, y):
    """``grad f(w)`` on the rows ``(x, y)``, the official way: load ``w`` and ``torch.autograd.grad``."""
    model.load_state_dict(w, strict=False)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(params.values()))
    return dict(zip(params, grads))


def _local(init, w, batches, parts, hessian=True):
    model = copy.deepcopy(init)
    for x, y in batches:
        xs, ys = (torch.tensor_split(x, 3), torch.tensor_split(y, 3)) if parts == 3 else ([x] * 3, [y] * 3)
        g = _grad(model, w, xs[0], ys[0])
        d = _grad(model, {n: w[n] - ALPHA * g[n] for n in w}, xs[1], ys[1])
        pg = _grad(model, {n: w[n] + DELTA * d[n] for n in w}, xs[2], ys[2])
        mg = _grad(model, {n: w[n] - DELTA * d[n] for n in w}, xs[2], ys[2])
        hvp = {n: (pg[n] - mg[n]) / 2.0 / DELTA for n in w}
        w = {n: w[n] - BETA * (d[n] - (ALPHA * hvp[n] if hessian else 0)) for n in w}
    return w


def plain_hf_maml(init, dm, parts, hessian=True):
    w = {n: p.detach().clone() for n, p in init.named_parameters()}
    for r in range(ROUNDS):
        total, weight = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            steps = LOCAL_EPOCHS * math.ceil(len(dm.client_data(client)) / dm.batch_size)
            trained = _local(init, w, client_batches(dm, DATA_SEED, r, client, steps), parts, hessian)
            for n in w:
                total[n] += len(dm.client_data(client)) * trained[n]
            weight += len(dm.client_data(client))
        w = {n: t / weight for n, t in total.items()}
    return w


def fit(algorithm, runner="auto", batch_size=256, validate=False):
    torch.manual_seed(0)
    init, dm = net(), datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model


def _assert_equal(got, expected):
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("parts", [3, 1])
def test_hf_maml_equals_a_plain_loop(parts):
    """Golden test on the sequential runner. Fails if the Hessian term's sign flips (``d + scale * ...``), if
    the finite difference is one-sided (``minus`` taken at ``w``), if ``D'`` is ``D`` (``second`` -> ``first``
    in ``_grads``), or if ``parts`` is ignored (``_split`` always splitting, or never)."""
    strategy, init, dm, *_ = fit(HFMAML(alpha=ALPHA, delta=DELTA, parts=parts), runner="sequential")
    _assert_equal(strategy.global_tensors(), plain_hf_maml(init, dm, parts))


@pytest.mark.parametrize("parts", [3, 1])
def test_the_lockstep_runner_equals_the_plain_loop_and_the_sequential_runner(parts):
    """The rule inside the lockstep runner's ``vmap``, on batches of 64 (each pass's last one padded, its real
    rows not a multiple of 3). Fails if the split counts the padding (``mask.sum()`` -> ``mask.numel()`` in
    ``_split``)."""
    algorithm = HFMAML(alpha=ALPHA, delta=DELTA, parts=parts)
    lockstep, init, dm, *_ = fit(algorithm, runner="vectorized", batch_size=64)
    assert lockstep.runner_report.runner == "vectorized"
    sequential, *_ = fit(algorithm, runner="sequential", batch_size=64)
    expected = plain_hf_maml(init, dm, parts)
    _assert_equal(lockstep.global_tensors(), expected)
    _assert_equal(lockstep.global_tensors(), sequential.global_tensors())


def test_the_hessian_term_matters_here():
    """The golden tests can tell HF-MAML from first-order MAML (their references differ beyond tolerance)."""
    torch.manual_seed(0)
    init, dm = net(), datamodule()
    dm.setup()
    a, b = plain_hf_maml(init, dm, 3), plain_hf_maml(init, dm, 3, hessian=False)
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4


def test_hf_maml_by_name_has_the_official_settings():
    """``"hf_maml"`` is registered with the official alpha 1e-2, delta 1e-3 and the paper's three batches."""
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["hf_maml"]
    assert isinstance(algorithm, HFMAML)
    assert (algorithm.alpha, algorithm.delta, algorithm.parts) == (1e-2, 1e-3, 3)


def test_evaluation_scores_the_global_model_adapted_on_each_clients_data():
    """HF-MAML's evaluation (``test_MAML``): the global model after one plain SGD step at ``alpha`` on one
    training batch of each client (full batch here), scored on the client's test data, mean over clients.
    Fails if ``HFMAML.evaluation`` drops ``adapt``, its ``adapt_lr`` (the module's lr, 0.1, instead of alpha),
    or takes more than one step."""
    strategy, init, dm, trainer, model = fit(HFMAML(alpha=ALPHA, delta=DELTA))
    w = plain_hf_maml(init, dm, 3)
    accuracies, losses = [], []
    for client in range(NUM_CLIENTS):
        adapted = copy.deepcopy(init)
        g = _grad(adapted, w, *_xy(dm, client))
        adapted.load_state_dict({n: w[n] - ALPHA * g[n] for n in w}, strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            accuracies.append((adapted(x).argmax(1) == y).double().mean().item())
            losses.append(F.cross_entropy(adapted(x), y).item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6
    assert abs(metrics["test/loss"] - sum(losses) / NUM_CLIENTS) < 1e-5


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": "0.01"}, "alpha"),
        ({"delta": -1e-3}, "delta"),
        ({"parts": 2}, "parts"),
        ({"parts": True}, "parts"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, argument):
    with pytest.raises((ValueError, TypeError), match=argument):
        HFMAML(**kwargs)


def test_a_batch_too_small_to_split_in_three_is_refused():
    """Sequential runner, ``parts=3``, batches of 2 rows: one of ``D, D', D''`` would be empty."""
    with pytest.raises(ValueError, match="at least 3 rows"):
        fit(HFMAML(), runner="sequential", batch_size=2)
