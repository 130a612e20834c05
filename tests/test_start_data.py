"""``ClientStart.data``: the client's training samples, read by ``Algorithm.start_client`` (FedALA's blend weights,
FedAS's alignment and FedPAC's statistics read them the same way), and ``ClientEnd.data``, read by
``Algorithm.finish_client`` after training (FedAS's Fisher information).

An algorithm reads, at each client's start, all its samples in order (batches of 7), a shuffled pass (batches of
5, the last partial one dropped) drawn from ``data.generator("order")``, and a contiguous slice; it stores the
first read's sum of inputs as a declared tensor (a start outcome computed from the data) and records what it read;
its finish reads a shuffled pass in the round's batch size with another key.
Compared with the client's rows of the data module, the generator restated from the documented seeding rule
``(seed, round, 0x57A7, client, crc32(key))``, on both runners.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.data.low_rank import FreshSampleRoundLoader, make_low_rank_problem
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome, ClientSamples, StartOutcome
from tests.fixtures import quiet_trainer, reference_clients, reference_generator, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS = 5, 3, 4, 2


class ReadsData(Algorithm):
    """FedAvg whose start reads the client's training samples three ways and keeps the sum of its inputs."""

    client_tensors = (ClientTensors("input_sum", shapes=(6,)),)

    def __init__(self):
        super().__init__("reads_data", {"body", "head"}, "FedAvg reading each client's data at its start")
        self.seen: dict[tuple[int, int], dict] = {}

    def start_client(self, start):
        data = start.data
        ordered = list(data.batches(batch_size=7))
        order = torch.randperm(data.num_samples, generator=data.generator("order"))
        shuffled = list(data.batches(order, batch_size=5, drop_last=True))
        sliced = list(data.batches(torch.arange(2, 9)))
        self.seen[start.round, start.client] = {
            "sizes": [len(x) for x, _ in ordered],
            "x": torch.cat([x for x, _ in ordered]),
            "y": torch.cat([y for _, y in ordered]),
            "shuffled": torch.cat([x for x, _ in shuffled]),
            "shuffled_sizes": [len(x) for x, _ in shuffled],
            "sliced": torch.cat([x for x, _ in sliced]),
            "batch_size": data.batch_size,
            "device": ordered[0][0].device,
        }
        return StartOutcome(client_state={"input_sum": torch.cat([x for x, _ in ordered]).sum(0)})

    def finish_client(self, end):
        """``ClientEnd.data``: the same samples after training, a shuffled pass drawn with another key."""
        order = torch.randperm(end.data.num_samples, generator=end.data.generator("after"))
        shuffled = list(end.data.batches(order, drop_last=True))
        self.seen[end.round, end.client]["after"] = torch.cat([x for x, _ in shuffled])
        return ClientOutcome(upload=end.shared())


class ReadsDataAtTheEnd(ReadsData):
    """Also reads, at each client's finish (``ClientEnd.data``), all its samples in order and a shuffled pass."""

    def finish_client(self, end):
        data = end.data
        order = torch.randperm(data.num_samples, generator=data.generator("order"))
        self.seen[end.round, end.client].update(
            end_x=torch.cat([x for x, _ in data.batches(batch_size=4)]),
            end_shuffled=torch.cat([x for x, _ in data.batches(order, batch_size=3, drop_last=True)]),
            end_client=data.client,
        )
        return ClientOutcome(upload=end.shared())


