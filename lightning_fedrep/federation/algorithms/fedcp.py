"""FedCP (Zhang et al., "FedCP: Separating Feature Information for Personalized Federated Learning via
Conditional Policy", KDD 2023): a conditional policy network (CPN) splits each sample's features between a
personalized head and a global head.

What was followed: FLUTE does not release its FedCP; this is the authors' repository
(github.com/TsingZ0/FedCP, ``system/flcore/clients/clientcp.py``, ``servers/servercp.py``; the same code is
PFLlib's ``clientcp.py``/``servercp.py``). Each client holds the shared feature extractor ``phi`` (the module's
body), its personalized head ``h_p`` (the module's head, kept per client), the round's global head ``h_g``
(frozen locally), the CPN (``Linear(d, 2d) -> LayerNorm(2d) -> ReLU``, read as ``[B, 2, d]``) and a frozen
copy ``phi_g`` of the round-start global extractor. Per local step on the batch ``(x, y)``, one plain SGD
step (the same ``lr``) on ``phi``, ``h_p`` and the CPN of::

    rep = phi(x);  c = context_i / ||context_i||;  (pm, gm) = gumbel_softmax(CPN(rep * c), dim=1, tau=1)
    loss = CE(h_p(rep * pm) + h_g(rep * gm), y) + lamda * MMD_rbf(rep, phi_g(x))   (bandwidths 10, 15, 20, 50)

After its steps the client uploads ``phi``, its CPN and ``0.5 h_p + 0.5 h_g``; the server takes the
sample-weighted means of the three (the new ``phi``, CPN and ``h_g``). A client's context is the rows' sum of
its personalized head's weight (the product of the head's weight matrices, last to first, when it has
several layers) after its last training.

Deviations from the official code (also in the README's FedCP paragraph):

1. With partial participation the official server sends ``h_g`` and the CPN only to the round's clients, at
   the round's end, so a client starts a later round with those of its last participation. Here (as the
   paper's Algorithm 1) every client starts its round, and is evaluated, with the current global ones.
2. The official code samples the Gumbel noise at test time too; evaluation here uses the noise-free softmax
   gate (deterministic scores). Training noise is a counter-based hash of (a server key drawn from the
   strategy's seed, round, client, local step, row, unit), so both runners and every process draw the same.
3. The official initial context is ``torch.rand``; here a client that never trained uses the rows' sum of
   the module's initial head (what it would be after a training that leaves the head unchanged). The CPN
   starts at ``nn.Linear``'s/``nn.LayerNorm``'s default initialization, drawn from the strategy's seed.
4. The CPN takes plain SGD steps at the client's learning rate; ``phi`` and ``h_p`` take the module
   optimizer's step (the official plain ``SGD(lr)`` when the module's optimizer is that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_fedrep.federation.api.aggregation import WeightedMean
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import ClientEnd, ClientOutcome
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
    find_feature_split_on_data,
    head_input,
    head_owner,
)

__all__ = ["FedCP", "fedcp_forward", "gumbel_noise"]

CPN, HEAD_G, KEY = "cpn", "hg", "noise_key"
CLIENT_CPN, CONTEXT = "cpn_i", "context"
CPN_KEYS = ("linear.weight", "linear.bias", "norm.weight", "norm.bias")
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
_MASK = 0xFFFFFFFF


def _features_dim(head: Mapping[str, tuple[int, ...]]) -> int:
    """``d``: the input size of the head's first linear layer (its first 2-D tensor)."""
    for shape in head.values():
        if len(shape) == 2:
            return int(shape[1])
    raise ValueError(
        "FedCP needs the module's head to be linear layers (a [C, d] weight): pass head= naming them."
    )


