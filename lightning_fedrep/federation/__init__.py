"""``Federation``: the federated state and the round state machine, with no Lightning in it.

A federation owns the global shared tensors, every client's local tensors (a :class:`ClientStore`),
the run's :class:`History`, and the open round: its plan, the live client and phase, the running
weighted average. It drives one live ``nn.Module`` and its optimizers by copying tensors into the
module's own parameters (never rebinding them), so the optimizers keep working:

    plan(r) -> open_round(plan) -> [load_client(c) -> begin_step/end_step ... -> finish_client()]*
            -> close_round()

The Lightning strategy (:mod:`lightning_fedrep.strategy`) calls these from its hooks; tests and
other runtimes can drive a federation directly.
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fedrep.algorithms import PART_GROUPS, Algorithm, Part, Phase
from lightning_fedrep.clients import ClientStore, OptimizerState
from lightning_fedrep.collective import Collective, to_cpu
from lightning_fedrep.history import History
from lightning_fedrep.plan import RoundPlan, StepLocation, plan_round, sample_clients, shard_round
from lightning_fedrep.server import WeightedAverage
from lightning_fedrep.split import ParameterSplit, TensorLayout

STATE_VERSION = 2


@dataclass(frozen=True)
class FederationConfig:
    """The settings of a federation that do not depend on the model (checked at construction)."""

    phases: tuple[Phase, ...]
    clients_per_round: float | int = 0.1
    weighting: Literal["samples", "uniform"] = "samples"
    client_optimizer_state: Literal["reset", "keep"] = "reset"
    seed: int = 0
    on_nonfinite: Literal["skip", "raise"] = "skip"
    on_client_error: Literal["raise", "skip"] = "raise"
    first_state: Literal["initial", "average"] = "initial"
    """Where a client that has not trained yet starts its local part: the module's ``"initial"`` values, or
    the ``"average"`` of every local tensor over the last aggregated round's clients (the official code's
    aliasing of ``w_locals`` to the global model, into which it averages every key, heads included)."""

    def __post_init__(self) -> None:
        for name, value in (("on_nonfinite", self.on_nonfinite), ("on_client_error", self.on_client_error)):
            if value not in ("skip", "raise"):
                raise ValueError(f"{name} must be 'skip' or 'raise', got {value!r}.")
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {self.weighting!r}.")
        if self.client_optimizer_state not in ("reset", "keep"):
            raise ValueError(
                f"client_optimizer_state must be 'reset' or 'keep', got {self.client_optimizer_state!r}."
            )
        if self.first_state not in ("initial", "average"):
            raise ValueError(f"first_state must be 'initial' or 'average', got {self.first_state!r}.")


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


@dataclass(frozen=True)
class ClientFault:
    """A client left out of a round: nothing it computed in the round is kept (its stored state is
    what it was before the round) and the round aggregates without it."""

    round: int
    client: int
    step: int
    """Its local steps in the round when the fault was found (an error: the step that raised)."""
    reason: str


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
    aggregated: bool
    weight: float = 0.0
    """The total aggregation weight of the participants (samples, or their count when uniform)."""
    faults: tuple[ClientFault, ...] = ()
    """The clients left out of the round, and why."""


@dataclass
class _RoundStart:
    """What the open round may change, as it was when the round opened (for :meth:`Federation.rollback_round`)."""

    round_index: int
    rng: Tensor
    finetuned: dict[int, dict[str, Tensor]]
    clients: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each client stored in the round so far: its record before the round."""


@dataclass
class _LiveClient:
    client: int
    steps: int = 0
    timed_steps: int = 0
    seconds: float = 0.0
    fresh: bool = True
    step_started: float | None = field(default=None, repr=False)
    fault: str = ""


class FederationMismatch(ValueError):
    """A checkpoint saved by another federation (other clients or planning settings) than the run's."""


def clients_fingerprint(client_sizes: Sequence[int], partition: int) -> dict[str, Any]:
    """The clients' part of a federation's fingerprint: their number, a checksum of their training-set
    sizes, and ``partition``, a checksum of which samples each holds (``RoundLoader.partition_checksum``)."""
    sizes = tuple(int(n) for n in client_sizes)
    return {
        "num_clients": len(sizes),
        "client_sizes": zlib.crc32(str(sizes).encode()),
        "partition": int(partition),
    }


