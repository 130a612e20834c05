"""PFLlib's federation of a labelled data set: the train and test sets pooled, split over clients, then
75/25 per client.

PFLlib (``TsingZ0/PFLlib``, ``dataset/utils/dataset_utils.py``) builds its leaderboard's clients in three
steps, all drawn from NumPy's *global* generator seeded with ``np.random.seed(1)`` by ``generate_*.py``:

1. the training and test sets are merged, training samples first;
2. ``separate_data`` deals the pool over the clients, ``"pat"`` (pathological: ``classes_per_client``
   classes each, random unbalanced sizes) or ``"dir"`` (Dirichlet label skew with concentration
   ``alpha``, redrawn until every client has ``least_samples``);
3. ``split_data`` cuts every client's samples in turn into train and test with scikit-learn's
   ``train_test_split(train_size=0.75, shuffle=True)``: one permutation of the client's samples, the first
   ``n - floor(0.75 n)`` are its test samples, the next ``floor(0.75 n)`` its training samples.

:class:`PFLlibPartitioner` restates the three steps with a local ``numpy.random.RandomState(seed)``
making the same calls in the same order as PFLlib's global generator, so seed 1 gives exactly PFLlib's
clients (its indices into the pool), and no global random state is read or advanced.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import numpy as np
import torch

from lightning_fedrep.data.partition import (
    ClientSplit,
    Partitioner,
    _check_num_clients,
    _check_seed,
    _labels_to_numpy,
)

__all__ = ["PFLlibPartitioner"]

PFLLIB_BATCH_SIZE = 10
"""``dataset_utils.batch_size``: the batch size PFLlib's ``least_samples`` rule guarantees a test batch of."""


