"""Personalized models out of a checkpoint, without a Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.strategy import CHECKPOINT_KEY


def personalized_state_dict(checkpoint: str | Path | dict[str, Any], client: int) -> dict[str, Tensor]:
    """Client ``client``'s personalized ``state_dict`` for the user's module, read from a checkpoint
    written during a federated fit (a path, or the already loaded dict).

    The result loads with ``MyModule(...).load_state_dict(...)``: the global shared part from the
    checkpoint's ``state_dict`` and the client's own local part (its head, for FedRep). A client that
    never trained gets the initial local part, as it would during training.
    """
    if not isinstance(checkpoint, dict):
        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if CHECKPOINT_KEY not in checkpoint:
        raise ValueError(
            f"This checkpoint has no '{CHECKPOINT_KEY}' entry; it was not written by a federated fit "
            "(FedRepStrategy), so it holds no per-client state."
        )
    state = checkpoint[CHECKPOINT_KEY]
    clients = state["clients"]
    local = clients["local"].get(client, clients["template"])
    out = dict(checkpoint["state_dict"])
    for name, value in zip(state["local_names"], local):
        out[name] = value
    return out
