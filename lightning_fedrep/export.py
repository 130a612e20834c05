"""Personalized models out of a checkpoint, without a Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.checkpoint_payload import CHECKPOINT_KEY
from lightning_fedrep.checkpoints import check_version, read_checkpoint
from lightning_fedrep.federation.store import ClientStore


def personalized_state_dict(checkpoint: str | Path | dict[str, Any], client: int) -> dict[str, Tensor]:
    """Client ``client``'s personalized ``state_dict`` for the user's module, read from a checkpoint
    written during a federated fit (a path, or the already loaded dict).

    The same as ``strategy.client_state_dict(client)`` on the live strategy: the checkpoint's
    ``state_dict`` (the global shared part) with the client's own tensors — its local part (the initial
    one for a client that never trained) and whatever it fine-tuned (``HeadFineTuning``). The result
    loads with ``MyModule(...).load_state_dict(...)``.
    """
    source = "(given as a dict)"
    if not isinstance(checkpoint, dict):
        source = checkpoint
        checkpoint = read_checkpoint(
            source, lambda: torch.load(source, map_location="cpu", weights_only=True)
        )
    if CHECKPOINT_KEY not in checkpoint:
        raise ValueError(
            f"This checkpoint has no '{CHECKPOINT_KEY}' entry; it was not written by a federated fit "
            "(FederatedStrategy), so it holds no per-client state."
        )
    state = checkpoint[CHECKPOINT_KEY]
    check_version(state, source)
    clients = (state.get("federation") or {}).get("num_clients")
    if (
        isinstance(client, bool)
        or not isinstance(client, int)
        or client < -1
        or (clients is not None and client >= clients)
    ):
        raise IndexError(
            f"client must be a client id in 0..{'' if clients is None else clients - 1} (or -1 for a client that never "
            f"trained), got {client!r}."
        )
    store = ClientStore([])
    store.load_state_dict(state["clients"])
    return {**checkpoint["state_dict"], **store.personal(client, state["local_names"])}
