"""The lockstep schedule of a round: which clients train together in each Lightning step.

A round's clients are cut into groups of at most ``width``; each group runs the round's phases one
after another, and a phase is a *segment* of ``max(steps)`` Lightning steps in which every client of
the segment's lanes takes its own next local step (a client with fewer steps in the phase is masked
out once it is done). A phase that does not run on cached features may use narrower lanes than the
group (``uncached_width``: where one wide step costs more than several narrow ones, e.g. convolutions
on a CPU); its lanes then run one after another. Every client sees exactly its sequential batches, in
the same order: its data position is its local step count, continued across phases.

A Lightning step runs one *call*: by default one lockstep step (``steps_per_call=1``); a fused schedule
(``steps_per_call`` > 1, or ``None`` for a whole segment) runs several lockstep steps of one segment in one
call, never across a segment's end, and its batch is a :class:`FusedBatches` that draws the stacked batches
of those steps as the engine iterates it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Part
from lightning_fedrep.federation.plan import RoundPlan, steps_per_epoch

if TYPE_CHECKING:
    from lightning_fedrep.runners.lockstep.loading import ClientBatches


@dataclass(frozen=True)
class Segment:
    """Lightning steps ``start .. start + length - 1`` in which a group runs one phase in lockstep."""

    group: int
    group_clients: tuple[int, ...]
    """Every client of the group (the tensors stacked together while the group trains)."""
    lanes: tuple[int, int]
    """The group positions ``[start, stop)`` that train in this segment."""
    phase_index: int
    part: Part
    steps: tuple[int, ...]
    """Each client's local steps in this phase (0: it only waits)."""
    offsets: tuple[int, ...]
    """Each client's local steps before this phase in the round (the position of its next batch)."""
    start: int
    cached: bool
    """Whether the phase trains the head on features cached from the frozen body."""
    last_of_group: bool

    @property
    def clients(self) -> tuple[int, ...]:
        """The clients that train in this segment (the group's lanes)."""
        return self.group_clients[self.lanes[0] : self.lanes[1]]

    @property
    def length(self) -> int:
        return max(self.steps)

    def active(self, step: int) -> list[bool]:
        """Which clients take a local step at the segment's ``step``-th Lightning step."""
        return [step < n for n in self.steps]


@dataclass(frozen=True)
class Call:
    """One Lightning step of a lockstep schedule: ``count`` lockstep steps of ``segment`` from its ``first``."""

    segment: Segment
    first: int
    count: int

    @property
    def last(self) -> int:
        """The segment's step index of the call's last lockstep step."""
        return self.first + self.count - 1


class FusedBatches:
    """The batch of a fused call: its lockstep steps' stacked batches (each as :class:`LockstepPlan`'s
    unfused batches), drawn from the round's loader when iterated. Lightning hands it to the step as is
    (it holds no tensor); the engine converts and moves each stacked batch itself."""

    __slots__ = ("loader", "round", "call")

    def __init__(self, loader: ClientBatches, round_index: int, call: Call):
        self.loader = loader
        self.round = round_index
        self.call = call

    def __len__(self) -> int:
        return self.call.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        call = self.call
        return _segment_batches(self.loader, self.round, call.segment, call.first, call.last + 1)

    def __repr__(self) -> str:
        call = self.call
        return (
            f"FusedBatches(round={self.round}, group={call.segment.group}, steps={call.first}..{call.last})"
        )


