"""The sequential runner: one client step per Lightning step, the user's own ``training_step``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.run import NOTHING_RAN, Notify
from lightning_fedrep.plan import RoundPlan


class SequentialRunner:
    """Trains a round's clients one after another: at each step it loads the step's client (handing the
    previous one to the federation), sets its phase, runs the user's step and adds the loss terms.

    Args:
        federation: the federated state the clients are loaded from and stored into.
        notify: tells the federated callbacks (``on_client_start``, ``on_client_end``).
        terms: the step's loss terms (``terms(batch, batch_idx)``), or ``None`` for none.
    """

    vectorized = False

    def __init__(
        self,
        federation: Federation,
        notify: Notify,
        terms: Callable[[Any, int], list[Any]] | None = None,
    ):
        self.federation = federation
        self.notify = notify
        self.terms = terms
        self._idle = False
        self._client_step = 0

    def schedule(self, plan: RoundPlan, own: bool = True) -> RoundPlan:
        return plan

    def open_round(self, plan: RoundPlan) -> None:
        pass

    def begin_step(self, plan: RoundPlan, step: int) -> None:
        federation = self.federation
        location = plan.locate(step)
        if location.client != federation.live_client:
            self.finish()
            federation.load_client(location.client)
            self.notify("on_client_start", location.client)
        self._idle = federation.live_failed  # its step raised earlier in the round (on_client_error="skip")
        if not self._idle:
            federation.begin_step(location)
            self._client_step = location.client_step

    def loss(self, batch: Any, batch_idx: int, user_step: Callable[[], Any]) -> Any:
        if self._idle:
            return NOTHING_RAN
        try:
            output = user_step()
        except Exception as error:
            if self.federation.config.on_client_error != "skip":
                raise
            self.federation.fail_live_client(self._client_step, error)
            return NOTHING_RAN
        if self.terms is None:
            return output
        return _with_terms(output, lambda: self.terms(batch, batch_idx))

    def logged_loss(self) -> None:
        return None  # the user's step logs its own

    def step(self, optimizer_step: Callable[[], Any], closure: Callable[[], Any]) -> Any:
        if self._idle:
            closure()  # it trains nothing
            return None
        return optimizer_step()

    def end_step(self) -> None:
        self.federation.end_step()

    def finish(self) -> None:
        result = self.federation.finish_client()
        if result is not None:
            self.notify("on_client_end", result)

    def abandon(self) -> None:
        self._idle = False

    @property
    def current_clients(self) -> tuple[int, ...]:
        client = self.federation.live_client
        return () if client is None else (client,)

    @property
    def current_phase(self) -> str | None:
        return self.federation.live_phase

    def settings(self) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_settings(self, settings: dict[str, Any] | None) -> None:
        pass

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


def _with_terms(output: Any, terms: Callable[[], list[Any]]) -> Any:
    """``output`` (a loss, or a dict with ``"loss"``) plus every term that is not ``None``."""
    loss = output["loss"] if isinstance(output, dict) else output
    if loss is None:
        return output
    for extra in terms():
        if extra is not None:
            loss = loss + extra
    return {**output, "loss": loss} if isinstance(output, dict) else loss
