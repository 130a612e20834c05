"""What a round's clients start from and hand the server, and what the server holds between rounds.

Before a client's first local step of an aggregating round the federation calls
``Algorithm.start_client(ClientStart)`` where the algorithm overrides it, which returns a :class:`StartOutcome`
(new starting values of some of the client's tensors, new values of some of its declared tensors). After a
client's last local step the federation calls ``Algorithm.finish_client(ClientEnd)``, which returns
a :class:`ClientOutcome` (what the aggregator receives, the client's new declared tensors, per-client
metrics). At the round's close ``Algorithm.aggregate(server, results, failures)`` receives the
:class:`ServerState` and the :class:`RoundResults` and returns the new server state and metrics for the
round's history row. No Lightning here (the core).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_fedrep.federation.api.aggregation import Aggregator, ClientUpdate

__all__ = [
    "ClientEnd",
    "ClientMap",
    "ClientOutcome",
    "ClientSamples",
    "ClientStart",
    "RoundResults",
    "ServerState",
    "StartOutcome",
]


@dataclass(frozen=True)
class ClientSamples:
    """A client's training samples, as ``Algorithm.start_client`` reads them (``ClientStart.data``): the samples
    of the round's training loader (the data module's collate, the training step's precision, on the module's
    device), by position into the client's own ``num_samples`` samples (position order is the data module's
    order of the client's samples). Nothing is read until :meth:`batches` is iterated.

    Draw any randomness (an offset, a shuffled order) from :meth:`generator`, never the global RNG: it is a pure
    function of the strategy's seed, the round, the client and a key, so both runners, every process and a
    resumed run read the same samples.
    """

    client: int
    round: int
    num_samples: int
    batch_size: int
    """The round's training batch size (the data module's)."""
    read: Callable[[Sequence[Tensor]], Iterator[Any]] = field(repr=False)
    """``read(positions)``: one collated batch per tensor of positions (the federation binds it)."""
    seeded: Callable[[str], torch.Generator] = field(repr=False)
    """``seeded(key)``: the generator :meth:`generator` returns (the federation binds it)."""

    def generator(self, key: str) -> torch.Generator:
        """A CPU generator seeded from the strategy's seed, the round, the client and ``key`` (another key,
        an independent stream)."""
        return self.seeded(key)

    def batches(
        self, positions: Tensor | None = None, batch_size: int | None = None, drop_last: bool = False
    ) -> Iterator[Any]:
        """The samples at ``positions`` (a 1-D tensor of positions in ``[0, num_samples)``; ``None``: all, in
        order), in consecutive batches of ``batch_size`` (``None``: the round's) as the training step receives
        them; the last batch may be smaller unless ``drop_last``. A shuffled pass is
        ``batches(torch.randperm(n, generator=data.generator("key")))``; a contiguous slice
        ``batches(torch.arange(a, b))``."""
        size = self.batch_size if batch_size is None else int(batch_size)
        if size < 1:
            raise ValueError(f"ClientSamples.batches(batch_size=...) must be >= 1, got {batch_size}.")
        if positions is None:
            positions = torch.arange(self.num_samples)
        positions = torch.as_tensor(positions, dtype=torch.long).flatten()
        if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= self.num_samples):
            raise IndexError(
                f"ClientSamples.batches(positions=...): client {self.client} has {self.num_samples} training "
                f"samples, positions must be in [0, {self.num_samples}), got [{int(positions.min())}, "
                f"{int(positions.max())}]."
            )
        chunks = list(positions.split(size))
        if drop_last and chunks and len(chunks[-1]) < size:
            chunks = chunks[:-1]
        if not chunks:
            return iter(())
        return self.read(chunks)


@dataclass(frozen=True)
class ClientStart:
    """A client about to train in an aggregating round (views, not copies: valid during the call; do not
    modify them in place, return new values in a :class:`StartOutcome`).

    ``start`` maps the module's shared and local tensor names to the values the client would train from:
    the round's global shared tensors and its stored local part (the template if it never trained);
    ``client_state`` holds its declared client tensors as they are before the round (slots such as Ditto's
    ``"personal.<name>"`` included), ``server`` the declared server tensors.

    ``data`` reads the client's training samples (:class:`ClientSamples`: FedALA's learned blend weights, FedAS's
    alignment, FedPAC's statistics on the new body); ``None`` only for a federation driven without a training
    loader (no strategy).
    """

    client: int
    round: int
    num_samples: int
    """The client's training samples."""
    start: Mapping[str, Tensor]
    client_state: Mapping[str, Tensor]
    server: Mapping[str, Tensor]
    shared_names: tuple[str, ...] = ()
    """The names of ``start`` the server shares (the others are the client's local part)."""
    data: ClientSamples | None = None
    """The client's training samples (:class:`ClientSamples`), on the process that trains it."""

    def shared(self) -> dict[str, Tensor]:
        """The round's global values of the shared tensors."""
        return {n: self.start[n] for n in self.shared_names}

    def local(self) -> dict[str, Tensor]:
        """The client's stored values of its local tensors."""
        return {n: t for n, t in self.start.items() if n not in self.shared_names}


@dataclass(frozen=True)
class StartOutcome:
    """What ``start_client`` returns: new starting values of some of the client's tensors (names of
    ``ClientStart.start``; those left out start as given) and new values of some of its declared client tensors
    (names of ``ClientStart.client_state``; those left out keep their values). Each value has the shape of the
    value it replaces. The default changes nothing."""

    start: Mapping[str, Tensor] = field(default_factory=dict)
    """New starting values of some of the client's shared and local tensors, by name."""
    client_state: Mapping[str, Tensor] = field(default_factory=dict)
    """New values of some of the client's declared tensors, by name (stored at once; a client left out of
    the round, or a rolled-back round, gets back what it held before)."""


@dataclass(frozen=True)
class ClientEnd:
    """A client after its last local step of the round (views, not copies: valid during the call).

    ``start``/``end`` map the module's shared and local tensor names to their values at the start of the
    client's round (what it trained from: after ``Algorithm.start_client``) and at the end of its work;
    ``client_state`` holds its declared client tensors as stored before this call (what ``start_client`` and a
    step rule wrote this round included), ``server`` the declared server tensors; ``lr`` is the first optimizer's first
    param group's learning rate (``None`` if unknown); ``slots`` the declared slots the client trained this
    round (``Phase(slot=...)``) at the end of its work, by ``"<slot>.<tensor name>"`` (stored with its
    declared tensors after ``finish_client``; ``{}`` when no phase trained a slot); ``data`` reads the client's
    training samples as ``ClientStart.data`` does (FedPAC's local prototypes of the trained model).
    """

    client: int
    round: int
    num_samples: int
    """The client's training samples."""
    steps: int
    """The local steps it ran this round."""
    lr: float | None
    start: Mapping[str, Tensor]
    end: Mapping[str, Tensor]
    client_state: Mapping[str, Tensor]
    server: Mapping[str, Tensor]
    shared_names: tuple[str, ...] = ()
    """The names of ``start``/``end`` the server shares (what :meth:`shared` returns)."""
    slots: Mapping[str, Tensor] = field(default_factory=dict)
    data: ClientSamples | None = None
    """The client's training samples (:class:`ClientSamples`, the same reader and generators as at its start),
    on the process that trained it; ``None`` only for a federation driven without a training loader."""

    def shared(self) -> dict[str, Tensor]:
        """The end values of the shared tensors (what the default ``finish_client`` uploads)."""
        return {n: self.end[n] for n in self.shared_names}

    def tensors(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The end values of ``names``."""
        return {n: self.end[n] for n in names}


@dataclass(frozen=True)
class ClientOutcome:
    """What ``finish_client`` returns: the upload the aggregator receives (``ClientUpdate.upload``; its
    names must be those of ``Algorithm.aggregator``'s ``like``), new values of the client's declared tensors
    (those left out keep their values) and per-client metrics (their mean over the round's clients joins
    the round's history row under the same key)."""

    upload: Mapping[str, Tensor]
    client_state: Mapping[str, Tensor] = field(default_factory=dict)
    """New values of some of the client's declared tensors, by name."""
    metrics: Mapping[str, float] = field(default_factory=dict)


ClientMap = Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]]
"""``client_map(a client's declared tensors by name) -> new values of some of them`` (``ServerState``)."""


@dataclass(frozen=True)
class ServerState:
    """What the server holds between rounds: the global shared tensors and the declared server tensors,
    by name; ``num_clients`` is the federation's size. ``aggregate`` returns a new one (``replace``).

    ``client_map`` (returned by ``aggregate``, never stored): a server step that changes every client's
    declared tensors at once (L2GD's pull towards the average). It receives one client's declared tensors
    by name and returns new values of some of them (the others are kept); the federation applies it right
    after ``aggregate`` to every client it holds and to the template of those that never trained, on every
    process alike (so it must be a pure function of its input and of the server state), before evaluation
    or a checkpoint can see them.
    """

    shared: Mapping[str, Tensor]
    tensors: Mapping[str, Tensor]
    num_clients: int = 0
    client_map: ClientMap | None = None

    def replace(self, **changes: Any) -> ServerState:
        """A copy with ``changes`` (``shared=``, ``tensors=``: the names given replace those values)."""
        for key in ("shared", "tensors"):
            if key in changes:
                changes[key] = {**getattr(self, key), **changes[key]}
        return replace(self, **changes)


@dataclass(frozen=True)
class RoundResults:
    """The round as the server step sees it: the aggregator's reduction (``reduced``, its ``result()``),
    the aggregator itself (``Stacked`` holds every update), the surviving clients' ids, the total
    aggregation weight and the round's plan. Identical on every process."""

    reduced: Mapping[str, Tensor]
    aggregator: Aggregator
    clients: tuple[int, ...]
    weight: float
    plan: Any
    """The round's ``RoundPlan`` (typed loosely: the plan module imports the algorithms)."""

    @property
    def updates(self) -> list[ClientUpdate]:
        """Every client's update (only with an aggregator that keeps them, e.g. ``Stacked``)."""
        return list(getattr(self.aggregator, "updates", []))
