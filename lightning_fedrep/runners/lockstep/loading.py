"""What the lockstep runner reads from the loaders it is handed: small protocols, so the runner does not
import the data loaders (``lightning_fedrep.data.loaders``: ``RoundLoader``, ``EvalLoader`` and
``ClientChunk`` implement them). The engine takes the round's training loader as a
:class:`ClientBatches`, the batched evaluation its evaluation loader as a :class:`EvaluationProbe` and
its items as :class:`ClientChunkLike`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch import Tensor


class ClientBatches(Protocol):
    """A round's training loader as the lockstep runner reads it: each client's batches by step, the
    positions they hold, the clients' whole samples (the feature cache) and why batches may not be a pure
    function of their sample indices."""

    batch_size: int
    sampling: str
    """``"shuffle"`` (batches of at most ``batch_size``) or ``"poisson"`` (batches of any size, ``batch_size`` on
    average: the schedule pads each step to its largest batch)."""

    @property
    def num_clients(self) -> int: ...

    def client_size(self, client: int) -> int: ...

    def client_batches(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> Iterator[Any]: ...

    def client_positions(
        self, client: int, round_index: int, first_step: int, num_steps: int
    ) -> list[Tensor]: ...

    def probe_batch(self, client: int, round_index: int = 0, step: int = 0) -> Any: ...

    def client_samples(self, client: int, chunk: int) -> Iterator[Any]: ...

    def clients_samples(self, clients: Sequence[int], chunk: int) -> Iterator[Any]: ...

    def random_batches(self) -> str | None: ...


class EvaluationProbe(Protocol):
    """An evaluation loader as the batched evaluation reads it: one batch to probe the module with."""

    def first_batch(self) -> Any: ...


class ClientChunkLike(Protocol):
    """Several clients' whole evaluation splits in one item: ``inputs`` and ``targets`` are their samples
    one client after another, ``sizes`` how many each has."""

    clients: Tensor
    sizes: Tensor
    inputs: Tensor
    targets: Tensor
