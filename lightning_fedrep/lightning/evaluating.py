"""The Lightning side of a personalized evaluation pass (validation, test) and of prediction: the pass's
steps on each batch's client, the logged summaries over clients and the notes, whose content comes from
:mod:`lightning_fedrep.evaluation.metrics` and :mod:`lightning_fedrep.evaluation.records` (Lightning-free)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fedrep.callbacks.evaluation_finetuning import EvaluationAdaptation, FineTunedEvaluation
from lightning_fedrep.data.loaders import ClientChunk
from lightning_fedrep.evaluation.metrics import EvaluationPass
from lightning_fedrep.evaluation.records import gather_pass, non_finite_note, partial_pass_note, pass_values
from lightning_fedrep.federation.sharding import IdleStep
from lightning_fedrep.lightning import internals, loading
from lightning_fedrep.lightning.capture import batch_size_of, capture_logs
from lightning_fedrep.lightning.monitoring import warn_selection_on_test_data

PREDICTION_MODES = {
    "personalized": "personalized predictions, each batch on its client's own model (the global body and the "
    "client's head); strategy.prediction_clients gives each batch's client",
    "new_client": "new-client predictions, every batch on the model a client that never trained gets (the "
    "global body and the initial head), not on the clients' personalized models",
}


def setup(strategy: Any, trainer: Any) -> None:
    """At the strategy's ``setup``: the warning of an evaluation of the module's own weights alone
    (:func:`warn_module_alone`), the adaptation the algorithm's ``EvaluationSpec.adapt`` asks for, its
    module and data checked now (``None`` without one). A ``FineTunedEvaluation`` is refused with an
    algorithm's own ``EvaluationSpec.forward`` (its heads would be fine-tuned for the module's forward). A fit
    whose callbacks select rounds on validation metrics computed on test data warns."""
    if strategy._module_alone:
        warn_module_alone(strategy, str(trainer.state.fn.value))
    if trainer.state.fn == "fit":
        warn_selection_on_test_data(trainer)
    spec = strategy.federation.evaluation_spec
    if spec.forward is not None and any(isinstance(c, FineTunedEvaluation) for c in trainer.callbacks):
        raise ValueError(
            f"FineTunedEvaluation fine-tunes each client's head through the module's own forward, but algorithm "
            f"{strategy.algorithm.name!r} scores its clients with its own prediction function "
            f"(EvaluationSpec.forward={spec.forward!r}), so the fine-tuned heads would not be what it scores: "
            "remove the FineTunedEvaluation callback."
        )
    strategy._adaptation = None
    if spec.adapt is not None:
        adaptation = EvaluationAdaptation(strategy.algorithm.name, spec.adapt, spec.adapt_lr)
        adaptation.setup(trainer, strategy.lightning_module, trainer.state.fn)
        strategy._adaptation = adaptation


def take_federation_state(strategy: Any, fit: bool, module_alone: bool) -> bool:
    """At the strategy's ``setup``: the federation takes its state (the module's weights the first time, else
    what it holds, moved to the device); whether that state is the given module's own weights alone, taken
    by a ``validate``/``test``/``predict`` of a strategy that neither fitted nor restored a checkpoint
    (``ckpt_path``). ``module_alone`` is the last call's answer: a later evaluation by the same strategy
    still holds the module's weights, untrained as a federation."""
    federation = strategy.federation
    alone = not fit and not strategy._restored and (module_alone or not federation.has_state)
    federation.initialize(strategy.root_device)
    return alone


def warn_module_alone(strategy: Any, call: str) -> None:
    """Warn, when the algorithm keeps a part of the model per client, that ``trainer.<call>()`` gives every
    client the module's one copy of that part: what a module restored by ``load_from_checkpoint`` and
    evaluated without ``ckpt_path`` gets (Lightning's ``load_from_checkpoint`` reads the checkpoint's
    ``state_dict`` only, and leaves nothing on the module that says which file it came from)."""
    federation, algorithm = strategy.federation, strategy.algorithm
    personal = [*federation.local_names, *(t.name for t in algorithm.client_tensors)]
    if not personal or (call == "predict" and not loading.predictions_read_clients(strategy)):
        return  # predict="new_client" asks for the global part with the initial one: what the module holds
    module = type(strategy.lightning_module).__name__
    scores, score = PASS_VERBS.get(call, PASS_VERBS["test"])
    rank_zero_warn(
        f"trainer.{call}() {scores} the given module's own weights: this strategy holds no federated state (no "
        f"fit, no ckpt_path), so every client gets the module's one {_some(personal)}, which algorithm "
        f"{algorithm.name!r} keeps per client. A module from {module}.load_from_checkpoint(path) does not hold "
        "the clients' own: they are in the checkpoint's 'lightning_fedrep' entry, which load_from_checkpoint "
        "does not read (its state_dict holds the initial, untrained ones). Pass ckpt_path=path "
        f"(trainer.{call}(model, ckpt_path=path), also with a new Trainer) to {score} every client's own model."
    )


