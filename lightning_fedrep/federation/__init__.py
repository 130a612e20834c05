"""``Federation``: the federated state and the round state machine, with no Lightning in it.

A federation owns the global shared tensors, every client's local tensors (a :class:`ClientStore`),
the run's :class:`History`, and the open round: its plan, the live client and phase, the running
weighted average. It drives one live ``nn.Module`` and its optimizers by copying tensors into the
module's own parameters (never rebinding them), so the optimizers keep working:

    plan(r) -> open_round(plan) -> [load_client(c) -> begin_step/end_step ... -> finish_client()]*
            -> close_round()

The Lightning strategy (:mod:`lightning_fedrep.lightning.strategy`) calls these from its hooks; tests and
other runtimes can drive a federation directly.

It is composed of four parts, one object and module each, each given the parts it works with:
``federation.state`` (:class:`~.state.FederationState`: settings, stored state, fingerprint, ``state_dict``),
``federation.live`` (:class:`~.live.LiveModule`: the live module, phases, optimizer and evaluation swaps),
``federation.ranks`` (:class:`~.ranks.RankTransfer`: clients between processes) and ``federation.rounds``
(:class:`~.round.RoundTransaction`: open -> finish client -> close / rollback), over :mod:`.store` (the
client store); the federation answers for them (its attributes are theirs) and ties them together. A round
aggregates with :mod:`.api.aggregation` (``ClientUpdate``, ``Aggregator``, ``WeightedMean``, ``Stacked``).
The rest of this folder is the core around it: the algorithm API (:mod:`.api`) and the built-in algorithms
(:mod:`.algorithms`), the user's module as the core sees it (:mod:`.module`), round plans (:mod:`.plan`),
processes (:mod:`.sharding`, :mod:`.collective`), the run's history (:mod:`.history`), the fit driven step by
step (:mod:`.run`) and the checkpoint format (:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import (
    Aggregator,
    ClientFault,
    ClientUpdate,
    Stacked,
    WeightedMean,
)
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.live import LiveModule
from lightning_fedrep.federation.module.split import TensorLayout
from lightning_fedrep.federation.ranks import RankTransfer
from lightning_fedrep.federation.round import (
    ClientFaultError,
    ClientFaultWarning,
    ClientResult,
    RoundResult,
    RoundTransaction,
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


_PARTS: dict[str, type] = {
    "state": FederationState,
    "live": LiveModule,
    "ranks": RankTransfer,
    "rounds": RoundTransaction,
}


class _Part:
    """A federation attribute answered by one of its parts: ``name = _Part("rounds")`` reads
    ``federation.rounds.name`` (``attribute``: under another name there); ``writable``: set there too.
    It carries the docstring of the part's method or property (none for a plain attribute)."""

    def __init__(self, part: str, attribute: str | None = None, writable: bool = False):
        self.part, self.attribute, self.writable = part, attribute, writable

    def __set_name__(self, owner: type, name: str) -> None:
        self.attribute = self.attribute or name
        self.__doc__ = getattr(getattr(_PARTS[self.part], self.attribute, None), "__doc__", None)

    def __get__(self, federation: Any, owner: type | None = None) -> Any:
        if federation is None:
            return self
        return getattr(getattr(federation, self.part), self.attribute)

    def __set__(self, federation: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(
                f"Federation.{self.attribute} is federation.{self.part}.{self.attribute}'s, read-only here."
            )
        setattr(getattr(federation, self.part), self.attribute, value)


class Federation:
    """The federated state and the round state machine of one federated training.

    Composed of four parts, each an object with its own state: :attr:`state` (the stored state),
    :attr:`live` (the live module), :attr:`ranks` (the processes) and :attr:`rounds` (the open round). Their
    public attributes and methods are the federation's (``federation.close_round()`` is
    ``federation.rounds.close_round()``); the few that touch several parts are the federation's own.

    Args:
        algorithm: what the server shares and how it aggregates.
        layout: which named tensors of the module are shared and which are local.
        config: sampling, phases, weighting and optimizer-state settings.
    """

    def __init__(self, algorithm: Algorithm, layout: TensorLayout, config: FederationConfig):
        self.state = FederationState(algorithm, layout, config)
        """The stored state: settings, global, server and client tensors, history (``state_dict``)."""
        self.live = LiveModule(self.state)
        """The module the clients' tensors are made live in, its optimizers and the evaluation swaps."""
        self.ranks = RankTransfer(self.state, Collective())
        """The processes the round's clients are sharded over (their collective set by the distributed strategy)."""
        self.rounds = RoundTransaction(self.state, self.live, self.ranks)
        """The round state machine: plan, open, live client, finish client, close or roll back."""

    # the stored state (state.py)
    algorithm = _Part("state")
    layout = _Part("state")
    config = _Part("state")
    global_state = _Part("state")
    server_tensors = _Part("state")
    store = _Part("state")
    history = _Part("state")
    faults = _Part("state")
    saved_federation = _Part("state")
    partition = _Part("state")
    client_sizes = _Part("state")
    batch_size = _Part("state")
    split = _Part("state")
    shared_names = _Part("state")
    local_names = _Part("state")
    num_clients = _Part("state")
    has_state = _Part("state")
    evaluation_spec = _Part("state")
    global_tensors = _Part("state")
    global_view = _Part("state")
    client_tensors = _Part("state")
    check_client = _Part("state")
    personalized_state = _Part("state")
    scored_tensors = _Part("state")
    adopt_new_federation = _Part("state")
    fingerprint = _Part("state")
    federation_changes = _Part("state")

    # the live module (live.py)
    module = _Part("live")
    live_phase = _Part("live", "phase")
    attach = _Part("live")
    set_phase = _Part("live")
    release_phases = _Part("live")
    evaluate_client = _Part("live")
    set_evaluation_tensors = _Part("live")
    evaluation_tensors = _Part("live")
    load_personalized = _Part("live")
    scoring = _Part("live")
    scored_forward = _Part("live")

    # the processes (ranks.py)
    collective = _Part("ranks", writable=True)
    shard_clients = _Part("ranks")
    gather_clients = _Part("ranks")
    gathered_store_state = _Part("ranks")
    restore_round_records = _Part("ranks")

    # the round (round.py)
    round_index = _Part("rounds")
    round_open = _Part("rounds")
    timing = _Part("rounds", writable=True)
    clock = _Part("rounds", writable=True)
    live_client = _Part("rounds")
    live_slot = _Part("rounds")
    live_failed = _Part("rounds")
    plan = _Part("rounds")
    open_round = _Part("rounds")
    load_client = _Part("rounds")
    begin_step = _Part("rounds")
    end_step = _Part("rounds")
    put_live_state = _Part("rounds")
    put_step_state = _Part("rounds")
    begin_client = _Part("rounds")
    bind_samples = _Part("rounds")
    client_samples = _Part("rounds")
    start_tensors = _Part("rounds")
    store_client = _Part("rounds")
    weight_of = _Part("rounds")
    fail_live_client = _Part("rounds")
    finish_client = _Part("rounds")
    close_round = _Part("rounds")
    rollback_round = _Part("rounds")
    restore_round = _Part("rounds")

    # what ties several parts together
    def initialize(self, device: torch.device) -> None:
        """Snapshot the global shared part and the initial local part from the attached module (first
        time), or move the existing state to ``device``."""
        self.state.initialize(device, self.live.named)

    def bind_data(self, client_sizes: Sequence[int], batch_size: int, partition: int = 0) -> None:
        """Bind the training data: ``client_sizes``, the clients' training-set sizes (aggregation weights,
        epoch budgets), the ``batch_size``, and ``partition``, a checksum of which samples each client holds
        (part of the federation's fingerprint); rounds are planned anew."""
        self.state.bind_data(client_sizes, batch_size, partition)
        self.rounds.forget_plans()

    def update_global(self, tensors: Mapping[str, Tensor]) -> None:
        """Overwrite some of the global shared tensors (e.g. a server step after aggregation); between
        rounds, the module gets them too."""
        self.state.update_global(tensors)
        if not self.rounds.round_open:
            self.live.write_global()

    def update_client(self, client: int, tensors: Mapping[str, Tensor]) -> None:
        """Overwrite some of ``client``'s local tensors (e.g. a server step on the heads); the module gets
        them too if ``client`` is live."""
        local = self.state.update_client(client, tensors)
        if client == self.rounds.live_client:
            self.live.write(self.state.local_names, local)

    def record(self, **values: float) -> None:
        """Add columns to the history row of the current (or just closed) round."""
        self.state.history.record(self.rounds.round_index, {k: float(v) for k, v in values.items()})

    def begin_evaluation(self) -> None:
        """Evaluate the global shared part; keep the live client's training tensors aside if mid-round."""
        self.state.require_state()
        self.live.begin_evaluation(keep_training=self.rounds.pause_client())

    def end_evaluation(self) -> None:
        """Put back what training had live before the evaluation."""
        self.live.end_evaluation(self.rounds.live_client)

    def declared_names(self, named: Mapping[str, Any] | None = None) -> tuple[list[str], list[str]]:
        """The names of the algorithm's declared client and server tensors in this layout (``named``: the
        model's tensors by name, whose shapes size a ``shapes=callable``; default: the attached module's)."""
        return self.state.declared_names(self.live.named if named is None else named)

    def check_declared(self, state: Mapping[str, Any], path: Any) -> None:
        """Refuse a checkpoint's federated ``state`` (read from ``path``) that lacks declared tensors this
        run's algorithm needs (e.g. a version-2 file, which holds none), naming them and what to do."""
        self.state.check_declared(state, path, self.live.named)

    def round_records(self) -> dict[str, Any]:
        """What only this process holds in the open round (saved with its open round): the clients it
        finished in the round (the others receive them when it closes) and those it borrowed."""
        return self.ranks.round_records(r.client for r in self.rounds.finished if not r.fault)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the federation exactly (tensors, ints, strings, lists, dicts)."""
        return self.state.state_dict(self.rounds.state_dict())

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | None = None, path: Any = "The checkpoint"
    ) -> None:
        """Restore the global state, every client and the history from ``state`` (any stage), on ``device``
        (``None``: where its tensors are). The open round is restored separately by :meth:`restore_round`,
        once the optimizers exist. A state that lacks tensors the algorithm declares (a version-2 file) is
        refused (:meth:`check_declared`), naming ``path``."""
        self.state.load_state_dict(state, self.live.named, device, path)
