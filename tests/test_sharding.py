"""Building blocks of the multi-process strategy, without processes: sharding a round over ranks by
steps, comparing plans across ranks, and the one-vector form of the round's average that an
all-reduce adds up."""

import pytest
import torch

from lightning_fedrep.federation.api.aggregation import WeightedAverage
from lightning_fedrep.federation.api.algorithm import Phase
from lightning_fedrep.federation.plan import plan_fingerprint, plan_round, shard_round

SIZES = [7, 41, 13, 22, 30, 9, 55, 18, 3, 26]
PHASES = (Phase("head", epochs=2), Phase("body", epochs=1))


def plan(clients=range(10), sizes=SIZES, phases=PHASES, round_index=0):
    return plan_round(round_index, list(clients), phases, sizes, batch_size=5)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_client_goes_to_exactly_one_rank_in_plan_order(world_size):
    p = plan()
    shares = shard_round(p, world_size)
    assert [s.rank for s in shares] == list(range(world_size))
    dealt = [c for s in shares for c in s.clients]
    assert sorted(dealt) == sorted(p.clients)
    for share in shares:
        assert list(share.clients) == [c for c in p.clients if c in share.clients]
        assert share.steps == sum(p.steps_of(c) for c in share.clients)


def test_shares_are_balanced_by_steps_not_by_count():
    p = plan()
    shares = shard_round(p, 2)
    steps = [s.steps for s in shares]
    total, largest = sum(steps), max(w.steps for w in p.work)
    # longest-first greedy: the heavier rank exceeds an even split by less than one client's work
    assert max(steps) - total / 2 <= largest / 2
    assert abs(steps[0] - steps[1]) <= largest
    by_count = shard_round(plan(sizes=[100, 1, 1, 1], clients=range(4)), 2)
    assert [len(s.clients) for s in by_count] == [1, 3]  # one large client against three small ones


def test_sharding_is_a_pure_function_of_the_plan():
    assert shard_round(plan(), 3) == shard_round(plan(), 3)
    with pytest.raises(ValueError, match="world_size"):
        shard_round(plan(), 0)


def test_more_ranks_than_clients_leaves_idle_ranks():
    shares = shard_round(plan(clients=[1, 4]), 4)
    assert sum(1 for s in shares if not s.clients) == 2
    assert {s.steps for s in shares if not s.clients} == {0}


def test_plan_fingerprints_differ_when_plans_differ():
    base = plan_fingerprint(plan())
    assert base == plan_fingerprint(plan())
    assert base != plan_fingerprint(plan(round_index=1))
    assert base != plan_fingerprint(plan(clients=range(9)))
    assert base != plan_fingerprint(plan(sizes=[*SIZES[:-1], 31]))
    assert base != plan_fingerprint(plan(phases=(Phase("all", epochs=3),)))
    assert base != plan_fingerprint(plan().replace(aggregate=False))


