"""FedDBE (Zhang et al., "Eliminating Domain Bias for Federated Learning in Representation Space", NeurIPS
2023): the whole model is shared; each client keeps a personalized representation bias ``b_i`` added to its
features before the head, and a mean regularizer pulls the running mean of its features to a global mean.

What was followed: the authors' repository (github.com/TsingZ0/DBE, ``system/flcore/clients/clientDBE.py``,
``servers/serverDBE.py``; PFLlib's ``clientdbe.py``/``serverdbe.py`` are the same code). With ``rep = phi(x)``
(the module's body output, the head's input) and ``h`` the module's head, per local step on the batch::

    r    <- (1 - m) * r.detach() + m * mean_batch(rep)        (r reset to 0 when the client starts a round)
    loss  = CE(h(rep + b_i), y) + kappa * mean_d(0.5 * (r - r_bar) ** 2)

the module's optimizer steps the model, plain SGD (the client's learning rate) steps ``b_i`` (``[d]``, starting
at 0, never uploaded). The server takes the sample-weighted mean of the whole model. ``r_bar`` is fixed once, by
an initialization pass before the first training round: every client trains one round of plain ``CE(h(rep),
y)`` from the initial model while tracking ``r``; ``r_bar`` is the sample-weighted mean of the clients' final
``r``, and the pass's trained weights are thrown away. Evaluation scores ``h(phi(x) + b_i)`` with the global
model.

How it maps here: the initialization pass is the fit's first federated round (every client takes part; its
``aggregate`` keeps the initial model and stores ``r_bar``), so ``max_epochs=R`` trains ``R - 1`` DBE rounds;
the evaluation after it scores the initial model, as the official round 0 does. The loss is a step rule on the
module's feature split (``forward_features``/``forward_head``, or a head submodule called last).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.aggregation import WeightedMean
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import ClientEnd, ClientOutcome, ClientStart, StartOutcome
from lightning_fedrep.federation.api.objective import (
    Objective,
    PureLoss,
    StepOutcome,
    StepRule,
    StepView,
    masked_mean,
    required_loss,
)
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec
from lightning_fedrep.federation.module.feature_split import (
    FeatureSplit,
    declares_split,
    head_input,
    require_feature_split,
)

__all__ = ["DBEForward", "FedDBE"]

BIAS, RUNNING, GLOBAL, READY = "bias", "running_mean", "global_mean", "initialized"


def _features_shape(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """``(d,)``: the input size of the head's first linear layer (its first 2-D tensor)."""
    for shape in groups["head"].values():
        if len(shape) == 2:
            return (int(shape[1]),)
    raise ValueError(
        "FedDBE adds its bias to the head's [batch, d] input, so the head must start with a linear layer (a [C, d] "
        "weight): pass head= naming it."
    )


@dataclass
class DBEForward:
    """FedDBE's scored prediction (``EvaluationSpec.forward``): ``h(phi(x) + b_i)`` with the module's declared
    ``forward_features``/``forward_head``, else the input of the head submodule ``head`` (set at set-up)."""

    head: str = ""

    def __call__(
        self, module: nn.Module, client_state: Mapping[str, Tensor], server: Any, x: Tensor
    ) -> Tensor:
        bias = client_state[BIAS]
        if declares_split(module):
            rep = module.forward_features(x)
            return module.forward_head(rep + bias.to(rep.dtype))
        if not self.head:
            raise RuntimeError("FedDBE's prediction needs FedDBE.setup() to have found the module's head.")
        rep = head_input(module, self.head, x)
        return module.get_submodule(self.head)(rep + bias.to(rep.dtype))


