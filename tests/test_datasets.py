"""The data modules, each fed tiny files in its data set's real on-disk format and read by the real code.

CIFAR: the python-pickle batches torchvision reads (``cifar-10-batches-py``, ``cifar-100-python``); MNIST
and EMNIST: uncompressed big-endian idx-ubyte files under ``<Name>/raw``; LEAF: JSON files. torchvision
checks CIFAR files against the real files' md5 sums, so the CIFAR tests (only) replace
``torchvision.datasets.cifar.check_integrity`` by an existence check.
"""

from __future__ import annotations

import ast
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedrep import FedRepStrategy, PFLlibPartitioner
from lightning_fedrep.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    FashionMNISTDataModule,
    LEAFDataModule,
    MNISTDataModule,
    NaturalPartitioner,
    SyntheticClassificationDataModule,
)
from lightning_fedrep.data.partition import IIDPartitioner, ShardPartitioner
from lightning_fedrep.data.synthetic_classification import make_synthetic_classification
from lightning_fedrep.models import CIFAR10CNN, CIFAR100CNN, FEMNISTMLP, MLPClassifier
from tests.fixtures import (
    leaf_user,
    quiet_trainer,
    random_images,
    write_cifar10,
    write_cifar100,
    write_leaf_file,
)

torchvision = pytest.importorskip("torchvision")

# ----------------------------------------------------------------------------- real-format writers


