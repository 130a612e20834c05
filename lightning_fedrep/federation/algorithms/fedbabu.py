"""FedBABU (Oh et al., ICLR 2022): the body is learned with the head frozen at its random initialization;
the head is fine-tuned only for evaluation.

Federated rounds: every sampled client trains its **body only** (one ``Phase("body", epochs=local_epochs)``)
for ``local_epochs``, with its head frozen; the server takes the sample-weighted mean of the bodies. The head is
the local part of the split but never trains in a federated round, so every client's head is the module's
initial head, one for all (the strategy's ``seed`` and the module's seeded initialization make it the same
random head for every client, as PFLlib's ``torch.manual_seed(0)`` does), and the global model is the global
body with that head.

Evaluation (:meth:`FedBABU.evaluation`): before each validation and test, every evaluated client fine-tunes
body and head from that global model on its own training data for ``fine_tuning_epochs`` epochs (plain SGD at
``fine_tuning_lr``), and evaluation scores the fine-tuned model (the paper's *personalized accuracy*); the
stored state does not change, so the federated training goes on from the unfine-tuned model.
``fine_tuning_epochs=0`` scores the global model itself (the paper's *initial accuracy*; PFLlib's per-round
number). Runners: both.
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_int
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["FedBABU"]


class FedBABU(Algorithm):
    """FedBABU: the body is trained and averaged with the head frozen at its random initialization; each client
    fine-tunes the whole model before it is scored.

    Args:
        fine_tuning_epochs: epochs of body-and-head fine-tuning on each client's training data before it is
            scored (the official code's 5 "personalization" epochs; PFLlib's ``-fte`` is 10); 0 scores the
            global model (body with the initial head).
        fine_tuning_lr: the fine-tuning's learning rate; ``None`` (the default) takes the module optimizer's
            current learning rate (the official code fine-tunes at the training's final rate, 1e-3 after its
            step decay; PFLlib at its training rate 0.005).

    Deviations: the fine-tuning is plain SGD (no momentum, no weight decay), PFLlib's; the official code's uses
    momentum 0.9. It starts from the round's global model, the official code's start (PFLlib starts from each
    client's last locally trained model), and runs before every evaluation, not once after the last round:
    for PFLlib's protocol (fine-tune once after the last round, with the module's own optimizer, and keep the
    fine-tuned models) use ``FedBABU(fine_tuning_epochs=0)`` with the callback
    ``HeadFineTuning(mode="full", epochs=10)``, whose round is logged as ``finetune/val/acc``. The official code
    freezes the head with a learning rate of 0; here it gets no gradient, so the optimizer (momentum and weight
    decay included) leaves it as it is: the same. The official server averages uniformly
    (``weighting="uniform"``) and shares BatchNorm statistics with the body, as ``buffers="shared"`` does.

    Official training settings: SGD lr 0.1, momentum 0.9, lr divided by 10 at 1/2 and 3/4 of the rounds,
    batch 50; PFLlib's: plain SGD lr 0.005, batch 10, 1 local epoch. A phase that trains the head in a federated
    round (``phases=``) is refused when the round is planned: that is FedPer, not FedBABU.

    ``Trainer(strategy="fedbabu")`` (and ``"fedbabu_ddp"``) uses ``FedBABU()``; it needs the head marked
    (``head=`` or the module's ``fedrep_head``).
    """

    def __init__(self, fine_tuning_epochs: int = 5, fine_tuning_lr: float | None = None):
        super().__init__(
            "fedbabu",
            {"body"},
            "FedBABU: the body is averaged, trained with the head frozen at its random initialization; "
            "each client fine-tunes before it is scored.",
        )
        self.fine_tuning_epochs = check_int(
            "fine_tuning_epochs", fine_tuning_epochs, minimum=0, owner="FedBABU"
        )
        if fine_tuning_lr is not None:
            EvaluationSpec(
                adapt=Phase("all", epochs=1), adapt_lr=fine_tuning_lr
            )  # checks it, naming adapt_lr
        self.fine_tuning_lr = fine_tuning_lr

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """``local_epochs`` of the body, the head frozen."""
        return (Phase("body", epochs=local_epochs),)

    def configure_round(self, plan, server):  # noqa: ANN001, ANN201 (the base's loose types)
        """Refuse a federated round whose phases train the head (the head must stay at its initialization)."""
        training_head = [p for p in plan.phases if p.train != "body"]
        if plan.federated and training_head:
            raise ValueError(
                f"FedBABU trains only the body in its federated rounds (the head stays at its random "
                f"initialization), but the round's phases include {training_head[0]!r}: drop phases= (or give "
                "only Phase('body', ...)), or use FedPer to train the head too."
            )
        return plan

    def evaluation(self) -> EvaluationSpec:
        """The whole model fine-tuned for ``fine_tuning_epochs`` from the global model before it is scored."""
        if self.fine_tuning_epochs == 0:
            return EvaluationSpec()
        return EvaluationSpec(
            adapt=Phase("all", epochs=self.fine_tuning_epochs), adapt_lr=self.fine_tuning_lr
        )

    def __repr__(self) -> str:
        return f"FedBABU(fine_tuning_epochs={self.fine_tuning_epochs}, fine_tuning_lr={self.fine_tuning_lr})"


register_algorithm(FedBABU())
