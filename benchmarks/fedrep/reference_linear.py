"""Independent plain-PyTorch reference of FedRep Algorithm 2 on the low-rank linear problem.

Used as an oracle by the tests. It deliberately shares no code with the package's model or
strategy: the head is solved by the normal equations, the body gradient is the closed form
``grad_B f_hat = -(1/m) X^T (y - X B w) w^T`` (no autograd), and the distance is computed from the
singular values of ``Q_B^T Q_*`` instead of the package's ``principal_angle_distance``.

Each client keeps its fixed training set across rounds (as in the paper's notebook), not fresh samples.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_fedrep.data.low_rank import LowRankLinearProblem


def subspace_distance(estimate: Tensor, truth: Tensor) -> float:
    """``sin`` of the largest principal angle between ``col(estimate)`` and ``col(truth)`` (same rank)."""
    q1, _ = torch.linalg.qr(estimate.double())
    q2, _ = torch.linalg.qr(truth.double())
    smallest_cosine = torch.linalg.svdvals(q1.T @ q2).min().clamp(max=1.0)
    return float(torch.sqrt(1.0 - smallest_cosine**2))


def fedrep_linear_reference(
    problem: LowRankLinearProblem,
    init_body: Tensor,
    rounds: int,
    participation_count: int,
    lr: float,
    seed_sampler: Callable[[int], list[int]],
) -> list[float]:
    """Run Algorithm 2 for ``rounds`` rounds and return ``dist(B^t, B*)`` after each round.

    Round ``t`` (0-based) uses the client ids ``seed_sampler(t)`` (exactly ``participation_count`` of
    them). Every sampled client solves its head exactly on its fixed training data with the current
    global ``B``, takes one gradient step of size ``lr`` on ``B``, and the server averages the clients'
    bodies weighted by their sample counts.
    """
    body = init_body.detach().clone().float()
    truth = problem.ground_truth_body.float()
    distances: list[float] = []
    for t in range(rounds):
        clients = list(seed_sampler(t))
        if len(clients) != participation_count:
            raise ValueError(
                f"round {t}: sampler gave {len(clients)} clients, expected {participation_count}"
            )
        weighted_sum = torch.zeros_like(body)
        total_samples = 0
        for client in clients:
            x, y = problem.train[client].tensors
            x, y = x.float(), y.float().reshape(-1, 1)
            m = x.shape[0]
            features = x @ body  # (m, k)
            w = torch.linalg.solve(features.T @ features, features.T @ y)  # (k, 1)
            residual = y - features @ w  # (m, 1)
            gradient = -(x.T @ residual) @ w.T / m  # (d, k)
            weighted_sum += m * (body - lr * gradient)
            total_samples += m
        body = weighted_sum / total_samples
        distances.append(subspace_distance(body, truth))
    return distances
