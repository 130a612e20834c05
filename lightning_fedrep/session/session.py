"""``FederatedSession``: the settings of a federated strategy, the Lightning-free objects it owns, their public
accessors (documented in the API reference, docs/api/strategies.md) and the Lightning-free halves of its hooks.

The Lightning face (:class:`~lightning_fedrep.lightning.strategy.FederatedStrategyMixin`) inherits it: each of
its hooks reads what it needs of the Trainer (its state, the precision plugin, the loops) and calls the session.
What the session needs of its host it asks through :class:`Host`'s few methods (the live module, the round
Lightning runs, the device) and attributes (how to warn and inform, how to capture the user's logs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fedrep.data.binding import DataBinding, ModelProbe, data_fingerprint, training_clients
from lightning_fedrep.data.loaders import EvalLoader, RoundLoader
from lightning_fedrep.evaluation.head_tuning import ClientHead, HeadFineTuning
from lightning_fedrep.evaluation.metrics import CaptureLogs, ClientMetrics
from lightning_fedrep.evaluation.passes import FederatedEvaluation
from lightning_fedrep.evaluation.prediction import Prediction, reads_clients
from lightning_fedrep.federation import ClientFault, Federation, fingerprint_changes
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.federation.api.scoring import set_forward
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer
from lightning_fedrep.federation.checkpoint.entry import (
    CHECKPOINT_KEY,
    read_federated_entry,
    refuse_plain_checkpoint_in_fit,
    round_evaluation_missing,
)
from lightning_fedrep.federation.checkpoint.reading import load_federated_state
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.module.feature_split import evaluation_split
from lightning_fedrep.federation.module.split import HeadSpec, ParameterSplit, resolve_layout
from lightning_fedrep.federation.plan import RankShare, RoundPlan, refuse_empty_plan, shard_round
from lightning_fedrep.federation.run import CallbackBus, FederatedRun, refuse_manual_loss_terms
from lightning_fedrep.federation.settings import (
    check_evaluation_settings,
    check_settings,
    federation_config,
    refuse_another_module,
    strategy_algorithm,
    takes_settings_of,
)
from lightning_fedrep.runners.batched_evaluation import serve_evaluation
from lightning_fedrep.runners.constraints import Constraints
from lightning_fedrep.runners.runner_report import RunnerReport
from lightning_fedrep.runners.selection import RunnerSelection
from lightning_fedrep.runners.settings import (
    Randomness,
    RunnerChoice,
    RunnerSettings,
    randomness_setting,
    refuse_old_keywords,
    runner_settings,
)

Say = Callable[[str], None]


class Host:
    """What a session asks of the strategy it is part of (the Lightning face provides each)."""

    _warn: Say
    """How a warning is given (the face: on rank zero)."""
    _info: Say
    """How an information line is given (the face: on rank zero)."""
    _capture: CaptureLogs
    """How the user's evaluation step's logs are captured per client."""
    _batch_size: Callable[[Any], int]
    """A batch's number of samples, as the host infers it."""

    def _live_module(self) -> Any:
        """The user's module, connected (``None`` before)."""
        raise NotImplementedError

    def _round_now(self) -> int:
        """The round (Lightning epoch) being run."""
        raise NotImplementedError

    def _device(self) -> torch.device:
        """The training device."""
        raise NotImplementedError


