"""PFLlibPartitioner gives exactly PFLlib's clients.

Reference: PFLlib's ``dataset/utils/dataset_utils.py`` (``separate_data`` for ``'pat'`` with
``balance=False`` and ``'dir'``; ``split_data``, i.e. scikit-learn's ``train_test_split(train_size=0.75,
shuffle=True)``), restated below in plain NumPy on the *global* generator as their code runs it, after
``np.random.seed(1)`` as ``generate_*.py`` do, on the pooled labels (train then test) of generated label
vectors of FMNIST's and CIFAR-100's sizes. The partitioner must return the same per-client train and test
index sets, from its own ``RandomState``, without touching the global generator.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, PFLlibPartitioner

BATCH_SIZE, TRAIN_RATIO, ALPHA = 10, 0.75, 0.1


def reference_separate_data(
    labels, num_clients, num_classes, partition, class_per_client=None, balance_factor=True
):
    """PFLlib's separate_data (niid=True, balance=False), returning each client's pool indices in its order."""
    least_samples = int(min(BATCH_SIZE / (1 - TRAIN_RATIO), len(labels) / num_clients / 2))
    dataidx_map = {}
    if partition == "pat":
        idxs = np.array(range(len(labels)))
        idx_for_each_class = [idxs[labels == i] for i in range(num_classes)]
        class_num_per_client = [class_per_client for _ in range(num_clients)]
        for i in range(num_classes):
            selected_clients = [c for c in range(num_clients) if class_num_per_client[c] > 0]
            if len(selected_clients) == 0:
                break
            selected_clients = selected_clients[
                : int(np.ceil((num_clients / num_classes) * class_per_client))
            ]
            num_all_samples = len(idx_for_each_class[i])
            num_selected_clients = len(selected_clients)
            num_per = num_all_samples / num_selected_clients
            num_samples = np.random.randint(
                max(num_per / 10, least_samples / num_classes), num_per, num_selected_clients - 1
            ).tolist()
            num_samples.append(num_all_samples - sum(num_samples))
            idx = 0
            for client, num_sample in zip(selected_clients, num_samples):
                part = idx_for_each_class[i][idx : idx + num_sample]
                dataidx_map[client] = (
                    part if client not in dataidx_map else np.append(dataidx_map[client], part)
                )
                idx += num_sample
                class_num_per_client[client] -= 1
    else:
        min_size, big_n = 0, len(labels)
        while min_size < least_samples:
            idx_batch = [[] for _ in range(num_clients)]
            for k in range(num_classes):
                idx_k = np.where(labels == k)[0]
                np.random.shuffle(idx_k)
                proportions = np.random.dirichlet(np.repeat(ALPHA, num_clients))
                if balance_factor:
                    proportions = np.array(
                        [p * (len(idx_j) < big_n / num_clients) for p, idx_j in zip(proportions, idx_batch)]
                    )
                proportions = proportions / proportions.sum()
                proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
                idx_batch = [
                    idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))
                ]
                min_size = min([len(idx_j) for idx_j in idx_batch])
        dataidx_map = {j: np.array(idx_batch[j]) for j in range(num_clients)}
    return [np.asarray(dataidx_map[c]) for c in range(num_clients)]


def reference_split_data(shares):
    """PFLlib's split_data: sklearn's ShuffleSplit on the global generator, client after client."""
    train, test = [], []
    for share in shares:
        n = len(share)
        n_train = math.floor(TRAIN_RATIO * n)
        n_test = n - n_train
        permutation = np.random.permutation(n)
        test.append(np.sort(share[permutation[:n_test]]))
        train.append(np.sort(share[permutation[n_test : n_test + n_train]]))
    return train, test


def reference_clients(labels, num_clients, partition, class_per_client=None, balance_factor=True):
    state = np.random.get_state()
    np.random.seed(1)
    try:
        num_classes = len(set(labels.tolist()))
        shares = reference_separate_data(
            labels, num_clients, num_classes, partition, class_per_client, balance_factor
        )
        return reference_split_data(shares)
    finally:
        np.random.set_state(state)


def generated_labels(num_classes: int, train: int, test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced labels in a random order, as the real sets (FMNIST 60,000 + 10,000, CIFAR 50,000 + 10,000)."""
    rng = np.random.default_rng(seed)
    return (
        rng.permutation(np.arange(train) % num_classes),
        rng.permutation(np.arange(test) % num_classes),
    )


SETTINGS = {
    "fmnist": (10, 60_000, 10_000, 2),
    "cifar100": (100, 50_000, 10_000, 10),
}


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def labels(request):
    num_classes, n_train, n_test, per_client = SETTINGS[request.param]
    train, test = generated_labels(num_classes, n_train, n_test, seed=num_classes)
    return train, test, per_client


@pytest.mark.parametrize("partition", ["dir", "pat"])
def test_seed_1_gives_pfllibs_clients(labels, partition):
    train, test, per_client = labels
    pool = np.concatenate([train, test])
    expected_train, expected_test = reference_clients(pool, 20, partition, per_client)
    partitioner = PFLlibPartitioner(
        20, partition=partition, alpha=ALPHA, classes_per_client=per_client if partition == "pat" else None
    )
    before = np.random.get_state()[1].copy()
    split = partitioner.split(torch.from_numpy(train), torch.from_numpy(test), seed=1)
    assert (np.random.get_state()[1] == before).all(), "the global generator was used"
    assert split.num_clients == 20
    for client in range(20):
        assert split.train[client].tolist() == expected_train[client].tolist(), client
        assert split.test[client].tolist() == expected_test[client].tolist(), client
    owned = torch.cat(split.train + split.test)
    assert owned.numel() == pool.size and owned.unique().numel() == pool.size  # every pooled sample, once


