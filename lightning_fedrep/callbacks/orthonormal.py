"""``OrthonormalBody``: the QR step of FedRep's and SRPFL's linear algorithms after every aggregation."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_fedrep.federation import RoundResult
from lightning_fedrep.lightning.callback import FederatedCallback


class OrthonormalBody(FederatedCallback):
    """After every aggregated round, replace a shared matrix by the orthonormal factor of its QR
    decomposition: ``B <- Q`` with ``B = QR`` (FedRep's Algorithm 1 and SRPFL's Algorithm 2, line 14, for the
    linear representation ``B``; the analyses need ``B`` orthonormal, the column space is unchanged).

    Args:
        parameter: the shared tensor's name (``"body.weight"`` of ``LowRankLinear``: an ``nn.Linear(d, k)``
            weight, stored ``k x d``). The orthonormal directions are those of the longer side: a wide
            ``k x d`` weight gets orthonormal rows (``B = W^T`` has orthonormal columns), a tall one columns.

    It runs in ``on_round_end``, so validation, checkpoints and the next round see the orthonormal body. The
    clients' heads are left as they are: they were fitted to the average ``B = QR`` and are evaluated with
    ``Q`` until FedRep's exact head step refits them the next round; with ``R``'s diagonal kept positive
    (no column flips) and ``B`` near orthonormal (``R`` near the identity) that evaluation is close.
    """

    def __init__(self, parameter: str = "body.weight"):
        if not isinstance(parameter, str) or not parameter:
            raise TypeError(f"OrthonormalBody(parameter=...) must be a parameter name, got {parameter!r}.")
        self.parameter = parameter

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a name that is not a 2-D shared parameter, before anything runs."""
        super().setup(trainer, pl_module, stage)
        parameters = dict(pl_module.named_parameters())
        if self.parameter not in parameters or parameters[self.parameter].dim() != 2:
            matrices = [n for n, p in parameters.items() if p.dim() == 2]
            raise ValueError(
                f"OrthonormalBody(parameter={self.parameter!r}) must name a 2-D parameter of "
                f"{type(pl_module).__name__}; its matrices: {matrices}."
            )

    def on_round_end(self, trainer: L.Trainer, pl_module: L.LightningModule, result: RoundResult) -> None:
        if not result.aggregated:
            return
        federation = self.federation(trainer)
        if self.parameter not in federation.shared_names:
            raise ValueError(
                f"OrthonormalBody(parameter={self.parameter!r}) names a per-client tensor; it orthonormalizes "
                f"the shared representation: one of {list(federation.shared_names)}."
            )
        federation.update_global({self.parameter: orthonormal(federation.global_view()[self.parameter])})

    def state_dict(self) -> dict[str, Any]:
        return {"parameter": self.parameter}


def orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """The Q factor of ``matrix``'s QR decomposition along its longer side (same shape and dtype), signed so
    that R's diagonal is positive: each column of Q points the way the matching column of ``matrix`` does."""
    wide = matrix.shape[0] < matrix.shape[1]
    tall = matrix.T if wide else matrix
    q, r = torch.linalg.qr(tall.double())
    signs = torch.sign(torch.diagonal(r))
    q = q * torch.where(signs == 0, torch.ones_like(signs), signs)  # R's diagonal positive: no column flips
    return (q.T if wide else q).to(matrix.dtype)
