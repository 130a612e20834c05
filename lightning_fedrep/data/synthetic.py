"""Synthetic low-rank linear regression problem of the FedRep paper (Sec. 5.1, Algorithm 2).

Every client ``i`` shares a ``d x k`` representation ``B*`` (orthonormal columns) and owns a head
``w_i*`` in ``R^k`` with ``||w_i*|| = sqrt(k)`` (Assumption 3). Its samples are

    x ~ N(0, I_d),    y = w_i*^T B*^T x + noise_std * N(0, 1).

This module generates such problems reproducibly (a local :class:`torch.Generator`, never the global
RNG), provides Algorithm 2's method-of-moments initialisation of the representation, and the
principal-angle distance (Definition 1) used to measure how well ``col(B*)`` is recovered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep.data.loaders import ClientData, RoundLoader, _BatchFetcher
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import NaturalPartitioner
from lightning_fedrep.plan import round_generator

__all__ = [
    "LowRankLinearDataModule",
    "FreshSampleRoundLoader",
    "LowRankLinearProblem",
    "SyntheticClassificationDataModule",
    "make_synthetic_classification",
    "make_low_rank_problem",
    "method_of_moments_init",
    "principal_angle_distance",
]


@dataclass
class LowRankLinearProblem:
    """The FedRep paper's synthetic low-rank linear regression problem (Sec. 5.1).

    Attributes:
        ground_truth_body: ``B*``, shape ``(d, k)``, orthonormal columns (QR of a Gaussian ``d x k``).
        client_heads: ``w_i*`` stacked as rows, shape ``(num_clients, k)``; Gaussian rows normalised to
            norm ``sqrt(k)`` (Assumption 3).
        train: one :class:`TensorDataset` per client holding ``x`` of shape ``(m, d)`` and ``y`` of shape
            ``(m, 1)``, both float32.
        test: one :class:`TensorDataset` per client with fresh test points from the same client model.
        noise_std: standard deviation of the additive Gaussian label noise.
    """

    ground_truth_body: Tensor
    client_heads: Tensor
    train: list[TensorDataset]
    test: list[TensorDataset]
    noise_std: float

    @property
    def dim(self) -> int:
        """Input dimension ``d``."""
        return self.ground_truth_body.shape[0]

    @property
    def rank(self) -> int:
        """Representation dimension ``k``."""
        return self.ground_truth_body.shape[1]

    @property
    def num_clients(self) -> int:
        """Number of clients ``n``."""
        return self.client_heads.shape[0]

    def draw(self, client: int, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw ``num_samples`` fresh samples of ``client`` using ``generator``.

        Used to build the fixed train/test splits and for experiments with fresh samples every round
        (Algorithm 2 taken literally).

        Returns:
            ``(x, y)`` with ``x`` of shape ``(num_samples, d)`` and ``y`` of shape ``(num_samples, 1)``,
            both float32 on the device of :attr:`ground_truth_body`.
        """
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} out of range for {self.num_clients} clients")
        device = self.ground_truth_body.device
        x = torch.randn(num_samples, self.dim, generator=generator, device=device)
        noise = torch.randn(num_samples, 1, generator=generator, device=device)
        theta = self.ground_truth_body @ self.client_heads[client]  # (d,) = B* w_i*
        y = (x @ theta).unsqueeze(1) + self.noise_std * noise
        return x, y


def make_low_rank_problem(
    dim: int = 20,
    rank: int = 2,
    num_clients: int = 100,
    samples_per_client: int = 10,
    test_samples_per_client: int = 50,
    noise_std: float = 1e-3,
    seed: int = 0,
) -> LowRankLinearProblem:
    """Generate a :class:`LowRankLinearProblem` deterministically from ``seed``.

    Draw order from a local generator: ``B*``, the heads, every client's training set (client 0 first),
    then every client's test set. Changing the number of test samples therefore leaves ``B*``, the heads
    and the training data unchanged.
    """
    if rank > dim:
        raise ValueError(f"rank ({rank}) must not exceed dim ({dim})")
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    body, _ = torch.linalg.qr(gaussian)
    heads = torch.randn(num_clients, rank, generator=generator, dtype=torch.float64)
    heads = heads / heads.norm(dim=1, keepdim=True) * rank**0.5
    problem = LowRankLinearProblem(
        ground_truth_body=body.float(),
        client_heads=heads.float(),
        train=[],
        test=[],
        noise_std=float(noise_std),
    )
    for client in range(num_clients):
        problem.train.append(TensorDataset(*problem.draw(client, samples_per_client, generator)))
    for client in range(num_clients):
        problem.test.append(TensorDataset(*problem.draw(client, test_samples_per_client, generator)))
    return problem