@dataclass(frozen=True)
class LockstepPlan:
    """A round plan as lockstep segments, cut into calls (one per Lightning step); the training
    ``RoundLoader`` iterates its batches.

    ``steps_per_call``: lockstep steps per Lightning step, at most a segment's (``None``: a whole segment).
    """

    plan: RoundPlan
    segments: tuple[Segment, ...]
    steps_per_call: int | None = 1
    calls: tuple[Call, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        calls = []
        for segment in self.segments:
            size = segment.length if self.steps_per_call is None else self.steps_per_call
            for first in range(0, segment.length, size):
                calls.append(Call(segment, first, min(size, segment.length - first)))
        object.__setattr__(self, "calls", tuple(calls))

    @property
    def round(self) -> int:
        return self.plan.round

    @property
    def fused(self) -> bool:
        """Whether a Lightning step may run more than one lockstep step."""
        return self.steps_per_call != 1

    @property
    def length(self) -> int:
        """Lightning steps (calls) in the round."""
        return len(self.calls)

    @property
    def lockstep_steps(self) -> int:
        """Lockstep steps in the round (the sum of its segments' lengths)."""
        return sum(segment.length for segment in self.segments)

    def call(self, index: int) -> Call:
        """The round's ``index``-th Lightning step."""
        if not 0 <= index < self.length:
            raise IndexError(f"step {index} is outside round {self.round} of {self.length} lockstep calls.")
        return self.calls[index]

    def locate(self, step: int) -> tuple[Segment, int]:
        """The segment of the round's ``step``-th Lightning step and the index inside it of its (first)
        lockstep step."""
        call = self.call(step)
        return call.segment, call.first

    def batches(self, loader: ClientBatches, start: int = 0) -> Iterator[Any]:
        """The Lightning batches from call ``start``: per lockstep step every lane's next batch, stacked;
        in a fused schedule one :class:`FusedBatches` per call."""
        if self.fused:
            for call in self.calls[start:]:
                yield FusedBatches(loader, self.round, call)
            return
        for segment in self.segments:
            if segment.start + segment.length <= start:
                continue
            first = max(0, start - segment.start)
            yield from _segment_batches(loader, self.round, segment, first)


def lockstep_plan(
    plan: RoundPlan,
    width: int,
    cache_head: bool,
    uncached_width: int | None = None,
    steps_per_call: int | None = 1,
) -> LockstepPlan:
    """Cut ``plan``'s clients into groups of at most ``width`` and each group's work into phase segments;
    phases not on cached features run in lanes of at most ``uncached_width`` clients (default ``width``);
    each Lightning step runs ``steps_per_call`` lockstep steps of a segment (``None``: the whole segment)."""
    if width < 1 or (uncached_width is not None and uncached_width < 1):
        raise ValueError(f"The engine's widths must be >= 1, got {width} and {uncached_width}.")
    if steps_per_call is not None and steps_per_call < 1:
        raise ValueError(f"The engine's steps per call must be >= 1 (or None), got {steps_per_call}.")
    work = [w.client for w in plan.work]
    segments: list[Segment] = []
    start = 0
    groups = [tuple(work[i : i + width]) for i in range(0, len(work), width)]
    for g, clients in enumerate(groups):
        per_epoch = [steps_per_epoch(plan.client_sizes[c], plan.batch_size) for c in clients]
        offsets = [0] * len(clients)
        group_segments = []
        for p, phase in enumerate(plan.phases):
            steps = [phase.num_steps(n) for n in per_epoch]
            if max(steps) == 0:
                continue
            cached = cache_head and phase.train == "head"
            lane = len(clients) if cached or uncached_width is None else uncached_width
            for a in range(0, len(clients), lane):
                b = min(a + lane, len(clients))
                if max(steps[a:b]) > 0:
                    lanes_steps, lanes_offsets = tuple(steps[a:b]), tuple(offsets[a:b])
                    group_segments.append((p, phase.train, (a, b), lanes_steps, lanes_offsets, cached))
            offsets = [o + s for o, s in zip(offsets, steps)]
        for i, (p, part, lanes, steps, offs, cached) in enumerate(group_segments):
            last = i == len(group_segments) - 1
            segments.append(Segment(g, clients, lanes, p, part, steps, offs, start, cached, last))
            start += max(steps)
    return LockstepPlan(plan, tuple(segments), steps_per_call)


def _segment_batches(
    loader: ClientBatches, round_index: int, segment: Segment, first: int, stop: int | None = None
) -> Iterator[dict[str, Any]]:
    """The stacked batches of ``segment``'s steps ``first .. stop - 1`` (``None``: to its end). Each step's
    batches are padded to ``batch_size`` (shuffled batches), or under Poisson sampling to the step's largest
    batch (a batch is never cut: the privacy accounting counts every sample drawn; nor padded beyond what the
    step needs); ``mask`` marks the real rows. A cached segment's steps share one width (the largest over the steps drawn at once)."""
    k = len(segment.clients)
    batch_size = loader.batch_size
    # Poisson batches vary in size: pad each step to its largest batch only
    poisson = getattr(loader, "sampling", "shuffle") == "poisson"
    stop = segment.length if stop is None else stop
    remaining = [max(0, min(n, stop) - first) for n in segment.steps]
    if segment.cached:
        rows, mask = _cached_positions(loader, round_index, segment, first, stop - first, remaining)
        for step in range(stop - first):
            yield {"positions": rows[step], "mask": mask[step]}
        return
    sources = [
        iter(loader.client_batches(c, round_index, o + first, r)) if r else iter(())
        for c, o, r in zip(segment.clients, segment.offsets, remaining)
    ]
    for step in range(first, stop):
        active = [step < n for n in segment.steps]
        pairs = [next(sources[i]) if active[i] else None for i in range(k)]
        largest = max([1, *(_rows(p) for p in pairs if p is not None)])
        width = largest if poisson else max(batch_size, largest)
        mask = torch.zeros(k, width)
        yield {**_stack_pairs(pairs, width, mask), "mask": mask}


def _rows(pair: Any) -> int:
    """The samples in a client's ``(x, y)`` batch (0 for anything else: :func:`_stack_pairs` refuses it)."""
    if isinstance(pair, list | tuple) and pair and isinstance(pair[0], Tensor) and pair[0].dim():
        return pair[0].shape[0]
    return 0


def _cached_positions(
    loader: ClientBatches, round_index: int, segment: Segment, first: int, steps: int, remaining: list[int]
) -> tuple[Tensor, Tensor]:
    """Every step's batch positions ``[steps, K, width]`` (zero-padded) of a cached segment's steps ``first ..``
    and their mask, built per client at once instead of per step; ``width`` is ``batch_size``, or the largest
    batch of these steps where one is larger (Poisson sampling)."""
    k = len(segment.clients)
    taken = {
        i: loader.client_positions(client, round_index, offset + first, count)
        for i, (client, offset, count) in enumerate(zip(segment.clients, segment.offsets, remaining))
        if count
    }
    batch_size = max([loader.batch_size, *(len(t) for ts in taken.values() for t in ts)])
    rows = torch.zeros(steps, k, batch_size, dtype=torch.long)
    mask = torch.zeros(steps, k, batch_size)
    width = torch.arange(batch_size)
    for i, positions in taken.items():
        count = len(positions)
        padded = torch.nn.utils.rnn.pad_sequence(positions, batch_first=True)
        rows[:count, i, : padded.shape[1]] = padded
        lengths = torch.tensor([len(t) for t in positions])
        mask[:count, i] = (width < lengths[:, None]).to(mask.dtype)
    return rows, mask


def _stack_pairs(pairs: list[Any], batch_size: int, mask: Tensor) -> dict[str, Tensor]:
    """Stack per-client ``(x, y)`` batches into ``[K, batch_size, ...]`` (``batch_size``: the step's width, at
    least its largest batch), zero-padded; fills ``mask``."""
    template = next(p for p in pairs if p is not None)
    if not (
        isinstance(template, list | tuple)
        and len(template) == 2
        and all(isinstance(t, Tensor) for t in template)
    ):
        raise TypeError(
            "The vectorized runner needs training batches of (inputs, targets) tensors; "
            f"got {type(template).__name__}. Pass runner='sequential' to the strategy."
        )
    x = template[0].new_zeros((len(pairs), batch_size, *template[0].shape[1:]))
    y = template[1].new_zeros((len(pairs), batch_size, *template[1].shape[1:]))
    for i, pair in enumerate(pairs):
        if pair is not None:
            n = pair[0].shape[0]
            x[i, :n], y[i, :n] = pair
            mask[i, :n] = 1.0
    return {"x": x, "y": y}
