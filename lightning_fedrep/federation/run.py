"""One fit (or evaluation) of a federation, driven step by step by the Lightning face, without Lightning.

:class:`Runner` is the protocol of what runs a round's local work (``lightning_fedrep.runners``: the
sequential runner, the vectorized runner, both wrapped by the per-process ``Sharded`` runner). It is declared
here, in the core, so the core never imports a runner. :class:`FederatedRun` opens and closes rounds around
the runner's steps, hands the clients' ends to the federated callbacks (:class:`CallbackBus`) and builds the
checkpoint entry. The Lightning face (``lightning_fedrep.lightning.strategy``) turns each Lightning hook
into one call here, handing in what it reads from the Trainer as plain values and callables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.federation.api.objective import Objective, StepView, refuse_removed_hooks
from lightning_fedrep.federation.checkpoint.entry import (
    OptimizerState,
    check_round_runner,
    federated_entry,
    restore_rank_state,
    this_rank_state,
)
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.sharding import StepSchedule


class NothingRan:
    """What :meth:`Runner.loss` returns when this process trained nothing at the step (an idle step, or
    the live client failed with ``on_client_error="skip"``)."""

    def __repr__(self) -> str:
        return "NOTHING_RAN"


NOTHING_RAN = NothingRan()


@dataclass(frozen=True)
class StepLoss:
    """A local step's training loss as it enters the round's ``train/loss`` (a lockstep step's: every client's
    that took it): ``total`` is each client's mean loss on its batch times the batch's samples, summed over the
    clients, ``samples`` the sum of those samples (``total / samples``: the mean loss per sample)."""

    total: Tensor
    samples: Tensor

    def __add__(self, other: StepLoss) -> StepLoss:
        return StepLoss(self.total + other.total, self.samples + other.samples)


def step_loss(losses: Tensor, samples: Tensor) -> StepLoss:
    """The :class:`StepLoss` of local steps with mean losses ``losses`` on batches of ``samples`` each (tensors of
    one shape; a local step that did not run has ``samples`` 0). Summed in at least float32, samples counted
    exactly (int64), on the losses' device, without a synchronization."""
    dtype = torch.promote_types(losses.dtype, torch.float32)
    return StepLoss((losses.detach().to(dtype) * samples.to(dtype)).sum(), samples.sum().to(torch.int64))


class Notify(Protocol):
    def __call__(self, hook: str, *args: Any) -> None: ...


class Runner(Protocol):
    """Runs a round's local work one Lightning step at a time against a :class:`Federation`; no Lightning.

    The sequential runner trains one client step per Lightning step (the user's ``training_step``); the
    lockstep runner trains a group of clients per step (``torch.func``). Runners hand the clients they
    start and finish to the callbacks themselves (``notify``), so the callbacks see them in order.
    """

    vectorized: bool
    """Whether the clients train in lockstep (what a mid-round checkpoint records as ``"engine"``)."""

    def schedule(self, plan: RoundPlan, own: bool = True) -> RoundPlan | StepSchedule:
        """What the round's loader iterates (``own``: this process's part, worth caching)."""

    def open_round(self, plan: RoundPlan) -> None:
        """Before the round's first step (the processes agree on the plan here)."""

    def begin_step(self, plan: RoundPlan, step: int) -> None:
        """Before the round's ``step``-th Lightning step: open the group/client and phase."""

    def loss(self, batch: Any, batch_idx: int, user_step: Callable[[], Any]) -> Any:
        """``training_step``'s value: the user's step plus loss terms, the lockstep losses, or
        :data:`NOTHING_RAN`."""

    def logged_loss(self) -> Sequence[StepLoss]:
        """The step's losses for the round's ``train/loss``, one per local step it ran (a lockstep step: every
        client's), in order; empty where nothing ran, or where the user's step ran (it logs its own)."""

    def step(self, optimizer_step: Callable[..., Any], closure: Callable[[], Any]) -> Any:
        """The optimizer step (``optimizer_step()`` runs the user's with ``closure``, ``optimizer_step(c)``
        with the closure ``c`` instead, e.g. one that transforms the gradients after the backward;
        ``closure`` only the loss and backward)."""

    def end_step(self) -> None:
        """After the optimizer step: hand over the clients whose round work is done."""

    def finish(self) -> None:
        """Hand over the open client/group (round end, or a round cut short)."""

    def abandon(self) -> None:
        """The round was rolled back: drop the open client/group."""

    @property
    def current_clients(self) -> tuple[int, ...]: ...

    @property
    def current_phase(self) -> str | None: ...

    def settings(self) -> dict[str, Any] | None:
        """What a checkpoint keeps at every stage (the lockstep widths); ``None``: nothing."""

    def state_dict(self) -> dict[str, Any] | None:
        """The open group (mid-round), or ``None``."""

    def load_settings(self, settings: dict[str, Any] | None) -> None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


