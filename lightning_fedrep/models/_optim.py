"""The official FedRep optimiser, shared by the reference models."""

from __future__ import annotations

import torch
from torch import nn


def fedrep_sgd(module: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """SGD with momentum and weight decay on weights only (biases get none), as the official FedRep code.

    Every parameter goes into the optimizer, frozen or not: the strategy freezes the body or the head
    per phase, and frozen parameters get no gradient, so neither momentum nor weight decay touches them.
    """
    decay = [p for n, p in module.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in module.named_parameters() if n.endswith("bias")]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)
