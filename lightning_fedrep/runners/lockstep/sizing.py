"""How wide the vectorized runner runs: the memory bound on a lockstep group, and a short timing of
one wide lockstep step against the same clients one after another.

A group of K clients holds K copies of every trainable tensor, their gradients and optimizer state,
K clients' activations of one step, and (head phases) K clients' cached features. :func:`group_width`
fits that into a memory budget. Whether a phase that cannot use cached features is faster in lockstep
depends on the device and the model (a batch-10 convolution is compute-bound on a CPU, so K clients
at once cost as much as K one after another, plus the batching; on a GPU one wide step costs about
as much as one narrow step): :func:`faster_lane_width` measures it instead of guessing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

OPTIMIZER_SLOTS = 2
"""Optimizer state tensors per parameter assumed when sizing a group (Adam's two moments; SGD's
momentum needs one)."""


def default_memory_budget(device: torch.device) -> int:
    """Bytes a lockstep group may use: half the free memory of a GPU, a quarter of a host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.25)
    except (ValueError, OSError, AttributeError):  # not a POSIX host: assume 16 GiB
        return 4 << 30


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes(step: Callable[[], Tensor]) -> int:
    """Bytes autograd keeps for the backward of ``step()`` (one client's forward and loss)."""
    saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return saved


def client_bytes(trainable: Iterable[Tensor], activations: int, cached_features: int) -> int:
    """Bytes one client of a lockstep group takes: its tensors, gradients, optimizer state, one step's
    activations and its cached features."""
    return tensor_bytes(trainable) * (2 + OPTIMIZER_SLOTS) + activations + cached_features


POISSON_SIGMAS = 4
"""Standard deviations above the mean batch size that :func:`poisson_width_factor` allows for."""


def poisson_width_factor(batch_size: int) -> float:
    """How much wider than ``batch_size`` a lockstep step's padded batches are assumed to be under Poisson
    sampling (each lane's batch a binomial draw of mean ``batch_size``, every lane padded to the step's largest):
    the expected batch size plus :data:`POISSON_SIGMAS` standard deviations (at most ``sqrt(batch_size)``), plus
    one sample, over ``batch_size``. An estimate for the memory bound: a step wider than that still runs (a
    batch is never cut), only with more memory than assumed."""
    return (batch_size + POISSON_SIGMAS * batch_size**0.5 + 1) / batch_size


def group_width(budget: int, per_client: int) -> int:
    """How many clients fit in ``budget`` bytes (at least one)."""
    return max(1, budget // max(1, per_client))


LOCKSTEP_MARGIN = 0.05
"""How much slower a measured lockstep step may be and still be chosen where narrow lanes pay a cost the
measurement leaves out (the sequential runner, or unfused one-lane calls, pay Lightning's per-step cost once per
client step, lockstep once per group step); within it either choice is within 5% of the faster. Where both
widths run fused in the engine the margin is 0 (``LockstepEngine._lockstep_margin``)."""


NARROW_SAMPLE = 8
"""Clients whose narrow steps are timed, after one warm-up client, to estimate a group's steps one after another
(independent clients: their total is linear in the group's clients; the wide step is not, and runs whole)."""

CLEAR_GAP = 0.3
"""How far apart (30%) the two timings must be for :func:`faster_lane_width` to decide after one timed repeat;
a closer call is timed again."""

PROBE_FRACTION = 4
"""``LockstepEngine`` first times a group of a quarter of the width (:func:`probe_width`); where lockstep loses
there it is not timed at the full width."""


def probe_width(width: int) -> int:
    """The width of the cheap first timing of a ``width``-client group (``width`` itself where a quarter would
    be under :data:`NARROW_SAMPLE` clients: the full timing is cheap there)."""
    quarter = -(-width // PROBE_FRACTION)
    return quarter if quarter >= NARROW_SAMPLE else width


def faster_lane_width(
    wide: Callable[[], None],
    narrow: list[Callable[[], None]],
    device: torch.device,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    margin: float = LOCKSTEP_MARGIN,
    sample: int = NARROW_SAMPLE,
    clear: float = CLEAR_GAP,
) -> tuple[bool, float, float]:
    """Time one lockstep step of K clients (``wide``) against the same K clients' steps one after
    another (``narrow``), each a whole step (forward, backward, the optimizer's update): one untimed warm-up
    of the wide step and of the first narrow client (of every one where all are timed), then up to ``repeats``
    rounds of both, interleaved (so a passing load slows both alike), the best of each. The narrow time is the
    first ``sample`` clients after the warm-up one, scaled to all K (all K where there are at most
    ``sample + 1``). After a repeat whose best times are more than ``1 + clear`` apart either way it stops: only
    a close call is timed again. Returns whether the wide step is at most ``1 + margin`` times as slow
    (:data:`LOCKSTEP_MARGIN`), and both times in seconds of ``clock`` (wall-clock seconds by default; tests pass
    a fake clock that the work advances)."""

    def timed(work: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - start

    every = len(narrow) <= sample + 1
    warm_up, timed_narrow = (narrow, narrow) if every else (narrow[:1], narrow[1 : sample + 1])
    scale = len(narrow) / len(timed_narrow)

    def some_narrow() -> None:
        for work in timed_narrow:
            work()

    wide()
    for work in warm_up:
        work()
    wide_s = narrow_s = float("inf")
    for _ in range(repeats):
        wide_s = min(wide_s, timed(wide))
        narrow_s = min(narrow_s, timed(some_narrow) * scale)
        if max(wide_s, narrow_s) > min(wide_s, narrow_s) * (1 + clear):
            break
    return wide_s <= narrow_s * (1 + margin), wide_s, narrow_s


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The module's buffers and parameters by name."""
    return {**dict(module.named_buffers()), **dict(module.named_parameters())}