def test_sharded_averages_summed_as_one_vector_equal_the_single_process_average():
    torch.manual_seed(0)
    like = [torch.zeros(3, 2), torch.zeros(4, dtype=torch.long)]
    clients = [([torch.randn(3, 2), torch.randint(0, 9, (4,))], float(n)) for n in SIZES]
    single = WeightedAverage(like)
    for tensors, weight in clients:
        single.add(tensors, weight)
    ranks = [WeightedAverage(like) for _ in range(3)]
    for i, (tensors, weight) in enumerate(clients):
        ranks[i % 3].add(tensors, weight)
    reduced = sum(r.flat() for r in ranks)  # what all_reduce(SUM) computes
    combined = WeightedAverage(like)
    combined.load_flat(reduced)
    assert combined.weight == single.weight
    for a, b in zip(combined.mean(like), single.mean(like)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    # and both are the weighted mean written out (integer tensors rounded back)
    total = sum(weight for _, weight in clients)
    for index, ref in enumerate(like):
        mean = sum(weight * tensors[index].double() for tensors, weight in clients) / total
        expected = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
        torch.testing.assert_close(combined.mean(like)[index], expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------- rank schedules and idle steps
from lightning_fedrep.data.loaders import ClientData, EvalLoader, RoundLoader  # noqa: E402
from lightning_fedrep.evaluation.metrics import ClientMetrics  # noqa: E402
from lightning_fedrep.federation.sharding import IDLE_STEP, evaluation_shards, rank_schedule  # noqa: E402
from lightning_fedrep.federation.store import ClientStore  # noqa: E402


def round_loader(sizes=SIZES, batch_size=5):
    data = torch.utils.data.TensorDataset(torch.arange(sum(sizes)).float()[:, None], torch.zeros(sum(sizes)))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    clients = [ClientData(data, torch.arange(s, s + n)) for s, n in zip(starts, sizes)]
    return RoundLoader(clients, batch_size, seed=1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_runs_the_longest_ranks_steps_and_its_own_clients_batches(world_size):
    p = plan(clients=[0, 1, 3, 4, 6, 9])
    loader = round_loader()
    schedules = [rank_schedule(p, r, world_size, lambda local, own: local) for r in range(world_size)]
    shares = shard_round(p, world_size)
    longest = max(s.steps for s in shares)
    for rank, schedule in enumerate(schedules):
        assert schedule.length == longest  # the same on every rank: no collective needed
        assert schedule.local.clients == list(shares[rank].clients)
        batches = list(schedule.batches(loader))
        assert len(batches) == longest
        own = shares[rank].steps
        assert all(b is IDLE_STEP for b in batches[own:]) and not any(b is IDLE_STEP for b in batches[:own])
        assert [schedule.idle(i) for i in range(longest)] == [i >= own for i in range(longest)]
        # the rank's batches are exactly what one process draws for those clients
        single = [b for b in loader.plan_batches(p, 0)]
        expected = [
            b
            for b, c in zip(single, (p.locate(i).client for i in range(p.length)))
            if c in shares[rank].clients
        ]
        for got, want in zip(batches[:own], expected):
            assert torch.equal(got[0], want[0])
        # resuming mid-round from any step continues the same sequence
        assert [b if b is IDLE_STEP else b[0].sum() for b in schedule.batches(loader, 3)] == [
            b if b is IDLE_STEP else b[0].sum() for b in batches[3:]
        ]


def test_evaluation_is_dealt_by_samples_and_padded_to_the_longest_rank():
    sizes = [12, 0, 3, 25, 7, 7]
    shards = evaluation_shards(sizes, 2)
    assert sorted(c for s in shards for c in s) == [0, 2, 3, 4, 5]  # the client without data goes nowhere
    # longest first to the lighter rank: 25 | 12, 7, 7 | then 3 to the lighter (25 < 26)
    assert shards == [[2, 3], [0, 4, 5]]
    data = torch.utils.data.TensorDataset(
        torch.arange(54).float()[:, None], torch.zeros(54, dtype=torch.long)
    )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    clients = [ClientData(data, torch.arange(s, s + n)) for s, n in zip(starts, sizes)]
    for chunk in (None, 10):
        loaders = []
        for rank in range(2):
            loader = EvalLoader(clients, batch_size=4, stage="val")
            loader.chunk(chunk)
            loader.shard(rank, 2)
            loaders.append(loader)
        assert len(loaders[0]) == len(loaders[1])
        seen = []
        for loader in loaders:
            items = list(loader)
            assert len(items) == len(loader)
            real = [i for i in items if i is not IDLE_STEP]
            assert all(i is IDLE_STEP for i in items[len(real) :])
            if chunk is None:
                seen += [loader.client_of(b) for b in range(len(real))]
                assert sum(len(x) for x, _ in real) == sum(sizes[c] for c in loader.evaluated_clients)
            else:
                seen += [int(c) for item in real for c in item.clients]
        assert sorted(set(seen)) == [0, 2, 3, 4, 5]


def test_per_client_sums_merged_across_processes_equal_one_pass():
    """Exact reduction: sums and counts per client, not a mean of the ranks' means."""
    single, ranks = ClientMetrics(), [ClientMetrics(), ClientMetrics()]
    for client, (total, count) in enumerate([(3.0, 4), (1.0, 10), (7.0, 7)]):
        for metrics in (single, ranks[client % 2]):
            metrics.add("val/acc", client, total, count)
            metrics.samples[client] += count
    merged = ClientMetrics()
    for metrics in ranks:
        merged.merge(metrics.state())
    assert merged.per_client("val/acc") == single.per_client("val/acc")
    assert merged.summary("val/acc") == single.summary("val/acc")


def test_a_client_record_moves_its_whole_state_to_another_store():
    template = [torch.zeros(2)]
    source, target = ClientStore(template), ClientStore(template)
    source.put(3, [torch.tensor([1.0, 2.0])])
    source.optimizer_states[3] = {0: {0: {"momentum_buffer": torch.ones(2)}}}
    source.finetuned[3] = {"body.w": torch.full((2,), 5.0)}
    target.finetuned[3] = {"stale": torch.zeros(1)}
    target.load_record(3, source.record(3))
    assert torch.equal(target.get(3)[0], torch.tensor([1.0, 2.0]))
    assert torch.equal(target.optimizer_states[3][0][0]["momentum_buffer"], torch.ones(2))
    assert list(target.finetuned[3]) == ["body.w"]
    assert torch.equal(target.get(4)[0], torch.zeros(2))  # untouched clients still read the template


def test_a_sharded_store_holds_its_own_and_borrowed_clients_and_names_the_owner_of_the_others():
    from lightning_fedrep.federation.store import ClientNotHeld

    store = ClientStore([torch.zeros(2)])
    for client in range(5):
        store.put(client, [torch.full((2,), float(client))])
    store.borrowed.add(3)
    store.shard(world_size=2, rank=0)
    assert sorted(store.local) == [0, 2, 3, 4]  # its own (c % 2 == 0) and the borrowed 3
    assert torch.equal(store.get(3)[0], torch.full((2,), 3.0))
    assert torch.equal(store.get(-1)[0], torch.zeros(2))  # the template: a new client, on any rank
    with pytest.raises(ClientNotHeld, match="Client 1's state is held by rank 1, not by rank 0"):
        store.get(1)
    store.drop(3)
    with pytest.raises(ClientNotHeld, match="Client 3's state is held by rank 1"):
        store.personal(3, ["w"])
    store.unshard()
    assert torch.equal(store.get(1)[0], torch.zeros(2))  # answers for everyone again (after a gather)
