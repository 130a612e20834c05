"""FedRep (Collins et al., ICML 2021): a shared representation, a personal head per client.

Every sampled client first trains its own head with the body frozen at the round's global body, then the
body with its new head frozen; it uploads only the body, which the server replaces by the participants'
sample-weighted mean. Heads never leave the client: they persist between its participations.
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedRep"]


class FedRep(Algorithm):
    """FedRep: head epochs with the body frozen, then body epochs with the head frozen; body averaged.

    **Shares** the body (everything that is not head); the head stays on the client. **Phases**:
    ``Phase("head", epochs=head_epochs)`` then ``Phase("body", epochs=body_epochs)`` (the shorthands'
    defaults are 10 and 1). The server step is the default sample-weighted mean of the uploaded bodies.

    The official settings (``lgcollins/FedRep``, ``scripts/*.sh`` and ``models/Update.py``): 10 head epochs,
    then 1 body epoch on CIFAR-10 with 100 clients and 2 classes each, 5 body epochs everywhere else;
    ``SGD(lr=0.01, momentum=0.5)``, weight decay ``1e-4`` on non-bias parameters, batch size 10 (4 on
    Sent140), a fresh optimizer per client and round (the strategy's default ``keep_optimizer_state=False``),
    a tenth of the clients per round; every head starts from the same initial values; the reported
    accuracy is the mean over the last 10 rounds, then a final round fine-tunes the heads for 10 epochs.

    ``Trainer(strategy="fedrep")`` (and ``"fedrep_ddp"``) uses ``FedRep()``; the epoch counts are the
    strategy's ``head_epochs=`` and ``body_epochs=``.
    """

    def __init__(self) -> None:
        super().__init__(
            "fedrep",
            {"body"},
            "FedRep: head epochs with the body frozen, then body epochs with the head frozen; "
            "the body is averaged, heads stay local.",
        )

    epochs = ("head_epochs", "body_epochs")

    def default_phases(self, head_epochs: int, body_epochs: int) -> tuple[Phase, ...]:
        """The head phase (body frozen) for ``head_epochs``, then the body phase (head frozen) for ``body_epochs``."""
        return (Phase("head", epochs=head_epochs), Phase("body", epochs=body_epochs))


register_algorithm(FedRep())