def _cpn_shapes(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    d = _features_dim(groups["head"])
    return {
        "linear.weight": (2 * d, d),
        "linear.bias": (2 * d,),
        "norm.weight": (2 * d,),
        "norm.bias": (2 * d,),
    }


def _context_shape(groups: Mapping[str, Mapping[str, tuple[int, ...]]]) -> tuple[int, ...]:
    return (_features_dim(groups["head"]),)


def _init_cpn(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    """``nn.Linear``'s default (``U(-1/sqrt(d), 1/sqrt(d))`` for weight and bias) and ``nn.LayerNorm``'s
    (ones, zeros), drawn from ``generator``."""
    key = name.split(".", 1)[1]
    if key == "norm.weight":
        return torch.ones_like(template)
    if key == "norm.bias":
        return torch.zeros_like(template)
    d = template.shape[1] if key == "linear.weight" else template.shape[0] // 2
    uniform = torch.rand(template.shape, generator=generator, dtype=torch.float64)
    return ((2 * uniform - 1) / math.sqrt(d)).to(template.dtype)


def _init_key(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    """The training noise's key, drawn from the strategy's seed."""
    return torch.randint(0, 2**31 - 1, (), generator=generator, dtype=torch.int64)


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash (int64 tensors holding values in ``[0, 2**32)``; products stay below 2**63)."""
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK
    return h ^ (h >> 16)


def gumbel_noise(key: Tensor, round: int, client: Tensor, step: int, rows: int, d: int) -> Tensor:
    """Standard Gumbel noise ``[rows, 2, d]`` (float32), a pure function of (``key``, ``round``, ``client``,
    ``step``, row, unit): the hash of the six integers gives a 24-bit uniform ``u`` in ``(0, 1)``, and the noise
    is ``-log(-log u)``. Tensor ops only (runs inside ``vmap``)."""
    h = _mix(key.to(torch.int64) & _MASK)
    for part in (torch.as_tensor(round), client.to(torch.int64), torch.as_tensor(step)):
        h = _mix(h ^ _mix((part.to(h.device) + 0x9E3779B9) & _MASK))
    index = torch.arange(rows * 2 * d, device=h.device, dtype=torch.int64).reshape(rows, 2, d)
    h = _mix(h ^ _mix((index + 0x7F4A7C15) & _MASK))
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


def _gate(
    cpn: Mapping[str, Tensor], gate_in: Tensor, noise: Tensor | None, tau: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(pm, gm)``: the CPN's Gumbel softmax ``softmax((z + g) / tau)`` over its two channels (``noise=None``:
    the plain softmax ``softmax(z / tau)``)."""
    z = F.linear(gate_in, cpn["linear.weight"], cpn["linear.bias"])
    z = F.relu(F.layer_norm(z, z.shape[-1:], cpn["norm.weight"], cpn["norm.bias"]))
    z = z.reshape(z.shape[0], 2, -1)
    y = torch.softmax((z if noise is None else z + noise.to(z.dtype)) / tau, dim=1)
    return y[:, 0], y[:, 1]


def _context(weights: Sequence[Tensor]) -> Tensor:
    """The rows' sum of the product of the head's weight matrices (last to first): ``[d]``."""
    product = weights[-1]
    for w in reversed(weights[:-1]):
        product = product @ w
    return product.sum(0)


def _mmd(x: Tensor, y: Tensor, mask: Tensor | None) -> Tensor:
    """The official RBF maximum mean discrepancy (the mean over row pairs; only real rows with ``mask``)."""

    def distances(a: Tensor, b: Tensor) -> Tensor:
        return (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T

    dxx, dyy, dxy = distances(x, x), distances(y, y), distances(x, y)
    total = sum(
        torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2.0 * torch.exp(-0.5 * dxy / a)
        for a in BANDWIDTHS
    )
    if mask is None:
        return total.mean()
    pairs = mask[:, None] * mask[None, :]
    return (total * pairs).sum() / pairs.sum().clamp_min(1.0)


class _Method(nn.Module):
    """Calls one method of ``inner`` (``forward_features`` / ``forward_head``) as its ``forward``, so
    ``torch.func.functional_call`` can run it on given tensors (names prefixed ``"inner."``)."""

    def __init__(self, inner: nn.Module, method: str):
        super().__init__()
        self.inner = inner
        self.method = method

    def forward(self, *args: Any) -> Any:
        return getattr(self.inner, self.method)(*args)


def _call(module: nn.Module, method: str, tensors: Mapping[str, Tensor], *args: Any) -> Tensor:
    adapter = _Method(module, method)
    return torch.func.functional_call(adapter, {f"inner.{n}": t for n, t in tensors.items()}, args)


def _prefixed(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {n[len(prefix) + 1 :]: t for n, t in tensors.items() if n.startswith(f"{prefix}.")}


def fedcp_forward(
    module: nn.Module,
    client_state: Mapping[str, Tensor],
    server: Mapping[str, Tensor],
    x: Any,
    *args: Any,
    **kwargs: Any,
) -> Tensor:
    """FedCP's scored prediction (``EvaluationSpec.forward``): ``h_p(rep * pm) + h_g(rep * gm)`` with the
    noise-free gate, ``module`` holding the global extractor and the client's personalized head, ``server``
    the global CPN and head; the context is the rows' sum of the client's head weight. ``rep`` and the heads
    are the module's declared ``forward_features``/``forward_head``, else (a ``forward`` that is
    ``head(body(x))``, verified at set-up) the head submodule's input and the head submodule."""
    head_g = _prefixed(server, HEAD_G)
    weights = [module.get_parameter(n) for n, t in head_g.items() if t.dim() == 2]
    if declares_split(module):
        rep = module.forward_features(x)
        pm, gm = _gate(_prefixed(server, CPN), rep * F.normalize(_context(weights)[None], p=2, dim=1), None)
        return module.forward_head(rep * pm) + _call(module, "forward_head", head_g, rep * gm)
    owner = head_owner(tuple(head_g))
    head = module.get_submodule(owner)
    rep = head_input(module, owner, x)
    pm, gm = _gate(_prefixed(server, CPN), rep * F.normalize(_context(weights)[None], p=2, dim=1), None)
    own = {n.removeprefix(f"{owner}."): t for n, t in head_g.items()}
    return head(rep * pm) + torch.func.functional_call(head, own, (rep * gm,))


def _find_split(module: nn.Module, head: Sequence[str], datamodule: Any) -> FeatureSplit:
    """The module as ``head(features(x))`` (declared, or its head submodule called last), verified on a few
    training inputs as the vectorized runner verifies it; refuses a module that is neither."""
    split = find_feature_split_on_data(module, tuple(head), datamodule)
    if split is not None:
        return split
    name = type(module).__name__
    found = (
        "its forward_head(forward_features(x)) is not its forward(x), or forward_features reads the head"
        if declares_split(module)
        else f"it declares no forward_features/forward_head, and its forward is not its head "
        f"{head_owner(tuple(head)) or list(head)!r} applied last to the body's output"
    )
    raise ValueError(
        f"FedCP needs the module as head(features(x)), but on a client's first training samples {found}. Define "
        f"forward_features(x) (the body's output) and forward_head(features) on {name}, with forward(x) == "
        "forward_head(forward_features(x)), or make forward return head(body(x))."
    )


def _check_module(module: nn.Module, head: Sequence[str]) -> list[str]:
    """The head's weight names (layer order); refuses a head whose parameters are not all ``nn.Linear`` weights
    and biases."""
    weights = []
    for name in head:
        owner, _, kind = name.rpartition(".")
        layer = module.get_submodule(owner) if owner else module
        if not isinstance(layer, nn.Linear) or kind not in ("weight", "bias"):
            raise ValueError(
                f"FedCP needs the module's head to be nn.Linear layers (the context is the product of their "
                f"weights), got head parameter {name!r} of a {type(layer).__name__}: pass head= naming the final "
                "nn.Linear layer(s)."
            )
        if kind == "weight":
            weights.append(name)
    return weights


class FedCP(Algorithm):
    """FedCP: a FedAvg feature extractor, a personalized head per client, a global head and a conditional
    policy network mixing them per sample and feature.

    Args:
        lamda: the weight of the MMD regularizer between the local and the round-start global extractor's
            features (the official ``--lamda``: 5 in the authors' only run script, ``system/run_me.sh``; 0 is
            its ``main.py`` default, which drops the term).
        tau: the Gumbel softmax's temperature (the official 1).

    **Shares** the body (``phi``); the module's head is the client's personalized head ``h_p``. Declared
    tensors: server ``"cpn.*"`` (the CPN: ``linear.weight [2d, d]``, ``linear.bias``, ``norm.weight``,
    ``norm.bias [2d]``), ``"hg.*"`` (the global head, starting as the module's head) and ``"noise_key"``;
    per client ``"cpn_i.*"`` (its CPN during the round, taken from the server at its first step) and
    ``"context"`` (``[d]``). Evaluation scores ``fedcp_forward``. Needs the module's ``fedrep_loss``, the
    module as ``head(features(x))`` (declared ``forward_features``/``forward_head``, or a ``forward`` that returns
    its head submodule applied last to the body's output, found and verified on a client's first training samples
    as the vectorized runner finds it) and a head of ``nn.Linear`` layers (refused at ``setup``) and one ``Phase("all")`` per federated round (refused when the round is planned: a client
    takes the global CPN at its first step of the round). Runners: both (the step rule runs per client inside
    the lockstep runner's ``vmap``; the Gumbel noise is a hash of counters, not ``torch.rand``).

    ``Trainer(strategy="fedcp")`` uses ``FedCP()``.
    """

    client_tensors = (
        ClientTensors(CLIENT_CPN, shapes=_cpn_shapes),
        ClientTensors(CONTEXT, shapes=_context_shape),
    )
    server_tensors = (
        ServerTensors(CPN, shapes=_cpn_shapes, init=_init_cpn),
        ServerTensors(HEAD_G, like="head", init="module"),
        ServerTensors(KEY, shapes=(), init=_init_key, dtype=torch.int64),
    )

    def __init__(self, lamda: float = 5.0, tau: float = 1.0):
        super().__init__(
            "fedcp",
            {"body"},
            "FedCP: a conditional policy network splits features between a personalized and a global head.",
        )
        self.lamda = check_real("lamda", lamda, 0.0, owner="FedCP")
        self.tau = check_real("tau", tau, 0.0, owner="FedCP")
        if self.tau == 0:
            raise ValueError("FedCP(tau=0) is not a temperature: give tau > 0 (the official 1).")
        self._module: nn.Module | None = None
        self._split: FeatureSplit | None = None
        self._weights: list[str] = []
        self._head: tuple[str, ...] = ()
        self._loss: Callable[[Tensor, Tensor], Tensor] | None = None

    @property
    def needs_split(self) -> bool:
        """Always: the body is shared, the head is the personalized one."""
        return True

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a module FedCP cannot run (see the class docstring); keep it, and its feature split, to run its
        parts functionally."""
        self._weights = _check_module(module, split.head)
        self._head = tuple(split.head)
        self._loss = required_loss(module, "FedCP", "the two heads' summed logits")
        self._split = _find_split(module, split.head, datamodule)
        self._module = module

    def configure_round(self, plan: Any, server: Any) -> Any:
        """The plan unchanged; refuses a federated round whose local work is not one ``Phase("all")`` (the
        CPN is taken from the server at a client's first step of the round, and trains with the model)."""
        phases = plan.phases
        if plan.spec.aggregate and (
            len(phases) != 1 or phases[0].train != "all" or phases[0].slot != "model"
        ):
            raise ValueError(
                f"FedCP trains the extractor, the personalized head and the policy network together in one "
                f"phase per round, got phases={list(phases)}: use local_epochs= (one Phase('all', epochs=...))."
            )
        return plan

    def evaluation(self) -> EvaluationSpec:
        """The personal model (global extractor, the client's head) predicting with ``fedcp_forward``."""
        return EvaluationSpec(forward=fedcp_forward)

    def objective(self, phase: str) -> Objective:
        """The FedCP step rule, in every phase."""
        return Objective(step=StepRule(self._step, "FedCP conditional-policy step"))

    def aggregator(self, like: Mapping[str, Tensor]) -> WeightedMean:
        """The weighted mean of the extractor, the CPNs (``cpn.*``) and the uploaded heads (``hg.*``)."""
        if self._module is None:
            raise RuntimeError("FedCP.aggregator() needs setup() to have run.")
        named = dict(self._module.named_parameters())
        device = next(iter(like.values())).device
        d = named[self._weights[0]].shape[1]
        extra = {
            f"{CPN}.{k}": torch.zeros(s, device=device)
            for k, s in _cpn_shapes({"head": {"w": (1, d)}}).items()
        }
        extra.update({f"{HEAD_G}.{n}": torch.zeros_like(named[n], device=device) for n in self._head})
        return WeightedMean({**like, **extra})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads ``phi``, the client's CPN and ``0.5 h_p + 0.5 h_g``."""
        state, server = end.client_state, end.server
        source, prefix = (state, CLIENT_CPN) if end.steps else (server, CPN)
        upload = dict(end.shared())
        upload.update({f"{CPN}.{k}": source[f"{prefix}.{k}"] for k in CPN_KEYS})
        upload.update({f"{HEAD_G}.{n}": 0.5 * end.end[n] + 0.5 * server[f"{HEAD_G}.{n}"] for n in self._head})
        return ClientOutcome(upload=upload)

    def aggregate(self, server, results, failures):  # noqa: ANN001, ANN201 (Algorithm.aggregate's signature)
        """The new extractor, CPN and global head: the uploads' weighted means."""
        shared = {k: results.reduced[k] for k in server.shared}
        tensors = {n: results.reduced[n] for n in server.tensors if n in results.reduced}
        return server.replace(shared=shared, tensors=tensors), {}

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        split = self._split
        if split is None:
            raise RuntimeError("FedCP's step needs setup() to have run.")
        tensors = dict(view.tensors)
        if view.step == 0:  # the round's first step: the global CPN, the context of the round-start head
            cpn = {k: view.server[f"{CPN}.{k}"] for k in CPN_KEYS}
            context = _context([tensors[n] for n in self._weights])
        else:
            cpn = {k: view.client_state[f"{CLIENT_CPN}.{k}"] for k in CPN_KEYS}
            context = view.client_state[CONTEXT]
        head_g = {n: view.server[f"{HEAD_G}.{n}"] for n in self._head}
        c = F.normalize(context.detach()[None], p=2, dim=1)
        rows, d = x.shape[0], context.shape[0]
        noise = gumbel_noise(view.server[KEY], view.round, view.client, view.step, rows, d)
        lamda, tau, per_sample = self.lamda, self.tau, self._loss
        base = None
        if lamda:
            base = split.features({**tensors, **_server_body(view)}, x).detach()

        def objective(trained: Mapping[str, Tensor], policy: Mapping[str, Tensor]) -> Tensor:
            full = {**tensors, **trained}
            rep = split.features(full, x)
            pm, gm = _gate(policy, rep * c, noise, tau)
            out = split.head(full, rep * pm) + split.head({**full, **head_g}, rep * gm)
            value = masked_mean(per_sample(out, y), view.mask)
            return value + lamda * _mmd(rep, base, view.mask) if base is not None else value

        (grads, policy_grads), value = torch.func.grad_and_value(objective, argnums=(0, 1))(
            dict(view.trained), cpn
        )
        lr = 0.0 if view.lr is None else view.lr
        state = {f"{CLIENT_CPN}.{k}": cpn[k] - lr * policy_grads[k] for k in CPN_KEYS}
        state[CONTEXT] = context.detach()
        return StepOutcome(grads, value, state)

    def __repr__(self) -> str:
        return f"FedCP(lamda={self.lamda}, tau={self.tau})"


def _server_body(view: StepView) -> dict[str, Tensor]:
    """The round-start global extractor (``phi_g``): the server's shared tensors among the view's."""
    return {n: t for n, t in view.server.items() if n in view.tensors}


register_algorithm(FedCP())
