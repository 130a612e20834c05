"""How many samples one forward pass of a feature cache reads (the engine's cached head phases and
``FineTunedEvaluation``'s cached fine-tuning alike)."""

from __future__ import annotations

import torch
from torch import Tensor

FEATURE_CHUNK = 1024
"""Samples per forward pass when features are cached on an accelerator (and the most on a CPU)."""

CPU_FEATURE_CHUNK_BYTES = 512 << 10
"""Input bytes per forward pass when features are cached on a CPU (:func:`feature_chunk`)."""


def feature_chunk(device: torch.device, sample_bytes: int) -> int:
    """Samples per forward pass of a feature cache: :data:`FEATURE_CHUNK` on an accelerator; on a CPU as many
    as hold :data:`CPU_FEATURE_CHUNK_BYTES` of input (32 to :data:`FEATURE_CHUNK`), so a pass stays in the
    CPU's caches: on the 2-core development CPU the CIFAR CNN's features of 2,000 images took 0.74 s in chunks
    of 42 (this rule) and 1.55 s in chunks of 1,024, while a 64-input MLP keeps its chunks of 1,024."""
    if device.type != "cpu":
        return FEATURE_CHUNK
    return max(32, min(FEATURE_CHUNK, CPU_FEATURE_CHUNK_BYTES // max(1, sample_bytes)))


def feature_chunk_of(device: torch.device, inputs: Tensor) -> int:
    """:func:`feature_chunk` for inputs like ``inputs`` (a batch: its first sample's bytes)."""
    return feature_chunk(device, inputs[:1].numel() * inputs.element_size())
