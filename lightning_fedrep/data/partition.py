"""Split a labelled data set over simulated federated clients.

Every partitioner here is a pure function of label tensors: it never touches a data set, never reads
or advances a global random number generator, and returns the same :class:`ClientSplit` for the same
``(labels, seed)``. Randomness comes from a local ``numpy.random.default_rng(seed)``, so results are
reproducible for a given seed and NumPy version. All work is vectorised over samples (the only Python
loops run over classes or clients), so 60,000 labels over 1,000 clients take well under 0.1 s.

Three schemes are provided:

* :class:`ShardPartitioner`: the "S classes per client" pathological split used by FedRep on
  CIFAR-10/100 (the official code's ``utils/sampling.py::noniid``); each client is tested on exactly
  its own classes.
* :class:`DirichletPartitioner`: label skew where each class is spread over the clients with
  proportions drawn from ``Dir(alpha)``; each client's test labels follow its train labels.
* :class:`IIDPartitioner`: a uniformly random, equal-size split.

Classes are the distinct values present in the *train* labels. :class:`ShardPartitioner` and
:class:`DirichletPartitioner` give each client test samples of its own training classes, as the official
FedRep sampling deals the test set with the training class assignment; test samples of a class that
occurs in no training label therefore belong to no client, and a warning names those classes and how
many test samples they drop.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

from lightning_fedrep.data.labels import integer_labels_error

__all__ = [
    "ClientSplit",
    "DirichletPartitioner",
    "IIDPartitioner",
    "NaturalPartitioner",
    "Partitioner",
    "ShardPartitioner",
]


@dataclass(frozen=True)
class ClientSplit:
    """Which sample indices each client owns, in the train set and in the test set.

    ``train[i]`` and ``test[i]`` are 1-D ``torch.int64`` tensors of indices into the train and test
    labels given to :meth:`Partitioner.split`, sorted ascending. ``test[i]`` is empty when no test labels
    were given (or when the test set has no samples for client ``i``'s share); it repeats indices when the
    test set is drawn with replacement (``ShardPartitioner(test_draws=...)``).
    """

    train: list[torch.Tensor]
    test: list[torch.Tensor]

    def __post_init__(self) -> None:
        if len(self.train) != len(self.test):
            raise ValueError(
                f"ClientSplit needs one train and one test index tensor per client, got {len(self.train)} "
                f"train and {len(self.test)} test tensors."
            )

    @property
    def num_clients(self) -> int:
        """Number of clients in the split."""
        return len(self.train)


@runtime_checkable
class Partitioner(Protocol):
    """Anything that assigns train and test sample indices to ``num_clients`` clients.

    Implementations must be deterministic given ``seed`` and must not use global random state. A
    partitioner whose class sets ``pools_test_set = True`` (:class:`~lightning_fedrep.PFLlibPartitioner`)
    deals the train and test samples as one pool: both of its splits index ``train_labels ++ test_labels``.
    """

    num_clients: int

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Return the per-client train/test indices for these labels.

        Args:
            train_labels: the train set's integer labels, one per sample (1-D).
            test_labels: the test set's labels, or ``None`` when there is no test set.
            seed: the seed of every random choice (the same seed gives the same split).
        """
        ...


# --------------------------------------------------------------------------------------------------
# validation and shared helpers (private)
# --------------------------------------------------------------------------------------------------


def _check_count(name: str, value: object, minimum: int, bound: str) -> int:
    """``value`` as an ``int``; refuses a non-integer (``bool`` included) or one below ``minimum`` (the refusal
    says ``"<name> must be <bound>"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ValueError(f"{name} must be {bound}, got {value}.")
    return int(value)


def _check_num_clients(num_clients: object) -> int:
    return _check_count("num_clients", num_clients, 1, "at least 1")


def _check_seed(seed: object) -> int:
    return _check_count("seed", seed, 0, "a non-negative int")


def _labels_to_numpy(labels: object, name: str) -> np.ndarray:
    """Validate a label tensor (or array-like) and return it as a 1-D int64 NumPy array."""
    if isinstance(labels, torch.Tensor):
        tensor = labels.detach()
    else:
        try:
            tensor = torch.as_tensor(np.asarray(labels))
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"{name} must be a 1-D integer tensor of class ids, got {type(labels).__name__}."
            ) from err
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise integer_labels_error(name, tensor, "partitioning")
    if tensor.dim() != 1:
        raise ValueError(
            f"{name} must be 1-D (one class id per sample), got shape {tuple(tensor.shape)}; "
            f"flatten it or pass class indices instead of one-hot labels."
        )
    return tensor.cpu().numpy().astype(np.int64, copy=False)


def _prepare(
    train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.random.Generator]:
    """Validate inputs; return (classes, train class ids, test class ids or None, test labels, rng).

    Class ids are positions in ``classes`` (the sorted distinct train labels); test samples whose label
    is not a train class get id -1.
    """
    seed = _check_seed(seed)
    train = _labels_to_numpy(train_labels, "train_labels")
    if train.size == 0:
        raise ValueError("train_labels is empty; there is nothing to partition.")
    classes, train_ids = np.unique(train, return_inverse=True)
    train_ids = train_ids.reshape(-1)
    test_ids = None
    test = None
    if test_labels is not None:
        test = _labels_to_numpy(test_labels, "test_labels")
        pos = np.searchsorted(classes, test)
        pos_clipped = np.minimum(pos, len(classes) - 1)
        known = classes[pos_clipped] == test
        test_ids = np.where(known, pos_clipped, -1)
    return classes, train_ids, test_ids, test, np.random.default_rng(seed)


def _warn_test_only_classes(partitioner: str, test_labels: np.ndarray, test_ids: np.ndarray) -> None:
    """Say which test classes occur in no training label: their test samples are assigned to no client."""
    unknown = test_ids < 0
    if not unknown.any():
        return
    classes, counts = np.unique(test_labels[unknown], return_counts=True)
    listed = ", ".join(
        f"class {c} ({n} samples)" for c, n in zip(classes[:10].tolist(), counts[:10].tolist())
    )
    warnings.warn(
        f"{partitioner}: {int(unknown.sum())} of {test_labels.size} test samples are assigned to no client: "
        f"their classes occur in no training label ({listed}{' ...' if classes.size > 10 else ''}). Each client "
        "is tested on its own training classes, as the official FedRep sampling deals the test set; to keep "
        "these samples, give the training set samples of those classes (or use IIDPartitioner).",
        UserWarning,
        stacklevel=3,
    )


def _group_by_class(
    class_ids: np.ndarray, num_classes: int, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """Return (order, starts): sample positions grouped by class, and the offset of each class's block.

    Within a class the order is random when ``rng`` is given. Samples with class id -1 are left out.
    ``order[starts[c]:starts[c + 1]]`` are the samples of class ``c``.
    """
    positions = np.flatnonzero(class_ids >= 0)
    if rng is not None:
        positions = rng.permutation(positions)
    order = positions[np.argsort(class_ids[positions], kind="stable")]
    counts = np.bincount(class_ids[positions], minlength=num_classes)
    starts = np.concatenate([[0], np.cumsum(counts)])
    return order, starts


def _even_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` near-equal chunks of ``total`` items; the first ``total % parts`` get one more."""
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


def _indices_per_owner(owner: np.ndarray, num_clients: int) -> list[torch.Tensor]:
    """Turn an owner array (client id per sample, -1 for unassigned) into sorted per-client index tensors."""
    assigned = np.flatnonzero(owner >= 0)
    owners = owner[assigned]
    by_owner = assigned[np.argsort(owners, kind="stable")]  # stable: ascending indices within a client
    counts = np.bincount(owners, minlength=num_clients)
    chunks = np.split(by_owner, np.cumsum(counts)[:-1])
    return [torch.from_numpy(np.array(chunk, dtype=np.int64, copy=True)) for chunk in chunks]


def _empty_split(num_clients: int) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=torch.int64) for _ in range(num_clients)]


