"""Per-client state that stays on the client: its local tensors and, optionally, optimizer state.

Clients that never trained hold no entry; they read the *template* (the module's initial values of
the local part), so a federation of thousands of clients costs memory only for those that trained.
Everything here is tensors, ints and dicts, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

OptimizerState = dict[int, dict[int, dict[str, Any]]]
"""Optimizer index -> parameter index (position in the optimizer's param groups) -> state entries."""


class ClientNotHeld(KeyError):
    """A client's state was read on a process that does not hold it (``client_store="sharded"``)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ClientStore:
    """The local tensors of every client that trained, plus their kept optimizer state."""

    def __init__(self, template: list[Tensor]):
        self.template = [t.detach().clone() for t in template]
        self.local: dict[int, list[Tensor]] = {}
        self.optimizer_states: dict[int, OptimizerState] = {}
        self.finetuned: dict[int, dict[str, Tensor]] = {}
        """Per client, shared tensors it trained in a round that did not aggregate (fine-tuning)."""
        self.world_size: int | None = None
        """Sharded over this many processes (client ``c`` held by rank ``c % world_size``); ``None``: this
        store holds every client."""
        self.rank = 0
        self.borrowed: set[int] = set()
        """Clients held here for the open round only (their owner is another rank)."""

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
        for mapping in (self.local, self.optimizer_states, self.finetuned):
            for client in [c for c in mapping if not self.holds(c)]:
                del mapping[client]

    def unshard(self) -> None:
        """Answer for every client again (after every rank's clients were loaded here)."""
        self.world_size, self.borrowed = None, set()

    def drop(self, client: int) -> None:
        """Forget ``client`` (its owner holds it)."""
        for mapping in (self.local, self.optimizer_states, self.finetuned):
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
        stored = self.local.get(client)
        if stored is None:
            self.local[client] = [t.detach().clone() for t in tensors]
        elif stored:
            torch._foreach_copy_(stored, [t.detach() for t in tensors])

    def record(self, client: int) -> dict[str, Any]:
        """Everything stored for ``client`` (not copies): what another process needs to hold it too."""
        return {
            "local": self.local.get(client),
            "optimizer": self.optimizer_states.get(client),
            "finetuned": self.finetuned.get(client),
        }

    def load_record(self, client: int, record: dict[str, Any], device: torch.device | None = None) -> None:
        """Hold what :meth:`record` returned on another process for ``client`` (moved to ``device``)."""
        single = ClientStore([])
        single.load_state_dict(
            {
                "template": [],
                "local": {} if record["local"] is None else {client: record["local"]},
                "optimizer_states": {} if record["optimizer"] is None else {client: record["optimizer"]},
                "finetuned": {} if record["finetuned"] is None else {client: record["finetuned"]},
            },
            device,
        )
        for mapping, received in (
            (self.local, single.local),
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
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        def move(t: Any) -> Any:
            return t.to(device) if isinstance(t, Tensor) and device is not None else t

        self.template = [move(t) for t in state["template"]]
        self.local = {int(c): [move(t) for t in ts] for c, ts in state["local"].items()}
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

    def to(self, device: torch.device) -> None:
        """Move every stored tensor to ``device`` (called when the strategy moves the module)."""
        self.load_state_dict(self.state_dict(), device)
