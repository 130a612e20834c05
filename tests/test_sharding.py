"""Building blocks of the multi-process strategy, without processes: sharding a round over ranks by
steps, comparing plans across ranks, and the one-vector form of the round's average that an
all-reduce adds up."""

import pytest
import torch

from lightning_fedrep.algorithms import Phase
from lightning_fedrep.plan import plan_fingerprint, plan_round, shard_round
from lightning_fedrep.server import WeightedAverage

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