class CallbackBus:
    """The federated callbacks, as the run sees them. The face binds ``trainer`` and ``module`` (opaque
    here: each event hook receives them first, as Lightning callbacks do). The loss terms come from every
    callback's ``objective(phase)`` (:func:`local_objective`); a callback that still defines a removed
    loss-term hook is refused here, at the strategy's ``setup``."""

    def __init__(self, callbacks: Sequence[Any] = (), trainer: Any = None, module: Any = None):
        for callback in callbacks:
            refuse_removed_hooks(callback, "FederatedCallback")
        self.callbacks = list(callbacks)
        self.trainer = trainer
        self.module = module

    def notify(self, hook: str, *args: Any) -> None:
        """Call ``hook`` (``on_round_start``, ``on_client_start``, ...) on every federated callback."""
        for callback in self.callbacks:
            getattr(callback, hook)(self.trainer, self.module, *args)

    def configure_round(self, plan: RoundPlan) -> RoundPlan:
        """``plan`` after every callback's ``configure_round``."""
        for callback in self.callbacks:
            changed = callback.configure_round(self.trainer, plan)
            if not isinstance(changed, RoundPlan) or changed.round != plan.round:
                raise TypeError(
                    f"{type(callback).__name__}.configure_round must return a RoundPlan for round {plan.round} "
                    f"(e.g. plan.replace(clients=...)), got {changed!r}."
                )
            plan = changed
        return plan


PHASE_PARTS = ("head", "body", "all")
"""The phase parts an objective is resolved for (a callback's ``configure_round`` may add any)."""


def local_objective(
    algorithm: Algorithm, bus: CallbackBus, phase: str, privacy: PrivacyMechanism | None = None
) -> Objective:
    """The local objective of a phase training ``phase``: the algorithm's, then each callback's, every one
    asked ``objective(phase)``, then as the ``privacy`` mechanism privatizes it (resolved once per fit and
    phase, at its first use)."""
    cache = bus.__dict__.setdefault("_objectives", {})
    key = (phase, id(privacy))
    if key not in cache:
        objective = _objective_of(algorithm, phase)
        for callback in bus.callbacks:
            found = _objective_of(callback, phase)
            if objective.step is not None and found.step is not None:
                raise ValueError(
                    f"{type(callback).__name__}.objective sets the step rule {found.step.name!r}, but the "
                    f"step rule {objective.step.name!r} (of {type(algorithm).__name__} or an earlier callback) "
                    "already computes the step's gradients: at most one objective may set Objective.step."
                )
            objective = objective + found
        objective = objective.for_phase(phase)
        if privacy is not None:
            objective = privacy.local_objective(objective, phase)
            if not isinstance(objective, Objective):
                raise TypeError(
                    f"{type(privacy).__name__}.local_objective must return an Objective, got {objective!r}."
                )
        cache[key] = objective
    return cache[key]


def _objective_of(owner: Any, phase: str) -> Objective:
    """``owner.objective(phase)`` (an algorithm's or a callback's), refused unless it is an ``Objective``."""
    found = owner.objective(phase)
    if not isinstance(found, Objective):
        raise TypeError(
            f"{type(owner).__name__}.objective must return an Objective (Objective() for none), got {found!r}."
        )
    return found


def has_loss_terms(algorithm: Algorithm, bus: CallbackBus, privacy: PrivacyMechanism | None = None) -> bool:
    """Whether the algorithm, a callback or the ``privacy`` mechanism adds a loss term, a step transform or a
    step rule in any phase."""
    return any(not local_objective(algorithm, bus, phase, privacy).empty for phase in PHASE_PARTS)