class FedDBE(Algorithm):
    """FedDBE: a FedAvg model, a personalized representation bias per client and a mean regularizer.

    Args:
        momentum: ``m``, the running mean's weight of the current batch (PFLlib's ``-mo`` default 0.1; the
            DBE repository's example run uses 1).
        kappa: ``kappa``, the mean regularizer's weight (PFLlib's ``-klw`` default 0.0, which drops the term;
            the DBE repository's example run uses 50).

    **Shares** the body and the head. Declared tensors: per client ``"bias"`` (``b_i``, ``[d]``, zeros) and
    ``"running_mean"`` (``r``); server ``"global_mean"`` (``r_bar``) and ``"initialized"`` (0 until the
    initialization pass has set ``r_bar``). The first federated round is the initialization pass (every client,
    plain cross-entropy, the model kept as it was). Needs the module's ``fedrep_loss``, the module as
    ``head(features(x))`` (declared ``forward_features``/``forward_head``, or a ``forward`` returning its head
    submodule applied last, verified on a client's first training samples) and a head starting with a linear
    layer (refused at ``setup``). Runners: both (the step rule runs per client inside the lockstep runner's
    ``vmap``).

    ``Trainer(strategy="feddbe")`` uses ``FedDBE()``.
    """

    client_tensors = (
        ClientTensors(BIAS, shapes=_features_shape),
        ClientTensors(RUNNING, shapes=_features_shape),
    )
    server_tensors = (ServerTensors(GLOBAL, shapes=_features_shape), ServerTensors(READY, shapes=()))

    def __init__(self, momentum: float = 0.1, kappa: float = 0.0):
        super().__init__(
            "feddbe",
            {"body", "head"},
            "FedDBE: FedAvg + a personalized representation bias per client and a global-mean regularizer.",
        )
        self.momentum = check_real("momentum", momentum, 0.0, 1.0, owner="FedDBE")
        self.kappa = check_real("kappa", kappa, 0.0, owner="FedDBE")
        self._forward = DBEForward()
        self._split: FeatureSplit | None = None
        self._loss: Callable[[Tensor, Tensor], Tensor] | None = None
        self._dim = 0

    @property
    def needs_split(self) -> bool:
        """Always: the bias is added to the head's input."""
        return True

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a module FedDBE cannot run (see the class docstring); keep its feature split."""
        shapes = {n: tuple(module.get_parameter(n).shape) for n in split.head}
        (self._dim,) = _features_shape({"head": shapes})
        self._loss = required_loss(module, "FedDBE", "h(rep + b)")
        found = require_feature_split(module, tuple(split.head), datamodule, "FedDBE")
        self._split = found
        self._forward.head = found.head_module or ""

    def configure_round(self, plan: Any, server: Any) -> Any:
        """Every client in the initialization pass (the first federated round); later rounds unchanged. Round 0
        is named too: a past round planned again (``strategy.round_plan(0)``) sees the current server state."""
        if plan.federated and (plan.round == 0 or not bool(server.tensors[READY])):
            return plan.replace(clients=range(server.num_clients))
        return plan

    def evaluation(self) -> EvaluationSpec:
        """The global model predicting ``h(phi(x) + b_i)`` (``DBEForward``)."""
        return EvaluationSpec(forward=self._forward)

    def objective(self, phase: str) -> Objective:
        """The FedDBE step rule, in every phase."""
        return Objective(step=StepRule(self._step, "FedDBE bias and mean-regularizer step"))

    def start_client(self, start: ClientStart) -> StartOutcome:
        """``r`` restarts at 0 when the client starts a round."""
        return StartOutcome(client_state={RUNNING: torch.zeros_like(start.client_state[RUNNING])})

    def aggregator(self, like: Mapping[str, Tensor]) -> WeightedMean:
        """The weighted mean of the model and of the clients' running means."""
        device = next(iter(like.values())).device
        return WeightedMean({**like, RUNNING: torch.zeros(self._dim, device=device)})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads the model and ``r`` (read by the server only after the initialization pass)."""
        return ClientOutcome(upload={**end.shared(), RUNNING: end.client_state[RUNNING]})

    def aggregate(self, server, results, failures):  # noqa: ANN001, ANN201 (Algorithm.aggregate's signature)
        """After the initialization pass: the model as it was, ``r_bar`` the clients' weighted mean ``r``.
        Later: the weighted mean of the model."""
        if not bool(server.tensors[READY]):
            ready = torch.ones_like(server.tensors[READY])
            return server.replace(tensors={GLOBAL: results.reduced[RUNNING], READY: ready}), {}
        return server.replace(shared={n: results.reduced[n] for n in server.shared}), {}

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        split, per_sample = self._split, self._loss
        if split is None or per_sample is None:
            raise RuntimeError("FedDBE's step needs setup() to have run.")
        tensors = dict(view.tensors)
        ready = view.server[READY]  # 0 in the initialization pass: no bias, no regularizer
        previous = view.client_state[RUNNING].detach()
        m, kappa = self.momentum, self.kappa

        def objective(trained: Mapping[str, Tensor], bias: Tensor) -> tuple[Tensor, Tensor]:
            full = {**tensors, **trained}
            rep = split.features(full, x)
            rows = rep if view.mask is None else rep * view.mask[:, None].to(rep.dtype)
            count = rep.shape[0] if view.mask is None else view.mask.sum().clamp_min(1.0)
            running = (1 - m) * previous.to(rep.dtype) + m * rows.sum(0) / count
            out = split.head(full, rep + (ready * bias).to(rep.dtype))
            value = masked_mean(per_sample(out, y), view.mask)
            gap = 0.5 * (running - view.server[GLOBAL].to(rep.dtype)).square()
            return value + ready * kappa * gap.mean(), running.detach()

        bias = view.client_state[BIAS]
        (grads, bias_grad), (value, running) = torch.func.grad_and_value(
            objective, argnums=(0, 1), has_aux=True
        )(dict(view.trained), bias)
        lr = 0.0 if view.lr is None else view.lr
        return StepOutcome(grads, value, {BIAS: bias - lr * bias_grad, RUNNING: running.to(previous.dtype)})

    def __repr__(self) -> str:
        return f"FedDBE(momentum={self.momentum}, kappa={self.kappa})"


register_algorithm(FedDBE())
