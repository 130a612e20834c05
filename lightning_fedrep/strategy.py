"""The Lightning strategies: a whole federated training inside one ``Trainer.fit``.

One Lightning epoch is one communication round. Every hook here is thin: it says when Lightning
calls it and delegates to the :class:`~lightning_fedrep.federation.Federation` (the round state
machine, no Lightning in it), to the federated callbacks (:mod:`lightning_fedrep.hooks`), or to the
personalized evaluation (:mod:`lightning_fedrep.evaluation`). Lightning behaviour relied on beyond
the documented hooks lives in :mod:`lightning_fedrep.lightning_internals`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_fedrep import lightning_internals as internals
from lightning_fedrep.algorithms import (
    ALGORITHMS,
    EPOCH_DEFAULTS,
    Algorithm,
    Phase,
    get_algorithm,
    parse_phases,
)
from lightning_fedrep.arguments import (
    check_bool,
    check_choice,
    check_clients_per_round,
    check_epoch_shorthands,
    check_int,
)
from lightning_fedrep.callbacks.progress import FederatedProgressBar
from lightning_fedrep.captured_logs import batch_size_of, capture_logs
from lightning_fedrep.checkpoint_payload import (
    CHECKPOINT_KEY,
    check_round_runner,
    federated_entry,
    read_federated_entry,
    refuse_plain_checkpoint_in_fit,
    restore_rank_state,
    round_evaluation_missing,
    this_rank_state,
)
from lightning_fedrep.checkpoints import check_federated_state, read_checkpoint
from lightning_fedrep.collective import Collective
from lightning_fedrep.data.labels import (
    check_client_labels,
    has_string_labels,
    output_width,
    string_labels_error,
)
from lightning_fedrep.data.loaders import ClientChunk, EvalLoader, RoundLoader
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.engine import LockstepEngine, LockstepPlan
from lightning_fedrep.engine.evaluation import (
    EVALUATION_CHUNK_SAMPLES,
    BatchedEvaluation,
    batched_evaluation,
    evaluation_split,
)
from lightning_fedrep.engine.report import EngineReport
from lightning_fedrep.engine.selection import build_engine, start_engine
from lightning_fedrep.evaluation import ClientMetrics, EvaluationPass
from lightning_fedrep.evaluation_records import (
    empty_clients_note,
    gather_pass,
    non_finite_note,
    partial_pass_note,
    pass_values,
)
from lightning_fedrep.federation import (
    ClientFault,
    Federation,
    FederationConfig,
    FederationMismatch,
    clients_fingerprint,
    federation_fingerprint,
    fingerprint_changes,
)
from lightning_fedrep.hooks import FederatedCallback, LiveStep
from lightning_fedrep.plan import RankShare, RoundPlan, plan_fingerprint, shard_round
from lightning_fedrep.sharding import IdleStep, RankSchedule, rank_schedule
from lightning_fedrep.split import HeadSpec, ParameterSplit, resolve_layout
from lightning_fedrep.trainer_checks import check_optimizers_cover_split, check_trainer_flags
from lightning_fedrep.untouched import untouched_random_state


class FederatedStrategyMixin:
    """The federated hooks shared by :class:`FederatedStrategy` (one device) and
    :class:`~lightning_fedrep.distributed.FederatedDDPStrategy` (several processes): put before a
    Lightning strategy class in the bases.

    Args:
        head: the per-client part: module name(s) / parameter-name prefixes, or a compiled regex.
            ``None`` uses the module's own ``fedrep_head`` attribute.
        algorithm: a registered name (``"fedrep"``, ``"fedper"``, ``"lg_fedavg"``, ``"fedavg"``,
            ``"local"``) or an :class:`~lightning_fedrep.algorithms.Algorithm` object.
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
            algorithm shares the body; ``"local"`` keeps them per client for every algorithm (FedBN).
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
        engine: how a round's local work runs. ``"vectorized"``: a round's clients train together in
            lockstep (one Lightning step = one local step of every client; ``torch.func``), head phases
            on cached body features; exact, but only for a module that declares its loss
            (``fedrep_loss``), has no random layers or batch norm, and an element-wise optimizer without
            gradient clipping (an error lists what is missing). ``"sequential"``: one client step per
            Lightning step, the user's ``training_step`` as is. ``"auto"``: vectorized where exact,
            else sequential with a one-line message saying why.
            ``"auto"`` also times, once per fit, whether a phase that cannot use cached features (FedRep's
            body epoch) is faster in lockstep or one client at a time (the choice is logged and
            checkpointed), and runs sequentially where the engine would gain nothing.
        engine_width: at most this many clients train together; ``None``: a round's clients, as many as
            ``engine_memory`` allows.
        predict: whose model ``trainer.predict`` runs: ``"personalized"``, each batch's client's own model
            (needs a federated data module's batches: each client's test samples, client after client);
            ``"new_client"``, the model a client that never trained gets (global body, initial head);
            ``"auto"``, personalized where the batches carry their clients (a federated data module), else
            new_client. A log line says which ran; ``prediction_mode`` holds it and
            ``prediction_clients`` the client of each batch.
        engine_memory: bytes a lockstep group may take (tensors, gradients, optimizer state, one step's
            activations, cached features, per client); ``None``: half a GPU's free memory, a quarter of
            the host's RAM.
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
        engine: Literal["auto", "vectorized", "sequential"] = "auto",
        engine_width: int | None = None,
        engine_memory: int | None = None,
        predict: Literal["auto", "new_client", "personalized"] = "auto",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        _check_head(head)
        for name, epochs in (
            ("head_epochs", head_epochs),
            ("body_epochs", body_epochs),
            ("local_epochs", local_epochs),
        ):
            check_int(name, epochs, minimum=0)
        for name, flag in (
            ("allow_frozen", allow_frozen),
            ("headline_metrics", headline_metrics),
            ("allow_new_federation", allow_new_federation),
        ):
            check_bool(name, flag)
        check_int("seed", seed)
        check_choice("predict", predict, ("auto", "new_client", "personalized"))
        check_choice("first_state", first_state, ("initial", "average"))
        if evaluate_clients is not None:
            check_int("evaluate_clients", evaluate_clients, minimum=1)
        self.evaluate_clients = evaluate_clients
        self.predict = predict
        self.prediction_mode: str | None = None
        """Whose model the last ``trainer.predict`` ran: ``"personalized"`` or ``"new_client"``."""
        self.prediction_clients: list[int] = []
        """After ``trainer.predict`` on a federated data module: the client of each predicted batch, in
        the order of the returned predictions."""
        self._predict_loader: EvalLoader | None = None
        clients_per_round = check_clients_per_round(clients_per_round)
        resolved = get_algorithm(algorithm)
        # a registered algorithm is shared by name: each strategy gets its own copy of its server state
        self.algorithm: Algorithm = copy.deepcopy(resolved) if isinstance(algorithm, str) else resolved
        check_epoch_shorthands(
            self.algorithm,
            phases is not None,
            {"head_epochs": head_epochs, "body_epochs": body_epochs, "local_epochs": local_epochs},
            EPOCH_DEFAULTS,
            owner=type(self).__name__,
        )
        if buffers not in ("shared", "local"):
            raise ValueError(f"buffers must be 'shared' or 'local', got {buffers!r}.")
        if engine not in ("auto", "vectorized", "sequential"):
            raise ValueError(f"engine must be 'auto', 'vectorized' or 'sequential', got {engine!r}.")
        _check_positive_or_none("engine_width", engine_width, "a client count", "a round's clients")
        _check_positive_or_none(
            "engine_memory",
            engine_memory,
            "a number of bytes",
            "half a GPU's free memory, a quarter of the RAM",
        )
        self.engine = engine
        self.engine_width = engine_width
        self.engine_memory = engine_memory
        self.head = head
        self.buffers = buffers
        self.allow_frozen = allow_frozen
        self.headline_metrics = headline_metrics
        self.allow_new_federation = allow_new_federation
        self.config = FederationConfig(
            phases=parse_phases(phases)
            if phases is not None
            else self.algorithm.default_phases(head_epochs, body_epochs, local_epochs),
            clients_per_round=clients_per_round,
            weighting=weighting,
            client_optimizer_state=client_optimizer_state,
            first_state=first_state,
            seed=seed,
            on_nonfinite=on_nonfinite,
            on_client_error=on_client_error,
        )
        self.federation: Federation | None = None
        """The federated state and round state machine (created when the module's split is known)."""
        self.client_metrics: dict[str, ClientMetrics] = {}
        """Per stage (``"val"``, ``"test"``, ``"sanity"``), the last evaluation's per-client metrics."""
        self._callbacks: list[FederatedCallback] = []
        self._loss_callbacks: list[FederatedCallback] = []
        self._evaluation: EvaluationPass | None = None
        self._eval_loader: EvalLoader | None = None
        self._pending: dict[str, Any] | None = None
        self._engine: LockstepEngine | None = None
        self._engine_report: EngineReport | None = None
        self._batched_evaluation: BatchedEvaluation | None = None
        self.collective: Collective = Collective()
        """The processes a round's clients are sharded over (one here; several on the DDP strategy)."""
        self._rank_schedules: dict[int, RankSchedule] = {}
        self._idle = False
        self._client_step = 0
        self._round_start_loops: dict[str, Any] | None = None
        self._validated_round = -1
        self._restored = False
        self._labels_checked: set[str] = set()
        self._checkpoint_path: Any = None

    # ------------------------------------------------------------------ public accessors
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
        if self._engine is not None and self._engine.segment is not None:
            return self._engine.segment.clients
        client = self.current_client
        return () if client is None else (client,)

    @property
    def engine_report(self) -> EngineReport | None:
        """Which engine runs this fit's training steps (``"vectorized"`` / ``"sequential"``), why, decided
        when, and how each phase runs (:class:`~lightning_fedrep.engine.report.EngineReport`); ``None``
        before the first fit's ``setup``."""
        return self._engine_report

    def _decide_engine(self, report: EngineReport) -> None:
        self._engine_report = report

    @property
    def current_phase(self) -> str | None:
        """What trains right now: ``"head"``, ``"body"`` or ``"all"``."""
        if self._engine is not None and self._engine.segment is not None:
            return self._engine.segment.part
        return self.federation.live_phase if self.federation is not None else None

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
        return list(self._eval_loader.evaluated_clients) if self._eval_loader is not None else []

    def feature_split(self, names: Sequence[str], probe: Tensor) -> Any:
        """The live module as ``head(features(x))`` with ``names`` as the head, in evaluation mode, verified
        on ``probe`` (the engine's detection: a :class:`~lightning_fedrep.engine.FeatureSplit`), or ``None``:
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
        """The frozen plan of a round (sampled clients, in order, their phases' step counts), after
        every federated callback's ``configure_round``."""
        return self.require_federation().plan(round_index, self._configure_round)

    def round_shares(self, round_index: int | None = None) -> tuple[RankShare, ...]:
        """How a round's clients (the current round's by default) are dealt to the processes: each
        rank's clients and their local steps, balanced by steps (one share on one process)."""
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
        return shard_round(self.round_plan(r), self.collective.world_size)

    def rank_steps(self, round_index: int | None = None) -> tuple[int, ...]:
        """The Lightning steps each process trains in a round (the current one by default) before it
        idles, by rank: every rank runs the largest count, the others pad with idle steps."""
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
        schedule = self._training_schedule(r)
        return schedule.lengths if isinstance(schedule, RankSchedule) else (schedule.length,)

    def client_for(self, batch_idx: int, round_index: int | None = None) -> int:
        """The client that trains on the ``batch_idx``-th batch of a round (the current one by default).

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

    def client_state_dict(self, client: int) -> dict[str, Tensor]:
        """A ``state_dict`` of the user's module personalized for ``client`` (global shared part, its
        local part, and what it fine-tuned). Load it into a fresh instance of the module to predict."""
        return self.require_federation().personalized_state(self.lightning_module.state_dict(), client)

    def client_model(self, client: int) -> L.LightningModule:
        """A copy of the user's module holding ``client``'s personalized model (for prediction or export)."""
        state = self.client_state_dict(client)
        module = copy.deepcopy(self.lightning_module)
        module.load_state_dict(state)
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

    # ------------------------------------------------------------------ set-up
    @override
    def connect(self, model: L.LightningModule) -> None:
        """Called first in every ``fit``/``validate``/``test``: resolve the body/head split."""
        super().connect(model)
        self._restored = False
        self._labels_checked: set[str] = set()
        internals.replace_default_progress_bar(model.trainer, FederatedProgressBar)
        if any(True for _ in model.parameters()):  # else the module builds its layers in configure_model
            self._resolve_layout(model)

    def _resolve_layout(self, model: torch.nn.Module) -> None:
        layout = resolve_layout(
            model,
            self.head,
            shares=self.algorithm.shares,
            needs_head=self.algorithm.needs_split or any(p.train != "all" for p in self.config.phases),
            buffers=self.buffers,
            allow_frozen=self.allow_frozen,
        )
        if self.federation is None or self.federation.layout != layout:
            self.federation = Federation(self.algorithm, layout, self.config)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Called after the module's ``setup`` (and a checkpoint's model state): check the Trainer's
        settings (fit), create the optimizers, then snapshot the global and initial local state."""
        if trainer.training or trainer.state.fn == "fit":
            check_trainer_flags(trainer)
        if self.federation is None:
            self._resolve_layout(self.lightning_module)
        self._refuse_another_module(trainer)
        super().setup(trainer)
        federation = self.federation
        if trainer.state.fn == "fit":
            check_optimizers_cover_split(self.optimizers, self.lightning_module, federation.split)
        federation.attach(self.lightning_module, self.optimizers)
        federation.initialize(self.root_device)
        federation.collective = self.collective
        self._callbacks = [c for c in trainer.callbacks if isinstance(c, FederatedCallback)]
        self._loss_callbacks = [
            c for c in self._callbacks if type(c).loss_term is not FederatedCallback.loss_term
        ]
        federation.timing = any(c.needs_client_timing for c in self._callbacks)
        if (
            trainer.state.fn == "fit"
            and not self.lightning_module.automatic_optimization
            and self._has_loss_terms()
        ):
            raise RuntimeError(
                "Loss terms (from the algorithm or a FederatedCallback) need automatic optimization; this module "
                "uses manual optimization."
            )
        self._engine = None
        if trainer.state.fn == "fit":
            self._engine = build_engine(
                self.engine,
                trainer,
                self.lightning_module,
                federation,
                self.optimizers,
                self.lr_scheduler_configs,
                self.algorithm,
                self._callbacks,
                self._loss_callbacks,
                self.engine_width,
                decide=self._decide_engine,
            )

    def _refuse_another_module(self, trainer: L.Trainer) -> None:
        """A federation holds a body and one head per client; a module passed to a later ``fit``/``validate``/
        ``test`` without ``ckpt_path`` holds one model, whose weights the federation's would silently replace."""
        federation = self.federation
        held = federation.module if federation is not None and federation.has_state else None
        if held is None or held is self.lightning_module or self._restored:
            return
        call = str(trainer.state.fn.value)
        raise ValueError(
            f"trainer.{call}() was given another module than the one this strategy's federation holds (from an "
            "earlier fit or checkpoint): its weights would be replaced by the federation's global body and "
            f"per-client heads without a word. To evaluate a checkpoint, pass ckpt_path (trainer.{call}(model, "
            f"ckpt_path='best') restores its body and every client's head); to use the federation, pass the module "
            f"it was fitted with (trainer.lightning_module); to start from this module's own weights, use a new "
            "strategy (and Trainer)."
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Called for each data iterable Lightning loads: bind the training ``RoundLoader`` to the round
        plans; remember the evaluation loader."""
        if self.lightning_module.trainer.state.fn == "predict":
            self._predict_loader = None
            if isinstance(dataloader, EvalLoader):
                alone = self.federation is not None and self.federation.client_sizes is None  # predict alone
                if alone and self._predictions_read_clients():
                    self._check_same_federation(
                        self.federation.federation_changes(self._evaluated_clients(dataloader))
                    )
                dataloader.chunk(None)
                self._predict_loader = dataloader
                _warn_clients_without_data(dataloader)
            return dataloader
        if isinstance(dataloader, RoundLoader):
            self._check_labels(dataloader)
            federation = self.require_federation()
            federation.bind_data(
                dataloader.client_sizes(), dataloader.batch_size, dataloader.partition_checksum()
            )
            self._check_same_federation(federation.federation_changes())
            trainer = self.lightning_module.trainer
            if self.round_plan(trainer.current_epoch).length == 0:  # before the engine's probe
                raise ValueError(
                    "The round plan is empty: every phase has a zero budget (head_epochs, body_epochs, "
                    "local_epochs or phases=). Give at least one phase epochs or steps > 0."
                )
            if self._engine is not None:
                self._engine = start_engine(
                    self._engine,
                    self.engine,
                    dataloader,
                    self.round_plan(trainer.current_epoch),
                    self.root_device,
                    self.engine_memory,
                    smoke=bool(trainer.fast_dev_run),
                    collective=self.collective,
                    decide=self._decide_engine,
                )
            dataloader.bind(lambda: self._training_schedule(trainer.current_epoch))
            return dataloader
        if isinstance(dataloader, EvalLoader):
            if self.evaluate_clients is not None:
                dataloader.keep_first(self.evaluate_clients)
            self._eval_loader = dataloader
            _warn_clients_without_data(dataloader)
            self._check_labels(dataloader)
            if self.federation is not None and self.federation.client_sizes is None:  # validate/test alone
                self._check_same_federation(
                    self.federation.federation_changes(self._evaluated_clients(dataloader))
                )
            if self.collective.distributed:
                sharded = (
                    self.federation is not None
                    and self.federation.has_state
                    and self.federation.store.sharded
                )
                dataloader.shard(self.collective.rank, self.collective.world_size, by_owner=sharded)
            self._batched_evaluation = None
            if self.engine != "sequential" and self.headline_metrics and self.federation is not None:
                self._batched_evaluation = batched_evaluation(
                    self.lightning_module,
                    self.federation,
                    dataloader,
                    self.root_device,
                    self.lightning_module.trainer.precision_plugin.convert_input,
                )
            smoke = self.lightning_module.trainer.fast_dev_run  # one chunk is the pass: keep it a batch
            chunk = dataloader.batch_size if smoke else EVALUATION_CHUNK_SAMPLES
            dataloader.chunk(chunk if self._batched_evaluation is not None else None)
            return dataloader
        raise TypeError(
            f"{type(self).__name__} needs the data of a FederatedDataModule (a RoundLoader for training and an "
            f"EvalLoader for evaluation), got {type(dataloader).__name__}. Build the data with "
            "lightning_fedrep.FederatedDataModule(train_set, test_set, partitioner=...) and pass it as datamodule=."
        )

    def _check_labels(self, loader: RoundLoader | EvalLoader) -> None:
        """Refuse string labels, and labels the model cannot score (at or above its number of outputs on a
        probe batch, or the data module's ``num_classes``), naming the client: once per split and call."""
        split = "train" if isinstance(loader, RoundLoader) else loader.stage
        if split in self._labels_checked or not loader.clients:
            return
        self._labels_checked.add(split)
        with untouched_random_state():  # fetching a probe batch may draw from the global generators
            probe = (
                next(iter(loader.client_batches(0, 0, 0, 1)), None)
                if isinstance(loader, RoundLoader)
                else loader.first_batch()
            )
        if isinstance(probe, list | tuple) and len(probe) == 2 and has_string_labels(probe[1]):
            first = "client 0" if isinstance(loader, RoundLoader) else "the first client"
            raise string_labels_error(f"The {split} data of {first}", probe[1][0])
        convert_input = self.lightning_module.trainer.precision_plugin.convert_input
        num_classes = (  # headline_metrics=False: model(x) may not be class scores
            output_width(self.lightning_module, probe, self.root_device, convert_input)
            if self.headline_metrics
            else None
        )
        source = "the model outputs"
        if num_classes is None:
            declared = getattr(self.lightning_module.trainer.datamodule, "num_classes", None)
            if isinstance(declared, int) and not isinstance(declared, bool):
                num_classes, source = declared, "the data module declares"
        if num_classes is None:
            return
        unchecked = check_client_labels(loader.clients, split, num_classes, source)
        if unchecked:
            rank_zero_info(
                f"lightning_fedrep: {split} labels not checked against the {num_classes} classes: "
                f"{', '.join(sorted(set(unchecked)))} stores no `targets` (one out of range fails at its step)."
            )

    def _check_same_federation(self, changes: list[str]) -> None:
        """Refuse data or settings other than the checkpoint's (another federation's heads would be handed
        to these clients), unless ``allow_new_federation``: then these clients start from the global state."""
        if not changes:
            return
        if not self.allow_new_federation:
            raise FederationMismatch(
                f"The checkpoint was saved by another federation than this run's ({'; '.join(changes)}). Resume or "
                "evaluate it with the same data module (clients, partition, batch size) and strategy settings "
                "(algorithm, seed, clients_per_round, phases, first_state), or pass allow_new_federation=True to "
                "start these clients from the checkpoint's global state (their own parts from the initial ones)."
            )
        rank_zero_warn(
            f"allow_new_federation=True: a new federation ({'; '.join(changes)}); every client starts from the "
            "checkpoint's global state and the initial local part."
        )
        self.federation.adopt_new_federation()

    def _predictions_read_clients(self) -> bool:
        """Whether ``trainer.predict`` may read the clients' stored state, so a checkpoint's federation must be
        this data's: not for new-client predictions, which use the global part only (any clients may)."""
        return self.predict != "new_client"

    def _evaluated_clients(self, loader: EvalLoader) -> dict[str, Any]:
        """The clients a validate/test/predict alone evaluates, as a checkpoint's fingerprint records them:
        the data module's training clients (number, sizes, partition); only their number for data that do
        not come from a ``FederatedDataModule`` (a log line says so)."""
        clients = _training_clients(self.lightning_module.trainer.datamodule)
        if clients is None:
            rank_zero_info(
                "The evaluated data do not come from a FederatedDataModule with training clients: only their "
                "number is compared with the checkpoint's federation, not their partition."
            )
            return {"num_clients": loader.num_clients}
        return clients

    def checkpoint_changes(self, checkpoint: dict[str, Any], datamodule: Any, stage: str) -> list[str]:
        """How ``datamodule``'s clients (and, to resume a ``fit``, this strategy's settings) differ from the
        federation ``checkpoint`` was saved by: what ``trainer.<stage>(ckpt_path=...)`` checks when the data
        are loaded, answered before anything runs (the command asks it before it writes anything).

        Raises:
            FederationMismatch: they differ and ``allow_new_federation`` is not set.
        """
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("federation")
        if not saved or not isinstance(datamodule, FederatedDataModule):
            return []
        if stage == "predict" and not self._predictions_read_clients():
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
            current = _training_clients(datamodule) or {"num_clients": datamodule.num_clients}
        changes = fingerprint_changes(saved, current)
        if changes and not self.allow_new_federation:
            self._check_same_federation(changes)
        return changes

    def _training_schedule(self, round_index: int) -> RoundPlan | LockstepPlan | RankSchedule:
        plan = self.round_plan(round_index)
        if self.collective.distributed:
            return self._rank_schedule(plan)
        return self._engine.schedule(plan) if self._engine is not None else plan

    def _rank_schedule(self, plan: RoundPlan) -> RankSchedule:
        """This process's part of the round, padded with idle steps (computed once per round plan)."""
        schedule = self._rank_schedules.get(plan.round)
        if schedule is None or schedule.plan is not plan:
            engine = self._engine

            def how(local: RoundPlan, own: bool) -> RoundPlan | LockstepPlan:
                if engine is None:
                    return local
                return engine.schedule(local) if own else engine.build_schedule(local)

            collective = self.collective
            schedule = rank_schedule(plan, collective.rank, collective.world_size, how)
            self._rank_schedules = {r: v for r, v in self._rank_schedules.items() if r >= plan.round - 1}
            self._rank_schedules[plan.round] = schedule
        return schedule

    # ------------------------------------------------------------------ rounds
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called right before each training step (after callbacks' and the module's hook): open the
        round on its first step, switch client and phase."""
        federation = self.federation
        round_index = self.lightning_module.trainer.current_epoch
        if federation.round_open and federation.round_index != round_index:
            self._close_round()
        plan = self.round_plan(round_index)
        if not federation.round_open:
            if self.collective.distributed:
                self.collective.agree(plan_fingerprint(plan), f"the plan of round {round_index}")
            self._round_start_loops = internals.loops_state_at_round_start(
                self.lightning_module.trainer, round_index
            )
            federation.open_round(plan)
            self._dispatch("on_round_start", plan)
        self._idle = False
        if self.collective.distributed:
            schedule = self._rank_schedule(plan)
            self._idle = schedule.idle(batch_idx)
            if self._idle:
                return
            plan = schedule.local
        if self._engine is not None:
            for client in self._engine.begin_step(self._engine.schedule(plan), batch_idx):
                self._dispatch("on_client_start", client)
            return
        location = plan.locate(batch_idx)
        if location.client != federation.live_client:
            self._finish_client()
            federation.load_client(location.client)
            self._dispatch("on_client_start", location.client)
        if federation.live_failed:  # its step raised earlier in the round (on_client_error="skip")
            self._idle = True
            return
        federation.begin_step(location)
        self._client_step = location.client_step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each training batch (inside the optimizer closure in automatic optimization): add
        the loss terms; under manual optimization, close the round after its last step. On the
        vectorized engine: every active client's loss on its batch, summed (the user's step is not run).
        On an idle step (this process has no client left in the round) nothing runs: under automatic
        optimization the loss is a zero that depends on no parameter (Lightning refuses ``None`` on
        several processes), and the optimizer does not step."""
        if self._idle:
            if not self.lightning_module.automatic_optimization:
                self._after_step()
                return None
            return torch.zeros((), device=self.root_device, requires_grad=True)
        if self._engine is not None:
            loss = self._engine.loss(args[0] if args else kwargs["batch"])
            trainer = self.lightning_module.trainer
            if internals.step_metrics_reach_loggers(trainer) or internals.round_ends_now(trainer):
                self.lightning_module.log("train/loss", self._engine.mean_loss(), on_step=True, batch_size=1)
            return loss
        try:
            output = super().training_step(*args, **kwargs)
        except Exception as error:
            if self.config.on_client_error != "skip":
                raise
            self.federation.fail_live_client(self._client_step, error)
            if not self.lightning_module.automatic_optimization:
                self._after_step()
                return None
            return torch.zeros((), device=self.root_device, requires_grad=True)
        if self._has_loss_terms():
            output = self._add_loss_terms(output, args, kwargs)
        if not self.lightning_module.automatic_optimization:
            self._after_step()
        return output

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Called for each optimizer step: under automatic optimization, close the round after its last.
        On the vectorized engine: run the closure (loss and backward), then step every client's optimizer.
        On an idle step: run the closure (it trains nothing) and step nothing."""
        if self._idle:
            closure()
            if internals.round_ends_now(self.lightning_module.trainer):
                self._close_round()
            return None
        if self._engine is not None:
            closure()
            for result in self._engine.end_step():
                self._dispatch("on_client_end", result)
            if internals.round_ends_now(self.lightning_module.trainer):
                self._close_round()
            return None
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.lightning_module.automatic_optimization:
            self._after_step()
        return output

    def _after_step(self) -> None:
        self.federation.end_step()
        if internals.round_ends_now(self.lightning_module.trainer):
            self._close_round()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called when the run stops on an exception: roll the open round back, so the federation holds
        what it held before the round (no client half-updated over an unaggregated body)."""
        self._roll_back_round()
        super().on_exception(exception)

    def _roll_back_round(self) -> bool:
        federation = self.federation
        stopped_in = federation.round_index if federation is not None else -1
        if federation is None or not federation.rollback_round():
            return False
        if self._engine is not None:
            self._engine.abandon()
        rank_zero_warn(
            f"The run stopped inside round {stopped_in}: the round is rolled back (a checkpoint written now "
            "resumes at its first step)."
        )
        return True

    @override
    def on_train_end(self) -> None:
        """Called when training ends: close a round cut short (``max_steps``, a stop request)."""
        if self.federation.round_open:
            rank_zero_warn(
                f"Training stopped inside round {self.federation.round_index}; averaging the clients that trained in it."
            )
            self._close_round()
        self.federation.release_phases()
        super().on_train_end()

    def _finish_client(self) -> None:
        result = self.federation.finish_client()
        if result is not None:
            self._dispatch("on_client_end", result)

    def _close_round(self) -> None:
        if self._engine is not None:
            for result in self._engine.finish_group():
                self._dispatch("on_client_end", result)
        self._finish_client()
        result = self.federation.close_round()
        if result is not None:
            self._dispatch("on_round_end", result)

    # ------------------------------------------------------------------ federated callbacks
    def _dispatch(self, hook: str, *args: Any) -> None:
        trainer = self.lightning_module.trainer
        for callback in self._callbacks:
            getattr(callback, hook)(trainer, self.lightning_module, *args)

    def _configure_round(self, plan: RoundPlan) -> RoundPlan:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for callback in self._callbacks:
            changed = callback.configure_round(trainer, plan)
            if not isinstance(changed, RoundPlan) or changed.round != plan.round:
                raise TypeError(
                    f"{type(callback).__name__}.configure_round must return a RoundPlan for round {plan.round} "
                    f"(e.g. plan.replace(clients=...)), got {changed!r}."
                )
            plan = changed
        return plan

    def _has_loss_terms(self) -> bool:
        return type(self.algorithm).loss_term is not Algorithm.loss_term or bool(self._loss_callbacks)

    def _add_loss_terms(self, output: Any, args: tuple, kwargs: dict) -> Any:
        loss = output["loss"] if isinstance(output, dict) else output
        if loss is None:
            return output
        federation, module = self.federation, self.lightning_module
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        extra = self.algorithm.loss_term(module, federation.global_view())
        if extra is not None:
            loss = loss + extra
        step = LiveStep(federation.round_index, federation.live_client, federation.live_phase, batch_idx)
        for callback in self._loss_callbacks:
            extra = callback.loss_term(module.trainer, module, batch, step)
            if extra is not None:
                loss = loss + extra
        return {**output, "loss": loss} if isinstance(output, dict) else loss

    # ------------------------------------------------------------------ evaluation
    def _begin_evaluation(self, stage: str) -> None:
        self.require_federation().begin_evaluation()
        self._evaluation = EvaluationPass(stage, capture_logs, batch_size_of, headline=self.headline_metrics)

    def _end_evaluation(self, stage: str) -> None:
        evaluation, self._evaluation = self._evaluation, None
        if evaluation is not None:
            self.headline_metrics = evaluation.headline
            if evaluation.metrics.samples:
                self.client_metrics[stage] = evaluation.metrics
        self.federation.end_evaluation()

    @override
    def on_validation_start(self) -> None:
        """Called before each validation pass (also mid-round): evaluate the global shared part."""
        self._begin_evaluation("val")
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        """Called after each validation pass: keep its per-client metrics, restore training's state."""
        self._end_evaluation("sanity" if self.lightning_module.trainer.sanity_checking else "val")
        super().on_validation_end()

    @override
    def on_test_start(self) -> None:
        """Called before testing: evaluate the global shared part with each client's own part."""
        self._begin_evaluation("test")
        super().on_test_start()

    @override
    def on_test_end(self) -> None:
        """Called after testing: keep its per-client metrics."""
        self._end_evaluation("test")
        super().on_test_end()

    @override
    def on_predict_start(self) -> None:
        """Called before predicting (after the data is loaded): decide whose model predicts (``predict``),
        say it in a log line, and load the model a new client gets (global shared part, initial local part)."""
        federated = self._predict_loader is not None
        mode = ("personalized" if federated else "new_client") if self.predict == "auto" else self.predict
        if mode == "personalized" and not federated:
            raise ValueError(
                "predict='personalized' predicts each batch with its client's own model, but these batches carry "
                "no client (they do not come from a FederatedDataModule). Predict with datamodule=<the federated "
                "data module> (each client's test samples), use strategy.client_model(i) for client i's model, or "
                "pass predict='new_client' (or 'auto')."
            )
        self.prediction_mode = mode
        rank_zero_info(f"trainer.predict (predict={self.predict!r}): {_PREDICTION_MODES[mode]}.")
        if self.federation is not None and self.federation.has_state:
            self.federation.load_personalized(-1)
        self.prediction_clients = []
        self._predicting_client = -1
        super().on_predict_start()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each predicted batch: with ``predict="personalized"`` and a federated data module, on
        the batch's client's own model."""
        loader = self._predict_loader
        if loader is not None:
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            client = loader.client_of(batch_idx)
            self.prediction_clients.append(client)
            if self.prediction_mode == "personalized" and client != self._predicting_client:
                self.require_federation().load_personalized(client)
                self._predicting_client = client
        return super().predict_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each validation batch: run it on the batch's client's personalized model."""
        return self._evaluation_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each test batch: run it on the batch's client's personalized model."""
        return self._evaluation_step(super().test_step, args, kwargs)

    def _evaluation_step(self, step: Callable, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
        if isinstance(batch, IdleStep):  # this process has evaluated all its clients
            if internals.evaluation_ends_now(self.lightning_module.trainer):
                self._log_evaluation(self._evaluation)
            return None
        if isinstance(batch, ClientChunk):
            return self._batched_evaluation_step(batch)
        client = self._eval_loader.client_of(batch_idx)
        self.federation.evaluate_client(client)
        evaluation = self._evaluation
        plugin = self.precision_plugin
        context = plugin.val_step_context if evaluation.stage == "val" else plugin.test_step_context
        output = evaluation.step(self.lightning_module, lambda: step(*args, **kwargs), batch, client, context)
        if internals.evaluation_ends_now(self.lightning_module.trainer):
            self._log_evaluation(evaluation)
        return output

    def _batched_evaluation_step(self, chunk: ClientChunk) -> None:
        evaluation = self._evaluation
        plugin = self.precision_plugin
        context = plugin.val_step_context if evaluation.stage == "val" else plugin.test_step_context
        self._batched_evaluation.add(
            chunk, self.lightning_module, self.federation, evaluation.metrics, evaluation.stage, context
        )
        if internals.evaluation_ends_now(self.lightning_module.trainer):
            self._log_evaluation(evaluation)

    def _log_evaluation(self, evaluation: EvaluationPass) -> None:
        """Log every metric's summary over clients; keep the federated rounds' history (validation)."""
        module, federation = self.lightning_module, self.federation
        trainer = module.trainer
        if self.collective.distributed:
            gather_pass(evaluation, self.collective.all_gather_object)
        if evaluation.metrics.samples:  # complete now: callbacks' on_*_end hooks run before the strategy's
            self.client_metrics["sanity" if trainer.sanity_checking else evaluation.stage] = (
                evaluation.metrics
            )
        notes = [non_finite_note(evaluation)]
        if not trainer.sanity_checking:
            notes.insert(0, self._partial_pass_note(evaluation))
        for note in filter(None, notes):
            rank_zero_warn(note)
        in_fit = evaluation.stage == "val" and trainer.state.fn == "fit" and not trainer.sanity_checking
        prefix = ""
        if evaluation.stage == "val" and federation.round_index >= 0 and federation.client_sizes is not None:
            prefix = self.round_plan(federation.round_index).prefix
        if in_fit:
            self._validated_round = federation.round_index
        values = pass_values(evaluation, federation.history, federation.round_index, prefix, in_fit)
        for key, value in values.items():
            options = evaluation.logging_options(key.removeprefix(prefix))
            # the same value on every process: synced only to spare Lightning's warning
            sync = self.collective.distributed
            module.log(key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync, **options)

    def _partial_pass_note(self, evaluation: EvaluationPass) -> str | None:
        """What a pass cut short (``limit_val_batches``, ``fast_dev_run``) evaluated, read off the Trainer."""
        loader, trainer = self._eval_loader, self.lightning_module.trainer
        if loader is None:
            return None
        limit = "limit_val_batches" if evaluation.stage == "val" else "limit_test_batches"
        batches = trainer.num_val_batches if evaluation.stage == "val" else trainer.num_test_batches
        cause = "fast_dev_run" if trainer.fast_dev_run else f"{limit}={getattr(trainer, limit)}"
        sizes = [len(data) for data in loader.clients]
        return partial_pass_note(evaluation, sizes, batches[0] if batches else None, len(loader), cause)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Called when a checkpoint is saved: the module's ``state_dict`` with the *global* shared part and
        the *initial* local part, so ``load_from_checkpoint`` of the user's module works and does not
        depend on which client happened to be live. Every client's state is saved separately."""
        state = super().lightning_module_state_dict()
        if self.federation is None or not self.federation.has_state:
            return state
        return self.federation.personalized_state(state, -1)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Called to write a checkpoint: add the federation's state under ``checkpoint["lightning_fedrep"]``.
        Written because the run stopped inside a round (``OnExceptionCheckpoint``), it holds the state
        before that round, and resumes at the round's first step."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        validation_owed = False
        if interrupted and self._round_start_loops is not None and self._roll_back_round():
            checkpoint["loops"] = self._round_start_loops
        elif trainer is not None and "loops" in checkpoint and self._round_validation_owed(trainer):
            checkpoint["loops"] = internals.loops_state_before_round_validation(checkpoint["loops"])
            validation_owed = True
        if self.federation is not None and self.federation.has_state:
            checkpoint[CHECKPOINT_KEY] = federated_entry(
                self.federation,
                self.collective,
                runner=self._engine,
                optimizers=self.optimizers,
                round_start_loops=self._round_start_loops,
                interrupted=interrupted,
                validation_owed=validation_owed,
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _round_validation_owed(self, trainer: L.Trainer) -> bool:
        """Whether a checkpoint written now falls between the end of a round and the end of its validation
        (written at its last step, or during validation): resuming from it must run that validation again,
        or the round's evaluation would be missing from the history."""
        in_fit = trainer.state.fn == "fit" and not trainer.sanity_checking
        missing = in_fit and round_evaluation_missing(self.federation, self._validated_round)
        return missing and internals.round_validation_due(trainer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Called first when restoring from ``ckpt_path``: keep the federation's state for the loads below."""
        load = super().load_checkpoint
        checkpoint = read_checkpoint(
            checkpoint_path, lambda: load(checkpoint_path, weights_only=weights_only)
        )
        self._pending = checkpoint.get(CHECKPOINT_KEY)
        self._checkpoint_path = checkpoint_path
        read_federated_entry(checkpoint, checkpoint_path)
        if self._pending is None:
            module = self.lightning_module
            in_fit = module is not None and module._trainer is not None and module.trainer.state.fn == "fit"
            refuse_plain_checkpoint_in_fit(checkpoint, checkpoint_path, in_fit)
            rank_zero_info(
                "The checkpoint has no federated state; every client starts from the module's head."
            )
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Called in every stage, before ``setup``: restore the module, the global state, every client."""
        super().load_model_state_dict(checkpoint, strict=strict)
        self._restored = True
        if self.federation is None:
            self._resolve_layout(self.lightning_module)
        if self._pending is not None:
            module = self.lightning_module
            check_federated_state(
                self._pending,
                {**dict(module.named_buffers()), **dict(module.named_parameters())},
                self.federation.shared_names,
                self.federation.local_names,
                self._checkpoint_path,
            )
            self.federation.load_state_dict(self._pending, self.lightning_module.device)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Called in fit only, after ``setup``: restore the RNG and an interrupted round."""
        super().load_optimizer_state_dict(checkpoint)
        state, self._pending = self._pending, None
        if state is None:
            return
        state = this_rank_state(state, self.collective.rank, self.collective.world_size)
        restore_rank_state(self.federation, state)
        if state["round"]["open"]:
            self._round_start_loops = state["round"].get("start_loops")
        if "optimizers" in state and state["round"]["open"]:  # Lightning restored rank 0's: take this rank's
            for optimizer, saved in zip(self.optimizers, state["optimizers"]):
                optimizer.load_state_dict(saved)
        if self._engine is not None and self.engine == "auto" and "engine" not in state:
            self._engine = None  # the run that saved it ran sequentially: so does its continuation
            self._decide_engine(
                EngineReport.sequential("the checkpoint was written by a sequential run", "checkpoint")
            )
        if self._engine is not None:
            self._engine.load_settings(state.get("engine"))
        if not self.federation.round_open:
            if not state.get("validation_owed"):  # else Lightning runs the round's validation, then the next
                internals.start_next_round_after_restore(self.lightning_module.trainer)
            return
        check_round_runner(state, vectorized=self._engine is not None)
        if self._engine is not None:
            self._engine.load_state_dict(state["round"]["engine"])


def _training_clients(datamodule: Any) -> dict[str, Any] | None:
    """The fingerprint of a ``FederatedDataModule``'s training clients (``None`` for other data, or a
    data module without training data)."""
    if not isinstance(datamodule, FederatedDataModule):
        return None
    try:
        loader = datamodule.train_dataloader()
    except ValueError:  # evaluation data only
        return None
    return clients_fingerprint(loader.client_sizes(), loader.partition_checksum())


_PREDICTION_MODES = {
    "personalized": "personalized predictions, each batch on its client's own model (the global body and the "
    "client's head); strategy.prediction_clients gives each batch's client",
    "new_client": "new-client predictions, every batch on the model a client that never trained gets (the "
    "global body and the initial head), not on the clients' personalized models",
}


def _warn_clients_without_data(loader: EvalLoader) -> None:
    """Clients without samples in an evaluation (or prediction) split are left out: say which."""
    note = empty_clients_note(loader.stage, [len(data) for data in loader.clients])
    if note is not None:
        rank_zero_warn(note)


def _check_head(head: Any) -> None:
    valid = head is None or isinstance(head, str | re.Pattern)
    if isinstance(head, Sequence) and not isinstance(head, str):
        valid = len(head) > 0 and all(isinstance(entry, str) and entry for entry in head)
    if not valid:
        raise TypeError(
            "head must be a module name or parameter-name prefix ('classifier'), a non-empty list of them, "
            f"a compiled regex (re.compile(...)), or None (the module's `fedrep_head`); got {head!r}."
        )


def _check_positive_or_none(name: str, value: Any, what: str, default: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be {what} >= 1 or None ({default}), got {value!r}.")


class FederatedStrategy(FederatedStrategyMixin, SingleDeviceStrategy):
    """Personalized federated learning (FedRep and its family) on one device: a whole federated training
    inside one ``Trainer.fit``, one Lightning epoch per communication round.

    Takes every federated setting of :class:`FederatedStrategyMixin` (``head``, ``algorithm``,
    ``clients_per_round``, ``head_epochs``, ``body_epochs``, ``local_epochs``, ``phases``, ``weighting``,
    ``client_optimizer_state``, ``first_state``, ``evaluate_clients``, ``buffers``, ``allow_frozen``, ``seed``, ``headline_metrics``, ``engine``,
    ``engine_width``, ``engine_memory``), and:

    Args:
        device: the device to train on; by default the one the Trainer's accelerator picks.

    For several processes (GPUs, nodes) use :class:`~lightning_fedrep.distributed.FederatedDDPStrategy`
    (``strategy="fedrep_ddp"``, ...).
    """

    strategy_name = "federated"

    def __init__(self, *args: Any, device: str | torch.device | None = None, **kwargs: Any):
        super().__init__(*args, device=device or "cpu", **kwargs)
        # Lightning fills ``parallel_devices`` from ``Trainer(accelerator=..., devices=...)``; the
        # device then comes from there (SingleDeviceStrategy alone would stay on the CPU).
        self.parallel_devices = [torch.device(device)] if device is not None else None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register one strategy name per registered algorithm (``"fedrep"``, ``"fedavg"``, ...)."""
        for name, algorithm in ALGORITHMS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=algorithm.description, algorithm=name)

    @override
    def setup_environment(self) -> None:
        """Called first in a run: refuse several devices or nodes (this strategy runs one process)."""
        devices = len(self.parallel_devices or [])
        module = self.lightning_module
        nodes = internals.requested_num_nodes(module.trainer) if module is not None and module._trainer else 1
        if devices > 1 or nodes > 1:
            name = self.algorithm.name if self.algorithm.name in ALGORITHMS else "fedrep"
            given = f"devices={devices}" if devices > 1 else f"num_nodes={nodes}"
            raise ValueError(
                f"{type(self).__name__} runs on one device, but the Trainer was given {given}. For several "
                f"processes use strategy='{name}_ddp' (lightning_fedrep.FederatedDDPStrategy), or pass devices=1 "
                "and num_nodes=1."
            )
        super().setup_environment()

    @property
    @override
    def root_device(self) -> torch.device:
        """The training device: the Trainer's accelerator device (P15: not SingleDeviceStrategy's CPU)."""
        return self.parallel_devices[0] if self.parallel_devices else self._root_device


FedRepStrategy = FederatedStrategy
"""The :class:`FederatedStrategy` under FedRep's name (its default algorithm is FedRep; any other may be named)."""
