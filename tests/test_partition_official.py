"""ShardPartitioner(assignment="official"): the official ``utils/sampling.py::noniid``, restated here.

The official rule (lgcollins/FedRep, also FLUTE and SRPFL), written out independently of the library:

* ``shard_per_class = S * N / C``; each class's indices, in data set order, are cut into that many shards
  of ``n_c // shard_per_class`` consecutive samples, and the ``n_c % shard_per_class`` leftover samples at
  the end are appended one each to the first shards;
* ``rand_set_all`` = ``list(range(C)) * shard_per_class``, shuffled, reshaped to ``(N, S)``: a client may
  draw the same class twice (and then gets two shards of it);
* client ``i`` pops one random remaining shard per entry of its row; the test set is cut the same way
  with the same ``rand_set_all``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fedrep.data.partition import ShardPartitioner


def official_shards(labels: np.ndarray, label: int, shard_per_class: int) -> list[set[int]]:
    """The official cut of one class's indices (data set order) into ``shard_per_class`` shards."""
    x = np.flatnonzero(labels == label)
    run = len(x) // shard_per_class
    shards = [set(x[i * run : (i + 1) * run].tolist()) for i in range(shard_per_class)]
    for i, idx in enumerate(x[shard_per_class * run :].tolist()):
        shards[i].add(idx)
    return shards


def assert_official_deal(labels: np.ndarray, owned: list[torch.Tensor], rows: torch.Tensor, spc: int) -> None:
    """Each client's samples of class c are exactly (multiplicity of c in its row) whole official shards,
    and every shard goes to exactly one slot."""
    for label in range(int(rows.max()) + 1):
        shards = official_shards(labels, label, spc)
        shard_of = {idx: k for k, shard in enumerate(shards) for idx in shard}
        used: list[int] = []
        for client, indices in enumerate(owned):
            mine = {i for i in indices.tolist() if labels[i] == label}
            ids = {shard_of[i] for i in mine}
            assert len(ids) == int((rows[client] == label).sum()), (client, label)
            assert mine == set().union(*(shards[k] for k in ids)), "a client holds part of a shard"
            used += sorted(ids)
        assert sorted(used) == list(range(spc)), "every official shard goes to exactly one slot"


def test_official_assignment_deals_the_official_shards_in_train_and_test():
    """Catches: cutting shards after shuffling each class (the "distinct" path's cut), contiguous shards
    with leftovers in the first shards (``_even_sizes``), a test split that ignores repeated classes, or
    an assignment that is not the multiset (each class exactly S*N/C slots)."""
    n, s, c = 20, 5, 10
    gen = torch.Generator().manual_seed(3)
    train = torch.randint(0, c, (1003,), generator=gen)
    test = torch.randint(0, c, (407,), generator=gen)
    part = ShardPartitioner(n, s, assignment="official")
    split = part.split(train, test, seed=7)
    rows = part.assign_classes(c, seed=7)
    spc = s * n // c
    assert torch.bincount(rows.reshape(-1), minlength=c).tolist() == [spc] * c  # the multiset
    assert any(row.unique().numel() < s for row in rows), "seed 7 should draw a repeated class"
    assert_official_deal(train.numpy(), split.train, rows, spc)
    assert_official_deal(test.numpy(), split.test, rows, spc)
    for i in range(n):  # tested on exactly its drawn classes
        assert (
            set(test[split.test[i]].tolist()) == set(rows[i].tolist()) == set(train[split.train[i]].tolist())
        )


def expected_distinct(n: int, s: int, c: int) -> float:
    """E[distinct classes of a row] for S draws without replacement from the multiset (C classes x NS/C)."""
    total, m = n * s, n * s // c
    return c * (1 - math.comb(total - m, s) / math.comb(total, s))


@pytest.mark.parametrize(("s", "c", "paper"), [(5, 10, 4.10), (20, 100, 18.3), (40, 100, 33.3)])
def test_official_assignment_distinct_class_statistics(s, c, paper):
    """Catches: dealing distinct classes (``_assign_official`` returning the "distinct" rows: the mean
    would be exactly S): the mean number of distinct classes per client matches the hypergeometric closed
    form (the issue's 4.10 / 18.3 / 33.3) within sampling error. (Uniform draws with replacement are
    caught by the multiset check of the test above.)"""
    n = 2000 if c == 10 else 500
    rows = ShardPartitioner(n, s, assignment="official").assign_classes(c, seed=0)
    distinct = np.array([row.unique().numel() for row in rows])
    closed = expected_distinct(n, s, c)
    assert abs(expected_distinct(100, s, c) - paper) < 0.1  # the figures (one decimal), at N=100
    assert abs(distinct.mean() - closed) < 4 * distinct.std() / math.sqrt(n) + 1e-9


def test_official_assignment_two_classes_one_in_ten_clients_hold_one():
    """Catches: the "distinct" deal (no client would hold one class): at S=2 of 10 classes a client's
    two slots are the same class with probability C * m(m-1) / (NS(NS-1)), about 10%."""
    n, s, c = 2000, 2, 10
    rows = ShardPartitioner(n, s, assignment="official").assign_classes(c, seed=1)
    one = float(np.mean([row.unique().numel() == 1 for row in rows]))
    m, total = n * s // c, n * s
    closed = c * m * (m - 1) / (total * (total - 1))
    assert abs(one - closed) < 4 * math.sqrt(closed * (1 - closed) / n)


def test_distinct_assignment_unchanged_by_default():
    """The default stays S distinct classes per client (``assignment="distinct"``)."""
    rows = ShardPartitioner(200, 5).assign_classes(10, seed=0)
    assert all(row.unique().numel() == 5 for row in rows)
    assert "assignment='distinct'" in repr(ShardPartitioner(200, 5))


def test_unknown_assignment_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="assignment='multiset'.*'distinct'.*'official'"):
        ShardPartitioner(10, 2, assignment="multiset")
