"""Per-client random draws on the vectorized runner (``FederatedStrategy(randomness="per_client")``).

Under ``"per_client"`` a lockstep step's forward runs inside ``torch.func.vmap(..., randomness="different")``:
every random operation (a dropout mask, noise) draws one tensor for all the step's clients, each client its
own row, so each client draws its own random numbers, as it would alone. The generator it draws from is
forked and seeded for the step from a key of the strategy's seed, the round, the phase, the local step and
the clients that step together (:func:`step_seed`): the draws are a pure function of those, not of the
global generator's history, so the same seed gives the same model, a resumed run (at a round boundary or
mid-round) draws what the uninterrupted run drew, and the run's global generators are left untouched.

The contract is the same distribution as the sequential runner, not the same draws: a client's mask is a
row of its group's draw, so it depends on which clients step together (the group width, the processes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from lightning_fedrep.runners.settings import Randomness

_PRIME = 2**61 - 1
_TAG = 0x5EED_D207
"""Sets the engine's per-client streams apart from the other streams keyed by the strategy's seed."""


def step_seed(seed: int, round_index: int, phase: int, step: int, clients: Sequence[int]) -> int:
    """The seed of one lockstep step's draws: ``seed``, the round, the phase index, the phase's local
    ``step`` and the stepping ``clients`` (in lane order) folded into one 61-bit integer."""
    value = (seed & 0xFFFFFFFFFFFF) ^ _TAG
    for key in (round_index, phase, step, len(clients), *clients):
        value = (value * 1_000_003 + int(key) + 1) % _PRIME
    return value


@contextmanager
def keyed_generator(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: ``device``'s default generator seeded with ``seed``; afterwards as it was before (forked), so
    the draws inside are a function of ``seed`` alone and the run's own stream moves on as if nothing ran."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]), torch.cuda.device(index):
            torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


def vmap_randomness(randomness: Randomness) -> str:
    """What ``torch.func.vmap`` is told about random operations: ``"error"`` under the exact contract (none
    may run: the probe and the set-up checks refuse them first), ``"different"`` under ``"per_client"``."""
    return "different" if randomness == "per_client" else "error"


def step_draws(
    randomness: Randomness,
    seed: int,
    round_index: int,
    phase: int,
    step: int,
    clients: Sequence[int],
    device: torch.device,
) -> AbstractContextManager[None]:
    """The context a lockstep step's forward runs in: :func:`keyed_generator` of :func:`step_seed` under
    ``"per_client"``, nothing under ``"exact"`` (no random operation runs)."""
    if randomness != "per_client":
        return nullcontext()
    return keyed_generator(step_seed(seed, round_index, phase, step, clients), device)
