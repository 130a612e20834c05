"""The Lightning side of personalized evaluation (validation, test) and prediction: what needs the Trainer
(its state and counters, ``module.log``, rank-zero messages) around the Lightning-free owners,
:class:`~lightning_fedrep.evaluation.passes.FederatedEvaluation` and
:class:`~lightning_fedrep.evaluation.prediction.Prediction`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fedrep.data.module import why_batches_vary
from lightning_fedrep.evaluation.adaptation import EvaluationAdaptation
from lightning_fedrep.evaluation.finetuning import ClientFineTuning, FineTuningContext
from lightning_fedrep.evaluation.passes import module_alone_note
from lightning_fedrep.evaluation.prediction import reads_clients
from lightning_fedrep.lightning import internals, loading
from lightning_fedrep.lightning.monitoring import warn_selection_on_test_data


def setup(strategy: Any, trainer: Any) -> EvaluationAdaptation | None:
    """At the strategy's ``setup``, after the federation took its state: the warning of an evaluation of the
    module's own weights alone, and the adaptation the algorithm's ``EvaluationSpec.adapt`` asks for, its module
    and data checked now (``None`` without one). A ``FineTunedEvaluation`` is refused with an algorithm's own
    ``EvaluationSpec.forward`` (its heads would be fine-tuned for the module's forward). A fit whose callbacks
    select rounds on validation metrics computed on test data warns."""
    federation, algorithm, module = strategy.federation, strategy.algorithm, strategy.lightning_module
    if strategy._evaluation.module_alone:
        call, reads = str(trainer.state.fn.value), reads_clients(strategy.predict)
        loading.warn(module_alone_note(federation, algorithm, type(module).__name__, call, reads))
    if trainer.state.fn == "fit":
        warn_selection_on_test_data(trainer)
    spec = federation.evaluation_spec
    if spec.forward is not None and any(isinstance(c, ClientFineTuning) for c in trainer.callbacks):
        raise ValueError(
            f"FineTunedEvaluation fine-tunes each client's head through the module's own forward, but algorithm "
            f"{algorithm.name!r} scores its clients with its own prediction function "
            f"(EvaluationSpec.forward={spec.forward!r}), so the fine-tuned heads would not be what it scores: "
            "remove the FineTunedEvaluation callback."
        )
    if spec.adapt is None:
        return None
    adaptation = EvaluationAdaptation(algorithm.name, spec.adapt, spec.adapt_lr, finetuning_context)
    adaptation.setup(finetuning_context(trainer, module))
    return adaptation


def finetuning_context(trainer: Any, module: Any) -> FineTuningContext:
    """What fine-tuning clients before an evaluation (``FineTunedEvaluation``, the adaptation) reads of a run."""
    strategy, plugin, data = trainer.strategy, trainer.precision_plugin, trainer.datamodule
    return FineTuningContext(
        module=module,
        federation=strategy.require_federation(),
        data=data,
        evaluated_clients=strategy.evaluated_clients,
        device=module.device,
        optimizers=lambda: list(trainer.optimizers) or internals.configured_optimizers(module),
        feature_split=strategy.feature_split,
        fit_heads_together=strategy.fit_heads_together,
        why_batches_vary=lambda clients: why_batches_vary(data, clients),
        convert_input=plugin.convert_input,
        step_context=plugin.train_step_context,
        smoke=bool(trainer.fast_dev_run),
        info=rank_zero_info,
    )


def begin(strategy: Any, stage: str) -> None:
    """Before a pass: the federation evaluates the global shared part with each client's own part (adapted
    first where the algorithm's evaluation asks for it; never in the sanity check)."""
    module = strategy.lightning_module
    adapt_on = None if module.trainer.sanity_checking else (module.trainer, module)
    strategy._evaluation.begin(stage, strategy.require_federation(), strategy.headline_metrics, adapt_on)


def step(strategy: Any, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One evaluation batch, on its client's personalized model (or a chunk of clients, or nothing on an idle
    step); logs the pass's summaries after its last batch."""
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
    evaluation, module, plugin = strategy._evaluation, strategy.lightning_module, strategy.precision_plugin
    context = plugin.val_step_context if evaluation.current.stage == "val" else plugin.test_step_context
    run_step = lambda: user_step(*args, **kwargs)  # noqa: E731
    output = evaluation.step(batch, batch_idx, module, strategy.federation, run_step, context)
    if internals.evaluation_ends_now(module.trainer):
        log(strategy, module.trainer)
    return output


def log(strategy: Any, trainer: Any) -> None:
    """Log every metric's summary over clients; keep the federated rounds' history (validation)."""
    evaluation, federation, collective = strategy._evaluation, strategy.federation, strategy.collective
    stage, sanity = evaluation.current.stage, trainer.sanity_checking
    in_fit = stage == "val" and trainer.state.fn == "fit" and not sanity
    cut = None if sanity else _cut(trainer, stage)
    values = evaluation.finish(federation, collective, strategy.round_plan, in_fit, cut, rank_zero_warn)
    if in_fit:
        strategy._run.validated_round = federation.round_index
    for key, (value, options) in values.items():
        # the same value on every process: synced only to spare Lightning's warning
        sync = collective.distributed
        strategy.lightning_module.log(
            key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync, **options
        )


def _cut(trainer: Any, stage: str) -> tuple[int | None, str]:
    """The batches Lightning ran of a pass and what may have cut it short (``limit_val_batches``,
    ``fast_dev_run``), read off the Trainer."""
    limit = "limit_val_batches" if stage == "val" else "limit_test_batches"
    batches = trainer.num_val_batches if stage == "val" else trainer.num_test_batches
    cause = "fast_dev_run" if trainer.fast_dev_run else f"{limit}={getattr(trainer, limit)}"
    return (batches[0] if batches else None), cause


def begin_prediction(strategy: Any) -> None:
    """Decide whose model predicts (``predict``), say it in a log line, and load the model a new client
    gets (global shared part, initial local part)."""
    strategy._prediction.begin(
        strategy.predict,
        strategy.federation,
        strategy.algorithm.name,
        strategy.config.first_state,
        strategy._evaluation.module_alone,
        rank_zero_info,
        rank_zero_warn,
    )


def predict(strategy: Any, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One predicted batch: on its client's model (``predict="personalized"``) or a new client's, with the
    algorithm's ``EvaluationSpec.forward`` in place of the module's where it has one."""
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    module, run_step = strategy.lightning_module, lambda: user_step(*args, **kwargs)
    return strategy._prediction.step(batch_idx, module, strategy.federation, run_step)
