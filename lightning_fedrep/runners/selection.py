"""Which runner runs a fit: the strategy's ``runner=`` setting against what is exact and what is faster.

:meth:`RunnerSelection.setup` runs at ``setup`` (before any step): the reasons the lockstep runner would not
compute what the sequential runner computes send ``runner="auto"`` to the sequential runner with one line,
and make ``runner="vectorized"`` an error naming them. :meth:`RunnerSelection.first_loader` runs when the
first training loader is bound: it decides the feature cache and the widths, and under ``"auto"`` keeps
the sequential runner where the engine would gain nothing. Lightning-free: the face hands in the Trainer's
facts as :class:`~lightning_fedrep.runners.constraints.Constraints` and prints the returned line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_fedrep.evaluation.head_tuning import ClientHead, HeadFineTuning
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import PART_GROUPS, Algorithm
from lightning_fedrep.federation.api.scoring import evaluation_spec
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.federation.module.untouched import untouched_random_state
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.run import PHASE_PARTS, FederatedRun, local_objective
from lightning_fedrep.runners.constraints import Constraints
from lightning_fedrep.runners.lockstep.engine import LockstepEngine
from lightning_fedrep.runners.lockstep.fusion import resolve_steps_per_call
from lightning_fedrep.runners.lockstep.heads_together import fit_heads_together
from lightning_fedrep.runners.lockstep.probe import SIDE_EFFECTS, vectorize_problem
from lightning_fedrep.runners.lockstep.runner import LockstepRunner
from lightning_fedrep.runners.lockstep.validity import (
    federation_reasons,
    module_reasons,
    random_layers,
    trainer_reasons,
)
from lightning_fedrep.runners.runner_report import (
    PER_BATCH_FORWARD,
    PER_CLIENT_LINE,
    RunnerReport,
    randomness_contract,
)
from lightning_fedrep.runners.sequential import SequentialRunner
from lightning_fedrep.runners.settings import Randomness, RunnerChoice, RunnerSettings, StepsPerCall
from lightning_fedrep.runners.sharded import Sharded


@dataclass(frozen=True)
class Decision:
    """A runner decision: the vectorized runner's engine (``None``: the sequential runner), the report (``None``:
    unchanged) and the line to log (``None``: none)."""

    engine: LockstepEngine | None
    report: RunnerReport | None = None
    line: str | None = None


def build_engine(
    mode: RunnerChoice,
    constraints: Constraints,
    module: nn.Module,
    federation: Federation,
    algorithm: Algorithm,
    callbacks: Sequence[Any],
    width: int | None,
    objectives: dict[str, Any] | None = None,
    steps_per_call: StepsPerCall = "auto",
    compile: bool = False,
    randomness: Randomness = "exact",
) -> Decision:
    """The vectorized runner for this fit, or the sequential runner (``mode="auto"`` where the engine would
    not be exact); raises for ``mode="vectorized"`` where it would not be exact. The engine runs
    ``steps_per_call`` lockstep steps per Lightning step (:func:`~lightning_fedrep.runners.lockstep.fusion.resolve_steps_per_call`:
    refused here where something needs a Lightning step per local step), its cached head steps compiled
    where ``compile`` (:mod:`~lightning_fedrep.runners.lockstep.compiled`; not in a smoke run, nor with random
    layers under ``randomness="per_client"``). ``randomness`` is the strategy's contract for random layers
    (``"per_client"``: they are no reason, each client draws its own)."""
    if mode == "sequential":
        return Decision(None, RunnerReport.sequential("runner='sequential'", "setup"))
    objectives = objectives or {}
    reasons = (
        module_reasons(module, federation.layout, constraints, randomness)
        + trainer_reasons(constraints)
        + federation_reasons(objectives, callbacks)
    )
    if federation.config.on_client_error == "skip":
        reasons.append(
            "on_client_error='skip' leaves out the one client whose step raised, which needs its own steps"
        )
    started = _start_client_buffers(algorithm, module, federation)
    if started:
        reasons.append(
            f"{type(algorithm).__name__}.start_client may give a client its own starting buffers "
            f"({', '.join(started)}), which lockstep holds once for a whole group"
        )
    slots = sorted({phase.slot for phase in federation.config.phases} - {"model"})
    if slots:
        reasons.append(
            f"a phase trains the per-client slot {', '.join(map(repr, slots))}, which lockstep does not"
        )
    if reasons:
        if mode == "vectorized":
            raise ValueError(
                "runner='vectorized' would not compute what the sequential runner computes: "
                f"{'; '.join(reasons)}. Remove what is listed, or pass runner='auto' (falls back to the "
                "sequential runner) or runner='sequential'."
            )
        report = RunnerReport.sequential("; ".join(reasons), "setup")
        return Decision(None, report, f"lightning_fedrep: sequential runner ({'; '.join(reasons)}).")
    calls, calls_line = resolve_steps_per_call(steps_per_call, constraints.per_step_needs, constraints.smoke)
    report = RunnerReport.vectorized(
        "nothing at setup keeps it sequential; the first loader decides", "setup"
    )
    engine = LockstepEngine(
        federation,
        module,
        constraints.optimizers[0],
        declared_loss(module),
        width,
        objectives=objectives,
        convert_input=constraints.convert_input,
        to_device=constraints.to_device,
        randomness=randomness,
    )
    engine.steps_per_call, engine.calls_line = calls, calls_line
    engine.compile_skipped = _compile_skipped(compile, constraints.smoke, randomness, module)
    engine.compile = compile and engine.compile_skipped is None
    return Decision(engine, report)


def _compile_skipped(compile: bool, smoke: bool, randomness: Randomness, module: nn.Module) -> str | None:
    """Why ``compile=True`` compiles nothing in this fit, or ``None``: a smoke run, or random layers drawn per
    client (the compiled head step has no keyed per-client draws)."""
    if not compile:
        return None
    if smoke:
        return "fast_dev_run: a smoke run is not worth compiling"
    layers = random_layers(module) if randomness == "per_client" else []
    if layers:
        return f"randomness='per_client' with random layers ({', '.join(layers)}) steps eagerly"
    return None


def _start_client_buffers(algorithm: Algorithm, module: nn.Module, federation: Federation) -> list[str]:
    """The buffers among the tensors an overridden ``Algorithm.start_client`` may change per client (the
    lockstep runner stacks each client's parameters, but reads buffers from the module, one for all)."""
    if type(algorithm).start_client is Algorithm.start_client:
        return []
    names = set(federation.layout.shared) | set(federation.layout.local)
    return sorted(n for n, _ in module.named_buffers() if n in names)


def start_engine(
    engine: LockstepEngine,
    mode: RunnerChoice,
    loader: Any,
    plan: RoundPlan,
    device: torch.device,
    memory: int | None,
    smoke: bool,
    collective: Collective | None = None,
) -> Decision:
    """On the fit's first training loader: check on probe batches that the engine trains what
    ``training_step`` trains, decide the feature cache and the widths and say so in one line; the
    sequential runner where ``mode="auto"`` keeps it (``mode="vectorized"`` raises where the engine
    would not train what the step trains). Later loaders change nothing.
    On several processes every rank takes the first probe problem any rank found (so all fall back
    together), caches features only where every rank can, takes rank 0's lane choice (its timing decides
    for all) and the smallest group width any rank's memory allows."""
    distributed = collective is not None and collective.distributed
    cache = engine.bind_loader(loader, device, collective.all_gather_object if distributed else None)
    if cache is None:
        return Decision(engine)
    if engine.probe_problem is not None or engine.loss_terms_problem is not None:
        reason = engine.probe_problem or engine.loss_terms_problem
        if mode == "vectorized":
            raise ValueError(
                f"runner='vectorized' cannot run here: {reason}. {_probe_fix(reason, engine.probe_problem)}, or "
                "pass runner='auto' (falls back to the sequential runner) or runner='sequential'."
            )
        report = RunnerReport.sequential(reason, "first loader")
        return Decision(None, report, f"lightning_fedrep: sequential runner ({reason}).")
    gather = collective.all_gather_object if distributed else None
    unbatched = _vectorize_problem(engine, loader, plan, device, gather)
    if unbatched is not None:
        if mode == "vectorized":
            raise ValueError(
                f"runner='vectorized' cannot run here: {unbatched}. torch.func.vmap cannot batch an operation "
                "of this module's loss or gradient; pass runner='sequential' (or runner='auto', which falls "
                "back to it)."
            )
        report = RunnerReport.sequential(unbatched, "first loader")
        return Decision(None, report, f"lightning_fedrep: sequential runner ({unbatched}).")
    if engine.caching and not engine.caches_head(plan):
        cache = f"no head phase in the first round; any later one on cached features ({engine.split.how})"
    widths = engine.prepare(plan, device, measure=mode == "auto" and not smoke, memory=memory, smoke=smoke)
    if distributed:  # rank 0's timing, the smallest memory bound
        every = collective.all_gather_object(engine.settings())
        bounded = [s["group_width"] for s in every if s["group_width"]]
        engine.use_widths(
            {"group_width": min(bounded) if bounded else 0, "lane_width": every[0]["lane_width"]}
        )
    if mode == "auto" and not engine.gains(plan):
        no_gain = f"no cached features and no gain in lockstep: {widths}"
        report = RunnerReport.sequential(no_gain, "first loader")
        return Decision(None, report, f"lightning_fedrep: sequential runner ({no_gain}).")
    cached = ("head",) if engine.caching else ()
    how = engine.split.how if cached else ""
    report = RunnerReport.vectorized(f"{cache}; {widths}", "first loader", cached, how)
    return Decision(engine, report, f"lightning_fedrep: vectorized runner ({cache}; {widths}).")


def _probe_fix(reason: str, probe_problem: str | None) -> str:
    """How to make the module run on the engine, for a refusal of ``runner="vectorized"`` on the probe batches."""
    if probe_problem is None:
        return "Declare forward_features/forward_head on the module (its features being what the loss terms take)"
    fixes = []
    if not reason.startswith(SIDE_EFFECTS):
        fixes.append(
            "the engine runs no training_step: it trains mean(fedrep_loss(module(x), y)) on (inputs, targets) "
            "batches and logs only 'train/loss'; make the module match that"
        )
    if SIDE_EFFECTS in reason:
        fixes.append(
            "move those writes out of training_step: compute a metric in validation_step (it runs per client on "
            "every engine), count local steps in a FederatedCallback's on_client_end (result.steps)"
        )
    joined = "; ".join(fixes)
    return joined[0].upper() + joined[1:]


def _vectorize_problem(
    engine: LockstepEngine,
    loader: Any,
    plan: RoundPlan,
    device: torch.device,
    gather: Callable[[Any], list[Any]] | None,
) -> str | None:
    """Why ``torch.func.vmap`` cannot run the engine's loss and gradient (:func:`vectorize_problem`) on
    the first client's first batch, for each phase kind ``plan`` trains (its head phases on cached
    features where the engine caches them); on several processes (``gather``) the first any rank found."""
    split = engine.federation.split
    parts = {
        phase.train: [n for n in engine.trainable if split.group(n) in PART_GROUPS[phase.train]]
        for phase in plan.phases
        if phase.epochs or phase.steps
    }
    forward = None
    if engine.needs_features and engine.split is not None:  # the loss terms' run: head(features(x))
        features, head = engine.split.features, engine.split.head

        def forward(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return head(tensors, features(tensors, x))

    with untouched_random_state():
        batch = loader.probe_batch(plan.work[0].client, plan.round, 0)
    batch = engine.to_device(engine.convert_input(batch), device)
    cached = engine.split if engine.caching else None
    module, loss_fn = engine.module, engine.loss_fn
    problem = vectorize_problem(
        module, loss_fn, batch, parts, engine.trainable, forward, cached, engine.randomness
    )
    if gather is None:
        return problem
    found = [v["vectorize_problem"] for v in gather({"vectorize_problem": problem}) if v["vectorize_problem"]]
    return found[0] if found else None


def _step_rule_loss(objectives: dict[str, Any], module: nn.Module) -> Any:
    """The module's declared loss where an objective has a step rule (``None`` where none has); refuses a
    step rule on a module without ``fedrep_loss``, or one combined with loss terms (it replaces the loss)."""
    rules = {o.step.name: o for o in objectives.values() if o.step is not None}
    if not rules:
        return None
    name, objective = next(iter(rules.items()))
    if objective.terms:
        terms = ", ".join(repr(t.name) for t in objective.terms)
        raise ValueError(
            f"The step rule {name!r} computes the step's gradients from the declared loss, so the loss terms "
            f"{terms} would be ignored: drop them, or fold them into the rule."
        )
    loss_fn = declared_loss(module)
    if loss_fn is None:
        raise ValueError(
            f"The step rule {name!r} differentiates the module's declared loss, and {type(module).__name__} "
            "declares none: set fedrep_loss on the module (e.g. fedrep_loss = 'cross_entropy', or a callable "
            "(output, target) -> per-sample loss), the loss its training_step computes."
        )
    return loss_fn


class RunnerSelection:
    """The runner of a fit, decided at ``setup``, on the first training loader and on a resumed checkpoint;
    every decision installs the runner (always wrapped in :class:`Sharded`) on the :class:`FederatedRun`.

    Args:
        settings: the strategy's ``runner=`` setting (the choice, and the vectorized runner's ``width``,
            ``memory``, ``steps_per_call`` and ``compile``).
        randomness: the strategy's ``randomness=`` setting (``"per_client"``: the vectorized runner takes random
            layers, each client drawing its own; the report says which contract ran).
    """

    def __init__(self, settings: RunnerSettings, randomness: Randomness = "exact"):
        self.settings = settings
        self.randomness: Randomness = randomness
        """The strategy's contract for random layers on the vectorized runner (``"exact"`` or ``"per_client"``)."""
        self.mode: RunnerChoice = settings.choice
        self.width, self.memory = settings.width, settings.memory
        self.steps_per_call: StepsPerCall = settings.steps_per_call
        self.compile = settings.compile
        self.report: RunnerReport | None = None
        """Which runner runs this fit's training steps and why (``None`` before the first fit's ``setup``)."""
        self.engine: LockstepEngine | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        """The user's optimizer (what ``StepView.lr`` reads on the sequential runner)."""
        self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        """The user's optimizers (the sequential runner scales their lrs by a client's ``lr_scale``)."""
        self.loss_fn: Any = None
        """The module's declared per-sample loss where a step rule needs it (the sequential runner's)."""
        self.evaluation: str | None = None
        """How evaluation runs where the engine does not batch it (``RunnerReport.evaluation``)."""

    @staticmethod
    def fit_heads_together(
        tuning: HeadFineTuning, clients: Sequence[ClientHead]
    ) -> list[dict[str, torch.Tensor]]:
        """Many clients' heads fine-tuned at once on their cached features (the vectorized runner's
        :func:`~lightning_fedrep.runners.lockstep.heads_together.fit_heads_together`, whatever runner trains):
        what the strategy's ``fit_heads_together`` runs."""
        return fit_heads_together(tuning, clients)

    @property
    def engine_settings(self) -> dict[str, Any]:
        """The lockstep engine's decided settings (what the strategy's ``runner_settings`` shows: the widths,
        one client's estimated bytes, the feature cache, lockstep steps per call, compilation); ``{}``
        without an engine (the sequential runner)."""
        engine = self.engine
        if engine is None:
            return {}
        return {
            "group_width": engine.group_width,
            "lane_width": engine.lane_width,
            "client_bytes": engine.client_bytes,
            "caching": engine.caching,
            "split": engine.split.how if engine.split is not None else None,
            "steps_per_call": engine.steps_per_call,
            "compile": engine.compile,
        }

    def _lr(self) -> float | None:
        groups = self.optimizer.param_groups if self.optimizer is not None else ()
        return groups[0].get("lr") if groups else None

    def install(self, run: FederatedRun, algorithm: Algorithm, collective: Collective) -> None:
        """Give ``run`` the runner decided so far (sequential until :meth:`setup` decides)."""
        notify = run.bus.notify
        inner = (
            LockstepRunner(self.engine, notify)
            if self.engine is not None
            else SequentialRunner(
                run.federation,
                notify,
                lambda phase: local_objective(algorithm, run.bus, phase, run.federation.config.privacy),
                run.bus.module,
                self._lr,
                lambda: self.optimizers,
                self.loss_fn,
            )
        )
        run.runner = Sharded(inner, collective)

    def _take(self, decision: Decision) -> str | None:
        self.engine = decision.engine
        line = decision.line
        if self.compile and line is not None and decision.engine is None:
            line = f"{line} compile=True compiles nothing on it (it runs the module's training_step)."
        if decision.report is not None:
            report = decision.report
            self.report = replace(
                report,
                randomness=self.randomness,
                randomness_contract=randomness_contract(report.runner, self.randomness),
            )
            if self.report.runner == "vectorized" and self.randomness == "per_client" and line is not None:
                line = f"{line} {PER_CLIENT_LINE}"
            if self.report.runner == "vectorized" and self.evaluation is not None:
                self.report = replace(self.report, evaluation=self.evaluation)
                line = None if line is None else f"{line} Evaluation: {self.evaluation}."
        return line

    def setup(
        self,
        run: FederatedRun,
        constraints: Constraints,
        module: nn.Module,
        algorithm: Algorithm,
        collective: Collective,
        fit: bool,
    ) -> str | None:
        """At ``setup``: the runner for a fit (the sequential one for other stages); returns the line to log."""
        self.engine = None
        self.optimizer = constraints.optimizers[0] if constraints.optimizers else None
        self.optimizers = tuple(constraints.optimizers)
        line = None
        self.loss_fn = None
        self.evaluation = PER_BATCH_FORWARD if evaluation_spec(algorithm).forward is not None else None
        if fit:
            callbacks = run.bus.callbacks
            privacy = run.federation.config.privacy
            objectives = {phase: local_objective(algorithm, run.bus, phase, privacy) for phase in PHASE_PARTS}
            self.loss_fn = _step_rule_loss(objectives, module)
            decision = build_engine(
                self.mode,
                constraints,
                module,
                run.federation,
                algorithm,
                callbacks,
                self.width,
                objectives,
                self.steps_per_call,
                self.compile,
                self.randomness,
            )
            line = self._take(decision)
        self.install(run, algorithm, collective)
        return line

    def first_loader(
        self,
        run: FederatedRun,
        loader: Any,
        plan: RoundPlan,
        device: torch.device,
        smoke: bool,
        algorithm: Algorithm,
        collective: Collective,
    ) -> str | None:
        """When a training loader is bound (only the first one decides); returns the line to log."""
        if self.engine is None:
            return None
        decision = start_engine(
            self.engine, self.mode, loader, plan, device, self.memory, smoke=smoke, collective=collective
        )
        line = self._take(decision)
        self.install(run, algorithm, collective)
        return line

    def checkpoint(
        self, run: FederatedRun, state: dict[str, Any], algorithm: Algorithm, collective: Collective
    ) -> None:
        """A resumed ``runner="auto"`` run keeps the runner of the run that saved the checkpoint."""
        if self.engine is not None and self.mode == "auto" and "engine" not in state:
            self._take(
                Decision(
                    None,
                    RunnerReport.sequential("the checkpoint was written by a sequential run", "checkpoint"),
                )
            )
            self.install(run, algorithm, collective)
