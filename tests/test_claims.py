"""The documented claims (docs/concepts.md), each against an independent reference (issue 24, items 1, 2, 3 and 5).

- ``weighting``: the body is the sample-weighted mean of the clients' bodies, or their plain mean under
  ``weighting="uniform"`` — told apart with clients of unequal sizes, each against a plain PyTorch loop;
- ``*_last10``: the mean of exactly the last 10 validated rounds, over more than 10 rounds;
- client sampling: uniform without replacement, seeded by ``(seed, round)`` — the library's draws equal
  the rule restated in ``tests/fixtures.py`` and have its statistical properties;
- buffers (BatchNorm statistics): averaged by samples with the body by default, each client's own under
  ``buffers="local"``, against a plain PyTorch loop.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FedRepStrategy
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, reference_clients

SIZES = (6, 14, 30, 50)
"""Unequal client sizes: sample weighting and the plain mean give different bodies. With batches of 8
every client's last batch has at least 2 samples (BatchNorm's training mode needs 2)."""


class BatchNormTinyNet(TinyNet):
    """``TinyNet`` with a BatchNorm layer in the body (its running statistics are buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU()
        )


def unequal_datamodule(sizes=SIZES, seed: int = 0) -> FederatedDataModule:
    """Clients with ``sizes`` training samples each (and 8 test samples), labels from the tiny rule."""
    g = torch.Generator().manual_seed(seed)

    def dataset(n: int, shift: float) -> TensorDataset:
        x = torch.randn(n, 6, generator=g) + shift
        return TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())

    # a different input shift per client: their BatchNorm statistics differ
    train = [dataset(n, 0.5 * i) for i, n in enumerate(sizes)]
    test = [dataset(8, 0.5 * i) for i in range(len(sizes))]
    dm = FederatedDataModule.from_client_datasets(train, test, batch_size=8, seed=seed)
    dm.setup()
    return dm


def plain_fedrep(init, dm, rounds: int, per_round: int, seed: int, weighting: str, buffers: str):
    """FedRep written out with the documented rules (docs/concepts.md): each round, ``reference_clients`` train one head epoch
    (body frozen) then one body epoch (head frozen) with a fresh SGD; the server's body is the mean of the
    clients' bodies weighted by their training samples (``"samples"``) or equally (``"uniform"``);
    buffers go with the body (``"shared"``) or stay with each client (``"local"``).
    Returns the global state and each client's own state."""
    start = init.state_dict()
    buffer_names = {n for n, _ in init.named_buffers()}
    local_names = set(HEAD) | (buffer_names if buffers == "local" else set())
    global_state = {k: v.clone() for k, v in start.items() if k not in local_names}
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(rounds):
        trained, weights = [], []
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            model = copy.deepcopy(init)
            state = {k: v.clone() for k, v in start.items()}
            state.update(clients.get(cid, {}))
            state.update(global_state)
            model.load_state_dict(state)
            model.train()
            opt = model.configure_optimizers()
            per_epoch = math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            batches = client_batches(dm, dm.seed, r, cid, 2 * per_epoch)
            for part in ("head", "body"):
                for name, p in model.named_parameters():
                    p.requires_grad_((name in HEAD) == (part == "head"))
                for _ in range(per_epoch):
                    x, y = next(batches)
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            after = {k: v.detach().clone() for k, v in model.state_dict().items()}
            clients[cid] = {k: v for k, v in after.items() if k in local_names}
            trained.append(after)
            weights.append(float(dm.client_num_samples(cid)) if weighting == "samples" else 1.0)
        total = sum(weights)
        for k, ref in global_state.items():
            mean = sum(w * s[k].double() for w, s in zip(weights, trained)) / total
            global_state[k] = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
    return global_state, clients


def fit(model, dm, **strategy_kwargs) -> FedRepStrategy:
    """Two rounds of FedRep (one head epoch, one body epoch) on ``dm``, no validation."""
    strategy = FedRepStrategy(head="classifier", head_epochs=1, body_epochs=1, **strategy_kwargs)
    quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0).fit(model, datamodule=dm)
    return strategy


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ----------------------------------------------------------------------------- item 1: weighting


