"""FedCAC (Wu et al., "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through
Cautiously Aggressive Collaboration", ICCV 2023).

What was followed: the authors' code in Fling (github.com/kxzxvbk/Fling, ``fedcac_client.py``, ``fedcac_group.py``,
``flzoo/cifar10/cifar10_fedcac_resnet_config.py``); PFLlib's ``clientcac.py``/``servercac.py`` (by the same first
author) differ where noted. Every client trains the whole model with the module's loss. After its local epochs, per
tensor, with ``theta_old`` the model it started from and ``theta_new`` its end model::

    c = |(theta_new - theta_old) * theta_new|,   thresh = the int(tau * numel)-th largest c
    (if thresh <= 1e-10: the smallest c > 1e-20),  critical = (c >= thresh)

The server takes the sample-weighted mean of the models (the global model). Over the round's clients it computes
``overlap(i, j) = 1 - sum|m_i - m_j| / (2 sum m_i)`` of their flattened critical masks, the threshold
``T = mean + (t + 1) / beta * (max - mean)`` over the off-diagonal pairs (``t``: the round), and client ``i``'s
customized model: the *uniform* mean of its model and of every ``j`` with ``overlap(i, j) >= T``. Then every client's
model becomes ``critical_i * customized_i + (1 - critical_i) * global`` (a client not in the round keeps its earlier
mask and customized model).

How it maps here: the per-client slot ``"personal"`` holds that model (what the client trains from next, what
evaluation scores), ``"critical"`` its mask, ``"id"`` its index (plus one: 0 for a client that never trained, written
at its start, so the server step's ``client_map`` can tell the clients apart). The uploads are kept (``Stacked``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, ClientUpdate, Stacked
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_bool, check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import (
    ClientEnd,
    ClientOutcome,
    ClientStart,
    RoundResults,
    ServerState,
    StartOutcome,
)
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedCAC", "critical_mask"]

PERSONAL, CRITICAL, ID, INIT = "personal", "critical", "id", "init"


def critical_mask(old: Tensor, new: Tensor, tau: float) -> Tensor:
    """The authors' critical mask of one tensor (1 critical, 0 not), in ``new``'s dtype: ``c = |(new - old) * new|``
    at least its ``int(tau * numel)``-th largest value (or the smallest value above 1e-20 when that is <= 1e-10)."""
    if not new.is_floating_point():
        return torch.zeros_like(new)
    c = ((new - old) * new).abs().reshape(-1)
    count = int(tau * c.numel())
    if count == 0:
        return torch.zeros_like(new)
    thresh = torch.topk(c, count).values[-1]
    if thresh <= 1e-10:
        nonzero = c[c > 1e-20]
        if nonzero.numel():
            thresh = nonzero.min()
    return (c >= thresh).to(new.dtype).reshape(new.shape)


class FedCAC(Algorithm):
    """FedCAC: per-element critical masks; critical parameters averaged among clients with overlapping masks, the
    others taken from the global model.

    Args:
        tau: ``tau``, the fraction of each tensor's elements marked critical, in ``[0, 1]`` (Fling's CIFAR-10
            config: 0.5; CIFAR-100: 0.4). PFLlib's ``-tau`` default 1.0 marks everything critical, so nothing is
            ever taken from the global model.
        beta: ``beta >= 1``, how fast collaboration narrows: the overlap threshold reaches the maximum overlap
            (no more collaboration) at round ``beta - 1`` (Fling's CIFAR-10 config: 100; CIFAR-100: 170). PFLlib's
            ``-bt`` default 0.0 fails its own ``beta >= 1`` assertion.
        customize_first_round: ``True`` (Fling, the authors'): the first aggregation already customizes.
            ``False`` is PFLlib's (since ``700541e``): at round 0 the customized models are the initial model, so
            the critical parameters restart from the initial random weights.

    **Shares** the whole model; declared per client: ``"personal"`` (like the model), ``"critical"`` (like the shared
    tensors), ``"id"``; with ``customize_first_round=False`` the server keeps the initial model (``"init"``).
    Customization runs over the round's clients: with every client in every round (Fling's and the paper's setting)
    that is Fling's all-clients rule; PFLlib also uses the selected clients only. Floating buffers are masked like
    parameters (the authors mask parameters only and keep every buffer local). The local mask travels with the
    model, so ``ClientLevelDP`` refuses FedCAC. A server optimizer (``with_server_optimizer``) steps the global
    model, but the non-critical part written to the clients is the weighted mean. Runners: both.

    ``Trainer(strategy="fedcac")`` uses ``FedCAC()``.
    """

    def __init__(self, tau: float = 0.5, beta: float = 100.0, customize_first_round: bool = True):
        super().__init__(
            "fedcac",
            {"body", "head"},
            "FedCAC: critical parameters averaged among clients with overlapping critical masks.",
        )
        self.tau = check_real("tau", tau, 0.0, 1.0, owner="FedCAC")
        self.beta = check_real("beta", beta, 1.0, owner="FedCAC")
        self.customize_first_round = check_bool(
            "customize_first_round", customize_first_round, owner="FedCAC"
        )
        self.client_tensors = (
            ClientTensors(PERSONAL, like="model", init="module"),
            ClientTensors(CRITICAL, like="shared"),
            ClientTensors(ID, shapes=()),
        )
        self.server_tensors = (
            () if customize_first_round else (ServerTensors(INIT, like="model", init="module"),)
        )
        self.evaluation_slot = PERSONAL

    def start_client(self, start: ClientStart) -> StartOutcome:
        """The client trains from its model (``"personal"``), and records its index."""
        personal = {n: start.client_state[f"{PERSONAL}.{n}"] for n in start.shared_names}
        index = torch.full_like(start.client_state[ID], start.client + 1)
        return StartOutcome(start=personal, client_state={ID: index})

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads the end model and its critical masks (kept too); the slot keeps the client's local tensors."""
        masks = {
            f"{CRITICAL}.{n}": critical_mask(end.start[n], end.end[n], self.tau) for n in end.shared_names
        }
        local = {f"{PERSONAL}.{n}": t for n, t in end.end.items() if n not in end.shared_names}
        return ClientOutcome(upload={**end.shared(), **masks}, client_state={**masks, **local})

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """Every client's model and masks, kept (``Stacked``)."""
        return Stacked({**like, **{f"{CRITICAL}.{n}": t for n, t in like.items()}})

    def aggregate(
        self, server: ServerState, results: RoundResults, failures: Sequence[ClientFault]
    ) -> tuple[ServerState, dict[str, float]]:
        """The weighted mean as the global model; each client's customized model; every client's model re-mixed."""
        updates, names = results.updates, list(server.shared)
        total = sum(u.weight for u in updates)
        mean = {
            n: (sum(u.weight * u.upload[n].double() for u in updates) / total).to(server.shared[n].dtype)
            for n in names
        }
        if not self.customize_first_round and results.plan.round == 0:
            customized = {u.client: {n: server.tensors[f"{INIT}.{n}"] for n in names} for u in updates}
            sizes = [1.0] * len(updates)
        else:
            customized, sizes = self._customize(updates, names, results.plan.round)

        def remix(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
            own = customized.get(int(state[ID]) - 1)
            out = {}
            for n in names:
                mask, old = state[f"{CRITICAL}.{n}"], state[f"{PERSONAL}.{n}"]
                critical = old if own is None else own[n].to(old)  # mask * old == mask * its customized model
                out[f"{PERSONAL}.{n}"] = mask * critical + (1 - mask) * mean[n].to(old)
            return out

        metrics = {"fedcac/collaborators": sum(sizes) / len(sizes)}
        return server.replace(shared=mean, client_map=remix), metrics

    def _customize(
        self, updates: list[ClientUpdate], names: list[str], round_index: int
    ) -> tuple[dict[int, dict[str, Tensor]], list[float]]:
        """Each client's customized model (the uniform mean over it and its collaborators) and group sizes."""
        masks = torch.stack(
            [torch.cat([u.upload[f"{CRITICAL}.{n}"].double().reshape(-1) for n in names]) for u in updates]
        )
        k = len(updates)
        if k < 2:
            return {u.client: {n: u.upload[n] for n in names} for u in updates}, [1.0] * k
        differ = (masks[:, None, :] - masks[None, :, :]).abs().sum(-1)
        critical = masks.sum(1, keepdim=True)
        overlap = torch.where(
            critical > 0, 1 - differ / (2 * critical.clamp_min(1)), torch.zeros_like(differ)
        )
        off = ~torch.eye(k, dtype=torch.bool)
        pairs = overlap[off]
        average, top = pairs.mean(), pairs.max()
        threshold = average + (round_index + 1) / self.beta * (top - average)
        together = (overlap >= threshold) & off | ~off
        customized = {}
        for i, u in enumerate(updates):
            group = [updates[j] for j in range(k) if together[i, j]]
            customized[u.client] = {
                n: (sum(v.upload[n].double() for v in group) / len(group)).to(u.upload[n].dtype)
                for n in names
            }
        return customized, together.sum(1).double().tolist()

    def __repr__(self) -> str:
        return f"FedCAC(tau={self.tau}, beta={self.beta}, customize_first_round={self.customize_first_round})"


register_algorithm(FedCAC())