def write_idx(path: Path, array: np.ndarray) -> None:
    """An idx-ubyte file: magic 0x0000 08 <ndim>, big-endian uint32 sizes, then the uint8 data."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist_like(raw: Path, prefixes: dict[str, str], labels: dict[str, np.ndarray]) -> None:
    raw.mkdir(parents=True, exist_ok=True)  # several EMNIST splits may share one raw folder
    for split, prefix in prefixes.items():
        y = labels[split]
        write_idx(raw / f"{prefix}-images-idx3-ubyte", random_images(len(y), (28, 28), len(y)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y.astype(np.uint8))


def write_mnist(root: Path, n_train: int = 40, n_test: int = 20) -> None:
    write_mnist_like(
        root / "MNIST" / "raw",
        {"train": "train", "test": "t10k"},
        {"train": np.arange(n_train) % 10, "test": np.arange(n_test) % 10},
    )


def write_fashion_mnist(root: Path, train_labels: np.ndarray, test_labels: np.ndarray) -> None:
    """``FashionMNIST/raw``: MNIST's four idx files (torchvision's FashionMNIST reads the same format)."""
    write_mnist_like(
        root / "FashionMNIST" / "raw",
        {"train": "train", "test": "t10k"},
        {"train": train_labels, "test": test_labels},
    )


def write_emnist(root: Path, split: str, n_train: int, n_test: int, labels: np.ndarray) -> None:
    write_mnist_like(
        root / "EMNIST" / "raw",
        {"train": f"emnist-{split}-train", "test": f"emnist-{split}-test"},
        {"train": labels[np.arange(n_train) % len(labels)], "test": labels[np.arange(n_test) % len(labels)]},
    )


@pytest.fixture
def no_md5(monkeypatch):
    """The tiny CIFAR files cannot match the real md5 sums: check only that the files exist."""
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


# ----------------------------------------------------------------------------- laziness, errors


def test_construction_touches_no_disk(tmp_path):
    missing = tmp_path / "nowhere"
    for cls in (
        CIFAR10DataModule,
        CIFAR100DataModule,
        MNISTDataModule,
        EMNISTDataModule,
        FashionMNISTDataModule,
    ):
        module = cls(root=str(missing), download=False)
        module.prepare_data()  # download=False: nothing to do
    LEAFDataModule(train_dir=str(missing / "train"), test_dir=str(missing / "test"))
    SyntheticClassificationDataModule()
    assert not missing.exists()


def test_vision_module_imports_torchvision_lazily():
    tree = ast.parse(Path(__file__).parents[1].joinpath("lightning_fedrep/data/vision.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top_level for a in n.names] + [
        n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)
    ]
    assert not any(name.startswith("torchvision") for name in names)


@pytest.mark.parametrize(
    "cls, expected",
    [
        (CIFAR10DataModule, "cifar-10-batches-py"),
        (CIFAR100DataModule, "cifar-100-python"),
        (MNISTDataModule, "MNIST/raw"),
        (EMNISTDataModule, "EMNIST/raw/emnist-digits"),
        (FashionMNISTDataModule, "FashionMNIST/raw"),
    ],
)
def test_missing_files_say_download_true(tmp_path, cls, expected):
    module = cls(root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="download=True") as info:
        module.setup("fit")
    assert expected in str(info.value) and str(tmp_path) in str(info.value)


def test_emnist_rejects_unknown_split():
    with pytest.raises(ValueError, match="letters"):
        EMNISTDataModule(split="lowercase")


def test_download_true_downloads_when_missing(tmp_path, monkeypatch, no_md5):
    """With download=True, missing files are fetched (here: written by a stand-in for the download)."""
    calls = []

    def fake_download(self):
        calls.append(self.root)
        if not (Path(self.root) / "cifar-10-batches-py").exists():
            write_cifar10(Path(self.root))

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", fake_download)
    module = CIFAR10DataModule(root=str(tmp_path), num_clients=5, download=True)
    module.prepare_data()
    assert calls and (tmp_path / "cifar-10-batches-py" / "data_batch_5").is_file()
    module.setup("fit")
    assert module.num_clients == 5
    # setup without prepare_data (e.g. data.num_clients outside a Trainer) downloads too
    fresh = CIFAR10DataModule(root=str(tmp_path / "fresh"), num_clients=5, download=True)
    assert fresh.num_clients == 5 and calls[-1] == str(tmp_path / "fresh")


# ----------------------------------------------------------------------------- CIFAR


def test_cifar10_real_format(tmp_path, no_md5):
    write_cifar10(tmp_path)
    module = CIFAR10DataModule(root=str(tmp_path), num_clients=5, classes_per_client=2, seed=3)
    module.setup("fit")
    assert isinstance(module.train_set, torchvision.datasets.CIFAR10)
    assert len(module.train_set) == 40 and len(module.test_set) == 20
    assert module.num_classes == 10 and module.num_clients == 5
    labels_train = torch.as_tensor(module.train_set.targets)
    labels_test = torch.as_tensor(module.test_set.targets)
    for client in range(5):
        train, test = module.client_data(client, "train"), module.client_data(client, "test")
        assert len(train) == 8 and len(test) == 4
        classes = set(labels_train[train.indices].tolist())
        assert len(classes) == 2 and set(labels_test[test.indices].tolist()) == classes
    # test transform: ToTensor + Normalize with the ImageNet statistics the official code uses
    x, y = module.test_set[0]
    raw = torch.from_numpy(module.test_set.data[0]).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert x.shape == (3, 32, 32) and y == 0
    assert torch.allclose(x, (raw - mean[:, None, None]) / std[:, None, None], atol=1e-6)
    # training transform: random crop (padding 4) and flip first, then the same normalisation
    train_steps = [type(t).__name__ for t in module.train_set.transform.transforms]
    assert train_steps == ["RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert module.train_set[0][0].shape == (3, 32, 32)
    plain = CIFAR10DataModule(root=str(tmp_path), num_clients=5, augment=False)
    plain.setup()
    assert [type(t).__name__ for t in plain.train_set.transform.transforms] == ["ToTensor", "Normalize"]


def test_cifar_validation_split_is_not_augmented(tmp_path, no_md5):
    write_cifar10(tmp_path)
    module = CIFAR10DataModule(root=str(tmp_path), num_clients=5, val_fraction=0.25)
    module.setup("fit")
    val = module.client_data(0, "val")
    assert len(val) == 2 and len(module.client_data(0, "train")) == 6
    assert val.dataset.data is module.train_set.data  # a view of the same images, not a copy
    assert [type(t).__name__ for t in val.dataset.transform.transforms] == ["ToTensor", "Normalize"]
    assert "RandomCrop" in [type(t).__name__ for t in module.train_set.transform.transforms]
    batch = next(iter(module.val_dataloader()))
    assert batch[0].shape == (2, 3, 32, 32)


def test_cifar100_real_format(tmp_path, no_md5):
    write_cifar100(tmp_path)
    module = CIFAR100DataModule(root=str(tmp_path), num_clients=10, classes_per_client=10)
    module.setup()
    assert isinstance(module.train_set, torchvision.datasets.CIFAR100)
    assert module.num_classes == 100 and module.num_clients == 10
    assert all(
        len(module.client_data(c)) == 20 and len(module.client_data(c, "test")) == 10 for c in range(10)
    )
    normalize = module.test_set.transform.transforms[-1]
    assert tuple(normalize.mean) == (0.507, 0.487, 0.441) and tuple(normalize.std) == (0.267, 0.256, 0.276)
    x, _ = module.test_set[0]
    assert x.shape == (3, 32, 32)


# ----------------------------------------------------------------------------- MNIST, EMNIST


def test_mnist_real_format(tmp_path):
    write_mnist(tmp_path)
    module = MNISTDataModule(root=str(tmp_path), num_clients=4, partitioner=IIDPartitioner(4))
    module.setup()
    assert isinstance(module.train_set, torchvision.datasets.MNIST)
    assert module.num_clients == 4 and sum(len(module.client_data(c)) for c in range(4)) == 40
    x, y = module.train_set[3]
    assert x.shape == (1, 28, 28) and y == 3
    raw = module.train_set.data[3].float() / 255
    assert torch.allclose(x[0], (raw - 0.1307) / 0.3081, atol=1e-5)


def test_fashion_mnist_real_format_and_both_preprocessings(tmp_path):
    write_fashion_mnist(tmp_path, np.arange(40) % 10, np.arange(20) % 10)
    module = FashionMNISTDataModule(root=str(tmp_path), num_clients=5, classes_per_client=2)
    module.setup()
    assert isinstance(module.train_set, torchvision.datasets.FashionMNIST)
    assert module.num_classes == 10 and module.num_clients == 5
    x, y = module.train_set[3]
    raw = module.train_set.data[3].float() / 255
    assert x.shape == (1, 28, 28) and y == 3
    assert torch.allclose(x[0], (raw - 0.2860) / 0.3530, atol=1e-5)
    pfllib = FashionMNISTDataModule(root=str(tmp_path), num_clients=5, preprocessing="pfllib")
    pfllib.setup()
    assert torch.allclose(pfllib.train_set[3][0][0], (raw - 0.5) / 0.5, atol=1e-6)
    assert torch.allclose(
        pfllib.test_set[0][0][0], (pfllib.test_set.data[0].float() / 255 - 0.5) / 0.5, atol=1e-6
    )


def test_pfllib_preprocessing_on_cifar(tmp_path, no_md5):
    """PFLlib's generate_Cifar*.py: ToTensor + Normalize(0.5, 0.5) per channel, no augmentation."""
    write_cifar10(tmp_path / "c10")
    write_cifar100(tmp_path / "c100")
    for cls, root in ((CIFAR10DataModule, "c10"), (CIFAR100DataModule, "c100")):
        module = cls(root=str(tmp_path / root), num_clients=2, classes_per_client=10, preprocessing="pfllib")
        module.setup()
        assert module.augment is False
        for dataset in (module.train_set, module.test_set):
            assert [type(t).__name__ for t in dataset.transform.transforms] == ["ToTensor", "Normalize"]
            x, _ = dataset[1]
            raw = torch.from_numpy(dataset.data[1]).permute(2, 0, 1).float() / 255
            assert torch.allclose(x, (raw - 0.5) / 0.5, atol=1e-6)
    augmented = CIFAR10DataModule(root=str(tmp_path / "c10"), preprocessing="pfllib", augment=True)
    assert augmented.augment is True
    with pytest.raises(ValueError, match="preprocessing="):
        CIFAR10DataModule(preprocessing="pflib")
    with pytest.raises(ValueError, match="preprocessing="):
        FashionMNISTDataModule(preprocessing="none")


