"""Subspace math of the FedRep paper's low-rank linear problem (Algorithm 2, Definition 1).

Algorithm 2's method-of-moments initialisation of the representation, and the principal-angle
distance (Definition 1) used to measure how well ``col(B*)`` is recovered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

__all__ = ["method_of_moments_init", "principal_angle_distance"]


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
