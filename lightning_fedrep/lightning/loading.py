"""The Lightning side of binding the data: the strategy's ``process_dataloader`` (round loaders bound to
the run's schedule, evaluation loaders chunked and sharded, prediction loaders), the label checks and the
same-federation check of a restored checkpoint."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fedrep.data.labels import (
    check_client_labels,
    has_string_labels,
    output_width,
    refuse_float_class_labels,
    string_labels_error,
)
from lightning_fedrep.data.loaders import EvalLoader, RoundLoader
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.evaluation.records import empty_clients_note
from lightning_fedrep.federation import FederationMismatch, clients_fingerprint
from lightning_fedrep.federation.module.untouched import untouched_random_state
from lightning_fedrep.runners.lockstep.evaluation import EVALUATION_CHUNK_SAMPLES, batched_evaluation


def bind_loader(strategy: Any, dataloader: object) -> object:
    """What ``process_dataloader`` returns for ``dataloader`` (refusing data not from a federated module)."""
    if strategy.lightning_module.trainer.state.fn == "predict":
        return bind_predict_loader(strategy, dataloader)
    if isinstance(dataloader, RoundLoader):
        return bind_training_loader(strategy, dataloader)
    if isinstance(dataloader, EvalLoader):
        return bind_evaluation_loader(strategy, dataloader)
    raise TypeError(
        f"{type(strategy).__name__} needs the data of a FederatedDataModule (a RoundLoader for training and an "
        f"EvalLoader for evaluation), got {type(dataloader).__name__}. Build the data with "
        "lightning_fedrep.FederatedDataModule(train_set, test_set, partitioner=...) and pass it as datamodule=."
    )


def bind_predict_loader(strategy: Any, dataloader: object) -> object:
    strategy._predict_loader = None
    if isinstance(dataloader, EvalLoader):
        federation = strategy.federation
        alone = federation is not None and federation.client_sizes is None  # predict alone
        if alone and predictions_read_clients(strategy):
            check_same_federation(
                strategy, federation.federation_changes(evaluated_clients(strategy, dataloader))
            )
        dataloader.chunk(None)
        strategy._predict_loader = dataloader
        warn_clients_without_data(dataloader)
    return dataloader


def bind_training_loader(strategy: Any, dataloader: RoundLoader) -> RoundLoader:
    """Bind the round loader to the run's schedule; the first one decides the runner's details."""
    check_labels(strategy, dataloader)
    federation = strategy.require_federation()
    federation.bind_data(dataloader.client_sizes(), dataloader.batch_size, dataloader.partition_checksum())
    check_same_federation(strategy, federation.federation_changes())
    trainer = strategy.lightning_module.trainer
    run = strategy._run
    plan = run.plan(trainer.current_epoch)
    if plan.length == 0:  # before the engine's probe
        raise ValueError(
            "The round plan is empty: every phase has a zero budget (head_epochs, body_epochs, "
            "local_epochs or phases=). Give at least one phase epochs or steps > 0."
        )
    line = strategy._selection.first_loader(
        run,
        dataloader,
        plan,
        strategy.root_device,
        bool(trainer.fast_dev_run),
        strategy.algorithm,
        strategy.collective,
    )
    say(line)
    dataloader.bind(lambda: strategy._run.schedule(trainer.current_epoch))
    return dataloader


def bind_evaluation_loader(strategy: Any, dataloader: EvalLoader) -> EvalLoader:
    """Keep the evaluated clients, shard them over the processes, chunk them for the batched evaluation."""
    if strategy.evaluate_clients is not None:
        dataloader.keep_first(strategy.evaluate_clients)
    strategy._eval_loader = dataloader
    warn_clients_without_data(dataloader)
    check_labels(strategy, dataloader)
    federation, collective = strategy.federation, strategy.collective
    if federation is not None and federation.client_sizes is None:  # validate/test alone
        check_same_federation(
            strategy, federation.federation_changes(evaluated_clients(strategy, dataloader))
        )
    if collective.distributed:
        sharded = federation is not None and federation.has_state and federation.store.sharded
        dataloader.shard(collective.rank, collective.world_size, by_owner=sharded)
    strategy._batched_evaluation = None
    module = strategy.lightning_module
    batched = federation is not None and federation.evaluation_spec.forward is None  # else per batch
    if strategy.runner.choice != "sequential" and strategy.headline_metrics and batched:
        strategy._batched_evaluation = batched_evaluation(
            module,
            federation,
            dataloader,
            strategy.root_device,
            module.trainer.precision_plugin.convert_input,
        )
    smoke = module.trainer.fast_dev_run  # one chunk is the pass: keep it a batch
    chunk = dataloader.batch_size if smoke else EVALUATION_CHUNK_SAMPLES
    dataloader.chunk(chunk if strategy._batched_evaluation is not None else None)
    return dataloader


def say(line: str | None) -> None:
    """Log a runner decision's line (rank zero), if any."""
    if line is not None:
        rank_zero_info(line)