PASS_VERBS = {
    "validate": ("scores every client with", "score"),
    "test": ("scores every client with", "score"),
    "predict": ("predicts with", "predict with"),
}
"""What a pass does with a model, for :func:`warn_module_alone`: ``(sentence verb, infinitive)`` by call."""


def _some(names: list[str], shown: int = 4) -> str:
    """``names`` for a message: the first ``shown`` of them, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(name) for name in names[:shown]) + more


def begin(strategy: Any, stage: str) -> None:
    """Before a pass: the federation evaluates the global shared part with each client's own part (adapted
    first where the algorithm's evaluation asks for it; never in the sanity check)."""
    federation = strategy.require_federation()
    federation.begin_evaluation()
    adaptation, module = getattr(strategy, "_adaptation", None), strategy.lightning_module
    if adaptation is not None and not module.trainer.sanity_checking:
        adaptation.adapt(module.trainer, module)
    strategy._evaluation = EvaluationPass(
        stage, capture_logs, batch_size_of, headline=strategy.headline_metrics
    )


def end(strategy: Any, stage: str) -> None:
    """After a pass: keep its per-client metrics, restore training's state."""
    evaluation, strategy._evaluation = strategy._evaluation, None
    if evaluation is not None:
        strategy.headline_metrics = evaluation.headline
        if evaluation.metrics.samples:
            strategy.client_metrics["sanity" if stage == "sanity" else evaluation.key] = (
                evaluation.named_metrics()
            )
    strategy.federation.end_evaluation()


def step(strategy: Any, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One evaluation batch: on its client's personalized model (a batched chunk of clients, or nothing on
    an idle step); logs the pass's summaries after its last batch."""
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
    evaluation, module = strategy._evaluation, strategy.lightning_module
    plugin = strategy.precision_plugin
    context = plugin.val_step_context if evaluation.stage == "val" else plugin.test_step_context
    output = None
    if isinstance(batch, ClientChunk):
        strategy._batched_evaluation.add(
            batch, module, strategy.federation, evaluation.metrics, evaluation.stage, context
        )
    elif not isinstance(batch, IdleStep):  # an idle step: this process has evaluated all its clients
        client = strategy._eval_loader.client_of(batch_idx)
        strategy.federation.evaluate_client(client)
        with strategy.federation.scoring(module, client):  # the algorithm's forward, if it has one
            output = evaluation.step(module, lambda: user_step(*args, **kwargs), batch, client, context)
    if internals.evaluation_ends_now(module.trainer):
        log(strategy, evaluation)
    return output


def log(strategy: Any, evaluation: EvaluationPass) -> None:
    """Log every metric's summary over clients; keep the federated rounds' history (validation)."""
    module, federation, collective = strategy.lightning_module, strategy.federation, strategy.collective
    trainer = module.trainer
    if collective.distributed:
        gather_pass(evaluation, collective.all_gather_object)
    prefix = ""
    if evaluation.stage == "val" and federation.round_index >= 0 and federation.client_sizes is not None:
        prefix = strategy.round_plan(federation.round_index).prefix
    evaluation.name_under(prefix)  # a fine-tuning round's per-client values: client_metrics["finetune/val"]
    if evaluation.metrics.samples:  # complete now: callbacks' on_*_end hooks run before the strategy's
        strategy.client_metrics["sanity" if trainer.sanity_checking else evaluation.key] = (
            evaluation.named_metrics()
        )
    notes = [non_finite_note(evaluation), evaluation.nothing_logged_note()]
    if not trainer.sanity_checking:
        notes.insert(0, _partial_pass_note(strategy, evaluation))
    for note in notes:
        loading.warn(note)
    in_fit = evaluation.stage == "val" and trainer.state.fn == "fit" and not trainer.sanity_checking
    if in_fit:
        strategy._run.validated_round = federation.round_index
    values = pass_values(evaluation, federation.history, federation.round_index, prefix, in_fit)
    for key, value in values.items():
        options = evaluation.logging_options(key.removeprefix(prefix))
        # the same value on every process: synced only to spare Lightning's warning
        sync = collective.distributed
        module.log(key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync, **options)


