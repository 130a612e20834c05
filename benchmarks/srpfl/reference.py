"""Independent plain-PyTorch reference of FedRep-SRPFL (Algorithm 2 with the doubling schedule).

Used as an oracle by the tests and the benchmark. It shares no code with the callback, the strategy
or the model: participation is ``argsort`` of the round's latencies (the ``n`` fastest, ``n`` doubling
every ``rounds_per_stage`` rounds, as the official code's counter does), the round costs the slowest
participant's latency plus the communication cost, the head is solved by the normal equations, the
body gradient is the closed form ``-(1/m) X^T (y - X B w) w^T`` and the server takes the plain mean
of the clients' bodies (no orthonormalisation, like the strategy). The distance is computed from
the singular values of ``Q_B^T Q_*``. Only the data come from the package (``problem.draw`` with the
generator seeded by ``(seed, round, client)``, the fresh-sample convention of the data module).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_fedrep.data.low_rank import LowRankLinearProblem
from lightning_fedrep.federation.plan import round_generator


def subspace_distance(estimate: Tensor, truth: Tensor) -> float:
    """``sin`` of the largest principal angle between ``col(estimate)`` and ``col(truth)``."""
    q1, _ = torch.linalg.qr(estimate.double())
    q2, _ = torch.linalg.qr(truth.double())
    smallest_cosine = torch.linalg.svdvals(q1.T @ q2).min().clamp(max=1.0)
    return float(torch.sqrt(1.0 - smallest_cosine**2))


def srpfl_linear_reference(
    problem: LowRankLinearProblem,
    init_body: Tensor,
    latencies: Callable[[int], Tensor],
    rounds: int,
    initial_clients: int | None,
    rounds_per_stage: int = 10,
    lr: float = 0.1,
    sample_seed: int = 0,
    fresh: bool = True,
    communication_cost: float = 0.0,
    qr: bool = False,
) -> tuple[list[float], list[float]]:
    """Run ``rounds`` rounds; return the simulated time and ``dist(B, B*)`` after each round.

    ``latencies(r)`` gives every client's latency in round ``r``; ``initial_clients=None`` is FedRep
    (every client, every round). ``fresh=True`` draws each participant's samples anew every round,
    otherwise each client uses its fixed ``problem.train`` sample. ``qr=True`` replaces the average by
    its orthonormal QR factor every round (Algorithm 2, line 14).
    """
    body = init_body.detach().double().clone()
    truth = problem.ground_truth_body.double()
    num_clients = problem.num_clients
    n = num_clients if initial_clients is None else initial_clients
    counter = rounds_per_stage
    clock, times, distances = 0.0, [], []
    for r in range(rounds):
        latency = latencies(r).double()
        chosen = torch.argsort(latency, stable=True)[: min(n, num_clients)]
        clock += float(latency[chosen].max()) + communication_cost
        total = torch.zeros_like(body)
        for client in chosen.tolist():
            if fresh:
                m = len(problem.train[client])
                x, y = problem.draw(client, m, round_generator(sample_seed, r, client))
            else:
                x, y = problem.train[client].tensors
            x, y = x.double(), y.double().reshape(-1, 1)
            features = x @ body
            w = torch.linalg.solve(features.T @ features, features.T @ y)
            gradient = -(x.T @ (y - features @ w)) @ w.T / x.shape[0]
            total += body - lr * gradient
        body = total / len(chosen)
        if qr:
            body = torch.linalg.qr(body).Q
        times.append(clock)
        distances.append(subspace_distance(body, truth))
        if counter == 1:
            n, counter = min(2 * n, num_clients), rounds_per_stage
        else:
            counter -= 1
    return times, distances


def time_to_reach(times: list[float], distances: list[float], target: float) -> float:
    """Simulated time at the first round whose distance is at most ``target`` (``inf`` if none)."""
    for t, d in zip(times, distances):
        if d <= target:
            return t
    return float("inf")
