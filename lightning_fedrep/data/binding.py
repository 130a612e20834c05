"""What a federated strategy checks and binds of the data it is handed (Lightning-free): the label checks,
the same-federation check of a restored checkpoint, the evaluated clients kept and dealt to the processes, and
the note that a fit selects rounds on test data.

:class:`DataBinding` holds what is remembered between loaders of one ``fit``/``validate``/``test``/``predict``
(which splits' labels were checked); the strategy creates it, and its ``process_dataloader`` calls it with
the Trainer's facts (:class:`ModelProbe`) and the Lightning-side ways to warn and inform.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
from lightning_fedrep.federation import (
    Federation,
    FederationMismatch,
    clients_fingerprint,
    federation_fingerprint,
)
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.module.untouched import untouched_random_state

Say = Callable[[str], None]
Fingerprint = Callable[[], "dict[str, Any] | None"]
"""The data module's training clients as a checkpoint's fingerprint records them (``None``: no
``FederatedDataModule`` with training data), asked only when a checkpoint's federation is compared."""


@dataclass(frozen=True)
class ModelProbe:
    """What the label checks run a probe batch through: the module on its device, Lightning's conversion of
    a batch (the precision), whether ``model(x)`` gives class scores (``headline_metrics``), and the data
    module's declared ``num_classes`` (``None``: none declared)."""

    module: nn.Module
    device: torch.device
    convert_input: Callable[[Any], Any]
    headline: bool
    declared_classes: Any = None


class DataBinding:
    """The data checks of a federated strategy, and the evaluation loaders' client selection.

    Args:
        allow_new_federation: the strategy's setting: data or settings other than a restored checkpoint's
            start the clients from its global state (a warning) instead of being refused.
        evaluate_clients: validation and test score only the first this many clients (``None``: all).
        warn: how a warning is given (rank zero).
        info: how an information line is given (rank zero).
    """

    def __init__(self, allow_new_federation: bool, evaluate_clients: int | None, warn: Say, info: Say):
        self.allow_new_federation = allow_new_federation
        self.evaluate_clients = evaluate_clients
        self.warn, self.info = warn, info
        self.labels_checked: set[str] = set()
        """The splits whose labels were checked in this call (``"train"``, ``"val"``, ...)."""

    def start_call(self) -> None:
        """A new ``fit``/``validate``/``test``/``predict``: its loaders' labels are checked again."""
        self.labels_checked = set()

    def bind_training(self, loader: RoundLoader, federation: Federation, probe: ModelProbe) -> None:
        """Draw the batches the privacy mechanism's accounting needs (:meth:`use_mechanism_sampling`), check the
        training labels, give the federation the clients' sizes, and refuse another federation's data (or
        settings) than a restored checkpoint's."""
        self.use_mechanism_sampling(loader, federation)
        self.check_labels(loader, probe)
        federation.bind_data(loader.client_sizes(), loader.batch_size, loader.partition_checksum())
        self.check_same_federation(federation, federation.federation_changes())

    @staticmethod
    def use_mechanism_sampling(loader: RoundLoader, federation: Federation) -> None:
        """Switch ``loader`` to the batch sampling the federation's privacy mechanism needs inside clients
        (``PrivacyMechanism.batch_sampling``: ``"poisson"`` for sample-level DP-SGD, whose accounting assumes
        Poisson batches); a loader that draws its own batches is refused (naming it and the fix)."""
        mechanism = federation.config.privacy
        sampling = getattr(mechanism, "batch_sampling", None)
        if sampling is None:
            return
        try:
            loader.use_sampling(sampling)
        except ValueError as error:
            raise ValueError(
                f"The privacy mechanism {type(mechanism).__name__} needs {sampling!r} batches inside the clients "
                f"(its privacy accounting assumes them), but the training loader refuses them: {error}"
            ) from error

    def bind_evaluation(
        self,
        loader: EvalLoader,
        federation: Federation | None,
        collective: Collective,
        probe: ModelProbe,
        training_clients: Fingerprint,
    ) -> EvalLoader:
        """Keep the evaluated clients, warn of those without data, check the labels, refuse a restored
        checkpoint's federation other than these clients' (``training_clients``: the data module's, see
        :meth:`evaluated_clients`), and deal the clients to the processes."""
        if self.evaluate_clients is not None:
            loader.keep_first(self.evaluate_clients)
        self.warn_clients_without_data(loader)
        self.check_labels(loader, probe)
        self.check_federation_alone(federation, loader, training_clients)
        if collective.distributed:
            sharded = federation is not None and federation.has_state and federation.store.sharded
            loader.shard(collective.rank, collective.world_size, by_owner=sharded)
        return loader

    def bind_prediction(
        self,
        loader: EvalLoader,
        federation: Federation | None,
        reads_clients: bool,
        training_clients: Fingerprint,
    ) -> EvalLoader:
        """A prediction loader, one batch per step: a checkpoint's federation must be these clients' when the
        predictions read the clients' stored state (``reads_clients``)."""
        if reads_clients:
            self.check_federation_alone(federation, loader, training_clients)
        loader.chunk(None)
        self.warn_clients_without_data(loader)
        return loader

    def check_federation_alone(
        self, federation: Federation | None, loader: EvalLoader, training_clients: Fingerprint
    ) -> None:
        """A ``validate``/``test``/``predict`` alone (no training data bound): a checkpoint's federation must
        be the evaluated data's."""
        if federation is not None and federation.client_sizes is None:
            clients = self.evaluated_clients(loader, training_clients)
            self.check_same_federation(federation, federation.federation_changes(clients))

    def evaluated_clients(self, loader: EvalLoader, training_clients: Fingerprint) -> dict[str, Any]:
        """The clients a validate/test/predict alone evaluates, as a checkpoint's fingerprint records them:
        the data module's training clients (``training_clients()``: number, sizes, partition); only their
        number for data that do not come from a ``FederatedDataModule`` (a log line says so)."""
        clients = training_clients()
        if clients is None:
            self.info(
                "The evaluated data do not come from a FederatedDataModule with training clients: only their "
                "number is compared with the checkpoint's federation, not their partition."
            )
            return {"num_clients": loader.num_clients}
        return clients

    def check_same_federation(self, federation: Federation, changes: list[str]) -> None:
        """Refuse data or settings other than the checkpoint's (another federation's heads would be handed
        to these clients), unless ``allow_new_federation``: then these clients start from the global state."""
        if not changes:
            return
        if not self.allow_new_federation:
            raise FederationMismatch(
                f"The checkpoint was saved by another federation than this run's ({'; '.join(changes)}). Resume "
                "or evaluate it with the same data module (clients, partition, batch size) and strategy settings "
                "(algorithm, seed, clients_per_round, phases, first_state, privacy), or pass allow_new_federation=True to "
                "start these clients from the checkpoint's global state (their own parts from the initial ones)."
            )
        self.warn(
            f"allow_new_federation=True: a new federation ({'; '.join(changes)}); every client starts from the "
            "checkpoint's global state and the initial local part."
        )
        federation.adopt_new_federation()

    def check_labels(self, loader: RoundLoader | EvalLoader, probe: ModelProbe) -> None:
        """Refuse string labels, float class ids (whole numbers below the model's number of outputs), and
        labels the model cannot score (at or above its number of outputs on a probe batch, or the data module's
        ``num_classes``), naming the client: once per split and call."""
        split = "train" if isinstance(loader, RoundLoader) else loader.stage
        if split in self.labels_checked or not loader.clients:
            return
        self.labels_checked.add(split)
        with untouched_random_state():  # fetching a probe batch may draw from the global generators
            batch = loader.probe_batch(0) if isinstance(loader, RoundLoader) else loader.first_batch()
        first = "client 0" if isinstance(loader, RoundLoader) else "the first client"
        if isinstance(batch, list | tuple) and len(batch) == 2 and has_string_labels(batch[1]):
            raise string_labels_error(f"The {split} data of {first}", batch[1][0])
        num_classes, source = None, "the model outputs"
        if probe.headline:  # else model(x) may not be class scores
            where = f"The {split} data of {first} (its first batch)"
            refuse_float_class_labels(probe.module, batch, probe.device, where, probe.convert_input)
            num_classes = output_width(probe.module, batch, probe.device, probe.convert_input)
        declared = probe.declared_classes
        if num_classes is None and isinstance(declared, int) and not isinstance(declared, bool):
            num_classes, source = declared, "the data module declares"
        if num_classes is None:
            return
        unchecked = check_client_labels(loader.clients, split, num_classes, source)
        if unchecked:
            self.info(
                f"lightning_fedrep: {split} labels not checked against the {num_classes} classes: "
                f"{', '.join(sorted(set(unchecked)))} stores no `targets` (one out of range fails at its step)."
            )

    def warn_clients_without_data(self, loader: EvalLoader) -> None:
        """Clients without samples in an evaluation (or prediction) split are left out: say which."""
        note = empty_clients_note(loader.stage, [len(data) for data in loader.clients])
        if note is not None:
            self.warn(note)


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


