"""Synthetic classification with a shared nonlinear representation and personal heads."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import NaturalPartitioner

__all__ = ["SyntheticClassificationDataModule", "make_synthetic_classification"]


def _synthetic_feature_map(dim: int, hidden: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The shared feature map's weights ``W1`` (hidden x dim) and ``W2`` (hidden x hidden), gain 2."""
    w1 = torch.randn(hidden, dim, generator=generator) * (2.0 / dim**0.5)
    w2 = torch.randn(hidden, hidden, generator=generator) * (2.0 / hidden**0.5)
    return w1, w2


def make_synthetic_classification(
    num_clients: int = 20,
    samples_per_client: int = 100,
    test_samples_per_client: int = 100,
    dim: int = 20,
    num_classes: int = 10,
    classes_per_client: int = 2,
    hidden: int = 8,
    seed: int = 0,
) -> tuple[list[TensorDataset], list[TensorDataset]]:
    """Classification clients that share a nonlinear representation but need personal heads.

    Generative model (all weights drawn once from a local generator seeded with ``seed``):

    * Shared representation: a fixed random 2-layer tanh network without biases,
      ``phi(x) = tanh(W2 tanh(W1 x))`` with ``W1 ~ N(0, 4/dim)`` of shape ``(hidden, dim)`` and
      ``W2 ~ N(0, 4/hidden)`` of shape ``(hidden, hidden)``. ``phi`` is odd, so ``E[phi(x)] = 0``.
    * Client ``i`` owns ``classes_per_client`` distinct classes ``c_i`` (a uniformly random subset of
      ``0 .. num_classes-1``) and a head ``V_i`` of shape ``(classes_per_client, hidden)`` with
      independent Gaussian rows scaled to unit norm.
    * A sample of client ``i`` is ``x ~ N(0, I_dim)`` with label ``y = c_i[argmax_j (V_i phi(x))_j]``
      (no label noise).

    Every client's labels are therefore a linear classifier of the *same* features ``phi(x)``, so a
    shared body that learns ``phi`` plus a per-client linear head fits every client exactly, while two
    clients holding the same class label different regions of input space with it, so one global model
    cannot fit them all. With two classes per client the classes are exactly balanced in expectation
    (``x`` and ``-x`` are equally likely and swap the argmax).

    Draw order: ``W1``, ``W2``, every client's classes and head (client 0 first), every client's train
    samples, then every client's test samples; changing ``test_samples_per_client`` leaves the train data
    unchanged.

    Returns:
        ``(train, test)``: one ``TensorDataset(x, y)`` per client each, ``x`` float32 of shape
        ``(m, dim)``, ``y`` int64 of shape ``(m,)`` with values in that client's classes.
    """
    for name, value in (
        ("num_clients", num_clients),
        ("samples_per_client", samples_per_client),
        ("dim", dim),
        ("num_classes", num_classes),
        ("classes_per_client", classes_per_client),
        ("hidden", hidden),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    if test_samples_per_client < 0:
        raise ValueError(f"test_samples_per_client must be >= 0, got {test_samples_per_client}.")
    if classes_per_client > num_classes:
        raise ValueError(
            f"classes_per_client={classes_per_client} exceeds num_classes={num_classes}; a client cannot "
            "hold the same class twice."
        )
    generator = torch.Generator().manual_seed(seed)
    w1, w2 = _synthetic_feature_map(dim, hidden, generator)
    classes = [
        torch.randperm(num_classes, generator=generator)[:classes_per_client].sort().values
        for _ in range(num_clients)
    ]
    heads = []
    for _ in range(num_clients):
        head = torch.randn(classes_per_client, hidden, generator=generator)
        heads.append(head / head.norm(dim=1, keepdim=True))

    def draw(client: int, num_samples: int) -> TensorDataset:
        x = torch.randn(num_samples, dim, generator=generator)
        features = torch.tanh(torch.tanh(x @ w1.T) @ w2.T)
        y = classes[client][(features @ heads[client].T).argmax(dim=1)]
        return TensorDataset(x, y.long())

    train = [draw(client, samples_per_client) for client in range(num_clients)]
    test = [draw(client, test_samples_per_client) for client in range(num_clients)]
    return train, test


class SyntheticClassificationDataModule(FederatedDataModule):
    """:func:`make_synthetic_classification`'s clients as a data module (one client per generated client).

    The data are generated in ``setup`` from ``seed``, which also seeds the validation split and the
    data order. The clients' samples lie in one tensor data set per split, cut by a
    :class:`~lightning_fedrep.data.partition.NaturalPartitioner` on the client ids.
    """

    def __init__(
        self,
        num_clients: int = 20,
        samples_per_client: int = 100,
        test_samples_per_client: int = 100,
        dim: int = 20,
        num_classes: int = 10,
        classes_per_client: int = 2,
        hidden: int = 8,
        batch_size: int = 10,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
        )
        self.generator_args = dict(
            num_clients=num_clients,
            samples_per_client=samples_per_client,
            test_samples_per_client=test_samples_per_client,
            dim=dim,
            num_classes=num_classes,
            classes_per_client=classes_per_client,
            hidden=hidden,
        )
        self.num_classes = num_classes

    def setup(self, stage: str | None = None) -> None:
        """Generate the clients' data (once) and assign each generated client its samples."""
        if self._train is not None:
            return
        train, test = make_synthetic_classification(**self.generator_args, seed=self.seed)

        def concat(datasets: list[TensorDataset]) -> tuple[TensorDataset, Tensor]:
            x = torch.cat([d.tensors[0] for d in datasets])
            y = torch.cat([d.tensors[1] for d in datasets])
            owner = torch.cat([torch.full((len(d),), i, dtype=torch.long) for i, d in enumerate(datasets)])
            return TensorDataset(x, y), owner

        self.train_set, train_owner = concat(train)
        self.test_set, test_owner = concat(test)
        self.partitioner = NaturalPartitioner(train_owner, test_owner)
        super().setup(stage)
