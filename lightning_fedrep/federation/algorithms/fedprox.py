"""FedProx (Li et al., MLSys 2020): FedAvg whose local loss adds a proximal pull to the round's global model.

Every client trains everything (one ``"all"`` phase of ``local_epochs``) on::

    loss(w) + mu/2 * ||w - w_global||^2       over the shared parameters, w_global = the round-start model

and the server takes the sample-weighted mean, as FedAvg. The proximal term is one vmappable
:class:`~lightning_fedrep.federation.api.objective.LossTerm`, so both runners train it (``runner="auto"`` may
pick the lockstep runner).
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.objective import LossTerm, Objective, StepView
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedProx"]


class FedProx(Algorithm):
    """FedAvg with the proximal term ``mu/2 ||w - w_global||^2`` on the shared (averaged) parameters.

    Args:
        mu: the proximal weight, ``>= 0`` (0 is FedAvg). The default ``0.1`` is the official FedRep code's
            (``--mu 0.1``, its FedProx baseline in FedRep's Table 1), not the 0.01 of some FedProx
            experiments: the baseline is the one this package reproduces.

    The term is part of the loss, so its gradient ``mu (w - w_global)`` goes through the user's optimizer:
    with momentum it is accumulated in the momentum buffer like the loss's gradient. The official FedRep
    code's FedProx optimizer (``FedProx.py``) does the same: it adds ``mu (w - w_0)`` in place to ``d_p``,
    which is its momentum buffer, so the term enters the buffer and decays with it, the update this
    strategy takes with an SGD optimizer of the same momentum. One difference remains in the settings: that
    optimizer decays every tensor (``weight_decay=1e-4`` on ``net.parameters()``, biases included), while
    the recipes' optimizer, like the official code's other baselines, decays the weights only.

    ``Trainer(strategy="fedprox")`` (and ``"fedprox_ddp"``) uses ``FedProx()``; pass another ``mu`` as
    ``FederatedStrategy(algorithm=FedProx(mu=0.01))``.
    """

    def __init__(self, mu: float = 0.1):
        super().__init__(
            "fedprox",
            {"body", "head"},
            "FedProx: FedAvg whose local loss adds mu/2 ||w - w_global||^2 on the shared parameters.",
        )
        self.mu = check_real("mu", mu, 0.0, owner="FedProx")

    def objective(self, phase: str) -> Objective:
        """The proximal term, in every phase (none when ``mu == 0``)."""
        if self.mu == 0:
            return Objective()
        mu = self.mu

        def proximal(view: StepView) -> Tensor | None:
            shared = [name for name in view.trained if name in view.server]
            if not shared:
                return None
            distance = sum((view.trained[n] - view.server[n]).square().sum() for n in shared)
            return mu / 2 * distance

        return Objective(terms=(LossTerm(proximal, "FedProx proximal term"),))

    def __repr__(self) -> str:
        return f"FedProx(mu={self.mu})"


register_algorithm(FedProx())
