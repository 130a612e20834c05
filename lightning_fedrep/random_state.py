"""The run's random generators left as they were: for work done before training that must change no run."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def untouched_random_state() -> Iterator[None]:
    """Torch's CPU generator, numpy's and Python's global generators are as they were afterwards: for a
    probe batch fetched before training (a ``DataLoader``'s ``iter()`` draws a seed from torch's generator,
    and a data set's random transforms may draw from any of the three), so probing changes no run."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
