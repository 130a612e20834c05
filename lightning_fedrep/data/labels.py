"""Clients' labels checked against the model before any step: integer class indices below the number of
classes the model outputs (its output width on a probe batch, or a data module's declared ``num_classes``).

Without the check a label of 15 for a 10-class model fails deep inside a step (``index 15 is out of
bounds`` from ``vmap``, ``Target 15 is out of bounds`` from ``cross_entropy``) without saying which client
holds it, string labels fail in ``torch.as_tensor`` with ``too many dimensions 'str'``, and float class ids
(``3.0``) fail inside the loss with ``expected target dtype to be Long``.

Also here: the warning that a client is evaluated on classes its own training data lacks
(:func:`unseen_classes_note`), given by the data module for every way of building its clients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep.data.loaders import ClientData
from lightning_fedrep.federation.module.untouched import untouched_modes


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


def integer_labels_error(where: str, labels: Tensor, needed_by: str, otherwise: str = "") -> ValueError:
    """The error for labels that are not one integer class id per sample (floats, one-hot or soft labels) in
    ``where``, which ``needed_by`` (partitioning, the loss) needs; ``otherwise`` says what to do instead
    when the labels are not class ids (regression targets). The one message of every path that refuses them."""
    return ValueError(
        f"{where} has labels of dtype {labels.dtype} and shape {tuple(labels.shape)}, but {needed_by} needs "
        "integer class ids, one per sample. Convert them to integers (e.g. TensorDataset(x, y.long()), or "
        "dataset.targets = dataset.targets.long()); pass class indices, not one-hot or soft labels."
        + (f" {otherwise}" if otherwise else "")
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
    labels = _probe_labels(batch)
    if labels is None or labels.is_floating_point():
        return None
    return _scores_width(module, batch[0], len(labels), device, convert_input)


def refuse_float_class_labels(
    module: nn.Module,
    batch: Any,
    device: torch.device,
    where: str,
    convert_input: Callable[[Any], Any] | None = None,
) -> None:
    """Refuse float labels that are class ids, on an ``(x, y)`` probe batch (``where`` names its data): ``y``
    holds one float per sample, every one a whole number in ``0..C-1``, and ``model(x)`` scores ``C >= 2``
    classes per sample. A classification loss would fail on them inside the first step (cross-entropy:
    ``expected target dtype to be Long``). Real targets (regression) pass: a model that outputs one value
    per sample, or targets that are not all class ids of its outputs; so does ``headline_metrics=False``,
    under which the caller does not ask (``model(x)`` is then not class scores)."""
    labels = _probe_labels(batch)
    if labels is None or not labels.is_floating_point():
        return
    width = _scores_width(module, batch[0], len(labels), device, convert_input)
    if width is None or width < 2:
        return
    class_ids = (labels == labels.round()) & (labels >= 0) & (labels < width)
    if bool(class_ids.all()):
        raise integer_labels_error(
            where,
            labels,
            f"the model outputs {width} class scores per sample and the labels are whole numbers in "
            f"0..{width - 1}, so they are class ids, and a classification loss (cross-entropy)",
            "If they are real-valued targets and model(x) is not class scores, pass headline_metrics=False to "
            "the strategy.",
        )


def _probe_labels(batch: Any) -> Tensor | None:
    """The labels of an ``(x, y)`` probe batch of tensors, one per sample; ``None`` for other batches."""
    if not (isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], Tensor)):
        return None
    labels = batch[1]
    if not isinstance(labels, Tensor) or labels.dim() != 1 or len(labels) == 0:
        return None
    return labels


@torch.no_grad()
def _scores_width(
    module: nn.Module,
    x: Tensor,
    samples: int,
    device: torch.device,
    convert_input: Callable[[Any], Any] | None,
) -> int | None:
    """The width of ``module(x)`` when it is a float ``(samples, width)`` tensor, else ``None``; the module
    runs in evaluation mode with the random number generators and every submodule's mode restored."""
    x = convert_input(x) if convert_input is not None else x
    devices = [device] if device.type == "cuda" else []
    try:
        with untouched_modes(module), torch.random.fork_rng(devices=devices):
            module.eval()
            output = module(x.to(device))
    except Exception:  # a forward that does not take x alone: nothing to compare the labels with
        return None
    if not isinstance(output, Tensor) or output.dim() != 2 or output.shape[0] != samples:
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


