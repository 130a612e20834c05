"""LEAF Sent140 (tweets labelled by sentiment), one client per Twitter user, tokenised as the official
FedRep code (``lgcollins/FedRep``, ``models/language_utils.py``).

LEAF writes Sent140 like every LEAF data set (see :mod:`lightning_fedrep.data.leaf`), with each sample's
``x`` the raw tweet record ``[tweet id, date, query, user, text]`` and ``y`` its label (0 negative, 1
positive). The official code keeps only the text (``x[4]``), splits it into words with
``re.findall(r"[\\w']+|[.,!?;]", text)`` (no lower-casing), keeps the first 25 words, maps each word to
its row in the pre-computed GloVe vocabulary and every unknown word to the extra row ``len(vocab)`` (a
zero vector), and pads short tweets with that same index (:func:`tokenize`).

The vocabulary is read from a word-vector file given by path (``glove_path``), never downloaded: either
GloVe's text format (``glove.6B.300d.txt``, one ``word v1 ... v300`` per line, from
https://nlp.stanford.edu/data/glove.6B.zip) or LEAF's ``embs.json`` (``{"vocab": [...], "emba": [...]}``,
written from that file by LEAF's ``models/sent140/get_embs.sh``, which the official code reads as
``models/embs.json``). Word ``i`` of the file is row ``i`` of the embedding, as the official code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightning_fedrep.data.leaf import LEAFDataModule
from lightning_fedrep.federation.api.arguments import check_int

__all__ = [
    "GLOVE_SOURCE",
    "Sent140DataModule",
    "load_tokenizer",
    "read_word_vectors",
    "split_words",
    "tokenize",
]

GLOVE_SOURCE = (
    "GloVe's glove.6B.300d.txt (https://nlp.stanford.edu/data/glove.6B.zip) or LEAF's embs.json "
    "(leaf/models/sent140/get_embs.sh)"
)
"""Where the word vectors come from, for error messages."""

_WORDS = re.compile(r"[\w']+|[.,!?;]")


def split_words(text: str) -> list[str]:
    """The words of ``text`` as the official ``split_line``: runs of word characters and apostrophes,
    and the punctuation marks ``. , ! ? ;`` on their own."""
    return _WORDS.findall(text)


def tokenize(text: str, word_ids: dict[str, int], max_words: int = 25) -> list[int]:
    """The official ``line_to_indices``: the first ``max_words`` words' ids, unknown words and padding
    as ``len(word_ids)``, always ``max_words`` long."""
    unknown = len(word_ids)
    ids = [word_ids.get(word, unknown) for word in split_words(text)[:max_words]]
    return ids + [unknown] * (max_words - len(ids))


def load_tokenizer(name: str) -> Any:
    """``AutoTokenizer.from_pretrained(name)``, padding with the end-of-text token when it has no pad token
    (GPT-2). Needs the ``transformers`` extra."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(
            f'Sent140DataModule(tokenizer={name!r}) needs transformers: pip install "lightning-fedrep[transformers]".'
        ) from error
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer {name!r} has neither a pad token nor an end-of-text token to pad with."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _missing(path: Path, owner: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{owner}: glove_path={str(path)!r} does not exist. Pass the path of the word vectors: {GLOVE_SOURCE}. "
        "Nothing is downloaded."
    )


def read_word_vectors(
    path: str | Path, *, vectors: bool = True, owner: str = "read_word_vectors"
) -> tuple[list[str], np.ndarray | None]:
    """The words of a GloVe text file or LEAF ``embs.json``, in file order, and (``vectors=True``) their
    vectors as a ``(len(words), dim)`` float32 array (``None`` otherwise).

    ``embs.json``'s last ``emba`` row (LEAF's zero vector for unknown words) is dropped: callers add it
    back as row ``len(words)``. ``owner`` names the class or function in error messages.
    """
    path = Path(path)
    if not path.is_file():
        raise _missing(path, owner)
    if path.suffix == ".json":
        words, array = _read_embs_json(path, vectors, owner)
    else:
        words, array = _read_glove_text(path, vectors, owner)
    if not words:
        raise ValueError(
            f"{owner}: glove_path={str(path)!r} holds no word vectors (an empty vocabulary); pass a non-empty file "
            f"such as {GLOVE_SOURCE}."
        )
    if len(set(words)) != len(words):
        seen: set[str] = set()
        repeated = next(w for w in words if w in seen or seen.add(w))
        raise ValueError(
            f"{owner}: glove_path={str(path)!r} lists the word {repeated!r} twice; each word needs one row."
        )
    return words, array


