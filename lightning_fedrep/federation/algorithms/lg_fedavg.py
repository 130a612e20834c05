"""LG-FedAvg (Liang et al., 2020): local representations, a global head (FedRep the other way round).

Every sampled client trains its whole model jointly for ``local_epochs``; it uploads the head part, which
the server replaces by the participants' sample-weighted mean, and keeps its representation.
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["LGFedAvg"]


class LGFedAvg(Algorithm):
    """LG-FedAvg: trained jointly; the head part is averaged, the representation stays local.

    **Shares** the head (the parameters the strategy's ``head=`` marks: for LG-FedAvg, the *global* top
    layers); the body stays on the client. **Phases**: the base class's one ``Phase("all",
    epochs=local_epochs)``. The server step is the default sample-weighted mean.

    The official settings (FedRep's baseline, ``lgcollins/FedRep``): the global part is CIFAR's ``fc2`` and
    ``fc3``, the FEMNIST MLP's ``layer_hidden2`` and ``layer_out``, Sent140's ``rnn.weight_ih_l0`` and
    ``decoder`` (pass those as ``head=``); joint local epochs, ``SGD(lr=0.01, momentum=0.5)``, weight decay
    ``1e-4``, FedRep's batch sizes, a tenth of the clients per round.

    ``Trainer(strategy="lg_fedavg")`` (and ``"lg_fedavg_ddp"``) uses ``LGFedAvg()``.
    """

    def __init__(self) -> None:
        super().__init__(
            "lg_fedavg",
            {"head"},
            "LG-FedAvg: trained jointly; the head part is averaged, the representation stays local.",
        )

    def __repr__(self) -> str:  # the registered instance's text from before it was a class
        return f"Algorithm(name={self.name!r}, shares={sorted(self.shares)})"


register_algorithm(LGFedAvg())
