"""The Lightning strategies: a whole federated training inside one ``Trainer.fit``.

One Lightning epoch is one communication round. Every hook here is thin: it says when Lightning calls
it and delegates to the Lightning-free :class:`~lightning_fedrep.federation.run.FederatedRun` (rounds,
callbacks, checkpoint entry) and its runner (:mod:`lightning_fedrep.runners`), to the
:class:`~lightning_fedrep.federation.Federation`, or to the Lightning glue of this folder (data binding:
:mod:`~lightning_fedrep.lightning.loading`; evaluation: :mod:`~lightning_fedrep.lightning.evaluating`).
The public accessors are on :class:`~lightning_fedrep.lightning.api.StrategyAPI`. Lightning behaviour
relied on beyond the documented hooks lives in :mod:`lightning_fedrep.lightning.internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_fedrep.evaluation.passes import FederatedEvaluation
from lightning_fedrep.evaluation.prediction import Prediction
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.checkpoint.entry import (
    CHECKPOINT_KEY,
    read_federated_entry,
    refuse_plain_checkpoint_in_fit,
    round_evaluation_missing,
)
from lightning_fedrep.federation.checkpoint.reading import load_federated_state, read_checkpoint
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.module.split import HeadSpec, check_optimizers_cover_split, resolve_layout
from lightning_fedrep.federation.run import CallbackBus, FederatedRun, refuse_manual_loss_terms
from lightning_fedrep.federation.settings import (
    check_evaluation_settings,
    check_settings,
    federation_config,
    refuse_another_module,
    refuse_several_processes,
    strategy_algorithm,
    takes_settings_of,
)
from lightning_fedrep.lightning import evaluating, internals, loading
from lightning_fedrep.lightning.api import StrategyAPI
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.capture import batch_size_of, capture_logs, logged_per_round
from lightning_fedrep.lightning.checks import check_lr_schedulers, check_trainer_flags
from lightning_fedrep.lightning.constraints import constraints_of
from lightning_fedrep.lightning.progress import FederatedProgressBar
from lightning_fedrep.runners.selection import RunnerSelection
from lightning_fedrep.runners.settings import (
    RunnerChoice,
    RunnerSettings,
    refuse_old_keywords,
    runner_settings,
)


class FederatedStrategyMixin(StrategyAPI):
    """The federated hooks shared by :class:`FederatedStrategy` (one device) and
    :class:`~lightning_fedrep.FederatedDDPStrategy` (several processes): put before a
    Lightning strategy class in the bases.

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
        **kwargs: Any,
    ):
        refuse_old_keywords(kwargs)
        super().__init__(**kwargs)
        check_settings(
            head, head_epochs, body_epochs, local_epochs, allow_frozen, headline_metrics, seed, predict
        )
        check_evaluation_settings(allow_new_federation, first_state, evaluate_clients, buffers)
        self.runner: RunnerSettings = runner_settings(runner)
        """The runner setting (a choice's name becomes its :class:`~lightning_fedrep.runners.settings.RunnerSettings`)."""
        self.algorithm: Algorithm = strategy_algorithm(algorithm)
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
        self._selection = RunnerSelection(self.runner)
        self._callbacks: list[FederatedCallback] = []
        self._evaluation = FederatedEvaluation(capture_logs, batch_size_of)
        self._prediction = Prediction()
        self._binding = loading.data_binding(self)
        self._pending: dict[str, Any] | None = None
        self._restored = False
        self._checkpoint_path: Any = None

    # ------------------------------------------------------------------ set-up
    @override
    def connect(self, model: L.LightningModule) -> None:
        """Called first in every ``fit``/``validate``/``test``: resolve the body/head split."""
        super().connect(model)
        self._restored = False
        self._binding = loading.data_binding(self)
        internals.replace_default_progress_bar(model.trainer, FederatedProgressBar)
        if any(True for _ in model.parameters()):  # else the module builds its layers in configure_model
            self._resolve_layout(model)

    def _resolve_layout(self, model: torch.nn.Module) -> None:
        needs_head = self.algorithm.needs_split or any(p.train != "all" for p in self.config.phases)
        layout = resolve_layout(
            model,
            self.head,
            shares=self.algorithm.shares,
            needs_head=needs_head,
            buffers=self.buffers,
            allow_frozen=self.allow_frozen,
        )
        if self.federation is None or self.federation.layout != layout:
            self.federation = Federation(self.algorithm, layout, self.config)
            zero = lambda: torch.zeros((), device=self.root_device, requires_grad=True)  # noqa: E731
            self._run = FederatedRun(self.federation, None, CallbackBus(), zero)
            self._selection.install(self._run, self.algorithm, self.collective)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Called after the module's ``setup`` (and a checkpoint's model state): check the Trainer's
        settings (fit), create the optimizers, snapshot the global and initial local state, then choose
        the runner (fit: ``lightning_fedrep.runners.selection``, which says why in one line)."""
        fit = trainer.state.fn == "fit"
        if trainer.training or fit:
            check_trainer_flags(trainer)
        if self.federation is None:
            self._resolve_layout(self.lightning_module)
        refuse_another_module(
            self.federation, self.lightning_module, self._restored, str(trainer.state.fn.value)
        )
        super().setup(trainer)
        module, federation = self.lightning_module, self.federation
        if fit:
            check_optimizers_cover_split(self.optimizers, module, federation.split)
            check_lr_schedulers(self.lr_scheduler_configs, module.automatic_optimization)
        federation.attach(module, self.optimizers)
        self._evaluation.take_state(federation, self.root_device, fit, self._restored)
        self.algorithm.setup(module, federation.split, trainer.datamodule)
        self._evaluation.adaptation = evaluating.setup(self, trainer)
        federation.collective = self.collective
        self._callbacks = [c for c in trainer.callbacks if isinstance(c, FederatedCallback)]
        self._run.bus = CallbackBus(self._callbacks, trainer, module)
        federation.timing = any(c.needs_client_timing for c in self._callbacks)
        refuse_manual_loss_terms(fit and not module.automatic_optimization, self.algorithm, self._run.bus)
        constraints = constraints_of(trainer, module, self.optimizers)
        loading.say(
            self._selection.setup(self._run, constraints, module, self.algorithm, self.collective, fit)
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Called for each data iterable Lightning loads: bind the training ``RoundLoader`` to the run's
        schedule (the first one decides the runner's details); keep, shard and chunk the evaluation loader."""
        return loading.bind_loader(self, dataloader)

    # ------------------------------------------------------------------ rounds
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called right before each training step (after callbacks' and the module's hook): open the
        round on its first step, switch client(s) and phase."""
        trainer = self.lightning_module.trainer
        round_index = trainer.current_epoch
        loops = lambda: internals.loops_state_at_round_start(trainer, round_index)  # noqa: E731
        self._run.training_step_starts(round_index, batch_idx, loops)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each training batch (inside the optimizer closure in automatic optimization): the runner's
        loss (the user's step, its default-timed logs once per round, plus the loss terms; on the lockstep runner
        the active clients' losses, summed; ``train/loss`` once per round). Under manual optimization, the round
        closes after its last step. A step that trains nothing returns a zero that needs grad (manual: ``None``)."""
        module = self.lightning_module
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        step = lambda: super(FederatedStrategyMixin, self).training_step(*args, **kwargs)  # noqa: E731
        round_ends = lambda: internals.round_ends_now(module.trainer)  # noqa: E731
        log = lambda mean, samples: _log_round_loss(module, mean, samples, self.collective.distributed)  # noqa: E731
        user_step = lambda: _user_training_step(module, step)  # noqa: E731
        return self._run.loss(batch, batch_idx, user_step, module.automatic_optimization, round_ends, log)

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Called for each optimizer step: the runner's step (the user's optimizer; on the lockstep runner
        the closure, then every client's optimizer; on an idle step the closure alone). Under automatic
        optimization the round closes after its last step."""
        module = self.lightning_module
        step = lambda run=closure: super(FederatedStrategyMixin, self).optimizer_step(  # noqa: E731
            optimizer, run, model, **kwargs
        )
        round_ends = lambda: internals.round_ends_now(module.trainer)  # noqa: E731
        return self._run.optimizer_step(step, closure, module.automatic_optimization, round_ends)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called when the run stops on an exception: roll the open round back, so the federation holds
        what it held before the round (no client half-updated over an unaggregated body)."""
        _roll_back(self._run)
        super().on_exception(exception)

    @override
    def on_train_end(self) -> None:
        """Called when training ends: close a round cut short (``max_steps``, a stop request)."""
        loading.warn(self._run.end_training())
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation
    @override
    def on_validation_start(self) -> None:
        """Called before each validation pass (also mid-round): evaluate the global shared part."""
        evaluating.begin(self, "val")
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        """Called after each validation pass: keep its per-client metrics, restore training's state."""
        stage = "sanity" if self.lightning_module.trainer.sanity_checking else "val"
        self.headline_metrics = self._evaluation.end(stage, self.federation, self.headline_metrics)
        super().on_validation_end()

    @override
    def on_test_start(self) -> None:
        """Called before testing: evaluate the global shared part with each client's own part."""
        evaluating.begin(self, "test")
        super().on_test_start()

    @override
    def on_test_end(self) -> None:
        """Called after testing: keep its per-client metrics."""
        self.headline_metrics = self._evaluation.end("test", self.federation, self.headline_metrics)
        super().on_test_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each validation batch: run it on the batch's client's personalized model."""
        return evaluating.step(self, super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each test batch: run it on the batch's client's personalized model."""
        return evaluating.step(self, super().test_step, args, kwargs)

    @override
    def on_predict_start(self) -> None:
        """Called before predicting (after the data is loaded): decide whose model predicts (``predict``),
        say it in a log line, and load the model a new client gets (global shared part, initial local part)."""
        evaluating.begin_prediction(self)
        super().on_predict_start()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each predicted batch: with ``predict="personalized"`` and a federated data module, on
        the batch's client's own model."""
        return evaluating.predict(self, super().predict_step, args, kwargs)

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
        if (
            interrupted
            and self._run is not None
            and self._run.round_start_loops is not None
            and _roll_back(self._run)
        ):
            checkpoint["loops"] = self._run.round_start_loops
        elif trainer is not None and "loops" in checkpoint and _round_validation_owed(trainer, self._run):
            checkpoint["loops"] = internals.loops_state_before_round_validation(checkpoint["loops"])
            validation_owed = True
        if self.federation is not None and self.federation.has_state:
            checkpoint[CHECKPOINT_KEY] = self._run.checkpoint_entry(
                self.collective, self.optimizers, interrupted, validation_owed
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

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
        module = self.lightning_module
        if self.federation is None:
            self._resolve_layout(module)
        if self._pending is not None:
            load_federated_state(self.federation, self._pending, module, module.device, self._checkpoint_path)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Called in fit only, after ``setup``: restore the RNG, the runner and an interrupted round."""
        super().load_optimizer_state_dict(checkpoint)
        state, self._pending = self._pending, None
        if state is None:
            return
        self._selection.checkpoint(self._run, state, self.algorithm, self.collective)
        state = self._run.restore(state, self.collective, self.optimizers)
        if not self.federation.round_open and not state.get("validation_owed"):
            internals.start_next_round_after_restore(
                self.lightning_module.trainer
            )  # else its validation first


