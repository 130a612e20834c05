"""Whose model ``trainer.predict`` runs, batch by batch (Lightning-free): :class:`Prediction` owns the
prediction loader it serves, the mode decided at the start (``strategy.prediction_mode``), the client of each
predicted batch (``strategy.prediction_clients``) and the client whose model is loaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_fedrep.evaluation.passes import some_names
from lightning_fedrep.federation import Federation

PREDICTION_MODES = {
    "personalized": "personalized predictions, each batch on its client's own model (the global body and the "
    "client's head); strategy.prediction_clients gives each batch's client",
    "new_client": "new-client predictions, every batch on the model a client that never trained gets (the "
    "global body and the initial head), not on the clients' personalized models",
}


def reads_clients(setting: str) -> bool:
    """Whether ``trainer.predict`` with ``predict=setting`` may read the clients' stored state, so a checkpoint's
    federation must be this data's: not for new-client predictions, which use the global part only."""
    return setting != "new_client"


class Prediction:
    """The predictions of one strategy: which model, which client each batch had."""

    def __init__(self) -> None:
        self.loader: Any = None
        """The federated prediction loader being served (an ``EvalLoader``), ``None`` for other batches."""
        self.mode: str | None = None
        """Whose model the last ``trainer.predict`` ran: ``"personalized"`` or ``"new_client"``."""
        self.clients: list[int] = []
        """After ``trainer.predict`` on a federated data module: the client of each predicted batch, in the
        order of the returned predictions."""
        self.client = -1
        """The client whose model the live module holds (``-1``: a new client's)."""

    def serve(self, loader: Any) -> None:
        """Predict ``loader``'s batches client by client (``None``: batches that carry no client)."""
        self.loader = loader

    def begin(
        self,
        setting: str,
        federation: Federation | None,
        algorithm_name: str,
        first_state: str,
        module_alone: bool,
        info: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        """Decide whose model predicts (``setting``: the strategy's ``predict``), say it in a log line, and
        load the model a new client gets (global shared part, initial local part)."""
        federated = self.loader is not None
        mode = ("personalized" if federated else "new_client") if setting == "auto" else setting
        if mode == "personalized" and not federated:
            raise ValueError(
                "predict='personalized' predicts each batch with its client's own model, but these batches carry "
                "no client (they do not come from a FederatedDataModule). Predict with datamodule=<the federated "
                "data module> (each client's test samples), use strategy.client_model(i) for client i's model, or "
                "pass predict='new_client' (or 'auto')."
            )
        self.mode = mode
        info(f"trainer.predict (predict={setting!r}): {PREDICTION_MODES[mode]}.")
        if setting == "auto" and not module_alone:  # else setup warned
            note = untrained_new_client_note(federation, algorithm_name, first_state, mode)
            if note is not None:
                warn(note)
        if federation is not None and federation.has_state:
            federation.load_personalized(-1)
        self.clients = []
        self.client = -1

    def step(
        self, batch_idx: int, module: nn.Module, federation: Federation | None, user_step: Callable[[], Any]
    ) -> Any:
        """One predicted batch: on its client's model (``"personalized"``) or a new client's, with the
        algorithm's ``EvaluationSpec.forward`` in place of the module's where it has one."""
        if self.loader is not None:
            client = self.loader.client_of(batch_idx)
            self.clients.append(client)
            if self.mode == "personalized" and client != self.client:  # the federation holds state (setup)
                federation.load_personalized(client)
                self.client = client
        if federation is None or not federation.has_state:
            return user_step()
        with federation.scoring(module, self.client if self.mode == "personalized" else -1):
            return user_step()


def untrained_new_client_note(
    federation: Federation | None, algorithm_name: str, first_state: str, mode: str
) -> str | None:
    """What ``predict="auto"`` falling back to the new-client model means when that model's local part is
    the initial, untrained one (``first_state="initial"``) of an algorithm that keeps a part per client (under
    FedRep the global body with an untrained head: no client's model); ``None`` otherwise."""
    local = list(federation.local_names) if federation is not None else []
    if mode != "new_client" or not local or first_state != "initial":
        return None
    return (
        "trainer.predict on batches that carry no client (not a FederatedDataModule's) predicts with the model "
        f"a client that never trained gets: the global part with the initial, untrained {some_names(local)}, "
        f"which algorithm {algorithm_name!r} trains per client, so no client's model makes these "
        "predictions. Predict with datamodule=<the federated data module> for each client's own model, or with "
        "strategy.client_model(i) for client i's; pass predict='new_client' to choose this model (a log line "
        "then says so, without this warning)."
    )
