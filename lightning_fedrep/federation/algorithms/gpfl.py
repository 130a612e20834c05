"""GPFL (Zhang et al., "GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized
Federated Learning", ICCV 2023): a shared feature extractor ``phi`` whose features a conditional valve (CoV) turns
into a personalized and a generic feature, the generic one pulled to a global category embedding (GCE).

What was followed: the authors' repository (github.com/TsingZ0/GPFL, ``system/flcore/clients/clientgp.py``,
``servers/servergp.py``; PFLlib's ``clientgpfl.py``/``servergpfl.py`` are the same rule). With ``f = phi(x)`` (the
module's body output, the head's input), ``h`` the module's head, ``E`` the GCE (``[C, d]``, ``nn.Embedding``'s
``N(0, 1)`` start), ``CoV(f, c) = relu(f * (1 + gamma(c)) + beta(c))`` (``gamma``, ``beta``: ``Linear(d, d) -> ReLU
-> LayerNorm(d)``), the client's conditional inputs ``g = mean_c K[c]`` and ``p_i = sum_c pi_i[c] K[c]`` (``pi_i``
its training label distribution, ``K`` the GCE it holds when the server last sent one, see below), per local step on
``(x, y)``::

    f_P = CoV(f, p_i);  f_G = CoV(f, g)
    loss = CE(h(f_P), y) + mean_rows(-log softmax_c(cos(f_G, E[c]))[y]) + lamda * ||f_G - E_round[y]||_F

(``E_round``: the round's global GCE, frozen; the norm over the whole batch, not squared nor averaged). The module's
optimizer steps ``phi`` and ``h``; plain SGD at the client's learning rate with weight decay ``mu`` steps the
client's GCE and CoV. The server takes the sample-weighted means of ``phi``, the GCEs and the CoVs; the head is the
client's own. After each round every client's ``K`` becomes the GCE it held before receiving the new global one:
its trained GCE if it trained this round, else the previous global GCE (``K = 0`` before the first aggregation, so
``g = p_i = 0`` in the first round). Evaluation scores ``h(CoV(phi(x), p_i))`` with the global CoV.

Deviations: ``pi_i`` counts all the client's training samples (the authors' loader drops the last partial batch).
A client that never trained holds the client store's shared template, so it has no ``pi_i`` yet: it is scored with
the uniform prior (``p = g``); from its first training on, its own ``pi_i`` is used (with full participation,
PFLlib's setting, every client trains in the first round).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

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
    module_features,
    module_head,
    require_feature_split,
)

__all__ = ["GPFL", "GPFLForward", "conditional_valve"]

GCE, COV, GCE_I, COV_I = "gce", "cov", "gce_i", "cov_i"
SOURCE, PRIOR, FRESH = "conditional_source", "prior", "fresh"
BRANCHES = ("gamma", "beta")
COV_KEYS = tuple(f"{b}.{k}" for b in BRANCHES for k in ("weight", "bias", "norm.weight", "norm.bias"))


def _sizes(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> tuple[int, int]:
    """``(C, d)``: the head's first linear layer's input size and its last one's output size."""
    matrices = [s for s in groups["head"].values() if len(s) == 2]
    if not matrices:
        raise ValueError(
            "GPFL conditions the head's [batch, d] input and embeds its C classes, so the head must be linear "
            "layers (a [C, d] weight): pass head= naming them."
        )
    return int(matrices[-1][0]), int(matrices[0][1])


