"""Whether a validation or test pass evaluates many clients at once (the vectorized runner's batched
evaluation) or one batch at a time, decided per evaluation loader from the runner setting (Lightning-free:
the face hands in the Trainer's facts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_fedrep.federation import Federation
from lightning_fedrep.runners.lockstep.evaluation import (
    EVALUATION_CHUNK_SAMPLES,
    BatchedEvaluation,
    batched_evaluation,
)
from lightning_fedrep.runners.selection import RunnerSelection


def serve_evaluation(
    selection: RunnerSelection,
    loader: Any,
    module: nn.Module,
    federation: Federation | None,
    device: torch.device,
    convert_input: Callable[[Any], Any],
    headline: bool,
    smoke: bool,
) -> BatchedEvaluation | None:
    """The batched evaluation of ``loader``'s clients where the runner setting allows it (not the
    sequential runner), the headline metrics are computed and the algorithm scores with the module's own
    forward (else ``None``: one batch per step), ``loader`` chunked to match (``smoke``: ``fast_dev_run``,
    one chunk is the pass, so keep it a batch)."""
    batched = None
    scores_per_batch = federation is None or federation.evaluation_spec.forward is not None
    if selection.mode != "sequential" and headline and not scores_per_batch:
        batched = batched_evaluation(module, federation, loader, device, convert_input)
    chunk = loader.batch_size if smoke else EVALUATION_CHUNK_SAMPLES
    loader.chunk(chunk if batched is not None else None)
    return batched
