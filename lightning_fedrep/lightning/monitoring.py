"""The warning that a fit selects rounds on test data: a ``ModelCheckpoint`` or ``EarlyStopping`` monitors a
validation metric while the data module validates on each client's *test* split (``val_fraction=0``, the
papers' protocol). Checked once, at the strategy's ``setup`` of a fit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedrep.data.binding import rounds_selected_on_test_note
from lightning_fedrep.data.module import FederatedDataModule


def selection_on_test_note(callbacks: Iterable[Any], datamodule: Any) -> str | None:
    """What to say when ``callbacks`` select rounds (best checkpoint, early stop) on a validation metric that
    ``datamodule`` computes on the test split; ``None`` when it has a validation split of its own, is not a
    :class:`~lightning_fedrep.FederatedDataModule`, or nothing monitors a validation metric."""
    if not isinstance(datamodule, FederatedDataModule) or datamodule.has_validation_split:
        return None
    monitors = [c for c in callbacks if isinstance(c, ModelCheckpoint | EarlyStopping)]
    return rounds_selected_on_test_note(monitors, type(datamodule).__name__)


def warn_selection_on_test_data(trainer: L.Trainer) -> None:
    """At a fit's set-up: warn (rank zero) when its callbacks select rounds on test data
    (:func:`selection_on_test_note`)."""
    note = selection_on_test_note(trainer.callbacks, trainer.datamodule)
    if note is not None:
        rank_zero_warn(note)
