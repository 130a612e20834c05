"""The FedRep paper's synthetic low-rank linear regression problem as a data module (for recipes)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.synthetic import (
    LowRankLinearProblem,
    make_low_rank_problem,
    method_of_moments_init,
)


class LowRankLinearDataModule(FederatedDataModule):
    """Clients of :func:`make_low_rank_problem`, each with its fixed training sample and test points.

    ``batch_size=None`` uses one full batch per client (Algorithm 2's full-gradient steps). Pair it with
    :class:`~lightning_fedrep.models.LowRankLinear` (``init="mom"`` for the method-of-moments start).
    """

    def __init__(
        self,
        dim: int = 20,
        rank: int = 2,
        num_clients: int = 100,
        samples_per_client: int = 10,
        test_samples_per_client: int = 50,
        noise_std: float = 1e-3,
        batch_size: int | None = None,
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(batch_size=batch_size or samples_per_client, seed=seed, **kwargs)
        self.problem: LowRankLinearProblem = make_low_rank_problem(
            dim, rank, num_clients, samples_per_client, test_samples_per_client, noise_std, seed
        )
        self.rank = rank
        self._set_clients_from(self.problem)

    def _set_clients_from(self, problem: LowRankLinearProblem) -> None:
        reference = FederatedDataModule.from_client_datasets(problem.train, problem.test)
        self._set_clients(reference._train, reference._test)

    def method_of_moments_init(self) -> Tensor:
        """Algorithm 2's initial body from every client's training sample, shape ``(dim, rank)``."""
        return method_of_moments_init(self.problem.train, self.rank)
