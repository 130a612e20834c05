"""pFedMe (Dinh et al., "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

What was followed: the authors' repository (github.com/CharlieDinh/pFedMe, ``userpFedMe.py``,
``serverpFedMe.py``, ``fedoptimizer.py``) and PFLlib's ``clientpFedMe.py``/``serverpFedMe.py`` (the same rule).
The whole model is shared. Each client keeps a local model ``w_i`` (the module's own parameters, trained by its
optimizer) and a personalized model ``theta_i`` (the declared slot ``"personal"``). When a client starts a round,
both become the global model. Per batch, with ``eta`` the client's learning rate::

    K times:  theta <- theta - eta_p * (grad f(theta; batch) + lam * (theta - w) + mu * theta)
    then:     w     <- w - eta * lam * (w - theta)

``theta`` carries over from batch to batch (it is not reset to ``w``); after the last batch the client uploads
``w``. The server takes the sample-weighted mean of the ``w_i`` and mixes it into the previous global model::

    x <- (1 - beta) * x_prev + beta * mean_i(w_i)

How it maps here: one :class:`StepRule` runs the ``K`` inner steps on ``theta`` (written back as the slot's new
value) and hands the optimizer the gradient ``lam * (w - theta)``: with plain SGD (the paper's) the optimizer
step is exactly the ``w`` update (momentum or weight decay would act on it too). Runners: both (the rule runs per
client inside the lockstep runner's ``vmap``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_choice, check_int, check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientEnd, ClientOutcome, ClientStart, StartOutcome
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["PFedMe"]

PERSONAL, LOCAL = "personal", "local"
TARGETS = ("personalized", "local", "global")


class PFedMe(Algorithm):
    """pFedMe: per batch, ``K`` steps of a personalized model on the Moreau-envelope objective, then one step of
    the local model towards it; the server mixes the local models' weighted mean into the global one.

    Args:
        lam: ``lambda``, the Moreau envelope's weight (paper and official code: 15; PFLlib's ``-lam``
            default is 1).
        inner_steps: ``K``, the personalized model's steps per batch (5, everywhere).
        personal_lr: ``eta_p``, the personalized model's learning rate (0.01: PFLlib's ``-lrp`` and the
            official runs' low end; the paper uses 0.01-0.1).
        beta: ``beta``, the server's mixing weight (paper/official: 1 or 2; 1 is FedAvg's server). PFLlib's
            ``-bt`` default is **0.0**, which never moves the global model: pass ``beta=0`` only on purpose.
        mu: the personalized step's weight decay (0.001, a hidden default of the official and PFLlib
            ``pFedMeOptimizer``).
        evaluate: what evaluation scores: ``"personalized"`` (the paper's ``theta_i``, the default),
            ``"local"`` (``w_i`` at the end of the client's last round; stored in a second slot, ``"local"``)
            or ``"global"`` (the server's model, for every client: PFLlib's since its 2023 evaluate-after-send
            order, which scores the model just received).

    **Shares** the whole model. Declared tensors: per client the slot ``"personal"`` (``theta_i``, like the
    model, starting at the module's initial values; set to the global model when the client starts a round)
    and, with ``evaluate="local"``, the slot ``"local"``. Needs the module's ``fedrep_loss``. The official code
    trains every client each round but aggregates only the sampled ones; here only the sampled clients train.

    ``Trainer(strategy="pfedme")`` uses ``PFedMe()``.
    """

    def __init__(
        self,
        lam: float = 15.0,
        inner_steps: int = 5,
        personal_lr: float = 0.01,
        beta: float = 1.0,
        mu: float = 0.001,
        evaluate: Literal["personalized", "local", "global"] = "personalized",
    ):
        super().__init__(
            "pfedme",
            {"body", "head"},
            "pFedMe: K Moreau-envelope steps of a personalized model per batch, the local model pulled to it.",
        )
        self.lam = check_real("lam", lam, 0.0, owner="PFedMe")
        self.inner_steps = check_int("inner_steps", inner_steps, 1, owner="PFedMe")
        self.personal_lr = check_real("personal_lr", personal_lr, 0.0, low_open=True, owner="PFedMe")
        self.beta = check_real("beta", beta, 0.0, owner="PFedMe")
        self.mu = check_real("mu", mu, 0.0, owner="PFedMe")
        self.evaluate = check_choice("evaluate", evaluate, TARGETS, owner="PFedMe")
        slots = (PERSONAL, LOCAL) if self.evaluate == "local" else (PERSONAL,)
        self.client_tensors = tuple(ClientTensors(s, like="model", init="module") for s in slots)

    def evaluation(self) -> EvaluationSpec:
        """``theta_i``, ``w_i`` or the global model, as ``evaluate`` says."""
        if self.evaluate == "global":
            return EvaluationSpec("global")
        return EvaluationSpec("slot", slot=PERSONAL if self.evaluate == "personalized" else LOCAL)

    def start_client(self, start: ClientStart) -> StartOutcome:
        """``theta_i`` starts the round as the global model (``w_i`` does anyway)."""
        prefix = f"{PERSONAL}."
        return StartOutcome(
            client_state={
                n: start.start[n[len(prefix) :]] for n in start.client_state if n.startswith(prefix)
            }
        )

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads ``w_i``; with ``evaluate="local"`` also keeps it in the ``"local"`` slot."""
        if self.evaluate != "local":
            return ClientOutcome(upload=end.shared())
        return ClientOutcome(
            upload=end.shared(), client_state={f"{LOCAL}.{n}": t for n, t in end.end.items()}
        )

    def objective(self, phase: str) -> Objective:
        """The pFedMe step rule, in every phase."""
        return Objective(step=StepRule(self._step, "pFedMe personalized steps and local pull"))

    def aggregate(self, server, results, failures):  # noqa: ANN001, ANN201 (Algorithm.aggregate's signature)
        """``x <- (1 - beta) x_prev + beta * mean(w_i)`` (the sample-weighted mean)."""
        beta = self.beta
        mixed = {n: (1 - beta) * x + beta * results.reduced[n] for n, x in server.shared.items()}
        return server.replace(shared=mixed), {}

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        w = {n: t.detach() for n, t in view.trained.items()}
        theta = {n: view.client_state[f"{PERSONAL}.{n}"].to(t.dtype) for n, t in w.items()}
        rest = dict(view.tensors)
        lam, eta_p, mu = self.lam, self.personal_lr, self.mu

        def f(personal: Mapping[str, Tensor]) -> Tensor:
            return loss({**rest, **personal}, x, y, view.mask)

        value = torch.zeros(())
        for _ in range(self.inner_steps):
            grads, value = torch.func.grad_and_value(f)(theta)
            theta = {n: t - eta_p * (grads[n] + lam * (t - w[n]) + mu * t) for n, t in theta.items()}
        pull = {n: lam * (w[n] - theta[n]) for n in w}
        return StepOutcome(pull, value, {f"{PERSONAL}.{n}": t for n, t in theta.items()})

    def __repr__(self) -> str:
        return (
            f"PFedMe(lam={self.lam}, inner_steps={self.inner_steps}, personal_lr={self.personal_lr}, "
            f"beta={self.beta}, mu={self.mu}, evaluate={self.evaluate!r})"
        )


register_algorithm(PFedMe())
