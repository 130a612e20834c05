"""FedAS (Yang et al., "FedAS: Bridging Inconsistency in Personalized Federated Learning", CVPR 2024): the base
(body) is shared, the head personal; a client aligns the global base to its own features before training, and the
server weights each client by the Fisher information of its trained model.

What was followed: PFLlib's ``clientas.py``/``serveras.py`` (written by FedAS's first author; the official
repository is not public), with its ``copy.deepcopy`` of the global model at each send. When a client starts a
round (``start_client``, with ``ClientStart.data``):

1. **Prototypes**: the per-class mean ``p_c`` of its *own* base's features ``phi_l(x)`` (its base after its last
   training; the module's initial one until then) over its training samples, in a shuffled pass of batches of 16
   whose last partial batch is dropped.
2. **Alignment**: on a copy of the global base ``phi_g``, plain SGD (lr 0.01) for one epoch over another such
   pass, per batch on ``sum_c MSE(phi_g(x_c), p_c)`` over the classes ``c`` of the batch that have a prototype
   (each MSE the mean over ``n_c x d`` entries). The aligned base becomes the client's starting base; its head is
   its own.

Then it trains body and head ``local_epochs`` with the module's own loss and optimizer, and after training
(``finish_client``, with ``ClientEnd.data``) computes the trace of its Fisher information, ``F = sum over the
training batches (the round's batch size, shuffled, last partial batch dropped) of sum_theta ||d NLL_batch-mean /
d theta||^2`` over every trained tensor, in evaluation mode. The server averages the uploaded bases weighted by
``w_i = F_i / sum_j F_j`` (not by samples). Evaluation scores each client's own model: its base after its last
training with its head (the reference's model before the next alignment).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_fedrep.federation.api.aggregation import (
    Aggregator,
    ClientUpdate,
    WeightedAverage,
    WeightedMean,
)
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_int, check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientEnd, ClientOutcome, ClientStart, StartOutcome
from lightning_fedrep.federation.api.objective import PureLoss, pure_loss
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec
from lightning_fedrep.federation.module.feature_split import (
    FeatureSplit,
    require_feature_split,
)

__all__ = ["FedAS", "FisherMean"]

OWN, FISHER = "own", "fedas.fisher"
Features = Callable[[dict[str, Tensor], Tensor], Tensor]


class FisherMean(WeightedMean):
    """The uploads' mean weighted by each client's Fisher trace (its upload ``"fedas.fisher"``), not by its
    samples: ``w_i = F_i / sum_j F_j``. A client whose trace is 0 adds nothing (with every trace 0 the round
    aggregates nothing and the global base stays as it was)."""

    def add(self, update: ClientUpdate) -> None:  # type: ignore[override]
        """Add one surviving client's upload, weighted by its Fisher trace."""
        weight = float(update.upload[FISHER])
        if weight > 0:
            WeightedAverage.add(self, [update.upload[n] for n in self.names], weight)


def _own_model(glob: Mapping[str, Tensor], own: Mapping[str, Tensor], client: int) -> Mapping[str, Tensor]:
    """The scored model: the client's own base (the slot) with its head (the local part, from ``glob``)."""
    return own


