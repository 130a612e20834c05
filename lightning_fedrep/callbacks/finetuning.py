"""``HeadFineTuning``: fine-tuning rounds after the federated rounds (FedAvg + FT, FedRep's last round)."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L

from lightning_fedrep.federation.api.algorithm import Phase
from lightning_fedrep.federation.api.arguments import check_choice, check_int
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.internals import set_max_rounds

FINETUNE_PREFIX = "finetune/"
"""What the names of a fine-tuning round's validation carry in front: ``finetune/val/acc`` (the summary over
clients, ``strategy.results()["finetune"]``) and its per-client values (``client_metrics["finetune/val"]``,
``clients_finetune_val.csv``)."""


class HeadFineTuning(FederatedCallback):
    """After the federated rounds, every client fine-tunes its own model on its own training data.

    ``mode="head"`` trains only the head with the body frozen (the FedRep paper's FedAvg + FT
    protocol, and the official FedRep code's final head-only round for all clients);
    ``mode="full"`` trains the whole model (the FedAvg-FT paper's protocol). Nothing is aggregated:
    each client keeps its fine-tuned model, and validation/test then run on the fine-tuned models.
    Validation after a fine-tuning round is logged under ``finetune/`` (``finetune/val/acc``) so it
    stays out of the federated rounds' figures (``strategy.results()["finetune"]``); its per-client values
    carry the same names (``strategy.client_metrics["finetune/val"].per_client("finetune/val/acc")``,
    ``clients_finetune_val.csv``), while ``val/acc`` and ``client_metrics["val"]`` stay the last federated
    round's, the global model's for FedAvg.

    The callback appends ``rounds`` rounds to ``max_epochs`` when fit starts (each is one pass of
    ``epochs`` local epochs, or ``steps`` steps, over all clients), so set ``max_epochs`` to the
    number of federated rounds. It plans them through ``configure_round``: a fine-tuning round is the
    round's plan with every client, the fine-tuning phase, no aggregation and the ``finetune/`` prefix.
    """

    def __init__(
        self,
        epochs: int = 10,
        mode: Literal["head", "full"] = "head",
        rounds: int = 1,
        steps: int | None = None,
    ):
        owner = "HeadFineTuning"
        check_choice("mode", mode, ("head", "full"), owner=owner)
        check_int("rounds", rounds, minimum=1, owner=owner)
        if steps is None:
            check_int("epochs", epochs, minimum=1, owner=owner)
        else:
            check_int("steps", steps, minimum=1, owner=owner)
        self.phase = Phase(
            "head" if mode == "head" else "all", epochs=None if steps is not None else epochs, steps=steps
        )
        self.mode = mode
        self.rounds = rounds
        self.federated_rounds: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Extend the fit by the fine-tuning rounds."""
        if self.mode == "head" and not self.federation(trainer).split.head:
            raise ValueError(
                "HeadFineTuning(mode='head') needs to know the head: pass head=... to the strategy or set "
                "`fedrep_head` on the module (or use mode='full')."
            )
        if self.federated_rounds is None:
            max_epochs = trainer.max_epochs
            if max_epochs is None or max_epochs < 0:
                raise ValueError("HeadFineTuning needs Trainer(max_epochs=<number of federated rounds>).")
            self.federated_rounds = max_epochs
        set_max_rounds(trainer, self.federated_rounds + self.rounds)

    def configure_round(self, trainer: L.Trainer, plan: RoundPlan) -> RoundPlan:
        """The rounds after the federated ones fine-tune every client (head-only or full), unaggregated."""
        if self.federated_rounds is None or plan.round < self.federated_rounds:
            return plan
        return plan.replace(
            clients=range(plan.num_clients), phases=(self.phase,), aggregate=False, prefix=FINETUNE_PREFIX
        )

    @property
    def label(self) -> str:
        """What the callback adds to the algorithm, in words for a run's name: ``"head fine-tuning"`` or
        ``"full fine-tuning"``."""
        return f"{self.mode} fine-tuning"

    def describe(self) -> dict[str, Any]:
        """The fine-tuning as ``RunSummary`` records it (``summary.json``'s ``fine_tuning``): :attr:`label`,
        ``mode``, ``epochs`` or ``steps``, ``rounds``, the ``prefix`` of its validation's names and the
        ``federated_rounds`` before it (``None`` before fit)."""
        return {
            "label": self.label,
            "mode": self.mode,
            "epochs": self.phase.epochs,
            "steps": self.phase.steps,
            "rounds": self.rounds,
            "prefix": FINETUNE_PREFIX,
            "federated_rounds": self.federated_rounds,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"federated_rounds": self.federated_rounds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.federated_rounds = state_dict["federated_rounds"]
