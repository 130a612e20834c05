"""``max_train_samples`` (the official ``m_tr``) and ``assignment`` on the data modules."""

from __future__ import annotations

import pytest
import torch

from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.data.vision import CIFAR10DataModule, EMNISTDataModule


def test_cap_keeps_at_most_m_tr_of_each_clients_own_samples():
    """Catches: a cap that is not applied (or applied after the loaders read the sizes), one that draws
    samples from outside the client's split, or one that cuts the test split too: with the cap, each
    client trains on min(n_i, m_tr) of its own uncapped samples (the round loader too), its test split
    unchanged."""
    full = DigitsDataModule(num_clients=10, classes_per_client=2, seed=1)
    capped = DigitsDataModule(num_clients=10, classes_per_client=2, seed=1, max_train_samples=143)
    full.setup()
    capped.setup()
    sizes = [full.client_num_samples(c) for c in range(10)]
    assert min(sizes) < 143 < max(sizes), "the fixture must have clients on both sides of the cap"
    for c in range(10):
        own = set(full.client_data(c).indices.tolist())
        kept = capped.client_data(c).indices.tolist()
        assert len(kept) == min(sizes[c], 143) == capped.client_num_samples(c)
        assert set(kept) <= own and len(set(kept)) == len(kept)
        assert torch.equal(capped.client_data(c, "test").indices, full.client_data(c, "test").indices)
    loader = capped.train_dataloader()  # what the strategy plans rounds from
    assert [len(data) for data in loader.clients] == [min(n, 143) for n in sizes]
    again = DigitsDataModule(num_clients=10, classes_per_client=2, seed=1, max_train_samples=143)
    again.setup()
    assert all(torch.equal(again.client_data(c).indices, capped.client_data(c).indices) for c in range(10))


def test_cap_must_be_a_positive_int_naming_the_argument():
    with pytest.raises(ValueError, match="max_train_samples"):
        DigitsDataModule(max_train_samples=0)


def test_vision_modules_pass_assignment_and_cap_to_their_partitioner():
    """Catches: the data modules' ``assignment`` not reaching the default ShardPartitioner (a recipe's
    ``assignment: official`` would silently deal distinct classes)."""
    cifar = CIFAR10DataModule(
        num_clients=50, classes_per_client=2, assignment="official", max_train_samples=500
    )
    assert cifar.partitioner.assignment == "official" and cifar.max_train_samples == 500
    emnist = EMNISTDataModule(split="letters", first_classes=10, assignment="official")
    assert emnist.partitioner.assignment == "official"
    digits = DigitsDataModule(assignment="official")
    assert digits.partitioner.assignment == "official"
    assert CIFAR10DataModule().partitioner.assignment == "distinct"