def unseen_classes_note(
    train: Sequence[ClientData], evaluated: Sequence[ClientData], split: str
) -> str | None:
    """What a client's ``split`` (``"val"``, ``"test"``) holds of classes its own training data lacks, or
    ``None`` when no client's does: its personalized model is scored on classes it never trained on (the
    data module says so once, at its set-up, however the clients were built: a partitioner, explicit data
    sets, natural users). Read from the data sets' stored labels (``targets``, a ``TensorDataset``'s second
    tensor); data sets that store none, or real targets (regression), are not compared."""
    owners, train_labels, eval_owners, eval_labels = [], [], [], []
    known: dict[int, Tensor | None] = {}  # by base data set: clients share one
    for cid, (own, other) in enumerate(zip(train, evaluated)):
        labels, held = _labels_of(own.dataset, known), _labels_of(other.dataset, known)
        if labels is None or held is None or not len(other):
            continue
        train_labels.append(labels[own.indices])
        owners.append(torch.full((len(own),), cid))
        eval_labels.append(held[other.indices])
        eval_owners.append(torch.full((len(other),), cid))
    if not eval_labels:
        return None
    classes, codes = torch.unique(torch.cat(train_labels + eval_labels), return_inverse=True)
    train_codes, eval_codes = codes.split([sum(map(len, train_labels)), sum(map(len, eval_labels))])
    width = len(classes)
    trained = torch.cat(owners) * width + train_codes
    evaluated_pairs = torch.cat(eval_owners) * width + eval_codes
    unseen = ~torch.isin(evaluated_pairs, trained)
    if not bool(unseen.any()):
        return None
    return _unseen_text(evaluated_pairs[unseen], classes, split, len(train), len(evaluated_pairs))


def _unseen_text(pairs: Tensor, classes: Tensor, split: str, clients: int, samples: int) -> str:
    """The note of :func:`unseen_classes_note` from the ``client * C + class`` codes of the unseen samples, of
    ``clients`` clients with ``samples`` samples of ``split`` in all."""
    width = len(classes)
    lacking = torch.unique(pairs // width)
    shown = []
    for client in lacking[:5].tolist():
        names, counts = torch.unique(pairs[pairs // width == client] % width, return_counts=True)
        listed = ", ".join(
            f"{classes[c].item()} ({n} sample{'s' if n > 1 else ''})"
            for c, n in zip(names[:5].tolist(), counts[:5].tolist())
        )
        shown.append(f"client {client}: class {listed}{' ...' if len(names) > 5 else ''}")
    more = f"; {len(lacking) - 5} more clients" if len(lacking) > 5 else ""
    return (
        f"{len(lacking)} of {clients} clients have {split} samples of classes their own training data lacks "
        f"({len(pairs)} of {samples} {split} samples; {'; '.join(shown)}{more}), so their "
        "personalized models are scored on classes they never trained on, which lowers their accuracy whatever "
        "the method. Expected of IID or natural (per-user) splits of small clients; ShardPartitioner and "
        "DirichletPartitioner give each client test samples of its own training classes only. To score clients "
        "only on classes they trained on, drop those samples from their evaluation data."
    )


def _labels_of(dataset: Dataset, known: dict[int, Tensor | None]) -> Tensor | None:
    """The integer labels ``dataset`` stores (read once into ``known``), ``None`` when it stores none it can
    give (string labels are refused where the labels are checked against the model, not here)."""
    if id(dataset) not in known:
        try:
            known[id(dataset)] = stored_labels(dataset, type(dataset).__name__)
        except TypeError:
            known[id(dataset)] = None
    return known[id(dataset)]
