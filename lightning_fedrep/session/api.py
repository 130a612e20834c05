"""``FederatedStrategyAPI``: what a federated callback may use of the Trainer's strategy, the accessors of
:class:`~lightning_fedrep.session.session.FederatedSession` that every federated strategy inherits."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning_fedrep.evaluation.metrics import ClientMetrics
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.plan import RoundPlan


@runtime_checkable
class FederatedStrategyAPI(Protocol):
    """What a federated callback may use of the Trainer's strategy (``FederatedStrategy`` implements it)."""

    algorithm: Algorithm
    client_metrics: dict[str, ClientMetrics]

    @property
    def current_client(self) -> int | None: ...

    @property
    def current_clients(self) -> tuple[int, ...]: ...

    @property
    def current_phase(self) -> str | None: ...

    @property
    def history(self) -> list[dict[str, Any]]: ...

    @property
    def faults(self) -> list[Any]: ...

    @property
    def evaluated_clients(self) -> list[int]: ...

    def require_federation(self) -> Federation: ...

    def round_plan(self, round_index: int) -> RoundPlan: ...

    def results(self) -> dict[str, dict[str, float]]: ...
