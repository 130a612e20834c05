"""Per-FedAvg (``lightning_fedrep.federation.algorithms.per_fedavg``) against a plain PyTorch loop written from
the official FedRep code's ``LocalUpdateMAML`` (``models/Update.py``): each batch is split into its first
``int(0.8 n)`` rows (support) and the rest (query); the step is the paper's MAML meta-gradient
``grad_w L_q(w - lr_in grad L_s(w))`` (``step="maml"``) or the official code's ``grad L_s(w) + grad L_q(w)``
(``step="official"``), followed by the client's SGD step (momentum 0.5); the server takes the sample-weighted
mean (the official ``main_fedrep.py`` for ``--alg maml``). Full-batch clients; the split reads the rows in the
order of each pass's shuffle, re-derived by ``tests.fixtures.client_batches``."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FederatedDataModule, FederatedStrategy, PerFedAvg
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED = 3, 2, 4, 2, 2, 3


def datamodule(batch_size=256):
    """Full-batch clients of unequal sizes (Dirichlet); ``batch_size=64`` gives them different step counts
    (lockstep lanes that idle) and each pass a padded last batch."""
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=1.0, min_samples_per_client=100)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _forward(p, x):
    """TinyNet's forward written out (dropout 0): the functional model the inner step adapts."""
    h = F.relu(F.linear(x, p["body.0.weight"], p["body.0.bias"]))
    h = F.relu(F.linear(h, p["body.3.weight"], p["body.3.bias"]))
    return F.linear(h, p["classifier.weight"], p["classifier.bias"])


def _local(init, w, batches, step, first_order, inner_scale):
    """A full-batch step of the module's own optimizer per batch, with ``torch.autograd``."""
    model = copy.deepcopy(init)
    model.load_state_dict(w, strict=False)
    optimizer = model.configure_optimizers()
    lr_in = optimizer.param_groups[0]["lr"] * inner_scale
    for x, y in batches:
        k = int(0.8 * x.shape[0])
        optimizer.zero_grad()
        p = dict(model.named_parameters())
        loss_s = F.cross_entropy(_forward(p, x[:k]), y[:k])
        if step == "official":
            (loss_s + F.cross_entropy(_forward(p, x[k:]), y[k:])).backward()
        else:
            inner = torch.autograd.grad(loss_s, list(p.values()), create_graph=not first_order)
            adapted = {n: t - lr_in * g for (n, t), g in zip(p.items(), inner)}
            F.cross_entropy(_forward(adapted, x[k:]), y[k:]).backward()
        optimizer.step()
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def plain_per_fedavg(init, dm, step, first_order=False, inner_scale=1e-3):
    w = {n: p.detach().clone() for n, p in init.named_parameters()}
    for r in range(ROUNDS):
        total, weight = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            steps = LOCAL_EPOCHS * math.ceil(len(dm.client_data(client)) / dm.batch_size)
            batches = list(client_batches(dm, DATA_SEED, r, client, steps))
            trained = _local(init, w, batches, step, first_order, inner_scale)
            for n in w:
                total[n] += len(dm.client_data(client)) * trained[n]
            weight += len(dm.client_data(client))
        w = {n: t / weight for n, t in total.items()}
    return w


def fit(algorithm, runner="auto", batch_size=256):
    torch.manual_seed(0)
    init = LossNet()
    dm = datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(copy.deepcopy(init), datamodule=dm)
    dm.setup()
    return strategy, init, dm


@pytest.mark.parametrize(
    "step, first_order, inner_scale",
    [("maml", False, 1.0), ("maml", True, 1.0), ("official", False, 1e-3)],
)
def test_per_fedavg_equals_a_plain_loop(step, first_order, inner_scale):
    """Golden test on the sequential runner (``inner_scale=1`` makes the inner step large enough to see the
    second-order term). Fails if the meta-gradient is taken at ``w`` instead of the adapted weights (``at(w,
    xq, yq)`` in ``outer``), if ``first_order`` is ignored (the ``inner.detach()`` line dropped), if the split
    is not the first 80% of rows (``k = x.shape[0] // 2``), or if ``"official"`` drops the support loss."""
    algorithm = PerFedAvg(step=step, first_order=first_order, inner_scale=inner_scale)
    strategy, init, dm = fit(algorithm, runner="sequential")
    expected = plain_per_fedavg(init, dm, step, first_order, inner_scale)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("step, first_order", [("maml", False), ("maml", True), ("official", False)])
def test_the_lockstep_runner_equals_the_plain_loop_and_the_sequential_runner(step, first_order):
    """The rule inside the lockstep runner's ``vmap``, on batches of 64 (each pass's last one padded: the split
    takes the first 80% of its *real* rows). Fails if the split counts the padding (``mask.sum()`` ->
    ``mask.numel()`` in ``_split``) or if the engine drops the surrogate's per-lane gradients (``keep`` set to
    zeros in ``_rule_loss``)."""
    algorithm = PerFedAvg(step=step, first_order=first_order, inner_scale=1.0)
    lockstep, init, dm = fit(algorithm, runner="vectorized", batch_size=64)
    assert lockstep.runner_report.runner == "vectorized"
    sequential, *_ = fit(algorithm, runner="sequential", batch_size=64)
    expected = plain_per_fedavg(init, dm, step, first_order, 1.0)
    for name, value in expected.items():
        got = lockstep.global_tensors()[name]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got, sequential.global_tensors()[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_second_order_term_matters_here():
    """The golden test can tell MAML from first-order MAML (their references differ beyond its tolerance)."""
    torch.manual_seed(0)
    init, dm = LossNet(), datamodule()
    dm.setup()
    a = plain_per_fedavg(init, dm, "maml", False, 1.0)
    b = plain_per_fedavg(init, dm, "maml", True, 1.0)
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-5


def test_per_fedavg_by_name_has_the_official_settings():
    """``"per_fedavg"`` is registered with the paper's step, the official inner lr ``lr * 0.001`` and 80/20 split."""
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["per_fedavg"]
    assert isinstance(algorithm, PerFedAvg)
    assert (algorithm.step, algorithm.first_order, algorithm.inner_scale, algorithm.support) == (
        "maml",
        False,
        1e-3,
        0.8,
    )
    assert algorithm.adapt_epochs == 5


def test_evaluation_scores_the_global_model_adapted_on_each_clients_data():
    """Per-FedAvg's evaluation: the global model after ``adapt_epochs`` epochs of plain SGD at the module's lr
    on each client's training data (full batch: one step an epoch), scored on the client's test data, mean over
    clients. Fails if ``PerFedAvg.evaluation`` drops ``adapt`` (scores the global model as it is) or adapts for
    another number of epochs."""
    torch.manual_seed(0)
    init, dm = LossNet(), datamodule()
    strategy = FederatedStrategy(
        algorithm=PerFedAvg(step="official", adapt_epochs=3),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    w = plain_per_fedavg(init, dm, "official")
    lr = init.configure_optimizers().param_groups[0]["lr"]
    accuracies = []
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(w, strict=False)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        x, y = _xy(dm, client)
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            accuracies.append((net(x).argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


@pytest.mark.parametrize(
    "kwargs, argument",
    [({"step": "reptile"}, "step"), ({"support": 1.0}, "support"), ({"inner_scale": -1}, "inner_scale")],
)
def test_bad_settings_name_the_argument(kwargs, argument):
    with pytest.raises((ValueError, TypeError), match=argument):
        PerFedAvg(**kwargs)
