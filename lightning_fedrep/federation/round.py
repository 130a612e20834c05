"""The round as a transaction: open -> client steps -> finish client -> close (aggregate) or roll back.

:class:`RoundTransaction` is the part of :class:`~lightning_fedrep.federation.Federation` that runs a
round: it plans it, opens it, stores each client that finishes (handing the server a
:class:`~lightning_fedrep.federation.api.aggregation.ClientUpdate`, or a :class:`ClientFault` for a client left
out), and closes it through the algorithm's aggregator, or undoes it.
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, ClientUpdate, WeightedAverage
from lightning_fedrep.federation.api.algorithm import PART_GROUPS, Algorithm
from lightning_fedrep.federation.api.exchange import (
    ClientEnd,
    ClientMap,
    ClientOutcome,
    ClientSamples,
    ClientStart,
    RoundResults,
    ServerState,
    StartOutcome,
)
from lightning_fedrep.federation.plan import (
    RoundPlan,
    StepLocation,
    plan_round,
    round_generator,
    sample_clients,
)
from lightning_fedrep.federation.store import OptimizerState

if TYPE_CHECKING:
    from lightning_fedrep.federation.live import LiveModule
    from lightning_fedrep.federation.ranks import RankTransfer
    from lightning_fedrep.federation.state import FederationState

ReadSamples = Callable[[int, int, Sequence[Tensor]], Iterator[Any]]
"""``read(client, round, positions)``: the client's training samples at each tensor of ``positions`` (into its own
samples), one batch each, as the training step receives them (what ``ClientStart.data`` reads)."""

START_DATA_KEY = 0x57A7
"""A key of ``ClientSamples.generator``'s seed ``(seed, round, START_DATA_KEY, client, crc32(key))``: no other
generator of the package (plans, batch orders) is seeded with it after the round."""


@dataclass(frozen=True)
class ClientResult:
    """What one client did in a round (``FederatedCallback.on_client_end``).

    ``steps`` counts the local steps it ran (in this process); ``seconds`` is the wall-clock time of
    its ``timed_steps``: every step but the first after the client was loaded (which pays for the
    swap) and the round's last step (which pays for the aggregation). Timing runs only when a
    callback asks for it; otherwise ``seconds`` is 0.
    """

    round: int
    client: int
    steps: int
    timed_steps: int
    seconds: float
    fault: str = ""
    """Why the client was left out of the round (non-finite values, an error); ``""`` if it was not."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What ``Algorithm.finish_client`` reported for the client (``ClientOutcome.metrics``)."""


class ClientFaultError(RuntimeError):
    """A client failed under the ``"raise"`` policy (``on_nonfinite`` / ``on_client_error``)."""


class ClientFaultWarning(UserWarning):
    """A client was left out of a round under the ``"skip"`` policy."""


@dataclass(frozen=True)
class RoundResult:
    """A closed round (``FederatedCallback.on_round_end``): its plan, what each client did, whether the
    shared state was replaced by the aggregate."""

    round: int
    plan: RoundPlan
    clients: tuple[ClientResult, ...]
    """What each client that trained did (:class:`ClientResult`), on several processes every rank's."""
    aggregated: bool
    """Whether the shared state was replaced by the aggregate (``False``: a local-only round, or none survived)."""
    weight: float = 0.0
    """The total aggregation weight of the participants (samples, or their count when uniform)."""
    faults: tuple[ClientFault, ...] = ()
    """The clients left out of the round, and why."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The columns the round's close wrote to its history row: the server step's metrics
    (``Algorithm.aggregate``), the privacy mechanism's (``privacy/epsilon``, ...), the mean of what the clients'
    ``finish_client`` reported, and ``faults`` (clients left out); the strategy logs them once per round."""


@dataclass
class _RoundStart:
    """What the open round may change, as it was when the round opened (for :meth:`RoundTransaction.rollback_round`)."""

    round_index: int
    rng: Tensor
    finetuned: dict[int, dict[str, Tensor]]
    clients: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each client stored in the round so far: its record before the round."""
    cuda_rng: list[Tensor] | None = None
    """Every GPU's generator state, where CUDA is in use."""


@dataclass
class _LiveClient:
    client: int
    steps: int = 0
    timed_steps: int = 0
    seconds: float = 0.0
    fresh: bool = True
    step_started: float | None = field(default=None, repr=False)
    fault: str = ""
    slot: str = "model"
    """The slot live in the module: ``"model"``, or a declared per-client slot (Ditto's ``"personal"``)."""
    model: list[Tensor] | None = field(default=None, repr=False)
    """While a declared slot is live: the model slot's values, put back when the slot's phase ends."""
    slot_values: dict[str, Tensor] = field(default_factory=dict, repr=False)
    """Declared slots trained this round (``"<slot>.<name>"``), stored when the client finishes."""