# --------------------------------------------------------------------------------------------------
# shards: S classes per client (FedRep's CIFAR partition)
# --------------------------------------------------------------------------------------------------


class ShardPartitioner(Partitioner):
    """FedRep's pathological "S classes per client" split (the official code's ``noniid``).

    With ``C`` classes (the distinct train labels) and ``N = num_clients``, there are ``N * S`` class
    slots. Each class gets ``N * S / C`` holder clients; when that is not an integer the slots are spread
    as evenly as possible, i.e. ``(N * S) % C`` randomly chosen classes get one holder more than the
    others. If ``N * S < C`` some classes get no holder, and their samples are assigned to nobody.

    ``assignment`` says how the class slots are dealt:

    * ``"distinct"`` (default): every client holds exactly ``S`` *distinct* classes. Clients are filled
      one by one, in random order, each drawing ``S`` distinct classes with probability proportional to
      the class's remaining slots, and taking first any class that must go to every remaining client, so
      a valid assignment is always found when ``S <= C``.
    * ``"official"``: the official ``sampling.py`` (FedRep, FLUTE, SRPFL): the *multiset* of class slots
      (each class repeated ``N * S / C`` times) is shuffled and dealt ``S`` per client, so a client can
      draw the same class twice and then holds two shards of it (fewer than ``S`` distinct classes: at
      ``S = 5`` of 10 classes about 4.1 on average; at ``S = 2`` about 10% of clients hold one class).
      Each class's samples are cut, in data set order, into ``N * S / C`` shards of ``n_c // (N S / C)``
      samples, the ``n_c % (N S / C)`` leftover samples going one each to the first shards, and each slot
      takes a random shard; the test set is cut the same way with the same assignment. (The official
      code needs ``N * S`` to be a multiple of ``C``; otherwise the extra slots go to random classes, as
      for ``"distinct"``.)

    Each class's train samples are shuffled and cut into one shard per holder, with sizes differing by
    at most one (leftovers go to the first shards; nothing is dropped). So when the classes are balanced
    and ``N * S`` is a multiple of ``C``, every client gets the same number of train samples, and every
    train sample belongs to exactly one client. The test set is cut the same way with the *same* class
    assignment, so each client is tested on exactly its own classes (as in the official code, which uses
    the same ``rand_set_all`` for both splits). Leftover samples go to randomly ordered holders. A client's
    test shard of a class is empty when the test set has fewer samples of that class than it has holders.

    ``test_draws`` (default ``None``: the disjoint test shards above) draws each client's test set *with
    replacement* instead, as the official ``noniid`` does when the test set has fewer than 100 samples per
    client: the test samples of each class are cut into its shards as above (one per holder slot), and each
    of a client's class slots takes ``test_draws`` of its class's shards, each chosen uniformly at random,
    independently (so a shard can repeat, and clients share test samples). The official scripts' rule is 50
    draws per slot: SRPFL's EMNIST (the first 10 letters' 8,000 test images, 100 clients, S = 5) gives every
    client 5 x 50 shards of 16 images, 4,000 test samples (the disjoint cut: 80).
    """

    def __init__(
        self,
        num_clients: int,
        classes_per_client: int,
        assignment: Literal["distinct", "official"] = "distinct",
        test_draws: int | None = None,
    ) -> None:
        """Create a partitioner for ``num_clients`` clients holding ``classes_per_client`` classes each
        (``assignment``: ``"distinct"`` classes per client, or the ``"official"`` code's shuffled multiset;
        ``test_draws``: test shards drawn with replacement per class slot, or ``None`` for disjoint shards)."""
        self.num_clients = _check_num_clients(num_clients)
        if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, (int, np.integer)):
            raise ValueError(
                f"classes_per_client must be an int, got {type(classes_per_client).__name__} ({classes_per_client!r})."
            )
        if classes_per_client < 1:
            raise ValueError(f"classes_per_client must be at least 1, got {classes_per_client}.")
        self.classes_per_client = int(classes_per_client)
        if assignment not in ("distinct", "official"):
            raise ValueError(
                f"ShardPartitioner(assignment={assignment!r}) must be 'distinct' (S distinct classes per client) "
                "or 'official' (the official sampling.py's shuffled multiset of class slots)."
            )
        self.assignment = assignment
        if test_draws is not None and (
            isinstance(test_draws, bool) or not isinstance(test_draws, (int, np.integer)) or test_draws < 1
        ):
            raise ValueError(
                f"ShardPartitioner(test_draws={test_draws!r}) must be a positive int (test shards drawn with "
                "replacement per class slot; the official code: 50) or None (disjoint test shards)."
            )
        self.test_draws = None if test_draws is None else int(test_draws)

    def __repr__(self) -> str:
        draws = "" if self.test_draws is None else f", test_draws={self.test_draws}"
        return (
            f"{type(self).__name__}(num_clients={self.num_clients}, classes_per_client={self.classes_per_client}, "
            f"assignment={self.assignment!r}{draws})"
        )

    def assign_classes(self, num_classes: int, seed: int) -> torch.Tensor:
        """Return the ``(num_clients, classes_per_client)`` int64 class assignment that :meth:`split` uses.

        Entry ``[i, j]`` is a position in the sorted distinct train labels (not the label value itself);
        each row is sorted, and has no repeats unless ``assignment="official"``. Useful to inspect or log
        who holds which classes.

        Args:
            num_classes: how many distinct labels the train set has.
            seed: the seed :meth:`split` is given.
        """
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}.")
        assignment = self._assign(int(num_classes), np.random.default_rng(_check_seed(seed)))
        return torch.from_numpy(assignment)

    def _assign(self, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        n, s, c = self.num_clients, self.classes_per_client, num_classes
        if self.assignment == "official":
            return self._assign_official(c, rng)
        if s > c:
            raise ValueError(
                f"classes_per_client={s} exceeds the number of classes present in the train labels ({c}); "
                f"a client cannot hold the same class twice. Use classes_per_client <= {c}."
            )
        holders = np.full(c, (n * s) // c, dtype=np.int64)
        holders[rng.choice(c, size=(n * s) % c, replace=False)] += 1
        assignment = np.empty((n, s), dtype=np.int64)
        remaining = holders.copy()  # invariant: sum == clients_left * s and max <= clients_left
        # Weighted sampling of s distinct classes without replacement, by Efraimidis-Spirakis keys
        # log(u) / weight (top-s keys win); classes every remaining client must hold get key +inf.
        log_u = np.log1p(-rng.random((n, c)))  # log(u), u in (0, 1]
        for step, client in enumerate(rng.permutation(n)):
            clients_left = n - step
            keys = np.full(c, -np.inf)
            available = remaining > 0
            keys[available] = log_u[step, available] / remaining[available]
            keys[remaining == clients_left] = np.inf
            row = np.sort(np.argpartition(-keys, s - 1)[:s])
            assignment[client] = row
            remaining[row] -= 1
        return assignment

    def _assign_official(self, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        """The official ``rand_set_all``: the shuffled multiset of class slots, ``S`` per client (rows sorted)."""
        n, s, c = self.num_clients, self.classes_per_client, num_classes
        holders = np.full(c, (n * s) // c, dtype=np.int64)
        holders[rng.choice(c, size=(n * s) % c, replace=False)] += 1
        slots = rng.permutation(np.repeat(np.arange(c), holders))
        return np.sort(slots.reshape(n, s), axis=1)

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Assign each client ``classes_per_client`` classes and one shard of each, in train and test."""
        classes, train_ids, test_ids, test, rng = _prepare(train_labels, test_labels, seed)
        num_classes = len(classes)
        if self.num_clients > train_ids.size:
            raise ValueError(
                f"num_clients={self.num_clients} exceeds the number of train samples ({train_ids.size}); "
                f"use at most {train_ids.size} clients."
            )
        assignment = self._assign(num_classes, rng)

        # holders of each class, in random order (decides who gets a leftover sample)
        flat = assignment.reshape(-1)
        client_of_slot = np.repeat(np.arange(self.num_clients), self.classes_per_client)
        slot_order = np.argsort(flat, kind="stable")
        holder_counts = np.bincount(flat, minlength=num_classes)
        holders = np.split(client_of_slot[slot_order], np.cumsum(holder_counts)[:-1])
        holders = [rng.permutation(h) for h in holders]

        shuffle = None if self.assignment == "official" else rng  # official: shards in data set order
        train_order, train_starts = _group_by_class(train_ids, num_classes, shuffle)
        class_sizes = np.diff(train_starts)
        too_small = np.flatnonzero((holder_counts > class_sizes) & (holder_counts > 0))
        if too_small.size:
            c = too_small[0]
            raise ValueError(
                f"class {classes[c]} has {class_sizes[c]} train samples but must be cut into "
                f"{holder_counts[c]} shards (one per client holding it); use fewer clients or a smaller "
                f"classes_per_client."
            )
        train_owner = self._deal(train_ids.size, train_order, train_starts, holders, self.assignment)
        train = _indices_per_owner(train_owner, self.num_clients)

        if test_ids is None:
            return ClientSplit(train=train, test=_empty_split(self.num_clients))
        _warn_test_only_classes(repr(self), test, test_ids)
        test_order, test_starts = _group_by_class(test_ids, num_classes, shuffle)
        if self.assignment == "official":  # each test slot pops its own random shard
            holders = [rng.permutation(h) for h in holders]
        if self.test_draws is not None:
            return ClientSplit(train=train, test=self._draw_tests(test_order, test_starts, holders, rng))
        test_owner = self._deal(test_ids.size, test_order, test_starts, holders, self.assignment)
        return ClientSplit(train=train, test=_indices_per_owner(test_owner, self.num_clients))

    def _draw_tests(
        self, order: np.ndarray, starts: np.ndarray, holders: Sequence[np.ndarray], rng: np.random.Generator
    ) -> list[torch.Tensor]:
        """Each class slot's ``test_draws`` shards of its class, drawn uniformly with replacement (sorted
        per client, repeats kept)."""
        drawn: list[list[np.ndarray]] = [[] for _ in range(self.num_clients)]
        for c, class_holders in enumerate(holders):
            block = order[starts[c] : starts[c + 1]]
            k = class_holders.size
            if k == 0 or block.size == 0:
                continue
            shard = _shard_of_positions(block.size, k, self.assignment)
            members = [block[shard == s] for s in range(k)]
            picks = rng.integers(k, size=(k, self.test_draws))
            for client, row in zip(class_holders.tolist(), picks):
                drawn[client].extend(members[s] for s in row.tolist())
        return [
            torch.from_numpy(np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64))
            for parts in drawn
        ]

    @staticmethod
    def _deal(
        num_samples: int,
        order: np.ndarray,
        starts: np.ndarray,
        holders: Sequence[np.ndarray],
        assignment: str = "distinct",
    ) -> np.ndarray:
        """Cut each class block into one near-equal shard per holder; return the owner of each sample.

        ``"distinct"``: contiguous shards, the first ``size % holders`` one longer. ``"official"``: shard
        ``i`` is the ``i``-th run of ``size // holders`` samples plus, for ``i < size % holders``, the
        ``i``-th leftover sample from the block's end (the official ``noniid``'s cut).
        """
        owner = np.full(num_samples, -1, dtype=np.int64)
        for c, class_holders in enumerate(holders):
            if class_holders.size == 0:
                continue
            block = order[starts[c] : starts[c + 1]]
            owner[block] = class_holders[_shard_of_positions(block.size, class_holders.size, assignment)]
        return owner


def _shard_of_positions(size: int, k: int, assignment: str) -> np.ndarray:
    """The shard (0..k-1) of each position of a class block of ``size`` samples cut into ``k`` shards:
    ``"official"``: runs of ``size // k`` plus the ``i``-th leftover from the end for shard ``i``;
    otherwise contiguous near-equal shards, the first ``size % k`` one longer."""
    if assignment == "official":
        run, position = size // k, np.arange(size)
        return np.where(position < k * run, position // max(run, 1), position - k * run)
    return np.repeat(np.arange(k), _even_sizes(size, k))


# --------------------------------------------------------------------------------------------------
# Dirichlet label skew
# --------------------------------------------------------------------------------------------------


class DirichletPartitioner(Partitioner):
    """Label-skewed split: each class is spread over clients with proportions drawn from ``Dir(alpha)``.

    For every class a proportion vector ``p ~ Dir(alpha * 1_N)`` is drawn, and the class's (shuffled)
    train samples are cut at ``round(cumsum(p) * n_class)``, so small ``alpha`` concentrates each class
    on few clients and large ``alpha`` approaches an IID split. Client sizes are not balanced. The draw is
    repeated (deterministically, from the same seeded generator) until every client has at least
    ``min_samples_per_client`` train samples; after ``max_tries`` failures a ``ValueError`` is raised.

    The test set is cut with the *same* per-class proportions, so each client's test label distribution
    follows its train label distribution (up to rounding), provided the test set's class balance matches
    the train set's. Every train sample belongs to exactly one client, and so does every test sample of a
    class present in the train labels.
    """

    def __init__(
        self, num_clients: int, alpha: float, min_samples_per_client: int = 1, max_tries: int = 100
    ) -> None:
        """Create a partitioner for ``num_clients`` clients with concentration ``alpha`` (> 0)."""
        self.num_clients = _check_num_clients(num_clients)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
            raise ValueError(f"alpha must be a positive number, got {type(alpha).__name__} ({alpha!r}).")
        if not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(
                f"alpha must be a positive, finite number, got {alpha}; small values (e.g. 0.1) give strong label "
                f"skew, large values (e.g. 100) give a nearly IID split."
            )
        self.alpha = float(alpha)
        for name, value, low in (
            ("min_samples_per_client", min_samples_per_client, 0),
            ("max_tries", max_tries, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}.")
        self.min_samples_per_client = int(min_samples_per_client)
        self.max_tries = int(max_tries)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_clients={self.num_clients}, alpha={self.alpha}, "
            f"min_samples_per_client={self.min_samples_per_client}, max_tries={self.max_tries})"
        )

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Draw per-class client proportions and cut the train and test samples of each class by them."""
        classes, train_ids, test_ids, test, rng = _prepare(train_labels, test_labels, seed)
        n, num_classes = self.num_clients, len(classes)
        needed = n * self.min_samples_per_client
        if needed > train_ids.size or n > train_ids.size:
            raise ValueError(
                f"{n} clients with at least {self.min_samples_per_client} samples each need "
                f"{max(needed, n)} train samples, but there are only {train_ids.size}; use fewer clients or a "
                f"smaller min_samples_per_client."
            )
        train_order, train_starts = _group_by_class(train_ids, num_classes, rng)
        class_sizes = np.diff(train_starts)
        concentration = np.full(n, self.alpha)
        fewest = -1
        for _ in range(self.max_tries):
            proportions = rng.dirichlet(concentration, size=num_classes)  # (C, N)
            if not np.all(np.isfinite(proportions)):
                continue
            counts = self._counts(proportions, class_sizes)
            per_client = counts.sum(axis=0)
            fewest = int(per_client.min())
            if fewest >= self.min_samples_per_client:
                break
        else:
            raise ValueError(
                f"could not give each of {n} clients at least {self.min_samples_per_client} train samples with "
                f"alpha={self.alpha} in {self.max_tries} tries (best draw's smallest client had {max(fewest, 0)}); "
                f"use a larger alpha, fewer clients or a smaller min_samples_per_client."
            )
        train = _indices_per_owner(self._deal(train_ids.size, train_order, counts), n)
        if test_ids is None:
            return ClientSplit(train=train, test=_empty_split(n))
        _warn_test_only_classes(repr(self), test, test_ids)
        test_order, test_starts = _group_by_class(test_ids, num_classes, rng)
        test_counts = self._counts(proportions, np.diff(test_starts))
        return ClientSplit(
            train=train, test=_indices_per_owner(self._deal(test_ids.size, test_order, test_counts), n)
        )

    @staticmethod
    def _counts(proportions: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
        """Per (class, client) sample counts from cutting each class at rounded cumulative proportions."""
        cuts = np.rint(np.cumsum(proportions, axis=1) * class_sizes[:, None]).astype(np.int64)
        cuts[:, -1] = class_sizes
        cuts = np.maximum.accumulate(np.minimum(cuts, class_sizes[:, None]), axis=1)
        return np.diff(cuts, axis=1, prepend=0)

    @staticmethod
    def _deal(num_samples: int, order: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Give client ``k`` the next ``counts[c, k]`` samples of each class block; return the owners."""
        owner = np.full(num_samples, -1, dtype=np.int64)
        owner[order] = np.repeat(np.tile(np.arange(counts.shape[1]), counts.shape[0]), counts.reshape(-1))
        return owner


# --------------------------------------------------------------------------------------------------
# IID
# --------------------------------------------------------------------------------------------------


class IIDPartitioner(Partitioner):
    """Uniformly random split into near-equal parts (sizes differ by at most one), for train and test.

    Every train and every test sample belongs to exactly one client. Clients can get an empty test set
    when there are fewer test samples than clients.
    """

    def __init__(self, num_clients: int) -> None:
        """Create a partitioner for ``num_clients`` clients."""
        self.num_clients = _check_num_clients(num_clients)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_clients={self.num_clients})"

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Shuffle the train (and test) indices and cut them into ``num_clients`` near-equal parts."""
        _, train_ids, _, test, rng = _prepare(train_labels, test_labels, seed)
        if self.num_clients > train_ids.size:
            raise ValueError(
                f"num_clients={self.num_clients} exceeds the number of train samples ({train_ids.size}); "
                f"use at most {train_ids.size} clients."
            )
        train = _indices_per_owner(self._deal(train_ids.size, rng), self.num_clients)
        if test is None:
            return ClientSplit(train=train, test=_empty_split(self.num_clients))
        return ClientSplit(train=train, test=_indices_per_owner(self._deal(test.size, rng), self.num_clients))

    def _deal(self, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        owner = np.empty(num_samples, dtype=np.int64)
        owner[rng.permutation(num_samples)] = np.repeat(
            np.arange(self.num_clients), _even_sizes(num_samples, self.num_clients)
        )
        return owner


# --------------------------------------------------------------------------------------------------
# natural partition: one client per user / writer / speaker
# --------------------------------------------------------------------------------------------------


class NaturalPartitioner(Partitioner):
    """One client per natural group (a LEAF user, a writer, a speaker), from per-sample group ids.

    Unlike the other partitioners the assignment is fixed by the data, not drawn: ``train_groups[j]`` is
    the integer id of the group that owns train sample ``j`` and ``test_groups[j]`` that of test sample
    ``j``. The clients are the distinct train group ids in ascending order (client ``i`` is the
    ``i``-th smallest id, so ids ``0 .. N-1`` map to clients ``0 .. N-1``), and ``num_clients`` is their
    number. Every train sample belongs to its group's client; a test sample whose group has no train
    sample is assigned to no client, and a client whose group has no test sample gets an empty test split.

    :meth:`split` takes the same arguments as every :class:`Partitioner`, so
    ``FederatedDataModule.setup`` works unchanged; the labels it is given are only checked to have
    one entry per sample (their values do not matter), and ``seed`` is unused (there is no randomness).
    """

    def __init__(self, train_groups: torch.Tensor, test_groups: torch.Tensor | None = None) -> None:
        """Create a partitioner from the group id of each train sample (and of each test sample)."""
        self.train_groups = _labels_to_numpy(train_groups, "train_groups")
        if self.train_groups.size == 0:
            raise ValueError("train_groups is empty; there is nothing to partition.")
        self.test_groups = None if test_groups is None else _labels_to_numpy(test_groups, "test_groups")
        self.groups = np.unique(self.train_groups)
        self.num_clients = int(self.groups.size)

    def __repr__(self) -> str:
        num_test = None if self.test_groups is None else self.test_groups.size
        return (
            f"{type(self).__name__}(num_clients={self.num_clients}, train_samples={self.train_groups.size}, "
            f"test_samples={num_test})"
        )

    def _owners(self, groups: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.groups, groups)
        pos_clipped = np.minimum(pos, self.groups.size - 1)
        return np.where(self.groups[pos_clipped] == groups, pos_clipped, -1)

    def split(self, train_labels: torch.Tensor, test_labels: torch.Tensor | None, seed: int) -> ClientSplit:
        """Give each client the samples of its group, in train and in test."""
        _check_seed(seed)
        if len(train_labels) != self.train_groups.size:
            raise ValueError(
                f"NaturalPartitioner was built with {self.train_groups.size} train group ids but the train set "
                f"has {len(train_labels)} samples; give one group id per train sample."
            )
        train = _indices_per_owner(self._owners(self.train_groups), self.num_clients)
        if test_labels is None:
            return ClientSplit(train=train, test=_empty_split(self.num_clients))
        if self.test_groups is None or len(test_labels) != self.test_groups.size:
            have = 0 if self.test_groups is None else self.test_groups.size
            raise ValueError(
                f"NaturalPartitioner was built with {have} test group ids but the test set has "
                f"{len(test_labels)} samples; give test_groups with one group id per test sample."
            )
        return ClientSplit(
            train=train, test=_indices_per_owner(self._owners(self.test_groups), self.num_clients)
        )