def _partial_pass_note(strategy: Any, evaluation: EvaluationPass) -> str | None:
    """What a pass cut short (``limit_val_batches``, ``fast_dev_run``) evaluated, read off the Trainer."""
    loader, trainer = strategy._eval_loader, strategy.lightning_module.trainer
    if loader is None:
        return None
    limit = "limit_val_batches" if evaluation.stage == "val" else "limit_test_batches"
    batches = trainer.num_val_batches if evaluation.stage == "val" else trainer.num_test_batches
    cause = "fast_dev_run" if trainer.fast_dev_run else f"{limit}={getattr(trainer, limit)}"
    sizes = [len(data) for data in loader.clients]
    return partial_pass_note(evaluation, sizes, batches[0] if batches else None, len(loader), cause)


def begin_prediction(strategy: Any) -> None:
    """Decide whose model predicts (``predict``), say it in a log line, and load the model a new client
    gets (global shared part, initial local part)."""
    federated = strategy._predict_loader is not None
    mode = ("personalized" if federated else "new_client") if strategy.predict == "auto" else strategy.predict
    if mode == "personalized" and not federated:
        raise ValueError(
            "predict='personalized' predicts each batch with its client's own model, but these batches carry "
            "no client (they do not come from a FederatedDataModule). Predict with datamodule=<the federated "
            "data module> (each client's test samples), use strategy.client_model(i) for client i's model, or "
            "pass predict='new_client' (or 'auto')."
        )
    strategy.prediction_mode = mode
    rank_zero_info(f"trainer.predict (predict={strategy.predict!r}): {PREDICTION_MODES[mode]}.")
    if strategy.predict == "auto" and not strategy._module_alone:  # else setup warned
        loading.warn(untrained_new_client_note(strategy, mode))
    if strategy.federation is not None and strategy.federation.has_state:
        strategy.federation.load_personalized(-1)
    strategy.prediction_clients = []
    strategy._predicting_client = -1


def untrained_new_client_note(strategy: Any, mode: str) -> str | None:
    """What ``predict="auto"`` falling back to the new-client model means when that model's local part is
    the initial, untrained one (``first_state="initial"``) of an algorithm that keeps a part per client (under
    FedRep the global body with an untrained head: no client's model); ``None`` otherwise, and for an
    explicit ``predict="new_client"`` (a choice, said in the log line)."""
    federation = strategy.federation
    local = list(federation.local_names) if federation is not None else []
    if mode != "new_client" or not local or strategy.config.first_state != "initial":
        return None
    return (
        "trainer.predict on batches that carry no client (not a FederatedDataModule's) predicts with the model "
        f"a client that never trained gets: the global part with the initial, untrained {_some(local)}, which "
        f"algorithm {strategy.algorithm.name!r} trains per client, so no client's model makes these "
        "predictions. Predict with datamodule=<the federated data module> for each client's own model, or with "
        "strategy.client_model(i) for client i's; pass predict='new_client' to choose this model (a log line "
        "then says so, without this warning)."
    )


def prediction_client(strategy: Any, args: tuple, kwargs: dict) -> None:
    """Before a predicted batch: with ``predict="personalized"`` load its client's own model."""
    loader = strategy._predict_loader
    if loader is None:
        return
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    client = loader.client_of(batch_idx)
    strategy.prediction_clients.append(client)
    if strategy.prediction_mode == "personalized" and client != strategy._predicting_client:
        strategy.require_federation().load_personalized(client)
        strategy._predicting_client = client


def predict(strategy: Any, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One predicted batch: on its client's model (``predict="personalized"``) or a new client's, with the
    algorithm's ``EvaluationSpec.forward`` in place of the module's where it has one."""
    prediction_client(strategy, args, kwargs)
    federation = strategy.federation
    if federation is None or not federation.has_state:
        return user_step(*args, **kwargs)
    client = strategy._predicting_client if strategy.prediction_mode == "personalized" else -1
    with federation.scoring(strategy.lightning_module, client):
        return user_step(*args, **kwargs)
