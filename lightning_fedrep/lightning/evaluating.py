"""The Lightning side of personalized evaluation (validation, test): the adaptation's set-up and the Trainer's
counters of a pass, around the Lightning-free owners (:class:`~lightning_fedrep.evaluation.passes.FederatedEvaluation`,
:class:`~lightning_fedrep.session.session.FederatedSession`)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info

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
        to_device=lambda batch: move_data_to_device(batch, module.device),
        optimizers=lambda: list(trainer.optimizers) or internals.configured_optimizers(module),
        feature_split=strategy.feature_split,
        fit_heads_together=strategy.fit_heads_together,
        why_batches_vary=lambda clients: why_batches_vary(data, clients),
        convert_input=plugin.convert_input,
        step_context=plugin.train_step_context,
        smoke=bool(trainer.fast_dev_run),
        info=rank_zero_info,
    )


def pass_cut(trainer: Any, stage: str) -> tuple[int | None, str]:
    """The batches Lightning ran of a pass and what may have cut it short (``limit_val_batches``,
    ``fast_dev_run``), read off the Trainer."""
    limit = "limit_val_batches" if stage == "val" else "limit_test_batches"
    batches = trainer.num_val_batches if stage == "val" else trainer.num_test_batches
    cause = "fast_dev_run" if trainer.fast_dev_run else f"{limit}={getattr(trainer, limit)}"
    return (batches[0] if batches else None), cause
