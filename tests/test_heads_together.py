"""Fine-tuning many clients' heads at once on cached features (``callbacks.heads_together``, the batched path of
``FineTunedEvaluation``): checked against a plain per-client PyTorch loop and against one client at a time."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FedRepStrategy, FineTunedEvaluation
from lightning_fedrep.evaluation import finetuning, head_tuning
from lightning_fedrep.evaluation.head_tuning import ClientHead, HeadFineTuning, NotBatchable
from lightning_fedrep.federation.module.losses import NAMED_LOSSES
from lightning_fedrep.runners import selection
from lightning_fedrep.runners.lockstep import heads_together
from tests.fixtures import TinyNet, quiet_trainer

SIZES = (5, 13, 21, 8)
"""Unequal clients: different step counts per epoch and short last batches."""


def plain_client_loop(client, make_optimizer, loss):
    """One client's head (a linear layer) trained the plain way: its own optimizer, one batch per step, the mean
    of the loss over the batch."""
    weight = client.start["weight"].clone().requires_grad_(True)
    bias = client.start["bias"].clone().requires_grad_(True)
    optimizer = make_optimizer({"weight": weight, "bias": bias})
    for index in client.batches:
        optimizer.zero_grad()
        loss(F.linear(client.features[index], weight, bias), client.targets[index]).mean().backward()
        optimizer.step()
    return {"weight": weight.detach(), "bias": bias.detach()}


def sgd_with_decay_on_weights(head):
    return torch.optim.SGD(
        [{"params": [head["weight"]], "weight_decay": 1e-2}, {"params": [head["bias"]], "weight_decay": 0.0}],
        lr=0.3,
        momentum=0.5,
    )


def adam(head):
    return torch.optim.Adam(list(head.values()), lr=0.05)


def head_call(state, x):
    return F.linear(x, state["weight"], state["bias"])


def linear_clients(g):
    """Four clients of unequal sizes: a 7 -> 3 linear head each, 3 epochs of batch 4."""
    features = [torch.randn(n, 7, generator=g) for n in SIZES]
    targets = [torch.randint(0, 3, (n,), generator=g) for n in SIZES]
    starts = [{"weight": torch.randn(3, 7, generator=g), "bias": torch.randn(3, generator=g)} for _ in SIZES]
    batches = [[b for _ in range(3) for b in torch.randperm(n, generator=g).split(4)] for n in SIZES]
    return [ClientHead(*client) for client in zip(starts, features, targets, batches)]


def per_element_cross_entropy(out, y):
    """A loss of the user's own with a value per sample and class (its mean is the cross-entropy / 3)."""
    return -F.log_softmax(out, -1) * F.one_hot(y, 3)


@pytest.mark.parametrize(
    "loss", [NAMED_LOSSES["cross_entropy"], per_element_cross_entropy], ids=["named", "users-per-element"]
)
@pytest.mark.parametrize(
    "make_optimizer", [sgd_with_decay_on_weights, adam], ids=["sgd-momentum-decay", "adam"]
)
def test_every_client_trains_as_in_its_own_plain_loop(make_optimizer, loss):
    """Catches a padded sample counted in a client's mean (drop the mask), a client stepping after its last batch
    (momentum and Adam's moments keep moving it: step every lane), or another client's batches. SGD runs the
    engine's stacked update, Adam one optimizer per client over views; a named loss runs once over every
    client's samples, the user's own per client."""
    clients = linear_clients(torch.Generator().manual_seed(0))
    tuning = HeadFineTuning(head_call, {}, make_optimizer, loss, contextlib.nullcontext)
    got = heads_together.fit_heads_together(tuning, clients)
    for k, client in enumerate(clients):
        expected = plain_client_loop(client, make_optimizer, loss)
        for name in ("weight", "bias"):
            torch.testing.assert_close(got[k][name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make_optimizer", "loss", "why"),
    [
        (lambda h: torch.optim.LBFGS(list(h.values())), NAMED_LOSSES["cross_entropy"], "per-parameter"),
        (lambda h: torch.optim.SGD([h["weight"]], lr=0.1), NAMED_LOSSES["cross_entropy"], "exactly the head"),
        (adam, F.cross_entropy, "not one value per sample"),
    ],
    ids=["lbfgs", "optimizer-without-the-bias", "mean-reduced-loss"],
)
def test_what_would_not_be_one_client_at_a_time_is_refused_before_any_step(make_optimizer, loss, why):
    """A coupled optimizer, one that leaves a head tensor out, or a loss that averages the (padded) batch itself:
    ``NotBatchable`` before any client stepped (the callback then fine-tunes one client at a time)."""
    clients = linear_clients(torch.Generator().manual_seed(0))
    starts = [{n: t.clone() for n, t in c.start.items()} for c in clients]
    with pytest.raises(NotBatchable, match=why):
        heads_together.fit_heads_together(
            HeadFineTuning(head_call, {}, make_optimizer, loss, contextlib.nullcontext), clients
        )
    assert all(torch.equal(c.start[n], s[n]) for c, s in zip(clients, starts) for n in s)


def test_groups_stay_within_the_feature_budget():
    """Consecutive clients; a group's padded features (largest client x width x bytes) within the budget."""
    assert head_tuning.groups_by_bytes([4, 4, 4, 4], 10, budget=80) == [[0, 1], [2, 3]]
    assert head_tuning.groups_by_bytes([2, 9, 1], 10, budget=100) == [[0], [1], [2]]
    assert head_tuning.groups_by_bytes([3, 3, 3], 1, budget=10**6) == [[0, 1, 2]]


def unequal_datamodule():
    g = torch.Generator().manual_seed(1)
    train, test = [], []
    for n in (9, 17, 30, 12, 23):
        x = torch.randn(n + 6, 6, generator=g)
        y = ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()).long()
        train.append(TensorDataset(x[:n], y[:n]))
        test.append(TensorDataset(x[n:], y[n:]))
    return FederatedDataModule.from_client_datasets(train, test, batch_size=4)


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


