"""FedALA against a plain PyTorch loop restating the authors' ``ALA.py`` (``TsingZ0/FedALA``, as PFLlib runs it).

The reference keeps, per client, its model after its last training, ``W`` and the ``start_phase`` flag, and at each
participation runs ALA the way the authors' code does (parameter lists in module order, a deep-copied temporary
model, ``backward()`` and ``param.grad``, ``np.std``), then trains with the module's SGD on the loader's batch order
(re-derived by ``client_batches``); the server takes the sample-weighted mean. The sample's offset is the one
documented seeded draw, ``randint(0, n - k + 1)`` from ``(seed, round, 0x57A7, client, crc32("fedala"))``, restated
(the reference's Python ``random.randint`` is replaced by it in both). Partial participation (3 of 5 clients) covers
round 0's skip, a first ALA that repeats passes until the losses settle, later single passes, and a client whose
first participation comes after round 0 (its kept model is the initial one).
"""

from __future__ import annotations

import copy
import math
import zlib

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedALA, FederatedStrategy
from lightning_fedrep.federation.api.registry import ALGORITHMS
from tests.fixtures import (
    client_batches,
    quiet_trainer,
    reference_clients,
    reference_generator,
    tiny_datamodule,
)
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, DATA_SEED, ROUNDS, LOCAL_EPOCHS, BATCH = 5, 3, 4, 3, 4, 1, 8
ETA, PERCENT, LAYER_IDX, THRESHOLD, NUM_PRE_LOSS = 1.0, 80, 2, 0.1, 10


class Client:
    """One client of the reference: its model (after its last training), W, start_phase (the authors' names)."""

    def __init__(self, init):
        self.model = copy.deepcopy(init)
        self.weights = None
        self.start_phase = True


def offset_of(round_index, client, n, k):
    generator = reference_generator(SEED, round_index, 0x57A7, client, zlib.crc32(b"fedala"))
    return int(torch.randint(0, n - k + 1, (), generator=generator))


def reference_ala(client, global_model, x, y, round_index, cid, broken=None):
    """``ALA.adaptive_local_aggregation`` of the authors' code, on the client's slice; returns what happened."""
    k = int(PERCENT / 100 * len(x))
    start = 0 if broken == "offset-0" else offset_of(round_index, cid, len(x), k)
    xs, ys = x[start : start + k], y[start : start + k]
    params_g = list(global_model.parameters())
    params = list(client.model.parameters())
    if torch.sum(params_g[0] - params[0]) == 0:
        return "skipped"
    for param, param_g in zip(params[:-LAYER_IDX], params_g[:-LAYER_IDX]):
        param.data = param_g.data.clone()
    model_t = copy.deepcopy(client.model)
    params_t = list(model_t.parameters())
    params_p, params_gp, params_tp = params[-LAYER_IDX:], params_g[-LAYER_IDX:], params_t[-LAYER_IDX:]
    for param in params_t[:-LAYER_IDX]:
        param.requires_grad = False
    if client.weights is None:
        client.weights = [torch.ones_like(p.data) for p in params_p]
    for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, client.weights):
        param_t.data = param + (param_g - param) * weight
    losses, kind = [], "first" if client.start_phase else "later"
    while True:
        for i in range(0, k, BATCH):
            for p in params_tp:
                p.grad = None
            loss_value = F.cross_entropy(model_t(xs[i : i + BATCH]), ys[i : i + BATCH])
            loss_value.backward()
            for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, client.weights):
                update = ETA * (param_t.grad * (param_g - param))
                weight.data = weight - update if broken == "no-clip" else torch.clamp(weight - update, 0, 1)
            for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, client.weights):
                param_t.data = param + (param_g - param) * weight
        losses.append(loss_value.item())
        if not client.start_phase or broken == "one-pass":
            break
        if len(losses) > NUM_PRE_LOSS and np.std(losses[-NUM_PRE_LOSS:]) < THRESHOLD:
            break
    client.start_phase = False
    for param, param_t in zip(params_p, params_tp):
        param.data = param_t.data.clone()
    return f"{kind} ({len(losses)} passes)"


def plain_fedala(init, dm, broken=None):
    """The FedALA run written out; returns the global model, the clients, and what ALA did per (round, client)."""
    global_model = copy.deepcopy(init)
    clients = [Client(init) for _ in range(NUM_CLIENTS)]
    events = {}
    for r in range(ROUNDS):
        total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in global_model.named_parameters()}
        weight = 0
        for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            data = dm.client_data(c)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            events[r, c] = reference_ala(clients[c], global_model, x, y, r, c, broken)
            model = clients[c].model
            optimizer = model.configure_optimizers()
            steps = LOCAL_EPOCHS * math.ceil(len(data) / BATCH)
            for xb, yb in client_batches(dm, DATA_SEED, r, c, steps):
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            for n, p in model.named_parameters():
                total[n] += len(data) * p.detach().double()
            weight += len(data)
        with torch.no_grad():
            for n, p in global_model.named_parameters():
                p.copy_((total[n] / weight).to(p.dtype))
    return global_model, clients, events