class FederatedSession(Host):
    """The settings and the accessors of the federated strategies, :class:`~lightning_fedrep.FederatedStrategy`
    (one device) and :class:`~lightning_fedrep.FederatedDDPStrategy` (several processes), which both take
    these settings.

    Args:
        head: the per-client part: module name(s) / parameter-name prefixes, or a compiled regex.
            ``None`` uses the module's own ``fedrep_head`` attribute.
        algorithm: a registered name (``"fedrep"``, ``"fedper"``, ``"lg_fedavg"``, ``"fedavg"``,
            ``"local"``) or an :class:`~lightning_fedrep.federation.api.algorithm.Algorithm` object.
        clients_per_round: a fraction in (0, 1] of the clients, or a count, sampled each round.
        head_epochs: FedRep's local epochs of the head, with the body frozen (first in a round).
        body_epochs: FedRep's local epochs of the body, with the head frozen (after the head's).
        local_epochs: local epochs of the other algorithms (everything trains jointly).
        phases: explicit local phases instead of the shorthands, e.g.
            ``[Phase("head", steps=10), Phase("body", steps=1)]`` (dicts are accepted too).
        weighting: ``"samples"`` weights clients by their training-set size (the official code),
            ``"uniform"`` averages them equally (the paper's Algorithm 1).
        client_optimizer_state: ``"reset"`` gives every client a fresh optimizer state every round (the
            official FedRep recipe); ``"keep"`` keeps the optimizer state of each client's *local*
            part (its head, for FedRep) across rounds; the shared part's state restarts every round.
        first_state: where a client that has not trained yet starts its local part (its head, for
            FedRep; LG-FedAvg's local representation), and what it is evaluated with until it trains:
            ``"initial"``, the module's initial values; ``"average"``, the weighted average of that part
            over the last aggregated round's clients (the official FedRep/FLUTE/SRPFL code, whose clients
            alias the global model into which every key, heads included, is averaged each round).
        evaluate_clients: validation and test score only the first this many clients (ids ``0 .. N-1``);
            ``None``: every client. The official ``main_local.py`` (Local Only) scores the first
            ``min(100, n)`` clients with an unweighted mean (``val/acc``).
        buffers: ``"shared"``: buffers (BatchNorm statistics) follow the body, averaged when the
            algorithm shares the body; ``"local"`` keeps them per client for every algorithm (PFLlib's
            FedBN, whose buffers never travel; ``FedBN`` keeps its BatchNorm layers local by itself).
        allow_frozen: keep parameters that are frozen at setup fixed, instead of raising.
        seed: seeds client sampling (data order is seeded by the data module).
        headline_metrics: compute ``val/acc`` and ``val/loss`` (``test/``...) from ``model(x)`` on
            ``(x, y)`` batches, in addition to what the module logs.
        on_nonfinite: a client whose tensors are not all finite after its round's work (a NaN loss, NaN
            data, a diverging step): ``"skip"`` leaves it out of the round (nothing it computed is kept,
            the round aggregates without it, a warning and the history say so); ``"raise"`` stops.
        allow_new_federation: resume or evaluate a checkpoint with other clients or settings than it was
            saved with (e.g. fine-tune its global model on new clients); by default that is refused.
        on_client_error: a client whose step raises: ``"raise"`` stops the run (the open round is rolled
            back, so a checkpoint written on the exception restarts the round); ``"skip"`` leaves the
            client out of the round like a non-finite one (sequential path only: one client's steps).
        runner: which runner runs a round's local work: ``"auto"`` (the vectorized runner where it computes
            exactly what the sequential one does and gains, else the sequential runner, saying why in one
            line), ``"vectorized"`` (clients in lockstep; refused, naming why, where not exact) or
            ``"sequential"`` (one client step per Lightning step, the module's own ``training_step``); or a
            :class:`~lightning_fedrep.runners.settings.RunnerSettings` with the choice and the vectorized
            runner's sizing (``width``, ``memory``, ``steps_per_call``, ``compile``). Held as
            ``strategy.runner`` (a ``RunnerSettings``); what was decided is ``strategy.runner_report``.
        predict: whose model ``trainer.predict`` runs: ``"personalized"``, each batch's client's own model
            (needs a federated data module's batches: each client's test samples, client after client);
            ``"new_client"``, the model a client that never trained gets (global body, initial head);
            ``"auto"``, personalized where the batches carry their clients (a federated data module), else
            new_client (a warning if its local part is the untrained initial one). A log line says which
            ran; ``prediction_mode`` holds it and ``prediction_clients`` the client of each batch.
        privacy: a server-side privacy mechanism from ``lightning_fedrep.privacy`` (``ClientLevelDP``: each
            round's shared updates clipped and noised before the server step; needs ``weighting="uniform"``),
            or ``None``.
        randomness: what the vectorized runner does with random layers (dropout) in train mode. ``"exact"``
            (default): it computes what the sequential runner computes, draw for draw, so a module with random
            layers runs sequentially (``runner="auto"``) or is refused (``runner="vectorized"``). ``"per_client"``:
            it takes them, and every client of a lockstep step draws its own random numbers
            (``torch.func.vmap(randomness="different")``) from a generator keyed by ``seed``, the round, the
            phase, the local step and the step's clients: the same distribution as the sequential runner, not
            the same draws; bit-identical for a seed and across a resume (round boundary or mid-round), and
            untouched by ``seed_everything``. The sequential runner draws from torch's global generator either
            way (``seed_everything``; checkpoints hold it). ``runner_report.randomness_contract`` says which ran.
        server_optimizer: a server step after the algorithm's aggregation (FedOpt): a registered name
            (``"fedadam"``, ``"fedyogi"``, ``"fedadagrad"``, with their defaults) or a
            :class:`~lightning_fedrep.federation.api.server_optimizer.ServerOptimizer` such as
            ``FedAdam(lr=0.01)`` (in a recipe: ``{class_path: lightning_fedrep.FedAdam, init_args: {lr: 0.01}}``).
            The strategy runs ``algorithm.with_server_optimizer(...)``, named e.g. ``"fedrep_fedadam"``;
            refused for an algorithm that shares nothing or already has one (``"fedadam"``). ``None``: none.
    """

    def __init__(
        self,
        head: HeadSpec = None,
        algorithm: str | Algorithm = "fedrep",
        clients_per_round: int | float = 0.1,
        head_epochs: int = 10,
        body_epochs: int = 1,
        local_epochs: int = 1,
        phases: Sequence[Phase | dict] | None = None,
        weighting: Literal["samples", "uniform"] = "samples",
        client_optimizer_state: Literal["reset", "keep"] = "reset",
        first_state: Literal["initial", "average"] = "initial",
        evaluate_clients: int | None = None,
        buffers: Literal["shared", "local"] = "shared",
        allow_frozen: bool = False,
        seed: int = 0,
        headline_metrics: bool = True,
        on_nonfinite: Literal["skip", "raise"] = "skip",
        on_client_error: Literal["raise", "skip"] = "raise",
        allow_new_federation: bool = False,
        runner: RunnerChoice | RunnerSettings = "auto",
        predict: Literal["auto", "new_client", "personalized"] = "auto",
        privacy: PrivacyMechanism | None = None,
        randomness: Randomness = "exact",
        server_optimizer: ServerOptimizer | str | None = None,
        **kwargs: Any,
    ):
        refuse_old_keywords(kwargs)
        super().__init__(**kwargs)  # the host's other bases (the Lightning strategy) take the rest
        check_settings(
            head, head_epochs, body_epochs, local_epochs, allow_frozen, headline_metrics, seed, predict
        )
        check_evaluation_settings(allow_new_federation, first_state, evaluate_clients, buffers)
        self.runner: RunnerSettings = runner_settings(runner)
        """The runner setting (a choice's name becomes its :class:`~lightning_fedrep.runners.settings.RunnerSettings`)."""
        self.randomness: Randomness = randomness_setting(randomness)
        """The vectorized runner's contract for random layers (``"exact"`` or ``"per_client"``)."""
        self.algorithm: Algorithm = strategy_algorithm(algorithm, server_optimizer, type(self).__name__)
        epochs = {"head_epochs": head_epochs, "body_epochs": body_epochs, "local_epochs": local_epochs}
        self.config = federation_config(
            self.algorithm,
            phases,
            epochs,
            clients_per_round,
            type(self).__name__,
            weighting=weighting,
            client_optimizer_state=client_optimizer_state,
            first_state=first_state,
            seed=seed,
            on_nonfinite=on_nonfinite,
            on_client_error=on_client_error,
            privacy=privacy,
        )
        self.evaluate_clients, self.predict = evaluate_clients, predict
        self.head, self.buffers = head, buffers
        self.allow_frozen, self.headline_metrics = allow_frozen, headline_metrics
        self.allow_new_federation = allow_new_federation
        self.federation: Federation | None = None
        """The federated state and round state machine (created when the module's split is known)."""
        self.collective: Collective = Collective()
        """The processes a round's clients are sharded over (one here; several on the DDP strategy)."""
        self._run: FederatedRun | None = None
        self._selection = RunnerSelection(self.runner, self.randomness)
        self._constraints = Constraints()
        """The host's facts of the current call (how a training batch is converted and moved to the device)."""
        self._callbacks: list[Any] = []
        self._evaluation = FederatedEvaluation(self._capture, self._batch_size)
        self._prediction = Prediction()
        self._binding = self._new_binding()
        self._pending: dict[str, Any] | None = None
        self._restored = False
        self._checkpoint_path: Any = None

    # ------------------------------------------------------------------ accessors
    @property
    def split(self) -> ParameterSplit | None:
        """Which parameters are head, body and frozen (``None`` before the module is connected)."""
        return self.federation.split if self.federation is not None else None

    @property
    def current_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between rounds, and
        on the vectorized runner, where :attr:`current_clients` train together)."""
        return self.federation.live_client if self.federation is not None else None

    @property
    def current_clients(self) -> tuple[int, ...]:
        """The clients training in the current step: several in lockstep on the vectorized runner, the
        live client on the sequential path, none between rounds."""
        return self._run.runner.current_clients if self._run is not None else ()

    @property
    def current_phase(self) -> str | None:
        """What trains right now: ``"head"``, ``"body"`` or ``"all"``."""
        return self._run.runner.current_phase if self._run is not None else None

    @property
    def runner_report(self) -> RunnerReport | None:
        """Which runner runs this fit's training steps (``RunnerReport.runner``: ``"vectorized"`` or
        ``"sequential"``), why, decided when, and how each phase kind runs
        (:class:`~lightning_fedrep.runners.runner_report.RunnerReport`); ``None`` before the first fit's ``setup``."""
        return self._selection.report

    @property
    def runner_settings(self) -> dict[str, Any]:
        """The lockstep runner's decided settings: ``group_width`` and ``lane_width`` (``None``: a round's
        clients, the group's), ``client_bytes`` (one client's estimated bytes), ``caching`` and ``split`` (how
        head phases run on cached features), ``steps_per_call`` (lockstep steps per Lightning step, ``None``: a
        whole phase of a group), ``compile`` (``RunnerSettings.compile``); ``{}`` on the sequential runner."""
        return self._selection.engine_settings

    @property
    def lockstep_engine(self) -> Any:
        """The lockstep runner's engine (a :class:`~lightning_fedrep.runners.lockstep.engine.LockstepEngine`:
        its groups, schedules, loss terms, for inspection), ``None`` when the fit runs sequentially."""
        return self._selection.engine

    @property
    def num_clients(self) -> int:
        """Number of clients in the training data."""
        return self.require_federation().num_clients

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every validated federated round: ``{"round": r, "val/acc": ..., <recorded columns>}`` (the
        rounds between validations, with only recorded columns, are in ``federation.history.rows``)."""
        return self.federation.history.evaluated_rows if self.federation is not None else []

    @property
    def evaluated_clients(self) -> list[int]:
        """The clients this process evaluates in the current (or last) validation/test: every client with
        evaluation data on one process, this rank's share on several (``[]`` before any evaluation)."""
        return self._evaluation.evaluated_clients

    @property
    def client_metrics(self) -> dict[str, ClientMetrics]:
        """Per stage (``"val"``, ``"test"``, ``"sanity"``, ``"finetune/val"``), the last evaluation's
        per-client metrics."""
        return self._evaluation.client_metrics

    @property
    def prediction_mode(self) -> str | None:
        """Whose model the last ``trainer.predict`` ran: ``"personalized"`` or ``"new_client"``."""
        return self._prediction.mode

    @property
    def prediction_clients(self) -> list[int]:
        """After ``trainer.predict`` on a federated data module: the client of each predicted batch, in
        the order of the returned predictions."""
        return self._prediction.clients

    def fit_heads_together(
        self, tuning: HeadFineTuning, clients: Sequence[ClientHead]
    ) -> list[dict[str, Tensor]]:
        """Many clients' heads fine-tuned at once on their cached features, each with its own batches and its
        own optimizer, stacked as the engine stacks a group (``runners/lockstep/heads_together.py``): ``tuning``
        says how (the same for every client), ``clients`` each one's start, features and batches; the heads in
        ``clients``' order. For a callback that fine-tunes many clients (``FineTunedEvaluation``, with the head
        of ``feature_split``); the same computation as one client at a time within float error. Raises
        :class:`~lightning_fedrep.evaluation.head_tuning.NotBatchable` (before any client stepped) where it would not be."""
        return self._selection.fit_heads_together(tuning, clients)

    def feature_split(self, names: Sequence[str], probe: Tensor) -> Any:
        """The live module as ``head(features(x))`` with ``names`` as the head, in evaluation mode, verified
        on ``probe`` (the engine's detection: a :class:`~lightning_fedrep.federation.module.feature_split.FeatureSplit`), or ``None``:
        for a callback that computes a frozen body's output once (``FineTunedEvaluation``)."""
        return evaluation_split(self._live_module(), tuple(names), probe)

    @property
    def faults(self) -> list[ClientFault]:
        """Every client left out of a round so far: ``ClientFault(round, client, step, reason)``."""
        return list(self.federation.faults) if self.federation is not None else []

    def results(self) -> dict[str, dict[str, float]]:
        """The papers' figures: the last validated round (``final``), the mean over the last 10
        validated rounds (``last10``), the last fine-tuning evaluation (``finetune``); and the leaderboard's:
        the best validated round of ``val/acc`` and ``val/acc_weighted`` (``best``, its round in
        ``best_round``; selected on the evaluated split, so optimistic)."""
        return self.federation.history.results() if self.federation is not None else {}

    def round_plan(self, round_index: int) -> RoundPlan:
        """The frozen plan of round ``round_index`` (sampled clients, in order, their phases' step counts),
        after every federated callback's ``configure_round``."""
        self.require_federation()
        return self._run.plan(round_index)

    def round_shares(self, round_index: int | None = None) -> tuple[RankShare, ...]:
        """How round ``round_index``'s clients (the current round's by default) are dealt to the processes:
        each rank's clients and their local steps, balanced by steps (one share on one process)."""
        r = self._round_now() if round_index is None else round_index
        return shard_round(self.round_plan(r), self.collective.world_size)

    def rank_steps(self, round_index: int | None = None) -> tuple[int, ...]:
        """The Lightning steps each process trains in round ``round_index`` (the current one by default)
        before it idles, by rank: every rank runs the largest count, the others pad with idle steps."""
        r = self._round_now() if round_index is None else round_index
        self.require_federation()
        return self._run.schedule(r).lengths

    def client_for(self, batch_idx: int, round_index: int | None = None) -> int:
        """The client that trains on the ``batch_idx``-th batch of round ``round_index`` (the current one by
        default).

        A callback's or the module's ``on_train_batch_start`` runs before the strategy switches clients.
        """
        r = self._round_now() if round_index is None else round_index
        return self.round_plan(r).locate(batch_idx).client

    def global_tensors(self) -> dict[str, Tensor]:
        """The global shared part, by name (a copy)."""
        return self.require_federation().global_tensors()

    def update_global(self, tensors: dict[str, Tensor]) -> None:
        """Overwrite some of the global shared tensors (e.g. a server step after aggregation)."""
        self.require_federation().update_global(tensors)

    def client_tensors(self, client: int) -> dict[str, Tensor]:
        """The tensors specific to ``client`` (its local part and any fine-tuned part), by name. A copy."""
        return self.require_federation().client_tensors(client)

    def update_client(self, client: int, tensors: dict[str, Tensor]) -> None:
        """Overwrite some of ``client``'s local tensors (e.g. a server step on the heads)."""
        self.require_federation().update_client(client, tensors)

    def client_state_dict(self, client: int, warn_forward: bool = True) -> dict[str, Tensor]:
        """A ``state_dict`` of the user's module personalized for ``client`` (global shared part, its
        local part, and what it fine-tuned; what evaluation scores, ``Algorithm.evaluation()``). Load it into a
        fresh instance of the module to predict. With ``EvaluationSpec.adapt`` it is the model before the
        adaptation (evaluation adapts it on the client's training data first; a warning says so, once per
        strategy). With an ``EvaluationSpec.forward`` it is not the whole prediction (a warning says so, once
        per strategy, unless ``warn_forward=False``): use :meth:`client_model`."""
        federation = self.require_federation()
        adapt = federation.evaluation_spec.adapt
        if adapt is not None and client != -1:
            self._warn_once(
                "adapt",
                f"client_state_dict(i) (here i={client}) is client i's scored model before the adaptation its "
                f"evaluation runs first ({adapt!r} on the client's training data, EvaluationSpec.adapt of "
                f"{self.algorithm.name!r}); warned once per strategy.",
            )
        if federation.evaluation_spec.forward is not None and warn_forward:
            self._warn_once(
                "forward",
                f"client_state_dict(i) (here i={client}) holds the module's tensors only, but {self.algorithm.name!r} "
                "predicts with its own EvaluationSpec.forward over declared tensors too: use "
                "strategy.client_model(i) for a module that predicts as evaluation scores; warned once per strategy.",
            )
        return federation.personalized_state(self._live_module().state_dict(), client)

    def _warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` the first time ``key`` comes up for this strategy, not on every call."""
        warned = self.__dict__.setdefault("_warned_once", set())
        if key not in warned:
            warned.add(key)
            self._warn(message)

    def client_model(self, client: int) -> nn.Module:
        """A copy of the user's module (the ``LightningModule``) holding ``client``'s personalized model (for
        prediction or export).

        With the algorithm's ``EvaluationSpec.forward`` (an algorithm whose prediction is not the module's own
        forward, e.g. FedCP) the copy's instance attribute ``forward`` is a
        ``ScoredForward`` over copies of ``client``'s declared
        tensors and the server tensors, so ``model(x)`` predicts as evaluation scores, standalone; the class's
        own forward stays ``type(model).forward``. ``copy.deepcopy`` and ``torch.save(model)`` keep it when the
        algorithm's ``forward`` is picklable (a module-level function); its ``state_dict`` alone does not hold
        the declared tensors (``client_state_dict`` warns)."""
        state = self.client_state_dict(client, warn_forward=False)
        module = copy.deepcopy(self._live_module())
        set_forward(module, None)  # the class's forward (Lightning may leave a bound method there)
        module.load_state_dict(state)
        set_forward(module, self.require_federation().scored_forward(module, client))
        return module

    def new_client_model(self) -> nn.Module:
        """What the federation gives a client that never trained: the global shared part with the
        initial local part (for FedAvg, the global model). The starting point of new clients."""
        return self.client_model(-1)

    def gather_clients(self) -> None:
        """Give this process every client's state. A collective: call it on every process. Needed only
        after a fit with ``client_store="sharded"`` (each rank then holds its own clients), before reading
        any client (``client_model(i)``, ``client_tensors(i)``) on any rank; a no-op otherwise."""
        self.require_federation().gather_clients()

    def require_federation(self) -> Federation:
        """The federation, with an error that says how to get one."""
        if self.federation is None or not self.federation.has_state:
            raise RuntimeError("No federated state yet: call trainer.fit(...) or load a checkpoint first.")
        return self.federation

    def checkpoint_changes(self, checkpoint: dict[str, Any], datamodule: Any, stage: str) -> list[str]:
        """How ``datamodule``'s clients (and, to resume a ``fit``, this strategy's settings) differ from the
        federation ``checkpoint`` was saved by: what ``trainer.<stage>(ckpt_path=...)`` checks when the data
        are loaded, answered before anything runs (the command asks it before it writes anything).

        Raises:
            ~lightning_fedrep.federation.FederationMismatch: they differ and ``allow_new_federation`` is not set.
        """
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("federation")
        if not saved or (stage == "predict" and not reads_clients(self.predict)):
            return []
        current = data_fingerprint(datamodule, stage == "fit", self.algorithm.name, self.config)
        changes = fingerprint_changes(saved, current) if current is not None else []
        if changes and not self.allow_new_federation:
            self._new_binding().check_same_federation(self.federation, changes)
        return changes

    # ------------------------------------------------------------------ the hooks' Lightning-free halves
    def _new_binding(self) -> DataBinding:
        """A new call's data checks, with the settings (``allow_new_federation``, ``evaluate_clients``)."""
        return DataBinding(self.allow_new_federation, self.evaluate_clients, self._warn, self._info)

    def _say(self, line: str | None) -> None:
        """Give ``line`` (a runner decision's) as an information line, if any."""
        if line is not None:
            self._info(line)

    def _note(self, note: str | None) -> None:
        """Warn with ``note``, if any."""
        if note is not None:
            self._warn(note)

    def _resolve_layout(self, model: nn.Module) -> None:
        """Split ``model`` into the algorithm's parts; a new layout gets a new federation and run."""
        needs_head = self.algorithm.needs_split or any(p.train != "all" for p in self.config.phases)
        layout = resolve_layout(
            model,
            self.head,
            shares=self.algorithm.shares,
            needs_head=needs_head,
            buffers=self.buffers,
            allow_frozen=self.allow_frozen,
            keep_local=self.algorithm.keep_local(model),
            owner=type(self.algorithm).__name__,
        )
        if self.federation is None or self.federation.layout != layout:
            self.federation = Federation(self.algorithm, layout, self.config)
            zero = lambda: torch.zeros((), device=self._device(), requires_grad=True)  # noqa: E731
            self._run = FederatedRun(self.federation, None, CallbackBus(), zero)
            self._selection.install(self._run, self.algorithm, self.collective)

    def _take_module(self, call: str) -> None:
        """At ``setup``, before the host's own: the federation of the connected module (refusing another
        module than the one it holds, ``call``: the Trainer's call)."""
        if self.federation is None:
            self._resolve_layout(self._live_module())
        refuse_another_module(self.federation, self._live_module(), self._restored, call)

    def _attach(self, module: nn.Module, optimizers: Sequence[Any], fit: bool, datamodule: Any) -> None:
        """At ``setup``, once the optimizers exist: the federation takes the module, evaluation its state
        (global and initial local), the algorithm its ``setup``."""
        self.federation.attach(module, optimizers)
        self._evaluation.take_state(self.federation, self._device(), fit, self._restored)
        self.algorithm.setup(module, self.federation.split, datamodule)

    def _start_call(
        self, callbacks: Sequence[Any], trainer: Any, constraints: Constraints, fit: bool, manual: bool
    ) -> None:
        """At the end of ``setup``: the federated ``callbacks`` join the run (their hooks get ``trainer``, the
        host's, and the module), then the runner is chosen (fit; one line says why) from the host's
        ``constraints`` (``manual``: the module optimizes manually)."""
        module = self._live_module()
        self.federation.collective = self.collective
        self._constraints = constraints
        self._callbacks = list(callbacks)
        self._run.bus = bus = CallbackBus(callbacks, trainer, module)
        self.federation.timing = any(c.needs_client_timing for c in callbacks)
        privacy = self.federation.config.privacy
        if fit and privacy is not None:
            privacy.check_module(module)
        refuse_manual_loss_terms(fit and manual, self.algorithm, bus, privacy)
        self._say(self._selection.setup(self._run, constraints, module, self.algorithm, self.collective, fit))

    def _bind_loader(
        self, loader: object, predicting: bool, probe: Callable[[], ModelProbe], datamodule: Any, smoke: bool
    ) -> object:
        """What ``process_dataloader`` returns for ``loader`` (refusing data not from a federated module):
        ``probe`` gives the module's facts for the label checks, ``smoke`` says ``fast_dev_run``."""
        fingerprint = lambda: training_clients(datamodule)  # noqa: E731
        if predicting:
            self._prediction.serve(None)
            if isinstance(loader, EvalLoader):
                reads = reads_clients(self.predict)
                self._binding.bind_prediction(loader, self.federation, reads, fingerprint)
                self._prediction.serve(loader)
            return loader
        if isinstance(loader, RoundLoader):
            return self._bind_training(loader, probe(), smoke)
        if isinstance(loader, EvalLoader):
            return self._bind_evaluation(loader, probe(), smoke, fingerprint)
        raise TypeError(
            f"{type(self).__name__} needs the data of a FederatedDataModule (a RoundLoader for training and an "
            f"EvalLoader for evaluation), got {type(loader).__name__}. Build the data with "
            "lightning_fedrep.FederatedDataModule(train_set, test_set, partitioner=...) and pass it as datamodule=."
        )

    def _bind_training(self, loader: RoundLoader, probe: ModelProbe, smoke: bool) -> RoundLoader:
        """Bind the round loader to the run's schedule; the first one decides the runner's details."""
        self._binding.bind_training(loader, self.require_federation(), probe)
        run = self._run
        plan = run.plan(self._round_now())
        refuse_empty_plan(plan)  # before the engine's probe
        device = self._device()
        self._say(
            self._selection.first_loader(run, loader, plan, device, smoke, self.algorithm, self.collective)
        )
        loader.bind(lambda: self._run.schedule(self._round_now()))
        self._bind_samples(loader, device)
        return loader

    def _bind_samples(self, loader: RoundLoader, device: torch.device) -> None:
        """What ``ClientStart.data`` reads: the loader's samples of a client, as the training step receives them
        (the host's conversion, on ``device``)."""
        convert, to_device = self._constraints.convert_input, self._constraints.to_device

        def read(client: int, round_index: int, positions: Sequence[Tensor]) -> Any:
            for batch in loader.batches_at(client, round_index, positions):
                yield to_device(convert(batch), device)

        self.require_federation().bind_samples(read)

    def _bind_evaluation(
        self, loader: EvalLoader, probe: ModelProbe, smoke: bool, fingerprint: Callable[[], Any]
    ) -> EvalLoader:
        """Keep the evaluated clients, shard them over the processes, chunk them for the batched evaluation."""
        federation = self.federation
        self._binding.bind_evaluation(loader, federation, self.collective, probe, fingerprint)
        batched = serve_evaluation(
            self._selection,
            loader,
            probe.module,
            federation,
            probe.device,
            probe.convert_input,
            probe.headline,
            smoke,
        )
        self._evaluation.serve(loader, batched)
        return loader

    def _finish_pass(self, in_fit: bool, cut: tuple[int | None, str] | None) -> dict[str, Any]:
        """After an evaluation pass's last batch: its summaries over clients to log (``in_fit``: a fit's
        validation, kept in the rounds' history; ``cut``: what the host ran of the pass, and why)."""
        federation, collective = self.federation, self.collective
        values = self._evaluation.finish(federation, collective, self.round_plan, in_fit, cut, self._warn)
        if in_fit:
            self._run.validated_round = federation.round_index
        return values

    def _begin_prediction(self) -> None:
        """Decide whose model predicts (``predict``), say it in a log line, and load the model a new client
        gets (global shared part, initial local part)."""
        self._prediction.begin(
            self.predict,
            self.federation,
            self.algorithm.name,
            self.config.first_state,
            self._evaluation.module_alone,
            self._info,
            self._warn,
        )

    def _roll_back(self) -> bool:
        """Roll the open round back (warning that it did); whether a round was open."""
        note = self._run.roll_back() if self._run is not None else None
        self._note(note)
        return note is not None

    def _write_entry(
        self,
        checkpoint: dict[str, Any],
        interrupted: bool,
        in_fit: bool,
        validation_due: Callable[[], bool],
        before_validation: Callable[[dict[str, Any]], dict[str, Any]],
        optimizers: Sequence[Any],
    ) -> None:
        """Add the federation's state to ``checkpoint`` (under :data:`CHECKPOINT_KEY`). ``interrupted`` (the run
        stopped inside a round): the open round is rolled back and the checkpoint's loops resume at its first
        step. Written between the end of a fit's (``in_fit``) round and the end of its validation
        (``validation_due()``: the host validates after the step being run), the loops are rewritten by
        ``before_validation`` to run that validation again on resuming, or the round's evaluation would be
        missing from the history."""
        run, validation_owed = self._run, False
        if interrupted and run is not None and run.round_start_loops is not None and self._roll_back():
            checkpoint["loops"] = run.round_start_loops
        elif "loops" in checkpoint and self._validation_missing(in_fit) and validation_due():
            checkpoint["loops"] = before_validation(checkpoint["loops"])
            validation_owed = True
        if self.federation is not None and self.federation.has_state:
            entry = run.checkpoint_entry(self.collective, optimizers, interrupted, validation_owed)
            checkpoint[CHECKPOINT_KEY] = entry

    def _validation_missing(self, in_fit: bool) -> bool:
        """Whether a fit's last round lacks its evaluation in the history."""
        federation = self._run.federation if self._run is not None else None
        validated = self._run.validated_round if self._run is not None else -1
        return in_fit and round_evaluation_missing(federation, validated)

    def _keep_entry(self, checkpoint: dict[str, Any], path: Any, in_fit: bool) -> None:
        """When restoring from ``path``: keep the federation's state for the loads below (a checkpoint
        without one is refused in a fit, ``in_fit``, else said in a line)."""
        self._pending = checkpoint.get(CHECKPOINT_KEY)
        self._checkpoint_path = path
        read_federated_entry(checkpoint, path)
        if self._pending is None:
            refuse_plain_checkpoint_in_fit(checkpoint, path, in_fit)
            self._info("The checkpoint has no federated state; every client starts from the module's head.")

    def _restore_federation(self, module: nn.Module, device: torch.device) -> None:
        """After the module's state is loaded (every stage, before ``setup``): the global state, every client."""
        self._restored = True
        if self.federation is None:
            self._resolve_layout(module)
        if self._pending is not None:
            load_federated_state(self.federation, self._pending, module, device, self._checkpoint_path)

    def _restore_run(self, optimizers: Sequence[Any]) -> bool:
        """In a fit, after ``setup``: restore the RNG, the runner and an interrupted round; whether the next
        round starts at its first step (else the restored round resumes, or its validation runs first)."""
        state, self._pending = self._pending, None
        if state is None:
            return False
        self._selection.checkpoint(self._run, state, self.algorithm, self.collective)
        state = self._run.restore(state, self.collective, optimizers)
        return not self.federation.round_open and not state.get("validation_owed")


takes_federated_settings = takes_settings_of(FederatedSession.__init__)
"""Give a federated strategy's ``__init__(self, *args, <its own keyword settings>, **kwargs)`` the federated
settings of :class:`FederatedSession` in its signature; applied once, where the class is defined."""
