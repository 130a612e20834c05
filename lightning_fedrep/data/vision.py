"""CIFAR-10, CIFAR-100, MNIST, EMNIST and Fashion-MNIST split over clients, read with torchvision's own data set classes.

Each data module takes plain arguments (so a LightningCLI YAML can build it) and touches the disk only in
``prepare_data`` (which downloads when ``download=True``) and ``setup`` (which loads the files); building
one, or printing its configuration, reads nothing. torchvision is imported only then, so the core package
works without the ``vision`` extra.

By default the clients are cut FedRep-style, ``ShardPartitioner(num_clients, classes_per_client)``: each
client holds ``classes_per_client`` classes and is tested on exactly those classes of the test set (the
official code's ``utils/sampling.py::noniid``). Pass any other :class:`Partitioner` to change that.

Transforms follow the official FedRep code (``lgcollins/FedRep``):

* CIFAR-10: training images get ``RandomCrop(32, padding=4)`` and ``RandomHorizontalFlip()``, then
  ``ToTensor()`` and ``Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))``; test images only the
  last two.
* CIFAR-100: the same, normalised with ``(0.507, 0.487, 0.441), (0.267, 0.256, 0.276)``.
* MNIST and EMNIST: ``ToTensor()`` and ``Normalize((0.1307,), (0.3081,))``, no augmentation.

``augment=False`` drops the CIFAR training augmentation. A validation split (``val_fraction > 0``) is
carved from the training images but always read with the *test* transform.

``preprocessing="pfllib"`` (CIFAR-10, CIFAR-100, Fashion-MNIST) reads every image as PFLlib's
``generate_*.py`` do: ``ToTensor()`` then ``Normalize(0.5, 0.5)`` per channel, no augmentation. With a
pooling partitioner (:class:`~lightning_fedrep.PFLlibPartitioner`) the clients' samples come from the
train and test files alike; each is read with the training transform when a client trains on it and the
test transform when it is evaluated.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from torch.utils.data import Dataset

from lightning_fedrep.data.loaders import ClientData
from lightning_fedrep.data.module import FederatedDataModule, pooled_dataset
from lightning_fedrep.data.partition import Partitioner, ShardPartitioner
from lightning_fedrep.federation.api.arguments import check_bool, check_int

__all__ = [
    "CIFAR100DataModule",
    "CIFAR10DataModule",
    "EMNISTDataModule",
    "FashionMNISTDataModule",
    "MNISTDataModule",
    "TorchvisionDataModule",
]

CIFAR10_MEAN, CIFAR10_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR100_MEAN, CIFAR100_STD = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
PREPROCESSING = ("default", "pfllib")
"""The ``preprocessing`` choices: the module's own transforms, or PFLlib's ``Normalize(0.5, 0.5)``."""


def _torchvision() -> Any:
    try:
        import torchvision
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "The CIFAR/MNIST/EMNIST data modules need torchvision: pip install 'lightning-fedrep[vision]'."
        ) from error
    return torchvision


def _check_preprocessing(owner: str, preprocessing: object) -> None:
    if preprocessing not in PREPROCESSING:
        raise ValueError(
            f"{owner}(preprocessing={preprocessing!r}) must be 'default' (the module's documented transforms) or "
            "'pfllib' (PFLlib's ToTensor + Normalize(0.5, 0.5), no augmentation)."
        )


def _with_transform(dataset: Any, transform: Callable) -> Any:
    """A shallow copy of a torchvision data set (sharing its arrays) that applies ``transform`` instead."""
    from torchvision.datasets.vision import StandardTransform

    clone = copy.copy(dataset)
    clone.transform = transform
    clone.transforms = StandardTransform(transform, dataset.target_transform)
    return clone


class TorchvisionDataModule(FederatedDataModule):
    """Base of the torchvision-backed data modules: lazy loading, download handling, transforms.

    Subclasses set :attr:`display_name`, :attr:`expected_files` and :attr:`num_classes` and implement
    :meth:`_make_dataset` and :meth:`_transform`.

    Args:
        root: folder holding the data set (torchvision's layout, e.g. ``root/cifar-10-batches-py``).
        num_clients: number of clients of the default :class:`ShardPartitioner`.
        classes_per_client: classes per client of the default :class:`ShardPartitioner`.
        partitioner: any partitioner instead of the default shards; ``num_clients`` and
            ``classes_per_client`` are then ignored.
        download: download the files in ``prepare_data`` when they are missing. Without it, missing
            files raise a ``FileNotFoundError`` that says where to put them.
        batch_size: training batch size (the official FedRep scripts use 10).
        eval_batch_size: batch size of validation and test.
        val_fraction: fraction of each client's training samples kept for validation.
        num_workers: ``DataLoader`` workers used to load and transform the images.
        seed: seed of the partition, of the validation split and of the data order.
        assignment: how the default :class:`ShardPartitioner` deals classes: ``"distinct"`` (S distinct
            classes per client) or ``"official"`` (the official code's shuffled multiset of class slots).
        max_train_samples: at most this many training samples per client (the official ``m_tr``; see
            :class:`FederatedDataModule`); ``None`` keeps them all.
        test_draws: draw each client's test set with replacement, ``test_draws`` test shards of its class per
            class slot (the official code's rule when the test set has fewer than 100 samples per client:
            50; see :class:`ShardPartitioner`); ``None``: disjoint test shards.
    """

    display_name: ClassVar[str] = ""
    expected_files: str = ""
    """Where the files must lie, for the error raised when they are missing."""
    num_classes: int = 0
    """Number of classes (the head size a model needs)."""

    def __init__(
        self,
        root: str = "data",
        num_clients: int = 100,
        classes_per_client: int = 2,
        partitioner: Partitioner | None = None,
        download: bool = False,
        batch_size: int = 10,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        assignment: Literal["distinct", "official"] = "distinct",
        max_train_samples: int | None = None,
        test_draws: int | None = None,
    ):
        check_bool("download", download, owner=type(self).__name__)
        if partitioner is not None and test_draws is not None:
            raise ValueError(
                f"{type(self).__name__}(test_draws={test_draws!r}) applies to the default ShardPartitioner, but "
                f"partitioner={partitioner!r} was given: pass test_draws to that partitioner instead "
                "(ShardPartitioner(..., test_draws=...)), or drop partitioner=."
            )
        super().__init__(
            partitioner=partitioner
            or ShardPartitioner(num_clients, classes_per_client, assignment, test_draws),
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
            max_train_samples=max_train_samples,
        )
        self.root = str(root)
        self.download = download

    # -- subclass hooks ---------------------------------------------------------------------------

    def _make_dataset(self, train: bool, download: bool, transform: Callable | None) -> Dataset:
        raise NotImplementedError

    def _transform(self, train: bool) -> Callable:
        raise NotImplementedError

    # -- loading ----------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Download the training and test files when ``download=True`` (Lightning calls this once)."""
        if self.download:
            _torchvision()
            for train in (True, False):
                self._make_dataset(train, download=True, transform=None)

    def _load(self, train: bool, transform: Callable) -> Dataset:
        try:
            return self._make_dataset(train, download=False, transform=transform)
        except RuntimeError as error:
            if self.download:  # prepare_data was not called in this process: download now
                self.prepare_data()
                return self._make_dataset(train, download=False, transform=transform)
            raise FileNotFoundError(
                f"{self.display_name} was not found (or failed torchvision's checksum) under "
                f"{os.path.abspath(self.root)!r}: expected {self.expected_files}. Pass download=True "
                f"(on the command line: --data.download true) to download it, or put the files there "
                f"(or point root= at the folder that holds them). torchvision said: {error}"
            ) from error

    def setup(self, stage: str | None = None) -> None:
        """Load the data sets (once) and partition them over the clients."""
        if self._train is not None:
            return
        _torchvision()
        self.train_set = self._load(True, self._transform(train=True))
        self.test_set = self._load(False, self._transform(train=False))
        super().setup(stage)
        if self._val is not None:  # validation images carved from the training set: no augmentation
            if getattr(self.partitioner, "pools_test_set", False):
                eval_train = self._pool(training=False)
            else:
                eval_train = _with_transform(self.train_set, self._transform(train=False))
            self._val = [ClientData(eval_train, c.indices) for c in self._val]

    def _pool(self, training: bool) -> Dataset:
        """The pooled train ++ test images, all read with the training transform (``training``) or all with
        the test transform."""
        if training:
            return pooled_dataset(self.train_set, _with_transform(self.test_set, self._transform(train=True)))
        return pooled_dataset(_with_transform(self.train_set, self._transform(train=False)), self.test_set)


class _CIFARDataModule(TorchvisionDataModule):
    """CIFAR-10 or CIFAR-100 (``dataset_class``), normalised with ``mean`` and ``std``.

    Args:
        augment: randomly crop and flip the training images (the official code's augmentation); ``None``
            (default): on with the default preprocessing, off with ``"pfllib"``.
        preprocessing: ``"default"`` (FedRep's normalisation, see the module docstring) or ``"pfllib"``
            (``Normalize(0.5, 0.5)`` per channel, as PFLlib's ``generate_Cifar*.py``).
        *args, **kwargs: the arguments of :class:`TorchvisionDataModule`, in its order.
    """

    mean: ClassVar[tuple[float, ...]] = CIFAR10_MEAN
    std: ClassVar[tuple[float, ...]] = CIFAR10_STD
    dataset_class: ClassVar[str] = "CIFAR10"

    def __init__(
        self,
        *args: Any,
        augment: bool | None = None,
        preprocessing: Literal["default", "pfllib"] = "default",
        **kwargs: Any,
    ):
        _check_preprocessing(type(self).__name__, preprocessing)
        if augment is not None:
            check_bool("augment", augment, owner=type(self).__name__)
        super().__init__(*args, **kwargs)
        self.preprocessing = preprocessing
        self.augment = preprocessing == "default" if augment is None else augment

    def _make_dataset(self, train: bool, download: bool, transform: Callable | None) -> Dataset:
        cls = getattr(_torchvision().datasets, self.dataset_class)
        return cls(self.root, train=train, download=download, transform=transform)

    def _transform(self, train: bool) -> Callable:
        transforms = _torchvision().transforms
        steps: list[Callable] = []
        if train and self.augment:
            steps += [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
        mean, std = (self.mean, self.std) if self.preprocessing == "default" else ((0.5,) * 3, (0.5,) * 3)
        steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
        return transforms.Compose(steps)


class CIFAR10DataModule(_CIFARDataModule):
    """CIFAR-10 (50,000 train / 10,000 test 3x32x32 images, 10 classes) split over clients.

    The defaults are the FedRep paper's main setting: 100 clients with 2 classes each, so each client
    has 500 training and 100 test images. Training images are randomly cropped and flipped
    (``augment=True``, as the official code); see the module docstring for the transforms and
    :class:`TorchvisionDataModule` for the arguments. Files: ``root/cifar-10-batches-py/``.
    """

    display_name = "CIFAR-10"
    expected_files = "<root>/cifar-10-batches-py/{data_batch_1..data_batch_5, test_batch, batches.meta}"
    num_classes = 10
    dataset_class = "CIFAR10"


class CIFAR100DataModule(_CIFARDataModule):
    """CIFAR-100 (50,000 train / 10,000 test 3x32x32 images, 100 fine classes) split over clients.

    FedRep's settings are 100 clients with 5 or 20 classes each (``classes_per_client=5``). Normalised
    with the CIFAR-100 statistics the official code uses; otherwise as :class:`CIFAR10DataModule`.
    Files: ``root/cifar-100-python/``.
    """

    display_name = "CIFAR-100"
    expected_files = "<root>/cifar-100-python/{train, test, meta}"
    num_classes = 100
    mean = CIFAR100_MEAN
    std = CIFAR100_STD
    dataset_class = "CIFAR100"


class MNISTDataModule(TorchvisionDataModule):
    """MNIST (60,000 train / 10,000 test 1x28x28 digits) split over clients.

    Images are ``ToTensor()`` then ``Normalize((0.1307,), (0.3081,))``; see
    :class:`TorchvisionDataModule` for the arguments. Files: the four uncompressed idx files
    ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``.
    """

    display_name = "MNIST"
    expected_files = "<root>/MNIST/raw/{train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte}"
    num_classes = 10

    def _make_dataset(self, train: bool, download: bool, transform: Callable | None) -> Dataset:
        return _torchvision().datasets.MNIST(self.root, train=train, download=download, transform=transform)

    def _transform(self, train: bool) -> Callable:
        transforms = _torchvision().transforms
        return transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])


EMNIST_SPLITS: dict[str, int] = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}
"""Number of classes of each EMNIST split (``letters`` after the shift to 0-25, see below)."""