def _prior_shape(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> tuple[int, ...]:
    return (_sizes(groups)[0],)


def _cov_shapes(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    d = _sizes(groups)[1]
    return {k: (d, d) if k.endswith(".weight") and "norm" not in k else (d,) for k in COV_KEYS}


def _init_gce(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    """``nn.Embedding``'s default start, ``N(0, 1)``, drawn from ``generator``."""
    return torch.randn(template.shape, generator=generator, dtype=torch.float64).to(template.dtype)


def _init_cov(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    """``nn.Linear``'s default (``U(-1/sqrt(d), 1/sqrt(d))``, weight and bias) and ``nn.LayerNorm``'s (ones, zeros)."""
    if name.endswith("norm.weight"):
        return torch.ones_like(template)
    if name.endswith("norm.bias"):
        return torch.zeros_like(template)
    uniform = torch.rand(template.shape, generator=generator, dtype=torch.float64)
    return ((2 * uniform - 1) / math.sqrt(template.shape[-1])).to(template.dtype)


def conditional_valve(cov: Mapping[str, Tensor], features: Tensor, condition: Tensor) -> Tensor:
    """``CoV(f, c) = relu(f * (1 + gamma(c)) + beta(c))``, each branch ``Linear -> ReLU -> LayerNorm`` (``cov``: the
    branches' tensors by ``"<gamma|beta>.<weight|bias|norm.weight|norm.bias>"``)."""

    def branch(name: str) -> Tensor:
        z = F.relu(F.linear(condition, cov[f"{name}.weight"], cov[f"{name}.bias"]))
        return F.layer_norm(z, z.shape[-1:], cov[f"{name}.norm.weight"], cov[f"{name}.norm.bias"])

    return F.relu(features * (1 + branch("gamma")) + branch("beta"))


def _personal_input(client_state: Mapping[str, Tensor]) -> Tensor:
    """``p_i = sum_c pi_i[c] K[c]``; a client without a prior yet (the template) takes the uniform one (``p = g``)."""
    prior, source = client_state[PRIOR], client_state[SOURCE]
    uniform = torch.full_like(prior, 1.0 / prior.shape[0])
    return torch.where(prior.sum() > 0, prior, uniform).to(source.dtype) @ source


@dataclass
class GPFLForward:
    """GPFL's scored prediction (``EvaluationSpec.forward``): ``h(CoV(phi(x), p_i))`` with the global CoV, the
    module's declared ``forward_features``/``forward_head``, else the head submodule ``head`` (set at set-up)."""

    head: str = ""

    def __call__(
        self, module: nn.Module, client_state: Mapping[str, Tensor], server: Mapping[str, Tensor], x: Tensor
    ) -> Tensor:
        cov = {k: server[f"{COV}.{k}"] for k in COV_KEYS}
        rep = module_features(module, self.head, x, "GPFL's prediction")
        valved = conditional_valve(cov, rep, _personal_input(client_state).to(rep.dtype))
        return module_head(module, self.head, valved)


class GPFL(Algorithm):
    """GPFL: a FedAvg feature extractor, global category embedding and conditional valve; a personal head.

    Args:
        lamda: ``lamda``, the weight of the generic feature's distance to its class's round-start global embedding
            (the GPFL README's 0.01 for the 4-layer CNN and MLP; PFLlib's generic ``-lam`` default is 1.0).
        mu: ``mu``, the weight decay of the GCE's and CoV's SGD (the README's 0.1 for the 4-layer CNN and MLP;
            PFLlib's generic ``-mu`` default is 0.0).

    **Shares** the body (``phi``); the head is the client's own. Declared tensors: server ``"gce"`` (``[C, d]``) and
    ``"cov.*"`` (the CoV's two branches); per client ``"gce_i"``/``"cov_i.*"`` (its copies while it trains, taken
    from the server at its start), ``"conditional_source"`` (``K``), ``"prior"`` (``pi_i``, counted from its
    training samples at its first start: ``ClientStart.data``) and ``"fresh"`` (1 between its upload and the
    round's aggregation). Needs the module's ``fedrep_loss``, integer class labels, the module as
    ``head(features(x))`` (declared ``forward_features``/``forward_head``, or a ``forward`` returning its head
    submodule applied last, verified on a client's first training samples) and a head of linear layers (refused at
    ``setup``). Runners: both (the step rule runs per client inside the lockstep runner's ``vmap``).

    ``Trainer(strategy="gpfl")`` uses ``GPFL()``.
    """

    client_tensors = (
        ClientTensors(GCE_I, shapes=_sizes),
        ClientTensors(COV_I, shapes=_cov_shapes),
        ClientTensors(SOURCE, shapes=_sizes),
        ClientTensors(PRIOR, shapes=_prior_shape),
        ClientTensors(FRESH, shapes=()),
    )
    server_tensors = (
        ServerTensors(GCE, shapes=_sizes, init=_init_gce),
        ServerTensors(COV, shapes=_cov_shapes, init=_init_cov),
    )

    def __init__(self, lamda: float = 0.01, mu: float = 0.1):
        super().__init__(
            "gpfl",
            {"body"},
            "GPFL: a conditional valve splits features into personalized and generic ones (global embeddings).",
        )
        self.lamda = check_real("lamda", lamda, 0.0, owner="GPFL")
        self.mu = check_real("mu", mu, 0.0, owner="GPFL")
        self._forward = GPFLForward()
        self._split: FeatureSplit | None = None
        self._loss: Callable[[Tensor, Tensor], Tensor] | None = None
        self._sizes = (0, 0)

    @property
    def needs_split(self) -> bool:
        """Always: the body is shared, the head is the client's own and reads the valved features."""
        return True

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a module GPFL cannot run (see the class docstring); keep its feature split."""
        self._sizes = _sizes({"head": {n: tuple(module.get_parameter(n).shape) for n in split.head}})
        self._loss = required_loss(module, "GPFL", "h(CoV(phi(x), p_i))")
        self._split = require_feature_split(module, split.head, datamodule, "GPFL")
        self._forward.head = self._split.head_module or ""

    def evaluation(self) -> EvaluationSpec:
        """The personal model predicting ``h(CoV(phi(x), p_i))`` (``GPFLForward``)."""
        return EvaluationSpec(forward=self._forward)

    def objective(self, phase: str) -> Objective:
        """The GPFL step rule, in every phase."""
        return Objective(step=StepRule(self._step, "GPFL conditional-valve and embedding step"))

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The client's GCE and CoV start as the global ones; at its first start, its label distribution."""
        state = {GCE_I: start.server[GCE], **{f"{COV_I}.{k}": start.server[f"{COV}.{k}"] for k in COV_KEYS}}
        if not bool(start.client_state[PRIOR].sum() > 0):
            state[PRIOR] = self._prior(start)
        return StartOutcome(client_state=state)

    def _prior(self, start: ClientStart) -> Tensor:
        if start.data is None:
            raise RuntimeError(
                "GPFL counts a client's labels at its start: it needs the strategy's training loader."
            )
        counts = torch.zeros(self._sizes[0], dtype=torch.float64)
        for _, y in start.data.batches():
            y = torch.as_tensor(y).flatten().long().cpu()
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= self._sizes[0]):
                raise ValueError(
                    f"GPFL embeds the head's {self._sizes[0]} classes, but client {start.client} has labels outside "
                    f"0..{self._sizes[0] - 1}: give integer class labels that index the head's outputs."
                )
            counts += torch.bincount(y, minlength=self._sizes[0]).double()
        prior = start.client_state[PRIOR]
        return (counts / counts.sum().clamp_min(1.0)).to(prior.device, prior.dtype)

    def aggregator(self, like: Mapping[str, Tensor]) -> WeightedMean:
        """The weighted mean of the body, the clients' GCEs and their CoVs."""
        device = next(iter(like.values())).device
        (classes, d), extra = self._sizes, {GCE: torch.zeros(self._sizes, device=device)}
        shapes = _cov_shapes({"head": {"w": (classes, d)}})
        extra.update({f"{COV}.{k}": torch.zeros(s, device=device) for k, s in shapes.items()})
        return WeightedMean({**like, **extra})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads ``phi``, the client's GCE and CoV; marks it as trained this round."""
        state = end.client_state
        upload = {
            **end.shared(),
            GCE: state[GCE_I],
            **{f"{COV}.{k}": state[f"{COV_I}.{k}"] for k in COV_KEYS},
        }
        return ClientOutcome(upload=upload, client_state={FRESH: torch.ones_like(state[FRESH])})

    def aggregate(self, server, results, failures):  # noqa: ANN001, ANN201 (Algorithm.aggregate's signature)
        """The new body, GCE and CoV: the uploads' weighted means. Every client's ``K`` becomes the GCE it held
        before the new one arrives: its trained GCE if it trained this round, else the round's global GCE."""
        shared = {n: results.reduced[n] for n in server.shared}
        tensors = {n: results.reduced[n] for n in server.tensors}
        previous = server.tensors[GCE].detach().clone()

        def receive(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
            fresh = state[FRESH] > 0
            source = torch.where(fresh, state[GCE_I], previous.to(state[GCE_I]))
            return {SOURCE: source, FRESH: torch.zeros_like(state[FRESH])}

        return server.replace(shared=shared, tensors=tensors, client_map=receive), {}

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        split, per_sample = self._split, self._loss
        if split is None or per_sample is None:
            raise RuntimeError("GPFL's step needs setup() to have run.")
        tensors, state, mask = dict(view.tensors), view.client_state, view.mask
        source = state[SOURCE].detach()
        generic, personal = source.mean(0), _personal_input(state).detach()
        frozen = view.server[GCE].detach()
        lamda = self.lamda

        def objective(trained: Mapping[str, Tensor], gce: Tensor, cov: Mapping[str, Tensor]) -> Tensor:
            full = {**tensors, **trained}
            rep = split.features(full, x)
            value = masked_mean(
                per_sample(split.head(full, conditional_valve(cov, rep, personal.to(rep.dtype))), y), mask
            )
            feat_g = conditional_valve(cov, rep, generic.to(rep.dtype))
            cosine = F.normalize(feat_g, dim=1) @ F.normalize(gce.to(rep.dtype), dim=1).T
            value = value + masked_mean(F.cross_entropy(cosine, y, reduction="none"), mask)
            gap = feat_g - frozen.to(rep.dtype)[y]
            if mask is not None:
                gap = gap * mask[:, None].to(gap.dtype)
            return value + lamda * torch.linalg.vector_norm(gap.flatten())

        gce = state[GCE_I]
        cov = {k: state[f"{COV_I}.{k}"] for k in COV_KEYS}
        (grads, gce_grad, cov_grads), value = torch.func.grad_and_value(objective, argnums=(0, 1, 2))(
            dict(view.trained), gce, cov
        )
        lr, mu = (0.0 if view.lr is None else view.lr), self.mu
        new = {GCE_I: gce - lr * (gce_grad + mu * gce)}
        new.update({f"{COV_I}.{k}": cov[k] - lr * (cov_grads[k] + mu * cov[k]) for k in COV_KEYS})
        return StepOutcome(grads, value, new)

    def __repr__(self) -> str:
        return f"GPFL(lamda={self.lamda}, mu={self.mu})"


register_algorithm(GPFL())