def _read_glove_text(path: Path, vectors: bool, owner: str) -> tuple[list[str], np.ndarray | None]:
    words: list[str] = []
    rows: list[np.ndarray] = []
    dim = None
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            parts = line.split()
            if not parts:
                continue
            if dim is None:
                dim = len(parts) - 1
            if len(parts) - 1 != dim or dim == 0:
                raise ValueError(
                    f"{owner}: glove_path={str(path)!r}, line {number}: expected a word and {dim} numbers (GloVe's "
                    f"text format, as the first line), got {len(parts) - 1} numbers."
                )
            words.append(parts[0])
            if vectors:
                rows.append(np.asarray(parts[1:], dtype=np.float32))
    array = np.stack(rows) if vectors and rows else (np.zeros((0, 0), np.float32) if vectors else None)
    return words, array


def _read_embs_json(path: Path, vectors: bool, owner: str) -> tuple[list[str], np.ndarray | None]:
    with open(path) as handle:
        content = json.load(handle)
    if not isinstance(content, dict) or "vocab" not in content or "emba" not in content:
        raise ValueError(
            f"{owner}: glove_path={str(path)!r} is not LEAF's embs.json: it needs 'vocab' and 'emba'."
        )
    words = list(content["vocab"])
    if not vectors:
        return words, None
    array = np.asarray(content["emba"], dtype=np.float32)
    if array.ndim != 2 or len(array) != len(words) + 1:
        raise ValueError(
            f"{owner}: glove_path={str(path)!r}: 'emba' must have one row per word plus LEAF's unknown-word row "
            f"({len(words) + 1} rows), got shape {array.shape}."
        )
    return words, array[:-1]