def test_pooled_clients_read_each_sample_with_the_transform_of_their_use(tmp_path, no_md5):
    """With PFLlibPartitioner the clients index train ++ test: training samples taken from the test file are
    augmented like the training file's, evaluated samples taken from the training file are not."""
    write_cifar10(tmp_path, per_batch=40, n_test=100)
    module = CIFAR10DataModule(
        root=str(tmp_path), partitioner=PFLlibPartitioner(4, partition="pat", classes_per_client=5), seed=1
    )
    module.setup()
    train, test = module.client_data(0, "train"), module.client_data(0, "test")
    assert train.dataset.datasets[0] is module.train_set
    assert "RandomCrop" in repr(train.dataset.datasets[1].transform)
    assert test.dataset.datasets[1] is module.test_set
    assert "Random" not in repr(test.dataset.datasets[0].transform)
    pool_labels = module.train_set.targets + module.test_set.targets
    split = module.partitioner.split(
        torch.tensor(module.train_set.targets), torch.tensor(module.test_set.targets), seed=1
    )
    assert train.indices.tolist() == split.train[0].tolist()
    assert [test.dataset[int(i)][1] for i in test.indices] == [pool_labels[int(i)] for i in test.indices]
    assert sum(len(module.client_data(c)) + len(module.client_data(c, "test")) for c in range(4)) == 300
    batch = next(iter(module.val_dataloader()))
    assert batch[0].shape[1:] == (3, 32, 32)


