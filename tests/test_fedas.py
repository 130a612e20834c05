"""FedAS against a plain PyTorch loop restating PFLlib's ``clientas.py``/``serveras.py`` (the authors' code).

The reference keeps, per client, its model (body and head; the initial model until it trains) and at each of its
rounds: collects the prototypes of its own body over a shuffled pass of batches of 16 (last partial batch dropped),
aligns a deep copy of the global model's body with ``torch.optim.SGD(lr=0.01)`` on ``nn.MSELoss`` per class
present (PFLlib's loop, the prototype broadcast over the class's rows), copies the aligned body into its model,
trains with the module's optimizer on the loader's batch order (re-derived by ``client_batches``), then sums the
squared gradients of the batch-mean NLL over a shuffled pass of training batches in eval mode. The server averages
the bodies with weights ``F_i / sum F_j``. The three shuffles are the documented seeded draws
``randperm(n)`` from ``(seed, round, 0x57A7, client, crc32(key))`` (the reference's DataLoader shuffles replaced by
them in both). Partial participation (3 of 5 clients) covers round 0's alignment (global = initial model) and a
client whose first round comes later (its prototypes from the initial body).
"""

from __future__ import annotations

import copy
import math
import zlib

import pytest
import torch
from torch import nn
from torch.autograd import grad
from torch.nn import functional as F

from lightning_fedrep import FedAS, FederatedStrategy
from lightning_fedrep.federation.algorithms.fedas import FISHER, FisherMean
from lightning_fedrep.federation.api.aggregation import ClientUpdate
from lightning_fedrep.federation.api.registry import ALGORITHMS
from tests.fixtures import (
    client_batches,
    quiet_trainer,
    reference_clients,
    reference_generator,
    tiny_datamodule,
)
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, DATA_SEED, ROUNDS, LOCAL_EPOCHS, BATCH = 5, 3, 4, 3, 3, 1, 8


def shuffled(x, y, round_index, client, key, size):
    """The seeded shuffled pass in batches of ``size``, the last partial batch dropped."""
    generator = reference_generator(SEED, round_index, 0x57A7, client, zlib.crc32(key.encode()))
    order = torch.randperm(len(x), generator=generator)
    return [(x[order[i : i + size]], y[order[i : i + size]]) for i in range(0, len(x) - size + 1, size)]


def set_parameters(model, global_model, x, y, round_index, client, broken=None):
    """``clientAS.set_parameters`` (PFLlib), on the client's samples."""
    protos = [[] for _ in range(4)]
    source = global_model if broken == "global-prototypes" else model
    for xb, yb in shuffled(x, y, round_index, client, "fedas.prototypes", 16):
        with torch.no_grad():
            batch = source.body(xb)
        for proto, label in zip(batch, yb):
            protos[label.item()].append(proto)
    means = [torch.stack(p).mean(dim=0) if p else None for p in protos]
    aligned = copy.deepcopy(global_model)
    optimizer = torch.optim.SGD(aligned.body.parameters(), lr=0.01)
    for xb, yb in shuffled(x, y, round_index, client, "fedas.alignment.0", 16):
        features = aligned.body(xb)
        loss = 0
        for label in yb.unique():
            if means[label.item()] is not None:
                rows = features[yb == label]
                if broken == "batch-mean":  # FL-bench's variant: the class's batch-mean feature
                    loss += F.mse_loss(rows.mean(0), means[label.item()])
                else:
                    loss += F.mse_loss(rows, means[label.item()].expand_as(rows))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for new, old in zip(aligned.body.parameters(), model.body.parameters()):
        old.data = new.data.clone()


def fisher(model, x, y, round_index, client):
    """The Fisher trace of ``clientAS.train`` (eval mode, batch-mean NLL, every parameter)."""
    model.eval()
    total = 0.0
    for xb, yb in shuffled(x, y, round_index, client, "fedas.fisher", BATCH):
        nll = -F.log_softmax(model(xb), dim=1)[range(len(yb)), yb].mean()
        total += sum(float(torch.sum(g**2)) for g in grad(nll, list(model.parameters())))
    model.train()
    return total


def plain_fedas(init, dm, broken=None):
    """The FedAS run written out; returns the global model, every client's model and the round-0 traces."""
    global_model = copy.deepcopy(init)
    models = [copy.deepcopy(init) for _ in range(NUM_CLIENTS)]
    traces = {}
    for r in range(ROUNDS):
        uploads = []
        for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            data = dm.client_data(c)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            model = models[c]
            set_parameters(model, global_model, x, y, r, c, broken)
            optimizer = model.configure_optimizers()
            steps = LOCAL_EPOCHS * math.ceil(len(data) / BATCH)
            for xb, yb in client_batches(dm, DATA_SEED, r, c, steps):
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            traces[r, c] = fisher(model, x, y, r, c)
            uploads.append((len(data) if broken == "sample-weights" else traces[r, c], model))
        total = sum(w for w, _ in uploads)
        with torch.no_grad():
            for n, p in global_model.body.named_parameters():
                mean = sum(w * dict(m.body.named_parameters())[n].double() for w, m in uploads) / total
                p.copy_(mean.to(p.dtype))
    return global_model, models, traces


