"""Moving clients between processes: lending a round's clients to the rank that trains them, gathering
the round's results and the whole store, sharding the store (client ``c`` on rank ``c % world_size``).

:class:`RankTransfer` is the part of :class:`~lightning_fedrep.federation.Federation` that talks to the
other processes (through its :class:`~lightning_fedrep.federation.collective.Collective`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_fedrep.federation.collective import to_cpu
from lightning_fedrep.federation.plan import RoundPlan, shard_round
from lightning_fedrep.federation.round import ClientResult
from lightning_fedrep.federation.store import ClientStore


class RankTransfer:
    """The processes of a :class:`~lightning_fedrep.federation.Federation` (one of its parts)."""

    def shard_clients(self) -> None:
        """Hold only this process's clients (client ``c`` on rank ``c % world_size``)."""
        self.store.shard(self.collective.world_size, self.collective.rank)

    def gather_clients(self) -> None:
        """Every process holds every client again (one all-gather; call it on every rank)."""
        if not self.store.sharded:
            return
        held = [(c, to_cpu(self.store.record(c))) for c in self._owned()]
        for rank, records in enumerate(self.collective.all_gather_object(held)):
            if rank != self.collective.rank:
                for client, record in records:
                    self.store.load_record(client, record, self._device)
        self.store.unshard()

    def gathered_store_state(self) -> dict[str, Any] | None:
        """The whole client store's state on rank 0 (``None`` elsewhere): each rank sends the clients
        it owns (one gather, for a checkpoint); the borrowed ones travel with each rank's open round."""
        store = self.store
        state = store.state_dict()
        owned = set(self._owned())
        records = [(c, to_cpu(store.record(c))) for c in owned]
        gathered = self.collective.gather_object(records)
        if gathered is None:
            return None
        merged = ClientStore([])
        merged.load_state_dict({**state, "local": {}, "optimizer_states": {}, "finetuned": {}, "tensors": {}})
        for records in gathered:
            for client, record in records:
                merged.load_record(client, record)
        return merged.state_dict()

    def round_records(self) -> dict[str, Any]:
        """What only this process holds in the open round (saved with its open round): the clients it
        finished in the round (the others receive them when it closes) and those it borrowed."""
        finished = {r.client for r in self._finished if not r.fault}
        clients = sorted(finished | self.store.borrowed)
        return {
            "records": [(c, to_cpu(self.store.record(c))) for c in clients],
            "borrowed": sorted(self.store.borrowed),
        }

    def restore_round_records(self, saved: dict[str, Any] | None) -> None:
        """Hold again what :meth:`round_records` listed (a mid-round resume on as many processes)."""
        if not saved:
            return
        for client, record in saved["records"]:
            self.store.load_record(client, record, self._device)
        self.store.borrowed.update(saved["borrowed"])

    def _owned(self) -> list[int]:
        store = self.store
        clients = set(store.local) | set(store.optimizer_states) | set(store.finetuned) | set(store.tensors)
        return sorted(c for c in clients if store.owner(c) in (None, self.collective.rank))

    def _gather_round(self) -> None:
        """Across processes: add up the round's weighted sums (one all-reduce), and give every process
        what the others' clients did and now hold (one all-gather), so each holds every client."""
        if self._average is not None:
            self._average.reduce(self.collective)
        if self._local_average is not None:
            self._local_average.load_flat(self.collective.all_reduce_sum(self._local_average.flat()))
        store, me = self.store, self.collective.rank
        mine = [(asdict(r), to_cpu(store.record(r.client))) for r in self._finished]
        finished: dict[int, ClientResult] = {}
        for rank, records in enumerate(self.collective.all_gather_object(mine)):
            for result, record in records:
                client = result["client"]
                if rank != me and store.owner(client) in (None, me):
                    store.load_record(client, record, self._device)
                finished[client] = ClientResult(**result)
        for client in list(store.borrowed):  # back with their owners now
            store.drop(client)
        self._finished = [finished[c] for c in self.plan(self.round_index).clients if c in finished]

    def _lend_clients(self, plan: RoundPlan) -> None:
        """Sharded store: before a round, each rank sends the clients it holds that another rank trains
        (one all-gather); the trainer holds them until the round closes."""
        store, me = self.store, self.collective.rank
        trainer = {
            c: r
            for r, share in enumerate(shard_round(plan, self.collective.world_size))
            for c in share.clients
        }
        store.borrowed.update(c for c, r in trainer.items() if r == me and store.owner(c) != me)
        lent = [
            (c, to_cpu(store.record(c)))
            for c, r in trainer.items()
            if r != me and store.owner(c) == me and (c in store.local or c in store.tensors)
        ]
        for records in self.collective.all_gather_object(lent):
            for client, record in records:
                if trainer[client] == me:
                    store.load_record(client, record, self._device)