@pytest.mark.parametrize("weighting,other", [("samples", "uniform"), ("uniform", "samples")])
def test_weighting_averages_bodies_by_samples_or_plainly_with_unequal_clients(weighting, other):
    """The global body equals the plain loop's mean with ``weighting``'s weights and not the other's.

    Catches: ``Federation.weight_of`` ignoring the setting (``return float(...[client])`` for both,
    or ``1.0`` for both) — the ``uniform`` case, or the ``samples`` one, fails."""
    torch.manual_seed(0)
    init = TinyNet()
    dm = unequal_datamodule()
    model = copy.deepcopy(init)
    fit(model, dm, clients_per_round=3, seed=5, weighting=weighting)
    got = {k: v for k, v in model.state_dict().items() if k not in HEAD}
    expected, _ = plain_fedrep(init, dm, 2, 3, 5, weighting, "shared")
    wrong, _ = plain_fedrep(init, dm, 2, 3, 5, other, "shared")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert max_difference(expected, wrong) > 1e-3  # the two weightings are told apart here


# ----------------------------------------------------------------------------- item 2: last 10 rounds


class LoggedEveryRound(L.Callback):
    """What was logged after each round's validation, read from ``trainer.callback_metrics``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_last10_is_the_mean_of_exactly_the_last_10_validated_rounds():
    """Over 15 validated rounds, ``results()["last10"]`` and the logged ``val/..._last10`` are the mean of
    the last 10 rounds' logged values (and, before round 10, of all rounds so far).

    Catches: ``History.last_rounds_mean`` averaging the first 10 (``[:LAST_ROUNDS]``) or every round
    (``[-LAST_ROUNDS:]`` dropped), or ``LAST_ROUNDS = 5``."""
    torch.manual_seed(0)
    dm = unequal_datamodule(sizes=(16, 24, 16, 24))
    logged = LoggedEveryRound()
    strategy = FedRepStrategy(head="classifier", head_epochs=1, body_epochs=1, clients_per_round=2, seed=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=15, callbacks=[logged])
    trainer.fit(TinyNet(lr=0.2), datamodule=dm)
    assert len(logged.rows) == 15
    for key in ("val/loss", "val/acc", "val/loss_weighted"):
        per_round = np.array([row[key] for row in logged.rows])
        assert [row[key] for row in strategy.history] == pytest.approx(per_round.tolist(), rel=1e-6)
        for r, row in enumerate(logged.rows):
            assert row[f"{key}_last10"] == pytest.approx(per_round[max(0, r - 9) : r + 1].mean(), rel=1e-6)
        assert strategy.results()["last10"][key] == pytest.approx(per_round[-10:].mean(), rel=1e-6)
    assert strategy.results()["last10_rounds"]["rounds"] == 10
    losses = np.array([row["val/loss"] for row in logged.rows])
    for wrong in (losses.mean(), losses[:10].mean(), losses[-9:].mean(), losses[-11:].mean()):
        assert abs(wrong - losses[-10:].mean()) > 1e-5  # other windows would be told apart


# ----------------------------------------------------------------------------- item 3: client sampling

NUM_CLIENTS, PER_ROUND, ROUNDS = 20, 5, 400


def sampled(seed: int) -> list[list[int]]:
    """The clients a strategy with ``seed`` plans for rounds 0..ROUNDS-1 (after a one-round fit)."""
    dm = unequal_datamodule(sizes=(6,) * NUM_CLIENTS)
    strategy = FedRepStrategy(
        head="classifier", head_epochs=1, body_epochs=1, clients_per_round=PER_ROUND, seed=seed
    )
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(TinyNet(), datamodule=dm)
    return [sorted(strategy.round_plan(r).clients) for r in range(ROUNDS)]


@pytest.fixture(scope="module")
def draws() -> dict[str, list[list[int]]]:
    return {"seed 11": sampled(11), "seed 11 again": sampled(11), "seed 12": sampled(12)}


def test_sampler_follows_the_documented_rule(draws):
    """Every round's clients are those of the rule restated in ``tests/fixtures.reference_clients``.

    Catches: any change to the draw (another generator key, ``[:k]`` of another permutation, unsorted)."""
    for r, clients in enumerate(draws["seed 11"]):
        assert clients == reference_clients(NUM_CLIENTS, PER_ROUND, 11, r), f"round {r}"


def test_sampler_draws_other_clients_every_round(draws):
    """Rounds draw different client sets: of 400 draws of 5 of 20 clients (15504 sets), fewer than 20
    repeat an earlier set (about 5 expected).

    Catches: ``sample_clients`` seeded without the round (``round_generator(seed, 0)``)."""
    rounds = draws["seed 11"]
    assert all(len(set(c)) == PER_ROUND and all(0 <= i < NUM_CLIENTS for i in c) for c in rounds)
    assert len({tuple(c) for c in rounds}) > ROUNDS - 20
    assert sum(a != b for a, b in zip(rounds, rounds[1:])) > ROUNDS - 5


def test_sampler_picks_every_client_equally_often(draws):
    """Over 400 rounds each client's count is Binomial(400, 1/4): within 5 standard deviations of 100
    (a false alarm has probability < 1e-5), and the counts' chi-square (19 degrees of freedom) is below
    its 0.999 quantile, 43.8.

    Catches: a sampler that never picks the last client (``torch.randperm(num_clients - 1, ...)``) or
    favours high ids (``torch.multinomial(torch.arange(1.0, num_clients + 1), k, generator=...)``)."""
    counts = Counter(c for clients in draws["seed 11"] for c in clients)
    mean = ROUNDS * PER_ROUND / NUM_CLIENTS
    sd = math.sqrt(ROUNDS * (PER_ROUND / NUM_CLIENTS) * (1 - PER_ROUND / NUM_CLIENTS))
    for client in range(NUM_CLIENTS):
        assert abs(counts[client] - mean) < 5 * sd, f"client {client}: {counts[client]} of ~{mean:.0f}"
    chi2 = sum((counts[c] - mean) ** 2 / mean for c in range(NUM_CLIENTS))
    assert chi2 < 43.8


def test_sampler_is_reproduced_by_seed_and_round_and_differs_across_seeds(draws):
    """The same ``(seed, round)`` gives the same clients in a new strategy; another seed other clients.

    Catches: a draw from the global RNG (``generator=`` dropped) or one that ignores the seed
    (``round_generator(0, round_index)``)."""
    assert draws["seed 11"] == draws["seed 11 again"]
    differ = sum(a != b for a, b in zip(draws["seed 11"], draws["seed 12"]))
    assert differ > ROUNDS - 20


# ----------------------------------------------------------------------------- item 5: buffers


def running_stats(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running_" in k or "num_batches_tracked" in k}


def test_shared_buffers_are_the_sample_weighted_mean_of_the_clients():
    """With the default ``buffers="shared"`` the global BatchNorm statistics equal the plain loop's
    sample-weighted mean of the round's clients' statistics.

    Catches: buffers left out of the average (``resolve_layout`` putting them in ``local`` always) or
    averaged plainly (``weight_of`` returning ``1.0``)."""
    torch.manual_seed(0)
    init = BatchNormTinyNet()
    dm = unequal_datamodule()
    model = copy.deepcopy(init)
    strategy = fit(model, dm, clients_per_round=3, seed=5)
    expected, clients = plain_fedrep(init, dm, 2, 3, 5, "samples", "shared")
    got = strategy.global_tensors()
    stats = running_stats(expected)
    assert set(stats) <= set(got) and stats
    for name, value in stats.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    uniform, _ = plain_fedrep(init, dm, 2, 3, 5, "uniform", "shared")
    assert max_difference(running_stats(uniform), stats) > 1e-3  # plain and weighted means differ here
    assert max_difference(running_stats(init.state_dict()), stats) > 1e-3


def test_local_buffers_keep_each_clients_own_statistics():
    """With ``buffers="local"`` every client's BatchNorm statistics are its own plain-loop values (the
    module's initial ones for a client that never trained), not an average.

    Catches: ``buffers="local"`` ignored (``resolve_layout`` testing ``buffers == "shared" or True``)."""
    torch.manual_seed(0)
    init = BatchNormTinyNet()
    dm = unequal_datamodule()
    strategy = fit(copy.deepcopy(init), dm, clients_per_round=3, seed=5, buffers="local")
    shared, clients = plain_fedrep(init, dm, 2, 3, 5, "samples", "local")
    assert len(clients) == 4  # every client trained in one of the two rounds
    initial = running_stats(init.state_dict())
    for cid in range(dm.num_clients):
        got = strategy.client_state_dict(cid)
        own = {**initial, **running_stats(clients.get(cid, {}))}
        for name, value in own.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"client {cid} {name}")
        for name, value in shared.items():  # the body is still shared
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"client {cid} {name}")
    means = [clients[c]["body.1.running_mean"] for c in range(4)]
    assert min(float((a - b).abs().max()) for i, a in enumerate(means) for b in means[i + 1 :]) > 1e-3