def fit(runner="sequential", algorithm=None, rounds=ROUNDS):
    torch.manual_seed(0)
    init = LossNet()
    dm = tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=BATCH, seed=DATA_SEED)
    strategy = FederatedStrategy(
        algorithm=algorithm or FedAS(),
        head="classifier",
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(copy.deepcopy(init), datamodule=dm)
    dm.setup()
    return strategy, init, dm


def differences(strategy, reference):
    """The largest difference of the global body and of each client's scored model (its own body, its head)."""
    global_model, models, _ = reference
    gaps = [
        float((strategy.global_tensors()[f"body.{n}"] - p.detach()).abs().max())
        for n, p in global_model.body.named_parameters()
    ]
    for c, model in enumerate(models):
        scored = dict(strategy.client_model(c).named_parameters())
        gaps += [float((scored[n] - p).detach().abs().max()) for n, p in model.named_parameters()]
    return max(gaps)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedas_equals_pfllibs_loop(runner):
    """Golden test. Fails if the prototypes come from the global body, the alignment's MSE is FL-bench's batch
    mean, the server weights by samples (the planted bugs below), or the alignment, the own-body slot, the Fisher
    pass or its shuffle differ from the reference's."""
    strategy, init, dm = fit(runner)
    assert strategy.runner_report.runner == runner
    reference = plain_fedas(init, dm)
    rounds_of = {c: [r for r, cc in reference[2] if cc == c] for c in range(NUM_CLIENTS)}
    assert any(rs and rs[0] > 0 for rs in rounds_of.values())  # a first participation after round 0
    assert differences(strategy, reference) < 1e-5
    means = [strategy.federation.history.recorded(r)["fedas/fisher_trace"] for r in range(ROUNDS)]
    expected = [sum(t for (r, _), t in reference[2].items() if r == i) / PER_ROUND for i in range(ROUNDS)]
    assert means == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("broken", ["global-prototypes", "batch-mean", "sample-weights"])
def test_the_golden_test_sees_a_planted_bug(broken):
    """The comparison above is sharp: each detail of the rule changed in the reference moves the result."""
    strategy, init, dm = fit("sequential")
    assert differences(strategy, plain_fedas(init, dm, broken)) > 1e-4


def test_fisher_mean_weights_by_the_trace_and_skips_a_zero_trace():
    like = {"w": torch.zeros(2), FISHER: torch.zeros((), dtype=torch.float64)}
    mean = FisherMean(like)
    for client, (w, trace) in enumerate([([1.0, 2.0], 3.0), ([5.0, 6.0], 1.0), ([9.0, 9.0], 0.0)]):
        upload = {"w": torch.tensor(w), FISHER: torch.tensor(trace, dtype=torch.float64)}
        mean.add(ClientUpdate(client, 0, 100.0, 100, 1, upload))
    torch.testing.assert_close(mean.result()["w"], torch.tensor([2.0, 3.0]))
    assert mean.weight == 4.0


def test_fedas_by_name_bad_arguments_and_a_module_without_a_feature_split():
    assert isinstance(ALGORITHMS["fedas"], FedAS) and ALGORITHMS["fedas"].shares == {"body"}
    assert "fedas_ddp" in __import__("lightning").pytorch.strategies.StrategyRegistry
    assert repr(FedAS()) == "FedAS(alignment_lr=0.01, alignment_epochs=1, alignment_batch_size=16)"
    with pytest.raises(ValueError, match=r"FedAS\(alignment_batch_size=...\)"):
        FedAS(alignment_batch_size=0)
    with pytest.raises(ValueError, match=r"FedAS\(alignment_lr=...\)"):
        FedAS(alignment_lr=-1.0)

    class Tangled(LossNet):
        def forward(self, x):
            return self.classifier(self.body(x)) + self.body(x)[:, :4]

    torch.manual_seed(0)
    strategy = FederatedStrategy(algorithm=FedAS(), head="classifier", clients_per_round=2, local_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with pytest.raises(
        ValueError, match=r"FedAS \(it aligns the body's features\) needs the module as head\(features\(x\)\)"
    ):
        trainer.fit(Tangled(), datamodule=tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=BATCH))


def test_alignment_epochs_zero_starts_from_the_global_body():
    """With no alignment pass a client starts from the global body: after one round of a single client, its own
    body trained from the initial body (the round-0 global one) equals plain training from the initial model."""
    strategy, init, dm = fit("sequential", algorithm=FedAS(alignment_epochs=0), rounds=1)
    (c, *_) = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, 0)
    model = copy.deepcopy(init)
    optimizer = model.configure_optimizers()
    steps = LOCAL_EPOCHS * math.ceil(len(dm.client_data(c)) / BATCH)
    for xb, yb in client_batches(dm, DATA_SEED, 0, c, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    scored = dict(strategy.client_model(c).named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(scored[n], p.detach(), rtol=0, atol=1e-6)
    assert isinstance(model, nn.Module)


def test_fedas_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedAS (``tests/scripts/algorithms_run.py``), 2 rounds, every client: each rank reads the prototypes, the
    alignment and the Fisher pass from the samples of the clients it trains, and the Fisher-weighted sums cross the
    processes. The global body, every client's own body and head, and the mean Fisher trace on 2 processes equal the
    1-process run. Fails when a rank reads another client's samples or the weights stay per process."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedas"]
    assert all(row["fedas/fisher_trace"] > 0 for row in single["history"])
    for held in (rank["fedas"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-5, atol=1e-6)
        for got, expected in zip(held["history"], single["history"]):
            assert got["fedas/fisher_trace"] == pytest.approx(expected["fedas/fisher_trace"], rel=1e-5)
