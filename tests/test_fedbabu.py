"""FedBABU (``lightning_fedrep.federation.algorithms.fedbabu``) against a plain PyTorch loop on both runners: the
body trained and averaged with the head frozen at its random initialization, one head for every client; the
evaluation that fine-tunes each client's whole model from the global one before scoring it; by name; refusals.
Every client's training data is one batch, so batch order is irrelevant and the comparison exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedBABU, FederatedStrategy, HeadFineTuning, Phase
from tests.fixtures import HEAD, quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 6, 4, 4, 3, 2


def full_batch_datamodule():
    """Every client's training data is one batch (80 samples each)."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def xy(dm, client, split="train"):
    data = dm.client_data(client, split)
    return tuple(t[data.indices] for t in data.dataset.tensors)


def plain_fedbabu(init, dm, train_head=False):
    """FedBABU written out: each round's clients (``reference_clients``) load the global body over the initial
    model, freeze the head (``requires_grad=False``, as PFLlib) and take ``LOCAL_EPOCHS`` full-batch steps of
    the module's optimizer (momentum, weight decay); the server's body is the sample-weighted float64 mean.
    ``train_head=True`` is the planted bug (the head trains too: FedPer with a head reset every round)."""
    body = {k: v.clone() for k, v in init.state_dict().items() if k not in HEAD}
    for r in range(ROUNDS):
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in body.items()}
        weight = 0.0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            model = copy.deepcopy(init)
            model.load_state_dict(body, strict=False)
            model.classifier.requires_grad_(train_head)
            optimizer = model.configure_optimizers()
            x, y = xy(dm, client)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            for k in total:
                total[k] += model.state_dict()[k].double() * len(x)
            weight += len(x)
        body = {k: (v / weight).float() for k, v in total.items()}
    return body


def fit(runner="sequential", algorithm=None, callbacks=(), max_epochs=ROUNDS, **settings):
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    strategy = FederatedStrategy(
        head="classifier",
        algorithm=algorithm if algorithm is not None else FedBABU(),
        clients_per_round=PER_ROUND,
        seed=SEED,
        runner=runner,
        **({"local_epochs": LOCAL_EPOCHS} if "phases" not in settings else {}),
        **settings,
    )
    model = copy.deepcopy(init)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=max_epochs, limit_val_batches=0, callbacks=list(callbacks)
    )
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, trainer, model, init, dm


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedbabu_equals_a_plain_loop_and_never_moves_the_head(runner):
    """Golden test. The global body is the plain loop's; every client's head (all trained at least once) is the
    module's initial head, bit for bit. Fails if the phase trains the head (``Phase("all")``: the heads move
    and the body differs, ``train_head=True`` below), if the frozen head still gets weight decay or momentum, or
    if the head is shared (the global tensors would hold it)."""
    strategy, _, _, init, dm = fit(runner)
    assert strategy.runner_report.runner == runner
    expected = plain_fedbabu(init, dm)
    got = strategy.global_tensors()
    assert set(got) == set(expected)  # the head is not shared
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    initial = init.state_dict()
    for client in range(NUM_CLIENTS):
        state = strategy.client_state_dict(client)
        for name in HEAD:
            assert torch.equal(state[name], initial[name]), (client, name)
    planted = plain_fedbabu(init, dm, train_head=True)
    assert any(not torch.allclose(planted[k], expected[k], atol=1e-4) for k in expected)


def plain_scores(init, dm, body, epochs, lr):
    """Plain PyTorch: each client's global model (``body`` and the initial head) after ``epochs`` full-batch
    steps of plain SGD on all its parameters at ``lr``, scored on its test split; mean accuracy and loss."""
    accuracy, loss = [], []
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(body, strict=False)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        x, y = xy(dm, client)
        for _ in range(epochs):
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        x, y = xy(dm, client, "test")
        with torch.no_grad():
            out = net(x)
        accuracy.append((out.argmax(1) == y).double().mean().item())
        loss.append(F.cross_entropy(out, y).item())
    return sum(accuracy) / NUM_CLIENTS, sum(loss) / NUM_CLIENTS


