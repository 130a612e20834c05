"""FedPAC (Xu et al., "Personalized Federated Learning with Feature Alignment and Classifier Collaboration", ICLR
2023): a shared feature extractor aligned to global class prototypes, and per-client heads combined by a QP.

What was followed: PFLlib's ``clientpac.py``/``serverpac.py`` with the intended semantics (below). With ``rep =
phi(x)`` (the module's body output, the head's input), ``h`` its head, a client of the round:

* at its start, with the new global body: ``pi_k`` the share of class ``k`` in its samples, ``mu_k`` their mean
  feature, ``H_i[k] = pi_k mu_k`` and ``V_i = sum_k [pi_k tr(F_k^T F_k) / n_k - pi_k^2 ||mu_k||^2] / n_i``;
* trains its head alone for exactly one epoch (cross-entropy), then its body for ``local_epochs`` with
  ``CE(h(rep), y) + lamda * MSE(rep, T)`` (``T``'s row the global prototype of the label, or ``rep.detach()``);
* uploads its body, head, ``V_i``, ``H_i`` and its local prototypes (class means of the trained body's features,
  evaluation mode).

The server averages the bodies (sample-weighted), takes each class's global prototype as the plain mean over the
clients holding it, and gives each client ``i`` of the round the head ``sum_j alpha_j head_j`` over the round's
uploads, with ``alpha = argmin alpha^T (diag(V) + D_i) alpha`` over the simplex, ``D_i[j, k] = sum_c (H_i[c] -
H_j[c]) . (H_i[c] - H_k[c])`` (the matrix repaired to its eigenvalues >= 0.01 when not positive semi-definite;
weights below 1e-3 zeroed, then renormalized as the official code does; ``renormalize=False``: PFLlib's). A client
whose QP fails keeps its own head. Evaluation scores the global body with the client's combined head.

PFLlib bugs not reproduced (the intended semantics are keyed by client id on snapshots of the heads): its V and H
are in the selected clients' order but the heads in the reshuffled upload order (weights on the wrong heads); its
uploaded heads are the live client heads, overwritten one client at a time while later clients combine them; its
fallback indexes the uploads by client id instead of position. Also: statistics and prototypes read every sample
(``drop_last=True``: PFLlib's shuffled loader without its last partial batch); the official code's class-count
weighted prototypes are ``prototype_weighting="counts"``; its use of the client's own previous prototype as the
target of a class without a global one is not offered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.algorithms._fedpac_qp import head_weights, require_scipy
from lightning_fedrep.federation.algorithms._prototypes import (
    classes_and_dim,
    global_prototypes,
    one_hot,
    prototype_pull,
    prototype_shapes,
)
from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, Stacked
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_choice, check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import (
    ClientEnd,
    ClientOutcome,
    ClientSamples,
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
from lightning_fedrep.federation.module.feature_split import FeatureSplit, require_feature_split

__all__ = ["FedPAC", "head_weights"]

HEAD, CLIENT, V, H, PROTOS, HAS = "pac_head", "pac_client", "pac_v", "pac_h", "prototypes", "has_prototype"
UP_V, UP_H, UP_PROTOS, UP_COUNTS = "fedpac.v", "fedpac.h", "fedpac.prototypes", "fedpac.counts"


def _minus_one(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    return torch.full_like(template, -1.0)


_PROTOS_SHAPE, _CLASSES_SHAPE = prototype_shapes("FedPAC")


class FedPAC(Algorithm):
    """FedPAC: a shared body aligned to global class prototypes; per-client heads combined by a QP.

    Args:
        lamda: the prototype term's weight (PFLlib's ``-lam`` and the official default: 1.0).
        renormalize: renormalize the head weights after zeroing those below 1e-3 (the official code; PFLlib
            does not).
        prototype_weighting: ``"uniform"`` (PFLlib: the plain mean over the clients holding a class) or
            ``"counts"`` (the official: weighted by their class counts).
        drop_last: read the statistics' and prototypes' samples as PFLlib's training loader (a shuffled pass in
            batches of the round's size, the last partial one dropped) instead of every sample.

    **Shares** the body. Phases: ``Phase("head", epochs=1)``, then ``Phase("body", epochs=local_epochs)`` (the
    prototype term as a step rule). Declared tensors: per client ``"pac_head.*"`` (its combined head, starting
    as the module's), ``"pac_client"`` (its index, -1 before it trains), ``"pac_v"`` and ``"pac_h"`` (``[C,
    d]``, its statistics); server ``"prototypes"`` and ``"has_prototype"``. Needs scipy (the QP), the module's
    ``fedrep_loss``, the module as ``head(features(x))`` and a one-linear-layer head (refused at ``setup``).
    Runners: both. ``Trainer(strategy="fedpac")`` uses ``FedPAC()``.
    """

    client_tensors = (
        ClientTensors(HEAD, like="head", init="module"),
        ClientTensors(CLIENT, shapes=(), init=_minus_one),
        ClientTensors(V, shapes=()),
        ClientTensors(H, shapes=_PROTOS_SHAPE),
    )
    server_tensors = (ServerTensors(PROTOS, shapes=_PROTOS_SHAPE), ServerTensors(HAS, shapes=_CLASSES_SHAPE))

    def __init__(
        self,
        lamda: float = 1.0,
        renormalize: bool = True,
        prototype_weighting: str = "uniform",
        drop_last: bool = False,
    ):
        super().__init__("fedpac", {"body"}, "FedPAC: prototype-aligned shared body + QP-combined heads.")
        self.lamda = check_real("lamda", lamda, 0.0, owner="FedPAC")
        check_choice("prototype_weighting", prototype_weighting, ("uniform", "counts"), owner="FedPAC")
        for name, flag in (("renormalize", renormalize), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise ValueError(f"FedPAC's {name} must be True or False, got {flag!r}.")
        self.renormalize, self.prototype_weighting, self.drop_last = (
            renormalize,
            prototype_weighting,
            drop_last,
        )
        self._split: FeatureSplit | None = None
        self._module: nn.Module | None = None
        self._loss: Any = None
        self._head: tuple[str, ...] = ()
        self._shape = (0, 0)

    @property
    def needs_split(self) -> bool:
        """Always: the body is shared, prototypes are means of the head's input."""
        return True

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """The head for exactly one epoch, then the body for ``local_epochs``."""
        return (Phase("head", epochs=1), Phase("body", epochs=local_epochs))

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a module (or an environment) FedPAC cannot run; keep the module and its feature split."""
        require_scipy()
        self._head = tuple(split.head)
        self._shape = classes_and_dim({n: tuple(module.get_parameter(n).shape) for n in self._head}, "FedPAC")
        self._loss = required_loss(module, "FedPAC", "h(rep)")
        self._split = require_feature_split(module, self._head, datamodule, "FedPAC")
        self._module = module

    def evaluation(self) -> EvaluationSpec:
        """The global body with the client's combined head."""
        return EvaluationSpec("mixture", slot=HEAD, mix=lambda global_, head, client: dict(head))

    def objective(self, phase: str) -> Objective:
        """Cross-entropy in the head phase; the prototype step rule in the others."""
        if phase == "head":
            return Objective()
        return Objective(step=StepRule(self._step, "FedPAC prototype-alignment step"))

    @torch.no_grad()
    def _class_sums(self, tensors: Mapping[str, Tensor], data: ClientSamples, key: str) -> tuple[Tensor, ...]:
        """Per class: sample counts ``[C]``, feature sums ``[C, d]`` and sums of squared norms ``[C]``."""
        if self._split is None or self._module is None:
            raise RuntimeError("FedPAC needs setup() to have run.")
        positions = (
            torch.randperm(data.num_samples, generator=data.generator(key)) if self.drop_last else None
        )
        counts = sums = squares = None
        for x, y in data.batches(positions, drop_last=self.drop_last):
            rep = self._split.features(dict(tensors), x).to(torch.float64)
            rows = one_hot(y, self._shape[0], None, rep.dtype)
            parts = (rows.sum(0), rows.T @ rep, rows.T @ rep.square().sum(1))
            counts, sums, squares = (
                parts if counts is None else (a + b for a, b in zip((counts, sums, squares), parts))
            )
        if counts is None:
            zeros = torch.zeros(self._shape, dtype=torch.float64, device=next(iter(tensors.values())).device)
            return zeros[:, 0], zeros, zeros[:, 0]
        return counts, sums, squares

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The combined head as the starting head; ``V_i``, ``H_i`` on the new global body."""
        if start.data is None:
            raise RuntimeError("FedPAC's statistics need the client's training samples (ClientStart.data).")
        state = start.client_state
        counts, sums, squares = self._class_sums(start.start, start.data, "statistics")
        pi, held = counts / counts.sum().clamp_min(1.0), counts.clamp_min(1.0)
        mu = sums / held[:, None]
        v = (pi * squares / held - pi.square() * mu.square().sum(1)).sum() / start.num_samples
        head = {n: state[f"{HEAD}.{n}"] for n in self._head}
        return StartOutcome(
            start=head,
            client_state={
                CLIENT: torch.full_like(state[CLIENT], float(start.client)),
                V: v.to(state[V]),
                H: (pi[:, None] * mu).to(state[H]),
            },
        )

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """Every client's body, head, statistics and local prototypes (the body's mean is the new body)."""
        device = next(iter(like.values())).device
        if self._module is None:
            raise RuntimeError("FedPAC.aggregator() needs setup() to have run.")
        named = dict(self._module.named_parameters())
        extra = {f"{HEAD}.{n}": torch.zeros_like(named[n], device=device) for n in self._head}
        shapes = {UP_V: (), UP_H: self._shape, UP_PROTOS: self._shape, UP_COUNTS: self._shape[:1]}
        extra.update({name: torch.zeros(shape, device=device) for name, shape in shapes.items()})
        return Stacked({**like, **extra})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads the body, the trained head, ``V_i``, ``H_i`` and the local prototypes (evaluation mode)."""
        if end.data is None or self._module is None:
            raise RuntimeError("FedPAC's prototypes need the client's training samples (ClientEnd.data).")
        modes = {m: m.training for m in self._module.modules()}
        self._module.eval()
        try:
            counts, sums, _ = self._class_sums(end.end, end.data, "prototypes")
        finally:
            for m, training in modes.items():
                m.training = training
        state, dtype = end.client_state, end.client_state[H].dtype
        upload = {**end.shared(), **{f"{HEAD}.{n}": end.end[n] for n in self._head}}
        upload.update({UP_V: state[V], UP_H: state[H], UP_COUNTS: counts.to(dtype)})
        upload[UP_PROTOS] = (sums / counts.clamp_min(1.0)[:, None]).to(dtype)
        return ClientOutcome(upload=upload)

    def aggregate(
        self, server: ServerState, results: RoundResults, failures: Sequence[ClientFault]
    ) -> tuple[ServerState, dict[str, float]]:
        """The bodies' weighted mean, the global prototypes and each uploading client's combined head."""
        stacked, clients = results.aggregator.stacked(), [u.client for u in results.aggregator.updates]
        counts = stacked[UP_COUNTS].to(torch.float64)
        weights = counts if self.prototype_weighting == "counts" else (counts > 0).to(torch.float64)
        protos, has = global_prototypes(stacked[UP_PROTOS], weights)
        heads, solved = {}, 0
        for i, client in enumerate(clients):
            alpha = head_weights(stacked[UP_V].cpu(), stacked[UP_H].cpu(), i, self.renormalize)
            solved += alpha is not None
            heads[client] = {
                n: stacked[f"{HEAD}.{n}"][i]
                if alpha is None
                else torch.einsum("k,k...->...", alpha.to(stacked[f"{HEAD}.{n}"]), stacked[f"{HEAD}.{n}"])
                for n in self._head
            }

        def combined(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
            new = heads.get(int(state[CLIENT]), {})
            return {f"{HEAD}.{n}": t.to(state[f"{HEAD}.{n}"]) for n, t in new.items()}

        old = server.tensors
        tensors = {PROTOS: protos.to(old[PROTOS]), HAS: has.to(old[HAS])}
        shared = {n: results.reduced[n] for n in server.shared}
        return server.replace(shared=shared, tensors=tensors, client_map=combined), {
            "fedpac/solved": solved / max(len(clients), 1)
        }

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        split, per_sample = self._split, self._loss
        if split is None:
            raise RuntimeError("FedPAC's step needs setup() to have run.")
        tensors, lamda, classes = dict(view.tensors), self.lamda, self._shape[0]

        def objective(trained: Mapping[str, Tensor]) -> Tensor:
            full = {**tensors, **trained}
            rep = split.features(full, x)
            value = masked_mean(per_sample(split.head(full, rep), y), view.mask)
            rows = one_hot(y, classes, None, rep.dtype)
            return value + lamda * prototype_pull(rep, rows, view.server[PROTOS], view.server[HAS], view.mask)

        grads, value = torch.func.grad_and_value(objective)(dict(view.trained))
        return StepOutcome(grads, value)

    def __repr__(self) -> str:
        return (
            f"FedPAC(lamda={self.lamda}, renormalize={self.renormalize}, "
            f"prototype_weighting={self.prototype_weighting!r}, drop_last={self.drop_last})"
        )


register_algorithm(FedPAC())
