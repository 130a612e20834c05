"""FedAvg (McMahan et al., AISTATS 2017): one global model.

Every sampled client trains the whole model for ``local_epochs`` and uploads all of it; the server replaces
the model by the participants' sample-weighted mean. Nothing is personal (FedAvg+FT fine-tunes heads after
training: ``HeadFineTuning``).
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedAvg"]


class FedAvg(Algorithm):
    """FedAvg: one global model, everything averaged.

    **Shares** the body and the head (so it needs no ``head=``). **Phases**: the base class's one
    ``Phase("all", epochs=local_epochs)``. The server step is the default sample-weighted mean.

    The official settings (FedRep's baseline, ``lgcollins/FedRep``): ``local_ep`` 1 on CIFAR-10 (100 clients,
    2 or 5 classes) and CIFAR-100, 5 on CIFAR-10 with 1000 clients and FEMNIST, 10 on Sent140; ``SGD(lr=0.01,
    momentum=0.5)``, weight decay ``1e-4``, FedRep's batch sizes, a tenth of the clients per round, clients
    weighted by their number of training samples; FedAvg+FT (the paper) then fine-tunes only the head for 10
    epochs per client (``HeadFineTuning``).

    ``Trainer(strategy="fedavg")`` (and ``"fedavg_ddp"``) uses ``FedAvg()``.
    """

    def __init__(self) -> None:
        super().__init__("fedavg", {"body", "head"}, "FedAvg: one global model, everything averaged.")

    def __repr__(self) -> str:  # the registered instance's text from before it was a class
        return f"Algorithm(name={self.name!r}, shares={sorted(self.shares)})"


register_algorithm(FedAvg())
