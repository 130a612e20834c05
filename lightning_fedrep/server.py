"""Server-side aggregation: the sample-weighted average of what clients share."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class WeightedAverage:
    """Running ``sum_i w_i * x_i`` and ``sum_i w_i`` over the clients of a round.

    Sums are kept in float64 on the tensors' device so the mean does not depend on the order in which
    clients arrive beyond float64 rounding; integer tensors (e.g. BatchNorm's ``num_batches_tracked``)
    are averaged and rounded back.
    """

    def __init__(self, like: list[Tensor]):
        self.sums = [torch.zeros_like(t, dtype=torch.float64) for t in like]
        self.weight = 0.0

    def add(self, tensors: list[Tensor], weight: float) -> None:
        """Add one client's tensors with aggregation weight ``weight``."""
        if weight <= 0:
            raise ValueError(f"Aggregation weights must be positive, got {weight}.")
        for total, t in zip(self.sums, tensors):
            total.add_(t.detach().to(torch.float64), alpha=weight)
        self.weight += weight

    @property
    def empty(self) -> bool:
        return self.weight == 0.0

    def mean(self, like: list[Tensor]) -> list[Tensor]:
        """The weighted mean, cast to the dtypes of ``like``."""
        if self.empty:
            raise RuntimeError("No client contributed to this round's average.")
        out = []
        for total, ref in zip(self.sums, like):
            value = total / self.weight
            if not ref.is_floating_point() and not ref.is_complex():
                value = value.round()
            out.append(value.to(ref.dtype))
        return out

    def flat(self) -> Tensor:
        """The sums and the weight in one float64 vector: what one ``all_reduce(SUM)`` adds up when a
        round's clients are sharded over processes."""
        parts = [s.reshape(-1) for s in self.sums]
        weight = torch.tensor([self.weight], dtype=torch.float64, device=parts[0].device if parts else None)
        return torch.cat([*parts, weight])

    def load_flat(self, flat: Tensor) -> None:
        """Take the sums and the weight from :meth:`flat`'s layout (e.g. after the reduction)."""
        offset = 0
        for total in self.sums:
            total.copy_(flat[offset : offset + total.numel()].view_as(total))
            offset += total.numel()
        self.weight = float(flat[offset])

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums, "weight": self.weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = [s.to(t.device) for s, t in zip(state["sums"], self.sums)]
        self.weight = float(state["weight"])