def method_of_moments_init(datasets: Sequence[TensorDataset], rank: int) -> Tensor:
    """Algorithm 2's method-of-moments initialisation of the representation.

    Every client computes ``Z_i = (1/m) sum_j y_j^2 x_j x_j^T`` on its samples; the server averages the
    ``Z_i`` uniformly over *all* given clients and returns the top-``rank`` eigenvectors of the average
    (symmetric, so :func:`torch.linalg.eigh`), largest eigenvalue first.

    Args:
        datasets: one ``TensorDataset(x, y)`` per client, ``x`` of shape ``(m, d)``, ``y`` of ``(m,)`` or
            ``(m, 1)``.
        rank: ``k``, the number of eigenvectors to keep.

    Returns:
        A ``(d, rank)`` matrix with orthonormal columns, in the dtype of the first client's ``x``.
    """
    if len(datasets) == 0:
        raise ValueError("method_of_moments_init needs at least one client dataset")
    total: Tensor | None = None
    for dataset in datasets:
        x, y = dataset.tensors[0], dataset.tensors[1]
        x64 = x.double()
        y64 = y.double().reshape(x.shape[0], 1)
        z = (x64 * y64.square()).T @ x64 / x.shape[0]
        total = z if total is None else total + z
    assert total is not None
    average = total / len(datasets)
    _, eigenvectors = torch.linalg.eigh(average)  # ascending eigenvalues
    top = eigenvectors[:, -rank:].flip(1)
    return top.to(datasets[0].tensors[0].dtype)


def _orthonormal_basis(matrix: Tensor) -> Tensor:
    matrix = matrix.detach().to(device="cpu", dtype=torch.float64)
    if matrix.ndim == 1:
        matrix = matrix.unsqueeze(1)
    if matrix.ndim != 2:
        raise ValueError(f"expected a (d, k) matrix, got shape {tuple(matrix.shape)}")
    q, _ = torch.linalg.qr(matrix)
    return q


def principal_angle_distance(estimate: Tensor, truth: Tensor) -> float:
    """Principal-angle distance (Definition 1): ``||(I - Q1 Q1^T) Q2||_2`` (spectral norm).

    ``Q1`` and ``Q2`` are orthonormal bases (QR) of ``col(estimate)`` and ``col(truth)``, so the result
    depends only on the column spaces, lies in ``[0, 1]``, and is ``sin`` of the largest principal angle
    when both have the same rank. Computed in float64 on the CPU.

    Args:
        estimate: the learned representation ``B``, shape ``(d, k)`` (full column rank assumed).
        truth: the ground truth ``B*``, shape ``(d, k')``.
    """
    q1 = _orthonormal_basis(estimate)
    q2 = _orthonormal_basis(truth)
    if q1.shape[0] != q2.shape[0]:
        raise ValueError(f"row dimensions differ: {q1.shape[0]} vs {q2.shape[0]}")
    residual = q2 - q1 @ (q1.T @ q2)
    return float(torch.linalg.matrix_norm(residual, ord=2))


# --------------------------------------------------------------------------------------------------
# synthetic classification with a shared nonlinear representation and personal heads
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# low-rank linear regression as a data module, with fixed samples or fresh samples every round
# --------------------------------------------------------------------------------------------------


class _DrawnEachRound(Dataset):
    """Stands for a client's training samples that are drawn anew every round (never indexed)."""

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> None:
        raise RuntimeError("Fresh-sample clients draw their data every round; use FreshSampleRoundLoader.")