class PFLlibPartitioner(Partitioner):
    """PFLlib's clients: the train and test sets pooled, dealt over clients, then split 75/25 per client.

    A *pooling* partitioner (``pools_test_set = True``): :meth:`split` pools ``train_labels`` then
    ``test_labels`` (PFLlib's order) and returns indices into that pool, for each client's training *and*
    test samples. :class:`~lightning_fedrep.FederatedDataModule` reads the attribute and indexes the
    concatenation of its train and test sets. With seed 1 the clients are exactly those of PFLlib's
    ``generate_*.py`` (``np.random.seed(1)``; see the module docstring); the labels must be the class ids
    ``0 .. C-1``, every one present, as ``separate_data`` assumes.

    ``partition="pat"`` (PFLlib's pathological split, ``balance=False`` as in its leaderboard): the classes
    are taken in order; each goes to the first ``ceil(num_clients / C * classes_per_client)`` clients that
    still hold fewer than ``classes_per_client`` classes, with sizes ``randint(max(n/k/10, least_samples/C),
    n/k)`` for all but the last holder, which takes the rest (``balance=True``: ``int(n/k)`` each).

    ``partition="dir"``: for each class in order, its samples are shuffled, proportions ``p ~ Dir(alpha)``
    drawn, ``p`` zeroed for the clients that already hold ``pool / num_clients`` samples or more and
    renormalised, and the class cut at ``int(cumsum(p) * n)``; the whole draw is repeated until the smallest
    client holds ``least_samples`` (at most ``max_tries`` times).

    Args:
        num_clients: the number of clients (PFLlib's leaderboard: 20).
        partition: ``"dir"`` (Dirichlet label skew, the leaderboard's "practical" setting) or ``"pat"``
            (``classes_per_client`` classes per client, the "pathological" setting).
        alpha: the Dirichlet concentration of ``"dir"`` (PFLlib: 0.1).
        classes_per_client: the classes per client of ``"pat"`` (PFLlib's ``generate_*.py``: 2 for FMNIST and
            CIFAR-10, 10 for CIFAR-100); required for ``"pat"``, refused for ``"dir"``.
        train_fraction: each client's share of training samples (PFLlib's ``train_ratio``, 0.75).
        balance: ``"pat"`` only: equal class shares instead of random sizes (PFLlib's ``balance``; its
            leaderboard used ``False``).
        least_samples: the smallest client size a ``"dir"`` draw (and ``"pat"``'s size floor) accepts;
            ``None``: PFLlib's rule, ``int(min(10 / (1 - train_fraction), pool / num_clients / 2))`` (one test
            batch of 10 per client).
        max_tries: the most ``"dir"`` draws before giving up (PFLlib retries forever).
        seed: a fixed seed of the split, used instead of the one :meth:`split` is given (the data module's):
            PFLlib generates its clients once (seed 1) and every run trains on them, so a recipe run over
            several seeds keeps ``seed=1`` here; ``None``: the given seed.
    """

    pools_test_set: ClassVar[bool] = True
    """The split indexes the pool ``train ++ test``, for training and test samples alike."""

    def __init__(
        self,
        num_clients: int = 20,
        partition: Literal["dir", "pat"] = "dir",
        alpha: float = 0.1,
        classes_per_client: int | None = None,
        train_fraction: float = 0.75,
        balance: bool = False,
        least_samples: int | None = None,
        max_tries: int = 1000,
        seed: int | None = None,
    ) -> None:
        """Check the arguments and keep them; nothing is drawn until :meth:`split`."""
        self.num_clients = _check_num_clients(num_clients)
        if partition not in ("dir", "pat"):
            raise ValueError(
                f"PFLlibPartitioner(partition={partition!r}) must be 'dir' (Dirichlet label skew, PFLlib's "
                "practical setting) or 'pat' (classes_per_client classes per client, its pathological setting)."
            )
        self.partition = partition
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise ValueError(
                f"PFLlibPartitioner(alpha={alpha!r}) must be a positive, finite number (PFLlib: 0.1)."
            )
        self.alpha = float(alpha)
        if partition == "pat":
            if (
                isinstance(classes_per_client, bool)
                or not isinstance(classes_per_client, int)
                or classes_per_client < 1
            ):
                raise ValueError(
                    f"PFLlibPartitioner(partition='pat') needs classes_per_client, a positive int (PFLlib: 2 for "
                    f"FMNIST and CIFAR-10, 10 for CIFAR-100), got {classes_per_client!r}."
                )
        elif classes_per_client is not None:
            raise ValueError(
                f"PFLlibPartitioner(classes_per_client={classes_per_client!r}) applies to partition='pat' only; "
                "drop it for partition='dir' (the Dirichlet split draws each client's classes)."
            )
        self.classes_per_client = classes_per_client
        if (
            isinstance(train_fraction, bool)
            or not isinstance(train_fraction, (int, float))
            or not 0 < train_fraction < 1
        ):
            raise ValueError(
                f"PFLlibPartitioner(train_fraction={train_fraction!r}) must be a number strictly between 0 and 1 "
                "(PFLlib: 0.75)."
            )
        self.train_fraction = float(train_fraction)
        if not isinstance(balance, bool):
            raise ValueError(f"PFLlibPartitioner(balance={balance!r}) must be True or False.")
        self.balance = balance
        if least_samples is not None and (
            isinstance(least_samples, bool) or not isinstance(least_samples, int) or least_samples < 0
        ):
            raise ValueError(
                f"PFLlibPartitioner(least_samples={least_samples!r}) must be a non-negative int, or None for "
                "PFLlib's rule (one test batch of 10 per client)."
            )
        self.least_samples = least_samples
        if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
            raise ValueError(f"PFLlibPartitioner(max_tries={max_tries!r}) must be a positive int.")
        self.max_tries = max_tries
        self.seed = None if seed is None else _check_seed(seed)

    def __repr__(self) -> str:
        shape = (
            f"alpha={self.alpha}"
            if self.partition == "dir"
            else f"classes_per_client={self.classes_per_client}"
        )
        return (
            f"{type(self).__name__}(num_clients={self.num_clients}, partition={self.partition!r}, {shape}, "
            f"train_fraction={self.train_fraction}{'' if self.seed is None else f', seed={self.seed}'})"
        )

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Pool the labels (train first), deal the pool over the clients, split each client's share into
        train and test; the indices of both index the pool ``train_labels ++ test_labels``. ``seed`` seeds the
        draws unless the partitioner has a fixed ``seed`` of its own."""
        seed = _check_seed(seed)
        rng = np.random.RandomState(seed if self.seed is None else self.seed)
        pool = _labels_to_numpy(train_labels, "train_labels")
        if test_labels is not None:
            pool = np.concatenate([pool, _labels_to_numpy(test_labels, "test_labels")])
        num_classes = self._num_classes(pool)
        least = self._least_samples(pool.size)
        if self.partition == "pat":
            shares = self._pathological(pool, num_classes, least, rng)
        else:
            shares = self._dirichlet(pool, num_classes, least, rng)
        train, test = [], []
        for share in shares:  # PFLlib's split_data: client after client, from the same generator
            order = share[rng.permutation(share.size)]
            n_test = share.size - math.floor(self.train_fraction * share.size)
            test.append(torch.from_numpy(np.sort(order[:n_test])))
            train.append(torch.from_numpy(np.sort(order[n_test:])))
        return ClientSplit(train=train, test=test)

    # -- the steps ------------------------------------------------------------------------------------

    def _num_classes(self, pool: np.ndarray) -> int:
        classes = np.unique(pool)
        if classes.size == 0 or classes[0] != 0 or classes[-1] != classes.size - 1:
            raise ValueError(
                f"{self!r} needs the class ids 0 .. C-1 with every class present (PFLlib's separate_data deals "
                f"classes range(C)), got {classes.size} distinct labels from {classes[:1].tolist()} to "
                f"{classes[-1:].tolist()}; relabel the classes to 0 .. C-1."
            )
        return int(classes.size)

    def _least_samples(self, pool_size: int) -> int:
        if self.least_samples is not None:
            return self.least_samples
        return int(min(PFLLIB_BATCH_SIZE / (1 - self.train_fraction), pool_size / self.num_clients / 2))

    def _pathological(
        self, pool: np.ndarray, num_classes: int, least: int, rng: np.random.RandomState
    ) -> list[np.ndarray]:
        """PFLlib's ``partition == 'pat'``: each class in order to the first clients with room left."""
        n, per_client = self.num_clients, self.classes_per_client
        room = np.full(n, per_client)
        holders_per_class = int(np.ceil((n / num_classes) * per_client))
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in range(num_classes):
            holders = np.flatnonzero(room > 0)[:holders_per_class]
            if holders.size == 0:
                break
            members = np.flatnonzero(pool == c)
            sizes = self._class_sizes(members.size, holders.size, num_classes, least, rng, c)
            cuts = np.cumsum([0, *sizes])
            for client, start, stop in zip(holders.tolist(), cuts[:-1], cuts[1:]):
                parts[client].append(members[start:stop])
                room[client] -= 1
        empty = [client for client, p in enumerate(parts) if not p]
        if empty:
            raise ValueError(
                f"{self!r}: clients {empty[:10]} get no class ({num_classes} classes x 1 holder each cannot "
                f"reach {n} clients x {per_client} classes); use more classes_per_client or fewer clients."
            )
        return [np.concatenate(p) for p in parts]

    def _class_sizes(
        self, total: int, holders: int, num_classes: int, least: int, rng: np.random.RandomState, label: int
    ) -> list[int]:
        """One class's share of each holder: random (or equal) for all but the last, which takes the rest."""
        share = total / holders
        if self.balance:
            sizes = [int(share)] * (holders - 1)
        else:
            low = max(share / 10, least / num_classes)
            try:
                sizes = rng.randint(low, share, holders - 1).tolist()
            except ValueError as error:  # low >= high: too few samples for PFLlib's random sizes
                raise ValueError(
                    f"{self!r}: class {label} has {total} samples for {holders} clients, too few to draw random "
                    f"sizes between {low:g} and {share:g} (PFLlib's randint); give more samples or balance=True."
                ) from error
        return [*sizes, total - sum(sizes)]

    def _dirichlet(
        self, pool: np.ndarray, num_classes: int, least: int, rng: np.random.RandomState
    ) -> list[np.ndarray]:
        """PFLlib's ``partition == 'dir'``: balanced Dirichlet cuts, redrawn until every client holds ``least``."""
        n, cap = self.num_clients, pool.size / self.num_clients
        smallest = 0
        for _ in range(self.max_tries):
            parts: list[list[np.ndarray]] = [[] for _ in range(n)]
            held = np.zeros(n, dtype=np.int64)
            for c in range(num_classes):
                members = np.flatnonzero(pool == c)
                rng.shuffle(members)
                proportions = rng.dirichlet(np.repeat(self.alpha, n))
                proportions = proportions * (held < cap)  # full clients take no more
                proportions = proportions / proportions.sum()
                cuts = (np.cumsum(proportions) * members.size).astype(int)[:-1]
                for client, piece in enumerate(np.split(members, cuts)):
                    parts[client].append(piece)
                    held[client] += piece.size
            smallest = int(held.min())
            if smallest >= least:
                return [np.concatenate(p) for p in parts]
        raise ValueError(
            f"{self!r}: no Dirichlet draw in {self.max_tries} tries gave every client {least} samples (the last "
            f"draw's smallest client held {smallest}); use a larger alpha, fewer clients, more max_tries or a "
            "smaller least_samples."
        )
