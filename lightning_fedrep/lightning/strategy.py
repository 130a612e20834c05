"""The Lightning strategies: a whole federated training inside one ``Trainer.fit``.

One Lightning epoch is one communication round. Every hook here is thin: it says when Lightning calls
it, reads what it needs of the Trainer and hands it to the Lightning-free
:class:`~lightning_fedrep.session.session.FederatedSession` (the settings, the public accessors, the data
binding, the checkpoint entry), to :class:`~lightning_fedrep.federation.run.FederatedRun` (rounds, callbacks)
and its runner (:mod:`lightning_fedrep.runners`), or to the Lightning glue of this folder. Lightning behaviour
relied on beyond the documented hooks lives in :mod:`lightning_fedrep.lightning.internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.checkpoint.reading import read_checkpoint
from lightning_fedrep.federation.module.split import check_optimizers_cover_split
from lightning_fedrep.federation.settings import check_lr_schedulers, refuse_several_processes
from lightning_fedrep.lightning import evaluating, internals, loading
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.capture import batch_size_of, capture_logs, logged_per_round
from lightning_fedrep.lightning.checks import check_trainer_flags
from lightning_fedrep.lightning.constraints import constraints_of
from lightning_fedrep.lightning.progress import FederatedProgressBar
from lightning_fedrep.session.session import FederatedSession, takes_federated_settings


class FederatedStrategyMixin(FederatedSession):
    """The federated hooks shared by :class:`FederatedStrategy` (one device) and
    :class:`~lightning_fedrep.FederatedDDPStrategy` (several processes): put before a Lightning strategy class
    in the bases. The settings, the accessors and what the hooks do with the federation are the
    :class:`~lightning_fedrep.session.session.FederatedSession`'s; each hook here reads the Trainer and calls it."""

    _warn, _info = staticmethod(rank_zero_warn), staticmethod(rank_zero_info)
    _capture, _batch_size = staticmethod(capture_logs), staticmethod(batch_size_of)

    def _live_module(self) -> L.LightningModule | None:
        return self.lightning_module

    def _round_now(self) -> int:
        return self.lightning_module.trainer.current_epoch

    def _device(self) -> torch.device:
        return self.root_device

    _registered_as = ("{}", "{}")
    """How :meth:`register_strategies` names an algorithm's strategy and describes it (from the algorithm's)."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register one strategy name per registered algorithm (``"fedrep"``, ``"fedavg"``, ...; on several
        processes ``"fedrep_ddp"``, ...)."""
        for name, algorithm in ALGORITHMS.items():
            key, description = (
                cls._registered_as[0].format(name),
                cls._registered_as[1].format(algorithm.description),
            )
            if key not in strategy_registry:
                strategy_registry.register(key, cls, description=description, algorithm=name)

    # ------------------------------------------------------------------ set-up
    @override
    def connect(self, model: L.LightningModule) -> None:
        """Called first in every ``fit``/``validate``/``test``: resolve the body/head split."""
        super().connect(model)
        self._restored = False
        self._binding = self._new_binding()
        internals.replace_default_progress_bar(model.trainer, FederatedProgressBar)
        if any(True for _ in model.parameters()):  # else the module builds its layers in configure_model
            self._resolve_layout(model)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Called after the module's ``setup`` (and a checkpoint's model state): check the Trainer's
        settings (fit), create the optimizers, snapshot the global and initial local state, then choose
        the runner (fit: ``lightning_fedrep.runners.selection``, which says why in one line)."""
        fit = trainer.state.fn == "fit"
        if trainer.training or fit:
            check_trainer_flags(trainer)
        self._take_module(str(trainer.state.fn.value))
        super().setup(trainer)
        module = self.lightning_module
        if fit:
            check_optimizers_cover_split(self.optimizers, module, self.federation.split)
            check_lr_schedulers(self.lr_scheduler_configs, module.automatic_optimization)
        self._attach(module, self.optimizers, fit, trainer.datamodule)
        self._evaluation.adaptation = evaluating.setup(self, trainer)
        callbacks = [c for c in trainer.callbacks if isinstance(c, FederatedCallback)]
        constraints = constraints_of(trainer, module, self.optimizers)
        self._start_call(callbacks, trainer, constraints, fit, not module.automatic_optimization)
        distributed = self.collective.distributed
        self._run.log_columns = lambda columns: _log_round_columns(module, columns, distributed)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Called for each data iterable Lightning loads: bind the training ``RoundLoader`` to the run's
        schedule (the first one decides the runner's details); keep, shard and chunk the evaluation loader."""
        trainer, headline = self.lightning_module.trainer, self.headline_metrics
        probe = lambda: loading.model_probe(trainer, self.lightning_module, self.root_device, headline)  # noqa: E731
        predicting, smoke = trainer.state.fn == "predict", bool(trainer.fast_dev_run)
        return self._bind_loader(dataloader, predicting, probe, trainer.datamodule, smoke)

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
        self._roll_back()
        super().on_exception(exception)

    @override
    def on_train_end(self) -> None:
        """Called when training ends: close a round cut short (``max_steps``, a stop request)."""
        self._note(self._run.end_training())
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation
    @override
    def on_validation_start(self) -> None:
        """Called before each validation pass (also mid-round): evaluate the global shared part."""
        self._begin_pass("val")
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
        self._begin_pass("test")
        super().on_test_start()

    @override
    def on_test_end(self) -> None:
        """Called after testing: keep its per-client metrics."""
        self.headline_metrics = self._evaluation.end("test", self.federation, self.headline_metrics)
        super().on_test_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each validation batch: run it on the batch's client's personalized model."""
        return self._evaluation_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each test batch: run it on the batch's client's personalized model."""
        return self._evaluation_step(super().test_step, args, kwargs)

    @override
    def on_predict_start(self) -> None:
        """Called before predicting (after the data is loaded): decide whose model predicts (``predict``),
        say it in a log line, and load the model a new client gets (global shared part, initial local part)."""
        self._begin_prediction()
        super().on_predict_start()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Called for each predicted batch: with ``predict="personalized"`` and a federated data module, on
        the batch's client's own model."""
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        run_step = lambda: super(FederatedStrategyMixin, self).predict_step(*args, **kwargs)  # noqa: E731
        return self._prediction.step(batch_idx, self.lightning_module, self.federation, run_step)

    def _begin_pass(self, stage: str) -> None:
        """Before a pass: the federation evaluates the global shared part with each client's own part (adapted
        first where the algorithm's evaluation asks for it; never in the sanity check)."""
        module = self.lightning_module
        adapt_on = None if module.trainer.sanity_checking else (module.trainer, module)
        self._evaluation.begin(stage, self.require_federation(), self.headline_metrics, adapt_on)

    def _evaluation_step(self, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One evaluation batch, on its client's personalized model (or a chunk of clients, or nothing on an idle
        step); logs the pass's summaries over clients after its last batch."""
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
        module, plugin, trainer = self.lightning_module, self.precision_plugin, self.lightning_module.trainer
        stage = self._evaluation.current.stage
        context = plugin.val_step_context if stage == "val" else plugin.test_step_context
        run_step = lambda: user_step(*args, **kwargs)  # noqa: E731
        output = self._evaluation.step(batch, batch_idx, module, self.federation, run_step, context)
        if internals.evaluation_ends_now(trainer):
            in_fit = stage == "val" and trainer.state.fn == "fit" and not trainer.sanity_checking
            cut = None if trainer.sanity_checking else evaluating.pass_cut(trainer, stage)
            for key, (value, options) in self._finish_pass(in_fit, cut).items():
                # the same value on every process: synced only to spare Lightning's warning
                sync = self.collective.distributed
                module.log(key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync, **options)
        return output

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
        in_fit = trainer is not None and trainer.state.fn == "fit" and not trainer.sanity_checking
        due = lambda: internals.round_validation_due(trainer)  # noqa: E731
        before = internals.loops_state_before_round_validation
        self._write_entry(checkpoint, interrupted, in_fit, due, before, self.optimizers)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Called first when restoring from ``ckpt_path``: keep the federation's state for the loads below."""
        load = super().load_checkpoint
        checkpoint = read_checkpoint(
            checkpoint_path, lambda: load(checkpoint_path, weights_only=weights_only)
        )
        module = self.lightning_module
        in_fit = module is not None and module._trainer is not None and module.trainer.state.fn == "fit"
        self._keep_entry(checkpoint, checkpoint_path, in_fit)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Called in every stage, before ``setup``: restore the module, the global state, every client."""
        super().load_model_state_dict(checkpoint, strict=strict)
        self._restore_federation(self.lightning_module, self.lightning_module.device)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Called in fit only, after ``setup``: restore the RNG, the runner and an interrupted round."""
        super().load_optimizer_state_dict(checkpoint)
        if self._restore_run(self.optimizers):
            internals.start_next_round_after_restore(self.lightning_module.trainer)


