"""The per-process runner: a round's clients dealt to the processes, every process padded to the same
number of Lightning steps. Always on: with the one-process :class:`~lightning_fedrep.federation.collective.Collective`
this process's share is the whole round and no step is idle, so the Lightning hooks never ask how many
processes run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.plan import RoundPlan, plan_fingerprint
from lightning_fedrep.federation.run import NOTHING_RAN, Runner, StepLoss
from lightning_fedrep.federation.sharding import RankSchedule, StepSchedule, rank_schedule


class Sharded:
    """``runner`` on this process's share of each round (:func:`~lightning_fedrep.federation.sharding.rank_schedule`);
    an idle step (this process has no client left) trains nothing and steps no optimizer."""

    def __init__(self, runner: Runner, collective: Collective | None = None):
        self.runner = runner
        self.collective = collective or Collective()
        self._schedules: dict[int, RankSchedule] = {}
        self._idle = False

    @property
    def vectorized(self) -> bool:
        return self.runner.vectorized

    def schedule(self, plan: RoundPlan, own: bool = True) -> RankSchedule:
        """This process's part of the round, padded with idle steps (computed once per round plan)."""
        schedule = self._schedules.get(plan.round)
        if schedule is None or schedule.plan is not plan:
            runner, collective = self.runner, self.collective

            def how(local: RoundPlan, own: bool) -> RoundPlan | StepSchedule:
                return runner.schedule(local, own)

            schedule = rank_schedule(plan, collective.rank, collective.world_size, how)
            self._schedules = {r: v for r, v in self._schedules.items() if r >= plan.round - 1}
            self._schedules[plan.round] = schedule
        return schedule

    def open_round(self, plan: RoundPlan) -> None:
        """Every process must train the same plan: they compare its fingerprint (nothing on one process)."""
        self.collective.agree(plan_fingerprint(plan), f"the plan of round {plan.round}")
        self.runner.open_round(plan)

    def begin_step(self, plan: RoundPlan, step: int) -> None:
        schedule = self.schedule(plan)
        self._idle = schedule.idle(step)
        if not self._idle:
            self.runner.begin_step(schedule.local, step)

    def loss(self, batch: Any, batch_idx: int, user_step: Callable[[], Any]) -> Any:
        return NOTHING_RAN if self._idle else self.runner.loss(batch, batch_idx, user_step)

    def logged_loss(self) -> Sequence[StepLoss]:
        return () if self._idle else self.runner.logged_loss()

    def step(self, optimizer_step: Callable[[], Any], closure: Callable[[], Any]) -> Any:
        if self._idle:
            closure()  # it trains nothing
            return None
        return self.runner.step(optimizer_step, closure)

    def end_step(self) -> None:
        if not self._idle:
            self.runner.end_step()

    def finish(self) -> None:
        self.runner.finish()

    def abandon(self) -> None:
        self._idle = False
        self.runner.abandon()

    @property
    def current_clients(self) -> tuple[int, ...]:
        return self.runner.current_clients

    @property
    def current_phase(self) -> str | None:
        return self.runner.current_phase

    def settings(self) -> dict[str, Any] | None:
        return self.runner.settings()

    def state_dict(self) -> dict[str, Any] | None:
        return self.runner.state_dict()

    def load_settings(self, settings: dict[str, Any] | None) -> None:
        self.runner.load_settings(settings)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.runner.load_state_dict(state)
