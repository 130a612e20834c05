"""LEAF-format federated data (FEMNIST and other data sets with numeric features), one client per user.

LEAF (Caldas et al., https://leaf.cmu.edu) writes each split as a folder of JSON files, each holding

.. code-block:: json

    {"users": ["f0000_14", ...], "num_samples": [153, ...],
     "user_data": {"f0000_14": {"x": [[0.99, 1.0, ...], ...], "y": [36, ...]}, ...}}

:class:`LEAFDataModule` reads every ``*.json`` file of a train folder and of a test folder (the output of
LEAF's ``preprocess.sh ... -t sample``, of FedRep's ``my_sample.py`` (class ids written as floats are read
as integers), or of its seeded port ``scripts/femnist_sample.py``), keeps the users that have samples
in both, and makes each user one client (the natural partition, via
:class:`~lightning_fedrep.data.partition.NaturalPartitioner`). The data end up in one tensor data set per
split, so batches are cut by tensor indexing.

``x`` must be numeric (FEMNIST's 784 pixel values, LEAF's synthetic data set's feature vectors); the text
data sets (Sent140, Shakespeare) and CelebA (file names) need a tokeniser or image loader first and are
not read by this module. FEMNIST pixels are floats in [0, 1] with 1.0 the white background (LEAF inverts
nothing); they are kept as given, unnormalised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import NaturalPartitioner
from lightning_fedrep.federation.api.arguments import check_choice

__all__ = ["LEAFDataModule", "read_leaf_dir"]


def read_leaf_dir(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every user's ``{"x": [...], "y": [...]}`` in a LEAF split folder, merged over its ``*.json`` files.

    Files are read in name order. A user found in two files of the same folder is an error (LEAF writes
    each user once per split), and so is a folder without JSON files or a file without ``user_data``.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"LEAF data folder {str(folder)!r} does not exist.")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(
            f"No *.json files in {str(folder)!r}; expected LEAF's output (e.g. data/femnist/data/train/*.json)."
        )
    merged: dict[str, dict[str, Any]] = {}
    for path in files:
        with open(path) as handle:
            content = json.load(handle)
        if not isinstance(content, dict) or "user_data" not in content:
            raise ValueError(f"{str(path)!r} is not a LEAF file: it has no 'user_data' entry.")
        for user, data in content["user_data"].items():
            if user in merged:
                raise ValueError(f"User {user!r} appears twice in {str(folder)!r} (again in {path.name}).")
            if "x" not in data or "y" not in data:
                raise ValueError(f"User {user!r} in {str(path)!r} lacks 'x' or 'y'.")
            merged[user] = data
    return merged


class LEAFDataModule(FederatedDataModule):
    """A LEAF data set (e.g. FEMNIST) with one client per user, read from its train and test folders.

    The clients are the users that have at least one sample in the train folder *and* at least one in
    the test folder (LEAF's ``-t sample`` split puts every kept user in both; a user in only one split
    could be neither trained nor evaluated personally). They are in the order the train files list them
    (files in name order; ``user_order="file"``, as the official FedRep code reads them), or by user id
    (``user_order="id"``), so client ``i`` is ``self.users[i]``; ``max_clients`` keeps the first ones
    (FedRep's FEMNIST runs use the first 150 users). The users left out for missing a split are listed in
    ``self.dropped_users`` after ``setup``.

    Each sample's ``x`` is reshaped to ``image_shape`` (FEMNIST: ``(1, 28, 28)``), or kept flat with
    ``image_shape=None``; values are kept as given (FEMNIST: floats in [0, 1], 1.0 = white). ``y`` must
    be integer class ids (FEMNIST: 0-61; FedRep's re-sampled FEMNIST: 10 letters). Nothing is read until
    ``setup``.

    Args:
        train_dir: folder of the train split's JSON files.
        test_dir: folder of the test split's JSON files.
        image_shape: shape of one sample's ``x``, or ``None`` for flat feature vectors.
        max_clients: keep only the first ``max_clients`` users (in ``user_order``).
        batch_size, eval_batch_size, val_fraction, num_workers, seed: as :class:`FederatedDataModule`.
        user_order: ``"file"``: the order of the users in the train files (the official code's); ``"id"``:
            sorted by user id.
    """

    def __init__(
        self,
        train_dir: str,
        test_dir: str,
        image_shape: tuple[int, ...] | None = (1, 28, 28),
        max_clients: int | None = None,
        batch_size: int = 10,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        user_order: Literal["file", "id"] = "file",
    ):
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
        )
        if max_clients is not None and max_clients < 1:
            raise ValueError(f"max_clients must be a positive int or None, got {max_clients}.")
        self.user_order = check_choice("user_order", user_order, ("file", "id"), owner="LEAFDataModule")
        self.train_dir = str(train_dir)
        self.test_dir = str(test_dir)
        self.image_shape = tuple(image_shape) if image_shape is not None else None
        self.max_clients = max_clients
        self.users: list[str] = []
        self.dropped_users: list[str] = []

    def _tensors(
        self, data: dict[str, dict[str, Any]], users: list[str], split: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, y, user index)`` of all samples of ``users``, user after user."""
        xs, ys, groups = [], [], []
        for index, user in enumerate(users):
            try:
                x = np.asarray(data[user]["x"], dtype=np.float32)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"{split} x of LEAF user {user!r} is not a numeric array; this module reads numeric "
                    f"features only (FEMNIST, LEAF synthetic), not text or file names (Sent140, "
                    f"Shakespeare, CelebA)."
                ) from error
            y = np.asarray(data[user]["y"])
            if y.ndim == 1 and np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
                y = y.astype(np.int64)  # the official my_sample.py writes class ids as floats (3.0)
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or len(y) != len(x):
                raise ValueError(
                    f"{split} y of LEAF user {user!r} must be {len(x)} integer class ids (one per x), got "
                    f"an array of shape {y.shape} and dtype {y.dtype}."
                )
            x = x.reshape(len(x), -1)
            if self.image_shape is not None:
                if x.shape[1] != int(np.prod(self.image_shape)):
                    raise ValueError(
                        f"{split} samples of LEAF user {user!r} have {x.shape[1]} values each, which do not "
                        f"fit image_shape={self.image_shape}; pass the right image_shape, or None for flat "
                        f"feature vectors."
                    )
                x = x.reshape(len(x), *self.image_shape)
            xs.append(x)
            ys.append(y.astype(np.int64))
            groups.append(np.full(len(y), index, dtype=np.int64))
        return (
            torch.from_numpy(np.concatenate(xs)),
            torch.from_numpy(np.concatenate(ys)),
            torch.from_numpy(np.concatenate(groups)),
        )

    def setup(self, stage: str | None = None) -> None:
        """Read both folders (once), build the train and test tensors and one client per user."""
        if self._train is not None:
            return
        train_data = read_leaf_dir(self.train_dir)
        test_data = read_leaf_dir(self.test_dir)
        has_train = {u for u, d in train_data.items() if len(d["y"]) > 0}
        has_test = {u for u, d in test_data.items() if len(d["y"]) > 0}
        kept = has_train & has_test
        users = sorted(kept) if self.user_order == "id" else [u for u in train_data if u in kept]
        self.dropped_users = sorted((set(train_data) | set(test_data)) - set(users))
        if self.max_clients is not None:
            users = users[: self.max_clients]
        if not users:
            raise ValueError(
                f"No LEAF user has samples in both {self.train_dir!r} and {self.test_dir!r}; the two folders "
                "must be the train and test splits of the same users."
            )
        self.users = users
        x_train, y_train, g_train = self._tensors(train_data, users, "train")
        x_test, y_test, g_test = self._tensors(test_data, users, "test")
        self.train_set = TensorDataset(x_train, y_train)
        self.test_set = TensorDataset(x_test, y_test)
        self.partitioner = NaturalPartitioner(g_train, g_test)
        super().setup(stage)
