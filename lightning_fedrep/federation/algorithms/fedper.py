"""FedPer (Arivazhagan et al., 2019): FedRep's split, trained jointly.

Every sampled client trains its head and body together for ``local_epochs``; it uploads the body, which the
server replaces by the participants' sample-weighted mean, and keeps its head. Unlike FedRep, head and
representation get the same number of local updates.
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedPer"]


class FedPer(Algorithm):
    """FedPer: head and body trained jointly; the body is averaged, heads stay local.

    **Shares** the body; the head stays on the client. **Phases**: the base class's one
    ``Phase("all", epochs=local_epochs)``. The server step is the default sample-weighted mean.

    The official settings (FedRep's baseline, ``lgcollins/FedRep``): the same body/head split as FedRep,
    ``local_ep`` joint epochs (FedRep's paper: as many as FedRep's body epochs, 1 or 5), ``SGD(lr=0.01,
    momentum=0.5)``, weight decay ``1e-4``, FedRep's batch sizes, a tenth of the clients per round.

    ``Trainer(strategy="fedper")`` (and ``"fedper_ddp"``) uses ``FedPer()``.
    """

    def __init__(self) -> None:
        super().__init__("fedper", {"body"}, "FedPer: head and body trained jointly; the body is averaged.")

    def __repr__(self) -> str:  # the registered instance's text from before it was a class
        return f"Algorithm(name={self.name!r}, shares={sorted(self.shares)})"


register_algorithm(FedPer())