def warn(note: str | None) -> None:
    """Warn with ``note`` (rank zero), if any."""
    if note is not None:
        rank_zero_warn(note)


def check_labels(strategy: Any, loader: RoundLoader | EvalLoader) -> None:
    """Refuse string labels, float class ids (whole numbers below the model's number of outputs), and
    labels the model cannot score (at or above its number of outputs on a probe batch, or the data module's
    ``num_classes``), naming the client: once per split and call."""
    split = "train" if isinstance(loader, RoundLoader) else loader.stage
    if split in strategy._labels_checked or not loader.clients:
        return
    strategy._labels_checked.add(split)
    with untouched_random_state():  # fetching a probe batch may draw from the global generators
        probe = (
            next(iter(loader.client_batches(0, 0, 0, 1)), None)
            if isinstance(loader, RoundLoader)
            else loader.first_batch()
        )
    first = "client 0" if isinstance(loader, RoundLoader) else "the first client"
    if isinstance(probe, list | tuple) and len(probe) == 2 and has_string_labels(probe[1]):
        raise string_labels_error(f"The {split} data of {first}", probe[1][0])
    module = strategy.lightning_module
    convert_input = module.trainer.precision_plugin.convert_input
    if strategy.headline_metrics:  # else model(x) may not be class scores
        where = f"The {split} data of {first} (its first batch)"
        refuse_float_class_labels(module, probe, strategy.root_device, where, convert_input)
    num_classes = (  # headline_metrics=False: model(x) may not be class scores
        output_width(module, probe, strategy.root_device, convert_input)
        if strategy.headline_metrics
        else None
    )
    source = "the model outputs"
    if num_classes is None:
        declared = getattr(module.trainer.datamodule, "num_classes", None)
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


def check_same_federation(strategy: Any, changes: list[str]) -> None:
    """Refuse data or settings other than the checkpoint's (another federation's heads would be handed
    to these clients), unless ``allow_new_federation``: then these clients start from the global state."""
    if not changes:
        return
    if not strategy.allow_new_federation:
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
    strategy.federation.adopt_new_federation()


def predictions_read_clients(strategy: Any) -> bool:
    """Whether ``trainer.predict`` may read the clients' stored state, so a checkpoint's federation must be
    this data's: not for new-client predictions, which use the global part only (any clients may)."""
    return strategy.predict != "new_client"


def evaluated_clients(strategy: Any, loader: EvalLoader) -> dict[str, Any]:
    """The clients a validate/test/predict alone evaluates, as a checkpoint's fingerprint records them:
    the data module's training clients (number, sizes, partition); only their number for data that do
    not come from a ``FederatedDataModule`` (a log line says so)."""
    clients = training_clients(strategy.lightning_module.trainer.datamodule)
    if clients is None:
        rank_zero_info(
            "The evaluated data do not come from a FederatedDataModule with training clients: only their "
            "number is compared with the checkpoint's federation, not their partition."
        )
        return {"num_clients": loader.num_clients}
    return clients


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


def warn_clients_without_data(loader: EvalLoader) -> None:
    """Clients without samples in an evaluation (or prediction) split are left out: say which."""
    warn(empty_clients_note(loader.stage, [len(data) for data in loader.clients]))