class EMNISTDataModule(MNISTDataModule):
    """One EMNIST split (``"digits"``, ``"letters"``, ``"balanced"``, ``"byclass"``, ``"bymerge"``,
    ``"mnist"``) split over clients, with MNIST's transforms.

    ``first_classes=N`` keeps only the samples of classes ``0..N-1`` (the SRPFL paper's EMNIST: the first 10
    letters, ``split="letters", first_classes=10``); ``num_classes`` is then ``N``. The official SRPFL code
    draws each client's test set with replacement (``test_draws=50``: 4,000 samples per client at 100
    clients with 5 classes each, instead of 80 disjoint ones).

    Two properties of the data to know:

    * ``split="letters"``: torchvision labels the letters 1-26 (class 0, "N/A", is empty). This module
      shifts them to 0-25 (``targets - 1``; ``classes`` loses "N/A"), so a 26-way head works.
      ``num_classes`` gives the head size of every split.
    * The EMNIST idx files store every image transposed relative to MNIST, and torchvision does not undo
      that; neither does this module (it does not matter for training on EMNIST alone, but a model
      trained on MNIST sees EMNIST images transposed).

    This is NIST's EMNIST, not LEAF's FEMNIST (which keeps the writers, i.e. the natural clients): for
    FedRep's FEMNIST use :class:`lightning_fedrep.data.leaf.LEAFDataModule`. Files:
    ``root/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte``.

    Args:
        split: the EMNIST split (a key of :data:`EMNIST_SPLITS`).
        first_classes: keep only the samples of the first ``first_classes`` classes; ``None`` keeps all.
        *args, **kwargs: the other arguments of :class:`TorchvisionDataModule`, in its order after ``root``.
    """

    display_name = "EMNIST"

    def __init__(
        self,
        root: str = "data",
        split: str = "digits",
        *args: Any,
        first_classes: int | None = None,
        **kwargs: Any,
    ):
        if split not in EMNIST_SPLITS:
            raise ValueError(f"EMNIST split must be one of {sorted(EMNIST_SPLITS)}, got {split!r}.")
        if first_classes is not None:
            check_int(
                "first_classes",
                first_classes,
                minimum=1,
                maximum=EMNIST_SPLITS[split],
                owner="EMNISTDataModule",
            )
        super().__init__(root, *args, **kwargs)
        self.split = split
        self.first_classes = first_classes
        self.num_classes = first_classes or EMNIST_SPLITS[split]
        self.expected_files = (
            f"<root>/EMNIST/raw/emnist-{split}-{{train,test}}-{{images-idx3,labels-idx1}}-ubyte (4 files)"
        )

    def _make_dataset(self, train: bool, download: bool, transform: Callable | None) -> Dataset:
        dataset = _torchvision().datasets.EMNIST(
            self.root, split=self.split, train=train, download=download, transform=transform
        )
        if self.split == "letters":
            dataset.targets = dataset.targets - 1
            dataset.classes = list(dataset.classes[1:])
        if self.first_classes is not None:  # e.g. the SRPFL paper's first 10 letters
            keep = dataset.targets < self.first_classes
            dataset.data, dataset.targets = dataset.data[keep], dataset.targets[keep]
            dataset.classes = list(dataset.classes[: self.first_classes])
        return dataset


