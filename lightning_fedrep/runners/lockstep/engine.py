"""``LockstepEngine``: runs a round's local work with its clients in lockstep (the strategy's fast path).

Per Lightning step it computes every active client's loss in one ``torch.func.vmap`` over the
group's stacked tensors (the module as a pure function of its tensors, with the declared per-sample
loss, padding masked out), and after Lightning's backward steps every client's own optimizer. In a
head phase whose body is frozen and deterministic, each client's features are computed once per
segment and the head trains on them. Finished clients go to the :class:`Federation` exactly as the
sequential path hands them over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_fedrep.federation import ClientResult, Federation
from lightning_fedrep.federation.api.algorithm import PART_GROUPS
from lightning_fedrep.federation.api.objective import LossTerm, Objective, StepRule, StepView, pure_loss
from lightning_fedrep.federation.module.feature_chunks import FEATURE_CHUNK, feature_chunk_of
from lightning_fedrep.federation.module.feature_split import FeatureSplit, find_feature_split, same_tensor
from lightning_fedrep.federation.module.losses import NAMED_LOSSES, LossFn, masked_mean
from lightning_fedrep.federation.module.stateless import stateless_call
from lightning_fedrep.federation.module.untouched import untouched_modes, untouched_random_state
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.run import StepLoss, step_loss
from lightning_fedrep.runners.constraints import move_to_device
from lightning_fedrep.runners.lockstep import sizing
from lightning_fedrep.runners.lockstep.compiled import CompiledHeadStep
from lightning_fedrep.runners.lockstep.group import ClientGroup
from lightning_fedrep.runners.lockstep.loading import ClientBatches
from lightning_fedrep.runners.lockstep.probe import PROBE_SEED, loss_label, probe_problem
from lightning_fedrep.runners.lockstep.randomness import step_draws, vmap_randomness
from lightning_fedrep.runners.lockstep.schedule import FusedBatches, LockstepPlan, Segment, lockstep_plan
from lightning_fedrep.runners.settings import Randomness

SMOKE_GROUP = 4
"""Clients per group in a smoke run (``fast_dev_run``: one lockstep step is the whole run)."""

NO_OBJECTIVE = Objective()
"""The objective of a phase that none was given for: the declared loss alone."""


def data_is_deterministic(loader: ClientBatches) -> str | None:
    """``None`` if every training batch is a pure function of its sample indices, else why not."""
    return loader.random_batches()


class LockstepEngine:
    """The vectorized execution of a federation's rounds.

    Args:
        federation: the federated state it reads clients from and hands them back to.
        module: the live module, used as a stateless template (``torch.func.functional_call``).
        optimizer: the user's optimizer (class, param groups, hyper-parameters).
        loss: the module's declared per-sample loss.
        width: at most this many clients train together (memory); ``None``: a round's clients.
        split: how to run the head on cached features (``None``: no caching).
        objectives: the local objective of each phase part (the algorithm's and the callbacks'): its loss
            terms are applied per client inside the ``vmap``, its transforms per client around the step.
        convert_input: what Lightning does to a training batch before the step (the trainer's precision,
            e.g. float tensors to float64 under ``precision="64-true"``), applied to the batches the
            engine draws itself (probe, cached features, timing).
        to_device: how a batch moves to a device (the face passes Lightning's ``move_data_to_device``).
        randomness: the strategy's contract for random layers: ``"exact"`` (none runs: the set-up checks and the
            probe refuse them) or ``"per_client"`` (every forward of a step draws each client's own random
            numbers, from a generator keyed by the seed, round, phase, step and the step's clients:
            :mod:`~lightning_fedrep.runners.lockstep.randomness`).
    """

    def __init__(
        self,
        federation: Federation,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LossFn,
        width: int | None = None,
        split: FeatureSplit | None = None,
        objectives: Mapping[str, Objective] | None = None,
        convert_input: Callable[[Any], Any] | None = None,
        to_device: Callable[[Any, torch.device], Any] | None = None,
        randomness: Randomness = "exact",
    ):
        self.federation = federation
        self.randomness: Randomness = randomness
        self.module = module
        self.user_optimizer = optimizer
        self.loss_fn = loss
        self._forward = stateless_call(module)
        self._pure_loss = pure_loss(module, loss)
        self.convert_input = convert_input or (lambda batch: batch)
        self.to_device = to_device or move_to_device
        self.probe_problem: str | None = None
        """Why the engine would not train what ``training_step`` trains (decided in :meth:`bind_loader`:
        :func:`~lightning_fedrep.runners.lockstep.probe.probe_problem`), or ``None``."""
        self.objectives: dict[str, Objective] = dict(objectives or {})
        self.loss_terms: list[LossTerm] = list(
            {id(t): t for o in self.objectives.values() for t in o.terms}.values()
        )
        """Every phase's loss terms (those with ``needs_features`` need a feature split)."""
        self.needs_features = any(term.needs_features for term in self.loss_terms)
        """Whether uncached steps run the module as ``head(features(x))`` (for the loss terms)."""
        self.loss_terms_problem: str | None = None
        """Why the loss terms cannot run on this engine (decided in :meth:`bind_loader`), or ``None``."""
        self.width = width
        self.split = split
        self.caching = split is not None
        """Whether head phases run on cached features (decided in :meth:`bind_loader`)."""
        names = {id(p): n for n, p in module.named_parameters()}
        self.trainable = [
            n
            for n in federation.shared_names + federation.local_names
            if n in dict(module.named_parameters())
        ]
        self.param_names = [
            names.get(id(p)) if names.get(id(p)) in self.trainable else None
            for group in optimizer.param_groups
            for p in group["params"]
        ]
        self.group: ClientGroup | None = None
        self.segment: Segment | None = None
        self._group_index = -1
        self._step = 0
        self._active: list[bool] = []
        self._features: Tensor | None = None
        self._labels: Tensor | None = None
        self._loader: Any = None
        self._schedules: dict[int, LockstepPlan] = {}
        self._pending: dict[str, Any] | None = None
        self._declared_cache: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._segment_tensors: dict[Any, Tensor] = {}
        """Small tensors made once per segment (client ids, lane indices, active masks)."""
        self._rule_state: dict[str, Tensor] = {}
        """The last step rule's new declared tensors, stacked by lane (written after the step)."""
        self._call_losses: list[StepLoss] = []
        """The losses of the Lightning step's lockstep steps so far (:meth:`call_losses`)."""
        self.step_rules = [o.step.name for o in self.objectives.values() if o.step is not None]
        """The step rules of the phases (they run the whole module: no cached features)."""
        self._cache_decided = split is not None
        self.group_width: int | None = None
        """Clients per group after the memory bound (``None``: a round's clients)."""
        self.lane_width: int | None = None
        """Clients per lockstep step in phases without cached features (``None``: the group's)."""
        self.steps_per_call: int | None = 1
        """Lockstep steps per Lightning step (``None``: a whole phase of a group; decided by the runner
        selection: :func:`~lightning_fedrep.runners.selection.build_engine`)."""
        self._resumed_calls: tuple[int, int | None] | None = None
        """(round, steps per call) of a checkpoint's open round: it resumes with the calls it was saved with."""
        self._saved_steps_per_call: int | None = 1
        self.calls_line = "one lockstep step per Lightning step"
        """How many lockstep steps a Lightning step runs, in words (the engine's log line)."""
        self._sized = False
        self.client_bytes = 0
        """Estimated bytes one client of a lockstep group takes."""
        self.compile = False
        """Whether cached head steps without loss terms run compiled (``RunnerSettings.compile``:
        :class:`~lightning_fedrep.runners.lockstep.compiled.CompiledHeadStep`, built at the first such step)."""
        self.compile_skipped: str | None = None
        """Why ``compile=True`` compiles nothing in this fit although asked (a smoke run), or ``None``."""
        self._head_step: CompiledHeadStep | None = None
        self.feature_chunk = FEATURE_CHUNK
        """Samples per forward pass of the feature cache (:func:`~lightning_fedrep.federation.module.feature_chunks.feature_chunk`
        of a probe input, set when the first loader is bound)."""

    # ------------------------------------------------------------------ schedule
    def bind_loader(
        self, loader: Any, device: torch.device, gather: Callable[[Any], list[Any]] | None = None
    ) -> str | None:
        """The round's training loader (cached features are read from it). The first time, check on
        probe batches that the engine trains what ``training_step`` trains (:attr:`probe_problem`), find
        the feature split, decide whether head phases run on cached features (and whether the loss terms
        can run: :attr:`loss_terms_problem`), and return a line saying so (then ``None``).

        On several processes ``gather`` (an all-gather of one object per rank) makes every rank decide
        alike: the first problem any rank found (in rank order) is every rank's, and head phases run on
        cached features only where every rank can cache (a rank that ran the engine while another ran
        the sequential path would wait forever for the other's steps)."""
        self._loader = loader
        self._schedules = {}
        if self._cache_decided:
            return None
        self._cache_decided = True
        probes = self._probe_batches(loader, device)
        name = loss_label(getattr(self.module, "fedrep_loss", self.loss_fn))
        with untouched_random_state():  # a training_step may draw from numpy's or Python's generator too
            problem = probe_problem(self.module, self.loss_fn, name, probes, self.randomness)
        self.probe_problem = _first_problem(problem, gather)
        if self.probe_problem is not None:
            self.split, self.caching = None, False
            return f"no feature cache: {self.probe_problem}"
        probe_x = probes[0][0][0]
        self.feature_chunk = feature_chunk_of(device, probe_x)
        why = (
            self._decide_split_per_client(probe_x)
            if self.randomness == "per_client"
            else self._decide_split(probe_x)
        )
        if gather is not None:
            every = gather({"loss_terms_problem": self.loss_terms_problem, "no_cache": why})
            self.loss_terms_problem = next(
                (v["loss_terms_problem"] for v in every if v["loss_terms_problem"] is not None), None
            )
            if why is None:
                why = next(
                    (f"rank {r} cannot: {v['no_cache']}" for r, v in enumerate(every) if v["no_cache"]), None
                )
        self.caching = why is None and self.split is not None
        return (
            f"head phases on cached features ({self.split.how})"
            if self.caching
            else f"no feature cache: {why}"
        )

    def _decide_split(self, x: Tensor) -> str | None:
        """Find the feature split on probe inputs ``x`` (and check the loss terms' features); returns why
        head phases cannot run on cached features, or ``None``."""
        head = self.federation.split.head
        why = data_is_deterministic(self._loader) if head else "no head marked"
        if self.step_rules:
            why = f"the step rule {self.step_rules[0]!r} runs the whole module"
        if head and (why is None or self.needs_features):
            self.split = find_feature_split(self.module, head, x)
            if self.split is None:
                why = "the module's output is not head(features(x)): declare forward_features/forward_head"
            elif self.needs_features:
                self.loss_terms_problem = self._features_of_problem(x)
        if self.needs_features and self.split is None:
            self.loss_terms_problem = f"the loss terms that read features need the head's input ({why})"
        return why

    def _decide_split_per_client(self, x: Tensor) -> str | None:
        """:meth:`_decide_split` where random layers may run: the split's structure is verified in eval mode (not
        dropout's draws; the run's generators untouched), and head phases run on cached features only where the
        body is not random in train mode (its features under two seeds agree), since a random body draws anew
        at every step of the sequential runner."""
        with untouched_modes(self.module), untouched_random_state():
            self.module.eval()
            why = self._decide_split(x)
            if why is not None or self.split is None:
                return why
            self.module.train()
            tensors = {**dict(self.module.named_buffers()), **dict(self.module.named_parameters())}
            drawn = []
            for seed in (PROBE_SEED, PROBE_SEED + 1):
                torch.manual_seed(seed)
                with torch.no_grad():
                    drawn.append(self.split.features(tensors, x))
        if not same_tensor(*drawn):
            return "the body is random in train mode (randomness='per_client': it draws anew at every step)"
        return None

    def _probe_batches(self, loader: ClientBatches, device: torch.device) -> list[tuple[Any, int, str]]:
        """The first batch of the first client with data and the second batch of the last one, as
        Lightning hands batches to ``training_step`` (each with its ``batch_idx`` and a name). Fetching
        them draws nothing from the run's generators (a loader's seed, a random transform's noise)."""
        clients = [c for c in range(loader.num_clients) if loader.client_size(c)]
        first, last = clients[0], clients[-1]

        def batch(client: int, step: int) -> Any:
            with untouched_random_state():
                fetched = loader.probe_batch(client, 0, step)
            return self._as_stepped(fetched, device)

        return [
            (batch(first, 0), 0, f"client {first}'s first batch"),
            (batch(last, 1), 1, f"client {last}'s second batch"),
        ]

    def _as_stepped(self, batch: Any, device: torch.device) -> Any:
        """A batch the engine draws itself, as Lightning would hand it to the step: in the trainer's
        precision, on ``device``."""
        return self.to_device(self.convert_input(batch), device)

    def _features_of_problem(self, probe: Tensor) -> str | None:
        """Whether every loss term's ``features_of`` submodule gets exactly the split's features as its
        input on ``probe`` (the term's features are then what the engine hands it)."""
        tensors = {**dict(self.module.named_buffers()), **dict(self.module.named_parameters())}
        with torch.no_grad():
            features = self.split.features(tensors, probe)
        names = dict.fromkeys(t.features_of for t in self.loss_terms if t.needs_features and t.features_of)
        for name in names:
            seen: list[Any] = []
            hook = self.module.get_submodule(name).register_forward_pre_hook(
                lambda _m, args, seen=seen: seen.append(args[0] if args else None)
            )
            try:
                with torch.no_grad():
                    self.module(probe)
            finally:
                hook.remove()
            got = seen[0] if len(seen) == 1 else None  # called once, on exactly the split's features
            if not same_tensor(got, features):
                return (
                    f"a vectorized loss term takes the input of {name!r} as its features, which is not the "
                    f"head's input ({self.split.how})"
                )
        return None

    def prepare(
        self,
        plan: RoundPlan,
        device: torch.device,
        measure: bool,
        memory: int | None = None,
        smoke: bool = False,
    ) -> str:
        """Before the first round of a fit: bound the group width by ``memory`` bytes (default: see
        :func:`~lightning_fedrep.runners.lockstep.sizing.default_memory_budget`) and, if ``measure``, time whether
        phases without cached features are faster in lockstep or one client at a time. A smoke run
        (``fast_dev_run``) trains groups of at most :data:`SMOKE_GROUP` clients. A run resumed from a
        checkpoint keeps the widths it was saved with. Returns a line saying what was decided."""
        if not self._sized:
            self._sized = True
            width = self._memory_width(plan, device, memory)
            width = min(width, self.width) if self.width else width
            self.group_width = min(width, SMOKE_GROUP) if smoke else width
            self.lane_width = None
            self._timing = ""
            if measure and self._pending is None:
                self._measure_lanes(plan, device)
        bound = (
            f"by memory ({self.client_bytes / 2**20:.3g} MiB each; "
            if self.client_bytes  # not measured when the widths come from a checkpoint
            else "("
        )
        groups = f"groups of up to {self.group_width} clients {bound}the first round has {len(plan.work)})"
        lanes = (
            "the other phases one client at a time"
            if self.lane_width == 1
            else "the other phases in lockstep"
        )
        return f"{groups}; {lanes}{self._timing}; {self.calls_line}{self._compile_words(plan)}"

    def _compile_words(self, plan: RoundPlan) -> str:
        """What ``compile=True`` compiles in rounds like ``plan``, for the engine's line (nothing where
        it is off)."""
        if self.compile_skipped is not None:
            return f"; compile=True compiles nothing here ({self.compile_skipped})"
        if not self.compile:
            return ""
        if not self.caches_head(plan):
            return (
                "; compile=True compiles nothing here (no head phase on cached features in the first round)"
            )
        if self.objectives.get("head", NO_OBJECTIVE).terms:
            return "; compile=True compiles nothing here (the head phase has loss terms: eager)"
        return "; cached head steps compiled (torch.compile, once per group width and batch size)"

    def caches_head(self, plan: RoundPlan) -> bool:
        """Whether rounds like ``plan`` have a head phase that runs on cached features."""
        return self.caching and any(phase.train == "head" for phase in plan.phases)

    def gains(self, plan: RoundPlan) -> bool:
        """Whether the engine does anything the sequential path does not in rounds like ``plan``: a
        head phase on cached features, or phases in lockstep."""
        return self.caches_head(plan) or self.lane_width != 1

    def settings(self) -> dict[str, int]:
        """The widths decided for this run (checkpointed: a resumed run keeps them) and its lockstep steps per
        Lightning step (``0``: a whole phase; a resumed open round keeps them)."""
        return {
            "group_width": self.group_width or 0,
            "lane_width": self.lane_width or 0,
            "steps_per_call": self.steps_per_call or 0,
        }

    def load_settings(self, settings: dict[str, int] | None) -> None:
        """Keep the widths of the run a checkpoint was saved from (and, for its open round, its calls:
        :meth:`load_state_dict`)."""
        if settings:
            self.group_width = settings["group_width"] or None
            self.lane_width = settings["lane_width"] or None
            self._saved_steps_per_call = settings.get("steps_per_call", 1) or None  # absent: written unfused
            self._sized = True
            self._timing = " (widths as in the checkpoint)"
            self._schedules = {}

    def _memory_width(self, plan: RoundPlan, device: torch.device, memory: int | None) -> int:
        loader, module = self._loader, self.module
        with untouched_random_state():
            first = loader.probe_batch(plan.work[0].client, plan.round, 0)
        x, y = self._as_stepped(first, device)
        loss_fn = self.loss_fn
        with untouched_random_state():  # a random layer's draws (randomness="per_client") leave no trace
            activations = sizing.activation_bytes(lambda: loss_fn(module(x), y).sum())
        if getattr(loader, "sampling", "shuffle") == "poisson":
            activations = int(activations * sizing.poisson_width_factor(loader.batch_size))
        features = 0
        if self.caching:
            with torch.no_grad():
                per_sample = self.split.features(sizing.module_tensors(module), x[:1])
            largest = max(plan.client_sizes[w.client] for w in plan.work)
            features = largest * (
                per_sample.numel() * per_sample.element_size() + y[:1].numel() * y.element_size()
            )
        named = dict(module.named_parameters())
        per_client = sizing.client_bytes((named[n] for n in self.trainable), activations, features)
        self.client_bytes = per_client
        budget = memory if memory is not None else sizing.default_memory_budget(device)
        return sizing.group_width(budget, per_client)

    def _measure_lanes(self, plan: RoundPlan, device: torch.device) -> None:
        """Decide ``lane_width`` (1 or the group's) by timing the first uncached phase at the width that will
        run (the first group: every client of the first round, up to the memory bound): one lockstep step of
        them against their steps one by one (:func:`~lightning_fedrep.runners.lockstep.sizing.faster_lane_width`).
        A few clients' timing does not tell: on a CPU lockstep can win at 8 clients and lose by 1.7x at 100. It
        tells one way: where lockstep is slower at a quarter of the width
        (:func:`~lightning_fedrep.runners.lockstep.sizing.probe_width`), the device has no parallelism to spare
        and a wider step does not find it, so the clients run one at a time without the full width's timing (a
        CPU's convolution: one wide step of 100 CIFAR CNN clients costs a third to a half of the FedAvg round it
        would decide). Lockstep is kept within
        :data:`~lightning_fedrep.runners.lockstep.sizing.LOCKSTEP_MARGIN` of the narrow timing only where narrow
        lanes would pay a cost the timing leaves out (Lightning's per-step cost: unfused calls, or the sequential
        runner when no phase runs on cached features); else the faster timing wins."""
        width = min(self.group_width, len(plan.work))
        margin = self._lockstep_margin(plan)
        probe = sizing.probe_width(width)
        if probe < width:
            timed = self._time_lanes(plan, probe, device, margin)
            if timed is not None and not timed[0]:
                self._decide_lanes(
                    timed, f"; slower in lockstep at a quarter of the width, not timed at {width}"
                )
                return
        self._decide_lanes(self._time_lanes(plan, width, device, margin))

    def _decide_lanes(self, timed: tuple[bool, float, float, int] | None, why: str = "") -> None:
        """Keep a timing's choice (nothing timed: lockstep, where the first group's uncached phase has one
        client) and the words the engine's line says about it."""
        if timed is None:
            return
        faster, wide_s, narrow_s, clients = timed
        self.lane_width = None if faster else 1
        self._timing = (
            f" (one step of {clients} clients measured {wide_s * 1e3:.2f} ms in lockstep, "
            f"{narrow_s * 1e3:.2f} ms one after another{why})"
        )

    def _time_lanes(
        self, plan: RoundPlan, width: int, device: torch.device, margin: float
    ) -> tuple[bool, float, float, int] | None:
        """:func:`~lightning_fedrep.runners.lockstep.sizing.faster_lane_width` on the first uncached phase of a
        group of the first ``width`` clients: whether lockstep is faster, both times and the clients timed
        (``None`` where that phase has fewer than two clients)."""
        wide_plan = lockstep_plan(plan, width, cache_head=self.caching)
        wide = next((s for s in wide_plan.segments if s.group == 0 and not s.cached), None)
        if wide is None or len(wide.clients) < 2:
            return None
        narrow_plan = lockstep_plan(plan, width, cache_head=self.caching, uncached_width=1)
        narrow = [s for s in narrow_plan.segments if s.group == 0 and s.phase_index == wide.phase_index]

        def first_batch(schedule: LockstepPlan, segment: Segment) -> dict[str, Tensor]:
            with untouched_random_state():
                batch = next(iter(schedule.batches(self._loader, segment.start)))
            return self._as_stepped(batch, device)

        def work(segment: Segment, batch: dict[str, Tensor]) -> Callable[[], None]:
            def run() -> None:  # a whole step: its gradients allocated anew and the optimizer's update
                self._enter_segment(segment)
                self._active = segment.active(0)
                self.loss(batch).backward()
                self.group.step(self._active)

            return run

        self._open_group(wide)
        try:
            faster, wide_s, narrow_s = sizing.faster_lane_width(
                work(wide, first_batch(wide_plan, wide)),
                [work(s, first_batch(narrow_plan, s)) for s in narrow],
                device,
                margin=margin,
            )
        finally:
            self.group, self.segment, self._features, self._labels = None, None, None, None
            self._group_index = -1
        return faster, wide_s, narrow_s, len(wide.clients)

    def _lockstep_margin(self, plan: RoundPlan) -> float:
        """How much slower a measured lockstep step may be and still be taken (:meth:`_measure_lanes`): none
        where narrow lanes stay in the engine and run fused (a cached head phase keeps the engine, and a fused
        call pays Lightning's per-step cost once per phase in either width)."""
        stays_fused = self.steps_per_call != 1 and self.caches_head(plan)
        return 0.0 if stays_fused else sizing.LOCKSTEP_MARGIN

    def call_losses(self) -> list[StepLoss]:
        """The last Lightning step's training losses, for the round's ``train/loss``: one per lockstep step of the
        call, over the clients that stepped, each client's mean loss weighted by its batch's samples."""
        return self._call_losses

    def _keep_losses(self, losses: Tensor, mask: Tensor) -> None:
        """A lockstep step's per-client losses (inactive clients' zero): kept as :attr:`last_losses` and added to
        the call's :class:`StepLoss` list (the clients' samples: ``mask``'s rows, active clients only)."""
        self.last_losses = losses.detach()
        samples = mask.reshape(len(mask), -1).sum(1) * self._active_weights(mask.dtype, mask.device)
        self._call_losses.append(step_loss(self.last_losses, samples))

    def schedule(self, plan: RoundPlan) -> LockstepPlan:
        """The round's lockstep schedule (computed once per round plan)."""
        schedule = self._schedules.get(plan.round)
        if schedule is None or schedule.plan is not plan:
            schedule = self.build_schedule(plan)
            self._schedules = {r: s for r, s in self._schedules.items() if r >= plan.round - 1}
            self._schedules[plan.round] = schedule
        return schedule

    def build_schedule(self, plan: RoundPlan) -> LockstepPlan:
        """``plan`` as lockstep segments with this run's widths, cut into its calls (not cached: another
        rank's part). A checkpoint's open round keeps the calls it was saved with (its loader position
        counts them)."""
        width = min(self.group_width or len(plan.work), max(1, len(plan.work)))
        resumed = self._resumed_calls
        calls = resumed[1] if resumed is not None and resumed[0] == plan.round else self.steps_per_call
        return lockstep_plan(plan, width, self.caching, self.lane_width, calls)

    def use_widths(self, settings: dict[str, int]) -> None:
        """Take the widths another process decided (:meth:`settings`), so every rank schedules alike."""
        self.group_width = settings["group_width"] or None
        self.lane_width = settings["lane_width"] or None
        self._schedules = {}

    # ------------------------------------------------------------------ steps
    def begin_step(self, schedule: LockstepPlan, batch_idx: int) -> list[int]:
        """Before a Lightning step: open its group and phase (a fused call: its first lockstep step);
        returns the clients that start now."""
        segment, step = schedule.locate(batch_idx)
        started: list[int] = []
        if self.group is None or self._group_index != segment.group:
            resumed = self._open_group(segment)
            started = [] if resumed else list(segment.group_clients)
            scales = {work.client: work.lr_scale for work in schedule.plan.work}
            self.group.lr_scales = tuple(scales[c] for c in segment.group_clients)
        if self.segment is not segment:
            self._enter_segment(segment)
        self._step = step
        self._active = segment.active(step)
        self._call_losses = []
        return started

    def fused_loss(self, batches: FusedBatches) -> Tensor:
        """A fused call: every lockstep step but the last runs here (loss, backward, every client's step: as
        :meth:`loss` and :meth:`end_step` would one Lightning step each); returns the last step's :meth:`loss`,
        which Lightning backpropagates before :meth:`end_step`, as for an unfused step. A call never ends a
        segment early, so no client finishes inside it."""
        device = next(iter(self.group.stacked.values())).device
        last = len(batches) - 1
        for i, batch in enumerate(batches):
            if i:
                self._step += 1
                self._active = self.segment.active(self._step)
            batch = self._as_stepped(batch, device)
            if i == last:
                return self.loss(batch)
            grads = self._compiled_grads(batch)
            if grads is None:
                self.loss(batch).backward()
            else:  # the gradients themselves: no graph to backpropagate
                for name, grad in grads.items():
                    self._lane_tensors[0][name].grad = grad
            self.end_step()
        raise ValueError(f"{batches!r} holds no lockstep step.")

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        """The sum over the segment's clients of each one's mean loss on its batch (padding masked out)
        plus the callbacks' vectorized loss terms, each applied per client inside the same ``vmap``
        (clients that do not step count zero)."""
        mask = batch["mask"]
        trained, frozen = self._lane_tensors
        fixed = self._fixed
        loss_fn, split = self.loss_fn, self.split
        phase = self.segment.part
        objective = self.objectives.get(phase, NO_OBJECTIVE)
        if objective.step is not None:
            return self._rule_loss(objective.step, batch)
        terms = objective.terms
        compiled = None if terms else self._compiled_grads(batch)
        if compiled is not None:
            return self._surrogate(compiled)
        server, states = self._declared() if terms else ({}, {})
        shared = self._view_fields(server) if terms else {}

        if self.segment.cached:
            fixed, frozen, inputs, targets = self._cached_batch(batch, narrow=not terms)

            def run(tensors: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor | None]:
                return split.head(tensors, x), x

        elif self.needs_features:
            inputs, targets = batch["x"], batch["y"]

            def run(tensors: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor | None]:
                features = split.features(tensors, x)
                return split.head(tensors, features), features

        else:
            inputs, targets = batch["x"], batch["y"]

            forward = self._forward

            def run(tensors: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor | None]:
                return forward(tensors, x), None

        def client_loss(
            own: dict[str, Tensor],
            rest: dict[str, Tensor],
            x: Tensor,
            y: Tensor,
            m: Tensor,
            client: Tensor | None = None,
            state: dict[str, Tensor] | None = None,
            lane: dict[str, Tensor] | None = None,
        ) -> Tensor:
            tensors = {**fixed, **rest, **own}
            output, features = run(tensors, x)
            per_sample = loss_fn(output, y)
            loss = masked_mean(per_sample, m)
            for term in terms:
                view = StepView(
                    tensors=tensors,
                    trained=own,
                    client=client,
                    features=features if term.needs_features else None,
                    mask=m,
                    client_state=state,
                    **shared,
                    **(lane or {}),
                )
                extra = term.fn(view)
                if extra is not None:
                    loss = loss + extra
            return loss

        if not terms and self.loss_fn in PER_SAMPLE_LOSSES:

            def client_output(own: dict[str, Tensor], rest: dict[str, Tensor], x: Tensor) -> Tensor:
                return run({**fixed, **rest, **own}, x)[0]

            with self._draws(mask.device):
                outputs = over_lanes(client_output, len(mask), self._vmap_randomness)(trained, frozen, inputs)
            losses = lane_mean_losses(self.loss_fn, outputs, targets, mask)
        else:
            lanes_args = (trained, frozen, inputs, targets, mask)
            if terms:  # what a term's StepView reads per client
                lanes_args += (self._segment_clients(mask.device), states, self._lane_fields(mask.device))
            with self._draws(mask.device):
                losses = over_lanes(client_loss, len(mask), self._vmap_randomness)(*lanes_args)
        losses = losses * self._active_weights(losses.dtype, losses.device)
        self._keep_losses(losses, mask)
        return losses.sum()

    @property
    def _vmap_randomness(self) -> str:
        """What the step's ``vmap`` does with random operations (:func:`~.randomness.vmap_randomness`)."""
        return vmap_randomness(self.randomness)

    def _draws(self, device: torch.device) -> Any:
        """The context of this lockstep step's forward: under ``randomness="per_client"`` a generator keyed by
        the seed, round, phase, local step and the segment's clients (nothing under ``"exact"``)."""
        segment = self.segment
        return step_draws(
            self.randomness,
            self.federation.config.seed,
            self.federation.round_index,
            segment.phase_index,
            self._step,
            segment.clients,
            device,
        )

    def _rule_loss(self, rule: StepRule, batch: dict[str, Tensor]) -> Tensor:
        """A step rule run per client inside one ``vmap`` (each client its own ``(x, y)``, mask and declared
        tensors): the surrogate ``sum((p * g).sum())`` over the lanes, whose gradient is each client's ``g``;
        its ``client_state`` is written after the step (:meth:`end_step`)."""
        mask, inputs, targets = batch["mask"], batch["x"], batch["y"]
        trained, frozen = self._lane_tensors
        fixed = self._fixed
        server, states = self._declared()
        shared = self._view_fields(server)
        loss = self._pure_loss

        def client_step(own, rest, x, y, m, client, state, lane):  # noqa: ANN001, ANN202 (vmapped)
            view = StepView(
                tensors={**fixed, **rest, **own},
                trained=own,
                client=client,
                mask=m,
                client_state=state,
                **shared,
                **lane,
            )
            outcome = rule.fn(loss, view, x, y)
            return dict(outcome.grads), outcome.loss, dict(outcome.client_state)

        own = {n: t.detach() for n, t in trained.items()}
        rest = {n: t.detach() for n, t in frozen.items()}
        clients = self._segment_clients(mask.device)
        with self._draws(mask.device):
            grads, losses, new_state = torch.func.vmap(client_step, randomness=self._vmap_randomness)(
                own, rest, inputs, targets, mask, clients, states, self._lane_fields(mask.device)
            )
        active = self._active_weights(losses.dtype, losses.device)
        self._keep_losses(losses * active, mask)
        self._rule_state = {n: t.detach() for n, t in new_state.items()}
        surrogate = None
        for name, grad in grads.items():
            keep = active.reshape(-1, *([1] * (grad.dim() - 1)))
            term = (trained[name] * (grad.detach() * keep).to(trained[name].dtype)).sum()
            surrogate = term if surrogate is None else surrogate + term
        if surrogate is None:
            raise ValueError(
                f"The step rule {rule.name!r} returned no gradients: it must move a trained tensor."
            )
        return surrogate

    def _compiled_grads(self, batch: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """A cached head step's gradients from the compiled step (:attr:`compile`), its losses kept for
        logging; ``None`` where the step runs eagerly (not compiled, not a cached head step, loss terms, a
        failed compile)."""
        if (
            not (self.compile and self.segment.cached)
            or self.objectives.get(self.segment.part, NO_OBJECTIVE).terms
        ):
            return None
        if self._head_step is None:
            self._head_step = CompiledHeadStep(
                self.split.head,
                self.loss_fn,
                self.loss_fn in PER_SAMPLE_LOSSES,
                over_lanes,
                lane_mean_losses,
            )
        mask = batch["mask"]
        fixed, frozen, inputs, targets = self._cached_batch(batch, narrow=True)
        own = {n: t.detach() for n, t in self._lane_tensors[0].items()}
        active = self._active_weights(self._features.dtype, mask.device)
        out = self._head_step(own, fixed, frozen, inputs, targets, mask, active)
        if out is None or not out[0]:  # nothing reached: the eager step says so as autograd does
            return None
        grads, losses = out
        self._keep_losses(losses, mask)
        return grads

    def _cached_batch(
        self, batch: dict[str, Tensor], narrow: bool
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor, Tensor]:
        """A cached head step's fixed and frozen tensors, features and labels: the rows of ``batch["positions"]``
        of each lane's cached features; ``narrow``: only the tensors the head reads (where the split knows them;
        nothing else is batched)."""
        _, frozen = self._lane_tensors
        fixed, reads = self._fixed, self.split.head_reads
        if narrow and reads is not None:
            frozen = {n: t for n, t in frozen.items() if n in reads}
            fixed = {n: t for n, t in fixed.items() if n in reads}
        lanes = self._lane_indices(batch["mask"].device)[:, None]
        positions = batch["positions"]
        return fixed, frozen, self._features[lanes, positions], self._labels[lanes, positions]

    def _surrogate(self, grads: dict[str, Tensor]) -> Tensor:
        """What Lightning backpropagates for a compiled step: its value the step's loss (the sum of the lanes'),
        its gradient on each trained leaf exactly ``grads``."""
        trained = self._lane_tensors[0]
        linear = sum((trained[n] * g).sum() for n, g in grads.items())
        return linear - linear.detach() + self.last_losses.sum()

    def _segment_clients(self, device: torch.device) -> Tensor:
        """The segment's client ids as a tensor (what a :class:`StepView` reads as ``client``), made once per
        segment."""
        key = ("clients", device)
        if key not in self._segment_tensors:
            self._segment_tensors[key] = torch.tensor(self.segment.clients, device=device)
        return self._segment_tensors[key]

    def _lane_indices(self, device: torch.device) -> Tensor:
        """``0 .. lanes - 1`` (the rows of the cached features), made once per segment."""
        key = ("lanes", device)
        if key not in self._segment_tensors:
            self._segment_tensors[key] = torch.arange(len(self.segment.clients), device=device)
        return self._segment_tensors[key]

    def _active_weights(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """1 for the lanes that step now, 0 for those done with the phase (made once per pattern: it changes
        only when a client finishes its steps)."""
        key = (tuple(self._active), dtype, device)
        if key not in self._segment_tensors:
            self._segment_tensors[key] = torch.tensor(self._active, dtype=dtype, device=device)
        return self._segment_tensors[key]

    @torch.no_grad()
    def _write_rule_state(self) -> None:
        """The step rule's ``client_state`` of each active client, into the store (and the segment's rows)."""
        new, self._rule_state = self._rule_state, {}
        if not new:
            return
        for k, client in enumerate(self.segment.clients):
            if self._active[k]:
                self.federation.put_step_state(client, {n: t[k] for n, t in new.items()})
        self._declared_cache = None  # re-read: the rows changed

    def end_step(self) -> list[ClientResult]:
        """After Lightning's backward: step every active client; returns clients whose round is done."""
        group = self.group
        group.sync_hyperparameters(self.user_optimizer)
        objective = self.objectives.get(self.segment.part, NO_OBJECTIVE)
        if objective.grad_transforms:
            self._transform(objective.grad_transforms, grads=True)
        group.step(self._active)
        if objective.param_transforms:
            with torch.no_grad():
                self._transform(objective.param_transforms, grads=False)
        self._write_rule_state()
        # the user's optimizer.step() never runs here: mark it as stepped (what torch's LR scheduler wrapper
        # of .step() does), else every epoch scheduler warns that it stepped before the optimizer
        self.user_optimizer._opt_called = True
        if self._step == self.segment.length - 1 and self.segment.last_of_group:
            return self.finish_group()
        return []

    def _view_fields(self, server: dict[str, Tensor]) -> dict[str, Any]:
        """The :class:`StepView` fields every lane of this step shares (the server tensors, the phase part, the
        round, the local step and, where the lanes' ``lr_scale`` agree, the learning rate)."""
        shared = dict(
            server=server, phase=self.segment.part, round=self.federation.round_index, step=self._step
        )
        scales = self._lane_scales()
        if len(set(scales)) == 1:
            lr = self._lr()
            shared["lr"] = lr * scales[0] if lr is not None and scales[0] != 1.0 else lr
        return shared

    def _lane_fields(self, device: torch.device) -> dict[str, Tensor]:
        """The :class:`StepView` fields that differ between the lanes, batched by ``vmap`` (each client its own):
        ``client_step`` (each client's local step in the round: its steps in earlier phases plus this
        phase's), and ``lr`` (a 0-dim tensor) where the lanes' ``lr_scale`` differ."""
        key = ("offsets", device)
        if key not in self._segment_tensors:
            self._segment_tensors[key] = torch.tensor(self.segment.offsets, device=device)
        fields = {"client_step": self._segment_tensors[key] + self._step}
        scales, lr = self._lane_scales(), self._lr()
        if len(set(scales)) == 1 or lr is None:
            return fields
        key = ("lr", lr, device)
        if key not in self._segment_tensors:
            dtype = next(iter(self.group.stacked.values())).dtype
            self._segment_tensors[key] = torch.tensor([lr * s for s in scales], dtype=dtype, device=device)
        return {**fields, "lr": self._segment_tensors[key]}

    def _lane_scales(self) -> tuple[float, ...]:
        """The ``lr_scale`` of each lane of the segment."""
        start, stop = self.segment.lanes
        return self.group.lr_scales[start:stop]

    def _lr(self) -> float | None:
        groups = self.user_optimizer.param_groups
        return groups[0].get("lr") if groups else None

    def _transform(self, transforms: tuple[Any, ...], grads: bool) -> None:
        """Apply gradient (``grads``) or parameter transforms to each active lane, in one ``vmap``."""
        leaves, rest = self._lane_tensors
        fixed = self._fixed
        server, states = self._declared()
        shared = self._view_fields(server)
        device = next(iter(leaves.values())).device
        clients = torch.tensor(self.segment.clients, device=device)
        own = {n: t.detach() for n, t in leaves.items()}
        values = {n: t.grad for n, t in leaves.items() if t.grad is not None} if grads else own

        def apply(
            value: dict[str, Tensor],
            mine: dict[str, Tensor],
            others: dict[str, Tensor],
            client: Tensor,
            state: dict[str, Tensor],
            lane: dict[str, Tensor],
        ):
            view = StepView(
                tensors={**fixed, **others, **mine},
                trained=mine,
                client=client,
                client_state=state,
                **shared,
                **lane,
            )
            for transform in transforms:
                value = {**value, **transform.fn(value, view)}
            return value

        new = torch.func.vmap(apply)(values, own, rest, clients, states, self._lane_fields(device))
        active = self._active_weights(torch.bool, device)
        for name, value in new.items():
            keep = active.reshape(-1, *([1] * (value.dim() - 1)))
            if grads:
                leaves[name].grad = torch.where(keep, value, values[name])
            else:
                leaves[name].copy_(torch.where(keep, value, leaves[name]))

    def _declared(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """What a :class:`StepView` reads besides the module, as on the sequential runner: the round-start
        global shared tensors with the server's declared tensors (shared by the segment), and the segment
        clients' declared tensors stacked ``[lanes, ...]`` (``vmap`` hands each client its own row)."""
        if self._declared_cache is None:
            federation = self.federation
            device = next(iter(self.group.stacked.values())).device
            server = {**federation.global_view(), **federation.server_tensors}
            server = {n: t.detach().to(device) for n, t in server.items()}
            rows = [federation.store.client_state(c) for c in self.segment.clients]
            names = federation.store.tensor_names if rows else []
            states = {n: torch.stack([r[n].detach() for r in rows]).to(device) for n in names}
            self._declared_cache = (server, states)
        return self._declared_cache

    def finish_group(self) -> list[ClientResult]:
        """Hand every client of the open group to the federation (also for a round cut short)."""
        group, federation = self.group, self.federation
        if group is None:
            return []
        keep = federation.config.client_optimizer_state == "keep"
        local = set(federation.local_names)
        finite = group.finite_clients()
        results = []
        for k, client in enumerate(group.clients):
            tensors = {**federation.start_tensors(client), **group.client_tensors(k)}
            state = group.client_optimizer_state(k, local) if keep else None
            checked = tuple(group.stacked) if finite[k] else ()
            results.append(federation.store_client(client, tensors, state, group.steps[k], finite=checked))
        self.group, self.segment, self._features, self._labels = None, None, None, None
        self._group_index = -1
        return results

    def abandon(self) -> None:
        """Drop the open group without handing its clients to the federation (the round was rolled back)."""
        self.group, self.segment, self._features, self._labels = None, None, None, None
        self._group_index = -1

    # ------------------------------------------------------------------ groups and phases
    def _open_group(self, segment: Segment) -> bool:
        """Stack the group's starting tensors, after ``Algorithm.start_client`` (or restore a checkpointed group:
        returns ``True``)."""
        federation = self.federation
        pending, self._pending = self._pending, None
        clients = segment.group_clients
        for client in clients:  # Algorithm.start_client, where overridden (not again for a resumed group)
            federation.begin_client(client)
        starts = [federation.start_tensors(c) for c in clients]
        stacked = {n: torch.stack([s[n].detach() for s in starts]).clone() for n in self.trainable}
        kept = [federation.store.optimizer_states.get(c) for c in clients]
        if federation.config.client_optimizer_state != "keep":
            kept = [None] * len(clients)
        self.group = ClientGroup(clients, stacked, self.user_optimizer, self.param_names, kept)
        resumed = pending is not None and tuple(pending["clients"]) == clients
        if resumed:
            self.group.load_state_dict(pending)
        self._group_index = segment.group
        trainable = set(self.trainable)
        named = {**dict(self.module.named_buffers()), **dict(self.module.named_parameters())}
        self._fixed = {n: t.detach() for n, t in named.items() if n not in trainable}
        return resumed

    def _enter_segment(self, segment: Segment) -> None:
        split = self.federation.split
        groups = PART_GROUPS[segment.part]
        self._trained = {n for n in self.trainable if split.group(n) in groups}
        self._lane_tensors = self.group.lanes(segment.lanes, self._trained)
        self.segment = segment
        self._segment_tensors = {}
        self._declared_cache = None
        self._features = self._labels = None
        if segment.cached:
            self._cache_features(segment)

    @torch.no_grad()
    def _cache_features(self, segment: Segment) -> None:
        """Every group client's features (its frozen body on all its training samples) and labels."""
        device = next(iter(self.group.stacked.values())).device
        first, stop = segment.lanes
        stacked = self.group.stacked

        def client_tensors(k: int) -> dict[str, Tensor]:
            return {**self._fixed, **{n: t[first + k] for n, t in stacked.items()}}

        frozen = [t[first:stop] for n, t in stacked.items() if n not in self._trained]
        if all(torch.equal(t, t[:1].expand_as(t)) for t in frozen):  # one body for all: one pass
            batches = self._loader.clients_samples(segment.clients, self.feature_chunk)
            features, labels = self._features_of(client_tensors(0), batches, device)
            sizes = [self._loader.client_size(c) for c in segment.clients]
            features, labels = list(features.split(sizes)), list(labels.split(sizes))
        else:
            pairs = [
                self._features_of(
                    client_tensors(k), self._loader.client_samples(c, self.feature_chunk), device
                )
                for k, c in enumerate(segment.clients)
            ]
            features, labels = [f for f, _ in pairs], [y for _, y in pairs]
        longest = max(len(f) for f in features)
        self._features = features[0].new_zeros((len(features), longest, *features[0].shape[1:]))
        self._labels = labels[0].new_zeros((len(labels), longest, *labels[0].shape[1:]))
        for k, (f, y) in enumerate(zip(features, labels)):
            self._features[k, : len(f)] = f
            self._labels[k, : len(y)] = y

    def _features_of(
        self, tensors: dict[str, Tensor], batches: Any, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        features, labels = [], []
        for batch in batches:
            x, target = self._as_stepped(batch, device)
            features.append(self.split.features(tensors, x))
            labels.append(target)
        return torch.cat(features), torch.cat(labels)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """The open group (its tensors, optimizer states, step counts), or ``None`` between groups."""
        return None if self.group is None else self.group.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resume inside a round (``state``: its open group, ``None`` between groups): the group is rebuilt
        from ``state`` at the next step (features recomputed), and the round keeps the calls it was saved with."""
        self.group, self.segment, self._group_index = None, None, -1
        self._pending = state
        self._resumed_calls = (self.federation.round_index, self._saved_steps_per_call)
        self._schedules = {}


PER_SAMPLE_LOSSES = frozenset(NAMED_LOSSES.values())
"""The declared losses known to treat every sample alone (the named ones): their per-sample losses of all
lanes' outputs at once are each lane's (:func:`lane_mean_losses`); a user's callable runs per lane."""


def lane_mean_losses(loss_fn: LossFn, outputs: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Each lane's mean loss over its unmasked samples (``[lanes]``), from its outputs ``[lanes, batch, ...]``:
    a per-sample ``loss_fn`` called once on every lane's samples (not once per lane under ``vmap``, whose
    batching rule of a cross-entropy costs a cached head step more than the head)."""
    return masked_mean(loss_fn(outputs.flatten(0, 1), targets.flatten(0, 1)).view(mask.shape), mask)


def over_lanes(fn: Callable[..., Any], lanes: int, randomness: str = "error") -> Callable[..., Any]:
    """``torch.func.vmap(fn, randomness=randomness)`` over ``lanes`` clients; for one lane ``fn`` called on its
    row directly (the
    same arithmetic without ``vmap``'s batching rules, which cost a CIFAR CNN step 6-8% on the development
    CPU), its outputs given back their lane dimension. The row is ``squeeze(0)``, a view whose backward is a
    view too (``t[0]``'s backward writes each gradient into a new zero tensor: 1-3% of that step)."""
    if lanes != 1:
        return torch.func.vmap(fn, randomness=randomness)

    def one_lane(*args: Any) -> Any:
        row = tree_map(lambda t: t.squeeze(0) if isinstance(t, Tensor) else t, args)
        return tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, fn(*row))

    return one_lane


def _first_problem(problem: str | None, gather: Callable[[Any], list[Any]] | None) -> str | None:
    """This rank's ``problem``, or on several processes (``gather``) the first any rank found, by rank."""
    if gather is None:
        return problem
    found = [v["probe_problem"] for v in gather({"probe_problem": problem}) if v["probe_problem"] is not None]
    return found[0] if found else None
