"""The single iterables Lightning sees: one round of training batches, or one pass of evaluation.

Lightning would iterate a dict of N loaders in lock-step, so the data module hands Lightning one
object per stage instead. ``RoundLoader`` yields the plain user batches of a round in the order of
the strategy's plan (one batch per optimizer step); it is sized, so Lightning does not prefetch and
knows the round's last batch, and stateful, so a checkpoint taken mid-round resumes at the right
batch. ``EvalLoader`` yields every client's evaluation batches, client after client, and says which
client each batch belongs to.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_fedrep.federation.plan import RoundPlan, round_generator, steps_per_epoch
from lightning_fedrep.federation.sharding import IDLE_STEP, evaluation_shards

Sampling = Literal["shuffle", "poisson"]
"""How a :class:`RoundLoader` draws a client's training batches (see the class)."""

POISSON_KEY = -1
"""The key of a Poisson step's generator, ``(seed, round, client, POISSON_KEY, step)``: no shuffled pass's
generator, ``(seed, round, client, pass)`` with ``pass >= 0``, has it."""


def check_sampling(sampling: Any) -> Sampling:
    """``sampling`` if it names a batch sampling, else a ``ValueError`` naming the choices."""
    if sampling not in get_args(Sampling):
        raise ValueError(
            f"sampling must be one of {', '.join(map(repr, get_args(Sampling)))}, got {sampling!r}: 'shuffle' "
            "draws fixed-size batches from reshuffled passes, 'poisson' includes each sample in each step "
            "independently (what sample-level DP-SGD's accounting assumes)."
        )
    return sampling


@dataclass(frozen=True)
class ClientData:
    """One client's samples: indices into a shared base data set (no copy of the data)."""

    dataset: Dataset
    """The shared base data set."""
    indices: torch.Tensor

    def __len__(self) -> int:
        return int(self.indices.numel())


class _BatchFetcher:
    """Turns lists of sample indices into collated batches for one base data set.

    Tensor data sets are indexed as whole tensors (no per-sample Python); other data sets go
    through a ``DataLoader`` over the given index batches, so ``num_workers`` and
    ``pin_memory`` work as usual.
    """

    def __init__(self, num_workers: int = 0, pin_memory: bool = False, collate_fn: Callable | None = None):
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn or default_collate

    def batches(self, dataset: Dataset, index_batches: Sequence[torch.Tensor]) -> Iterator[Any]:
        """The collated batches of ``index_batches``, in order. An empty index batch (a Poisson batch that
        drew no sample) gives a batch of 0 rows with the structure of the others."""
        if isinstance(dataset, TensorDataset) and self.collate_fn is default_collate:
            for idx in index_batches:
                yield [t[idx] for t in dataset.tensors]
            return
        if all(len(idx) for idx in index_batches):
            yield from self._loaded(dataset, index_batches)
            return
        full = [idx for idx in index_batches if len(idx)]
        loaded = self._loaded(dataset, full) if full else iter(())
        for idx in index_batches:
            yield next(loaded) if len(idx) else self._empty_batch(dataset)

    def _loaded(self, dataset: Dataset, index_batches: Sequence[torch.Tensor]) -> Iterator[Any]:
        return iter(
            DataLoader(
                dataset,
                batch_sampler=[idx.tolist() for idx in index_batches],
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                collate_fn=self.collate_fn,
            )
        )

    def _empty_batch(self, dataset: Dataset) -> Any:
        """A batch of 0 rows: one sample collated, every tensor in it cut to its first 0 rows (other
        leaves, e.g. a list of file names, as collated)."""
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("An empty training batch needs a data set with at least one sample to shape it.")
        one = self.collate_fn([dataset[0]])
        return tree_map(lambda leaf: leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() else leaf, one)