def test_emnist_digits_real_format(tmp_path):
    write_emnist(tmp_path, "digits", 40, 20, np.arange(10))
    module = EMNISTDataModule(root=str(tmp_path), split="digits", num_clients=5, classes_per_client=2)
    module.setup()
    assert isinstance(module.train_set, torchvision.datasets.EMNIST)
    assert module.num_classes == 10 and module.num_clients == 5
    assert module.train_set[0][0].shape == (1, 28, 28)


def test_emnist_letters_are_shifted_to_zero_based(tmp_path):
    write_emnist(tmp_path, "letters", 52, 26, np.arange(1, 27))  # torchvision's letters labels: 1..26
    module = EMNISTDataModule(root=str(tmp_path), split="letters", num_clients=13, classes_per_client=2)
    module.setup()
    assert module.num_classes == 26
    assert module.train_set.targets.min() == 0 and module.train_set.targets.max() == 25
    assert module.train_set.classes[0] == "a" and len(module.train_set.classes) == 26
    assert module.train_set[0][1] == 0


def test_emnist_first_classes_keeps_the_first_letters_only(tmp_path):
    """The SRPFL paper's EMNIST: the letters split, its first 10 classes (a-j)."""
    write_emnist(tmp_path, "letters", 104, 52, np.arange(1, 27))
    module = EMNISTDataModule(
        root=str(tmp_path), split="letters", first_classes=10, num_clients=5, classes_per_client=2
    )
    module.setup()
    assert module.num_classes == 10 and module.train_set.classes == list("abcdefghij")
    assert sorted(module.train_set.targets.unique().tolist()) == list(range(10))
    assert len(module.train_set) == 40 and len(module.test_set) == 20  # 4 and 2 of each kept letter
    assert sum(len(module.client_data(c)) for c in range(5)) == 40
    with pytest.raises(ValueError, match="first_classes"):
        EMNISTDataModule(split="letters", first_classes=27)


# ----------------------------------------------------------------------------- LEAF


