"""Synthetic token sequences whose labels are permuted per client group: an offline text federation.

Made for transformer recipes and tests that must run without downloads or a tokenizer: token ids are
drawn from a small vocabulary (id 0 is padding), every class has its own keywords, and each group of
clients names the classes differently, so one global classifier cannot fit all clients while a shared
representation with a personal classifier (or personal adapters) can.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import NaturalPartitioner
from lightning_fedrep.federation.api.arguments import check_int

__all__ = ["PAD_ID", "PermutedLabelTextDataModule", "make_permuted_label_text"]

PAD_ID = 0
"""The padding token id of the synthetic sequences."""


def _check(num_classes: int, keywords_per_class: int, vocab_size: int, min_length: int, length: int) -> None:
    if num_classes * keywords_per_class + 1 >= vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no background word after padding and num_classes * "
            f"keywords_per_class = {num_classes * keywords_per_class} keywords; raise vocab_size."
        )
    if not 1 <= min_length <= length:
        raise ValueError(f"min_length must be in [1, length={length}], got {min_length}.")


def make_permuted_label_text(
    num_clients: int = 20,
    samples_per_client: int = 64,
    test_samples_per_client: int = 32,
    num_groups: int = 2,
    num_classes: int = 2,
    vocab_size: int = 64,
    length: int = 16,
    min_length: int = 8,
    keywords_per_class: int = 4,
    keywords_per_sample: int = 2,
    seed: int = 0,
) -> tuple[list[TensorDataset], list[TensorDataset]]:
    """Clients of token sequences whose class is set by keywords and whose label names the class per group.

    Generative model (one generator seeded with ``seed``; draws client after client, train then test):

    * Token ids: ``0`` is padding; class ``c`` owns the keywords ``1 + c * keywords_per_class`` up to
      ``(c + 1) * keywords_per_class``; the remaining ids are background words.
    * A sample of client ``i``: a class ``c`` uniform over ``num_classes``, a length uniform in
      ``[min_length, length]``, background words at every position, ``keywords_per_sample`` of them
      replaced by keywords of ``c`` (uniform, with replacement), then padding to ``length``.
    * Client ``i`` is in group ``g = i % num_groups``, whose label of class ``c`` is ``(c + g) % num_classes``:
      group 0 labels as the keywords say, the others rotate the labels (with two classes, group 1 flips them).

    Args:
        num_clients: clients (client ``i`` in group ``i % num_groups``).
        samples_per_client: training samples per client.
        test_samples_per_client: test samples per client (0: none).
        num_groups: client groups, each naming the classes differently.
        num_classes: classes (and labels).
        vocab_size: token ids ``0 .. vocab_size - 1`` (0 is padding).
        length: tokens per sequence after padding.
        min_length: the shortest sequence before padding.
        keywords_per_class: keywords owned by each class.
        keywords_per_sample: keywords placed in each sequence.
        seed: seeds the one generator of every draw.

    Returns:
        ``(train, test)``: one ``TensorDataset(input_ids, labels)`` per client each, ``input_ids`` int64
        ``(m, length)`` padded with ``PAD_ID`` (0), ``labels`` int64 ``(m,)``.
    """
    owner = "make_permuted_label_text"
    for name, value, minimum in (
        ("num_clients", num_clients, 1),
        ("samples_per_client", samples_per_client, 1),
        ("test_samples_per_client", test_samples_per_client, 0),
        ("num_groups", num_groups, 1),
        ("num_classes", num_classes, 2),
        ("vocab_size", vocab_size, 4),
        ("length", length, 1),
        ("min_length", min_length, 1),
        ("keywords_per_class", keywords_per_class, 1),
        ("keywords_per_sample", keywords_per_sample, 1),
    ):
        check_int(name, value, minimum=minimum, owner=owner)
    _check(num_classes, keywords_per_class, vocab_size, min_length, length)
    if keywords_per_sample > min_length:
        raise ValueError(f"keywords_per_sample={keywords_per_sample} exceeds min_length={min_length}.")
    generator = torch.Generator().manual_seed(seed)
    background = 1 + num_classes * keywords_per_class

    def draw(client: int, count: int) -> TensorDataset:
        classes = torch.randint(num_classes, (count,), generator=generator)
        lengths = torch.randint(min_length, length + 1, (count,), generator=generator)
        ids = torch.randint(background, vocab_size, (count, length), generator=generator)
        where = (torch.rand(count, length, generator=generator) * lengths[:, None]).long()[
            :, :keywords_per_sample
        ]
        words = torch.randint(keywords_per_class, (count, keywords_per_sample), generator=generator)
        ids.scatter_(1, where, 1 + classes[:, None] * keywords_per_class + words)
        ids[torch.arange(length)[None, :] >= lengths[:, None]] = PAD_ID
        labels = (classes + client % num_groups) % num_classes
        return TensorDataset(ids, labels)

    train = [draw(client, samples_per_client) for client in range(num_clients)]
    test = [draw(client, test_samples_per_client) for client in range(num_clients)]
    return train, test


class PermutedLabelTextDataModule(FederatedDataModule):
    """:func:`make_permuted_label_text`'s clients as a data module: batches ``(input_ids, labels)``.

    The data are generated in ``setup`` from ``seed`` (which also seeds the validation split and the data
    order); ``pad_token_id`` (0, ``PAD_ID``) and ``vocab_size`` say what a model must accept.

    Args:
        num_clients: the generator's arguments, as :func:`make_permuted_label_text` (checked at construction),
            with ``samples_per_client``, ``test_samples_per_client``, ``num_groups``, ``num_classes``,
            ``vocab_size``, ``length``, ``min_length``, ``keywords_per_class`` and ``keywords_per_sample``.
        batch_size, eval_batch_size, val_fraction, num_workers, seed: as
            :class:`~lightning_fedrep.FederatedDataModule`.
    """

    def __init__(
        self,
        num_clients: int = 20,
        samples_per_client: int = 64,
        test_samples_per_client: int = 32,
        num_groups: int = 2,
        num_classes: int = 2,
        vocab_size: int = 64,
        length: int = 16,
        min_length: int = 8,
        keywords_per_class: int = 4,
        keywords_per_sample: int = 2,
        batch_size: int = 16,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
        )
        self.generator_args = dict(
            num_clients=num_clients,
            samples_per_client=samples_per_client,
            test_samples_per_client=test_samples_per_client,
            num_groups=num_groups,
            num_classes=num_classes,
            vocab_size=vocab_size,
            length=length,
            min_length=min_length,
            keywords_per_class=keywords_per_class,
            keywords_per_sample=keywords_per_sample,
        )
        make_permuted_label_text(
            **{**self.generator_args, "num_clients": 1, "samples_per_client": 1}, seed=seed
        )
        self.vocab_size = vocab_size
        self.pad_token_id = PAD_ID
        self.num_classes = num_classes

    def setup(self, stage: str | None = None) -> None:
        """Generate the clients' data (once) and assign each client its samples."""
        if self._train is not None:
            return
        train, test = make_permuted_label_text(**self.generator_args, seed=self.seed)
        self.train_set, train_owner = _concat(train)
        self.test_set, test_owner = _concat(test)
        self.partitioner = NaturalPartitioner(train_owner, test_owner)
        super().setup(stage)


def _concat(datasets: list[TensorDataset]) -> tuple[TensorDataset, Tensor]:
    """One data set of all clients' samples, and each sample's client id."""
    tensors = [torch.cat([d.tensors[k] for d in datasets]) for k in range(2)]
    owner = torch.cat([torch.full((len(d),), i, dtype=torch.long) for i, d in enumerate(datasets)])
    return TensorDataset(*tensors), owner
