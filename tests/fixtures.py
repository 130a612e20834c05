"""What the tests share: a tiny classifier and a small label-skewed federation, a quiet Trainer, the
per-step batches of the plain-PyTorch reference loops, and writers of tiny data files in each data
set's real on-disk format."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, RunnerSettings
from lightning_fedrep.data.partition import ShardPartitioner


class TinyNet(L.LightningModule):
    """Two-layer MLP; ``classifier`` is the head."""

    def __init__(
        self, lr: float = 0.05, momentum: float = 0.5, weight_decay: float = 1e-3, dropout: float = 0.0
    ):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.ReLU(), nn.Dropout(dropout), nn.Linear(12, 8), nn.ReLU()
        )
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_ce", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        hp = self.hparams
        return torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )


class MarkedTinyNet(TinyNet):
    fedrep_head = "classifier"


def tiny_datasets(n_train: int = 480, n_test: int = 160, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, 6, generator=g)
    y = ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()).long()
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def tiny_datamodule(
    num_clients: int = 8, classes_per_client: int = 2, batch_size: int = 8, seed: int = 0, **kw
):
    train, test = tiny_datasets(seed=seed)
    return FederatedDataModule(
        train,
        test,
        partitioner=ShardPartitioner(num_clients, classes_per_client),
        batch_size=batch_size,
        seed=seed,
        **kw,
    )


RUNNER_FIELDS = ("width", "memory", "steps_per_call", "compile")


def runner_setting(runner, settings: dict):
    """``runner`` (a choice's name) with the :class:`RunnerSettings` fields popped from ``settings``
    (``width=2``, ``steps_per_call=1``, ...): the strategy's ``runner=`` argument, for tests' ``fit`` helpers."""
    fields = {name: settings.pop(name) for name in RUNNER_FIELDS if name in settings}
    return RunnerSettings(runner, **fields) if fields else runner


def quiet_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


# ----------------------------------------------------------------------------- the seeding and sampling rules, restated

# The reference loops use these restatements, never the library's ``round_generator``/``sample_clients``,
# so a sampler or seeding bug cannot hide in both (``tests/test_claims.py`` checks the library's sampler
# equals ``reference_clients`` and is uniform). Tests that still call library code for a rule they rely on,
# and why (no independent reference is possible or the helper is itself the unit under test):
# ``plan_round``/``shard_round``/``plan_fingerprint`` (test_sharding, test_federation: unit tests of those
# functions against hand-computed step counts), ``WeightedAverage`` (its own unit tests against hand sums),
# ``summarize`` (test_evaluation: closed form), ``principal_angle_distance``/``method_of_moments_init``
# (measurement and initialisation applied to both the library's run and the reference, not the rule under
# test; ``benchmarks/fedrep/reference_linear.py`` has its own distance), the data modules and models
# (inputs, not rules), and the collapse metrics (rewritten separately).


def documented_pages() -> dict[str, str]:
    """The text a user reads, by path relative to the repository: README.md and every page of the docs site
    (``docs/**/*.md``; not built output), for the tests that check a
    documented figure or table against what the code prints."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    return {
        str(page.relative_to(root)): page.read_text()
        for page in pages
        if not {"_build", "node_modules"} & set(page.relative_to(root).parts)
    }


def reference_generator(seed: int, *keys: int) -> torch.Generator:
    """The seeding rule of every draw (sampling, shuffles, validation splits), restated: start from
    ``seed mod 2**32``, fold in each key ``k`` as ``v -> (1_000_003 * v + k + 1) mod (2**61 - 1)``, and
    seed a CPU ``torch.Generator`` with ``v``."""
    value = seed % 2**32
    for key in keys:
        value = (1_000_003 * value + key + 1) % (2**61 - 1)
    generator = torch.Generator()
    generator.manual_seed(value)
    return generator


