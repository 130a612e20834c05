"""What a probe leaves as it was (the run's random generators, every submodule's train/eval mode): for work
done before training or evaluation that must change no run."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn


@contextmanager
def untouched_random_state() -> Iterator[None]:
    """Torch's generators (the CPU's and, once CUDA is in use, every GPU's), numpy's and Python's global
    generators are as they were afterwards: for a probe batch fetched before training (a ``DataLoader``'s
    ``iter()`` draws a seed from torch's generator, and a data set's random transforms may draw from any of the
    three) and for a probe that seeds torch itself, so probing changes no run."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@contextmanager
def untouched_modes(module: nn.Module) -> Iterator[None]:
    """Every submodule's train/eval mode is as it was afterwards (``module.train(flag)`` would also reset a
    submodule the user keeps in eval mode, such as a frozen batch-norm backbone)."""
    modes = {m: m.training for m in module.modules()}
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
