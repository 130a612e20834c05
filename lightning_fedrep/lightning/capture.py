"""What the user's steps log, as the federation needs it. Evaluation: what the user's evaluation step logs,
captured per client, and a batch's size as Lightning infers it (given to
:class:`~lightning_fedrep.evaluation.metrics.EvaluationPass`, which stays Lightning-free). Training: the values
``training_step`` logs with Lightning's default timing, logged once per round (:func:`logged_per_round`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_fedrep.evaluation.metrics import ClientMetrics


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch, as Lightning infers it (1 if it cannot)."""
    try:
        return extract_batch_size(batch)
    except Exception:
        return 1


_LOG_SIGNATURE = inspect.signature(L.LightningModule.log)


@contextmanager
def capture_logs(
    module: L.LightningModule, metrics: ClientMetrics, client: int, size: int
) -> Iterator[set[str]]:
    """Record what the user's evaluation step logs, per client, instead of Lightning's sample mean.

    Mean-reduced scalars are summed per client (weighted by the batch size) and logged by the
    strategy as summaries over clients at the end of the pass, with the ``prog_bar``/``logger`` flags
    they were logged with; anything else (a torchmetrics ``Metric``, another ``reduce_fx``) goes to
    Lightning unchanged. Yields the set of keys the user logged.
    """
    original = module.log
    keys: set[str] = set()

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        keys.add(name)
        arguments = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs).arguments
        if not metrics.capture(name, value, client, size, arguments):
            original(name, value, *args, **kwargs)

    module.log = log
    try:
        yield keys
    finally:
        del module.log


@contextmanager
def logged_per_round(module: L.LightningModule) -> Iterator[None]:
    """While the user's ``training_step`` runs in a federated fit: a value it logs with Lightning's default
    timing (neither ``on_step`` nor ``on_epoch`` given; also through ``log_dict``) is logged with
    ``on_step=False, on_epoch=True``: once per round, under its own name, the round's mean (Lightning's epoch
    mean: every local step's value weighted by its batch's size) in every logger. Lightning's default, per
    step, would reach the loggers only every ``log_every_n_steps``-th Lightning step: rarely or never in a
    round of few steps. A timing the step gives is Lightning's."""
    original = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:  # flags given by position
            arguments = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs).arguments
            arguments.pop("self")
            kwargs, name, value, args = arguments, arguments.pop("name"), arguments.pop("value"), ()
        if kwargs.get("on_step") is None and kwargs.get("on_epoch") is None:
            kwargs = {**kwargs, "on_step": False, "on_epoch": True}
        original(name, value, *args, **kwargs)

    module.log = log
    try:
        yield
    finally:
        del module.log