def fit(runner="sequential", algorithm=None, rounds=ROUNDS):
    torch.manual_seed(0)
    init = LossNet()
    dm = tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=BATCH, seed=DATA_SEED)
    strategy = FederatedStrategy(
        algorithm=algorithm or FedALA(),
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
    """The largest difference of the global model, each client's kept model and W, and whether ``started``
    differs."""
    global_model, clients, _ = reference
    state = strategy.federation.store.client_state
    gaps = [
        float((strategy.global_tensors()[n] - p.detach()).abs().max())
        for n, p in global_model.named_parameters()
    ]
    for c, client in enumerate(clients):
        named = list(client.model.named_parameters())
        gaps += [float((state(c)[f"kept.{n}"] - p.detach()).abs().max()) for n, p in named]
        if client.weights is not None:
            higher = [n for n, _ in named][-LAYER_IDX:]
            gaps += [
                float((state(c)[f"ala_weights.{n}"] - w).abs().max()) for n, w in zip(higher, client.weights)
            ]
        gaps.append(float(float(state(c)["ala_started"]) != (not client.start_phase)))
    return max(gaps)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedala_equals_the_authors_ala_in_a_plain_loop(runner):
    """Golden test. Fails if the lower tensors are not overwritten with the global ones, W is not clipped to
    [0, 1], the first ALA runs one pass (or later ones repeat), the slice is not the seeded contiguous 80% slice,
    the zero-sum skip is missing (round 0 would blend), or the kept model is not the end of the last training."""
    strategy, init, dm = fit(runner)
    assert strategy.runner_report.runner == runner
    reference = plain_fedala(init, dm)
    kinds = set(reference[2].values())
    assert "skipped" in kinds and any(k.startswith("later") for k in kinds), reference[2]
    assert any(k.startswith("first") and int(k.split("(")[1].split()[0]) > NUM_PRE_LOSS for k in kinds)
    first_rounds = {c: min(r for r, cc in reference[2] if cc == c) for c in range(NUM_CLIENTS)}
    assert max(first_rounds.values()) > 0  # a client joins after round 0 and blends its initial model
    assert differences(strategy, reference) < 1e-5


@pytest.mark.parametrize("broken", ["offset-0", "no-clip", "one-pass"])
def test_the_golden_test_sees_a_planted_bug(broken):
    """The comparison above is sharp: each detail of the rule changed in the reference moves the result."""
    strategy, init, dm = fit("sequential")
    assert differences(strategy, plain_fedala(init, dm, broken)) > 1e-4


def test_round_zero_is_skipped_and_the_weights_persist():
    """In round 0 every client holds the initial model (g - l sums to 0): ALA is skipped, W stays ones and
    ``ala_started`` 0; a client that blended keeps W in [0, 1] between rounds."""
    strategy, _, _ = fit("sequential", rounds=1)
    for c in range(NUM_CLIENTS):
        state = strategy.federation.store.client_state(c)
        assert float(state["ala_started"]) == 0
        assert all(bool((state[n] == 1).all()) for n in state if n.startswith("ala_weights."))


def test_fedala_by_name_and_bad_arguments():
    assert isinstance(ALGORITHMS["fedala"], FedALA) and ALGORITHMS["fedala"].shares == {"body", "head"}
    assert repr(FedALA()) == "FedALA(eta=1.0, rand_percent=80, layer_idx=2, threshold=0.1, num_pre_loss=10)"
    with pytest.raises(ValueError, match=r"FedALA\(rand_percent=...\)"):
        FedALA(rand_percent=120)
    with pytest.raises(ValueError, match=r"FedALA\(layer_idx=...\)"):
        FedALA(layer_idx=0)
    with pytest.raises(ValueError, match=r"FedALA\(layer_idx=7\) .* trains 6: pass layer_idx <= 6"):
        fit("sequential", algorithm=FedALA(layer_idx=7), rounds=1)


def test_fedala_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedALA (``tests/scripts/algorithms_run.py``), 2 rounds, every client: round 1's first ALA reads each client's
    training samples on the rank that trains it. The global model, every client's kept model, W and flag on 2
    processes equal the 1-process run. Fails when a rank reads another client's samples or a client's W stays on
    the rank that trained it."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedala"]
    assert all(float(t["ala_started"]) == 1 for t in single["declared"].values())
    assert any(
        bool((t[n] < 1).any()) for t in single["declared"].values() for n in t if n.startswith("ala_w")
    )
    for held in (rank["fedala"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)


def test_evaluation_scores_each_clients_kept_model():
    """The scored model of a client is its model after its last training (the ``kept`` slot), not the global one."""
    strategy, _, _ = fit("sequential", rounds=2)
    state = strategy.federation.store.client_state(0)
    scored = dict(strategy.client_model(0).named_parameters())
    for name, value in scored.items():
        torch.testing.assert_close(value.detach(), state[f"kept.{name}"], rtol=0, atol=0)
    assert any(not torch.equal(strategy.global_tensors()[n], v.detach()) for n, v in scored.items())
