"""Per-client state that stays on the client: its local tensors and, optionally, optimizer state.

Clients that never trained hold no entry; they read the *template* (the module's initial values of
the local part), so a federation of thousands of clients costs memory only for those that trained.
The local tensors are rows of pooled stacked chunks (:class:`StackedRows`), one chunk tensor per
local tensor for many clients, so a client costs its values' bytes and an index entry, not a tensor
object per tensor. Checkpoints hold the same per-client lists of tensors as before; everything here
is tensors, ints and dicts, so they load with ``weights_only=True``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

OptimizerState = dict[int, dict[int, dict[str, Any]]]
"""Optimizer index -> parameter index (position in the optimizer's param groups) -> state entries."""


_Layout = tuple[tuple[torch.Size, torch.dtype, torch.device], ...]

FIRST_CHUNK_ROWS = 8
"""Rows of the first chunk; each further chunk doubles, up to :data:`MAX_CHUNK_ROWS`."""
MAX_CHUNK_ROWS = 1024
MAX_CHUNK_BYTES = 16 * 2**20
"""A chunk holds fewer rows where its rows are large (a whole model per client), at least one."""


def check_client_id(client: object, num_clients: int | None) -> None:
    """Refuse ``client`` unless it is a client id in ``0 .. num_clients - 1`` or ``-1`` (a client that never
    trained); ``num_clients=None`` (the federation's size is not known) bounds it from below only. Runs where
    a client's tensors are asked for: in a live federation and out of a checkpoint."""
    if (
        isinstance(client, bool)
        or not isinstance(client, int)
        or client < -1
        or (num_clients is not None and client >= num_clients)
    ):
        raise IndexError(
            f"client must be a client id in 0..{'' if num_clients is None else num_clients - 1} (or -1 for a client "
            f"that never trained), got {client!r}."
        )


def _layout(tensors: Sequence[Tensor]) -> _Layout:
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


class StackedRows(MutableMapping[int, list[Tensor]]):
    """Client -> its list of local tensors, stored as rows of pooled stacked chunks.

    Per position in the list, each chunk is one tensor of shape ``(rows, *shape)``; a client holds one
    slot (the same row of every position's chunk). Reading returns views of the client's row (do not
    modify them; they change when the client is written again, like the tensors of the per-client
    store did); writing copies into the row (a new client takes a free slot, growing the pool by a
    chunk when none is left). A list whose shapes, dtypes or devices differ from the pool's is kept
    as its own copies.
    """

    def __init__(self) -> None:
        self._layout: _Layout | None = None
        self._chunks: list[list[Tensor]] = []
        self._starts: list[int] = []
        """The first slot of each chunk."""
        self._capacity = 0
        self._next = 0
        """Slots below this were handed out at least once; the freed ones are in ``_free``."""
        self._free: list[int] = []
        self._slots: dict[int, int] = {}
        self._odd: dict[int, list[Tensor]] = {}

    def __len__(self) -> int:
        return len(self._slots) + len(self._odd)

    def __iter__(self) -> Iterator[int]:
        yield from list(self._slots)
        yield from list(self._odd)

    def __contains__(self, client: object) -> bool:
        return client in self._slots or client in self._odd

    def __getitem__(self, client: int) -> list[Tensor]:
        slot = self._slots.get(client)
        if slot is None:
            return self._odd[client]
        chunk = bisect_right(self._starts, slot) - 1
        row = slot - self._starts[chunk]
        return [stacked[row] for stacked in self._chunks[chunk]]

    def __setitem__(self, client: int, tensors: Sequence[Tensor]) -> None:
        tensors = [t.detach() for t in tensors]
        held = self[client] if client in self else None
        if held is not None and [t.shape for t in held] == [t.shape for t in tensors]:
            if held:
                torch._foreach_copy_(held, tensors)  # into the row (cast as the stored tensors are)
            return
        if held is not None:
            del self[client]
        if self._layout is None and not self._chunks:
            self._layout = _layout(tensors)
        if _layout(tensors) != self._layout:
            self._odd[client] = [t.clone() for t in tensors]
            return
        self._slots[client] = self._allocate()
        if tensors:
            torch._foreach_copy_(self[client], tensors)

    def __delitem__(self, client: int) -> None:
        slot = self._slots.pop(client, None)
        if slot is None:
            del self._odd[client]
        else:
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every client and release the pool."""
        self.__init__()

    def nbytes(self) -> int:
        """Bytes this mapping holds in memory: its pooled chunks (free slots included) and its own copies."""
        pooled = sum(t.nbytes for chunk in self._chunks for t in chunk)
        return pooled + sum(t.nbytes for tensors in self._odd.values() for t in tensors)

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next == self._capacity:
            self._grow()
        self._next += 1
        return self._next - 1

    def _grow(self) -> None:
        assert self._layout is not None
        row_bytes = sum(shape.numel() * dtype.itemsize for shape, dtype, _ in self._layout)
        most = max(1, min(MAX_CHUNK_ROWS, MAX_CHUNK_BYTES // max(row_bytes, 1)))
        rows = min(most, FIRST_CHUNK_ROWS * 2 ** len(self._chunks))
        self._chunks.append(
            [torch.zeros((rows, *shape), dtype=dtype, device=device) for shape, dtype, device in self._layout]
        )
        self._starts.append(self._capacity)
        self._capacity += rows


class ClientNotHeld(KeyError):
    """A client's state was read on a process that does not hold it (``client_store="sharded"``)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ClientStore:
    """The local tensors of every client that trained, plus their kept optimizer state."""

    def __init__(self, template: list[Tensor]):
        self.template = [t.detach().clone() for t in template]
        self.local = StackedRows()
        self.optimizer_states: dict[int, OptimizerState] = {}
        self.finetuned: dict[int, dict[str, Tensor]] = {}
        """Per client, shared tensors it trained in a round that did not aggregate (fine-tuning)."""
        self.world_size: int | None = None
        """Sharded over this many processes (client ``c`` held by rank ``c % world_size``); ``None``: this
        store holds every client."""
        self.rank = 0
        self.borrowed: set[int] = set()
        """Clients held here for the open round only (their owner is another rank)."""
        self.tensor_names: tuple[str, ...] = ()
        """The algorithm's declared client tensors (``Algorithm.client_tensors``), stored like the local part."""
        self.tensor_template: list[Tensor] = []
        self.tensors = StackedRows()
        """Client -> its declared tensors (in ``tensor_names`` order); absent: it reads ``tensor_template``."""

    @property
    def sharded(self) -> bool:
        return self.world_size is not None

    def owner(self, client: int) -> int | None:
        """The rank holding ``client`` (``None``: every rank)."""
        return None if self.world_size is None else client % self.world_size

    def holds(self, client: int) -> bool:
        """Whether this store can answer for ``client`` (always, unless sharded over processes)."""
        return client < 0 or self.owner(client) in (None, self.rank) or client in self.borrowed

    def get(self, client: int) -> list[Tensor]:
        """The client's local tensors (the template for a client that never trained). Do not modify."""
        if not self.holds(client):
            raise ClientNotHeld(
                f"Client {client}'s state is held by rank {self.owner(client)}, not by rank {self.rank} "
                "(client_store='sharded'). Read it on that rank, call strategy.gather_clients() on every rank "
                "first, or use client_store='replicated'."
            )
        return self.local.get(client, self.template)

    def shard(self, world_size: int, rank: int) -> None:
        """Hold only the clients of ``rank`` out of ``world_size`` (``c % world_size == rank``) and the
        borrowed ones; drop the others."""
        self.world_size, self.rank = world_size, rank
        for mapping in (self.local, self.optimizer_states, self.finetuned, self.tensors):
            for client in [c for c in mapping if not self.holds(c)]:
                del mapping[client]

    def unshard(self) -> None:
        """Answer for every client again (after every rank's clients were loaded here)."""
        self.world_size, self.borrowed = None, set()

    def drop(self, client: int) -> None:
        """Forget ``client`` (its owner holds it)."""
        for mapping in (self.local, self.optimizer_states, self.finetuned, self.tensors):
            mapping.pop(client, None)
        self.borrowed.discard(client)

    def personal(self, client: int, local_names: Sequence[str]) -> dict[str, Tensor]:
        """What makes ``client``'s model its own, by name: its local part (the template if it never
        trained) and any shared tensors it fine-tuned. Not copies: do not modify."""
        tensors = dict(zip(local_names, self.get(client)))
        tensors.update(self.finetuned.get(client, {}))
        return tensors

    def put(self, client: int, tensors: list[Tensor]) -> None:
        """Store a copy of the client's local tensors."""
        self.local[client] = tensors

    def declare(self, template: Mapping[str, Tensor]) -> None:
        """Hold the declared client tensors ``template`` (name -> initial value) for every client."""
        self.tensor_names = tuple(template)
        self.tensor_template = [t.detach().clone() for t in template.values()]

    def client_state(self, client: int) -> dict[str, Tensor]:
        """The client's declared tensors by name (the template if it has none yet). Views: do not modify."""
        self.get(client)  # refuses a client this process does not hold
        return dict(zip(self.tensor_names, self.tensors.get(client, self.tensor_template)))

    def put_state(self, client: int, tensors: Mapping[str, Tensor]) -> None:
        """Store a copy of new values of some of the client's declared tensors (the others are kept)."""
        unknown = set(tensors) - set(self.tensor_names)
        if unknown:
            raise KeyError(
                f"{sorted(unknown)} are not declared client tensors; the algorithm declares {list(self.tensor_names)}."
            )
        held = self.client_state(client)
        self.tensors[client] = [
            tensors[n].detach().to(held[n].device, held[n].dtype) if n in tensors else held[n].clone()
            for n in self.tensor_names
        ]

    def record(self, client: int) -> dict[str, Any]:
        """Everything stored for ``client``: what another process needs to hold it too. The local
        tensors are copies (views would carry their whole chunk); the rest is not."""
        local = self.local.get(client)
        declared = self.tensors.get(client)
        return {
            "local": None if local is None else [t.clone() for t in local],
            "optimizer": self.optimizer_states.get(client),
            "finetuned": self.finetuned.get(client),
            "tensors": None if declared is None else [t.clone() for t in declared],
        }

    def load_record(self, client: int, record: dict[str, Any], device: torch.device | None = None) -> None:
        """Hold what :meth:`record` returned on another process for ``client`` (moved to ``device``)."""
        single = ClientStore([])
        single.load_state_dict(
            {
                "template": [],
                "local": {},
                "optimizer_states": {} if record["optimizer"] is None else {client: record["optimizer"]},
                "finetuned": {} if record["finetuned"] is None else {client: record["finetuned"]},
            },
            device,
        )
        if record["local"] is None:
            self.local.pop(client, None)
        else:
            self.local[client] = [t if device is None else t.to(device) for t in record["local"]]
        if record.get("tensors") is None:
            self.tensors.pop(client, None)
        else:
            self.tensors[client] = [t if device is None else t.to(device) for t in record["tensors"]]
        for mapping, received in (
            (self.optimizer_states, single.optimizer_states),
            (self.finetuned, single.finetuned),
        ):
            if client in received:
                mapping[client] = received[client]
            else:
                mapping.pop(client, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "template": self.template,
            "local": dict(self.local),
            "optimizer_states": dict(self.optimizer_states),
            "finetuned": dict(self.finetuned),
            "tensor_names": list(self.tensor_names),
            "tensor_template": self.tensor_template,
            "tensors": dict(self.tensors),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        def move(t: Any) -> Any:
            return t.to(device) if isinstance(t, Tensor) and device is not None else t

        self.template = [move(t) for t in state["template"]]
        self.local = StackedRows()
        for c, ts in state["local"].items():
            self.local[int(c)] = [move(t) for t in ts]
        self.optimizer_states = {
            int(c): {
                int(o): {int(p): {k: move(v) for k, v in s.items()} for p, s in opt.items()}
                for o, opt in st.items()
            }
            for c, st in state["optimizer_states"].items()
        }
        self.finetuned = {
            int(c): {n: move(t) for n, t in ts.items()} for c, ts in state.get("finetuned", {}).items()
        }
        self.tensor_names = tuple(state.get("tensor_names", ()))
        self.tensor_template = [move(t) for t in state.get("tensor_template", [])]
        self.tensors = StackedRows()
        for c, ts in state.get("tensors", {}).items():
            self.tensors[int(c)] = [move(t) for t in ts]

    def nbytes(self) -> int:
        """Bytes of per-client state held here: local parts, declared tensors, fine-tuned tensors and kept
        optimizer state (measured from the tensors held, for memory reports and benchmarks)."""
        held = self.local.nbytes() + self.tensors.nbytes()
        held += sum(t.nbytes for tensors in self.finetuned.values() for t in tensors.values())
        for state in self.optimizer_states.values():
            for per_optimizer in state.values():
                for entries in per_optimizer.values():
                    held += sum(v.nbytes for v in entries.values() if isinstance(v, Tensor))
        return held

    def to(self, device: torch.device) -> None:
        """Move every stored tensor to ``device`` (called when the strategy moves the module)."""
        self.load_state_dict(self.state_dict(), device)