class Sent140DataModule(LEAFDataModule):
    """LEAF Sent140 with one client per user, tweets as ``max_words`` word ids (the official tokenisation).

    Reads LEAF's train and test folders (``preprocess.sh -s niid --sf 0.3 -k 50 -tf 0.8 -t sample`` for the
    FedRep paper's 183 users) like :class:`~lightning_fedrep.data.leaf.LEAFDataModule`: users in the order
    the train files list them (``user_order="file"``, the official code's), kept when they have samples in
    both splits, the first ``max_clients`` of them (the official ``--num_users 183``). Each sample becomes
    ``(ids, label)``: ``ids`` a ``(max_words,)`` int64 tensor (:func:`tokenize` with the vocabulary of
    ``glove_path``, unknown words and padding ``= vocab_size``), ``label`` 0 or 1.

    The model must use the same word-vector file (``Sent140RNN(glove_path=...)``), so that word ``i`` is
    embedding row ``i``. Batch size 4 is the official ``local_bs``.

    For a pretrained transformer, give ``tokenizer`` (a Hugging Face hub name or local folder, read with
    ``AutoTokenizer.from_pretrained``; needs the ``transformers`` extra) instead of ``glove_path``: each
    tweet's text becomes ``max_words`` token ids (truncated, padded with the tokenizer's pad token, or its
    end-of-text token when it has none, as GPT-2), for
    :class:`~lightning_fedrep.models.transformers.HFSequenceClassifier` of the same checkpoint;
    ``pad_token_id`` says which id pads.

    Args:
        train_dir: folder of the train split's JSON files.
        test_dir: folder of the test split's JSON files.
        glove_path: the word vectors defining the vocabulary (GloVe text or LEAF ``embs.json``).
        max_words: words (or, with ``tokenizer``, tokens) kept per tweet (the official 25).
        tokenizer: a Hugging Face tokenizer's hub name or folder, in place of ``glove_path``.
        max_clients, user_order, batch_size, eval_batch_size, val_fraction, num_workers, seed: as
            :class:`~lightning_fedrep.data.leaf.LEAFDataModule`.
    """

    def __init__(
        self,
        train_dir: str,
        test_dir: str,
        glove_path: str | None = None,
        max_words: int = 25,
        max_clients: int | None = None,
        batch_size: int = 4,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        user_order: Literal["file", "id"] = "file",
        tokenizer: str | None = None,
    ):
        super().__init__(
            train_dir=train_dir,
            test_dir=test_dir,
            image_shape=None,
            max_clients=max_clients,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
            user_order=user_order,
        )
        self.max_words = check_int("max_words", max_words, minimum=1, owner="Sent140DataModule")
        if (glove_path is None) == (tokenizer is None):
            raise ValueError(
                "Sent140DataModule needs exactly one of glove_path=<word vectors, for Sent140RNN> and "
                f"tokenizer=<Hugging Face tokenizer name or folder, for a transformer>; got glove_path={glove_path!r}, "
                f"tokenizer={tokenizer!r}."
            )
        if glove_path is not None and not Path(glove_path).is_file():
            raise _missing(Path(glove_path), "Sent140DataModule")
        self.glove_path = None if glove_path is None else str(glove_path)
        self.tokenizer_name = tokenizer
        self.tokenizer: Any = None
        self.word_ids: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        """Words in the vocabulary (after ``setup``); id ``vocab_size`` is the unknown word and padding.
        With ``tokenizer``: the tokenizer's vocabulary size."""
        if self.tokenizer is not None:
            return len(self.tokenizer)
        return len(self.word_ids)

    @property
    def pad_token_id(self) -> int | None:
        """The id that pads a tweet's token ids (after ``setup``; ``vocab_size`` without a tokenizer)."""
        if self.tokenizer is not None:
            return self.tokenizer.pad_token_id
        return len(self.word_ids) if self.word_ids else None

    def setup(self, stage: str | None = None) -> None:
        """Read the vocabulary or tokenizer (once), then the LEAF folders, tokenising every tweet."""
        if self.tokenizer_name is not None and self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        elif self.glove_path is not None and not self.word_ids:
            words, _ = read_word_vectors(self.glove_path, vectors=False, owner="Sent140DataModule")
            self.word_ids = {word: i for i, word in enumerate(words)}
        super().setup(stage)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ``max_words`` ids: the official word ids, or the tokenizer's padded token ids."""
        if self.tokenizer is None:
            return [tokenize(text, self.word_ids, self.max_words) for text in texts]
        encoded = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_words)
        return encoded["input_ids"]

    def _tensors(
        self, data: dict[str, dict[str, Any]], users: list[str], split: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(word ids, label, user index)`` of all samples of ``users``, user after user."""
        texts, ys, groups = [], [], []
        for index, user in enumerate(users):
            records, labels = data[user]["x"], data[user]["y"]
            if len(records) != len(labels):
                raise ValueError(
                    f"{split} data of Sent140 user {user!r}: {len(records)} x but {len(labels)} y."
                )
            for record in records:
                if not isinstance(record, list) or len(record) < 5 or not isinstance(record[4], str):
                    raise ValueError(
                        f"{split} x of Sent140 user {user!r} must be LEAF tweet records [id, date, query, "
                        f"user, text], got {str(record)[:80]}; is this folder LEAF's Sent140?"
                    )
                texts.append(record[4])
            y = np.asarray(labels)
            if y.ndim != 1 or not np.all(np.isin(y, (0, 1))):
                raise ValueError(
                    f"{split} y of Sent140 user {user!r} must be labels 0 or 1, got {labels[:5]}..."
                )
            ys.append(y.astype(np.int64))
            groups.append(np.full(len(y), index, dtype=np.int64))
        return (
            torch.tensor(self._encode(texts), dtype=torch.int64).reshape(-1, self.max_words),
            torch.from_numpy(np.concatenate(ys)),
            torch.from_numpy(np.concatenate(groups)),
        )
