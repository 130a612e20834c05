"""APFL (Deng et al., 2020), as the official FedRep repository runs it (``main_apfl.py``, ``LocalUpdateAPFL``).

Every client keeps a personal model ``v`` next to the global model ``w``. At each local step, on the batch,
with ``w_0`` the global copy at the step's start and ``lr`` the optimizer's learning rate:

``mixture="paper"`` (the paper's Algorithm 1, plain SGD for ``v``)::

    (a) w <- the client's optimizer step on grad L(w_0)
    (b) v <- v - lr * alpha * grad L(mix),   mix = alpha * v + (1 - alpha) * w_0

``mixture="official"`` (the official code's step, ``LocalUpdateAPFL.train``): one SGD optimizer (momentum ``m``,
weight decay ``wd`` on every tensor whose name does not contain ``"bias"``) steps twice per batch on one momentum
buffer, first ``w`` on ``L(w_0)``, then the mixture ``mix = alpha * v + alpha * w_0`` on ``alpha * L(mix)``, and
``v`` moves by the mixture's step::

    B <- m * V + grad L(w_0) + wd * w_0;              w <- w_0 - lr * B
    V <- m * B + alpha * grad L(mix) + wd * mix;      v <- v - lr * V

so ``v`` inherits ``w``'s momentum and weight decay and ``w`` the personal step's (``B``, ``V`` restart at 0 each
round, as the official optimizer is built per round). The ``alpha * w_0`` is the official code's typo for
``(1 - alpha) * w_0``, kept. Here ``w``'s step is the module's optimizer's: the rule hands it ``grad L(w_0) +
m * (V_prev - B_prev)``, which makes an SGD optimizer with momentum ``m`` and weight decay ``wd`` on the same
tensors (the official settings: ``momentum=0.5, weight_decay=1e-4``, biases not decayed) take exactly ``B``; with
another optimizer ``w`` follows that optimizer and only ``v`` the official step.

The server takes the sample-weighted mean of the ``w`` (the official ``main_apfl.py`` takes the unweighted mean
``w / m``: pass ``weighting="uniform"`` to the strategy for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientStart, StartOutcome
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["APFL"]

SLOT = "personal"
BUFFERS = ("apfl_global_buffer", "apfl_personal_buffer")
MIXTURES = ("paper", "official")


class APFL(Algorithm):
    """APFL: a FedAvg global model ``w`` and a personal model ``v`` per client, trained on their mixture.

    Args:
        alpha: the mixing weight ``alpha`` in ``[0, 1]`` (the official ``--alpha_apfl``, default 0.75).
        mixture: ``"paper"`` (``alpha v + (1 - alpha) w``, ``v`` by plain SGD: the paper's rule) or
            ``"official"`` (the official code's step: ``alpha v + alpha w``, ``v`` stepped by the optimizer
            just stepped for ``w``, sharing its momentum buffer and weight decay; see the module).
        momentum, weight_decay: ``"official"`` only: the momentum and the weight decay (of the tensors whose
            name has no ``"bias"``) of the optimizer the two steps share, the official code's SGD settings by
            default (0.5, 1e-4). Give the module optimizer's: it steps ``w``.

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

    def __init__(
        self,
        alpha: float = 0.75,
        mixture: Literal["paper", "official"] = "paper",
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__(
            "apfl",
            {"body", "head"},
            "APFL: a FedAvg model w and a personal model v per client, v trained on alpha v + (1 - alpha) w.",
        )
        self.alpha = check_real("alpha", alpha, 0.0, 1.0, owner="APFL")
        if mixture not in MIXTURES:
            raise ValueError(f"APFL mixture={mixture!r} is not one of {MIXTURES}: 'paper' or 'official'.")
        self.mixture = mixture
        self.momentum = check_real("momentum", momentum, 0.0, owner="APFL")
        self.weight_decay = check_real("weight_decay", weight_decay, 0.0, owner="APFL")
        if mixture == "official":  # the shared optimizer's buffer after w's step (B) and after v's (V)
            self.client_tensors = (*APFL.client_tensors, *(ClientTensors(b, like="model") for b in BUFFERS))

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
        step = self._official_step if self.mixture == "official" else self._step
        return Objective(step=StepRule(step, f"APFL {self.mixture} mixture step"))

    def start_client(self, start: ClientStart) -> StartOutcome:
        """``"official"``: the shared momentum buffers restart at 0 (the official optimizer is built per round)."""
        if self.mixture != "official":
            return StartOutcome()
        names = [n for n in start.client_state if n.split(".")[0] in BUFFERS]
        return StartOutcome(client_state={n: torch.zeros_like(start.client_state[n]) for n in names})

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        alpha = self.alpha
        rest, w = dict(view.tensors), dict(view.trained)
        grads, value = torch.func.grad_and_value(lambda t: loss({**rest, **t}, x, y, view.mask))(w)
        names = [n for n in w if f"{SLOT}.{n}" in view.client_state]
        v = {n: view.client_state[f"{SLOT}.{n}"] for n in names}
        mix = {n: alpha * v[n] + (1 - alpha) * w[n] for n in names}
        mixed = torch.func.grad(lambda t: loss({**rest, **t}, x, y, view.mask))(mix)
        lr = 0.0 if view.lr is None else view.lr
        personal = {f"{SLOT}.{n}": v[n] - lr * alpha * mixed[n] for n in names}
        return StepOutcome(grads, value, personal)

    def _official_step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        alpha, m = self.alpha, self.momentum
        rest, w = dict(view.tensors), dict(view.trained)
        grads, value = torch.func.grad_and_value(lambda t: loss({**rest, **t}, x, y, view.mask))(w)
        names = [n for n in w if f"{SLOT}.{n}" in view.client_state]
        v = {n: view.client_state[f"{SLOT}.{n}"] for n in names}
        mix = {n: alpha * v[n] + alpha * w[n] for n in names}
        mixed = torch.func.grad(lambda t: loss({**rest, **t}, x, y, view.mask))(mix)
        lr = 0.0 if view.lr is None else view.lr
        state, handed = {}, dict(grads)
        for n in names:
            decay = 0.0 if "bias" in n else self.weight_decay
            b_prev, v_prev = (view.client_state[f"{b}.{n}"] for b in BUFFERS)
            b = m * v_prev + grads[n] + decay * w[n]
            buffer = m * b + alpha * mixed[n] + decay * mix[n]
            handed[n] = grads[n] + m * (v_prev - b_prev)
            state.update(
                {f"{SLOT}.{n}": v[n] - lr * buffer, f"{BUFFERS[0]}.{n}": b, f"{BUFFERS[1]}.{n}": buffer}
            )
        return StepOutcome(handed, value, state)

    def __repr__(self) -> str:
        if self.mixture == "official":
            return (
                f"APFL(alpha={self.alpha}, mixture='official', momentum={self.momentum}, "
                f"weight_decay={self.weight_decay})"
            )
        return f"APFL(alpha={self.alpha}, mixture={self.mixture!r})"


register_algorithm(APFL())
