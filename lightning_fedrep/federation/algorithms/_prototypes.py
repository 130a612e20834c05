"""Class prototypes: per-class means of the features ``rep = phi(x)`` (the head's input) that prototype methods
exchange (FedProto, FedPAC): their shapes read from the head, the one-hot rows that sum features per class, the
pull of each feature to its label's global prototype, and the server's mean of the clients' prototypes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_fedrep.federation.api.objective import masked_mean

__all__ = ["classes_and_dim", "global_prototypes", "one_hot", "prototype_pull", "prototype_shapes"]

Shapes = Mapping[str, Mapping[str, tuple[int, ...]]]


def classes_and_dim(head: Mapping[str, tuple[int, ...]], owner: str) -> tuple[int, int]:
    """``(C, d)``: the shape of the head's first 2-D tensor (a linear layer's ``[C, d]`` weight)."""
    for shape in head.values():
        if len(shape) == 2:
            return int(shape[0]), int(shape[1])
    raise ValueError(
        f"{owner} reads the number of classes C and the feature size d from the head's [C, d] weight, so the "
        "head must be one linear layer: pass head= naming it."
    )


def prototype_shapes(
    owner: str,
) -> tuple[Callable[[Shapes], tuple[int, ...]], Callable[[Shapes], tuple[int, ...]]]:
    """The declared tensors' shapes ``[C, d]`` (prototypes, per-class sums) and ``[C]`` (per-class counts or
    flags), read from the head (``ClientTensors``/``ServerTensors`` ``shapes=``)."""

    def per_class_feature(groups: Shapes) -> tuple[int, ...]:
        return classes_and_dim(groups["head"], owner)

    def per_class(groups: Shapes) -> tuple[int, ...]:
        return classes_and_dim(groups["head"], owner)[:1]

    return per_class_feature, per_class


def one_hot(y: Tensor, classes: int, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``[B, C]`` one-hot rows of ``y`` (zero rows for padding under ``mask``); tensor ops only (``vmap``)."""
    rows = (y.reshape(-1, 1) == torch.arange(classes, device=y.device)).to(dtype)
    return rows if mask is None else rows * mask.reshape(-1, 1).to(dtype)


def prototype_pull(rep: Tensor, rows: Tensor, prototypes: Tensor, has: Tensor, mask: Tensor | None) -> Tensor:
    """``MSE(rep, T)``: each row's squared distance to its label's global prototype (``T``'s row; ``rep.detach()``,
    no pull, for a class without one: ``has`` 0), averaged over ``d`` and then over the batch's samples under
    ``mask`` (``rows``: the labels' one-hot rows; ``prototypes``: ``[C, d]``; ``has``: ``[C]``)."""
    held = (rows @ has.to(rep.dtype))[:, None]
    target = held * (rows @ prototypes.to(rep.dtype)) + (1 - held) * rep.detach()
    return masked_mean((rep - target).square().mean(1), mask)


def global_prototypes(prototypes: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``(P, has)`` from the clients' local prototypes ``[k, C, d]`` and weights ``[k, C]`` (1 where a client holds
    the class: the plain mean; its class counts: the count-weighted mean; 0 where it does not): per class the
    weighted mean over the clients holding it (float64 sums; zeros where none does), and 1 where one does."""
    weights = weights.to(torch.float64)
    total = weights.sum(0)
    sums = (weights[..., None] * prototypes.to(torch.float64)).sum(0)
    return sums / total.clamp_min(1.0)[:, None], (total > 0).to(torch.float64)
