"""The Lightning side of binding the data (the strategy's ``process_dataloader``): the Trainer's facts handed
to the Lightning-free owners, :class:`~lightning_fedrep.data.binding.DataBinding` (label and same-federation
checks, the evaluated clients), the evaluation and prediction objects (the loaders they serve) and the runner
selection (the round loader bound to the run's schedule, the batched evaluation)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fedrep.data.binding import DataBinding, ModelProbe
from lightning_fedrep.data.loaders import EvalLoader, RoundLoader
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.evaluation.prediction import reads_clients
from lightning_fedrep.federation import clients_fingerprint
from lightning_fedrep.federation.plan import refuse_empty_plan
from lightning_fedrep.runners.batched_evaluation import serve_evaluation


def data_binding(strategy: Any) -> DataBinding:
    """A new call's data checks, with the strategy's settings (``allow_new_federation``, ``evaluate_clients``)."""
    return DataBinding(
        strategy.allow_new_federation, strategy.evaluate_clients, rank_zero_warn, rank_zero_info
    )


def bind_loader(strategy: Any, dataloader: object) -> object:
    """What ``process_dataloader`` returns for ``dataloader`` (refusing data not from a federated module)."""
    trainer = strategy.lightning_module.trainer
    if trainer.state.fn == "predict":
        strategy._prediction.serve(None)
        if isinstance(dataloader, EvalLoader):
            fingerprint = lambda: training_clients(trainer.datamodule)  # noqa: E731
            reads = reads_clients(strategy.predict)
            strategy._binding.bind_prediction(dataloader, strategy.federation, reads, fingerprint)
            strategy._prediction.serve(dataloader)
        return dataloader
    if isinstance(dataloader, RoundLoader):
        return bind_training_loader(strategy, dataloader)
    if isinstance(dataloader, EvalLoader):
        return bind_evaluation_loader(strategy, dataloader)
    raise TypeError(
        f"{type(strategy).__name__} needs the data of a FederatedDataModule (a RoundLoader for training and an "
        f"EvalLoader for evaluation), got {type(dataloader).__name__}. Build the data with "
        "lightning_fedrep.FederatedDataModule(train_set, test_set, partitioner=...) and pass it as datamodule=."
    )


def bind_training_loader(strategy: Any, dataloader: RoundLoader) -> RoundLoader:
    """Bind the round loader to the run's schedule; the first one decides the runner's details."""
    federation = strategy.require_federation()
    strategy._binding.bind_training(dataloader, federation, model_probe(strategy))
    trainer, run = strategy.lightning_module.trainer, strategy._run
    plan = run.plan(trainer.current_epoch)
    refuse_empty_plan(plan)  # before the engine's probe
    smoke, device = bool(trainer.fast_dev_run), strategy.root_device
    say(
        strategy._selection.first_loader(
            run, dataloader, plan, device, smoke, strategy.algorithm, strategy.collective
        )
    )
    dataloader.bind(lambda: strategy._run.schedule(trainer.current_epoch))
    return dataloader


def bind_evaluation_loader(strategy: Any, dataloader: EvalLoader) -> EvalLoader:
    """Keep the evaluated clients, shard them over the processes, chunk them for the batched evaluation."""
    module, federation = strategy.lightning_module, strategy.federation
    fingerprint = lambda: training_clients(module.trainer.datamodule)  # noqa: E731
    probe = model_probe(strategy)
    strategy._binding.bind_evaluation(dataloader, federation, strategy.collective, probe, fingerprint)
    smoke = bool(module.trainer.fast_dev_run)
    batched = serve_evaluation(
        strategy._selection,
        dataloader,
        module,
        federation,
        probe.device,
        probe.convert_input,
        probe.headline,
        smoke,
    )
    strategy._evaluation.serve(dataloader, batched)
    return dataloader


def model_probe(strategy: Any) -> ModelProbe:
    """The module, device, precision conversion, headline setting and declared classes the checks use."""
    module = strategy.lightning_module
    trainer = module.trainer
    declared = getattr(trainer.datamodule, "num_classes", None)
    convert_input = trainer.precision_plugin.convert_input
    return ModelProbe(module, strategy.root_device, convert_input, strategy.headline_metrics, declared)


def training_clients(datamodule: Any) -> dict[str, Any] | None:
    """The fingerprint of a ``FederatedDataModule``'s training clients (``None`` for other data, or a
    data module without training data)."""
    if not isinstance(datamodule, FederatedDataModule):
        return None
    try:
        loader = datamodule.train_dataloader()
    except ValueError:  # evaluation data only
        return None
    return clients_fingerprint(loader.client_sizes(), loader.partition_checksum())


def say(line: str | None) -> None:
    """Log a runner decision's line (rank zero), if any."""
    if line is not None:
        rank_zero_info(line)


def warn(note: str | None) -> None:
    """Warn with ``note`` (rank zero), if any."""
    if note is not None:
        rank_zero_warn(note)
