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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from lightning_fedrep.evaluation.head_tuning import ClientHead, HeadFineTuning, NotBatchable
from lightning_fedrep.federation.module.losses import NAMED_LOSSES, masked_mean
from lightning_fedrep.runners.lockstep.group import ClientGroup


def fit_heads_together(tuning: HeadFineTuning, clients: Sequence[ClientHead]) -> list[dict[str, Tensor]]:
    """Each client's fine-tuned head: it starts from its ``start`` and takes one step per entry of its
    ``batches`` with its own optimizer, on the mean of the loss over its batch, every client's step at once;
    the heads in ``clients``' order. Raises :class:`~lightning_fedrep.evaluation.head_tuning.NotBatchable`, before any
    client has stepped, where that would not be one client at a time's computation: an optimizer class that is
    not one of torch's per-parameter ones or that does not hold exactly the head's tensors, a head ``vmap``
    cannot batch (random draws, in-place buffer updates, an operator without a batching rule), or a loss that
    does not give one value per sample."""
    first = clients[0].start
    names = list(first)
    width = len(clients)
    with _not_batchable("the optimizer"):
        template = {n: t.detach().clone().requires_grad_(True) for n, t in first.items()}
        optimizer = tuning.build_optimizer(template)
        _check_optimizer(optimizer, template)
        position_of = {id(t): n for n, t in template.items()}
        param_names = [position_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
        stacked = {n: torch.stack([c.start[n].detach() for c in clients]).clone() for n in names}
        group = ClientGroup(range(width), stacked, optimizer, param_names, [None] * width)
    leaves, _ = group.lanes((0, width), set(names))
    features, targets = _padded([c.features for c in clients]), _padded([c.targets for c in clients])
    positions, masks, counts = _step_positions([c.batches for c in clients], features.device)
    rows = torch.arange(width, device=features.device)[:, None]
    shared, head = tuning.shared, tuning.head
    forward = torch.func.vmap(lambda tensors, x: head({**shared, **tensors}, x))
    named_loss = tuning.loss_fn in NAMED_LOSSES.values()
    lane_loss = tuning.loss_fn if named_loss else torch.func.vmap(tuning.loss_fn)
    for step in range(len(positions)):
        index, mask = positions[step], masks[step]
        batch = index.shape[1]
        with _not_batchable("the head and loss") if step == 0 else nullcontext():  # nothing has stepped yet
            with tuning.step_context():
                outputs = forward(leaves, features[rows, index])
                target = targets[rows, index]
                if named_loss:  # per sample by contract: once over every lane's samples
                    per_sample = lane_loss(outputs.flatten(0, 1), target.flatten(0, 1))
                    per_sample_shape = per_sample.dim() >= 1 and per_sample.shape[0] == width * batch
                else:  # the user's own loss sees one lane's batch at a time, as one client at a time would
                    per_sample = lane_loss(outputs, target)
                    per_sample_shape = per_sample.dim() >= 2 and per_sample.shape[1] == batch
                if not per_sample_shape:
                    raise NotBatchable(
                        f"the loss gives {tuple(per_sample.shape)} for {width} clients' batches of {batch}, "
                        "not one value per sample"
                    )
                per_sample = per_sample.float().reshape(width, batch, -1).mean(-1)
                loss = masked_mean(torch.where(mask.bool(), per_sample, 0.0), mask).sum()
            loss.backward()
        group.step([step < n for n in counts])
    return [{n: t.detach().clone() for n, t in group.client_tensors(k).items()} for k in range(width)]


PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""Torch's optimizers whose update of a tensor reads only that tensor's gradient and state: one optimizer over
every client's views is then one optimizer per client."""


def _check_optimizer(optimizer: torch.optim.Optimizer, head: dict[str, Tensor]) -> None:
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
        raise NotBatchable(f"{type(optimizer).__name__} is not one of torch's per-parameter optimizers")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if held != {id(t) for t in head.values()}:
        raise NotBatchable("the optimizer does not hold exactly the head's tensors")


@contextmanager
def _not_batchable(what: str) -> Iterator[None]:
    """Any error inside (nothing has stepped yet) as :class:`NotBatchable`, naming ``what`` and the error."""
    try:
        yield
    except NotBatchable:
        raise
    except Exception as error:  # noqa: BLE001 (re-raised as the reason to fall back, the error named)
        raise NotBatchable(
            f"{what} cannot be batched over clients: {type(error).__name__}: {error}"
        ) from error


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
