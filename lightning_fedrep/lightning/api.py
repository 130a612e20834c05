"""The public API of the federated strategies: accessors over the federation and the run (documented in
the API reference, docs/api/strategies.md). A mixin of :class:`~lightning_fedrep.lightning.strategy.FederatedStrategyMixin`,
kept apart from its Lightning hooks."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.evaluation.head_tuning import ClientHead, HeadFineTuning
from lightning_fedrep.evaluation.metrics import ClientMetrics
from lightning_fedrep.evaluation.prediction import reads_clients
from lightning_fedrep.federation import ClientFault, Federation, federation_fingerprint, fingerprint_changes
from lightning_fedrep.federation.api.scoring import set_forward
from lightning_fedrep.federation.checkpoint.entry import CHECKPOINT_KEY
from lightning_fedrep.federation.module.feature_split import evaluation_split
from lightning_fedrep.federation.module.split import ParameterSplit
from lightning_fedrep.federation.plan import RankShare, RoundPlan, shard_round
from lightning_fedrep.lightning import loading
from lightning_fedrep.runners.runner_report import RunnerReport


class StrategyAPI:
    """Public accessors of a federated strategy (the attributes they read are set by the strategy)."""

    @property
    def split(self) -> ParameterSplit | None:
        """Which parameters are head, body and frozen (``None`` before the module is connected)."""
        return self.federation.split if self.federation is not None else None

    @property
    def current_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between rounds, and
        on the vectorized engine, where :attr:`current_clients` train together)."""
        return self.federation.live_client if self.federation is not None else None

    @property
    def current_clients(self) -> tuple[int, ...]:
        """The clients training in the current step: several in lockstep on the vectorized engine, the
        live client on the sequential path, none between rounds."""
        return self._run.runner.current_clients if self._run is not None else ()

    @property
    def current_phase(self) -> str | None:
        """What trains right now: ``"head"``, ``"body"`` or ``"all"``."""
        return self._run.runner.current_phase if self._run is not None else None

    @property
    def runner_report(self) -> RunnerReport | None:
        """Which runner runs this fit's training steps (``"lockstep"``, the vectorized engine, or
        ``"sequential"``: ``RunnerReport.engine``), why, decided when, and how each phase kind runs
        (:class:`~lightning_fedrep.runners.runner_report.RunnerReport`); ``None`` before the first fit's ``setup``."""
        return self._selection.report

    @property
    def runner_settings(self) -> dict[str, Any]:
        """The lockstep runner's decided settings: ``group_width`` and ``lane_width`` (``None``: a round's
        clients, the group's), ``client_bytes`` (one client's estimated bytes), ``caching`` and ``split`` (how
        head phases run on cached features), ``steps_per_call`` (lockstep steps per Lightning step, ``None``: a
        whole phase of a group), ``compile`` (``RunnerSettings.compile``); ``{}`` on the sequential runner."""
        engine = self._selection.engine
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
        return evaluation_split(self.lightning_module, tuple(names), probe)

    @property
    def faults(self) -> list[ClientFault]:
        """Every client left out of a round so far: ``ClientFault(round, client, step, reason)``."""
        return list(self.federation.faults) if self.federation is not None else []

    def results(self) -> dict[str, dict[str, float]]:
        """The papers' figures: the last validated round (``final``), the mean over the last 10
        validated rounds (``last10``), the last fine-tuning evaluation (``finetune``)."""
        return self.federation.history.results() if self.federation is not None else {}

    def round_plan(self, round_index: int) -> RoundPlan:
        """The frozen plan of round ``round_index`` (sampled clients, in order, their phases' step counts),
        after every federated callback's ``configure_round``."""
        self.require_federation()
        return self._run.plan(round_index)

    def round_shares(self, round_index: int | None = None) -> tuple[RankShare, ...]:
        """How round ``round_index``'s clients (the current round's by default) are dealt to the processes:
        each rank's clients and their local steps, balanced by steps (one share on one process)."""
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
        return shard_round(self.round_plan(r), self.collective.world_size)

    def rank_steps(self, round_index: int | None = None) -> tuple[int, ...]:
        """The Lightning steps each process trains in round ``round_index`` (the current one by default)
        before it idles, by rank: every rank runs the largest count, the others pad with idle steps."""
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
        self.require_federation()
        return self._run.schedule(r).lengths

    def client_for(self, batch_idx: int, round_index: int | None = None) -> int:
        """The client that trains on the ``batch_idx``-th batch of round ``round_index`` (the current one by
        default).

        A callback's or the module's ``on_train_batch_start`` runs before the strategy switches clients.
        """
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
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
        return federation.personalized_state(self.lightning_module.state_dict(), client)

    def _warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` the first time ``key`` comes up for this strategy, not on every call."""
        warned = self.__dict__.setdefault("_warned_once", set())
        if key not in warned:
            warned.add(key)
            rank_zero_warn(message)

    def client_model(self, client: int) -> L.LightningModule:
        """A copy of the user's module holding ``client``'s personalized model (for prediction or export).

        With the algorithm's ``EvaluationSpec.forward`` (an algorithm whose prediction is not the module's own
        forward, e.g. FedCP) the copy's instance attribute ``forward`` is a
        ``ScoredForward`` over copies of ``client``'s declared
        tensors and the server tensors, so ``model(x)`` predicts as evaluation scores, standalone; the class's
        own forward stays ``type(model).forward``. ``copy.deepcopy`` and ``torch.save(model)`` keep it when the
        algorithm's ``forward`` is picklable (a module-level function); its ``state_dict`` alone does not hold
        the declared tensors (``client_state_dict`` warns)."""
        state = self.client_state_dict(client, warn_forward=False)
        module = copy.deepcopy(self.lightning_module)
        set_forward(module, None)  # the class's forward (Lightning may leave a bound method there)
        module.load_state_dict(state)
        set_forward(module, self.require_federation().scored_forward(module, client))
        return module

    def new_client_model(self) -> L.LightningModule:
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
        if not saved or not isinstance(datamodule, FederatedDataModule):
            return []
        if stage == "predict" and not reads_clients(self.predict):
            return []
        if stage == "fit":
            loader = datamodule.train_dataloader()
            current = federation_fingerprint(
                loader.client_sizes(),
                loader.partition_checksum(),
                loader.batch_size,
                self.algorithm.name,
                self.config,
            )
        else:
            current = loading.training_clients(datamodule) or {"num_clients": datamodule.num_clients}
        changes = fingerprint_changes(saved, current)
        if changes and not self.allow_new_federation:
            loading.data_binding(self).check_same_federation(self.federation, changes)
        return changes
