"""Tests for lightning_fedrep.data.partition: partition properties, skew, determinism and validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedrep.data.partition import (
    ClientSplit,
    DirichletPartitioner,
    IIDPartitioner,
    Partitioner,
    ShardPartitioner,
)


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> torch.Tensor:
    """Shuffled labels with exactly ``per_class`` samples of each class."""
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return labels[torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(seed))]


def assert_partition(parts: list[torch.Tensor], n: int) -> None:
    """Each index 0..n-1 appears in exactly one part; parts are sorted int64 1-D tensors."""
    for p in parts:
        assert p.dtype == torch.int64 and p.dim() == 1
        assert torch.all(p[1:] > p[:-1]), "indices must be sorted ascending without repeats"
    allidx = torch.cat(parts)
    assert allidx.numel() == n, "some indices were lost or duplicated"
    assert torch.equal(torch.sort(allidx).values, torch.arange(n))


def label_hist(labels: torch.Tensor, idx: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.bincount(labels[idx], minlength=num_classes).double()


def same_split(a: ClientSplit, b: ClientSplit) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.train + a.test, b.train + b.test, strict=True))


ALL = [
    lambda n: ShardPartitioner(n, 2),
    lambda n: DirichletPartitioner(n, alpha=0.5),
    lambda n: IIDPartitioner(n),
]


# ---------------------------------------------------------------------------------------------- generic


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_exact_partition_of_train_and_test(make):
    train, test = balanced_labels(10, 100), balanced_labels(10, 30, seed=1)
    part = make(20)
    assert isinstance(part, Partitioner)
    split = part.split(train, test, seed=3)
    assert isinstance(split, ClientSplit)
    assert split.num_clients == 20 == len(split.test)
    assert_partition(split.train, train.numel())
    assert_partition(split.test, test.numel())


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_determinism_and_seed_dependence(make):
    train, test = balanced_labels(10, 100), balanced_labels(10, 20)
    part = make(10)
    a, b, c = part.split(train, test, 0), part.split(train, test, 0), part.split(train, test, 1)
    assert same_split(a, b)
    assert not same_split(a, c)


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_no_global_rng_use(make):
    train = balanced_labels(10, 50)
    torch.manual_seed(123)
    np.random.seed(123)
    before_t, before_np = torch.get_rng_state(), np.random.get_state()[1].copy()
    make(5).split(train, None, seed=0)
    assert torch.equal(before_t, torch.get_rng_state())
    assert np.array_equal(before_np, np.random.get_state()[1])


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_no_test_labels_gives_empty_test_tensors(make):
    split = make(4).split(balanced_labels(4, 25), None, seed=0)
    assert [t.numel() for t in split.test] == [0] * 4
    assert all(t.dtype == torch.int64 for t in split.test)


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_accepts_non_contiguous_label_values(make):
    # classes are the values present in the train labels, e.g. {3, 7, 42, 100}, on any integer dtype
    values = torch.tensor([3, 7, 42, 100], dtype=torch.int32)
    train = values[balanced_labels(4, 50)]
    split = make(4).split(train, values[balanced_labels(4, 10)], seed=0)
    assert_partition(split.train, train.numel())


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
def test_scale_60k_labels_1000_clients(make):
    # no timing assertion: just exercise the vectorised path at MNIST/CIFAR scale
    train, test = balanced_labels(10, 6000), balanced_labels(10, 1000)
    part = make(1000) if make is not ALL[1] else DirichletPartitioner(1000, alpha=1.0)
    split = part.split(train, test, seed=0)
    assert split.num_clients == 1000
    assert_partition(split.train, train.numel())


# ---------------------------------------------------------------------------------------------- shard


def test_shard_fedrep_cifar_like_balanced():
    # FedRep's CIFAR-10 (n=100, S=2) at 1/25 scale: 10 classes x 200 train / 40 test samples
    train, test = balanced_labels(10, 200), balanced_labels(10, 40, seed=5)
    split = ShardPartitioner(100, 2).split(train, test, seed=0)
    assert [t.numel() for t in split.train] == [20] * 100
    assert [t.numel() for t in split.test] == [4] * 100
    for tr, te in zip(split.train, split.test, strict=True):
        train_classes = set(train[tr].tolist())
        assert len(train_classes) == 2
        assert set(test[te].tolist()) == train_classes
        # equal shard per class: 10 samples of each of the two classes
        assert sorted(torch.bincount(train[tr], minlength=10).tolist()) == [0] * (10 - 2) + [10, 10]
    # every class is held by 100 * 2 / 10 = 20 clients
    holders = torch.zeros(10, dtype=torch.long)
    for tr in split.train:
        holders[train[tr].unique()] += 1
    assert holders.tolist() == [20] * 10


@pytest.mark.parametrize(
    ("n", "s", "c"), [(100, 5, 10), (10, 10, 10), (7, 3, 5), (13, 4, 4), (1000, 2, 10), (3, 20, 100)]
)
def test_shard_each_client_gets_exactly_s_distinct_classes(n, s, c):
    train = balanced_labels(c, max(2 * n, 40))
    test = balanced_labels(c, max(2 * n, 40), seed=9)
    part = ShardPartitioner(n, s)
    split = part.split(train, test, seed=4)
    for tr, te in zip(split.train, split.test, strict=True):
        classes = set(train[tr].tolist())
        assert len(classes) == s
        assert set(test[te].tolist()) == classes
    assignment = part.assign_classes(c, seed=4)
    assert assignment.shape == (n, s)
    for i, row in enumerate(assignment):
        assert row.unique().numel() == s
        assert set(row.tolist()) == set(train[split.train[i]].tolist())  # labels are 0..c-1 here


def test_shard_uneven_holders_distributed_as_evenly_as_possible():
    # 7 clients * 3 classes = 21 slots over 5 classes: four classes have 4 holders, one has 5
    train = balanced_labels(5, 60)
    split = ShardPartitioner(7, 3).split(train, None, seed=2)
    holders = torch.zeros(5, dtype=torch.long)
    for tr in split.train:
        holders[train[tr].unique()] += 1
    assert sorted(holders.tolist()) == [4, 4, 4, 4, 5]
    assert_partition(split.train, train.numel())  # every class still has a holder: nothing dropped


def test_shard_leftover_samples_go_to_shards_not_dropped():
    # 103 samples of class 0, 100 of class 1, 4 clients with 1 class each -> shards of 26,26,26,25 and 25 x4
    train = torch.cat([torch.zeros(103, dtype=torch.long), torch.ones(100, dtype=torch.long)])
    test = torch.cat([torch.zeros(10, dtype=torch.long), torch.ones(9, dtype=torch.long)])
    split = ShardPartitioner(8, 1).split(train, test, seed=0)
    assert_partition(split.train, train.numel())
    assert_partition(split.test, test.numel())
    sizes0 = sorted(t.numel() for t in split.train if train[t][0] == 0)
    assert sizes0 == [25, 26, 26, 26]


def test_shard_fewer_slots_than_classes_drops_unheld_classes():
    train = balanced_labels(10, 20)
    split = ShardPartitioner(2, 2).split(train, None, seed=0)
    held = torch.cat(split.train)
    assert held.numel() == 4 * 20
    assert train[held].unique().numel() == 4


def test_shard_test_classes_missing_from_train_are_unassigned():
    train = balanced_labels(3, 30)
    test = torch.tensor([0, 1, 2, 5, 5, 2])
    split = ShardPartitioner(3, 1).split(train, test, seed=0)
    assigned = torch.cat(split.test)
    assert sorted(test[assigned].tolist()) == [0, 1, 2, 2]


# ---------------------------------------------------------------------------------------------- dirichlet


def _mean_entropy(labels: torch.Tensor, parts: list[torch.Tensor], num_classes: int) -> float:
    ents = []
    for p in parts:
        h = label_hist(labels, p, num_classes)
        q = h / h.sum()
        ents.append(float(-(q[q > 0] * q[q > 0].log()).sum()))
    return float(np.mean(ents))


def test_dirichlet_smaller_alpha_more_skew():
    train = balanced_labels(10, 500)
    skewed = DirichletPartitioner(20, alpha=0.1).split(train, None, seed=0)
    flat = DirichletPartitioner(20, alpha=100.0).split(train, None, seed=0)
    e_skewed = _mean_entropy(train, skewed.train, 10)
    e_flat = _mean_entropy(train, flat.train, 10)
    assert e_flat > 0.95 * np.log(10)
    assert e_skewed < 0.6 * e_flat


def test_dirichlet_test_distribution_follows_train():
    train, test = balanced_labels(10, 10_000), balanced_labels(10, 10_000, seed=1)
    split = DirichletPartitioner(10, alpha=0.5).split(train, test, seed=0)
    assert_partition(split.test, test.numel())
    for tr, te in zip(split.train, split.test, strict=True):
        p, q = label_hist(train, tr, 10), label_hist(test, te, 10)
        tv = 0.5 * (p / p.sum() - q / q.sum()).abs().sum()
        assert tv < 0.02


def test_dirichlet_min_samples_respected():
    train = balanced_labels(10, 200)
    split = DirichletPartitioner(50, alpha=0.3, min_samples_per_client=10).split(train, None, seed=0)
    assert min(t.numel() for t in split.train) >= 10
    assert_partition(split.train, train.numel())


def test_dirichlet_gives_up_with_clear_error():
    train = balanced_labels(2, 10)
    with pytest.raises(ValueError, match="larger alpha"):
        DirichletPartitioner(10, alpha=0.001, min_samples_per_client=2, max_tries=5).split(
            train, None, seed=0
        )


# ---------------------------------------------------------------------------------------------- iid


def test_iid_sizes_within_one_and_labels_near_global():
    train, test = balanced_labels(10, 1003), balanced_labels(10, 101)
    split = IIDPartitioner(7).split(train, test, seed=0)
    sizes = [t.numel() for t in split.train]
    assert max(sizes) - min(sizes) <= 1
    test_sizes = [t.numel() for t in split.test]
    assert max(test_sizes) - min(test_sizes) <= 1
    for tr in split.train:
        q = label_hist(train, tr, 10)
        assert float(0.5 * (q / q.sum() - 0.1).abs().sum()) < 0.05


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("ctor", "match"),
    [
        (lambda: IIDPartitioner(0), "num_clients must be at least 1"),
        (lambda: IIDPartitioner(2.5), "num_clients must be an int"),
        (lambda: ShardPartitioner(0, 2), "num_clients must be at least 1"),
        (lambda: ShardPartitioner(10, 0), "classes_per_client must be at least 1"),
        (lambda: ShardPartitioner(10, 1.5), "classes_per_client must be an int"),
        (lambda: DirichletPartitioner(-1, 0.5), "num_clients must be at least 1"),
        (lambda: DirichletPartitioner(10, 0.0), "alpha must be a positive"),
        (lambda: DirichletPartitioner(10, -1.0), "alpha must be a positive"),
        (lambda: DirichletPartitioner(10, float("nan")), "alpha must be a positive"),
        (lambda: DirichletPartitioner(10, "big"), "alpha must be a positive number"),
        (
            lambda: DirichletPartitioner(10, 0.5, min_samples_per_client=-1),
            "min_samples_per_client must be at least 0",
        ),
        (lambda: DirichletPartitioner(10, 0.5, max_tries=0), "max_tries must be at least 1"),
    ],
)
def test_constructor_errors(ctor, match):
    with pytest.raises(ValueError, match=match):
        ctor()


@pytest.mark.parametrize("make", ALL, ids=["shard", "dirichlet", "iid"])
@pytest.mark.parametrize(
    ("train", "test", "seed", "match"),
    [
        (torch.rand(100), None, 0, "integer class ids"),
        (torch.ones(100, dtype=torch.bool), None, 0, "integer class ids"),
        (torch.zeros(100, 10, dtype=torch.long), None, 0, "must be 1-D"),
        (torch.zeros(0, dtype=torch.long), None, 0, "empty"),
        (torch.arange(100) % 4, torch.rand(10), 0, "test_labels has labels of dtype torch.float32"),
        (torch.arange(100) % 4, None, -1, "non-negative"),
        (torch.arange(100) % 4, None, 1.5, "seed must be an int"),
        (torch.arange(3), None, 0, "exceeds the number of train samples|only 3"),
    ],
)
def test_split_errors(make, train, test, seed, match):
    with pytest.raises(ValueError, match=match):
        make(4).split(train, test, seed)


def test_shard_more_classes_per_client_than_classes():
    with pytest.raises(ValueError, match=r"classes_per_client=5 exceeds the number of classes .*\(4\)"):
        ShardPartitioner(10, 5).split(balanced_labels(4, 50), None, seed=0)


def test_shard_class_too_small_for_its_shards():
    train = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="class 1 has 3 train samples .* 5 shards"):
        ShardPartitioner(10, 1).split(train, None, seed=0)


def test_dirichlet_not_enough_samples_for_min():
    with pytest.raises(ValueError, match="need 200 train samples, but there are only 100"):
        DirichletPartitioner(10, 1.0, min_samples_per_client=20).split(balanced_labels(10, 10), None, seed=0)


def test_client_split_length_mismatch():
    with pytest.raises(ValueError, match="one train and one test"):
        ClientSplit(train=[torch.arange(3)], test=[])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("n", "s", "c"), [(1, 1, 1), (1, 5, 5), (9, 9, 9), (50, 7, 10), (11, 3, 17), (30, 1, 100)]
)
def test_shard_assignment_valid_and_balanced(n, s, c, seed):
    assignment = ShardPartitioner(n, s).assign_classes(c, seed=seed)
    assert assignment.dtype == torch.int64 and assignment.shape == (n, s)
    assert all(row.unique().numel() == s for row in assignment)
    holders = torch.bincount(assignment.reshape(-1), minlength=c)
    assert holders.sum() == n * s
    assert holders.max() - holders.min() <= 1  # as even as possible
    assert torch.equal(assignment, ShardPartitioner(n, s).assign_classes(c, seed=seed))


def test_shard_assignment_is_random_not_structured():
    # the class pairs should vary widely (a structured fallback would give only a handful of distinct pairs)
    assignment = ShardPartitioner(100, 2).assign_classes(10, seed=0)
    pairs = {tuple(row.tolist()) for row in assignment}
    assert len(pairs) > 25
