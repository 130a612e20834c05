"""Many clients' heads fine-tuned at once on their cached features: one step of every client per step.

``FineTunedEvaluation`` fine-tunes each evaluated client's head on the features of its own training data (it
reaches this through the strategy's ``fit_heads_together``). One client after another, a step is a few tiny
operations on a batch of 10 (on a GPU, launch overhead is its whole cost); here a group of clients steps
together: their heads stacked (:class:`~lightning_fedrep.runners.lockstep.group.ClientGroup`, the engine's
stacked tensors with one optimizer per client), the head ``vmap``-ped over the clients, each client's loss the
mean over its own batch (padding masked out), and only the clients that still have a step take it. Every client
sees its own batches in its own order and its own optimizer: the same computation as one client at a time,
within float error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedrep.head_tuning import ClientHead, HeadFineTuning
from lightning_fedrep.losses import masked_mean
from lightning_fedrep.runners.lockstep.group import ClientGroup

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


def fit_heads_together(
    tuning: HeadFineTuning, clients: Sequence[ClientHead], budget: int = HEADS_TOGETHER_BYTES
) -> list[dict[str, Tensor]]:
    """:func:`fit_group` of every client, in consecutive groups of at most ``budget`` bytes of padded features
    (:func:`groups_by_bytes`); the heads in the clients' order."""
    sample = clients[0].features
    sample_bytes = sample[0].numel() * sample.element_size() if len(sample) else sample.element_size()
    heads: list[dict[str, Tensor]] = []
    for group in groups_by_bytes([len(c.features) for c in clients], sample_bytes, budget):
        heads += fit_group(tuning, [clients[i] for i in group])
    return heads


def fit_group(tuning: HeadFineTuning, clients: Sequence[ClientHead]) -> list[dict[str, Tensor]]:
    """Each client's fine-tuned head: it starts from its ``start`` and takes one step per entry of its
    ``batches`` with its own optimizer, on the mean of the loss over its batch, every client's step at once.
    Raises what ``torch.func.vmap`` raises for a head it cannot batch (random draws, in-place buffer updates)
    before any client has stepped."""
    first = clients[0].start
    names = list(first)
    template = {n: t.detach().clone().requires_grad_(True) for n, t in first.items()}
    optimizer = tuning.build_optimizer(template)
    position_of = {id(t): n for n, t in template.items()}
    param_names = [position_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    width = len(clients)
    stacked = {n: torch.stack([c.start[n].detach() for c in clients]).clone() for n in names}
    group = ClientGroup(range(width), stacked, optimizer, param_names, [None] * width)
    leaves, _ = group.lanes((0, width), set(names))
    features, targets = _padded([c.features for c in clients]), _padded([c.targets for c in clients])
    positions, masks, counts = _step_positions([c.batches for c in clients], features.device)
    rows = torch.arange(width, device=features.device)[:, None]
    shared, head = tuning.shared, tuning.head
    forward = torch.func.vmap(lambda tensors, x: head({**shared, **tensors}, x))
    for step in range(len(positions)):
        index, mask = positions[step], masks[step]
        with tuning.step_context():
            outputs = forward(leaves, features[rows, index])
            target = targets[rows, index]
            per_sample = tuning.loss_fn(outputs.flatten(0, 1), target.flatten(0, 1)).float()
            per_sample = per_sample.reshape(width, index.shape[1], -1).mean(-1)
            loss = masked_mean(per_sample, mask).sum()
        loss.backward()
        group.step([step < n for n in counts])
    return [{n: t.detach().clone() for n, t in group.client_tensors(k).items()} for k in range(width)]


def _padded(tensors: Sequence[Tensor]) -> Tensor:
    """``[clients, longest, ...]``: each client's rows, zero-padded to the longest."""
    longest = max(len(t) for t in tensors)
    out = tensors[0].new_zeros((len(tensors), longest, *tensors[0].shape[1:]))
    for k, t in enumerate(tensors):
        out[k, : len(t)] = t
    return out


def _step_positions(
    batches: Sequence[Sequence[Tensor]], device: torch.device
) -> tuple[Tensor, Tensor, list[int]]:
    """Every step's positions ``[steps, clients, batch]`` (zero-padded), its mask of real samples, and each
    client's step count; built on the CPU and moved to ``device`` once."""
    counts = [len(b) for b in batches]
    steps = max(counts)
    width = max((len(p) for b in batches for p in b), default=1)
    positions = torch.zeros(steps, len(batches), width, dtype=torch.long)
    masks = torch.zeros(steps, len(batches), width)
    for k, client_batches in enumerate(batches):
        for step, p in enumerate(client_batches):
            positions[step, k, : len(p)] = p
            masks[step, k, : len(p)] = 1.0
    return positions.to(device), masks.to(device), counts