def refuse_manual_loss_terms(
    manual_fit: bool, algorithm: Algorithm, bus: CallbackBus, privacy: PrivacyMechanism | None = None
) -> None:
    """Refuse loss terms (the algorithm's, a callback's, a privacy mechanism's step rule) in a fit under manual
    optimization: they are added to the loss of the automatic-optimization closure."""
    if manual_fit and has_loss_terms(algorithm, bus, privacy):
        raise RuntimeError(
            "Loss terms (from the algorithm, a FederatedCallback or the privacy mechanism) need automatic "
            "optimization; this module uses manual optimization."
        )


def live_view(
    federation: Federation, module: Any, batch: Any, batch_idx: int, step: int, lr: float | None
) -> StepView:
    """The sequential runner's :class:`StepView` of the live client (the live module's tensors)."""
    phase = federation.live_phase
    named = dict(module.named_parameters())
    tensors = {**dict(module.named_buffers()), **named}
    trained = {n: p for n, p in named.items() if p.requires_grad}
    device = next(iter(named.values())).device if named else None
    return StepView(
        tensors=tensors,
        trained=trained,
        server={**federation.global_view(), **federation.server_tensors},
        client=torch.tensor(federation.live_client, device=device),
        client_state=federation.store.client_state(federation.live_client),
        phase=phase,
        round=federation.round_index,
        step=step,
        client_step=step,
        lr=lr,
        batch=batch,
        batch_idx=batch_idx,
        slot=federation.live_slot,
    )


