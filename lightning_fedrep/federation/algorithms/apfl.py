"""APFL (Deng et al., 2020), as the official FedRep repository runs it (``main_apfl.py``, ``LocalUpdateAPFL``).

Every client keeps a personal model ``v`` next to the global model ``w``. At each local step, on the batch,
with ``w_0`` the global copy at the step's start and ``lr`` the optimizer's learning rate::

    (a) w <- the client's optimizer step on grad L(w_0)
    (b) v <- v - lr * alpha * grad L(mix),   mix = alpha * v + (1 - alpha) * w_0    (mixture="paper")
                                             mix = alpha * v + alpha * w_0          (mixture="official")

The official code reads ``alpha * w_local + alpha * w_glob`` (a typo for ``1 - alpha``): ``mixture="official"``
reproduces it. The server takes the sample-weighted mean of the ``w`` (the official ``main_apfl.py`` takes the
unweighted mean ``w / m``: pass ``weighting="uniform"`` to the strategy for it).

Deviation from the official code: its step (b) runs the same SGD optimizer (momentum 0.5, weight decay
1e-4) on ``alpha * L(mix)``, so ``v`` moves with the optimizer's momentum buffer shared with ``w``'s steps;
here (b) is a plain SGD step (no momentum, no weight decay) inside the step rule, written into the personal
model after ``w``'s optimizer step. With momentum and weight decay 0 the two are the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["APFL"]

SLOT = "personal"
MIXTURES = ("paper", "official")


class APFL(Algorithm):
    """APFL: a FedAvg global model ``w`` and a personal model ``v`` per client, trained on their mixture.

    Args:
        alpha: the mixing weight ``alpha`` in ``[0, 1]`` (the official ``--alpha_apfl``, default 0.75).
        mixture: ``"paper"`` (``alpha v + (1 - alpha) w``) or ``"official"`` (``alpha v + alpha w``, the
            official code's training mixture).

    The personal model is a declared ``ClientTensors("personal", like="model", init="module")``: it starts
    from the module's initial values ``w^0``. The official ``main_apfl.py`` fills ``w_locals`` with
    ``net_glob.state_dict()`` tensors, which alias the global model's parameters until a client first trains,
    so there a client's ``v`` starts from the global model of the round it is first sampled in.

    Evaluation scores the mixture ``alpha v + (1 - alpha) w`` of the client's personal model and the current
    global model, as ``main_apfl.py`` does (with either training ``mixture``).

    Runners: both (a :class:`~lightning_fedrep.federation.api.objective.StepRule` that updates the client's
    declared tensors every step, run per client inside the lockstep runner's ``vmap``). Needs the module's
    ``fedrep_loss``.

    ``Trainer(strategy="apfl")`` uses ``APFL()``.
    """

    client_tensors = (ClientTensors(SLOT, like="model", init="module"),)

    def __init__(self, alpha: float = 0.75, mixture: Literal["paper", "official"] = "paper"):
        super().__init__(
            "apfl",
            {"body", "head"},
            "APFL: a FedAvg model w and a personal model v per client, v trained on alpha v + (1 - alpha) w.",
        )
        self.alpha = check_real("alpha", alpha, 0.0, 1.0, owner="APFL")
        if mixture not in MIXTURES:
            raise ValueError(f"APFL mixture={mixture!r} is not one of {MIXTURES}: 'paper' or 'official'.")
        self.mixture = mixture

    def evaluation(self) -> EvaluationSpec:
        """The mixture ``alpha v + (1 - alpha) w_global`` of each client's personal and the global model."""
        alpha = self.alpha

        def mix(
            global_: Mapping[str, Tensor], personal: Mapping[str, Tensor], client: int
        ) -> dict[str, Tensor]:
            return {
                n: alpha * personal[n] + (1 - alpha) * g for n, g in global_.items() if g.is_floating_point()
            }

        return EvaluationSpec("mixture", slot=SLOT, mix=mix)

    def objective(self, phase: str) -> Objective:
        """The APFL step rule, in every phase."""
        return Objective(step=StepRule(self._step, f"APFL {self.mixture} mixture step"))

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        alpha = self.alpha
        beta = alpha if self.mixture == "official" else 1 - alpha
        rest, w = dict(view.tensors), dict(view.trained)
        grads, value = torch.func.grad_and_value(lambda t: loss({**rest, **t}, x, y, view.mask))(w)
        names = [n for n in w if f"{SLOT}.{n}" in view.client_state]
        v = {n: view.client_state[f"{SLOT}.{n}"] for n in names}
        mix = {n: alpha * v[n] + beta * w[n] for n in names}
        mixed = torch.func.grad(lambda t: loss({**rest, **t}, x, y, view.mask))(mix)
        lr = 0.0 if view.lr is None else view.lr
        personal = {f"{SLOT}.{n}": v[n] - lr * alpha * mixed[n] for n in names}
        return StepOutcome(grads, value, personal)

    def __repr__(self) -> str:
        return f"APFL(alpha={self.alpha}, mixture={self.mixture!r})"


register_algorithm(APFL())
