"""The Lightning side of a personalized evaluation pass: what the user's evaluation step logs, captured per
client, and a batch's size as Lightning infers it. Given to
:class:`~lightning_fedrep.evaluation.EvaluationPass`, which stays Lightning-free."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

from lightning_fedrep.evaluation import ClientMetrics


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
        scalar = value.detach() if isinstance(value, Tensor) and value.numel() == 1 else value
        mean_reduced = arguments.get("reduce_fx", "mean") in ("mean", torch.mean)
        if mean_reduced and isinstance(scalar, Tensor | float | int) and not isinstance(scalar, bool):
            batch = arguments.get("batch_size") or size
            metrics.add(name, client, float(scalar) * batch, batch)
            flags = {
                "prog_bar": arguments.get("prog_bar", False),
                "logger": arguments.get("logger"),
            }
            metrics.options.setdefault(name, flags)
            return
        original(name, value, *args, **kwargs)

    module.log = log
    try:
        yield keys
    finally:
        del module.log
