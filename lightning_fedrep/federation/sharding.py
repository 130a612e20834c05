"""A round, and an evaluation pass, cut into one part per process.

Lightning synchronizes the processes at every training step, so every rank must run the same number
of Lightning steps in a round. :func:`rank_schedule` deals the round's clients to the ranks (balanced by
steps, :func:`~lightning_fedrep.federation.plan.shard_round`), and pads each rank's part with idle steps to the
longest rank's, computing every rank's length locally (no collective). An idle step yields
:data:`IDLE_STEP` instead of a batch: the strategy runs nothing on it and the optimizer does not step.
:func:`evaluation_shards` deals the evaluation clients the same way, by samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_fedrep.federation.plan import RoundPlan, shard_round


class PlanBatches(Protocol):
    """What a rank's schedule draws batches from (the round's loader, ``RoundLoader``)."""

    def plan_batches(self, plan: RoundPlan, start: int) -> Iterator[Any]: ...


class StepSchedule(Protocol):
    """A round run other than one client step per Lightning step (the engine's ``LockstepPlan``)."""

    @property
    def length(self) -> int: ...

    def batches(self, loader: Any, start: int = 0) -> Iterator[Any]: ...


class IdleStep:
    """What a rank with less work than the longest rank gets instead of a batch: nothing to train."""

    def __repr__(self) -> str:
        return "IDLE_STEP"


IDLE_STEP = IdleStep()
"""The one idle item: a training step (or evaluation batch) in which this rank has nothing to do."""


@dataclass(frozen=True)
class RankSchedule:
    """This rank's part of a round: its clients' steps, then idle steps up to ``length``."""

    plan: RoundPlan
    """The whole round (every rank's clients)."""
    local: RoundPlan
    """The round restricted to this rank's clients."""
    steps: RoundPlan | StepSchedule
    """How this rank runs them: one client step per Lightning step, or in lockstep."""
    length: int
    """Lightning steps of the round on every rank (the longest rank's)."""
    lengths: tuple[int, ...] = ()
    """Each rank's Lightning steps before it idles, by rank."""

    @property
    def round(self) -> int:
        return self.plan.round

    def idle(self, step: int) -> bool:
        """Whether this rank has nothing to train at the round's ``step``-th Lightning step."""
        return step >= self.steps.length

    def batches(self, loader: PlanBatches, start: int = 0) -> Iterator[Any]:
        """This rank's batches from the round's ``start``-th step, then idle steps."""
        if start < self.steps.length:
            if isinstance(self.steps, RoundPlan):
                yield from loader.plan_batches(self.steps, start)
            else:
                yield from self.steps.batches(loader, start)
        for _ in range(max(start, self.steps.length), self.length):
            yield IDLE_STEP


def rank_schedule(
    plan: RoundPlan,
    rank: int,
    world_size: int,
    schedule: Callable[[RoundPlan, bool], RoundPlan | StepSchedule],
) -> RankSchedule:
    """``rank``'s part of ``plan`` on ``world_size`` ranks. ``schedule(local_plan, own)`` says how a rank
    runs its clients (``own``: the plan is this rank's, worth caching); every rank's length is computed
    here, so the padding needs no collective."""
    locals_ = [
        plan if share.clients == tuple(plan.clients) else plan.replace(clients=share.clients)
        for share in shard_round(plan, world_size)
    ]
    own = schedule(locals_[rank], True)
    lengths = tuple(own.length if r == rank else schedule(p, False).length for r, p in enumerate(locals_))
    return RankSchedule(plan, locals_[rank], own, max(lengths), lengths)


def evaluation_shards(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """The clients each rank evaluates: longest first to the rank with the fewest samples so far
    (ties to the lowest rank), each rank's clients in id order; clients without data go nowhere."""
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for client in sorted((c for c, n in enumerate(sizes) if n > 0), key=lambda c: (-sizes[c], c)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(client)
        loads[rank] += sizes[client]
    return [sorted(s) for s in shards]