class RoundLoader:
    """The training iterable of one round: the planned clients' batches, one per optimizer step.

    The strategy binds a plan provider (``bind``) when Lightning hands it this object; the loader
    then yields, for each planned step, a batch of the step's client. How a client's batches are drawn
    (``sampling``):

    * ``"shuffle"`` (default): consecutive passes over its data, each pass reshuffled by a generator
      seeded with ``(seed, round, client, pass)``; every batch has ``batch_size`` samples (a pass's last
      one may have fewer).
    * ``"poisson"``: each step's batch is a Poisson sample of the client's data: every sample joins the
      step independently with probability ``q = min(1, batch_size / n)`` (``sample_rate``), drawn by
      a generator seeded with ``(seed, round, client, POISSON_KEY, step)``. Batches vary in size (``q * n``
      on average, possibly 0, possibly above ``batch_size``). This is the sampling that sample-level DP-SGD's
      accounting (the RDP of the Poisson-subsampled Gaussian) assumes; a privacy mechanism that needs it
      sets it at bind time (``use_sampling``).

    Either way the number of steps per epoch is ``ceil(n / batch_size)``, and batches are a pure function
    of ``(seed, round, client, step)``: reproducible, independent of other clients, and the same from any
    first step (a mid-round resume). The sampling is a setting, not state: it is not checkpointed; a
    resumed fit's strategy sets it again when it binds the loader.

    Args:
        clients: every client's training samples, by client id.
        batch_size: the training batch size (under ``"poisson"``: the expected batch size).
        seed: the seed of the data order.
        fetcher: how batches are loaded and collated (workers, pinned memory; the data module's).
        sampling: ``"shuffle"`` or ``"poisson"`` (see above).
    """

    def __init__(
        self,
        clients: Sequence[ClientData],
        batch_size: int,
        seed: int = 0,
        fetcher: _BatchFetcher | None = None,
        sampling: Sampling = "shuffle",
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.clients = list(clients)
        self.batch_size = batch_size
        self.seed = seed
        self.fetcher = fetcher or _BatchFetcher()
        self.sampling: Sampling = check_sampling(sampling)
        self._plan_provider: Callable[[], RoundPlan] | None = None
        self._checksum: int | None = None
        self._resume_position = 0
        self._position = 0
        self._round: int | None = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client_sizes(self) -> list[int]:
        """Training samples per client (the aggregation weights and the epoch budgets)."""
        return [len(c) for c in self.clients]

    def partition_checksum(self) -> int:
        """A checksum of which samples each client holds (another partition gives another number)."""
        if self._checksum is None:
            value = 0
            for client in self.clients:
                value = zlib.crc32(client.indices.cpu().numpy().tobytes(), zlib.crc32(b"|", value))
            self._checksum = value
        return self._checksum

    def bind(self, plan_provider: Callable[[], RoundPlan]) -> None:
        """Called by the strategy: where to get the current round's plan."""
        self._plan_provider = plan_provider

    def _plan(self) -> RoundPlan:
        if self._plan_provider is None:
            raise RuntimeError(
                "This RoundLoader is not bound to a federated strategy. Train with "
                "Trainer(strategy=FederatedStrategy(...)) (or 'fedrep', 'fedper', ...), not a plain strategy."
            )
        return self._plan_provider()

    def __len__(self) -> int:
        return self._plan().length

    def use_sampling(self, sampling: Sampling) -> None:
        """Draw batches by ``sampling`` (``"shuffle"`` or ``"poisson"``, see the class); called by the strategy
        when it binds the loader (a privacy mechanism whose accounting needs Poisson batches), before any
        batch is drawn. Refuses a loader that draws its own batches (it overrides ``client_batches``): it
        would not draw the batches asked for."""
        sampling = check_sampling(sampling)
        if sampling != "shuffle" and self.draws_own_batches():
            raise ValueError(
                f"{type(self).__name__} draws its own batches (it overrides RoundLoader.client_batches), so it "
                f"cannot draw {sampling!r} batches. Use a RoundLoader that draws its batches with "
                "client_index_batches (which follows the sampling), or draw Poisson batches in client_batches "
                "and leave sampling as is."
            )
        self.sampling = sampling

    def draws_own_batches(self) -> bool:
        """Whether a subclass overrides ``client_batches`` (its batches need not follow :attr:`sampling`)."""
        return type(self).client_batches is not RoundLoader.client_batches

    def sample_rate(self, client: int) -> float:
        """The probability ``q = min(1, batch_size / n)`` with which each of ``client``'s ``n`` samples joins a
        step under Poisson sampling (1.0 for a client without samples)."""
        size = len(self.clients[client])
        return min(1.0, self.batch_size / size) if size else 1.0

    def client_positions(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> list[torch.Tensor]:
        """Positions (into the client's own samples) of its steps ``first_step ..`` in a round. Shuffled: each
        pass over its data reshuffled by a generator seeded with ``(seed, round, client, pass)``. Poisson: each
        step's positions (ascending) a Poisson sample (:meth:`poisson_positions`)."""
        if self.sampling == "poisson":
            return self.poisson_positions(client, round_index, first_step, num_steps)
        return self.shuffled_positions(client, round_index, first_step, num_steps)

    def poisson_positions(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> list[torch.Tensor]:
        """Each step's Poisson sample of ``client``'s positions: every position included independently with
        probability ``sample_rate``, by a generator seeded with ``(seed, round, client, POISSON_KEY, step)``
        (a pure function of the step: the same from any ``first_step``)."""
        size = len(self.clients[client])
        rate = self.sample_rate(client)
        batches = []
        for step in range(first_step, first_step + num_steps):
            if rate >= 1.0:
                batches.append(torch.arange(size))
                continue
            generator = round_generator(self.seed, round_index, client, POISSON_KEY, step)
            drawn = torch.rand(size, generator=generator, dtype=torch.float64)
            batches.append(torch.nonzero(drawn < rate).flatten())
        return batches

    def shuffled_positions(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> list[torch.Tensor]:
        """The shuffled sampling's positions of ``client``'s steps ``first_step ..`` (whatever :attr:`sampling`
        is): each pass over its data reshuffled by a generator seeded with ``(seed, round, client, pass)``."""
        size = len(self.clients[client])
        per_epoch = steps_per_epoch(size, self.batch_size)
        batches, perm, perm_pass = [], None, -1
        for step in range(first_step, first_step + num_steps):
            epoch_pass, j = divmod(step, per_epoch)
            if epoch_pass != perm_pass:
                perm = torch.randperm(
                    size, generator=round_generator(self.seed, round_index, client, epoch_pass)
                )
                perm_pass = epoch_pass
            batches.append(perm[j * self.batch_size : (j + 1) * self.batch_size])
        return batches

    def client_index_batches(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> list[torch.Tensor]:
        """Sample indices (into the base data set) of a client's steps ``first_step ..`` in a round."""
        indices = self.clients[client].indices
        return [indices[p] for p in self.client_positions(client, round_index, first_step, num_steps)]

    def client_samples(self, client: int, chunk: int) -> Iterator[Any]:
        """All of a client's training samples in position order, in batches of ``chunk`` (for features)."""
        data = self.clients[client]
        return self.fetcher.batches(data.dataset, list(data.indices.split(chunk)))

    def clients_samples(self, clients: Sequence[int], chunk: int) -> Iterator[Any]:
        """The training samples of several clients, one client after another in position order, in
        batches of ``chunk`` that may span clients (one base data set), else client by client."""
        datasets = {id(self.clients[c].dataset) for c in clients}
        if len(datasets) > 1:
            for client in clients:
                yield from self.client_samples(client, chunk)
            return
        indices = torch.cat([self.clients[c].indices for c in clients])
        yield from self.fetcher.batches(self.clients[clients[0]].dataset, list(indices.split(chunk)))

    def client_size(self, client: int) -> int:
        """How many training samples a client has."""
        return len(self.clients[client])

    def batches_at(self, client: int, round_index: int, positions: Sequence[torch.Tensor]) -> Iterator[Any]:
        """``client``'s training samples of round ``round_index`` at each tensor of ``positions`` (into its own
        samples), one collated batch each: what ``ClientStart.data`` reads (a loader whose clients draw other
        samples each round overrides it with :meth:`client_batches`)."""
        indices = self.clients[client].indices
        return self.fetcher.batches(self.clients[client].dataset, [indices[p] for p in positions])

    def __iter__(self) -> Iterator[Any]:
        plan = self._plan()
        start, self._resume_position = self._resume_position, 0
        if self._round is not None and self._round != plan.round:
            start = 0
        self._round = plan.round
        self._position = start
        batches = (
            plan.batches(self, start) if not isinstance(plan, RoundPlan) else self.plan_batches(plan, start)
        )
        for batch in batches:  # a round plan, or the vectorized runner's lockstep schedule
            self._position += 1
            yield batch

    def plan_batches(self, plan: RoundPlan, start: int) -> Iterator[Any]:
        """A round's batches from its ``start``-th step: client after client."""
        if start >= plan.length:
            return
        first = plan.locate(start)
        for work in plan.work[first.work_index :]:
            offset = first.client_step if work is plan.work[first.work_index] else 0
            yield from self.client_batches(work.client, plan.round, offset, work.steps - offset)

    def client_batches(self, client: int, round_index: int, first_step: int, num_steps: int) -> Iterator[Any]:
        """The batches of a client's steps ``first_step ..`` in a round (subclasses may draw other data)."""
        index_batches = self.client_index_batches(client, round_index, first_step, num_steps)
        return self.fetcher.batches(self.clients[client].dataset, index_batches)

    def probe_batch(self, client: int, round_index: int = 0, step: int = 0) -> Any | None:
        """One training batch of ``client`` for the checks and sizing done before training (labels, the
        vectorized runner's probes and memory bound), never trained on: its step's batch under shuffled
        sampling; under Poisson sampling the shuffled one instead (``min(batch_size, n)`` samples, never an
        empty draw)."""
        if self.sampling == "shuffle":
            return next(iter(self.client_batches(client, round_index, step, 1)), None)
        indices = self.clients[client].indices[self.shuffled_positions(client, round_index, step, 1)[0]]
        return next(iter(self.fetcher.batches(self.clients[client].dataset, [indices])))

    def random_batches(self) -> str | None:
        """``None`` if every training batch is a pure function of its sample indices, else why not (the
        rule for computing a frozen body's features once: the vectorized runner's head phases)."""
        if self.draws_own_batches():
            return f"{type(self).__name__} draws its own batches"
        return datasets_are_deterministic(data.dataset for data in self.clients)

    def state_dict(self) -> dict[str, int]:
        """Position in the round, saved by Lightning with the fit loop for mid-round resume."""
        return {"round": -1 if self._round is None else self._round, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._round = None if state["round"] < 0 else state["round"]
        self._resume_position = state["position"]


@dataclass
class ClientChunk:
    """Several clients' whole evaluation splits in one item (batched evaluation): ``inputs`` and
    ``targets`` are their samples one client after another, ``sizes`` how many each has."""

    clients: torch.Tensor
    sizes: torch.Tensor
    inputs: torch.Tensor
    targets: torch.Tensor


class EvalLoader:
    """Every listed client's evaluation batches, client after client, in a fixed order; or, once
    ``chunk`` was called, ``ClientChunk`` items of many clients each (batched evaluation).

    On several processes (``shard``) each rank yields only its share of the clients, then idle items
    (``lightning_fedrep.federation.sharding.IDLE_STEP``) up to the longest rank's length, so every rank ends
    the pass at the same batch.

    Args:
        clients: every client's evaluation samples, by client id.
        batch_size: the evaluation batch size.
        stage: ``"val"``, ``"test"`` or ``"predict"``.
        fetcher: how batches are loaded and collated (workers, pinned memory; the data module's).
    """

    def __init__(
        self,
        clients: Sequence[ClientData],
        batch_size: int,
        stage: str,
        fetcher: _BatchFetcher | None = None,
    ):
        self.clients = list(clients)
        self.batch_size = batch_size
        self.stage = stage
        self.fetcher = fetcher or _BatchFetcher()
        self._max_samples: int | None = None
        self._shards = [list(range(len(self.clients)))]
        self._rank = 0
        self._owner: list[int] = []
        self._chunks: list[list[int]] | None = None
        self._length = 0
        self._layout()

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def evaluated_clients(self) -> list[int]:
        """The clients this process evaluates (all of them on one process)."""
        return self._shards[self._rank]

    def client_of(self, batch_idx: int) -> int:
        """The client whose data the ``batch_idx``-th batch is (per-batch mode)."""
        return self._owner[batch_idx]

    def first_batch(self) -> Any:
        """The first evaluation batch (a probe), or ``None`` without evaluation data."""
        return next(self._batches(range(len(self.clients))), None)

    def keep_first(self, count: int) -> None:
        """Evaluate only the first ``count`` clients (ids ``0 .. count-1``, unchanged); call before
        :meth:`shard` and :meth:`chunk`."""
        self.clients = self.clients[:count]
        self._shards = [list(range(len(self.clients)))]
        self._layout()

    def chunk(self, max_samples: int | None) -> None:
        """Yield ``ClientChunk`` items of consecutive clients holding at most ``max_samples``
        samples (a larger client alone); ``None`` goes back to one batch per step."""
        self._max_samples = max_samples
        self._layout()

    def shard(self, rank: int, world_size: int, by_owner: bool = False) -> None:
        """Evaluate only ``rank``'s share of the clients out of ``world_size``: balanced by samples, or
        ``by_owner``, the clients a sharded client store holds there (``c % world_size == rank``)."""
        self._rank = rank
        if by_owner:
            self._shards = [
                [c for c in range(r, len(self.clients), world_size) if len(self.clients[c])]
                for r in range(world_size)
            ]
        else:
            self._shards = evaluation_shards([len(c) for c in self.clients], world_size)
        self._layout()

    @property
    def chunked(self) -> bool:
        return self._chunks is not None

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        yielded = 0
        for item in self._items():
            yielded += 1
            yield item
        for _ in range(yielded, self._length):
            yield IDLE_STEP

    def _layout(self) -> None:
        def owners(clients: list[int]) -> list[int]:
            return [c for c in clients for _ in range(steps_per_epoch(len(self.clients[c]), self.batch_size))]

        mine = self._shards[self._rank]
        self._owner = owners(mine)
        if self._max_samples is None:
            self._chunks = None
            self._length = max(len(owners(s)) for s in self._shards)
            return
        self._chunks = self._chunked(mine)
        self._length = max(len(self._chunked(s)) for s in self._shards)

    def _chunked(self, clients: list[int]) -> list[list[int]]:
        chunks: list[list[int]] = [[]]
        held = 0
        for cid in clients:
            data = self.clients[cid]
            if not len(data):
                continue
            if chunks[-1] and held + len(data) > self._max_samples:
                chunks.append([])
                held = 0
            chunks[-1].append(cid)
            held += len(data)
        return [c for c in chunks if c]

    def _items(self) -> Iterator[Any]:
        if self._chunks is None:
            yield from self._batches(self._shards[self._rank])
            return
        for clients in self._chunks:
            datas = [self.clients[c] for c in clients]
            sizes = torch.tensor([len(d) for d in datas])
            if len({id(d.dataset) for d in datas}) == 1:
                index = torch.cat([d.indices for d in datas])
                parts = self.fetcher.batches(datas[0].dataset, list(index.split(MAX_FETCH)))
            else:
                parts = (
                    b
                    for d in datas
                    for b in self.fetcher.batches(d.dataset, list(d.indices.split(MAX_FETCH)))
                )
            xs, ys = zip(*((x, y) for x, y in parts))
            yield ClientChunk(torch.tensor(clients), sizes, torch.cat(xs), torch.cat(ys))

    def _batches(self, clients: Sequence[int]) -> Iterator[Any]:
        for cid in clients:
            data = self.clients[cid]
            if len(data):
                yield from self.fetcher.batches(data.dataset, list(data.indices.split(self.batch_size)))


MAX_FETCH = 4096
"""Samples fetched at once when a chunk of clients is collected."""


def datasets_are_deterministic(datasets: Iterable[Any]) -> str | None:
    """``None`` if no data set draws random transforms (a ``transform`` whose repr names a ``Random``
    one), else why not: the rule for computing a frozen body's features once (the engine's head phases,
    ``FineTunedEvaluation``)."""
    for dataset in datasets:
        if isinstance(dataset, TensorDataset):
            continue
        parts = getattr(dataset, "datasets", None)  # a ConcatDataset (a pooled train ++ test set)
        if isinstance(parts, Sequence) and (why := datasets_are_deterministic(parts)) is not None:
            return why
        transform = getattr(dataset, "transform", None)
        if transform is not None and "Random" in repr(transform):
            return f"the training data is augmented at random ({type(dataset).__name__}.transform)"
    return None
