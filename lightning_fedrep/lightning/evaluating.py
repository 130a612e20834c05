"""The Lightning side of personalized evaluation (validation, test): the adaptation's set-up and the Trainer's
counters of a pass, around the Lightning-free owners (:class:`~lightning_fedrep.evaluation.passes.FederatedEvaluation`,
:class:`~lightning_fedrep.session.session.FederatedSession`)."""

from __future__ import annotations

from typing import Any

from lightning_fedrep.callbacks.evaluation_finetuning import EvaluationAdaptation, FineTunedEvaluation
from lightning_fedrep.evaluation.passes import module_alone_note
from lightning_fedrep.evaluation.prediction import reads_clients
from lightning_fedrep.lightning import loading
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
    if spec.forward is not None and any(isinstance(c, FineTunedEvaluation) for c in trainer.callbacks):
        raise ValueError(
            f"FineTunedEvaluation fine-tunes each client's head through the module's own forward, but algorithm "
            f"{algorithm.name!r} scores its clients with its own prediction function "
            f"(EvaluationSpec.forward={spec.forward!r}), so the fine-tuned heads would not be what it scores: "
            "remove the FineTunedEvaluation callback."
        )
    if spec.adapt is None:
        return None
    adaptation = EvaluationAdaptation(algorithm.name, spec.adapt, spec.adapt_lr)
    adaptation.setup(trainer, module, trainer.state.fn)
    return adaptation


def pass_cut(trainer: Any, stage: str) -> tuple[int | None, str]:
    """The batches Lightning ran of a pass and what may have cut it short (``limit_val_batches``,
    ``fast_dev_run``), read off the Trainer."""
    limit = "limit_val_batches" if stage == "val" else "limit_test_batches"
    batches = trainer.num_val_batches if stage == "val" else trainer.num_test_batches
    cause = "fast_dev_run" if trainer.fast_dev_run else f"{limit}={getattr(trainer, limit)}"
    return (batches[0] if batches else None), cause
