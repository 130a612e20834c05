"""Synthetic low-rank linear regression problem of the FedRep paper (Sec. 5.1, Algorithm 2).

Every client ``i`` shares a ``d x k`` representation ``B*`` (orthonormal columns) and owns a head
``w_i*`` in ``R^k`` with ``||w_i*|| = sqrt(k)`` (Assumption 3). Its samples are

    x ~ N(0, I_d),    y = w_i*^T B*^T x + noise_std * N(0, 1).

This module generates such problems reproducibly (a local :class:`torch.Generator`, never the global
RNG), provides Algorithm 2's method-of-moments initialisation of the representation, and the
principal-angle distance (Definition 1) used to measure how well ``col(B*)`` is recovered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

__all__ = [
    "LowRankLinearProblem",
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
