"""The official FedRep optimiser and weight-decay groups, shared by the reference models (public)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def fedrep_sgd(module: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """SGD with momentum and weight decay on weights only (biases get none), as the official FedRep code.

    Every parameter goes into the optimizer, frozen or not: the strategy freezes the body or the head
    per phase, and frozen parameters get no gradient, so neither momentum nor weight decay touches them.
    """
    return torch.optim.SGD(
        weight_decay_groups(module.named_parameters(), weight_decay), lr=lr, momentum=momentum
    )


def weight_decay_groups(
    named: Iterable[tuple[str, torch.Tensor]], weight_decay: float
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with ``weight_decay`` on weights and none on biases (names ending in
    ``bias``), as the official FedRep and SRPFL optimizers; empty groups left out."""
    named = list(named)
    groups = [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
