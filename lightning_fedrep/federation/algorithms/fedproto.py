"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022): no
model tensor is shared; clients and server exchange only per-class prototypes, ``d``-dimensional feature means.

What was followed: PFLlib's ``clientproto.py``/``serverproto.py`` (the official ``yuetan031/FedProto`` differs
as listed below). With ``rep = phi(x)`` (the module's body output, the head's input), ``h`` its head, ``P_c`` the
global prototype of class ``c`` (where one exists), per local step on the batch::

    T_row = P_y if class y has a global prototype else rep_row.detach()
    loss  = CE(h(rep), y) + lamda * MSE(rep, T)           (MSE: the mean over the batch's B * d entries)

Every sample's ``rep`` (detached, before the step, in training mode) joins its class's sum, over all local
epochs; the client's local prototype of a class is the plain mean of those features. The server's new global
prototype of a class is the plain (unweighted) mean of the local prototypes of the round's clients holding it; a
class none of them holds has none until one does. Evaluation scores the nearest global prototype under MSE
(scores ``-MSE(rep, P_c)``, ``-inf`` for a class without one); the head is unused.

Deviations, options: the reference scores the round-0 model (accuracy 0, no prototype yet); here evaluation
follows an aggregation, so prototypes exist. The official code (SGD lr 0.01, momentum 0.5, batch 4: the
module's and data module's settings here) collects prototypes in the last local epoch only (not offered), and
restricts inference to the client's own classes with distance 100 for the others (``own_classes=True``: the
classes of its last training); it also reports the head's accuracy (``scoring="head"``: the client's model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.algorithms._prototypes import (
    classes_and_dim,
    global_prototypes,
    one_hot,
    prototype_pull,
    prototype_shapes,
)
from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, Stacked
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_choice, check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import (
    ClientEnd,
    ClientOutcome,
    ClientStart,
    RoundResults,
    ServerState,
    StartOutcome,
)
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
    module_features,
    require_feature_split,
)

__all__ = ["FedProto", "ProtoForward"]

SUMS, COUNTS = "proto_sums", "proto_counts"
PROTOS, HAS = "prototypes", "has_prototype"
UP_PROTOS, UP_HAS = "fedproto.prototypes", "fedproto.has"
OWN_CLASS_DISTANCE = 100.0
"""The official inference's distance of a class the client does not hold."""
_PROTOS_SHAPE, _CLASSES_SHAPE = prototype_shapes("FedProto")


@dataclass
class ProtoForward:
    """FedProto's scored prediction (``EvaluationSpec.forward``): ``-MSE(phi(x), P_c)`` per class ``c`` (``-inf``
    where ``P_c`` does not exist; with ``own_classes``, ``-100`` for a class the client did not train on)."""

    head: str = ""
    own_classes: bool = False

    def __call__(
        self, module: nn.Module, client_state: Mapping[str, Tensor], server: Any, x: Tensor
    ) -> Tensor:
        rep = module_features(module, self.head, x, "The prototype forward")
        protos = server[PROTOS].to(rep.dtype)
        distance = (rep[:, None, :] - protos[None]).square().mean(-1)
        distance = torch.where(server[HAS][None] > 0, distance, torch.full_like(distance, float("inf")))
        if self.own_classes:
            own = (client_state[COUNTS] > 0)[None]
            distance = torch.where(own, distance, torch.full_like(distance, OWN_CLASS_DISTANCE))
        return -distance