takes_federated_settings = takes_settings_of(FederatedStrategyMixin.__init__)
"""Give a federated strategy's ``__init__(self, *args, <its own keyword settings>, **kwargs)`` the federated
settings of :class:`FederatedStrategyMixin` in its signature; applied once, where the class is defined."""


def _user_training_step(module: L.LightningModule, step: Callable[[], Any]) -> Any:
    """The user's ``training_step`` (``step``), its default-timed logs logged once per round."""
    with logged_per_round(module):
        return step()


def _log_round_loss(module: L.LightningModule, mean: float, samples: int, distributed: bool) -> None:
    """Log the round's training loss where the runner computed it (the lockstep engine, a step rule) as
    ``train/loss``, at the round's last step, as the user's default-timed logs are: once per round, in every
    logger (``samples``: what Lightning weighs it by; every process logs the same total, synchronized)."""
    module.log("train/loss", mean, on_step=False, on_epoch=True, batch_size=samples, sync_dist=distributed)


def _roll_back(run: FederatedRun | None) -> bool:
    """Roll the open round back (warning that it did); whether a round was open."""
    note = run.roll_back() if run is not None else None
    loading.warn(note)
    return note is not None


def _round_validation_owed(trainer: L.Trainer, run: FederatedRun | None) -> bool:
    """Whether a checkpoint written now falls between the end of a round and the end of its validation
    (written at its last step, or during validation): resuming from it must run that validation again,
    or the round's evaluation would be missing from the history."""
    in_fit = trainer.state.fn == "fit" and not trainer.sanity_checking
    federation = run.federation if run is not None else None
    validated = run.validated_round if run is not None else -1
    missing = in_fit and round_evaluation_missing(federation, validated)
    return missing and internals.round_validation_due(trainer)


