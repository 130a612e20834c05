"""Personalized models out of a checkpoint, without a Trainer."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import ALGORITHMS, get_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec, evaluation_spec, scored_tensors
from lightning_fedrep.federation.checkpoint.entry import CHECKPOINT_KEY
from lightning_fedrep.federation.checkpoint.reading import check_version, read_checkpoint
from lightning_fedrep.federation.store import ClientStore, check_client_id


def personalized_state_dict(
    checkpoint: str | Path | dict[str, Any], client: int, algorithm: str | Algorithm | None = None
) -> dict[str, Tensor]:
    """Client ``client``'s personalized ``state_dict`` for the user's module, read from a checkpoint
    written during a federated fit (a path, or the already loaded dict).

    The same as ``strategy.client_state_dict(client)`` on the live strategy: the checkpoint's
    ``state_dict`` (the global shared part) with the client's own tensors as the algorithm's evaluation
    scores them (``Algorithm.evaluation()``: its local part, the initial one for a client that never trained,
    and whatever it fine-tuned (``HeadFineTuning``); or a slot, a mixture, the global model). ``algorithm``
    (an ``Algorithm`` or a registered name) is the one the checkpoint was written with; ``None`` looks up its
    recorded name among the registered algorithms. The result loads with ``MyModule(...).load_state_dict(...)``.
    For an algorithm with its own ``EvaluationSpec.forward`` (FedCP) it is not the whole prediction (a warning
    says so): ``strategy.client_model(client)`` is.
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
    check_client_id(client, clients)
    store = ClientStore([])
    store.load_state_dict(state["clients"])
    personal = store.personal(client, state["local_names"])
    spec = None if client == -1 else _spec(state, store, algorithm, source)  # -1: a new client's model
    if spec is not None and spec.forward is not None:
        warnings.warn(
            f"personalized_state_dict(..., {client}) holds the module's tensors only, but the checkpoint's algorithm "
            "predicts with its own EvaluationSpec.forward over declared tensors too (not in a state_dict): "
            "load the checkpoint into a strategy and use strategy.client_model(client) to predict as evaluation "
            "scores.",
            UserWarning,
            stacklevel=2,
        )
    if spec is not None:
        global_tensors = dict(zip(state["shared_names"], state["global"]))
        personal = scored_tensors(spec, client, global_tensors, personal, lambda: store.client_state(client))
    return {**checkpoint["state_dict"], **personal}


def _spec(
    state: dict[str, Any], store: ClientStore, algorithm: str | Algorithm | None, source: Any
) -> EvaluationSpec | None:
    """What the checkpoint's algorithm scores: ``algorithm``'s, else the registered one of its recorded name;
    ``None`` (its local part) for an unregistered algorithm without declared client tensors (then no slot
    can be scored, and a global score equals it)."""
    if algorithm is not None:
        return evaluation_spec(get_algorithm(algorithm))
    name = state.get("algorithm")
    if name not in ALGORITHMS and not store.tensor_names:
        return None
    spec = evaluation_spec(ALGORITHMS[name]) if name in ALGORITHMS else None
    if spec is None or spec.score == "mixture":
        why = "is not registered here" if spec is None else "scores a mixture that depends on its settings"
        raise ValueError(
            f"{source} was written by algorithm {name!r}, which {why}: pass "
            "personalized_state_dict(..., algorithm=<the Algorithm object it was trained with>)."
        )
    return spec