def reference_clients(num_clients: int, count: int | float, seed: int, round_index: int) -> list[int]:
    """Client sampling as docs/concepts.md (*Rounds*) states it, restated: ``count`` of ``num_clients`` clients uniformly
    without replacement, seeded by ``(seed, round)`` — the first ``count`` entries of a random permutation
    drawn with ``reference_generator(seed, round)`` — in increasing order (all clients when ``count`` is
    all of them)."""
    if isinstance(count, float):  # a fraction of the clients, rounded to the nearest count
        count = max(1, int(round(count * num_clients)))
    assert isinstance(count, int) and 1 <= count <= num_clients, "give a client count or a fraction"
    if count == num_clients:
        return list(range(num_clients))
    permutation = torch.randperm(num_clients, generator=reference_generator(seed, round_index))
    return sorted(int(c) for c in permutation[:count])


# ----------------------------------------------------------------------------- reference loops' batches

HEAD = ("classifier.weight", "classifier.bias")


def client_batches(dm, seed, round_index, client, num_steps):
    """Batches of a client's steps in a round, re-derived here: a fresh permutation per pass."""
    data = dm.client_data(client)
    x, y = data.dataset.tensors
    per_epoch = math.ceil(len(data) / dm.batch_size)
    for step in range(num_steps):
        epoch_pass, j = divmod(step, per_epoch)
        perm = torch.randperm(len(data), generator=reference_generator(seed, round_index, client, epoch_pass))
        idx = data.indices[perm[j * dm.batch_size : (j + 1) * dm.batch_size]]
        yield x[idx], y[idx]


# ----------------------------------------------------------------------------- real-format data files


def random_images(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root: Path, per_batch: int = 8, n_test: int = 20) -> None:
    """``cifar-10-batches-py``: ``data_batch_1..5`` and ``test_batch`` ({'data': (n, 3072) uint8 in CHW
    order, 'labels': list}), and ``batches.meta`` ({'label_names': ...})."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for b in range(1, 6):
        _pickle(
            folder / f"data_batch_{b}",
            {
                "batch_label": f"training batch {b} of 5",
                "labels": [(b * per_batch + i) % 10 for i in range(per_batch)],
                "data": random_images(per_batch, (3072,), b),
                "filenames": [f"img_{b}_{i}.png" for i in range(per_batch)],
            },
        )
    _pickle(
        folder / "test_batch",
        {
            "batch_label": "testing batch 1 of 1",
            "labels": [i % 10 for i in range(n_test)],
            "data": random_images(n_test, (3072,), 99),
            "filenames": [f"test_{i}.png" for i in range(n_test)],
        },
    )
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _pickle(
        folder / "batches.meta", {"num_cases_per_batch": per_batch, "label_names": names, "num_vis": 3072}
    )


def write_cifar100(root: Path, n_train: int = 200, n_test: int = 100) -> None:
    """``cifar-100-python``: ``train``/``test`` ({'data', 'fine_labels', 'coarse_labels', ...}), ``meta``."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        fine = [i % 100 for i in range(n)]
        _pickle(
            folder / name,
            {
                "filenames": [f"{name}_{i}.png" for i in range(n)],
                "batch_label": f"{name}ing batch 1 of 1",
                "fine_labels": fine,
                "coarse_labels": [f // 5 for f in fine],
                "data": random_images(n, (3072,), seed),
            },
        )
    _pickle(
        folder / "meta",
        {
            "fine_label_names": [f"class{i}" for i in range(100)],
            "coarse_label_names": [f"super{i}" for i in range(20)],
        },
    )


def leaf_user(user_index: int, n: int, label_offset: int = 0) -> dict:
    """FEMNIST-like samples: 784 floats in [0, 1] (1.0 = white), pixel 0 encodes the user and sample."""
    xs = []
    for j in range(n):
        pixels = [1.0] * 784
        pixels[0] = user_index / 10 + j / 1000
        xs.append(pixels)
    return {"x": xs, "y": [(user_index + label_offset + j) % 10 for j in range(n)]}


def write_leaf_file(path: Path, users: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {
        "users": list(users),
        "num_samples": [len(d["y"]) for d in users.values()],
        "user_data": users,
    }
    path.write_text(json.dumps(content))