class RoundTransaction:
    """The round state machine of a :class:`~lightning_fedrep.federation.Federation`: the open round (its
    plan, live client, aggregator, finished clients and what rolls it back) over the federation's ``state``,
    written into ``live`` and moved between processes by ``ranks``.

    Args:
        state: the stored state the round reads and changes (global, server and client tensors, history).
        live: the live module the live client's tensors are written into.
        ranks: the processes the round's clients are sharded over.
    """

    def __init__(self, state: FederationState, live: LiveModule, ranks: RankTransfer):
        self.state = state
        self.live = live
        self.ranks = ranks
        self.round_index = -1
        self.round_open = False
        self.timing = False
        """Measure each client's step times (``ClientResult.seconds``); set when a callback needs it."""
        self.clock: Callable[[], float] = time.perf_counter
        """What times the steps: wall-clock seconds; tests set a fake clock that their steps advance."""
        self._plans: dict[int, RoundPlan] = {}
        self._average: Aggregator | None = None
        """The open round's aggregator (the algorithm's choice; ``WeightedMean`` by default)."""
        self._local_average: WeightedAverage | None = None
        """``first_state="average"``: the round's weighted sum of the participants' local tensors."""
        self._finished: list[ClientResult] = []
        self._starts: dict[int, dict[str, Tensor]] = {}
        """The open round's started clients not yet finished: the starting values ``start_client`` changed."""
        self._client: _LiveClient | None = None
        self._before_round: _RoundStart | None = None
        self._read_samples: ReadSamples | None = None
        """How ``ClientStart.data`` reads a client's training samples (:meth:`bind_samples`)."""

    @property
    def live_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between clients)."""
        return None if self._client is None else self._client.client

    @property
    def finished(self) -> tuple[ClientResult, ...]:
        """The clients that finished in the open round (in this process)."""
        return tuple(self._finished)

    def bind_samples(self, read: ReadSamples | None) -> None:
        """Where ``ClientStart.data`` reads a client's training samples: ``read(client, round, positions)``, one
        batch per tensor of positions into the client's own samples, as the training step receives them (the
        strategy binds the round's training loader; ``None``: no data, ``ClientStart.data`` is ``None``)."""
        self._read_samples = read

    def client_samples(self, client: int) -> ClientSamples | None:
        """``client``'s training samples in the open round, as ``Algorithm.start_client`` and ``finish_client``
        read them."""
        read, round_index = self._read_samples, self.round_index
        if read is None:
            return None
        seed, privacy = self.state.config.seed, self.state.config.privacy
        if getattr(privacy, "batch_sampling", None) is not None:
            read = _refused_under(privacy)
        return ClientSamples(
            client=client,
            round=round_index,
            num_samples=int(self.state.require_data()[client]),
            batch_size=int(self.state.batch_size),
            read=lambda positions: read(client, round_index, positions),
            seeded=lambda key: round_generator(
                seed, round_index, START_DATA_KEY, client, zlib.crc32(key.encode())
            ),
        )

    def forget_plans(self) -> None:
        """Plan every round anew (the clients' data changed)."""
        self._plans = {}

    def load_client(self, client: int) -> None:
        """Make ``client`` live: the round's global shared part, its local part (as ``Algorithm.start_client``
        changes them) and, if kept, its optimizer state (the shared part's optimizer state restarts)."""
        self.live.write_personal(client)
        self._client = _LiveClient(client)
        self.live.phase = None
        changed = self.begin_client(client)  # Algorithm.start_client, where overridden
        self.live.write(list(changed), list(changed.values()))
        self.live.load_optimizer_state(self.state.store.optimizer_states.get(client, {}))

    def pause_client(self) -> bool:
        """An evaluation interrupts the round: whether a client is live mid-round (its next step is then
        not timed, as after a swap)."""
        if self.round_open and self._client is not None:
            self._client.fresh = True
            return True
        return False

    def plan(self, round_index: int, configure: Callable[[RoundPlan], RoundPlan] | None = None) -> RoundPlan:
        """The frozen plan of a round: its sampled clients and their phases' step counts, passed once
        through the algorithm's ``configure_round`` and then ``configure`` (the federated callbacks) when
        the round is first planned."""
        sizes = self.state.require_data()
        plan = self._plans.get(round_index)
        if plan is None:
            seed = self.state.config.seed
            clients = sample_clients(len(sizes), self.state.config.clients_per_round, seed, round_index)
            plan = plan_round(
                round_index, clients, self.state.config.phases, sizes, self.state.batch_size, seed=seed
            )
            plan = self._algorithm_plan(plan)
            if configure is not None:
                plan = configure(plan)
            self._plans = {r: p for r, p in self._plans.items() if r >= round_index - 1}
            self._plans[round_index] = plan
        return plan

    def _algorithm_plan(self, plan: RoundPlan) -> RoundPlan:
        """``plan`` after ``Algorithm.configure_round``, with a read-only view of the server state the round
        starts from (global shared tensors, declared server tensors)."""
        if type(self.state.algorithm).configure_round is Algorithm.configure_round:
            return plan  # the default returns the plan unchanged: no server view to copy
        server = ServerState(
            {k: v.detach().clone() for k, v in self.state.global_view().items()},
            {k: v.detach().clone() for k, v in self.state.server_tensors.items()},
            len(self.state.require_data()),
        )
        changed = self.state.algorithm.configure_round(plan, server)
        if not isinstance(changed, RoundPlan) or changed.round != plan.round:
            raise TypeError(
                f"{type(self.state.algorithm).__name__}.configure_round must return a RoundPlan for round {plan.round} "
                f"(the plan it was given, or plan.replace(clients=..., settings=...)), got {changed!r}."
            )
        return changed

    def open_round(self, plan: RoundPlan) -> None:
        """Start training round ``plan.round``."""
        self.state.require_state()
        if self.state.config.privacy is not None:
            self.state.config.privacy.open_round(plan)
        aggregator = self._new_aggregator(plan) if plan.aggregate else None
        self._before_round = _RoundStart(
            self.round_index,
            torch.get_rng_state(),
            dict(self.state.store.finetuned),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        )
        self.round_index = plan.round
        self.round_open = True
        if plan.aggregate:
            self.state.store.finetuned.clear()  # a new federated round makes earlier fine-tuning stale
        if self.state.store.sharded:
            self.ranks.lend_clients(plan)
        self._average = aggregator
        self._local_average = self._new_local_average(plan.aggregate)
        self._finished = []
        self._starts = {}

    def _new_aggregator(self, plan: RoundPlan) -> Aggregator | None:
        """The algorithm's aggregator for the round (``WeightedMean`` unless it chooses another), or ``None``
        when it receives nothing (no shared tensors and no names of the algorithm's own: Local)."""
        mechanism = self.state.config.privacy
        if mechanism is not None:
            mechanism.prepare(len(self.state.require_data()), len(plan.clients))
        aggregator = self._aggregator(plan.round)
        if not isinstance(aggregator, Aggregator):
            raise TypeError(
                f"{type(self.state.algorithm).__name__}.aggregator() must return an Aggregator (e.g. WeightedMean or "
                f"Stacked from lightning_fedrep.federation.api.aggregation), got {type(aggregator).__name__}."
            )
        if not aggregator.names:
            return None
        aggregator.expect(len(plan.clients))
        return aggregator

    def _aggregator(self, round_index: int) -> Aggregator:
        """A new aggregator for round ``round_index``: the privacy mechanism's where it has one (in place of the
        algorithm's, :mod:`~lightning_fedrep.federation.api.mechanism`), else ``Algorithm.aggregator``."""
        like = self.state.global_view()
        mechanism = self.state.config.privacy
        private = (
            None if mechanism is None else mechanism.aggregator(like, round_index, self.state.config.seed)
        )
        return self.state.algorithm.aggregator(like) if private is None else private

    def _new_local_average(self, aggregate: bool) -> WeightedAverage | None:
        """A running average of the local part when untrained clients start from it (``first_state``)."""
        if self.state.config.first_state != "average" or not aggregate or not self.state.local_names:
            return None
        return WeightedAverage(self.state.store.template)

    def begin_step(self, location: StepLocation) -> None:
        """Before the live client's step at ``location``: set the phase, start its timer if timed."""
        live = self._client
        slot = self.plan(self.round_index).phases[location.phase_index].slot
        if slot != live.slot:
            self._make_live(slot)
        if location.part != self.live.phase:
            self.live.set_phase(location.part)
        live.steps += 1
        timed = self.timing and not live.fresh and not location.last_of_round
        live.fresh = False
        live.step_started = self._clock() if timed else None

    @property
    def live_slot(self) -> str:
        """The slot the live client trains (``"model"`` between clients)."""
        return "model" if self._client is None else self._client.slot

    @torch.no_grad()
    def _make_live(self, slot: str) -> None:
        """Make the live client's ``slot`` live in the module's own parameters (the model slot is kept
        aside meanwhile, a declared slot's values kept for the store); its optimizer state restarts."""
        live, names = self._client, self.state.shared_names + self.state.local_names
        if live.slot != "model":
            live.slot_values.update(
                {f"{live.slot}.{n}": t.detach().clone() for n, t in zip(names, self.live.tensors(names))}
            )
            self.live.write(names, live.model)
            live.model = None
        if slot != "model":
            live.model = [t.detach().clone() for t in self.live.tensors(names)]
            values = {**self.state.store.client_state(live.client), **live.slot_values}
            self.live.write(names, [values[f"{slot}.{n}"] for n in names])
        live.slot = slot
        self.live.clear_optimizer_state()

    def end_step(self) -> None:
        """After the live client's step (its optimizer step): stop its timer."""
        live = self._client
        if live is not None and live.step_started is not None:
            live.seconds += self._clock() - live.step_started
            live.timed_steps += 1
            live.step_started = None

    def put_live_state(self, tensors: Mapping[str, Tensor]) -> None:
        """New values of some of the live client's declared tensors, from a step (a ``StepRule``'s
        ``client_state``): stored now (a rolled-back round restores what it held before the round)."""
        if self._client is not None:
            self.put_step_state(self._client.client, tensors)

    def put_step_state(self, client: int, tensors: Mapping[str, Tensor]) -> None:
        """New values of some of a training client's declared tensors, from its step (the lockstep runner's
        clients are not live): stored now, restored if the round is rolled back or the client left out."""
        if not tensors:
            return
        self._remember_before(client)
        self.state.store.put_state(client, tensors)

    def _remember_before(self, client: int) -> None:
        """Keep what ``client`` held before the round, the first time the round changes it (for rollback)."""
        if self._before_round is None or client in self._before_round.clients:
            return
        record = self.state.store.record(client)
        self._before_round.clients[client] = {
            "local": None if record["local"] is None else [t.detach().clone() for t in record["local"]],
            "optimizer": record["optimizer"],  # replaced, never modified in place
            "finetuned": record["finetuned"],
            "tensors": record["tensors"],  # copies already
        }

    def finish_client(self) -> ClientResult | None:
        """Store the live client's state and add its shared part to the round's average."""
        live = self._client
        if live is None:
            return None
        names = self.state.shared_names + self.state.local_names
        keep = self.state.config.client_optimizer_state == "keep"
        if live.slot != "model":
            self._make_live("model")
        if live.fault:
            result = self._leave_out(live.client, live.steps, live.fault)
        else:
            result = self.store_client(
                live.client,
                dict(zip(names, self.live.tensors(names))),
                self.live.optimizer_snapshot() if keep else None,
                live.steps,
                live.timed_steps,
                live.seconds,
                live.slot_values,
            )
        self._client = None
        self.live.phase = None
        return result

    def start_tensors(self, client: int) -> dict[str, Tensor]:
        """A client's tensors at the start of its round by name (not copies): the global shared part,
        its local part, what it fine-tuned, and what ``Algorithm.start_client`` changed (:meth:`begin_client`)."""
        return {
            **self.state.global_view(),
            **self.state.store.personal(client, self.state.local_names),
            **self._starts.get(client, {}),
        }

    def begin_client(self, client: int) -> dict[str, Tensor]:
        """``client`` starts its work in the open round: ``Algorithm.start_client`` runs (where the algorithm
        overrides it, in a round that aggregates, once per client and round), its new declared tensors are
        stored (undone with the client if it is left out) and the starting values it changed are kept for
        :meth:`start_tensors` until the client finishes. Returns those changed starting values by name (what
        the runner writes into the client's live tensors); ``{}`` when nothing changed."""
        if client in self._starts:  # started already (a round resumed from a mid-round checkpoint)
            return self._starts[client]
        if type(self.state.algorithm).start_client is Algorithm.start_client or not self.round_open:
            return {}
        if not self.plan(self.round_index).aggregate:
            return {}
        changed = self._start_outcome(client)
        self._starts[client] = changed
        return changed

    def _start_outcome(self, client: int) -> dict[str, Tensor]:
        """``Algorithm.start_client`` on the client's starting tensors, checked; stores its new declared tensors
        and returns copies of its new starting values."""
        start = ClientStart(
            client=client,
            round=self.round_index,
            num_samples=int(self.state.require_data()[client]),
            start=self.start_tensors(client),
            client_state=self.state.store.client_state(client),
            server=self.state.server_tensors,
            shared_names=self.state.shared_names,
            data=self.client_samples(client),
        )
        outcome = self.state.algorithm.start_client(start)
        hook = f"{type(self.state.algorithm).__name__}.start_client()"
        if not isinstance(outcome, StartOutcome):
            raise TypeError(
                f"{hook} must return a StartOutcome (lightning_fedrep.federation.api.exchange), "
                f"got {type(outcome).__name__}."
            )
        values = _checked_values(
            outcome.start, start.start, hook, "start", "the client's shared and local tensors"
        )
        state = _checked_values(
            outcome.client_state,
            start.client_state,
            hook,
            "client_state",
            "the algorithm's declared client tensors",
        )
        if state:
            self.put_step_state(client, state)
        return values

    def store_client(
        self,
        client: int,
        tensors: Mapping[str, Tensor],
        optimizer_state: OptimizerState | None,
        steps: int,
        timed_steps: int = 0,
        seconds: float = 0.0,
        slots: Mapping[str, Tensor] | None = None,
        finite: Collection[str] = (),
    ) -> ClientResult:
        """A client finished its round's work with ``tensors`` (by name): keep its local part (and, in a
        round that does not aggregate, what it trained of the shared part), its optimizer state if kept,
        and add its shared part to the round's average. A client whose tensors are not all finite is
        left out of the round (``on_nonfinite="skip"``) or stops the run (``"raise"``).

        In a round that aggregates, ``Algorithm.finish_client`` decides the upload and the client's new
        declared tensors (their values must be finite too). ``slots``: the declared slots it trained
        (``"<slot>.<name>"``), stored with its declared tensors. ``finite``: names of ``tensors`` the caller
        already found finite (the vectorized runner checks a whole group's stacked tensors at once)."""
        plan = self.plan(self.round_index)
        slots = dict(slots or {})
        before = self._before_round
        stepped = (
            self.state.store.client_state(client) if before is not None and client in before.clients else {}
        )
        checked = {id(tensors[n]) for n in finite}
        # stepped: the declared tensors its steps wrote
        bad = _nonfinite({**tensors, **slots, **stepped}, checked)
        outcome = None
        if not bad and plan.aggregate:
            outcome = self._finish_outcome(client, tensors, steps, slots)
            checked.update(id(t) for t in tensors.values())  # an upload of the end values is checked
            bad = _nonfinite({**outcome.upload, **outcome.client_state}, checked)
        if bad:
            reason = f"non-finite values in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}"
            if self.state.config.on_nonfinite == "raise":
                raise ClientFaultError(
                    f"Client {client} in round {self.round_index}: {reason} after {steps} local steps "
                    "(on_nonfinite='raise'; 'skip' leaves such a client out of the round)."
                )
            return self._leave_out(client, steps, reason)
        metrics = {k: float(v) for k, v in outcome.metrics.items()} if outcome is not None else {}
        if self._average is not None:
            self._average.add(self._update(client, outcome.upload, steps, metrics))
        if self._local_average is not None:
            self._local_average.add([tensors[n] for n in self.state.local_names], self.weight_of(client))
        self._remember_before(client)
        if (outcome is not None and outcome.client_state) or slots:
            self.state.store.put_state(client, {**(outcome.client_state if outcome else {}), **slots})
        if not plan.aggregate:
            trained = {g for phase in plan.phases for g in PART_GROUPS[phase.train]}
            names = [n for n in self.state.shared_names if self.state.split.group(n) in trained]
            self.state.store.finetuned[client] = {n: tensors[n].detach().clone() for n in names}
        self.state.store.put(client, [tensors[n] for n in self.state.local_names])
        if optimizer_state is not None and self.state.config.client_optimizer_state == "keep":
            self.state.store.optimizer_states[client] = optimizer_state
        result = ClientResult(self.round_index, client, steps, timed_steps, seconds, metrics=metrics)
        self._finished.append(result)
        self._starts.pop(client, None)
        return result

    @torch.no_grad()
    def _finish_outcome(
        self, client: int, tensors: Mapping[str, Tensor], steps: int, slots: Mapping[str, Tensor]
    ) -> ClientOutcome:
        """``Algorithm.finish_client`` on the client's start and end tensors and the slots it trained
        (before the store changes)."""
        end = ClientEnd(
            client=client,
            round=self.round_index,
            num_samples=int(self.state.require_data()[client]),
            steps=steps,
            lr=self.live.client_lr(),
            start=self.start_tensors(client),
            end=tensors,
            client_state=self.state.store.client_state(client),
            server=self.state.server_tensors,
            shared_names=self.state.shared_names,
            slots=slots,
            data=self.client_samples(client),
        )
        outcome = self.state.algorithm.finish_client(end)
        if not isinstance(outcome, ClientOutcome):
            raise TypeError(
                f"{type(self.state.algorithm).__name__}.finish_client() must return a ClientOutcome "
                f"(lightning_fedrep.federation.api.exchange), got {type(outcome).__name__}."
            )
        return outcome

    def _update(
        self, client: int, upload: Mapping[str, Tensor], steps: int, metrics: Mapping[str, float]
    ) -> ClientUpdate:
        """What ``client`` hands the server: its upload (views), weight, samples, steps and metrics."""
        samples = int(self.state.require_data()[client])
        return ClientUpdate(client, self.round_index, self.weight_of(client), samples, steps, upload, metrics)

    def weight_of(self, client: int) -> float:
        """A client's aggregation weight: its training samples, or 1 under uniform weighting."""
        return float(self.state.require_data()[client]) if self.state.config.weighting == "samples" else 1.0

    def fail_live_client(self, step: int, error: BaseException) -> None:
        """The live client's step raised (``on_client_error="skip"``): it trains no further this round
        and is left out of it when it finishes."""
        if self._client is not None and not self._client.fault:
            self._client.fault = f"{type(error).__name__} at local step {step}: {error}"
            self._client.steps = step

    @property
    def live_failed(self) -> bool:
        """Whether the live client failed this round (its remaining steps train nothing)."""
        return self._client is not None and bool(self._client.fault)

    def _leave_out(self, client: int, steps: int, reason: str) -> ClientResult:
        before = self._before_round
        if before is not None and client in before.clients:  # its steps wrote declared tensors: undo them
            self.state.store.load_record(client, before.clients.pop(client), self.state.device)
        warnings.warn(
            f"Client {client} is left out of round {self.round_index}: {reason} (after {steps} local steps); its "
            "state stays as it was before the round.",
            ClientFaultWarning,
            stacklevel=3,
        )
        result = ClientResult(self.round_index, client, steps, 0, 0.0, fault=reason)
        self._finished.append(result)
        self._starts.pop(client, None)
        return result

    @torch.no_grad()
    def close_round(self) -> RoundResult | None:
        """Aggregate the round: the algorithm turns the participants' shared parts into the new global
        state. Idempotent; a round cut short averages the clients that trained."""
        if not self.round_open:
            return None
        self.finish_client()
        if self.ranks.distributed:
            results = [asdict(r) for r in self._finished]
            gathered = self.ranks.gather_round(self._average, self._local_average, results)
            clients = self.plan(self.round_index).clients
            self._finished = [ClientResult(**gathered[c]) for c in clients if c in gathered]
        aggregated, weight, columns = False, 0.0, {}
        faults = tuple(ClientFault(r.round, r.client, r.steps, r.fault) for r in self._finished if r.fault)
        if self._average is not None and not self._average.empty:
            weight = self._average.weight
            columns = self._server_step(faults)
            aggregated = True
        elif self._average is not None and faults:
            warnings.warn(
                f"Every client of round {self.round_index} was left out ({len(faults)} faults): the global state "
                "is unchanged.",
                ClientFaultWarning,
                stacklevel=2,
            )
        if self._local_average is not None and not self._local_average.empty:
            # untrained clients read the template: it becomes the round's average of every local tensor
            self.state.store.template = self._local_average.mean(self.state.store.template)
        if faults:
            self.state.faults.extend(faults)
            columns["faults"] = float(len(faults))
        plan = self.plan(self.round_index)
        if self.state.config.privacy is not None:
            columns.update(self.state.config.privacy.close_round(plan))
        columns.update(self._client_metrics())
        if columns:
            self.state.history.record(self.round_index, columns)
        if plan.aggregate:  # a federated round (fine-tuning rounds train every client apart)
            self.state.history.count_participants(plan.clients)
        self.live.write_global()
        self.round_open = False
        self._average = None
        self._local_average = None
        self._before_round = None
        self._starts = {}
        result = RoundResult(
            self.round_index, plan, tuple(self._finished), aggregated, weight, faults, columns
        )
        self._finished = []
        return result

    def _server_step(self, faults: tuple[ClientFault, ...]) -> dict[str, float]:
        """``Algorithm.aggregate(server, results, failures)``: new global shared and server tensors; returns the
        metrics for the round's history row (the algorithm's, then the privacy mechanism's)."""
        average = self._average
        server = ServerState(
            self.state.global_view(), dict(self.state.server_tensors), len(self.state.require_data())
        )
        clients = tuple(r.client for r in self._finished if not r.fault)
        plan = self.plan(self.round_index)
        results = RoundResults(average.result(), average, clients, average.weight, plan)
        answer = self.state.algorithm.aggregate(server, results, faults)
        name = type(self.state.algorithm).__name__
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], ServerState)):
            raise TypeError(
                f"{name}.aggregate(server, results, failures) must return (ServerState, metrics dict)."
            )
        new, metrics = answer
        metrics = dict(metrics)
        self._check_server_names(new, f"{name}.aggregate")
        optimizer = self.state.algorithm.server_optimizer
        if optimizer is not None:  # steps from what aggregate returned (after any privacy mechanism's mean)
            new, stepped = optimizer.step(server, new)
            self._check_server_names(new, f"{type(optimizer).__name__}.step")
            metrics.update(stepped)
        if new.client_map is not None:
            self._map_clients(new.client_map)
        self.state.set_server_state(new.shared, new.tensors)
        if self.state.config.privacy is not None:
            metrics.update(
                self.state.config.privacy.after_round(average, self.round_index, server.num_clients)
            )
        return {k: float(v) for k, v in metrics.items()}

    def _check_server_names(self, new: ServerState, owner: str) -> None:
        """Refuse a server step that did not return every shared and declared server tensor, by name."""
        for label, names, given in (
            ("shared", list(self.state.shared_names), list(new.shared)),
            ("server", list(self.state.server_tensors), list(new.tensors)),
        ):
            if sorted(given) != sorted(names):
                raise KeyError(f"{owner} returned {label} tensors {sorted(given)}, expected {sorted(names)}.")

    def _map_clients(self, client_map: ClientMap) -> None:
        """Apply the server step's ``client_map`` to the declared tensors of every client this process holds
        and to the template of the clients that never trained."""
        store = self.state.store
        template = dict(zip(store.tensor_names, store.tensor_template))
        changed = _checked_map(client_map, template, type(self.state.algorithm).__name__)
        for client in list(store.tensors):
            store.put_state(client, _checked_map(client_map, store.client_state(client), None))
        store.tensor_template = [
            changed[n].detach().to(t.device, t.dtype).clone() if n in changed else t
            for n, t in zip(store.tensor_names, store.tensor_template)
        ]

    def _client_metrics(self) -> dict[str, float]:
        """The mean over the round's clients of each metric their ``finish_client`` reported."""
        values: dict[str, list[float]] = {}
        for result in self._finished:
            for key, value in result.metrics.items():
                values.setdefault(key, []).append(value)
        return {k: sum(v) / len(v) for k, v in values.items()}

    def state_dict(self) -> dict[str, Any]:
        """The round's part of the federation's ``state_dict`` (its ``"round"``): the index and, in an open
        round, the live client, its tensors and phase, the partial averages, the clients finished and started,
        and what rolls the round back."""
        state: dict[str, Any] = {"open": self.round_open, "index": self.round_index}
        if not self.round_open:
            return state
        live = self._client
        state.update(
            live_client=-1 if live is None else live.client,
            live_part=self.live.phase or "",
            live_tensors=self.live.training_tensors(),
            average=self._average.state_dict() if self._average is not None else None,
            local_average=self._local_average.state_dict() if self._local_average is not None else None,
            finished=[asdict(r) for r in self._finished],
            live_counts=[live.steps, live.timed_steps, live.seconds] if live is not None else [],
            live_fault=live.fault if live is not None else "",
        )
        if self._starts:  # the clients start_client ran for (a resumed round does not run it again)
            state["starts"] = {
                c: {n: t.detach().clone() for n, t in values.items()} for c, values in self._starts.items()
            }
        if live is not None and live.slot != "model":  # a declared slot is live: keep the model aside
            state.update(
                live_slot=live.slot,
                live_model=[t.detach().clone() for t in live.model],
                live_slot_values={n: t.detach().clone() for n, t in live.slot_values.items()},
            )
        before = self._before_round
        if before is not None:  # a run resumed from here can still roll the whole round back
            state["before"] = {
                "round_index": before.round_index,
                "rng": before.rng,
                "finetuned": before.finetuned,
                "clients": before.clients,
                "cuda_rng": before.cuda_rng,
            }
        return state

    def rollback_round(self) -> bool:
        """Undo the open round (the run stopped inside it): every client stored in it gets back what it
        held before, nothing is aggregated, the RNG and the module are as at the round's start, and the
        federation is again after the previous round. Returns whether there was a round to undo."""
        before = self._before_round
        if not self.round_open or before is None:
            return False
        for client, record in before.clients.items():
            self.state.store.load_record(client, record, self.state.device)
        self.state.store.finetuned.clear()
        self.state.store.finetuned.update(before.finetuned)
        for client in list(self.state.store.borrowed):
            self.state.store.drop(client)
        torch.set_rng_state(before.rng)
        if before.cuda_rng is not None:
            torch.cuda.set_rng_state_all(before.cuda_rng)
        self.round_index, self.round_open = before.round_index, False
        self._average, self._finished, self._client, self.live.phase = None, [], None, None
        self._local_average = None
        self._before_round = None
        self._starts = {}
        self.live.write_global()
        self.live.write(self.state.local_names, self.state.store.template)
        return True

    def restore_round(self, state: dict[str, Any]) -> None:
        """Restore the RNG and an interrupted round (live client, its tensors and phase, the partial
        average, the clients already finished), after the optimizers exist."""
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        round_state = state["round"]
        self.round_index = round_state["index"]
        self.round_open = round_state["open"]
        if not self.round_open:
            return
        self._average = None
        if round_state["average"] is not None:
            self._average = self._aggregator(self.round_index)
            self._average.load_state_dict(round_state["average"])
        self._local_average = None
        if round_state.get("local_average") is not None:
            self._local_average = WeightedAverage(self.state.store.template)
            self._local_average.load_state_dict(round_state["local_average"])
        self._finished = [ClientResult(**r) for r in round_state.get("finished", [])]
        self._starts = {
            int(c): {n: t.to(self.state.device) for n, t in values.items()}
            for c, values in round_state.get("starts", {}).items()
        }
        self.live.write(self.state.shared_names + self.state.local_names, round_state["live_tensors"])
        client = round_state["live_client"]
        self._client = None if client < 0 else _LiveClient(client)
        if self._client is not None and round_state.get("live_slot", "model") != "model":
            device = self.state.device
            self._client.slot = round_state["live_slot"]
            self._client.model = [t.to(device) for t in round_state["live_model"]]
            self._client.slot_values = {n: t.to(device) for n, t in round_state["live_slot_values"].items()}
        counts = round_state.get("live_counts") or []
        if self._client is not None and counts:
            self._client.steps, self._client.timed_steps, self._client.seconds = (
                int(counts[0]),
                int(counts[1]),
                float(counts[2]),
            )
        if self._client is not None:
            self._client.fault = round_state.get("live_fault", "")
        before = round_state.get("before")
        self._before_round = None
        if before is not None:
            device = self.state.device
            self._before_round = _RoundStart(
                int(before["round_index"]),
                before["rng"],
                {
                    c: {n: t.to(device) for n, t in tensors.items()}
                    for c, tensors in before["finetuned"].items()
                },
                dict(before["clients"]),
                cuda_rng=before.get("cuda_rng") if torch.cuda.is_available() else None,
            )
        self.live.phase = None
        if self._client is not None and round_state["live_part"]:
            self.live.set_phase(round_state["live_part"])

    def _clock(self) -> float:
        """The step clock, after the device's queued work (so a GPU step is timed whole)."""
        if self.state.device.type == "cuda":
            torch.cuda.synchronize(self.state.device)
        return self.clock()