def data_fingerprint(datamodule: Any, fit: bool, algorithm: str, config: Any) -> dict[str, Any] | None:
    """``datamodule``'s federation as a checkpoint's fingerprint records it (``None``: data not from a
    ``FederatedDataModule``): to resume a ``fit``, its training clients with the batch size and the strategy's
    ``algorithm`` name and ``config``; else its training clients (their number alone without training data)."""
    if not isinstance(datamodule, FederatedDataModule):
        return None
    if not fit:
        return training_clients(datamodule) or {"num_clients": datamodule.num_clients}
    loader = datamodule.train_dataloader()
    sizes, checksum = loader.client_sizes(), loader.partition_checksum()
    return federation_fingerprint(sizes, checksum, loader.batch_size, algorithm, config)


VALIDATION_METRIC = re.compile(r"(^|/)val([/_.]|$)")
"""A metric measured by validation: ``val/acc``, ``val_loss``, a prefixed ``finetune/val/acc``."""


def rounds_selected_on_test_note(monitors: Iterable[Any], datamodule_name: str) -> str | None:
    """What to say when callbacks that select rounds (``monitors``: a best checkpoint, an early stop, each with
    its ``monitor``) monitor a validation metric that a data module named ``datamodule_name``, without a
    validation split, computes on the test split; ``None`` when none monitors a validation metric."""
    selecting = [
        f"{type(c).__name__}(monitor={c.monitor!r})"
        for c in monitors
        if isinstance(c.monitor, str) and VALIDATION_METRIC.search(c.monitor)
    ]
    if not selecting:
        return None
    return (
        f"{', '.join(selecting)} selects rounds on a validation metric, but {datamodule_name} has no "
        "validation split (val_fraction=0): validation runs on each client's test split, so the selected round "
        "is chosen on test data and its test metrics are optimistic. Carve a validation split off each client's "
        f"training data with {datamodule_name}(..., val_fraction=0.1) (on the command line: "
        "--data.val_fraction 0.1), or monitor a training metric. Reporting the test metric of the last round "
        "without selecting on it, as the papers do, needs no validation split."
    )