def _user_training_step(module: L.LightningModule, step: Callable[[], Any]) -> Any:
    """The user's ``training_step`` (``step``), its default-timed logs logged once per round."""
    with logged_per_round(module):
        return step()


def _log_round_loss(module: L.LightningModule, mean: float, samples: int, distributed: bool) -> None:
    """Log the round's training loss where the runner computed it (the vectorized runner, a step rule) as
    ``train/loss``, at the round's last step, as the user's default-timed logs are: once per round, in every
    logger (``samples``: what Lightning weighs it by; every process logs the same total, synchronized)."""
    module.log("train/loss", mean, on_step=False, on_epoch=True, batch_size=samples, sync_dist=distributed)


def _log_round_columns(module: L.LightningModule, columns: Mapping[str, float], distributed: bool) -> None:
    """Log a closed round's server-side columns (the server step's metrics, ``privacy/epsilon``, ``faults``)
    once per round in every logger, as ``train/loss`` is (the same values on every process)."""
    for key, value in columns.items():
        module.log(key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=distributed)


class FederatedStrategy(FederatedStrategyMixin, SingleDeviceStrategy):
    """Personalized federated learning (FedRep and its family) on one device: a whole federated training
    inside one ``Trainer.fit``, one Lightning epoch per communication round.

    Takes the federated settings (:class:`~lightning_fedrep.session.session.FederatedSession`: ``head``,
    ``algorithm``, ...), and:

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
