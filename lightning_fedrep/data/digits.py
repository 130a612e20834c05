"""scikit-learn's bundled handwritten digits (8x8 images, 10 classes): real data, offline."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils.data import TensorDataset

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import Partitioner, ShardPartitioner
from lightning_fedrep.federation.api.arguments import check_real


def load_digits_tensors(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 digits as standardised float features (64) and integer labels, split train/test.

    The split is stratified-free and seeded; pixel values are scaled to [0, 1] then standardised
    with the training set's mean and std.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "The digits data set needs scikit-learn: pip install 'lightning-fedrep[digits]'."
        ) from error
    bunch = load_digits()
    x = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    mean, std = x[train_idx].mean(0), x[train_idx].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


class DigitsDataModule(FederatedDataModule):
    """The digits split over clients, by default FedRep-style: ``classes_per_client`` classes each
    (``assignment``: how :class:`ShardPartitioner` deals them, ``"distinct"`` or ``"official"``)."""

    def __init__(
        self,
        num_clients: int = 20,
        classes_per_client: int = 2,
        partitioner: Partitioner | None = None,
        batch_size: int = 10,
        test_fraction: float = 0.2,
        seed: int = 0,
        assignment: Literal["distinct", "official"] = "distinct",
        **kwargs: Any,
    ):
        check_real(
            "test_fraction",
            test_fraction,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            owner="DigitsDataModule",
        )
        train, test = load_digits_tensors(test_fraction, seed)
        super().__init__(
            train,
            test,
            partitioner=partitioner or ShardPartitioner(num_clients, classes_per_client, assignment),
            batch_size=batch_size,
            seed=seed,
            **kwargs,
        )
