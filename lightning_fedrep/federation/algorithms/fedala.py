"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning", AAAI 2023), as
the authors' code runs it (``TsingZ0/FedALA``'s ``utils/ALA.py``, byte-identical to PFLlib's).

The server takes the sample-weighted mean of whole models (FedAvg). When a client starts a round it does not
train from the global model ``g`` alone but from its *adaptive local aggregation* with its own model ``l`` (what
it held after its last training): every tensor but the last ``layer_idx`` (in the module's parameter order)
becomes the global one, and each of the last ``layer_idx`` becomes ``t = l + (g - l) * W`` with element-wise
weights ``W`` in ``[0, 1]`` kept by the client (ones at first). ``W`` is learnt on a sample of its training data:
``rand_percent`` % of its samples as one contiguous slice at a random offset, unshuffled, in batches of the
training batch size; per batch, with ``L`` the module's loss of the model ``(lower: g, higher: t)``::

    W <- clip(W - eta * dL/dt * (g - l), 0, 1);   t <- l + (g - l) * W

The first time it runs for a client, passes over the sample repeat until more than ``num_pre_loss`` losses (one
per pass: its last batch's) were recorded and the population std of the last ``num_pre_loss`` is below
``threshold``; later, one pass. It is skipped (the client starts from ``l``) when the sum of ``g - l`` over the
first tensor is exactly 0 (round 0, where every client holds the initial model). Then the client trains normally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_int, check_optional_int, check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome, ClientStart, StartOutcome
from lightning_fedrep.federation.api.objective import cross_entropy_per_sample, declared_loss, pure_loss
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedALA", "ala_passes"]

KEPT, WEIGHTS, STARTED = "kept", "ala_weights", "ala_started"


def _ones(name: str, template: Tensor, generator: torch.Generator) -> Tensor:
    return torch.ones_like(template)


class FedALA(Algorithm):
    """FedALA: FedAvg whose clients start from an adaptive, learnt blend of their own model with the global one.

    Args:
        eta: the weights' learning rate η (the authors' ``-et``, default 1.0).
        rand_percent: the share of the client's training samples ALA learns on, in percent (``-s``, 80).
        layer_idx: how many of the module's last parameter tensors are blended (``-p``, 2: the last ``nn.Linear``'s
            weight and bias; the others are taken from the global model).
        threshold: the first ALA's stop: the std of the last ``num_pre_loss`` pass losses below it (the code's
            0.1; the authors' README gives 0.01 for the paper's runs).
        num_pre_loss: how many pass losses that std reads (10).
        max_start_passes: a cap on the first ALA's passes (``None``, the reference: until the losses settle).

    State per client (declared, checkpointed, rolled back): ``kept`` (its model after its last training; the
    module's initial values until then), ``ala_weights`` (``W``, ones at first; only the last ``layer_idx``
    tensors' are read) and ``ala_started`` (whether its first effective ALA ran). The sample's offset is drawn
    from ``ClientStart.data.generator("fedala")`` (the reference uses Python's ``random.randint``).

    Deviations: the package starts only the round's clients, so a client ALA-blends at the rounds it trains (the
    reference blends every client at every round, also those not selected; with full participation, the
    reference's setting, the two agree). Evaluation scores each client's ``kept`` model, its model after its
    last training (the reference scores the blend at the next send, before training). The loss is the module's
    ``fedrep_loss`` where declared, else the cross-entropy of its output (the reference's loss).

    Runners: both (the blend runs in ``start_client``, before the client's first step).
    """

    client_tensors = (
        ClientTensors(KEPT, like="model", init="module"),
        ClientTensors(WEIGHTS, like="model", init=_ones),
        ClientTensors(STARTED, shapes=()),
    )
    evaluation_slot = KEPT

    def __init__(
        self,
        eta: float = 1.0,
        rand_percent: int = 80,
        layer_idx: int = 2,
        threshold: float = 0.1,
        num_pre_loss: int = 10,
        max_start_passes: int | None = None,
    ):
        super().__init__(
            "fedala", {"body", "head"}, "FedAvg with adaptive local aggregation of the global model (FedALA)"
        )
        self.eta = check_real("eta", eta, 0.0, owner="FedALA")
        self.rand_percent = check_int("rand_percent", rand_percent, 0, 100, owner="FedALA")
        self.layer_idx = check_int("layer_idx", layer_idx, 1, owner="FedALA")
        self.threshold = check_real("threshold", threshold, 0.0, owner="FedALA")
        self.num_pre_loss = check_int("num_pre_loss", num_pre_loss, 1, owner="FedALA")
        self.max_start_passes = check_optional_int("max_start_passes", max_start_passes, 1, owner="FedALA")
        self._order: tuple[str, ...] = ()
        self._loss: Any = None

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """``local_epochs`` of the whole model (after the blend)."""
        return (Phase("all", epochs=local_epochs),)

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Keep the module's parameter order (which tensors are the last ``layer_idx``) and its loss."""
        self._order = tuple(n for n, p in module.named_parameters() if p.requires_grad)
        if len(self._order) < self.layer_idx:
            raise ValueError(
                f"FedALA(layer_idx={self.layer_idx}) blends the last {self.layer_idx} parameter tensors, but "
                f"{type(module).__name__} trains {len(self._order)}: pass layer_idx <= {len(self._order)}."
            )
        self._loss = pure_loss(module, declared_loss(module) or cross_entropy_per_sample)

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The adaptive local aggregation of the global model into the client's kept model (see the module)."""
        if start.data is None:
            raise RuntimeError(
                "FedALA reads the client's training samples at its start: train with the strategy."
            )
        names = [n for n in self._order if n in start.start]
        kept = {n: start.client_state[f"{KEPT}.{n}"] for n in names}
        glob = {n: start.start[n] for n in names}
        if float((glob[names[0]] - kept[names[0]]).sum()) == 0:  # the reference's round-0 test
            return StartOutcome(start=kept)
        higher = names[-self.layer_idx :]
        weights = {n: start.client_state[f"{WEIGHTS}.{n}"] for n in higher}
        if float(start.client_state[STARTED]) == 0:
            weights = {n: torch.ones_like(w) for n, w in weights.items()}
        n = start.data.num_samples
        size = int(self.rand_percent / 100 * n)
        offset = int(torch.randint(0, n - size + 1, (), generator=start.data.generator("fedala")))
        batches = list(start.data.batches(torch.arange(offset, offset + size)))
        first = float(start.client_state[STARTED]) == 0
        blended, weights = ala_passes(
            self._loss,
            glob,
            {n: kept[n] for n in higher},
            weights,
            batches,
            self.eta,
            self._stop(first),
        )
        state = {f"{WEIGHTS}.{n}": w for n, w in weights.items()}
        state[STARTED] = torch.ones_like(start.client_state[STARTED])
        return StartOutcome(start=blended, client_state=state)

    def _stop(self, first: bool) -> Any:
        """When the passes stop, given the pass losses so far: one pass, or (the first ALA) until they settle."""
        window, threshold, cap = self.num_pre_loss, self.threshold, self.max_start_passes

        def stop(losses: list[float]) -> bool:
            if not first or (cap is not None and len(losses) >= cap):
                return True
            recent = torch.tensor(losses[-window:], dtype=torch.float64)
            return len(losses) > window and float(recent.std(unbiased=False)) < threshold

        return stop

    def finish_client(self, end: Any) -> ClientOutcome:
        """Upload the end model (FedAvg); keep it as the client's model for its next blend and its evaluation."""
        return ClientOutcome(upload=end.shared(), client_state={f"{KEPT}.{n}": end.end[n] for n in end.end})

    def __repr__(self) -> str:
        return (
            f"FedALA(eta={self.eta}, rand_percent={self.rand_percent}, layer_idx={self.layer_idx}, "
            f"threshold={self.threshold}, num_pre_loss={self.num_pre_loss})"
        )


def ala_passes(
    loss: Any,
    glob: Mapping[str, Tensor],
    local: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
    batches: list[Any],
    eta: float,
    stop: Any,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """ALA's weight learning: passes over ``batches`` until ``stop(pass losses)``; returns the blended tensors
    (every name of ``glob``: the global values below, ``t`` for the names of ``local``) and the new weights.
    ``loss(tensors, x, y)`` is the model's mean loss; ``glob`` holds every trained tensor, ``local`` the higher ones."""
    diff = {n: glob[n].detach() - local[n].detach() for n in local}
    weights = {n: w.detach().clone() for n, w in weights.items()}
    blend = {n: local[n].detach() + diff[n] * weights[n] for n in local}
    losses: list[float] = []
    while batches:
        value = None
        for x, y in batches:
            higher = {n: t.clone().requires_grad_(True) for n, t in blend.items()}
            with torch.enable_grad():
                value = loss({**glob, **higher}, x, y)
                grads = torch.autograd.grad(value, list(higher.values()))
            for (n, _), g in zip(higher.items(), grads):
                weights[n] = torch.clamp(weights[n] - eta * (g * diff[n]), 0, 1)
                blend[n] = local[n].detach() + diff[n] * weights[n]
        losses.append(float(value.detach()))
        if stop(losses):
            break
    return {**{n: t.detach() for n, t in glob.items()}, **blend}, weights


register_algorithm(FedALA())