class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST (60,000 train / 10,000 test 1x28x28 images of 10 clothing classes) split over clients.

    Images are ``ToTensor()`` then ``Normalize((0.2860,), (0.3530,))`` (the data set's statistics), or
    PFLlib's ``Normalize((0.5,), (0.5,))`` with ``preprocessing="pfllib"``; no augmentation. PFLlib's
    leaderboard setting (FMNIST, 20 clients) is ``partitioner=PFLlibPartitioner(20, ...)`` with
    ``preprocessing="pfllib"`` (``recipes/pfllib/``). Files: torchvision's layout, the four uncompressed idx
    files ``root/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (MNIST's format).

    Args:
        preprocessing: ``"default"`` (the data set's mean and standard deviation) or ``"pfllib"``.
        *args, **kwargs: the arguments of :class:`TorchvisionDataModule`, in its order.
    """

    display_name = "Fashion-MNIST"
    expected_files = "<root>/FashionMNIST/raw/{train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte}"
    num_classes = 10

    def __init__(self, *args: Any, preprocessing: Literal["default", "pfllib"] = "default", **kwargs: Any):
        _check_preprocessing(type(self).__name__, preprocessing)
        super().__init__(*args, **kwargs)
        self.preprocessing = preprocessing

    def _make_dataset(self, train: bool, download: bool, transform: Callable | None) -> Dataset:
        return _torchvision().datasets.FashionMNIST(
            self.root, train=train, download=download, transform=transform
        )

    def _transform(self, train: bool) -> Callable:
        transforms = _torchvision().transforms
        mean, std = (
            (FASHION_MNIST_MEAN, FASHION_MNIST_STD) if self.preprocessing == "default" else ((0.5,), (0.5,))
        )
        return transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
