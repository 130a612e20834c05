"""The stacked client store (issue 28): per-client local tensors as rows of pooled chunks behave like
the per-client dict of copies they replaced, and cost the values' bytes."""

from __future__ import annotations

import io
import random

import torch

from lightning_fedrep.federation.store import ClientStore


def _template() -> list[torch.Tensor]:
    return [torch.zeros(3, 4), torch.zeros(3)]


def _assert_matches(store: ClientStore, reference: dict[int, list[torch.Tensor]], clients: range) -> None:
    for client in clients:
        expected = reference.get(client, store.template)
        got = store.get(client)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b), client
    assert sorted(store.local) == sorted(reference)


def test_stacked_store_matches_a_dict_of_copies_through_puts_drops_and_odd_shapes():
    """Catches two clients sharing a row (``_allocate`` reading ``self._free[-1]`` instead of popping it,
    or ``bisect_left`` for ``bisect_right`` in ``__getitem__``): the store must answer exactly as a plain
    dict of per-client clones does, through new clients over several chunks, overwrites, drops with slot
    reuse, lists of another shape or dtype, and a write through a caller's own tensor afterwards."""
    rng = random.Random(0)
    store = ClientStore(_template())
    reference: dict[int, list[torch.Tensor]] = {}
    for step in range(3000):
        client = rng.randrange(400)
        action = rng.random()
        if action < 0.15:
            store.drop(client)
            reference.pop(client, None)
            continue
        if action < 0.2:  # another dtype: kept as its own copies
            tensors = [
                torch.full((3, 4), step, dtype=torch.float64),
                torch.full((3,), -step, dtype=torch.float64),
            ]
            store.drop(client)
            reference.pop(client, None)
        else:
            tensors = [torch.randn(3, 4), torch.randn(3)]
        store.put(client, tensors)
        held = reference.get(client)
        if held is not None and [t.shape for t in held] == [t.shape for t in tensors]:
            reference[client] = [t.to(h.dtype, copy=True) for t, h in zip(tensors, held)]
        else:
            reference[client] = [t.clone() for t in tensors]
        tensors[0].add_(1000)  # the caller's tensor is not the store's
    _assert_matches(store, reference, range(400))
    restored = ClientStore([])
    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    restored.template = store.template
    _assert_matches(restored, reference, range(400))


def test_stacked_store_checkpoint_and_records_are_per_client_lists_detached_from_the_pool():
    """Catches ``record`` returning views of the pooled rows (``"local": local`` without ``clone``): a
    record sent to another process or kept for a round's rollback would carry the whole chunk and
    change when the client is written again. The checkpoint's ``local`` stays a dict of per-client
    lists of tensors, as before."""
    store = ClientStore(_template())
    for client in range(20):
        store.put(client, [torch.full((3, 4), float(client)), torch.full((3,), float(client))])
    record = store.record(7)
    store.put(7, [torch.full((3, 4), -1.0), torch.full((3,), -1.0)])
    assert torch.equal(record["local"][0], torch.full((3, 4), 7.0))
    assert record["local"][0].untyped_storage().nbytes() == 3 * 4 * 4
    local = store.state_dict()["local"]
    assert isinstance(local, dict) and sorted(local) == list(range(20))
    assert all(isinstance(ts, list) and [t.shape for t in ts] == [(3, 4), (3,)] for ts in local.values())
    assert torch.equal(local[3][1], torch.full((3,), 3.0))
    assert torch.equal(local[7][1], torch.full((3,), -1.0))


def test_stacked_store_holds_the_values_bytes_in_few_storages():
    """Catches a store that keeps a tensor per client again (``__setitem__`` storing
    ``[t.clone() for t in tensors]`` for every client): 5,000 heads must sit in a handful of shared
    storages whose bytes are within 1.15x of the heads' values (counted from the sizes)."""
    store = ClientStore([torch.zeros(10, 64), torch.zeros(10)])
    for client in range(5000):
        store.put(client, [torch.full((10, 64), float(client)), torch.full((10,), float(client))])
    storages = {}
    for client in range(5000):
        for t in store.get(client):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    values = 5000 * (640 + 10) * 4
    assert len(storages) < 40
    assert sum(storages.values()) <= 1.15 * values
    assert float(store.get(4321)[0][9, 63]) == 4321.0
