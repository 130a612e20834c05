"""Moving clients between processes: lending a round's clients to the rank that trains them, gathering
the round's results and the whole store, sharding the store (client ``c`` on rank ``c % world_size``).

:class:`RankTransfer` is the part of :class:`~lightning_fedrep.federation.Federation` that talks to the
other processes (through its :class:`~lightning_fedrep.federation.collective.Collective`); it moves the
client records of the federation's :class:`~lightning_fedrep.federation.state.FederationState`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_fedrep.federation.api.aggregation import Aggregator, WeightedAverage
from lightning_fedrep.federation.collective import Collective, to_cpu
from lightning_fedrep.federation.plan import RoundPlan, shard_round
from lightning_fedrep.federation.store import ClientStore

if TYPE_CHECKING:
    from lightning_fedrep.federation.state import FederationState


class RankTransfer:
    """The processes of a :class:`~lightning_fedrep.federation.Federation`: moves the client records of
    ``state`` between them through ``collective`` (one process: nothing moves).

    Args:
        state: the federation's stored state, whose client store it shards, lends and gathers.
        collective: the processes (set again by the distributed strategy before a fit).
    """

    def __init__(self, state: FederationState, collective: Collective):
        self.state = state
        self.collective = collective

    @property
    def distributed(self) -> bool:
        """Whether the round's clients are sharded over several processes."""
        return self.collective.distributed

    def shard_clients(self) -> None:
        """Hold only this process's clients (client ``c`` on rank ``c % world_size``)."""
        self.state.store.shard(self.collective.world_size, self.collective.rank)

    def gather_clients(self) -> None:
        """Every process holds every client again (one all-gather; call it on every rank)."""
        store = self.state.store
        if not store.sharded:
            return
        held = [(c, to_cpu(store.record(c))) for c in self._owned()]
        for rank, records in enumerate(self.collective.all_gather_object(held)):
            if rank != self.collective.rank:
                for client, record in records:
                    store.load_record(client, record, self.state.device)
        store.unshard()

    def gathered_store_state(self) -> dict[str, Any] | None:
        """The whole client store's state on rank 0 (``None`` elsewhere): each rank sends the clients
        it owns (one gather, for a checkpoint); the borrowed ones travel with each rank's open round."""
        store = self.state.store
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

    def round_records(self, finished: Iterable[int]) -> dict[str, Any]:
        """What only this process holds in the open round (saved with its open round): the clients it
        ``finished`` in the round and did not leave out (the others receive them when it closes) and those
        it borrowed."""
        store = self.state.store
        clients = sorted(set(finished) | store.borrowed)
        return {
            "records": [(c, to_cpu(store.record(c))) for c in clients],
            "borrowed": sorted(store.borrowed),
        }

    def restore_round_records(self, saved: dict[str, Any] | None) -> None:
        """Hold again what :meth:`round_records` listed (a mid-round resume on as many processes)."""
        if not saved:
            return
        store = self.state.store
        for client, record in saved["records"]:
            store.load_record(client, record, self.state.device)
        store.borrowed.update(saved["borrowed"])

    def _owned(self) -> list[int]:
        store = self.state.store
        clients = set(store.local) | set(store.optimizer_states) | set(store.finetuned) | set(store.tensors)
        return sorted(c for c in clients if store.owner(c) in (None, self.collective.rank))

    def gather_round(
        self,
        average: Aggregator | None,
        local_average: WeightedAverage | None,
        finished: Sequence[Mapping[str, Any]],
    ) -> dict[int, dict[str, Any]]:
        """Across processes, when a round closes: add up the round's weighted sums (``average`` and
        ``local_average``, in place; one all-reduce), and give every process what the others' clients did and
        now hold (one all-gather), so each holds every client. ``finished``: what each client this process
        finished did (``ClientResult`` as a dict); returns every rank's, by client."""
        if average is not None:
            average.reduce(self.collective)
        if local_average is not None:
            local_average.load_flat(self.collective.all_reduce_sum(local_average.flat()))
        store, me = self.state.store, self.collective.rank
        mine = [(dict(r), to_cpu(store.record(r["client"]))) for r in finished]
        gathered: dict[int, dict[str, Any]] = {}
        for rank, records in enumerate(self.collective.all_gather_object(mine)):
            for result, record in records:
                client = result["client"]
                if rank != me and store.owner(client) in (None, me):
                    store.load_record(client, record, self.state.device)
                gathered[client] = result
        for client in list(store.borrowed):  # back with their owners now
            store.drop(client)
        return gathered

    def lend_clients(self, plan: RoundPlan) -> None:
        """Sharded store, when a round opens: each rank sends the clients it holds that another rank trains
        (one all-gather); the trainer holds them until the round closes."""
        store, me = self.state.store, self.collective.rank
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
                    store.load_record(client, record, self.state.device)
