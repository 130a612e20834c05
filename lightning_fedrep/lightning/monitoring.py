"""The warning that a fit selects rounds on test data: a ``ModelCheckpoint`` or ``EarlyStopping`` monitors a
validation metric while the data module validates on each client's *test* split (``val_fraction=0``, the
papers' protocol). Checked once, at the strategy's ``setup`` of a fit."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedrep.data.module import FederatedDataModule

VALIDATION_METRIC = re.compile(r"(^|/)val([/_.]|$)")
"""A metric measured by validation: ``val/acc``, ``val_loss``, a prefixed ``finetune/val/acc``."""


def selection_on_test_note(callbacks: Iterable[Any], datamodule: Any) -> str | None:
    """What to say when ``callbacks`` select rounds (best checkpoint, early stop) on a validation metric that
    ``datamodule`` computes on the test split; ``None`` when it has a validation split of its own, is not a
    :class:`~lightning_fedrep.FederatedDataModule`, or nothing monitors a validation metric."""
    if not isinstance(datamodule, FederatedDataModule) or datamodule.has_validation_split:
        return None
    selecting = [
        f"{type(c).__name__}(monitor={c.monitor!r})"
        for c in callbacks
        if isinstance(c, ModelCheckpoint | EarlyStopping)
        and isinstance(c.monitor, str)
        and VALIDATION_METRIC.search(c.monitor)
    ]
    if not selecting:
        return None
    return (
        f"{', '.join(selecting)} selects rounds on a validation metric, but {type(datamodule).__name__} has no "
        "validation split (val_fraction=0): validation runs on each client's test split, so the selected round "
        "is chosen on test data and its test metrics are optimistic. Carve a validation split off each client's "
        f"training data with {type(datamodule).__name__}(..., val_fraction=0.1) (on the command line: "
        "--data.val_fraction 0.1), or monitor a training metric. Reporting the test metric of the last round "
        "without selecting on it, as the papers do, needs no validation split."
    )


def warn_selection_on_test_data(trainer: L.Trainer) -> None:
    """At a fit's set-up: warn (rank zero) when its callbacks select rounds on test data
    (:func:`selection_on_test_note`)."""
    note = selection_on_test_note(trainer.callbacks, trainer.datamodule)
    if note is not None:
        rank_zero_warn(note)