class FederatedRun:
    """A fit/validate/test of a federation: its :class:`Federation`, the :class:`Runner` of the local work
    and the :class:`CallbackBus`. Opens and closes rounds around the runner's steps.

    Args:
        federation: the federated state and round transaction.
        runner: what runs the local work (always the per-process ``Sharded`` wrapper).
        bus: the federated callbacks.
        zero: a zero loss that needs a gradient (a step that trains nothing under automatic optimization).
    """

    def __init__(self, federation: Federation, runner: Runner, bus: CallbackBus, zero: Callable[[], Any]):
        self.federation = federation
        self.runner = runner
        self.bus = bus
        self.zero = zero
        self.round_start_loops: dict[str, Any] | None = None
        """The Trainer's loops as they were when the open round started (a rolled-back round resumes there)."""
        self.validated_round = -1
        """The last round validated in this fit."""
        self.round_loss: StepLoss | None = None
        """The open round's training loss so far, of the steps whose runner computed it (:meth:`loss`)."""
        self.log_columns: Callable[[Mapping[str, float]], None] | None = None
        """Where a closed round's server-side columns go (``RoundResult.metrics``: the server step's metrics,
        ``privacy/epsilon``, ...), where the host can log during training (the strategy: its loggers); ``None``:
        the history only."""

    # ------------------------------------------------------------------ rounds
    def plan(self, round_index: int) -> RoundPlan:
        """The frozen plan of a round, after every callback's ``configure_round``."""
        return self.federation.plan(round_index, self.bus.configure_round)

    def schedule(self, round_index: int) -> RoundPlan | StepSchedule:
        """What the round's loader iterates on this process."""
        return self.runner.schedule(self.plan(round_index))

    def training_step_starts(self, round_index: int, step: int, loops: Callable[[], dict[str, Any]]) -> None:
        """Before a training step: close the last round if it is still open, open this one on its first
        step (``loops``: the Trainer's loop state to rewind to), then the runner's step."""
        federation = self.federation
        if federation.round_open and federation.round_index != round_index:
            self.close_round()
        plan = self.plan(round_index)
        if not federation.round_open:
            self.runner.open_round(plan)
            self.round_loss = None
            self.round_start_loops = loops()
            federation.open_round(plan)
            self.bus.notify("on_round_start", plan)
        self.runner.begin_step(plan, step)

    def loss(
        self,
        batch: Any,
        batch_idx: int,
        user_step: Callable[[], Any],
        automatic: bool,
        round_ends: Callable[[], bool],
        log: Callable[[float, int], None],
    ) -> Any:
        """``training_step``'s value. Under manual optimization the step is over when it returns: the
        round closes after its last step. After the round's last step, ``log(mean, samples)`` receives the
        round's training loss where the runner computed it (see :meth:`log_round_loss`)."""
        output = self.runner.loss(batch, batch_idx, user_step)
        for loss in self.runner.logged_loss():  # one by one: a fused call sums as its unfused steps do
            self.round_loss = loss if self.round_loss is None else self.round_loss + loss
        if round_ends():
            self.log_round_loss(log)
        if not automatic:
            self.step_done(round_ends)
            return None if output is NOTHING_RAN else output
        return self.zero() if output is NOTHING_RAN else output

    def log_round_loss(self, log: Callable[[float, int], None]) -> None:
        """At the round's last step, on every process: the round's training loss where the runner computed it
        (the vectorized runner, a step rule), summed over the processes, as ``log(mean, samples)``: the mean over
        every local step of every client of the step's mean loss, weighted by its batch's samples (the mean
        loss per trained sample); nothing where the user's ``training_step`` ran (it logs its own)."""
        loss, self.round_loss = self.round_loss, None
        mine = (0.0, 0) if loss is None else (float(loss.total), int(loss.samples))
        every = self.federation.collective.all_gather_object(mine)
        total, samples = sum(t for t, _ in every), sum(n for _, n in every)
        if samples:
            log(total / samples, samples)

    def optimizer_step(
        self,
        optimizer_step: Callable[[], Any],
        closure: Callable[[], Any],
        automatic: bool,
        round_ends: Callable[[], bool],
    ) -> Any:
        """The optimizer step; under automatic optimization the step is then over (see :meth:`step_done`)."""
        output = self.runner.step(optimizer_step, closure)
        if automatic:
            self.step_done(round_ends)
        return output

    def step_done(self, round_ends: Callable[[], bool]) -> None:
        """After a training step: hand over finished clients; close the round after its last step."""
        self.runner.end_step()
        if round_ends():
            self.close_round()

    def close_round(self, log: bool = True) -> None:
        """Hand over the open clients, aggregate, log the round's server-side columns (``log``: where the host
        can, :attr:`log_columns`), and tell the callbacks."""
        self.runner.finish()
        result = self.federation.close_round()
        if result is None:
            return
        if log and result.metrics and self.log_columns is not None:
            self.log_columns(result.metrics)
        self.bus.notify("on_round_end", result)

    def end_training(self) -> str | None:
        """At the end of training: close a round cut short (returns the warning to show), release phases."""
        federation = self.federation
        note = None
        if federation.round_open:
            note = f"Training stopped inside round {federation.round_index}; averaging the clients that trained in it."
            self.close_round(log=False)  # Lightning logs nothing from on_train_end: the history keeps them
        federation.release_phases()
        return note

    def roll_back(self) -> str | None:
        """Roll the open round back (the run stopped inside it); returns the warning to show, ``None`` when
        no round was open."""
        federation = self.federation
        stopped_in = federation.round_index
        if not federation.rollback_round():
            return None
        self.runner.abandon()
        return (
            f"The run stopped inside round {stopped_in}: the round is rolled back (a checkpoint written now "
            "resumes at its first step)."
        )

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_entry(
        self,
        collective: Collective,
        optimizers: Sequence[OptimizerState],
        interrupted: bool,
        validation_owed: bool,
    ) -> dict[str, Any]:
        """The federated entry of a checkpoint written now."""
        return federated_entry(
            self.federation,
            collective,
            runner=self.runner,
            optimizers=optimizers,
            round_start_loops=self.round_start_loops,
            interrupted=interrupted,
            validation_owed=validation_owed,
        )

    def restore(
        self, state: dict[str, Any], collective: Collective, optimizers: Sequence[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """Restore this process's open round, RNG and round records, its ``optimizers`` inside an open round
        (the trainer restored rank 0's), and the runner's settings and open group; returns this process's
        saved state (``validation_owed``)."""
        state = this_rank_state(state, collective.rank, collective.world_size)
        restore_rank_state(self.federation, state)
        if state["round"]["open"]:
            self.round_start_loops = state["round"].get("start_loops")
        self.runner.load_settings(state.get("engine"))
        if self.federation.round_open:
            check_round_runner(state, vectorized=self.runner.vectorized)
            self.runner.load_state_dict(state["round"].get("engine"))
        if "optimizers" in state and state["round"]["open"]:
            for optimizer, saved in zip(optimizers, state["optimizers"]):
                optimizer.load_state_dict(saved)
        return state
