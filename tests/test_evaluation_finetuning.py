"""``FineTunedEvaluation`` (SRPFL's evaluation): each client's head is fine-tuned on its training data before it
is scored, from the average of the last round's heads or from its own; checked against a plain PyTorch loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_fedrep import FedRepStrategy, FineTunedEvaluation
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

HEAD = ("classifier.weight", "classifier.bias")


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


def client_tensors(dm, client, split):
    data = dm.client_data(client, split)
    x, y = data.dataset.tensors
    return x[data.indices], y[data.indices]


def reference_accuracy(model, body, head, dm, client, epochs, lr, momentum=0.5, weight_decay=1e-4):
    """Head-only SGD on the client's whole training set per step (full batch, so order does not matter),
    then its accuracy on its evaluation data."""
    net = copy.deepcopy(model)
    net.load_state_dict({**net.state_dict(), **body, **head})
    for p in net.parameters():
        p.requires_grad_(False)
    params = [net.classifier.weight.requires_grad_(True), net.classifier.bias.requires_grad_(True)]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    x, y = client_tensors(dm, client, "train")
    for _ in range(epochs):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    x, y = client_tensors(dm, client, "test")
    with torch.no_grad():
        return (net(x).argmax(-1) == y).float().mean().item()


def fit(callback, algorithm="fedrep", engine="auto", rounds=2):
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=6, batch_size=8)
    strategy = FedRepStrategy(
        algorithm=algorithm, head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=4,
        engine=engine,
    )  # fmt: skip
    model = LossNet()
    initial = copy.deepcopy(model)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, callbacks=[callback])
    trainer.fit(model, datamodule=dm)
    return trainer, strategy, dm, initial


@pytest.mark.parametrize("engine", ["sequential", "auto"])
def test_every_client_is_scored_after_fine_tuning_the_average_of_the_last_rounds_heads(engine):
    callback = FineTunedEvaluation(epochs=3, lr=0.2, batch_size=10_000)
    trainer, strategy, dm, initial = fit(callback, engine=engine)
    federation = strategy.federation
    body = {n: t for n, t in federation.global_tensors().items() if n not in HEAD}
    last = list(strategy.round_plan(1).clients)
    assert callback.last_round_clients == last
    average = {n: torch.stack([federation.client_tensors(c)[n] for c in last]).mean(0) for n in HEAD}
    sampled = set(strategy.round_plan(0).clients) | set(last)
    never = [c for c in range(6) if c not in sampled]
    assert never, "the check below needs a client that never took part"
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        expected = reference_accuracy(initial, body, average, dm, client, epochs=3, lr=0.2)
        assert measured[client] == pytest.approx(expected, abs=1e-6), client
    for client in never:  # scored with a fine-tuned head; its stored head is still the initial one
        assert torch.equal(federation.client_tensors(client)["classifier.weight"], initial.classifier.weight)


def test_the_stored_start_fine_tunes_each_clients_own_head_and_leaves_it_stored():
    callback = FineTunedEvaluation(epochs=2, start="stored", lr=0.1, batch_size=10_000)
    trainer, strategy, dm, initial = fit(callback)
    federation = strategy.federation
    body = {n: t for n, t in federation.global_tensors().items() if n not in HEAD}
    stored = {c: federation.client_tensors(c) for c in range(6)}
    (result,) = trainer.validate(trainer.lightning_module, datamodule=dm, verbose=False)
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        head = {n: stored[client][n] for n in HEAD}
        assert measured[client] == pytest.approx(reference_accuracy(initial, body, head, dm, client, 2, 0.1))
        assert all(torch.equal(federation.client_tensors(client)[n], stored[client][n]) for n in HEAD)
    assert result["val/acc"] == pytest.approx(sum(measured.values()) / 6)


def test_fedavg_fine_tunes_the_global_head_per_client_and_keeps_the_global_model():
    callback = FineTunedEvaluation(epochs=2, lr=0.1, batch_size=10_000)
    trainer, strategy, dm, initial = fit(callback, algorithm="fedavg")
    federation = strategy.federation
    global_tensors = federation.global_tensors()
    body = {n: t for n, t in global_tensors.items() if n not in HEAD}
    head = {n: global_tensors[n] for n in HEAD}
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        assert measured[client] == pytest.approx(reference_accuracy(initial, body, head, dm, client, 2, 0.1))
    live = dict(trainer.lightning_module.named_parameters())
    assert all(torch.equal(live[n].detach(), t) for n, t in global_tensors.items())


def test_without_a_declared_loss_it_is_refused_before_training():
    dm = tiny_datamodule(num_clients=4)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[FineTunedEvaluation()])
    with pytest.raises(ValueError, match="fedrep_loss"):
        trainer.fit(TinyNet(), datamodule=dm)
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epochs": 0}, "epochs"),
        ({"start": "global"}, "start"),
        ({"loss": "hinge"}, "loss"),
        ({"stages": ["fit"]}, "stages"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        FineTunedEvaluation(**kwargs)
