"""Synthetic low-rank linear regression problem of the FedRep paper (Sec. 5.1, Algorithm 2).

Every client ``i`` shares a ``d x k`` representation ``B*`` (orthonormal columns) and owns a head
``w_i*`` in ``R^k`` with ``||w_i*|| = sqrt(k)`` (Assumption 3). Its samples are

    x ~ N(0, I_d),    y = w_i*^T B*^T x + noise_std * N(0, 1).

This module generates such problems reproducibly (a local :class:`torch.Generator`, never the global
RNG) and serves them as a data module, with a fixed sample per client or fresh samples every round.
Algorithm 2's method-of-moments initialisation and the principal-angle distance (Definition 1) are in
:mod:`lightning_fedrep.data.subspace`.
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
from lightning_fedrep.data.subspace import method_of_moments_init
from lightning_fedrep.federation.api.arguments import check_bool, check_int, check_real
from lightning_fedrep.federation.plan import round_generator

__all__ = [
    "LowRankLinearDataModule",
    "FreshSampleRoundLoader",
    "LowRankLinearProblem",
    "make_low_rank_problem",
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

    def batches_at(self, client: int, round_index: int, positions: Sequence[torch.Tensor]) -> Iterator[Any]:
        """The client's round samples at ``positions`` (in place of its fixed data set)."""
        return self.fetcher.batches(self.round_samples(client, round_index), list(positions))


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
        owner = type(self).__name__
        for name, value in (
            ("dim", dim),
            ("num_clients", num_clients),
            ("samples_per_client", samples_per_client),
            ("test_samples_per_client", test_samples_per_client),
        ):
            check_int(name, value, minimum=1, owner=owner)
        check_int("rank", rank, minimum=1, maximum=dim, owner=owner)
        check_real("noise_std", noise_std, low=0.0, owner=owner)
        check_bool("fresh_samples", fresh_samples, owner=owner)
        super().__init__(batch_size=batch_size or samples_per_client, seed=seed, **kwargs)
        self.fresh_samples = fresh_samples
        self.samples_per_client = samples_per_client
        self.rank = rank
        self._use(
            make_low_rank_problem(
                dim, rank, num_clients, samples_per_client, test_samples_per_client, noise_std, seed
            )
        )

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