def fit(algorithm, runner):
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=8, seed=3)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=1, runner=runner
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=dm)
    dm.setup()
    return strategy, dm


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_start_reads_the_clients_training_samples(runner):
    """Fails if ``data`` reads another client's samples or another round's order, ignores ``positions``,
    ``batch_size`` or ``drop_last``, draws its generator from another seed (the global RNG, the loader's), or is
    not bound on the runner (at the start or at the finish)."""
    algorithm = ReadsData()
    strategy, dm = fit(algorithm, runner)
    assert strategy.runner_report.runner == runner
    expected = {(r, c) for r in range(ROUNDS) for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)}
    assert set(algorithm.seen) == expected
    for (r, c), seen in algorithm.seen.items():
        data = dm.client_data(c)
        x, y = (t[data.indices] for t in data.dataset.tensors)
        n = len(x)
        assert seen["sizes"] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
        assert torch.equal(seen["x"], x) and torch.equal(seen["y"], y)
        order = torch.randperm(n, generator=reference_generator(SEED, r, 0x57A7, c, zlib.crc32(b"order")))
        assert seen["shuffled_sizes"] == [5] * (n // 5)
        assert torch.equal(seen["shuffled"], x[order[: 5 * (n // 5)]])
        assert torch.equal(seen["sliced"], x[2:9])
        after = torch.randperm(n, generator=reference_generator(SEED, r, 0x57A7, c, zlib.crc32(b"after")))
        assert torch.equal(seen["after"], x[after[: 8 * (n // 8)]])  # ClientEnd.data, the round's batch size
        assert seen["batch_size"] == 8 and seen["device"] == torch.device("cpu")
        torch.testing.assert_close(strategy.federation.store.client_state(c)["input_sum"], x.sum(0))


def test_bad_positions_and_batch_sizes_are_refused_naming_the_argument():
    data = ClientSamples(0, 0, 4, 2, read=lambda chunks: iter(chunks), seeded=lambda key: torch.Generator())
    with pytest.raises(IndexError, match=r"positions=.*client 0 has 4 training samples.*\[0, 4\)"):
        list(data.batches(torch.tensor([0, 4])))
    with pytest.raises(ValueError, match=r"batch_size=.*must be >= 1"):
        data.batches(batch_size=0)
    assert [t.tolist() for t in data.batches()] == [[0, 1], [2, 3]]
    assert list(data.batches(torch.tensor([3]), drop_last=True)) == []


def test_a_loader_drawing_fresh_samples_each_round_serves_that_rounds_samples():
    """``RoundLoader.batches_at`` reads the round's samples (FedRep's fresh-sample clients), not a placeholder."""
    problem = make_low_rank_problem(num_clients=2, dim=5, rank=2, samples_per_client=4, seed=0)
    loader = FreshSampleRoundLoader(problem, samples_per_round=6, batch_size=3, seed=1)
    ((x, y),) = loader.batches_at(1, 2, [torch.tensor([4, 0])])
    samples = loader.round_samples(1, 2)
    assert torch.equal(x, samples.tensors[0][[4, 0]]) and torch.equal(y, samples.tensors[1][[4, 0]])


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_finish_reads_the_clients_training_samples(runner):
    """``ClientEnd.data`` reads what ``ClientStart.data`` reads: the client's rows, and the same generator (the
    documented seeding rule). Fails if ``finish_client`` gets no reader or another client's."""
    algorithm = ReadsDataAtTheEnd()
    strategy, dm = fit(algorithm, runner)
    assert strategy.runner_report.runner == runner
    for (r, c), seen in algorithm.seen.items():
        data = dm.client_data(c)
        x = data.dataset.tensors[0][data.indices]
        n = len(x)
        order = torch.randperm(n, generator=reference_generator(SEED, r, 0x57A7, c, zlib.crc32(b"order")))
        assert seen["end_client"] == c and torch.equal(seen["end_x"], x)
        assert torch.equal(seen["end_shuffled"], x[order[: 3 * (n // 3)]])


def test_data_is_none_without_a_bound_loader():
    """A federation driven without the strategy (no training loader) gives ``data=None``, not a stale reader."""
    strategy, _ = fit(ReadsData(), "sequential")
    federation = strategy.federation
    assert isinstance(federation.client_samples(0), ClientSamples)
    federation.bind_samples(None)
    assert federation.client_samples(0) is None


def test_a_start_reading_data_is_refused_under_sample_level_dp():
    """Sample-level DP-SGD accounts for the local steps' Poisson batches only: a start reading the client's samples
    is refused, naming the mechanism and the fix (client-level DP covers it)."""
    from lightning_fedrep.privacy import SampleLevelDP

    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=ReadsData(),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=1,
        weighting="uniform",
        privacy=SampleLevelDP(clip=1.0, noise_multiplier=1.0, accountant=None),
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with pytest.raises(
        ValueError, match=r"SampleLevelDP privatizes the local steps' batches only.*ClientLevelDP"
    ):
        trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=8, seed=3))
