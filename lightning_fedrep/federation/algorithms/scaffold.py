"""SCAFFOLD (Karimireddy et al., ICML 2020), the official FedRep repository's variant (``--alg scaf``).

Every client trains the whole (shared) model with its gradient corrected by the control variates and then
clipped to norm ``clip`` (per client, after the correction, as the official ``clip_grad_norm_(.., 10)``)::

    g <- g + c - c_i,        g <- g * min(1, clip / (||g|| + 1e-6))

After its ``K`` local steps with learning rate ``lr`` a client updates its control variate and uploads its
model and the change of ``c_i``; the server takes the unweighted mean over the ``m`` clients that trained::

    c_i+ = c_i - c + (w_glob - w_i) / (K lr)
    w_glob <- w_glob + lr_g / m * sum_i (w_i - w_glob),    c <- c + sum_i (c_i+ - c_i) / n   (n: all clients)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import ClientUpdate, WeightedMean
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome
from lightning_fedrep.federation.api.objective import GradTransform, Objective, StepView
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["Scaffold"]


class _Unweighted(WeightedMean):
    """The plain mean of the uploads (every client weighs 1, whatever the strategy's weighting)."""

    def add(self, update: ClientUpdate) -> None:
        super().add(replace(update, weight=1.0))


class Scaffold(Algorithm):
    """SCAFFOLD with control variates ``c_i`` (per client) and ``c`` (server), both shaped like the shared model.

    Args:
        lr_g: the server's learning rate (the official code's ``--lr_g``, whose default is 0.1 in its
            ``utils/options.py``).
        clip: the per-client gradient-norm bound applied after the correction (the official 10).

    The clients' learning rate ``lr`` is their optimizer's (first param group). The correction and clip are a
    gradient transform that runs on both runners (in lockstep, per client inside the ``vmap``: each client's
    gradient is clipped by its own norm).
    """

    client_tensors = (ClientTensors("c_i", like="shared"),)
    server_tensors = (ServerTensors("c", like="shared"),)

    def __init__(self, lr_g: float = 0.1, clip: float = 10.0):
        super().__init__(
            "scaffold",
            {"body", "head"},
            "SCAFFOLD: gradients corrected by control variates (c - c_i) and clipped; server lr lr_g.",
        )
        self.lr_g = check_real("lr_g", lr_g, 0.0, owner="Scaffold")
        self.clip = check_real("clip", clip, 0.0, owner="Scaffold")

    def objective(self, phase: str) -> Objective:
        """The control-variate correction followed by the per-client clip, in every phase."""
        clip = self.clip

        def correct(grads: Mapping[str, Tensor], view: StepView) -> dict[str, Tensor]:
            out = {
                n: g + view.server[f"c.{n}"] - view.client_state[f"c_i.{n}"] if f"c.{n}" in view.server else g
                for n, g in grads.items()
            }
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in out.values()]))
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            return {n: g * scale for n, g in out.items()}

        return Objective(grad_transforms=(GradTransform(correct, "SCAFFOLD correction + clip"),))

    def aggregator(self, like: Mapping[str, Tensor]) -> WeightedMean:
        """The unweighted mean of the uploaded models and of the control-variate changes ``dc.<name>``."""
        return _Unweighted({**like, **{f"dc.{n}": t for n, t in like.items()}})

    def finish_client(self, end) -> ClientOutcome:
        """``c_i+ = c_i - c + (w_glob - w_i) / (K lr)``; uploads ``w_i`` and ``dc = c_i+ - c_i``."""
        if not end.lr or not end.steps:
            return ClientOutcome(
                upload={**end.shared(), **{f"dc.{n}": 0 * end.end[n] for n in end.shared_names}}
            )
        new, change = {}, {}
        for n in end.shared_names:
            c_i = end.client_state[f"c_i.{n}"]
            new[f"c_i.{n}"] = c_i - end.server[f"c.{n}"] + (end.start[n] - end.end[n]) / (end.steps * end.lr)
            change[f"dc.{n}"] = new[f"c_i.{n}"] - c_i
        return ClientOutcome(upload={**end.shared(), **change}, client_state=new)

    def aggregate(self, server, results, failures):
        """``w += lr_g (mean_i w_i - w)``, ``c += m mean_i dc_i / n``."""
        m, n = results.weight, server.num_clients
        shared = {k: w + self.lr_g * (results.reduced[k] - w) for k, w in server.shared.items()}
        control = {
            f"c.{k}": server.tensors[f"c.{k}"] + results.reduced[f"dc.{k}"] * (m / n) for k in server.shared
        }
        return server.replace(shared=shared, tensors=control), {}

    def __repr__(self) -> str:
        return f"Scaffold(lr_g={self.lr_g}, clip={self.clip})"


register_algorithm(Scaffold())
