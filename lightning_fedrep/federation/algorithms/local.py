"""Local Only: no communication; every client trains its own model on its own data.

The baseline every personalized method must beat: each client keeps its whole model, trains it for
``local_epochs`` whenever it is sampled, and nothing is averaged.
"""

from __future__ import annotations

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["Local"]


class Local(Algorithm):
    """Local Only: no communication, every client trains alone.

    **Shares** nothing (so it needs no ``head=``): the whole model is each client's own. **Phases**: the base class's one ``Phase("all",
    epochs=local_epochs)``. There is no server step.

    The official settings (FedRep's baseline, ``main_local.py`` in ``lgcollins/FedRep``): ``SGD`` with
    momentum 0.5, ``epochs`` passes over the local data, the same initial model for every client.

    ``Trainer(strategy="local")`` (and ``"local_ddp"``) uses ``Local()``.
    """

    def __init__(self) -> None:
        super().__init__("local", (), "Local Only: no communication, every client trains alone.")

    def __repr__(self) -> str:  # the registered instance's text from before it was a class
        return f"Algorithm(name={self.name!r}, shares={sorted(self.shares)})"


register_algorithm(Local())