class FederatedStrategy(FederatedStrategyMixin, SingleDeviceStrategy):
    """Personalized federated learning (FedRep and its family) on one device: a whole federated training
    inside one ``Trainer.fit``, one Lightning epoch per communication round.

    Takes every federated setting of :class:`~lightning_fedrep.lightning.strategy.FederatedStrategyMixin` (``head``, ``algorithm``,
    ``clients_per_round``, ``head_epochs``, ``body_epochs``, ``local_epochs``, ``phases``, ``weighting``,
    ``client_optimizer_state``, ``first_state``, ``evaluate_clients``, ``buffers``, ``allow_frozen``, ``seed``, ``headline_metrics``,
    ``on_nonfinite``, ``on_client_error``, ``allow_new_federation``, ``runner``, ``predict``), and:

    Args:
        device: the device to train on; by default the one the Trainer's accelerator picks.

    For several processes (GPUs, nodes) use :class:`~lightning_fedrep.FederatedDDPStrategy`
    (``strategy="fedrep_ddp"``, ...).
    """

    strategy_name = "federated"

    @takes_federated_settings
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
        refuse_several_processes(type(self).__name__, self.algorithm.name, devices, nodes)
        super().setup_environment()

    @property
    @override
    def root_device(self) -> torch.device:
        """The training device: the Trainer's accelerator device (P15: not SingleDeviceStrategy's CPU)."""
        return self.parallel_devices[0] if self.parallel_devices else self._root_device


FedRepStrategy = FederatedStrategy
"""The :class:`FederatedStrategy` under FedRep's name (its default algorithm is FedRep; any other may be named)."""