class FedProto(Algorithm):
    """FedProto: local models regularized towards global class prototypes; only prototypes travel.

    Args:
        lamda: ``lamda``, the prototype term's weight (PFLlib's ``-lam`` and the official ``--ld``: 1.0).
        own_classes: score only the client's own classes (the official inference; distance 100 for the others).
        scoring: ``"prototypes"`` (nearest global prototype, the reference) or ``"head"`` (the client's model).

    **Shares** nothing (every client keeps its whole model). Declared tensors: per client ``"proto_sums"``
    (``[C, d]``) and ``"proto_counts"`` (``[C]``): the round's feature sums and counts per class (reset when the
    client starts a round); server ``"prototypes"`` (``[C, d]``) and ``"has_prototype"`` (``[C]``, 1 where a
    global prototype exists). Uploads its local prototypes and which classes it holds (``Stacked``). Needs the
    module's ``fedrep_loss``, the module as ``head(features(x))`` and a head that is one linear layer (refused
    at ``setup``). Runners: both (the step rule runs per client inside the lockstep runner's ``vmap``).

    ``Trainer(strategy="fedproto")`` uses ``FedProto()``.
    """

    client_tensors = (ClientTensors(SUMS, shapes=_PROTOS_SHAPE), ClientTensors(COUNTS, shapes=_CLASSES_SHAPE))
    server_tensors = (ServerTensors(PROTOS, shapes=_PROTOS_SHAPE), ServerTensors(HAS, shapes=_CLASSES_SHAPE))

    def __init__(self, lamda: float = 1.0, own_classes: bool = False, scoring: str = "prototypes"):
        super().__init__("fedproto", (), "FedProto: local models + a pull to global class prototypes.")
        self.lamda = check_real("lamda", lamda, 0.0, owner="FedProto")
        check_choice("scoring", scoring, ("prototypes", "head"), owner="FedProto")
        if not isinstance(own_classes, bool):
            raise ValueError(f"FedProto's own_classes must be True or False, got {own_classes!r}.")
        self.scoring, self.own_classes = scoring, own_classes
        self._forward = ProtoForward(own_classes=own_classes)
        self._split: FeatureSplit | None = None
        self._module: nn.Module | None = None
        self._loss: Callable[[Tensor, Tensor], Tensor] | None = None
        self._shape = (0, 0)

    @property
    def needs_split(self) -> bool:
        """Always: prototypes are means of the head's input."""
        return True

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a module FedProto cannot run (see the class docstring); keep its feature split."""
        self._shape = classes_and_dim(
            {n: tuple(module.get_parameter(n).shape) for n in split.head}, "FedProto"
        )
        self._loss = required_loss(module, "FedProto", "h(rep)")
        self._split = require_feature_split(module, split.head, datamodule, "FedProto")
        self._forward.head = self._split.head_module or ""
        self._module = module

    def evaluation(self) -> EvaluationSpec:
        """The nearest global prototype (``ProtoForward``), or the client's model (``scoring="head"``)."""
        return EvaluationSpec(forward=self._forward) if self.scoring == "prototypes" else EvaluationSpec()

    def objective(self, phase: str) -> Objective:
        """The FedProto step rule, in every phase."""
        return Objective(step=StepRule(self._step, "FedProto prototype step"))

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The round's prototype sums and counts restart at 0."""
        state = start.client_state
        return StartOutcome(client_state={n: torch.zeros_like(state[n]) for n in (SUMS, COUNTS)})

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """Every client's local prototypes and held classes (no model tensor is shared)."""
        if self._module is None:
            raise RuntimeError("FedProto.aggregator() needs setup() to have run.")
        device = next(self._module.parameters()).device  # nothing is shared: like may be empty
        classes, dim = self._shape
        template = {
            UP_PROTOS: torch.zeros(classes, dim, device=device),
            UP_HAS: torch.zeros(classes, device=device),
        }
        return Stacked({**like, **template})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads the local prototypes (the class means of the round's features) and which classes it holds."""
        sums, counts = end.client_state[SUMS], end.client_state[COUNTS]
        protos = sums / counts.clamp_min(1.0)[:, None]
        return ClientOutcome(
            upload={**end.shared(), UP_PROTOS: protos, UP_HAS: (counts > 0).to(protos.dtype)}
        )

    def aggregate(
        self, server: ServerState, results: RoundResults, failures: Sequence[ClientFault]
    ) -> tuple[ServerState, dict[str, float]]:
        """The new global prototypes: per class, the plain mean over the round's clients holding it."""
        rows = results.aggregator.stacked()
        protos, has = global_prototypes(rows[UP_PROTOS], rows[UP_HAS])
        old = server.tensors
        new = {PROTOS: protos.to(old[PROTOS].dtype), HAS: has.to(old[HAS].dtype)}
        return server.replace(tensors=new), {}

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        split, per_sample = self._split, self._loss
        if split is None or per_sample is None:
            raise RuntimeError("FedProto's step needs setup() to have run.")
        tensors, lamda, classes = dict(view.tensors), self.lamda, self._shape[0]

        def objective(trained: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
            full = {**tensors, **trained}
            rep = split.features(full, x)
            value = masked_mean(per_sample(split.head(full, rep), y), view.mask)
            rows = one_hot(y, classes, None, rep.dtype)
            pull = prototype_pull(rep, rows, view.server[PROTOS], view.server[HAS], view.mask)
            return value + lamda * pull, rep.detach()

        grads, (value, rep) = torch.func.grad_and_value(objective, has_aux=True)(dict(view.trained))
        rows = one_hot(y, classes, view.mask, rep.dtype)
        state = view.client_state
        sums = state[SUMS] + (rows.T @ rep).to(state[SUMS].dtype)
        return StepOutcome(
            grads, value, {SUMS: sums, COUNTS: state[COUNTS] + rows.sum(0).to(state[COUNTS].dtype)}
        )

    def __repr__(self) -> str:
        return f"FedProto(lamda={self.lamda}, own_classes={self.own_classes}, scoring={self.scoring!r})"


register_algorithm(FedProto())