@pytest.fixture
def leaf_dirs(tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    # users f_b, f_a, f_c in both splits (over two files each); one user only in each split
    write_leaf_file(
        train / "all_data_0_niid_05_keep_50_train_9.json", {"f_b": leaf_user(1, 3), "f_a": leaf_user(0, 5)}
    )
    write_leaf_file(
        train / "all_data_1_niid_05_keep_50_train_9.json",
        {"f_c": leaf_user(2, 4), "f_train_only": leaf_user(7, 2)},
    )
    write_leaf_file(
        test / "all_data_0_niid_05_keep_50_test_9.json",
        {"f_a": leaf_user(0, 2, 5), "f_b": leaf_user(1, 1, 5)},
    )
    write_leaf_file(
        test / "all_data_1_niid_05_keep_50_test_9.json",
        {"f_c": leaf_user(2, 2, 5), "f_test_only": leaf_user(8, 1)},
    )
    return train, test


def test_leaf_users_become_clients(leaf_dirs):
    train, test = leaf_dirs
    module = LEAFDataModule(train_dir=str(train), test_dir=str(test), batch_size=2, user_order="id")
    module.setup("fit")
    assert module.users == ["f_a", "f_b", "f_c"]
    assert module.dropped_users == ["f_test_only", "f_train_only"]
    assert module.num_clients == 3
    assert [len(module.client_data(c)) for c in range(3)] == [5, 3, 4]
    assert [len(module.client_data(c, "test")) for c in range(3)] == [2, 1, 2]
    assert module.train_set.tensors[0].shape == (12, 1, 28, 28)
    assert module.train_set.tensors[0].dtype == torch.float32
    assert module.train_set.tensors[1].dtype == torch.int64
    user_index = {"f_a": 0, "f_b": 1, "f_c": 2}
    for client, user in enumerate(module.users):
        for split, offset in (("train", 0), ("test", 5)):
            data = module.client_data(client, split)
            x, y = data.dataset.tensors[0][data.indices], data.dataset.tensors[1][data.indices]
            # every sample is this user's own: pixel 0 encodes the user, labels follow its pattern
            assert torch.all((x[:, 0, 0, 0] * 10).floor() == user_index[user])
            expected = [(user_index[user] + offset + j) % 10 for j in range(len(y))]
            assert y.tolist() == expected
            assert torch.all(x[:, 0, 0, 1:] == 1.0)  # pixel values kept as given (white = 1.0)
    batch = next(iter(module.test_dataloader()))
    assert batch[0].shape == (2, 1, 28, 28)


def test_leaf_max_clients_and_flat_features(leaf_dirs):
    train, test = leaf_dirs
    module = LEAFDataModule(str(train), str(test), image_shape=None, max_clients=2, user_order="id")
    module.setup()
    assert module.users == ["f_a", "f_b"] and module.num_clients == 2
    assert module.train_set.tensors[0].shape == (8, 784)
    assert module.test_set.tensors[0].shape == (3, 784)


def test_leaf_errors(tmp_path, leaf_dirs):
    train, test = leaf_dirs
    with pytest.raises(ValueError, match="image_shape"):
        LEAFDataModule(str(train), str(test), image_shape=(3, 32, 32)).setup()
    with pytest.raises(FileNotFoundError, match="json"):
        (tmp_path / "empty").mkdir()
        LEAFDataModule(str(tmp_path / "empty"), str(test)).setup()
    write_leaf_file(train / "zz_duplicate.json", {"f_a": leaf_user(0, 1)})
    with pytest.raises(ValueError, match="appears twice"):
        LEAFDataModule(str(train), str(test)).setup()
    text_train, text_test = tmp_path / "t_train", tmp_path / "t_test"
    tweet = {"x": [["id", "date", "query", "user", "so happy today"]], "y": [1]}
    write_leaf_file(text_train / "a.json", {"u": tweet})
    write_leaf_file(text_test / "a.json", {"u": tweet})
    with pytest.raises(ValueError, match="numeric"):
        LEAFDataModule(str(text_train), str(text_test), image_shape=None).setup()


def test_leaf_reads_the_official_my_sample_float_labels_and_refuses_fractional_ones(tmp_path):
    """The official my_sample.py writes class ids as floats (``3.0``); a fractional label is still refused."""
    users = {"f_00000": leaf_user(0, 4), "f_00001": leaf_user(1, 3)}
    for user in users.values():
        user["y"] = [float(y) for y in user["y"]]
    write_leaf_file(tmp_path / "train" / "mytrain.json", users)
    write_leaf_file(tmp_path / "test" / "mytest.json", users)
    module = LEAFDataModule(str(tmp_path / "train"), str(tmp_path / "test"))
    module.setup()
    data = module.client_data(1)
    assert data.dataset.tensors[1].dtype == torch.int64
    assert data.dataset.tensors[1][data.indices].tolist() == [1, 2, 3]
    users["f_00000"]["y"][0] = 0.5
    write_leaf_file(tmp_path / "bad" / "train.json", users)
    with pytest.raises(ValueError, match="integer class ids"):
        LEAFDataModule(str(tmp_path / "bad"), str(tmp_path / "test")).setup()


# ----------------------------------------------------------------------------- NaturalPartitioner


def test_natural_partitioner():
    train_groups = torch.tensor([7, 2, 7, 9, 2, 2])
    test_groups = torch.tensor([2, 5, 9, 9])  # group 5 has no train samples: nobody's
    partitioner = NaturalPartitioner(train_groups, test_groups)
    assert partitioner.num_clients == 3  # groups 2, 7, 9 -> clients 0, 1, 2
    split = partitioner.split(torch.zeros(6, dtype=torch.long), torch.zeros(4, dtype=torch.long), seed=0)
    assert [t.tolist() for t in split.train] == [[1, 4, 5], [0, 2], [3]]
    assert [t.tolist() for t in split.test] == [[0], [], [2, 3]]
    assert partitioner.split(torch.zeros(6), None, seed=5).test[0].numel() == 0
    with pytest.raises(ValueError, match="one group id per train sample"):
        partitioner.split(torch.zeros(5, dtype=torch.long), None, 0)
    with pytest.raises(ValueError, match="test_groups"):
        NaturalPartitioner(train_groups).split(torch.zeros(6), torch.zeros(4), 0)
    with pytest.raises(ValueError, match="integer"):
        NaturalPartitioner(torch.tensor([0.5, 1.0]))
    assert "num_clients=3" in repr(partitioner)


# ----------------------------------------------------------------------------- synthetic classification


def test_synthetic_classification_shapes_and_determinism():
    args = dict(num_clients=6, samples_per_client=200, test_samples_per_client=50, dim=12, num_classes=5)
    train, test = make_synthetic_classification(**args, classes_per_client=2, hidden=4, seed=1)
    assert len(train) == len(test) == 6
    for tr, te in zip(train, test):
        assert tr.tensors[0].shape == (200, 12) and tr.tensors[0].dtype == torch.float32
        assert tr.tensors[1].shape == (200,) and tr.tensors[1].dtype == torch.int64
        assert te.tensors[0].shape == (50, 12)
        classes = set(tr.tensors[1].tolist())
        assert len(classes) == 2 and classes <= set(range(5))  # exactly its own 2 classes
        assert set(te.tensors[1].tolist()) <= classes
    again, _ = make_synthetic_classification(**args, classes_per_client=2, hidden=4, seed=1)
    assert all(
        torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
        for a, b in zip(train, again)
    )
    other, _ = make_synthetic_classification(**args, classes_per_client=2, hidden=4, seed=2)
    assert not torch.equal(train[0].tensors[0], other[0].tensors[0])
    # the test size does not change the training data
    more_test = dict(args, test_samples_per_client=10)
    same_train, _ = make_synthetic_classification(**more_test, classes_per_client=2, hidden=4, seed=1)
    assert torch.equal(same_train[3].tensors[1], train[3].tensors[1])
    three, _ = make_synthetic_classification(**args, classes_per_client=3, hidden=4, seed=1)
    assert all(len(set(d.tensors[1].tolist())) <= 3 for d in three)
    with pytest.raises(ValueError, match="classes_per_client"):
        make_synthetic_classification(num_classes=3, classes_per_client=4)


def test_synthetic_clients_need_personal_heads():
    """Two clients with the same classes label the same inputs differently (a shared head cannot fit)."""
    train, _ = make_synthetic_classification(
        num_clients=40, samples_per_client=10, num_classes=2, classes_per_client=2, seed=0
    )
    labels = torch.stack([d.tensors[1] for d in train])  # all clients hold classes {0, 1}
    assert 0.2 < labels.float().mean() < 0.8
    assert len({tuple(row.tolist()) for row in labels}) > 1


def test_synthetic_data_module_matches_generator():
    module = SyntheticClassificationDataModule(
        num_clients=4, samples_per_client=30, test_samples_per_client=10, seed=5
    )
    module.setup()
    train, test = make_synthetic_classification(4, 30, 10, 20, 10, 2, 8, seed=5)
    assert module.num_clients == 4 and module.num_classes == 10
    for client in range(4):
        for split, reference in (("train", train), ("test", test)):
            data = module.client_data(client, split)
            assert torch.equal(data.dataset.tensors[0][data.indices], reference[client].tensors[0])
            assert torch.equal(data.dataset.tensors[1][data.indices], reference[client].tensors[1])


# ----------------------------------------------------------------------------- end to end, one round each


def _cifar10(tmp_path):
    write_cifar10(tmp_path)
    return CIFAR10DataModule(root=str(tmp_path), num_clients=5, batch_size=4), CIFAR10CNN()


def _cifar100(tmp_path):
    write_cifar100(tmp_path)
    return CIFAR100DataModule(
        root=str(tmp_path), num_clients=10, classes_per_client=10, batch_size=10
    ), CIFAR100CNN()


def _mnist(tmp_path):
    write_mnist(tmp_path)
    return MNISTDataModule(root=str(tmp_path), num_clients=5, batch_size=4), FEMNISTMLP()


def _emnist(tmp_path):
    write_emnist(tmp_path, "letters", 52, 26, np.arange(1, 27))
    return EMNISTDataModule(root=str(tmp_path), split="letters", num_clients=13), FEMNISTMLP(num_classes=26)


def _leaf(tmp_path):
    for split, offset in (("train", 0), ("test", 5)):
        for f in range(2):
            users = {f"w{f}{u}": leaf_user(2 * f + u, 4, offset) for u in range(2)}
            write_leaf_file(tmp_path / split / f"part{f}.json", users)
    return LEAFDataModule(str(tmp_path / "train"), str(tmp_path / "test"), batch_size=2), FEMNISTMLP(
        output="softmax"
    )


def _synthetic(tmp_path):
    data = SyntheticClassificationDataModule(num_clients=4, samples_per_client=20, test_samples_per_client=10)
    return data, MLPClassifier(in_features=20, num_classes=10)


@pytest.mark.parametrize("build", [_cifar10, _cifar100, _mnist, _emnist, _leaf, _synthetic])
def test_one_fedrep_round(tmp_path, monkeypatch, build):
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    data, model = build(tmp_path)
    strategy = FedRepStrategy(clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(model, datamodule=data)
    assert trainer.current_epoch == 1
    if not isinstance(model, MLPClassifier):
        assert torch.isfinite(trainer.callback_metrics["train/loss"])
    results = trainer.test(model, datamodule=data, verbose=False)[0]
    assert 0.0 <= results["test/acc"] <= 1.0
    assert np.isfinite(results["test/loss"])
    assert len(strategy.client_metrics["test"].per_client("test/acc")) == data.num_clients


def test_default_partition_is_fedrep_shards():
    module = CIFAR10DataModule()
    assert isinstance(module.partitioner, ShardPartitioner)
    assert module.partitioner.num_clients == 100 and module.partitioner.classes_per_client == 2
    assert module.batch_size == 10