class FreshSampleRoundLoader(RoundLoader):
    """A :class:`~lightning_fedrep.data.loaders.RoundLoader` whose clients draw fresh samples every round.

    In round ``r`` client ``i`` draws ``samples_per_round`` new samples with
    ``problem.draw(i, samples_per_round, round_generator(seed, r, i))``, as FedRep's Algorithm 2 and the
    SRPFL analysis assume; its steps in the round are passes over these samples, ordered as in the
    base loader. The samples are a pure function of ``(seed, r, i)``, so a run is reproducible and a
    resumed run (even mid-round) trains on the same samples.
    """

    def __init__(
        self,
        problem: LowRankLinearProblem,
        samples_per_round: int,
        batch_size: int,
        seed: int = 0,
        fetcher: _BatchFetcher | None = None,
    ):
        if samples_per_round < 1:
            raise ValueError(f"samples_per_round must be >= 1, got {samples_per_round}.")
        placeholder = _DrawnEachRound(samples_per_round)
        clients = [
            ClientData(placeholder, torch.arange(samples_per_round)) for _ in range(problem.num_clients)
        ]
        super().__init__(clients, batch_size, seed, fetcher)
        self.problem = problem
        self.samples_per_round = samples_per_round

    def round_samples(self, client: int, round_index: int) -> TensorDataset:
        """The samples ``client`` trains on in round ``round_index``."""
        generator = round_generator(self.seed, round_index, client)
        return TensorDataset(*self.problem.draw(client, self.samples_per_round, generator))

    def client_batches(self, client: int, round_index: int, first_step: int, num_steps: int) -> Iterator[Any]:
        """The client's batches from its round samples (in place of its fixed data set)."""
        index_batches = self.client_index_batches(client, round_index, first_step, num_steps)
        return self.fetcher.batches(self.round_samples(client, round_index), index_batches)


class LowRankLinearDataModule(FederatedDataModule):
    """:func:`make_low_rank_problem`'s clients, with a fixed sample each or a fresh sample every round.

    ``fresh_samples=True``: in every round client ``i`` trains on ``samples_per_client`` new samples
    (:class:`FreshSampleRoundLoader`, FedRep's Algorithm 2 and the SRPFL analysis taken literally).
    ``fresh_samples=False`` (default): it reuses its fixed sample ``problem.train[i]`` every round, as
    the FedRep paper's notebook does.
    Either way ``client_data(i, "train")`` is the fixed initial sample, which
    :meth:`method_of_moments_init` uses (Algorithm 2's initialisation, ``LowRankLinear(init="mom")``),
    and validation and test use ``problem.test``. ``batch_size=None`` gives full-batch steps.
    ``seed`` seeds the problem, the fresh samples (with the round and the client) and the data order.
    """

    def __init__(
        self,
        dim: int = 20,
        rank: int = 2,
        num_clients: int = 100,
        samples_per_client: int = 10,
        test_samples_per_client: int = 50,
        noise_std: float = 1e-3,
        fresh_samples: bool = False,
        batch_size: int | None = None,
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(batch_size=batch_size or samples_per_client, seed=seed, **kwargs)
        self.fresh_samples = fresh_samples
        self.samples_per_client = samples_per_client
        self.rank = rank
        self._use(
            make_low_rank_problem(
                dim, rank, num_clients, samples_per_client, test_samples_per_client, noise_std, seed
            )
        )

    @classmethod
    def from_problem(
        cls, problem: LowRankLinearProblem, fresh_samples: bool = False, **kwargs: Any
    ) -> LowRankLinearDataModule:
        """A data module over an existing problem (``samples_per_client`` = its training set size)."""
        module = cls(
            dim=problem.dim,
            rank=problem.rank,
            num_clients=1,
            samples_per_client=len(problem.train[0]),
            test_samples_per_client=1,
            fresh_samples=fresh_samples,
            **kwargs,
        )
        module._use(problem)
        return module

    def _use(self, problem: LowRankLinearProblem) -> None:
        self.problem = problem
        self._set_clients(
            [ClientData(d, torch.arange(len(d))) for d in problem.train],
            [ClientData(d, torch.arange(len(d))) for d in problem.test],
        )

    def method_of_moments_init(self) -> Tensor:
        """Algorithm 2's initial body from every client's fixed sample, shape ``(dim, rank)``."""
        return method_of_moments_init(self.problem.train, self.rank)

    def train_dataloader(self) -> RoundLoader:
        if not self.fresh_samples:
            return super().train_dataloader()
        return FreshSampleRoundLoader(
            self.problem, self.samples_per_client, self.batch_size, self.seed, self._fetcher
        )
