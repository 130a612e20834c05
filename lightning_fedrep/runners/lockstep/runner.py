"""The vectorized runner: the lockstep engine (:mod:`lightning_fedrep.runners.lockstep.engine`) behind the runner
protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.run import Notify, StepLoss
from lightning_fedrep.runners.lockstep.engine import LockstepEngine
from lightning_fedrep.runners.lockstep.schedule import FusedBatches, LockstepPlan


class LockstepRunner:
    """A round's clients trained in groups, one local step of every client per Lightning step (or, fused,
    several: :attr:`LockstepEngine.steps_per_call <lightning_fedrep.runners.lockstep.engine.LockstepEngine.steps_per_call>`).

    Args:
        engine: the vectorized runner (decided and sized by :mod:`lightning_fedrep.runners.selection`).
        notify: tells the federated callbacks (``on_client_start``, ``on_client_end``).
    """

    vectorized = True

    def __init__(self, engine: LockstepEngine, notify: Notify):
        self.engine = engine
        self.notify = notify

    def schedule(self, plan: RoundPlan, own: bool = True) -> LockstepPlan:
        return self.engine.schedule(plan) if own else self.engine.build_schedule(plan)

    def open_round(self, plan: RoundPlan) -> None:
        pass  # each group takes its clients' lr_scale from the plan when it opens

    def begin_step(self, plan: RoundPlan, step: int) -> None:
        for client in self.engine.begin_step(self.engine.schedule(plan), step):
            self.notify("on_client_start", client)

    def loss(self, batch: Any, batch_idx: int, user_step: Callable[[], Any]) -> Any:
        if isinstance(batch, FusedBatches):
            return self.engine.fused_loss(batch)
        return self.engine.loss(batch)  # the user's step does not run: the declared loss does

    def logged_loss(self) -> list[StepLoss]:
        return self.engine.call_losses()

    def step(self, optimizer_step: Callable[[], Any], closure: Callable[[], Any]) -> None:
        closure()  # loss and backward; every client's optimizer steps in end_step

    def end_step(self) -> None:
        self._hand_over(self.engine.end_step())

    def finish(self) -> None:
        self._hand_over(self.engine.finish_group())
        result = self.engine.federation.finish_client()
        if result is not None:
            self.notify("on_client_end", result)

    def _hand_over(self, results: list[Any]) -> None:
        for result in results:
            self.notify("on_client_end", result)

    def abandon(self) -> None:
        self.engine.abandon()

    @property
    def current_clients(self) -> tuple[int, ...]:
        if self.engine.segment is not None:
            return self.engine.segment.clients
        client = self.engine.federation.live_client
        return () if client is None else (client,)

    @property
    def current_phase(self) -> str | None:
        segment = self.engine.segment
        return segment.part if segment is not None else self.engine.federation.live_phase

    def settings(self) -> dict[str, Any]:
        return self.engine.settings()

    def state_dict(self) -> dict[str, Any] | None:
        return self.engine.state_dict()

    def load_settings(self, settings: dict[str, Any] | None) -> None:
        self.engine.load_settings(settings)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.engine.load_state_dict(state)