class FedAS(Algorithm):
    """FedAS: the body is averaged with Fisher-trace weights; each client aligns the global body to its own
    class prototypes before training; the head stays on the client.

    Args:
        alignment_lr: the alignment's SGD learning rate (the reference's hard-coded 0.01; FL-bench's
            ``alignment_lr``).
        alignment_epochs: passes of the alignment (1; 0 starts from the global base unaligned).
        alignment_batch_size: the batch size of the prototype and alignment passes (16).

    **Shares** the body; the head is each client's. Declared per client: ``"own"`` (``like="shared"``, the
    client's base after its last training, the module's initial base until then): the prototypes' base and the
    scored one. The uploads carry ``"fedas.fisher"`` (the client's Fisher trace), which ``FisherMean``
    weights by. Needs the module as ``head(features(x))`` (declared ``forward_features``/``forward_head``, or a
    ``forward`` returning its head submodule applied last; refused at ``setup`` otherwise) and class labels;
    the Fisher trace takes the cross-entropy of the module's output (the reference's NLL of its log-softmax).

    Deviations: only the round's clients compute ``F`` (the reference has every client compute it every round,
    but reads only the uploaders' latest, computed after their training this round: the weights are the same).
    The prototype and alignment passes run in evaluation mode (the reference's model is in evaluation mode from
    its round 1 on, after its Fisher pass; in round 0 in training mode): the same without dropout or BatchNorm.
    An alignment batch with no class that has a prototype is skipped (the reference fails on it: a class whose
    every sample fell in the prototype pass's dropped batch). The shuffles are drawn from
    ``ClientStart.data``/``ClientEnd.data``'s seeded generators (keys ``"fedas.prototypes"``,
    ``"fedas.alignment.<epoch>"``, ``"fedas.fisher"``). Runners: both (the hooks run outside the lockstep
    runner's ``vmap``).

    ``Trainer(strategy="fedas")`` (and ``"fedas_ddp"``) uses ``FedAS()``.
    """

    client_tensors = (ClientTensors(OWN, like="shared", init="module"),)

    def __init__(self, alignment_lr: float = 0.01, alignment_epochs: int = 1, alignment_batch_size: int = 16):
        super().__init__(
            "fedas",
            {"body"},
            "FedAS: the body aligned to each client's prototypes at its start, averaged with Fisher-trace weights; "
            "the head stays on the client.",
        )
        self.alignment_lr = check_real("alignment_lr", alignment_lr, 0.0, owner="FedAS")
        self.alignment_epochs = check_int("alignment_epochs", alignment_epochs, 0, owner="FedAS")
        self.alignment_batch_size = check_int("alignment_batch_size", alignment_batch_size, 1, owner="FedAS")
        self._module: nn.Module | None = None
        self._split: FeatureSplit | None = None
        self._trained: tuple[str, ...] = ()
        self._nll: PureLoss | None = None

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """``local_epochs`` of body and head (after the alignment)."""
        return (Phase("all", epochs=local_epochs),)

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Keep the module, its trained tensors' names and its feature split (refused without one)."""
        found = require_feature_split(
            module, tuple(split.head), datamodule, "FedAS (it aligns the body's features)"
        )
        self._module, self._split = module, found
        self._trained = tuple(n for n, p in module.named_parameters() if p.requires_grad)
        self._nll = pure_loss(module, lambda z, y: F.cross_entropy(z, y, reduction="none"))

    def evaluation(self) -> EvaluationSpec:
        """Each client's own model: its base after its last training (the ``"own"`` slot) with its head."""
        return EvaluationSpec("mixture", slot=OWN, mix=_own_model)

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The parameter alignment: the global base aligned to the prototypes of the client's own base."""
        module, split, data = self._ready(start.data)
        own = {n: start.client_state[f"{OWN}.{n}"] for n in start.shared_names}
        size, names = self.alignment_batch_size, [n for n in self._trained if n in start.shared_names]
        with evaluating(module):
            order = torch.randperm(data.num_samples, generator=data.generator("fedas.prototypes"))
            prototypes = class_prototypes(
                split.features, {**start.start, **own}, data.batches(order, size, True)
            )
            aligned = dict(start.start)
            for epoch in range(self.alignment_epochs):
                order = torch.randperm(data.num_samples, generator=data.generator(f"fedas.alignment.{epoch}"))
                batches = data.batches(order, size, True)
                aligned = align(split.features, aligned, names, prototypes, batches, self.alignment_lr)
        return StartOutcome(start={n: aligned[n] for n in names})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Upload the base and the Fisher trace of the trained model; keep the base as the client's own."""
        module, _, data = self._ready(end.data)
        order = torch.randperm(data.num_samples, generator=data.generator("fedas.fisher"))
        names = [n for n in self._trained if n in end.end]
        with evaluating(module):
            trace = fisher_trace(self._nll, end.end, names, data.batches(order, None, True))
        device = next(iter(end.end.values())).device
        return ClientOutcome(
            upload={**end.shared(), FISHER: torch.tensor(trace, dtype=torch.float64, device=device)},
            client_state={f"{OWN}.{n}": end.end[n] for n in end.shared_names},
            metrics={"fedas/fisher_trace": trace},
        )

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """The uploads' mean weighted by the clients' Fisher traces (``FisherMean``)."""
        device = next(iter(like.values())).device
        return FisherMean({**like, FISHER: torch.zeros((), dtype=torch.float64, device=device)})

    def _ready(self, data: Any) -> tuple[nn.Module, FeatureSplit, Any]:
        if self._module is None or self._split is None:
            raise RuntimeError("FedAS's client hooks need FedAS.setup() to have run.")
        if data is None:
            raise RuntimeError(
                "FedAS reads the client's training samples in its hooks: train with the strategy."
            )
        return self._module, self._split, data

    def __repr__(self) -> str:
        return (
            f"FedAS(alignment_lr={self.alignment_lr}, alignment_epochs={self.alignment_epochs}, "
            f"alignment_batch_size={self.alignment_batch_size})"
        )


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode for the block; every submodule's mode restored after it."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@torch.no_grad()
def class_prototypes(
    features: Features, tensors: Mapping[str, Tensor], batches: Iterable[Any]
) -> dict[int, Tensor]:
    """The mean feature ``features(tensors, x)`` of each class over ``batches`` of ``(x, y)``, by label."""
    sums: dict[int, Tensor] = {}
    counts: dict[int, int] = {}
    for x, y in batches:
        rep = features(dict(tensors), x)
        for label in y.unique().tolist():
            rows = rep[y == label]
            sums[label] = sums[label] + rows.sum(0) if label in sums else rows.sum(0)
            counts[label] = counts.get(label, 0) + len(rows)
    return {label: total / counts[label] for label, total in sums.items()}