def test_the_check_sees_the_balancing_factor(labels):
    """Plant-the-bug: PFLlib's Dirichlet cut without its "p * (len(idx_j) < N / num_clients)" factor gives
    other clients, so the comparison above would catch a partitioner that dropped it."""
    train, test, _ = labels
    pool = np.concatenate([train, test])
    unbalanced_train, _ = reference_clients(pool, 20, "dir", balance_factor=False)
    split = PFLlibPartitioner(20, partition="dir").split(
        torch.from_numpy(train), torch.from_numpy(test), seed=1
    )
    assert any(split.train[c].tolist() != unbalanced_train[c].tolist() for c in range(20))


def test_sklearn_train_test_split_is_the_restated_split():
    """The restated split_data is scikit-learn's train_test_split on the global generator."""
    sklearn = pytest.importorskip("sklearn.model_selection")
    shares = [np.arange(10, 10 + n) for n in (7, 40, 101)]
    np.random.seed(3)
    expected = [sklearn.train_test_split(s, train_size=TRAIN_RATIO, shuffle=True) for s in shares]
    np.random.seed(3)
    train, test = reference_split_data(shares)
    for (x_train, x_test), got_train, got_test in zip(expected, train, test):
        assert sorted(x_train.tolist()) == got_train.tolist() and sorted(x_test.tolist()) == got_test.tolist()


def test_other_seeds_give_other_clients_and_the_same_seed_the_same():
    train, test = generated_labels(10, 3000, 600, seed=0)
    partitioner = PFLlibPartitioner(20, partition="dir")
    one = partitioner.split(torch.from_numpy(train), torch.from_numpy(test), seed=1)
    again = partitioner.split(torch.from_numpy(train), torch.from_numpy(test), seed=1)
    other = partitioner.split(torch.from_numpy(train), torch.from_numpy(test), seed=2)
    assert all(torch.equal(a, b) for a, b in zip(one.train, again.train))
    assert any(not torch.equal(a, b) for a, b in zip(one.train, other.train))


def test_a_fixed_seed_overrides_the_given_one():
    train, test = generated_labels(10, 3000, 600, seed=0)
    fixed = PFLlibPartitioner(20, partition="dir", seed=1)
    one = PFLlibPartitioner(20, partition="dir").split(
        torch.from_numpy(train), torch.from_numpy(test), seed=1
    )
    for given in (1, 2):
        got = fixed.split(torch.from_numpy(train), torch.from_numpy(test), seed=given)
        assert all(torch.equal(a, b) for a, b in zip(got.test, one.test))


def test_each_client_is_split_75_25():
    train, test = generated_labels(10, 3000, 600, seed=0)
    split = PFLlibPartitioner(20, partition="pat", classes_per_client=2).split(
        torch.from_numpy(train), torch.from_numpy(test), seed=1
    )
    for tr, te in zip(split.train, split.test):
        n = tr.numel() + te.numel()
        assert tr.numel() == math.floor(0.75 * n) and te.numel() == n - tr.numel()
        pool = np.concatenate([train, test])
        assert len(set(pool[tr.numpy()].tolist()) | set(pool[te.numpy()].tolist())) <= 2


def test_the_data_module_pools_train_and_test():
    """A pooling partitioner's indices point into train_set ++ test_set, for both splits."""
    train, test = generated_labels(10, 1500, 500, seed=0)
    x = torch.arange(2000, dtype=torch.float32)[:, None]
    train_set = TensorDataset(x[:1500], torch.from_numpy(train))
    test_set = TensorDataset(x[1500:], torch.from_numpy(test))
    partitioner = PFLlibPartitioner(20, partition="dir")
    dm = FederatedDataModule(train_set, test_set, partitioner, seed=1)
    dm.setup()
    split = partitioner.split(torch.from_numpy(train), torch.from_numpy(test), seed=1)
    pool_labels = np.concatenate([train, test])
    for client in range(20):
        for name, indices in (("train", split.train[client]), ("test", split.test[client])):
            data = dm.client_data(client, name)
            xs = torch.stack([data.dataset[int(i)][0] for i in data.indices])
            ys = [int(data.dataset[int(i)][1]) for i in data.indices]
            assert xs[:, 0].long().tolist() == indices.tolist()  # the sample's pool position
            assert ys == pool_labels[indices.numpy()].tolist()
    assert sum(len(dm.client_data(c, "test")) for c in range(20)) > 0
    from_test_file = torch.cat([dm.client_data(c, "train").indices for c in range(20)]) >= 1500
    assert from_test_file.any()  # clients train on samples of the test file


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_clients": 0}, "num_clients"),
        ({"partition": "iid"}, "partition="),
        ({"alpha": 0.0}, "alpha="),
        ({"partition": "pat"}, "classes_per_client"),
        ({"partition": "dir", "classes_per_client": 2}, "classes_per_client"),
        ({"train_fraction": 1.0}, "train_fraction"),
        ({"balance": "no"}, "balance"),
        ({"least_samples": -1}, "least_samples"),
        ({"max_tries": 0}, "max_tries"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PFLlibPartitioner(**kwargs)


def test_labels_must_be_0_to_c_minus_1():
    with pytest.raises(ValueError, match="0 .. C-1"):
        PFLlibPartitioner(2, partition="dir").split(torch.tensor([1, 2, 3, 1, 2, 3]), None, seed=1)


def test_a_dirichlet_draw_that_cannot_succeed_says_so():
    labels = torch.arange(40) % 2
    with pytest.raises(ValueError, match="max_tries"):
        PFLlibPartitioner(4, partition="dir", least_samples=11, max_tries=3).split(labels, None, seed=1)
