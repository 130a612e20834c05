"""Server-side aggregation: what each surviving client hands the server, and the aggregators that reduce it.

A round's clients reach the server as :class:`ClientUpdate` records, one per client that finished the
round with finite values, in the order they finish; a client left out of the round reaches the server step
as a :class:`ClientFault` (``Algorithm.aggregate``'s ``failures``), never as an update.

* :class:`WeightedMean` (the default) streams: running float64 sums ``sum_i w_i x_i`` and ``sum_i w_i``
  (a :class:`WeightedAverage`), one flat all-reduce across processes.
* :class:`Stacked` materializes: it keeps every client's update (copies), gathered from every process and
  ordered by client id, so robust rules (coordinate-wise median, trimmed mean) and FedNova are user code
  in ``Algorithm.aggregate``. It costs clients x upload bytes, bounded by ``max_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.collective import Collective, to_cpu


class WeightedAverage:
    """Running ``sum_i w_i * x_i`` and ``sum_i w_i`` over the clients of a round.

    Sums are kept in float64 on the tensors' device so the mean does not depend on the order in which
    clients arrive beyond float64 rounding; integer tensors (e.g. BatchNorm's ``num_batches_tracked``)
    are averaged and rounded back. ``like``: tensors of the shapes and devices to sum (the round's
    starting values).
    """

    def __init__(self, like: list[Tensor]):
        self.sums = [torch.zeros_like(t, dtype=torch.float64) for t in like]
        self.weight = 0.0

    def add(self, tensors: list[Tensor], weight: float) -> None:
        """Add one client's tensors with aggregation weight ``weight``."""
        if weight <= 0:
            raise ValueError(f"Aggregation weights must be positive, got {weight}.")
        for total, t in zip(self.sums, tensors):
            total.add_(t.detach().to(torch.float64), alpha=weight)
        self.weight += weight

    @property
    def empty(self) -> bool:
        return self.weight == 0.0

    def mean(self, like: list[Tensor]) -> list[Tensor]:
        """The weighted mean, cast to the dtypes of ``like``."""
        if self.empty:
            raise RuntimeError("No client contributed to this round's average.")
        out = []
        for total, ref in zip(self.sums, like):
            value = total / self.weight
            if not ref.is_floating_point() and not ref.is_complex():
                value = value.round()
            out.append(value.to(ref.dtype))
        return out

    def flat(self) -> Tensor:
        """The sums and the weight in one float64 vector: what one ``all_reduce(SUM)`` adds up when a
        round's clients are sharded over processes."""
        parts = [s.reshape(-1) for s in self.sums]
        weight = torch.tensor([self.weight], dtype=torch.float64, device=parts[0].device if parts else None)
        return torch.cat([*parts, weight])

    def load_flat(self, flat: Tensor) -> None:
        """Take the sums and the weight from :meth:`flat`'s layout (e.g. after the reduction)."""
        offset = 0
        for total in self.sums:
            total.copy_(flat[offset : offset + total.numel()].view_as(total))
            offset += total.numel()
        self.weight = float(flat[offset])

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums, "weight": self.weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = [s.to(t.device) for s, t in zip(state["sums"], self.sums)]
        self.weight = float(state["weight"])


@dataclass(frozen=True)
class ClientFault:
    """A client left out of a round: nothing it computed in the round is kept (its stored state is
    what it was before the round) and the round aggregates without it."""

    round: int
    client: int
    step: int
    """Its local steps in the round when the fault was found (an error: the step that raised)."""
    reason: str
    """What went wrong, in words (the error, or the non-finite values found)."""


@dataclass(frozen=True)
class ClientUpdate:
    """What one surviving client hands the server at the end of its round's work.

    ``upload`` maps the shared tensor names to the client's values (views of its tensors, valid during
    :meth:`Aggregator.add`: an aggregator that keeps them copies them). ``weight`` is its aggregation
    weight (its training samples, or 1 under uniform weighting).
    """

    client: int
    round: int
    weight: float
    num_samples: int
    """The client's training samples."""
    steps: int
    """The local steps it ran this round."""
    upload: Mapping[str, Tensor]
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Per-client values reported with the update (empty for the built-in clients)."""


class Aggregator:
    """Reduces a round's :class:`ClientUpdate` objects as they arrive (a Flower-like aggregation step).

    The federation calls :meth:`add` once per surviving client, :meth:`reduce` once across processes at the
    round's close, then hands :meth:`result` and the aggregator itself to ``Algorithm.aggregate(server,
    results, failures)`` (``results.reduced``, ``results.aggregator``). Subclasses implement :meth:`add`,
    :meth:`result`, :meth:`reduce` and the mid-round checkpoint (:meth:`state_dict`).

    Args:
        like: the shared tensors by name (the round's starting global state): names, shapes, dtypes.
    """

    def __init__(self, like: Mapping[str, Tensor]):
        self.names: tuple[str, ...] = tuple(like)

    def add(self, update: ClientUpdate) -> None:
        """Take one surviving client's update."""
        raise NotImplementedError

    def expect(self, clients: int) -> None:
        """The round opens with ``clients`` participants (refuse here what cannot be held)."""

    weight: float
    """The total aggregation weight of the updates (after :meth:`reduce`: of every process's)."""

    @property
    def empty(self) -> bool:
        """Whether no update arrived (the global state then stays as it was)."""
        return self.weight == 0.0

    def reduce(self, collective: Collective) -> None:
        """Combine every process's updates over ``collective`` (the processes' communication), so that every
        process holds the whole round's."""
        raise NotImplementedError

    def result(self) -> dict[str, Tensor]:
        """The aggregate by name (``RoundResults.reduced``: the default server step's new global values)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a mid-round checkpoint keeps of the updates so far."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``, what :meth:`state_dict` returned."""
        raise NotImplementedError


class WeightedMean(WeightedAverage, Aggregator):
    """The sample-weighted (or uniform) mean of the uploads: float64 sums, one flat all-reduce across
    processes, checkpointed as ``{"sums", "weight"}``. The default aggregator of every algorithm.
    """

    def __init__(self, like: Mapping[str, Tensor]):
        Aggregator.__init__(self, like)
        WeightedAverage.__init__(self, list(like.values()))
        self._like = list(like.values())

    def add(self, update: ClientUpdate) -> None:  # type: ignore[override]
        """Add one surviving client's :class:`ClientUpdate`, weighted by ``update.weight``."""
        WeightedAverage.add(self, [update.upload[n] for n in self.names], update.weight)

    def reduce(self, collective: Collective) -> None:
        self.load_flat(collective.all_reduce_sum(self.flat()))

    def result(self) -> dict[str, Tensor]:
        return dict(zip(self.names, self.mean(self._like)))


class Stacked(Aggregator):
    """Keeps every surviving client's update (a copy), for rules that need them all: coordinate-wise
    median, trimmed mean, Krum, FedNova. On several processes :meth:`reduce` gathers every process's
    updates (one all-gather of objects), and :attr:`updates` is ordered by client id, so ``aggregate``
    sees the same inputs on every process whatever the world size.

    Args:
        like: the shared tensors by name.
        max_bytes: the most a round may hold (clients x upload bytes); a larger round is refused when it
            opens (default 1 GiB).
    """

    def __init__(self, like: Mapping[str, Tensor], max_bytes: int = 2**30):
        super().__init__(like)
        self.max_bytes = int(max_bytes)
        self._upload_bytes = sum(t.numel() * t.element_size() for t in like.values())
        self._devices = {n: t.device for n, t in like.items()}
        self._updates: list[ClientUpdate] = []

    def expect(self, clients: int) -> None:
        needed = clients * self._upload_bytes
        if needed > self.max_bytes:
            raise ValueError(
                f"Stacked aggregation would hold {clients} clients x {self._upload_bytes} bytes = {needed} bytes, "
                f"more than max_bytes={self.max_bytes}: raise Stacked(max_bytes=...), sample fewer clients per "
                "round, or use a streaming aggregator (WeightedMean)."
            )

    def add(self, update: ClientUpdate) -> None:
        upload = {n: update.upload[n].detach().clone() for n in self.names}
        self._updates.append(_with_upload(update, upload))

    @property
    def updates(self) -> list[ClientUpdate]:
        """Every surviving client's update (copies), ordered by client id."""
        return sorted(self._updates, key=lambda u: u.client)

    @property
    def weight(self) -> float:
        return float(sum(u.weight for u in self._updates))

    def stacked(self) -> dict[str, Tensor]:
        """Each shared tensor's uploads as one ``(clients, *shape)`` tensor, rows ordered by client id."""
        updates = self.updates
        return {n: torch.stack([u.upload[n] for u in updates]) for n in self.names}

    def weights(self) -> Tensor:
        """The updates' aggregation weights (float64), in the rows' order."""
        return torch.tensor([u.weight for u in self.updates], dtype=torch.float64)

    def reduce(self, collective: Collective) -> None:
        gathered = collective.all_gather_object(to_cpu(self._updates))
        mine = collective.rank
        self._updates = [
            u if rank == mine else _with_upload(u, {n: t.to(self._devices[n]) for n, t in u.upload.items()})
            for rank, updates in enumerate(gathered)
            for u in updates
        ]

    def result(self) -> dict[str, Tensor]:
        """The weighted mean of the kept uploads (float64 sums in client-id order, cast back)."""
        weights = self.weights()
        out = {}
        for name, rows in self.stacked().items():
            mean = (rows.to(torch.float64) * weights.to(rows.device).view(-1, *[1] * (rows.dim() - 1))).sum(0)
            mean = mean / weights.sum()
            out[name] = (mean if rows.is_floating_point() else mean.round()).to(rows.dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": [
                {
                    "client": u.client,
                    "round": u.round,
                    "weight": u.weight,
                    "num_samples": u.num_samples,
                    "steps": u.steps,
                    "upload": dict(u.upload),
                    "metrics": dict(u.metrics),
                }
                for u in self._updates
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._updates = [
            ClientUpdate(
                **{
                    **u,
                    "upload": {n: t.to(self._devices[n]) for n, t in u["upload"].items()},
                }
            )
            for u in state["updates"]
        ]


def _with_upload(update: ClientUpdate, upload: Mapping[str, Tensor]) -> ClientUpdate:
    return replace(update, upload=upload, metrics=dict(update.metrics))