def align(
    features: Features,
    tensors: Mapping[str, Tensor],
    names: list[str],
    prototypes: Mapping[int, Tensor],
    batches: Iterable[Any],
    lr: float,
) -> dict[str, Tensor]:
    """One SGD pass over ``batches`` moving ``names`` of ``tensors`` on ``sum_c MSE(features(x_c), p_c)``."""
    current = {n: t.detach() for n, t in tensors.items()}
    for x, y in batches:
        labels = [c for c in y.unique().tolist() if c in prototypes]
        if not labels:
            continue
        moved = {n: current[n].clone().requires_grad_(True) for n in names}
        with torch.enable_grad():
            rep = features({**current, **moved}, x)
            loss = sum(F.mse_loss(rep[y == c], prototypes[c].expand_as(rep[y == c])) for c in labels)
            grads = torch.autograd.grad(loss, list(moved.values()), allow_unused=True)
        for (n, t), g in zip(moved.items(), grads):
            current[n] = t.detach() if g is None else t.detach() - lr * g
    return current


def fisher_trace(nll: Any, tensors: Mapping[str, Tensor], names: list[str], batches: Iterable[Any]) -> float:
    """``sum over batches of sum_n ||d nll(tensors, x, y) / d tensors[n]||^2`` (``nll``: the batch-mean NLL)."""
    total = 0.0
    for x, y in batches:
        moved = {n: tensors[n].detach().clone().requires_grad_(True) for n in names}
        with torch.enable_grad():
            value = nll({**tensors, **moved}, x, y)
            grads = torch.autograd.grad(value, list(moved.values()), allow_unused=True)
        total += sum(float(g.double().square().sum()) for g in grads if g is not None)
    return total


register_algorithm(FedAS())
