"""Silence the messages every run printed that a user cannot act on (used by the ``lightning-fedrep``
command and the quickstart; a Python user's own scripts are left alone):

- torch's ``isinstance(treespec, LeafSpec)`` deprecation, raised inside Lightning's ``_pytree`` helper;
- Lightning's tip to install ``litlogger``, printed by every ``Trainer``;
- W&B's "the anonymous setting has no effect", caused by the ``anonymous=None`` Lightning's
  ``WandbLogger`` always passes (see ``lightning_internals.drop_wandb_anonymous_flag``);
- Lightning's advice to lower ``log_every_n_steps`` when a round has fewer Lightning steps: in a federated
  fit ``train/loss`` and the values ``training_step`` logs with the default timing reach the loggers once
  per round whatever it is (``lightning.capture.logged_per_round``).
"""

from __future__ import annotations

import logging
import warnings

_LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_unactionable_messages() -> None:
    """Install the filters (idempotent)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings(
        "ignore", message=r"The number of training batches .* is smaller than the logging interval"
    )
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLitLoggerTip) for f in logger.filters):
            logger.addFilter(_DropLitLoggerTip())
