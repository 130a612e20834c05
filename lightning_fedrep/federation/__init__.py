"""``Federation``: the federated state and the round state machine, with no Lightning in it.

A federation owns the global shared tensors, every client's local tensors (a :class:`ClientStore`),
the run's :class:`History`, and the open round: its plan, the live client and phase, the running
weighted average. It drives one live ``nn.Module`` and its optimizers by copying tensors into the
module's own parameters (never rebinding them), so the optimizers keep working:

    plan(r) -> open_round(plan) -> [load_client(c) -> begin_step/end_step ... -> finish_client()]*
            -> close_round()

The Lightning strategy (:mod:`lightning_fedrep.lightning.strategy`) calls these from its hooks; tests and
other runtimes can drive a federation directly.

Its parts live in one module each: :mod:`.state` (stored state, fingerprint, ``state_dict``), :mod:`.round`
(open -> finish client -> close / rollback), :mod:`.live` (the live module, phases, optimizer and evaluation
swaps) and :mod:`.ranks` (clients between processes), over :mod:`.store` (the client store); a round
aggregates with :mod:`.api.aggregation` (``ClientUpdate``, ``Aggregator``, ``WeightedMean``, ``Stacked``).
The rest of this folder is the core around it: the algorithm API (:mod:`.api`) and the built-in algorithms
(:mod:`.algorithms`), the user's module as the core sees it (:mod:`.module`), round plans (:mod:`.plan`),
processes (:mod:`.sharding`, :mod:`.collective`), the run's history (:mod:`.history`), the fit driven step by
step (:mod:`.run`) and the checkpoint format (:mod:`.checkpoint`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.aggregation import (
    Aggregator,
    ClientFault,
    ClientUpdate,
    Stacked,
    WeightedAverage,
    WeightedMean,
)
from lightning_fedrep.federation.api.algorithm import Algorithm, Part
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.history import History
from lightning_fedrep.federation.live import LiveModule
from lightning_fedrep.federation.module.split import TensorLayout
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.ranks import RankTransfer
from lightning_fedrep.federation.round import (
    ClientFaultError,
    ClientFaultWarning,
    ClientResult,
    RoundResult,
    RoundTransaction,
    _LiveClient,
    _RoundStart,
)
from lightning_fedrep.federation.state import (
    STATE_VERSION,
    FederationConfig,
    FederationMismatch,
    FederationState,
    clients_fingerprint,
    federation_fingerprint,
    fingerprint_changes,
)
from lightning_fedrep.federation.store import ClientStore

__all__ = [
    "STATE_VERSION",
    "Aggregator",
    "ClientFault",
    "ClientFaultError",
    "ClientFaultWarning",
    "ClientResult",
    "ClientUpdate",
    "Federation",
    "FederationConfig",
    "FederationMismatch",
    "RoundResult",
    "Stacked",
    "WeightedMean",
    "clients_fingerprint",
    "federation_fingerprint",
    "fingerprint_changes",
]


class Federation(FederationState, RoundTransaction, LiveModule, RankTransfer):
    """The federated state and the round state machine of one federated training.

    Args:
        algorithm: what the server shares and how it aggregates.
        layout: which named tensors of the module are shared and which are local.
        config: sampling, phases, weighting and optimizer-state settings.
    """

    def __init__(self, algorithm: Algorithm, layout: TensorLayout, config: FederationConfig):
        self.algorithm = algorithm
        self.layout = layout
        self.config = config
        self.global_state: list[Tensor] | None = None
        self.server_tensors: dict[str, Tensor] = {}
        """The algorithm's declared server tensors by name (``Algorithm.server_tensors``)."""
        self.store: ClientStore | None = None
        self.history = History()
        self.faults: list[ClientFault] = []
        """Every client left out of a round so far (checkpointed)."""
        self.saved_federation: dict[str, Any] | None = None
        """The fingerprint of the federation the loaded checkpoint was saved with."""
        self.partition = 0
        self.client_sizes: tuple[int, ...] | None = None
        self.batch_size = 1
        self.round_index = -1
        self.round_open = False
        self.live_phase: Part | None = None
        self.timing = False
        """Measure each client's step times (``ClientResult.seconds``); set when a callback needs it."""
        self.clock: Callable[[], float] = time.perf_counter
        """What times the steps: wall-clock seconds; tests set a fake clock that their steps advance."""
        self.collective: Collective = Collective()
        """The processes the round's clients are sharded over (set by the distributed strategy)."""
        self._module: nn.Module | None = None
        self._device = torch.device("cpu")
        self._named: dict[str, Tensor] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._plans: dict[int, RoundPlan] = {}
        self._average: Aggregator | None = None
        """The open round's aggregator (the algorithm's choice; ``WeightedMean`` by default)."""
        self._local_average: WeightedAverage | None = None
        """``first_state="average"``: the round's weighted sum of the participants' local tensors."""
        self._finished: list[ClientResult] = []
        self._starts: dict[int, dict[str, Tensor]] = {}
        """The open round's started clients not yet finished: the starting values ``start_client`` changed."""
        self._live: _LiveClient | None = None
        self._eval_stash: list[Tensor] | None = None
        self._eval_client: int | None = None
        self._eval_tensors: dict[int, dict[str, Tensor]] = {}
        self._before_round: _RoundStart | None = None
