"""The official FedRep RNN for Sent140 (``lgcollins/FedRep``, ``models/Nets.py::RNNSent``).

Frozen pre-computed word vectors (not a parameter: neither trained, shared nor personalized, as the
official plain-tensor ``encoder``) → ``rnn`` LSTM (1 layer, 128 hidden) → ``fc`` 128→10 → ReLU →
Dropout(0.5) → ``decoder`` 10→2 on the last time step. The official FedRep/FedPer body is ``rnn`` and ``fc``
(state-dict keys 0-5), the head ``decoder`` (22 parameters); LG-FedAvg's official global keys are
``rnn.weight_ih_l0`` and ``decoder`` (keys 0, 6, 7).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.data.sent140 import read_word_vectors
from lightning_fedrep.models.classifier import FedRepClassifier

__all__ = ["SENT140_LG_GLOBAL", "Sent140RNN"]

SENT140_LG_GLOBAL = ("rnn.weight_ih_l0", "decoder")
"""LG-FedAvg's shared tensors for this model, as the official ``w_glob_keys = [net_keys[i] for i in [0,6,7]]``."""


class Sent140RNN(FedRepClassifier):
    """The official ``RNNSent``: an LSTM over frozen GloVe vectors; the head ``decoder`` (10→2) has 22 parameters.

    ``glove_path`` is the word-vector file the data module reads (GloVe text or LEAF ``embs.json``); its
    row ``i`` is word ``i``'s vector, and an extra zero row (index ``vocab_size``) is the unknown word and
    padding, as LEAF's ``embs.json``. The table is a non-persistent buffer: not in checkpoints (it is
    rebuilt from ``glove_path``), not trained, not averaged.

    ``layout`` picks how the LSTM reads a batch of ``(batch, max_words)`` word ids:

    * ``"tokens"`` (default): one step per word, each step the word's vector: ``LSTM(embedding_dim, 128)``
      over ``max_words`` steps, every tweet on its own. The output is ``decoder(features)``, with the
      body's features declared (``forward_features``), so the vectorized runner may cache them.
    * ``"official"``: the official code's ``emb.view(300, 4, 25)`` (sic) of the ``(25, batch, 300)``
      embedded batch, which reinterprets the memory as 300 steps of 25 numbers, so ``LSTM(max_words, 128)``
      as in ``Nets.py``, and each of its batch rows mixes the vectors of several tweets of the batch. A
      tweet's score then depends on the other tweets in its batch, so this layout declares no loss and no
      feature split (training runs on the sequential path) and no batched evaluation (each client is
      evaluated in its own batches: set the data module's ``eval_batch_size=4`` to score as the
      official code, which also drops a client's last incomplete batch, here kept).

    Either way the LSTM starts every batch from a zero state; the official code carries the (detached)
    state from one batch to the next within a client's local training and test pass.
    """

    fedrep_head = "decoder"

    def __init__(
        self,
        glove_path: str,
        max_words: int = 25,
        hidden_size: int = 128,
        fc_size: int = 10,
        num_classes: int = 2,
        dropout: float = 0.5,
        layout: Literal["tokens", "official"] = "tokens",
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 1e-4,
    ):
        super().__init__()
        if layout not in ("tokens", "official"):
            raise ValueError(f"Sent140RNN(layout=...) must be 'tokens' or 'official', got {layout!r}.")
        self.save_hyperparameters()
        words, vectors = read_word_vectors(glove_path, owner="Sent140RNN")
        table = torch.cat([torch.from_numpy(vectors), torch.zeros(1, vectors.shape[1])])
        self.register_buffer("embedding", table, persistent=False)
        self.vocab_size = len(words)
        dim = vectors.shape[1]
        self.rnn = nn.LSTM(max_words if layout == "official" else dim, hidden_size, 1)
        self.fc = nn.Linear(hidden_size, fc_size)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(fc_size, num_classes)
        for layer in (self.fc, self.decoder):  # the official init_weights
            nn.init.uniform_(layer.weight, -0.1, 0.1)
            nn.init.zeros_(layer.bias)
        if layout == "official":  # outputs depend on the batch: no declared loss, split or batched evaluation
            self.fedrep_loss = None
            self.fedrep_evaluation = None

    def setup(self, stage: str) -> None:
        """Refuse a data module whose vocabulary is not this model's (word ids would index wrong rows)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        size = getattr(datamodule, "vocab_size", None)
        if isinstance(size, int) and size != self.vocab_size:
            raise ValueError(
                f"The data module's vocabulary has {size} words but Sent140RNN(glove_path="
                f"{self.hparams.glove_path!r}) has {self.vocab_size}; pass the same glove_path to both."
            )

    def _sequence(self, ids: torch.Tensor) -> torch.Tensor:
        """The LSTM's input ``(steps, batch, size)`` for word ids ``(batch, max_words)``."""
        embedded = self.embedding[ids.t()]  # (max_words, batch, dim), as the official loop fills it
        if self.hparams.layout == "official":
            words, batch, dim = embedded.shape
            return embedded.reshape(dim, batch, words)  # the official emb.view(300, 4, 25)
        return embedded

    def forward_features(self, ids: torch.Tensor) -> torch.Tensor:
        """The body's output at the last step, ``relu(fc(lstm))``, shape ``(batch, fc_size)``."""
        output, _ = self.rnn(self._sequence(ids))
        return F.relu(self.fc(output[-1]))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)``: dropout, then ``decoder``."""
        return self.decoder(self.drop(features))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (lr 0.01, momentum 0.5), weight decay (1e-4) on every parameter whose name lacks ``bias``,
        as the official ``'bias' in name`` test (the LSTM's ``bias_ih_l0``/``bias_hh_l0`` get none)."""
        hp = self.hparams
        named = list(self.named_parameters())
        groups = [
            {"params": [p for n, p in named if "bias" not in n], "weight_decay": hp.weight_decay},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
        ]
        return torch.optim.SGD(groups, lr=hp.lr, momentum=hp.momentum)