def federation_fingerprint(
    client_sizes: Sequence[int], partition: int, batch_size: int, algorithm: str, config: FederationConfig
) -> dict[str, Any]:
    """What a checkpoint records of its federation: the clients (:func:`clients_fingerprint`), the batch
    size, the algorithm, how rounds are planned (seed, clients per round, phases) and where untrained
    clients start (``first_state``; absent from older checkpoints, whose resumes compare the rest)."""
    return {
        **clients_fingerprint(client_sizes, partition),
        "batch_size": int(batch_size),
        "algorithm": algorithm,
        "seed": config.seed,
        "clients_per_round": repr(config.clients_per_round),
        "phases": repr(config.phases),
        "first_state": config.first_state,
    }


def fingerprint_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """``"<key> <saved> -> <current>"`` for each key of ``current`` the ``saved`` fingerprint records
    with another value (``[]`` without a saved fingerprint)."""
    if not saved:
        return []
    return [
        f"{key} {saved[key]!r} -> {value!r}"
        for key, value in current.items()
        if key in saved and saved[key] != value
    ]


class Federation:
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
        self._average: WeightedAverage | None = None
        self._local_average: WeightedAverage | None = None
        """``first_state="average"``: the round's weighted sum of the participants' local tensors."""
        self._finished: list[ClientResult] = []
        self._live: _LiveClient | None = None
        self._eval_stash: list[Tensor] | None = None
        self._eval_client: int | None = None
        self._eval_tensors: dict[int, dict[str, Tensor]] = {}
        self._before_round: _RoundStart | None = None

    # ------------------------------------------------------------------ read-only views
    @property
    def split(self) -> ParameterSplit:
        """Which parameters are head, body and frozen."""
        return self.layout.split

    @property
    def shared_names(self) -> tuple[str, ...]:
        """Names of the tensors the server averages (parameters and buffers)."""
        return self.layout.shared

    @property
    def local_names(self) -> tuple[str, ...]:
        """Names of the tensors every client keeps for itself."""
        return self.layout.local

    @property
    def live_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between clients)."""
        return None if self._live is None else self._live.client

    @property
    def num_clients(self) -> int:
        """Number of clients (known once the training data is bound)."""
        return len(self._require_data())

    @property
    def module(self) -> nn.Module | None:
        """The module the federation drives (its tensors are written into it), once attached."""
        return getattr(self, "_module", None)

    @property
    def has_state(self) -> bool:
        """Whether the global and client state exist (after ``initialize`` or loading a checkpoint)."""
        return self.store is not None

    def global_tensors(self) -> dict[str, Tensor]:
        """The global shared tensors by name (copies)."""
        self._require_state()
        return {n: t.detach().clone() for n, t in zip(self.shared_names, self.global_state)}

    def global_view(self) -> dict[str, Tensor]:
        """The global shared tensors by name, not copied: read them, never modify them."""
        self._require_state()
        return dict(zip(self.shared_names, self.global_state))

    def client_tensors(self, client: int) -> dict[str, Tensor]:
        """What makes ``client``'s model its own, by name (copies): its local part (the initial one if it
        never trained) and any shared tensors it fine-tuned in a round that did not aggregate."""
        self._require_state()
        self.check_client(client)
        return {n: t.detach().clone() for n, t in self.store.personal(client, self.local_names).items()}

    def check_client(self, client: int) -> None:
        """Refuse a client id outside the federation (``-1``, a client that never trained, is allowed)."""
        known = len(self.client_sizes) if self.client_sizes is not None else None
        if known is None and self.saved_federation is not None:
            known = self.saved_federation.get("num_clients")
        if (
            isinstance(client, bool)
            or not isinstance(client, int)
            or client < -1
            or (known is not None and client >= known)
        ):
            raise IndexError(
                f"client must be a client id in 0..{'' if known is None else known - 1} (or -1 for a client that never "
                f"trained), got {client!r}."
            )

    def personalized_state(self, base_state: Mapping[str, Tensor], client: int) -> dict[str, Tensor]:
        """``base_state`` (a module ``state_dict`` holding the global shared part) made ``client``'s own."""
        return {**{k: v.detach().clone() for k, v in base_state.items()}, **self.client_tensors(client)}

    # ------------------------------------------------------------------ explicit updates
    def update_global(self, tensors: Mapping[str, Tensor]) -> None:
        """Overwrite some of the global shared tensors (e.g. a server step after aggregation)."""
        self._require_state()
        index = {n: i for i, n in enumerate(self.shared_names)}
        unknown = set(tensors) - set(index)
        if unknown:
            raise KeyError(f"{sorted(unknown)} are not shared; shared tensors are {list(self.shared_names)}.")
        for name, value in tensors.items():
            self.global_state[index[name]].copy_(value.detach())
        if not self.round_open:
            self._write(self.shared_names, self.global_state)

    def update_client(self, client: int, tensors: Mapping[str, Tensor]) -> None:
        """Overwrite some of ``client``'s local tensors (e.g. a server step on the heads)."""
        self._require_state()
        unknown = set(tensors) - set(self.local_names)
        if unknown:
            raise KeyError(
                f"{sorted(unknown)} are not local to a client; local tensors are {list(self.local_names)}."
            )
        current = [t.detach().clone() for t in self.store.get(client)]
        for i, name in enumerate(self.local_names):
            if name in tensors:
                current[i] = tensors[name].detach().to(current[i].device, current[i].dtype)
        self.store.put(client, current)
        if client == self.live_client:
            self._write(self.local_names, current)

    def record(self, **values: float) -> None:
        """Add columns to the history row of the current (or just closed) round."""
        self.history.record(self.round_index, {k: float(v) for k, v in values.items()})

    # ------------------------------------------------------------------ binding
    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Drive ``module`` (and its optimizers): called when the module, its device or optimizers change."""
        self._module = module
        self._named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        self._optimizers = list(optimizers)

    def initialize(self, device: torch.device) -> None:
        """Snapshot the global shared part and the initial local part from the module (first time),
        or move the existing state to ``device``."""
        self._device = torch.device(device)
        if self.store is None:
            self.global_state = [t.detach().clone() for t in self._tensors(self.shared_names)]
            self.store = ClientStore(self._tensors(self.local_names))
        else:
            self.global_state = [t.to(device) for t in self.global_state]
            self.store.to(device)

    def bind_data(self, client_sizes: Sequence[int], batch_size: int, partition: int = 0) -> None:
        """The clients' training-set sizes (aggregation weights, epoch budgets), the batch size, and a
        checksum of which samples each client holds (part of the federation's fingerprint)."""
        self.client_sizes = tuple(int(n) for n in client_sizes)
        self.batch_size = int(batch_size)
        self.partition = int(partition)
        self._plans = {}

    def adopt_new_federation(self) -> None:
        """Keep the loaded global state and forget the loaded clients (another federation's)."""
        self.store.local.clear()
        self.store.optimizer_states.clear()
        self.store.finetuned.clear()
        self.saved_federation = None

    def fingerprint(self) -> dict[str, Any]:
        """What makes a checkpoint this federation's: its clients (count, sizes, which samples), the
        batch size, the algorithm, how rounds are planned (seed, clients per round, phases), ``first_state``."""
        return federation_fingerprint(
            self._require_data(), self.partition, self.batch_size, self.algorithm.name, self.config
        )

    def federation_changes(self, current: Mapping[str, Any] | None = None) -> list[str]:
        """How this run's federation differs from the one the loaded checkpoint was saved with: all of
        :meth:`fingerprint`, or only the keys of ``current`` (in evaluation, the clients:
        :func:`clients_fingerprint`)."""
        return fingerprint_changes(self.saved_federation, self.fingerprint() if current is None else current)

    # ------------------------------------------------------------------ planning
    def plan(self, round_index: int, configure: Callable[[RoundPlan], RoundPlan] | None = None) -> RoundPlan:
        """The frozen plan of a round: its sampled clients and their phases' step counts, passed once
        through ``configure`` (the federated callbacks) when the round is first planned."""
        sizes = self._require_data()
        plan = self._plans.get(round_index)
        if plan is None:
            clients = sample_clients(len(sizes), self.config.clients_per_round, self.config.seed, round_index)
            plan = plan_round(round_index, clients, self.config.phases, sizes, self.batch_size)
            if configure is not None:
                plan = configure(plan)
            self._plans = {r: p for r, p in self._plans.items() if r >= round_index - 1}
            self._plans[round_index] = plan
        return plan

    # ------------------------------------------------------------------ the open round
    def open_round(self, plan: RoundPlan) -> None:
        """Start training round ``plan.round``."""
        self._require_state()
        self._before_round = _RoundStart(self.round_index, torch.get_rng_state(), dict(self.store.finetuned))
        self.round_index = plan.round
        self.round_open = True
        if plan.aggregate:
            self.store.finetuned.clear()  # a new federated round makes earlier fine-tuning stale
        if self.store.sharded:
            self._lend_clients(plan)
        self._average = WeightedAverage(self.global_state) if self.shared_names and plan.aggregate else None
        self._local_average = self._new_local_average(plan.aggregate)
        self._finished = []

    def _new_local_average(self, aggregate: bool) -> WeightedAverage | None:
        """A running average of the local part when untrained clients start from it (``first_state``)."""
        if self.config.first_state != "average" or not aggregate or not self.local_names:
            return None
        return WeightedAverage(self.store.template)

    def load_client(self, client: int) -> None:
        """Make ``client`` live: the round's global shared part, its local part and, if kept, its
        optimizer state (the shared part's optimizer state restarts)."""
        self._write_personal(client)
        self._live = _LiveClient(client)
        self.live_phase = None
        kept = self.store.optimizer_states.get(client, {})
        for index, optimizer in enumerate(self._optimizers):
            optimizer.state.clear()
            params = _optimizer_params(optimizer)
            for param_index, state in kept.get(index, {}).items():
                optimizer.state[params[param_index]] = {
                    k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()
                }

    def begin_step(self, location: StepLocation) -> None:
        """Before the live client's step at ``location``: set the phase, start its timer if timed."""
        live = self._live
        if location.part != self.live_phase:
            self.set_phase(location.part)
        live.steps += 1
        timed = self.timing and not live.fresh and not location.last_of_round
        live.fresh = False
        live.step_started = self._clock() if timed else None

    def end_step(self) -> None:
        """After the live client's step (its optimizer step): stop its timer."""
        live = self._live
        if live is not None and live.step_started is not None:
            live.seconds += self._clock() - live.step_started
            live.timed_steps += 1
            live.step_started = None

    def finish_client(self) -> ClientResult | None:
        """Store the live client's state and add its shared part to the round's average."""
        live = self._live
        if live is None:
            return None
        names = self.shared_names + self.local_names
        keep = self.config.client_optimizer_state == "keep"
        if live.fault:
            result = self._leave_out(live.client, live.steps, live.fault)
        else:
            result = self.store_client(
                live.client,
                dict(zip(names, self._tensors(names))),
                self._optimizer_snapshot() if keep else None,
                live.steps,
                live.timed_steps,
                live.seconds,
            )
        self._live = None
        self.live_phase = None
        return result

    def start_tensors(self, client: int) -> dict[str, Tensor]:
        """A client's tensors at the start of its round by name (not copies): the global shared part,
        its local part, and what it fine-tuned."""
        return {**self.global_view(), **self.store.personal(client, self.local_names)}

    def store_client(
        self,
        client: int,
        tensors: Mapping[str, Tensor],
        optimizer_state: OptimizerState | None,
        steps: int,
        timed_steps: int = 0,
        seconds: float = 0.0,
    ) -> ClientResult:
        """A client finished its round's work with ``tensors`` (by name): keep its local part (and, in a
        round that does not aggregate, what it trained of the shared part), its optimizer state if kept,
        and add its shared part to the round's average. A client whose tensors are not all finite is
        left out of the round (``on_nonfinite="skip"``) or stops the run (``"raise"``)."""
        floats = {n: t for n, t in tensors.items() if t.is_floating_point()}
        finite = [torch.isfinite(t).all() for t in floats.values()]
        bad = (
            []
            if not finite or bool(torch.stack(finite).all())
            else [n for n, f in zip(floats, finite) if not f]
        )
        if bad:
            reason = f"non-finite values in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}"
            if self.config.on_nonfinite == "raise":
                raise ClientFaultError(
                    f"Client {client} in round {self.round_index}: {reason} after {steps} local steps "
                    "(on_nonfinite='raise'; 'skip' leaves such a client out of the round)."
                )
            return self._leave_out(client, steps, reason)
        if self._average is not None:
            self._average.add([tensors[n] for n in self.shared_names], self.weight_of(client))
        if self._local_average is not None:
            self._local_average.add([tensors[n] for n in self.local_names], self.weight_of(client))
        if self._before_round is not None and client not in self._before_round.clients:
            record = self.store.record(client)
            self._before_round.clients[client] = {
                "local": None if record["local"] is None else [t.detach().clone() for t in record["local"]],
                "optimizer": record["optimizer"],  # replaced, never modified in place
                "finetuned": record["finetuned"],
            }
        plan = self.plan(self.round_index)
        if not plan.aggregate:
            trained = {g for phase in plan.phases for g in PART_GROUPS[phase.train]}
            names = [n for n in self.shared_names if self.split.group(n) in trained]
            self.store.finetuned[client] = {n: tensors[n].detach().clone() for n in names}
        self.store.put(client, [tensors[n] for n in self.local_names])
        if optimizer_state is not None and self.config.client_optimizer_state == "keep":
            self.store.optimizer_states[client] = optimizer_state
        result = ClientResult(self.round_index, client, steps, timed_steps, seconds)
        self._finished.append(result)
        return result

    def rollback_round(self) -> bool:
        """Undo the open round (the run stopped inside it): every client stored in it gets back what it
        held before, nothing is aggregated, the RNG and the module are as at the round's start, and the
        federation is again after the previous round. Returns whether there was a round to undo."""
        before = self._before_round
        if not self.round_open or before is None:
            return False
        for client, record in before.clients.items():
            self.store.load_record(client, record, self._device)
        self.store.finetuned.clear()
        self.store.finetuned.update(before.finetuned)
        for client in list(self.store.borrowed):
            self.store.drop(client)
        torch.set_rng_state(before.rng)
        self.round_index, self.round_open = before.round_index, False
        self._average, self._finished, self._live, self.live_phase = None, [], None, None
        self._local_average = None
        self._before_round = None
        self._write(self.shared_names, self.global_state)
        self._write(self.local_names, self.store.template)
        return True

    def fail_live_client(self, step: int, error: BaseException) -> None:
        """The live client's step raised (``on_client_error="skip"``): it trains no further this round
        and is left out of it when it finishes."""
        if self._live is not None and not self._live.fault:
            self._live.fault = f"{type(error).__name__} at local step {step}: {error}"
            self._live.steps = step

    @property
    def live_failed(self) -> bool:
        """Whether the live client failed this round (its remaining steps train nothing)."""
        return self._live is not None and bool(self._live.fault)

    def _leave_out(self, client: int, steps: int, reason: str) -> ClientResult:
        warnings.warn(
            f"Client {client} is left out of round {self.round_index}: {reason} (after {steps} local steps); its "
            "state stays as it was before the round.",
            ClientFaultWarning,
            stacklevel=3,
        )
        result = ClientResult(self.round_index, client, steps, 0, 0.0, fault=reason)
        self._finished.append(result)
        return result

    @torch.no_grad()
    def close_round(self) -> RoundResult | None:
        """Aggregate the round: the algorithm turns the participants' shared parts into the new global
        state. Idempotent; a round cut short averages the clients that trained."""
        if not self.round_open:
            return None
        self.finish_client()
        if self.collective.distributed:
            self._gather_round()
        aggregated, weight = False, 0.0
        faults = tuple(ClientFault(r.round, r.client, r.steps, r.fault) for r in self._finished if r.fault)
        if self._average is not None and not self._average.empty:
            weight = self._average.weight
            self.global_state = self.algorithm.aggregate(self.global_state, self._average)
            aggregated = True
        if self._local_average is not None and not self._local_average.empty:
            # untrained clients read the template: it becomes the round's average of every local tensor
            self.store.template = self._local_average.mean(self.store.template)
        elif self._average is not None and faults:
            warnings.warn(
                f"Every client of round {self.round_index} was left out ({len(faults)} faults): the global state "
                "is unchanged.",
                ClientFaultWarning,
                stacklevel=2,
            )
        if faults:
            self.faults.extend(faults)
            self.history.record(self.round_index, {"faults": float(len(faults))})
        plan = self.plan(self.round_index)
        if plan.aggregate:  # a federated round (fine-tuning rounds train every client apart)
            self.history.count_participants(plan.clients)
        self._write(self.shared_names, self.global_state)
        self.round_open = False
        self._average = None
        self._local_average = None
        self._before_round = None
        result = RoundResult(
            self.round_index, self.plan(self.round_index), tuple(self._finished), aggregated, weight, faults
        )
        self._finished = []
        return result

    def _gather_round(self) -> None:
        """Across processes: add up the round's weighted sums (one all-reduce), and give every process
        what the others' clients did and now hold (one all-gather), so each holds every client."""
        if self._average is not None:
            self._average.load_flat(self.collective.all_reduce_sum(self._average.flat()))
        if self._local_average is not None:
            self._local_average.load_flat(self.collective.all_reduce_sum(self._local_average.flat()))
        store, me = self.store, self.collective.rank
        mine = [(asdict(r), to_cpu(store.record(r.client))) for r in self._finished]
        finished: dict[int, ClientResult] = {}
        for rank, records in enumerate(self.collective.all_gather_object(mine)):
            for result, record in records:
                client = result["client"]
                if rank != me and store.owner(client) in (None, me):
                    store.load_record(client, record, self._device)
                finished[client] = ClientResult(**result)
        for client in list(store.borrowed):  # back with their owners now
            store.drop(client)
        self._finished = [finished[c] for c in self.plan(self.round_index).clients if c in finished]

    def _lend_clients(self, plan: RoundPlan) -> None:
        """Sharded store: before a round, each rank sends the clients it holds that another rank trains
        (one all-gather); the trainer holds them until the round closes."""
        store, me = self.store, self.collective.rank
        trainer = {
            c: r
            for r, share in enumerate(shard_round(plan, self.collective.world_size))
            for c in share.clients
        }
        store.borrowed.update(c for c, r in trainer.items() if r == me and store.owner(c) != me)
        lent = [
            (c, to_cpu(store.record(c)))
            for c, r in trainer.items()
            if r != me and store.owner(c) == me and c in store.local
        ]
        for records in self.collective.all_gather_object(lent):
            for client, record in records:
                if trainer[client] == me:
                    store.load_record(client, record, self._device)

    def shard_clients(self) -> None:
        """Hold only this process's clients (client ``c`` on rank ``c % world_size``)."""
        self.store.shard(self.collective.world_size, self.collective.rank)

    def gather_clients(self) -> None:
        """Every process holds every client again (one all-gather; call it on every rank)."""
        if not self.store.sharded:
            return
        held = [(c, to_cpu(self.store.record(c))) for c in self._owned()]
        for rank, records in enumerate(self.collective.all_gather_object(held)):
            if rank != self.collective.rank:
                for client, record in records:
                    self.store.load_record(client, record, self._device)
        self.store.unshard()

    def gathered_store_state(self) -> dict[str, Any] | None:
        """The whole client store's state on rank 0 (``None`` elsewhere): each rank sends the clients
        it owns (one gather, for a checkpoint); the borrowed ones travel with each rank's open round."""
        store = self.store
        state = store.state_dict()
        owned = set(self._owned())
        records = [(c, to_cpu(store.record(c))) for c in owned]
        gathered = self.collective.gather_object(records)
        if gathered is None:
            return None
        merged = ClientStore([])
        merged.load_state_dict({**state, "local": {}, "optimizer_states": {}, "finetuned": {}})
        for records in gathered:
            for client, record in records:
                merged.load_record(client, record)
        return merged.state_dict()

    def round_records(self) -> dict[str, Any]:
        """What only this process holds in the open round (saved with its open round): the clients it
        finished in the round (the others receive them when it closes) and those it borrowed."""
        finished = {r.client for r in self._finished if not r.fault}
        clients = sorted(finished | self.store.borrowed)
        return {
            "records": [(c, to_cpu(self.store.record(c))) for c in clients],
            "borrowed": sorted(self.store.borrowed),
        }

    def restore_round_records(self, saved: dict[str, Any] | None) -> None:
        """Hold again what :meth:`round_records` listed (a mid-round resume on as many processes)."""
        if not saved:
            return
        for client, record in saved["records"]:
            self.store.load_record(client, record, self._device)
        self.store.borrowed.update(saved["borrowed"])

    def _owned(self) -> list[int]:
        store = self.store
        clients = set(store.local) | set(store.optimizer_states) | set(store.finetuned)
        return sorted(c for c in clients if store.owner(c) in (None, self.collective.rank))

    def weight_of(self, client: int) -> float:
        """A client's aggregation weight: its training samples, or 1 under uniform weighting."""
        return float(self._require_data()[client]) if self.config.weighting == "samples" else 1.0

    def set_phase(self, part: Part) -> None:
        """Make only the parameters ``part`` trains trainable (the others get no gradient)."""
        trains = PART_GROUPS[part]
        for name, param in self._module.named_parameters():
            group = self.split.group(name)
            if group != "frozen":
                param.requires_grad_(group in trains)
                if group not in trains:
                    param.grad = None
        self.live_phase = part

    def release_phases(self) -> None:
        """Make every non-frozen parameter trainable again (when training ends)."""
        for name, param in self._module.named_parameters():
            if self.split.group(name) != "frozen":
                param.requires_grad_(True)
        self.live_phase = None

    # ------------------------------------------------------------------ evaluation and export
    def begin_evaluation(self) -> None:
        """Evaluate the global shared part; keep the live client's training tensors aside if mid-round."""
        self._require_state()
        if self.round_open and self._live is not None:
            self._eval_stash = [
                t.detach().clone() for t in self._tensors(self.shared_names + self.local_names)
            ]
            self._live.fresh = True
        self._write(self.shared_names, self.global_state)
        self._eval_client = None

    def evaluate_client(self, client: int) -> None:
        """Give the module ``client``'s personalized model for its evaluation batches."""
        if client != self._eval_client:
            if self.store.finetuned or self._eval_tensors:  # some client's own shared tensors may be live
                self._write(self.shared_names, self.global_state)
            personal = self.evaluation_tensors(client)
            self._write(list(personal), list(personal.values()))
            self._eval_client = client

    def set_evaluation_tensors(self, tensors: Mapping[int, Mapping[str, Tensor]]) -> None:
        """For the coming evaluation only, score each listed client with these tensors (by name, shared or
        local) in place of its stored ones; the stored state is not changed, and the override ends with the
        evaluation (``FineTunedEvaluation`` sets the heads it fine-tuned this way)."""
        self._require_state()
        known = set(self.shared_names) | set(self.local_names)
        for client, named in tensors.items():
            self.check_client(client)
            unknown = set(named) - known
            if unknown:
                raise KeyError(f"{sorted(unknown)} are neither shared nor local tensors of the federation.")
        self._eval_tensors = {c: dict(named) for c, named in tensors.items()}

    def evaluation_tensors(self, client: int) -> dict[str, Tensor]:
        """What makes ``client``'s model its own in the current evaluation (not copies: do not modify): its
        stored personal tensors, with those set by :meth:`set_evaluation_tensors` in their place."""
        return {**self.store.personal(client, self.local_names), **self._eval_tensors.get(client, {})}

    def end_evaluation(self) -> None:
        """Put back what training had live before the evaluation."""
        if self._eval_stash is not None:
            self._write(self.shared_names + self.local_names, self._eval_stash)
            self._eval_stash = None
        else:
            if self._eval_tensors:  # the shared part may hold a client's override
                self._write(self.shared_names, self.global_state)
            if self._live is not None:
                self._write(self.local_names, self.store.get(self._live.client))
        self._eval_tensors = {}
        self._eval_client = None

    def load_personalized(self, client: int) -> None:
        """Write ``client``'s personalized model into the module (``-1``: a client that never trained)."""
        self._write_personal(client)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the federation exactly (tensors, ints, strings, lists, dicts)."""
        self._require_state()
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "algorithm": self.algorithm.name,
            "algorithm_state": self.algorithm.state_dict(),
            "shared_names": list(self.shared_names),
            "local_names": list(self.local_names),
            "global": [t.detach().clone() for t in self.global_state],
            "clients": self.store.state_dict(),
            "history": self.history.state_dict(),
            "faults": [asdict(f) for f in self.faults],
            "federation": self.fingerprint() if self.client_sizes is not None else self.saved_federation,
            "round": {"open": self.round_open, "index": self.round_index},
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.round_open:
            live = self._live
            state["round"].update(
                live_client=-1 if live is None else live.client,
                live_part=self.live_phase or "",
                live_tensors=self._eval_stash
                if self._eval_stash is not None
                else [t.detach().clone() for t in self._tensors(self.shared_names + self.local_names)],
                average=self._average.state_dict() if self._average is not None else None,
                local_average=self._local_average.state_dict() if self._local_average is not None else None,
                finished=[asdict(r) for r in self._finished],
                live_counts=[live.steps, live.timed_steps, live.seconds] if live is not None else [],
                live_fault=live.fault if live is not None else "",
            )
            before = self._before_round
            if before is not None:  # a run resumed from here can still roll the whole round back
                state["round"]["before"] = {
                    "round_index": before.round_index,
                    "rng": before.rng,
                    "finetuned": before.finetuned,
                    "clients": before.clients,
                }
        return state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore the global state, every client and the history (any stage). The open round is
        restored separately by :meth:`restore_round`, once the optimizers exist."""
        if list(state["shared_names"]) != list(self.shared_names) or list(state["local_names"]) != list(
            self.local_names
        ):
            raise ValueError(
                f"The checkpoint's federated state was saved with algorithm {state['algorithm']!r} sharing "
                f"{state['shared_names']} and keeping {state['local_names']} local, but this strategy shares "
                f"{list(self.shared_names)} and keeps {list(self.local_names)}. Use the same algorithm and head "
                "as when saving."
            )
        self.global_state = [t.to(device) if device is not None else t for t in state["global"]]
        self.store = ClientStore([])
        self.store.load_state_dict(state["clients"], device)
        self.history = History()
        self.history.load_state_dict(state.get("history", []))
        self.faults = [ClientFault(**f) for f in state.get("faults", [])]
        self.saved_federation = state.get("federation")
        self.algorithm.load_state_dict(state.get("algorithm_state", {}))

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
            self._average = WeightedAverage(self.global_state)
            self._average.load_state_dict(round_state["average"])
        self._local_average = None
        if round_state.get("local_average") is not None:
            self._local_average = WeightedAverage(self.store.template)
            self._local_average.load_state_dict(round_state["local_average"])
        self._finished = [ClientResult(**r) for r in round_state.get("finished", [])]
        self._write(self.shared_names + self.local_names, round_state["live_tensors"])
        client = round_state["live_client"]
        self._live = None if client < 0 else _LiveClient(client)
        counts = round_state.get("live_counts") or []
        if self._live is not None and counts:
            self._live.steps, self._live.timed_steps, self._live.seconds = (
                int(counts[0]),
                int(counts[1]),
                float(counts[2]),
            )
        if self._live is not None:
            self._live.fault = round_state.get("live_fault", "")
        before = round_state.get("before")
        self._before_round = None
        if before is not None:
            device = self._device
            self._before_round = _RoundStart(
                int(before["round_index"]),
                before["rng"],
                {
                    c: {n: t.to(device) for n, t in tensors.items()}
                    for c, tensors in before["finetuned"].items()
                },
                dict(before["clients"]),
            )
        self.live_phase = None
        if self._live is not None and round_state["live_part"]:
            self.set_phase(round_state["live_part"])

    # ------------------------------------------------------------------ internals
    def _tensors(self, names: Iterable[str]) -> list[Tensor]:
        return [self._named[n] for n in names]

    @torch.no_grad()
    def _write(self, names: Sequence[str], values: Sequence[Tensor]) -> None:
        targets = self._tensors(names)
        if targets:
            torch._foreach_copy_(targets, list(values))

    def _write_personal(self, client: int) -> None:
        self._write(self.shared_names, self.global_state)
        personal = self.store.personal(client, self.local_names)
        self._write(list(personal), list(personal.values()))

    def _optimizer_snapshot(self) -> OptimizerState:
        """The optimizer state of the client's local parameters (the shared part restarts every round)."""
        local = {id(t) for t in self._tensors(self.local_names)}
        snapshot: OptimizerState = {}
        for index, optimizer in enumerate(self._optimizers):
            snapshot[index] = {
                i: {
                    k: v.detach().clone() if isinstance(v, Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
                for i, p in enumerate(_optimizer_params(optimizer))
                if id(p) in local and optimizer.state.get(p)
            }
        return snapshot

    def _clock(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return self.clock()

    def _require_data(self) -> tuple[int, ...]:
        if self.client_sizes is None:
            raise RuntimeError(
                "The federation has not seen the training data yet (it does at the start of fit)."
            )
        return self.client_sizes

    def _require_state(self) -> None:
        if self.store is None:
            raise RuntimeError("No federated state yet: call trainer.fit(...) or load a checkpoint first.")


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
