"""``FederatedDataModule``: N clients' train / val / test data behind Lightning's DataModule API."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from lightning_fedrep.data.labels import (
    has_string_labels,
    integer_labels_error,
    string_labels_error,
    unseen_classes_note,
)
from lightning_fedrep.data.loaders import (
    ClientData,
    EvalLoader,
    RoundLoader,
    _BatchFetcher,
    datasets_are_deterministic,
)
from lightning_fedrep.data.partition import Partitioner
from lightning_fedrep.federation.api.arguments import check_bool, check_int, check_real
from lightning_fedrep.federation.plan import round_generator


def dataset_labels(dataset: Dataset, name: str = "The data set") -> torch.Tensor:
    """Integer labels of a map-style data set: ``targets`` (torchvision), a TensorDataset's second
    tensor, or ``dataset[i][1]`` of each ``(input, label)`` sample as a last resort. String labels, float or
    one-hot labels, and samples without a position 1 (dicts) are refused, naming the data set (``name``)."""
    targets = getattr(dataset, "targets", None)
    if targets is None and isinstance(dataset, TensorDataset) and len(dataset.tensors) > 1:
        targets = dataset.tensors[1]
    if targets is None:
        targets = [_sample_label(dataset[i], name) for i in range(len(dataset))]
    if has_string_labels(targets):
        raise string_labels_error(name, targets[0])
    labels = torch.as_tensor(targets)
    if labels.is_floating_point() or labels.dim() != 1:
        raise integer_labels_error(
            name,
            labels,
            "partitioning",
            "For regression data (real targets), split the data yourself and build the data module with "
            "FederatedDataModule.from_client_datasets(...).",
        )
    return labels.long()


def _sample_label(sample: Any, name: str) -> Any:
    """The label of one ``(input, label)`` sample; a dict sample (or one without a second entry) is refused:
    which of its entries is the label is not for the package to guess."""
    pair = isinstance(sample, Sequence) and not isinstance(sample, str | bytes)
    pair = pair or (isinstance(sample, torch.Tensor) and sample.dim() > 0)
    if pair and len(sample) >= 2:
        return sample[1]
    kind = (
        f"dicts with keys {sorted(map(str, sample))}"
        if isinstance(sample, Mapping)
        else f"{type(sample).__name__} values"
    )
    raise TypeError(
        f"{name} stores no labels (no `targets` attribute) and its samples are {kind}, not (input, label) pairs, "
        "so the partitioner cannot read each sample's class. Give the data set a `targets` attribute holding one "
        "integer class id per sample, as torchvision's data sets do (e.g. dataset.targets = "
        "torch.tensor([dataset[i][<label key>] for i in range(len(dataset))])), or split the data over clients "
        "yourself and use FederatedDataModule.from_client_datasets(...)."
    )


class FederatedDataModule(L.LightningDataModule):
    """The clients' data for a federated ``Trainer.fit``/``validate``/``test``.

    Give either whole data sets and a ``partitioner`` (which splits them over clients once, in
    ``setup``), or explicit per-client data sets with :meth:`from_client_datasets`.

    **Validation.** With ``val_fraction > 0`` each client keeps ``round(val_fraction * n)`` of its ``n``
    training samples (at most ``n - 1``) for validation: a random subset drawn by a generator seeded with
    ``(seed, -1, client)``, so the same seed carves the same split, whatever the other clients hold. The
    client trains on the rest, and ``Trainer.validate``, the per-round validation, ``val/acc`` and any
    ``ModelCheckpoint``/``EarlyStopping`` that monitors it then see data that is neither trained on nor
    tested on. ``val_fraction=0`` (the default) keeps the papers' protocol: there is no validation split,
    and validation runs on each client's *test* split, so ``validate()`` and ``test()`` give the same
    numbers (:attr:`has_validation_split` says which; a fit that selects rounds on a ``val/`` metric then
    warns, see ``docs/concepts.md``).

    ``train_dataloader`` returns one :class:`~lightning_fedrep.data.loaders.RoundLoader` (the strategy
    drives it round by round) and ``val_dataloader``/``test_dataloader`` one
    :class:`~lightning_fedrep.data.loaders.EvalLoader` over all clients.

    ``max_train_samples`` caps each client's training samples (after any validation split), keeping a
    seeded random subset of that size (the official code's ``m_tr``, default 500, which keeps the *first*
    ``m_tr`` samples of a client's shards in the order they were dealt); test splits are not capped.

    Args:
        train_set: a map-style data set of ``(input, integer label)`` samples, split over the clients.
        test_set: the test data set, split over the same clients (each client gets its own classes'
            samples); ``None``: no test split.
        partitioner: how the data sets are split over clients (:class:`Partitioner`). A pooling one
            (``pools_test_set``, e.g. :class:`~lightning_fedrep.PFLlibPartitioner`) deals the train and test
            sets as one pool, so a client's test samples can come from either.
        batch_size: the training batch size.
        eval_batch_size: the batch size of validation and test.
        val_fraction: the share of each client's training data kept for validation, in ``[0, 1)`` (0: no
            validation split; validation runs on the test split, the papers' protocol).
        num_workers: ``DataLoader`` worker processes that load batches.
        pin_memory: pin the batches' memory (faster host-to-GPU copies).
        collate_fn: how samples become a batch (``None``: PyTorch's default collation).
        seed: the seed of the partition, the validation splits and ``max_train_samples``' subsets.
        max_train_samples: the cap on each client's training samples (``None``: no cap).
    """

    def __init__(
        self,
        train_set: Dataset | None = None,
        test_set: Dataset | None = None,
        partitioner: Partitioner | None = None,
        batch_size: int = 10,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable | None = None,
        seed: int = 0,
        max_train_samples: int | None = None,
    ):
        super().__init__()
        owner = type(self).__name__
        if max_train_samples is not None:
            check_int("max_train_samples", max_train_samples, minimum=1, owner=owner)
        check_int("batch_size", batch_size, minimum=1, owner=owner)
        check_int("eval_batch_size", eval_batch_size, minimum=1, owner=owner)
        check_real("val_fraction", val_fraction, low=0.0, high=1.0, high_open=True, owner=owner)
        check_int("num_workers", num_workers, minimum=0, owner=owner)
        check_bool("pin_memory", pin_memory, owner=owner)
        check_int("seed", seed, owner=owner)
        if partitioner is not None and not isinstance(partitioner, Partitioner):
            raise TypeError(
                f"{owner}(partitioner=...) must be a Partitioner (ShardPartitioner(...), DirichletPartitioner(...), "
                f"IIDPartitioner(...)), got {type(partitioner).__name__}."
            )
        self.train_set = train_set
        self.test_set = test_set
        self.partitioner = partitioner
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.max_train_samples = max_train_samples
        self._fetcher = _BatchFetcher(num_workers, pin_memory, collate_fn)
        self._train: list[ClientData] | None = None
        self._val: list[ClientData] | None = None
        self._test: list[ClientData] | None = None

    @classmethod
    def from_client_datasets(
        cls,
        train: Sequence[Dataset],
        test: Sequence[Dataset] | None = None,
        val: Sequence[Dataset] | None = None,
        **kwargs: Any,
    ) -> FederatedDataModule:
        """A data module whose clients are given explicitly: ``train[i]`` (and ``test[i]``, ``val[i]``) is
        client i's. ``val``: each client's own validation set (instead of carving one off its training data
        with ``val_fraction``, which it excludes). ``kwargs`` go to the constructor."""
        module = cls(**kwargs)
        for name, sets in (("test", test), ("val", val)):
            if sets is not None and len(sets) != len(train):
                raise ValueError(
                    f"from_client_datasets got {len(train)} client training sets but {len(sets)} {name} sets; "
                    "give one per client."
                )
        if val is not None and module.val_fraction > 0:
            raise ValueError(
                f"from_client_datasets got the clients' validation sets (val=...) and val_fraction="
                f"{module.val_fraction}, which would carve another validation split off their training data: "
                "give one of them (drop val_fraction to validate on the given sets)."
            )
        module._set_clients(
            _whole(train),
            _whole(test) if test is not None else None,
            _whole(val) if val is not None else None,
        )
        return module

    def _set_clients(
        self,
        train: list[ClientData],
        test: list[ClientData] | None,
        val: list[ClientData] | None = None,
        note_unseen_classes: bool = True,
    ) -> None:
        """Keep the clients' splits: ``val`` as given, else carved off ``train`` by ``val_fraction``; then
        ``max_train_samples`` caps the training samples. The one place every way of building clients goes
        through (partitioners, explicit data sets, natural users), so it warns here when a client's
        evaluation split holds classes its training data lacks (``note_unseen_classes``)."""
        if not train:
            raise ValueError("A federated data module needs at least one client.")
        empty = [cid for cid, c in enumerate(train) if len(c) == 0]
        if empty:
            raise ValueError(
                f"Clients {empty[:10]} have no training samples; use fewer clients or another partition."
            )
        if val is None and self.val_fraction > 0:
            train, val = self._carve_validation(train)
        if self.max_train_samples is not None:
            train = [self._capped(cid, data, self.max_train_samples) for cid, data in enumerate(train)]
        self._train, self._val, self._test = train, val, test
        if note_unseen_classes:
            for split, clients in (("val", val), ("test", test)):
                note = unseen_classes_note(train, clients, split) if clients is not None else None
                if note is not None:
                    warnings.warn(f"{type(self).__name__}: {note}", UserWarning, stacklevel=3)

    def _carve_validation(self, train: list[ClientData]) -> tuple[list[ClientData], list[ClientData]]:
        """Each client's training samples split in two, ``(kept for training, validation)``: a random
        ``round(val_fraction * n)`` of its ``n`` samples (at most ``n - 1``) drawn with ``(seed, -1, client)``."""
        kept, val = [], []
        for cid, data in enumerate(train):
            perm = torch.randperm(len(data), generator=round_generator(self.seed, -1, cid))
            n_val = min(int(round(self.val_fraction * len(data))), len(data) - 1)
            val.append(ClientData(data.dataset, data.indices[perm[:n_val]].sort().values))
            kept.append(ClientData(data.dataset, data.indices[perm[n_val:]].sort().values))
        return kept, val

    def _capped(self, client: int, data: ClientData, samples: int) -> ClientData:
        """A seeded random subset of at most ``samples`` of one client's training samples."""
        if len(data) <= samples:
            return data
        perm = torch.randperm(len(data), generator=round_generator(self.seed, -4, client))
        return ClientData(data.dataset, data.indices[perm[:samples]].sort().values)

    def setup(self, stage: str | None = None) -> None:
        """Partition the data sets over clients (once; later calls keep the partition)."""
        if self._train is not None:
            return
        if self.train_set is None or self.partitioner is None:
            raise ValueError(
                "FederatedDataModule needs train_set and partitioner (e.g. ShardPartitioner(num_clients=100, "
                "classes_per_client=2)), or use FederatedDataModule.from_client_datasets(...)."
            )
        owner = type(self).__name__
        train_labels = dataset_labels(self.train_set, f"{owner}(train_set=...)")
        test_labels = (
            dataset_labels(self.test_set, f"{owner}(test_set=...)") if self.test_set is not None else None
        )
        split = self.partitioner.split(train_labels, test_labels, self.seed)
        if getattr(self.partitioner, "pools_test_set", False):  # both splits index train_set ++ test_set
            self._set_clients(
                [ClientData(self._pool(training=True), idx) for idx in split.train],
                [ClientData(self._pool(training=False), idx) for idx in split.test],
            )
            return
        self._set_clients(
            [ClientData(self.train_set, idx) for idx in split.train],
            [ClientData(self.test_set, idx) for idx in split.test] if self.test_set is not None else None,
        )

    def _pool(self, training: bool) -> Dataset:
        """The train set followed by the test set, the data set a pooling partitioner's indices
        (``pools_test_set``, e.g. :class:`~lightning_fedrep.PFLlibPartitioner`) point into; ``training`` says
        which clients' samples it serves (a subclass reads them with its training or evaluation transform).
        Its ``targets`` are the pooled labels."""
        return pooled_dataset(self.train_set, self.test_set)

    @property
    def num_clients(self) -> int:
        self._require_setup()
        return len(self._train)

    @property
    def has_validation_split(self) -> bool:
        """Whether validation runs on a split of its own (carved by ``val_fraction``, or given), rather than
        on each client's test split (the papers' protocol, ``val_fraction=0``). Known before ``setup``."""
        return self._val is not None or self.val_fraction > 0

    def client_num_samples(self, client: int) -> int:
        """Number of training samples of ``client``."""
        self._require_setup()
        return len(self._train[client])

    def client_data(self, client: int, split: str = "train") -> ClientData:
        """One client's samples of ``split`` ("train", "val" or "test")."""
        self._require_setup()
        clients = {"train": self._train, "val": self._val, "test": self._test}[split]
        if clients is None:
            raise ValueError(f"This data module has no {split!r} split.")
        return clients[client]

    def client_batches(
        self, client: int, index_batches: Iterable[torch.Tensor], split: str = "train"
    ) -> Iterator[Any]:
        """``client``'s samples of ``split`` in the given batches of positions (``0 .. n-1`` within the
        client), collated as this data module's own loaders collate them (``collate_fn``, workers, pinned
        memory): for a callback that runs its own passes over a client's data (``FineTunedEvaluation``).
        ``index_batches`` holds one tensor of positions per batch."""
        data = self.client_data(client, split)
        return self._fetcher.batches(data.dataset, [data.indices[b] for b in index_batches])

    def _derived(
        self, train: list[ClientData], val: list[ClientData] | None, test: list[ClientData] | None
    ) -> FederatedDataModule:
        """A data module over these clients' splits as they are (nothing carved or capped again; the
        unseen-classes warning was this module's to give)."""
        module = FederatedDataModule(
            batch_size=self.batch_size,
            eval_batch_size=self.eval_batch_size,
            seed=self.seed,
        )
        module._fetcher = self._fetcher
        module._set_clients(train, test, val, note_unseen_classes=False)
        return module

    def holdout(
        self, new_clients: int | float, seed: int | None = None
    ) -> tuple[FederatedDataModule, FederatedDataModule]:
        """Split the clients in two: those that train in the federation and held-out *new* clients.

        ``new_clients`` is a count or a fraction of the clients, chosen by a generator seeded with
        ``seed`` (the data module's seed by default). Returns ``(federation, new)``; both keep their
        clients' train, validation and test splits, renumbered from 0 in their original order.
        """
        self._require_setup()
        n = len(self._train)
        count = int(round(new_clients * n)) if isinstance(new_clients, float) else int(new_clients)
        if not 0 < count < n:
            raise ValueError(
                f"new_clients={new_clients} must leave at least one client on each side of {n} clients."
            )
        perm = torch.randperm(n, generator=round_generator(self.seed if seed is None else seed, -2))
        new = sorted(perm[:count].tolist())
        old = sorted(perm[count:].tolist())

        def pick(ids: list[int]) -> FederatedDataModule:
            def some(clients: list[ClientData] | None) -> list[ClientData] | None:
                return [clients[i] for i in ids] if clients is not None else None

            return self._derived(some(self._train), some(self._val), some(self._test))

        return pick(old), pick(new)

    def with_train_samples(self, samples: int, seed: int | None = None) -> FederatedDataModule:
        """The same clients with at most ``samples`` training samples each (a random subset drawn with
        ``seed``, the data module's own when ``None``), validation and test splits unchanged: the few-shot
        data of the new-client protocol."""
        self._require_setup()
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}.")
        generator_seed = self.seed if seed is None else seed
        train = []
        for cid, data in enumerate(self._train):
            perm = torch.randperm(len(data), generator=round_generator(generator_seed, -3, cid))
            train.append(ClientData(data.dataset, data.indices[perm[:samples]].sort().values))
        return self._derived(train, self._val, self._test)

    def _require_setup(self) -> None:
        if self._train is None:
            self.setup()

    def train_dataloader(self) -> RoundLoader:
        self._require_setup()
        return RoundLoader(self._train, self.batch_size, self.seed, self._fetcher)

    def val_dataloader(self) -> EvalLoader:
        """Each client's validation split (``val_fraction`` or given), else its test split."""
        self._require_setup()
        clients = self._val if self._val is not None else self._test
        if clients is None:
            raise ValueError("No validation data: give a test_set/test client sets, or set val_fraction > 0.")
        return EvalLoader(clients, self.eval_batch_size, "val", self._fetcher)

    def test_dataloader(self) -> EvalLoader:
        self._require_setup()
        if self._test is None:
            raise ValueError("No test data: give test_set (or per-client test sets) to the data module.")
        return EvalLoader(self._test, self.eval_batch_size, "test", self._fetcher)

    def predict_dataloader(self) -> EvalLoader:
        """Each client's test samples, client after client (``trainer.predict``; the strategy's ``predict``
        setting decides whose model predicts them)."""
        self._require_setup()
        if self._test is None:
            raise ValueError(
                "No data to predict: give test_set (or per-client test sets) to the data module."
            )
        return EvalLoader(self._test, self.eval_batch_size, "predict", self._fetcher)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_clients": len(self._train) if self._train is not None else -1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"The checkpoint was made with data seed {state['seed']} but this data module has seed "
                f"{self.seed}; the clients' data would differ. Use seed={state['seed']}."
            )


def why_batches_vary(datamodule: Any, clients: Sequence[int]) -> str | None:
    """Why ``datamodule``'s training batches of ``clients`` are not a fixed function of their samples (a data
    module that draws its own ``client_batches``, a data set with random transforms), or ``None``: the rule for
    computing a frozen body's features once before an evaluation (``FineTunedEvaluation``,
    ``EvaluationSpec.adapt``)."""
    if type(datamodule).client_batches is not FederatedDataModule.client_batches:
        return f"{type(datamodule).__name__} draws its own batches"
    return datasets_are_deterministic(datamodule.client_data(c).dataset for c in clients)


def pooled_dataset(train_set: Dataset, test_set: Dataset | None) -> Dataset:
    """``train_set`` followed by ``test_set`` (``train_set`` alone when there is none), with the pooled
    labels as ``targets``: the data set of a pooling partitioner's clients."""
    if test_set is None:
        return train_set
    pool = ConcatDataset([train_set, test_set])
    pool.targets = torch.cat([dataset_labels(train_set), dataset_labels(test_set)])
    return pool


def _whole(datasets: Sequence[Dataset]) -> list[ClientData]:
    """One client per data set, holding all of its samples."""
    return [ClientData(d, torch.arange(len(d))) for d in datasets]