def _checked_map(
    client_map: ClientMap, tensors: Mapping[str, Tensor], owner: str | None
) -> Mapping[str, Tensor]:
    """``client_map(tensors)``; with ``owner`` (the first call), checked to return some of ``tensors``' names."""
    changed = client_map(tensors)
    if owner is not None and (not isinstance(changed, Mapping) or set(changed) - set(tensors)):
        raise KeyError(
            f"{owner}.aggregate returned a client_map that must return new values of some of the client's "
            f"declared tensors {sorted(tensors)}, got {changed if not isinstance(changed, Mapping) else sorted(changed)}."
        )
    return changed


def _refused_under(privacy: Any) -> ReadSamples:
    """A reader that refuses: a mechanism privatizing the local steps does not account for a start reading data."""

    def read(client: int, round_index: int, positions: Sequence[Tensor]) -> Iterator[Any]:
        raise ValueError(
            f"{type(privacy).__name__} privatizes the local steps' batches only: a start_client or finish_client "
            f"reading client {client}'s training samples (ClientStart.data, ClientEnd.data) in round {round_index} uses them outside the privacy "
            "accounting. Use an algorithm whose start_client reads no data with it, or client-level DP "
            "(ClientLevelDP, which covers everything a client computes)."
        )

    return read


def _checked_values(
    given: Mapping[str, Tensor], like: Mapping[str, Tensor], hook: str, field_name: str, what: str
) -> dict[str, Tensor]:
    """Copies of ``given`` (a hook's new values of some of ``like``'s names), on ``like``'s device and dtype;
    an unknown name or a wrong shape is refused naming the hook, the field and the name."""
    if not isinstance(given, Mapping):
        raise TypeError(f"{hook} returned {field_name}={given!r}: give a dict of tensors by name.")
    unknown = sorted(set(given) - set(like))
    if unknown:
        raise KeyError(f"{hook} returned {field_name} for {unknown}, which are not {what} {sorted(like)}.")
    values = {}
    for name, value in given.items():
        ref = like[name]
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ref.shape):
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
            raise ValueError(
                f"{hook} returned {field_name}[{name!r}] with {got}; {name!r} has shape {tuple(ref.shape)}."
            )
        values[name] = value.detach().to(ref.device, ref.dtype).clone()
    return values


def _nonfinite(tensors: Mapping[str, Tensor], checked: Collection[int] = ()) -> list[str]:
    """The names of the floating-point tensors among ``tensors`` that hold a NaN or an infinity (the
    tensor objects whose ``id`` is in ``checked`` are known finite)."""
    floats = {n: t for n, t in tensors.items() if t.is_floating_point() and id(t) not in checked}
    finite = [torch.isfinite(t).all() for t in floats.values()]
    if not finite or bool(torch.stack(finite).all()):
        return []
    return [n for n, f in zip(floats, finite) if not f]
