"""What fine-tuning many clients' heads on their cached features takes (the engine does it, a callback asks for it):
:class:`HeadFineTuning`, the same for every client, and :class:`ClientHead`, each client's own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class NotBatchable(Exception):
    """Fine-tuning these clients' heads together would not be one client at a time's computation (raised before
    any client stepped): fine-tune them one at a time. The message says why."""


HEADS_TOGETHER_BYTES = 256 * 2**20
"""At most this many bytes of padded features per group of clients fine-tuned together."""


def groups_by_bytes(
    sizes: Sequence[int], sample_bytes: int, budget: int = HEADS_TOGETHER_BYTES
) -> list[list[int]]:
    """Consecutive positions of ``sizes`` (samples per client) in groups whose padded features (the group's
    largest client times its width times ``sample_bytes``) stay within ``budget`` (a client alone may exceed it)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for position, size in enumerate(sizes):
        wider = max(longest, size)
        if current and wider * (len(current) + 1) * sample_bytes > budget:
            groups.append(current)
            current, wider = [], size
        current.append(position)
        longest = wider
    if current:
        groups.append(current)
    return groups


HeadCall = Callable[[dict[str, Tensor], Tensor], Tensor]
"""The head on given tensors: ``(state, features) -> outputs`` (a feature split's ``head``)."""


@dataclass(frozen=True)
class HeadFineTuning:
    """How every client's head is fine-tuned: what is the same for all of them."""

    head: HeadCall
    """The head on given tensors (a feature split's ``head``)."""
    shared: dict[str, Tensor]
    """The tensors the head reads that every client shares (the tuned ones come from each client's start)."""
    build_optimizer: Callable[[dict[str, Tensor]], torch.optim.Optimizer]
    """A fresh optimizer over a head's tensors by name: its class and hyper-parameters are each client's."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """The per-sample loss ``(outputs, targets) -> losses``; a client's step minimises its mean over the batch."""
    step_context: Callable[[], AbstractContextManager[Any]]
    """Entered around each step's forward and loss (a precision plugin's ``train_step_context``)."""


@dataclass(frozen=True)
class ClientHead:
    """One client's fine-tuning: its starting head, its cached features and targets, its steps' batches."""

    start: dict[str, Tensor]
    """The head it starts from, by name (the tensors it fine-tunes)."""
    features: Tensor
    targets: Tensor
    batches: Sequence[Tensor]
    """Each step's positions into ``features``/``targets``, in order."""