class HeadDropoutNet(LossNet):
    """Dropout on the features, inside the declared head (the body stays a fixed function: features cached)."""

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(F.dropout(features, 0.3, training=self.training))

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def fine_tuned(model_class, start, monkeypatch, together=True, calls=None, cache=True, budget=None):
    """Per-client ``val/loss`` after one round with ``FineTunedEvaluation`` (3 epochs, momentum SGD) and its
    together-decision line; with ``together=False`` the batched path is switched off (one client at a time on
    the cached features); ``calls`` collects each group's size; ``budget`` bounds a group's padded features."""
    if not together:
        monkeypatch.setattr(FineTunedEvaluation, "_fit_heads_together", lambda self, *a: {})
    elif calls is not None:
        real = selection.fit_heads_together
        monkeypatch.setattr(selection, "fit_heads_together", lambda *a: calls.append(len(a[1])) or real(*a))
    if budget is not None:
        monkeypatch.setattr(finetuning, "HEADS_TOGETHER_BYTES", budget)
    callback = FineTunedEvaluation(epochs=3, lr=0.1, start=start, optimizer="sgd", cache_features=cache)
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=2)
    quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[callback]).fit(
        model_class(), datamodule=unequal_datamodule()
    )
    monkeypatch.undo()
    return strategy.client_metrics["val"].per_client("val/loss"), callback.together_decision


@pytest.mark.parametrize(
    ("start", "budget", "groups"),
    [("average", None, [5]), ("stored", None, [5]), ("average", 1200, [2, 1, 1, 1])],
    ids=["average", "stored", "groups-by-bytes"],
)
def test_fine_tuned_evaluation_fits_the_clients_together_as_one_at_a_time(start, budget, groups, monkeypatch):
    """The callback's batched path (the unequal federation in one group, or in groups of at most ``budget``
    bytes of padded 8-float features: clients of 9 and 17 samples together, then each alone) scores every client
    as one client at a time on the same cached features and as the full forward passes."""
    calls: list[int] = []
    together, decision = fine_tuned(LossNet, start, monkeypatch, calls=calls, budget=budget)
    assert calls == groups and "together (5 clients)" in decision
    alone, _ = fine_tuned(LossNet, start, monkeypatch, together=False)
    full, _ = fine_tuned(LossNet, start, monkeypatch, cache=False)
    assert together.keys() == alone.keys() == set(range(5))
    for client, value in alone.items():
        assert together[client] == pytest.approx(value, rel=1e-5)
        assert together[client] == pytest.approx(full[client], rel=1e-5)


def test_a_head_that_draws_random_numbers_is_fine_tuned_one_client_at_a_time(monkeypatch):
    """``vmap`` cannot batch the head's dropout: the callback falls back before any client stepped, says so, and
    scores as one client at a time (the same random draws in the same order)."""
    fallback, decision = fine_tuned(HeadDropoutNet, "average", monkeypatch)
    alone, _ = fine_tuned(HeadDropoutNet, "average", monkeypatch, together=False)
    assert "one client at a time (the head and loss cannot be batched over clients" in decision
    assert fallback == alone
