"""Clients' labels checked against the model before any step: integer class indices below the number of
classes the model outputs (its output width on a probe batch, or a data module's declared ``num_classes``).

Without the check a label of 15 for a 10-class model fails deep inside a step (``index 15 is out of
bounds`` from ``vmap``, ``Target 15 is out of bounds`` from ``cross_entropy``) without saying which client
holds it, and string labels fail in ``torch.as_tensor`` with ``too many dimensions 'str'``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep.data.loaders import ClientData
from lightning_fedrep.untouched import untouched_modes


def has_string_labels(targets: Any) -> bool:
    """Whether ``targets`` (a data set's labels, or a batch's) are strings rather than numbers."""
    if isinstance(targets, str):
        return True
    if isinstance(targets, np.ndarray):
        return targets.dtype.kind in "USO" and targets.size > 0 and isinstance(targets.flat[0], str)
    if isinstance(targets, Sequence) and len(targets) > 0:
        return isinstance(targets[0], str | bytes)
    return False


def string_labels_error(where: str, example: Any) -> TypeError:
    """The error for string labels in ``where`` (e.g. ``"FederatedDataModule(train_set=...)"``)."""
    return TypeError(
        f"{where} has string labels (e.g. {example!r}); labels must be integer class indices 0..C-1. Map the "
        "names to integers in the data set (e.g. targets = [classes.index(name) for name in names])."
    )


def stored_labels(dataset: Dataset, where: str) -> Tensor | None:
    """A data set's labels where it stores them (``targets``, a ``TensorDataset``'s second tensor) as an
    integer tensor; ``None`` when it stores none or they are not one integer per sample (regression)."""
    targets = getattr(dataset, "targets", None)
    if targets is None and isinstance(dataset, TensorDataset) and len(dataset.tensors) > 1:
        targets = dataset.tensors[1]
    if targets is None:
        return None
    if has_string_labels(targets):
        raise string_labels_error(where, targets[0])
    try:
        labels = torch.as_tensor(targets)
    except (TypeError, ValueError, RuntimeError):  # e.g. a list of tensors or objects: not checked
        return None
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool or labels.dim() != 1:
        return None
    return labels


@torch.no_grad()
def output_width(
    module: nn.Module,
    batch: Any,
    device: torch.device,
    convert_input: Callable[[Any], Any] | None = None,
) -> int | None:
    """The number of classes ``module(x)`` scores on an ``(x, y)`` probe batch with integer labels ``y``
    (``None`` for other batches or outputs: regression, dicts, a forward that takes other inputs).
    ``convert_input`` is what Lightning does to a batch before the step (the trainer's precision plugin's:
    float inputs to float64 under ``precision="64-true"``). The module runs in evaluation mode with the
    random number generators saved and restored, and every submodule's mode restored, so the probe
    changes nothing."""
    if not (isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], Tensor)):
        return None
    x, y = batch
    if not isinstance(y, Tensor) or y.is_floating_point() or y.dim() != 1 or len(y) == 0:
        return None
    x = convert_input(x) if convert_input is not None else x
    devices = [device] if device.type == "cuda" else []
    try:
        with untouched_modes(module), torch.random.fork_rng(devices=devices):
            module.eval()
            output = module(x.to(device))
    except Exception:  # a forward that does not take x alone: nothing to compare the labels with
        return None
    if not isinstance(output, Tensor) or output.dim() != 2 or output.shape[0] != len(y):
        return None
    return int(output.shape[1]) if output.is_floating_point() else None


def check_client_labels(
    clients: Sequence[ClientData], split: str, num_classes: int, source: str
) -> list[str]:
    """Refuse clients of ``split`` holding a label outside ``0..num_classes - 1`` (``source`` says where the
    number of classes comes from), naming the first such client, its label and how many clients have one.
    Returns the names of the data sets whose labels could not be read (no ``targets``): not checked."""
    unchecked: list[str] = []
    labels_of: dict[int, Tensor | None] = {}
    bad_of: dict[int, Tensor] = {}
    offenders: list[tuple[int, int]] = []
    for cid, data in enumerate(clients):
        key = id(data.dataset)
        if key not in labels_of:
            labels = stored_labels(
                data.dataset, f"Client {cid}'s {split} data ({type(data.dataset).__name__})"
            )
            labels_of[key] = labels
            if labels is None:
                unchecked.append(type(data.dataset).__name__)
            else:
                bad = (labels < 0) | (labels >= num_classes)
                if bool(bad.any()):  # else none of this data set's clients can hold one
                    bad_of[key] = bad
        labels = labels_of[key]
        if labels is None or not len(data) or key not in bad_of:
            continue
        index = data.indices[bad_of[key][data.indices]]
        if index.numel():
            offenders.append((cid, int(labels[index[0]])))
    if offenders:
        cid, label = offenders[0]
        others = (
            f"; {len(offenders)} clients have such labels: {[c for c, _ in offenders[:10]]}"
            if len(offenders) > 1
            else ""
        )
        raise ValueError(
            f"Client {cid}'s {split} data has label {label}, but {source} {num_classes} classes: labels must be "
            f"integers in 0..{num_classes - 1}{others}. Fix the labels, or give the model as many outputs as "
            "classes (if model(x) is not class scores, pass headline_metrics=False to the strategy)."
        )
    return unchecked
