"""Local Only as the official ``main_local.py`` runs it, and ``evaluate_clients``.

``main_local.py`` restated: every client starts from the same initial model, trains ``--epochs`` passes
over its own data with one SGD optimizer (momentum 0.5, no weight decay) kept across the passes, and the
printed figure is the unweighted mean of the per-client test accuracies of the first ``min(100, n)`` clients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from tests.fixtures import TinyNet, client_batches, quiet_trainer, tiny_datamodule


def main_local(init, dm, epochs: int, scored: int) -> float:
    """The official Local Only figure: unweighted mean test accuracy of the first ``scored`` clients."""
    accuracies = []
    for cid in range(min(scored, dm.num_clients)):
        model = copy.deepcopy(init)
        opt = torch.optim.SGD(model.parameters(), lr=init.hparams.lr, momentum=0.5)
        steps = epochs * math.ceil(dm.client_num_samples(cid) / dm.batch_size)
        for x, y in client_batches(dm, dm.seed, 0, cid, steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        test = dm.client_data(cid, "test")
        x, y = (t[test.indices] for t in test.dataset.tensors)
        with torch.no_grad():
            accuracies.append(float((model(x).argmax(1) == y).float().mean()))
    return sum(accuracies) / len(accuracies)


def test_local_only_official_protocol_matches_main_local():
    """Catches: ``evaluate_clients`` ignored (every client scored), a sample-weighted mean, or Local Only
    not training every client for all ``local_epochs`` in its one round: the strategy's ``val/acc`` after
    one round of E epochs, scoring the first 3 clients, equals ``main_local.py``'s figure."""
    torch.manual_seed(0)
    init = TinyNet(weight_decay=0.0)
    dm = tiny_datamodule(num_clients=8, seed=3)
    dm.setup()
    strategy = FedRepStrategy(
        head="classifier",
        algorithm="local",
        clients_per_round=1.0,
        local_epochs=3,
        evaluate_clients=3,
        seed=0,
    )
    quiet_trainer(strategy=strategy, max_epochs=1).fit(copy.deepcopy(init), datamodule=dm)
    assert strategy.evaluated_clients == [0, 1, 2]
    expected = main_local(init, dm, epochs=3, scored=3)
    assert strategy.results()["final"]["val/acc"] == pytest.approx(expected, abs=1e-6)
    assert expected != pytest.approx(main_local(init, dm, epochs=3, scored=8), abs=1e-6)


def test_evaluate_clients_must_be_a_positive_int_naming_the_argument():
    with pytest.raises(ValueError, match="evaluate_clients"):
        FedRepStrategy(head="classifier", evaluate_clients=0)