@pytest.mark.parametrize(
    "runner, epochs, lr", [("sequential", 3, None), ("vectorized", 3, 0.2), ("sequential", 0, None)]
)
def test_evaluation_fine_tunes_body_and_head_from_the_global_model(runner, epochs, lr):
    """``trainer.test`` scores each client's global model (global body, initial head) after
    ``fine_tuning_epochs`` epochs of plain SGD on body and head at ``fine_tuning_lr`` (``None``: the module's
    0.05); 0 epochs score the global model. The stored state does not change. Fails if the fine-tuning trains
    the head only, starts from another model, ignores the epochs or the learning rate."""
    strategy, trainer, model, init, dm = fit(runner, FedBABU(fine_tuning_epochs=epochs, fine_tuning_lr=lr))
    body = plain_fedbabu(init, dm)
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    accuracy, loss = plain_scores(init, dm, body, epochs, lr if lr is not None else init.hparams.lr)
    assert abs(metrics["test/acc"] - accuracy) < 1e-6
    assert abs(metrics["test/loss"] - loss) < 1e-4 * max(1.0, loss)
    if epochs:
        assert abs(metrics["test/loss"] - plain_scores(init, dm, body, 0, 0.05)[1]) > 1e-3
    for name, value in body.items():  # training goes on from the unfine-tuned model
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_pfllib_protocol_is_fine_tuning_rounds_after_the_federated_ones():
    """``FedBABU(fine_tuning_epochs=0)`` with ``HeadFineTuning(mode="full")``: after the federated rounds every
    client fine-tunes body and head with the module's own optimizer and keeps them (PFLlib's final fine-tuning
    round); the federated rounds left every head at its initialization."""
    callback = HeadFineTuning(mode="full", epochs=2)
    strategy, _, _, init, dm = fit(algorithm=FedBABU(fine_tuning_epochs=0), callbacks=[callback])
    body = plain_fedbabu(init, dm)
    for client in (0, 5):
        net = copy.deepcopy(init)
        net.load_state_dict(body, strict=False)
        optimizer = net.configure_optimizers()
        x, y = xy(dm, client)
        for _ in range(2):
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        state = strategy.client_state_dict(client)
        for name, value in net.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=(client, name))


class MarkedLossNet(LossNet):
    fedrep_head = "classifier"


def test_by_name_has_the_official_defaults():
    """``Trainer(strategy="fedbabu")`` runs ``FedBABU()``: 5 fine-tuning epochs at the module's rate."""
    trainer = quiet_trainer(strategy="fedbabu", max_epochs=1, limit_val_batches=0)
    trainer.fit(MarkedLossNet(), datamodule=tiny_datamodule(num_clients=10))
    algorithm = trainer.strategy.algorithm
    assert isinstance(algorithm, FedBABU) and (algorithm.fine_tuning_epochs, algorithm.fine_tuning_lr) == (
        5,
        None,
    )
    assert algorithm.evaluation().adapt == Phase("all", epochs=5)
    assert "fedbabu_ddp" in __import__("lightning").pytorch.strategies.StrategyRegistry


def test_a_phase_training_the_head_is_refused():
    with pytest.raises(ValueError, match=r"FedBABU trains only the body.*Phase\(train='all'"):
        fit(phases=[Phase("all", epochs=1)])


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        ({"fine_tuning_epochs": -1}, ValueError, "fine_tuning_epochs"),
        ({"fine_tuning_epochs": 1.0}, TypeError, "fine_tuning_epochs"),
        ({"fine_tuning_lr": 0.0}, ValueError, "adapt_lr"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        FedBABU(**kwargs)


def test_fedbabu_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedBABU (``tests/scripts/algorithms_run.py``), 2 rounds, every client: the global body, every client's
    (initial) head and the fine-tuned validation accuracy on 2 processes equal the 1-process run bit for bit."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedbabu"]
    for held in (rank["fedbabu"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
