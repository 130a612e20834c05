"""Fed-MTL (Smith et al., NeurIPS 2017), as the official FedRep repository runs it (``main_mtl.py``,
``LocalUpdateMTL``).

Every client keeps its whole model (nothing is averaged: the official ``w_glob_keys`` are every weight and its
server step keeps nothing of the mean). A sampled client ``j`` of a round with ``m`` sampled clients trains::

    loss(w) + 10^-f * (||W||^2 + tr(W_c Omega W_c^T)),     Omega = (I - 11^T / m) ** 2   (elementwise)

``W`` (``d x m``) holds the sampled clients' flattened weights at the round's start, its own column being its
live weights ``w``; ``f = int(log10(d) + 1) + 1``; ``W_c`` is ``W``'s first ``chunk * (d // chunk)`` rows (the
official loop over 4000-row blocks drops the last partial block). Evaluation scores each client's own model.

Deviations from the official code: ``W``'s rows follow the module's parameter order (the official order is the
model's ``weight_keys``, fc layers first), which changes only *which* ``d mod chunk`` rows the trace drops;
the official optimizer (SGD, momentum 0.5, no weight decay: every weight is in ``w_glob_keys``) is the
module's own here; the official extra round T+1 over all clients (which fails there: ``Omega`` stays ``m x m``,
and ``I`` is undefined) is not run; on Sent140 the official ``W`` leaves out the embedding (``net_keys[1:]``),
which restarts from the initial model every round, while here every trained tensor is in ``W`` and kept.
Never-trained clients' columns are the initial model, as the official ``w_locals``, whatever ``first_state``.
On several processes each client's end weights travel to every process once per round (one all-gather of the
round's uploads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, Stacked
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_optional_int, check_real
from lightning_fedrep.federation.api.declared import ServerTensors
from lightning_fedrep.federation.api.exchange import ClientEnd, ClientOutcome, RoundResults, ServerState
from lightning_fedrep.federation.api.objective import LossTerm, Objective, StepView
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedMTL"]

UPLOAD = "fed_mtl.weights"
"""The name of a client's upload: its flattened end weights (no tensor of the module is shared)."""


class FedMTL(Algorithm):
    """Fed-MTL: local full models with the official regularizer over the sampled clients' flattened weights.

    Args:
        chunk: the official block size of the trace term (4000); ``None`` uses every row.
        strength: the regularizer's weight; ``None`` (the official) is ``10^-f`` with ``f = int(log10(d) + 1) + 1``.

    The other sampled clients' round-start weights live in no declared tensor (a client sees the server,
    never another client): each client uploads its flattened end weights (``Stacked``: every upload reaches
    :meth:`aggregate`, on every process), and the algorithm keeps every client's latest weights itself
    (never-trained clients hold the initial model, the declared server tensor ``init``), saved with the
    federation (``state_dict``), and learns the round's clients in ``configure_round``. The kept weights change
    only when a round closes, so every client of a round reads the others' round-start weights, whichever
    trains first and on whichever process. The term reads per-round tables indexed by ``view.client``, so both
    runners train it (in lockstep inside the ``vmap``), on one process or several (``fed_mtl_ddp``). Phases
    other than ``"all"`` train without the term.

    ``Trainer(strategy="fed_mtl")`` uses ``FedMTL()``.
    """

    server_tensors = (ServerTensors("init", like="model", init="module"),)

    def __init__(self, chunk: int | None = 4000, strength: float | None = None):
        super().__init__("fed_mtl", (), "Fed-MTL: local full models + 10^-f (||W||^2 + tr(W Omega W^T)).")
        self.chunk = check_optional_int("chunk", chunk, 1, owner="FedMTL")
        self.strength = None if strength is None else check_real("strength", strength, 0.0, owner="FedMTL")
        self._loaded = False
        self._template = torch.empty(0)
        self._names: list[str] = []  # the flattened parameters, in the module's order
        self._reset()

    def _reset(self) -> None:
        self._bank: dict[int, Tensor] = {}  # client -> its flattened weights at its last round's end
        self._clients: dict[int, tuple[tuple[int, ...], int]] = {}  # round -> (its clients, federation size)
        self._tables: tuple[int, int, dict[str, Tensor]] | None = (
            None  # (round, m, tables), at its first step
        )

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """The flattened parameters: the module's trainable ones, in its order (``W``'s rows)."""
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in trainable]
        numel = sum(p.numel() for _, p in trainable)
        like = trainable[0][1] if trainable else torch.empty(0)
        self._template = torch.empty(numel, dtype=like.dtype, device=like.device)

    def configure_round(self, plan: Any, server: ServerState) -> Any:
        """Records the round's clients (a new fit forgets the last one's weights); the plan is unchanged."""
        if plan.round == 0 and not self._loaded:
            self._reset()
        self._loaded = False
        self._clients = {r: c for r, c in self._clients.items() if r >= plan.round - 1}
        self._clients[plan.round] = (tuple(plan.clients), server.num_clients)
        return plan

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """Every client's flattened end weights, kept (``Stacked``; nothing of the module is averaged)."""
        return Stacked({**like, UPLOAD: self._template})

    def _round_tables(self, view: StepView) -> tuple[int, int, dict[str, Tensor]]:
        """``(round, m, tables)``: per sampled client the sum of the others' round-start columns and of their
        squares (all rows, the blocks' rows); each client's row and whether it was sampled."""
        if self._tables is not None and self._tables[0] == view.round:
            return self._tables
        clients, n = self._clients.get(view.round, ((), 0))
        self._check_names(view)
        init = torch.cat([view.server[f"init.{k}"].reshape(-1) for k in self._names])
        cols = torch.stack([self._bank.get(c, init).to(init) for c in clients] or [init])
        rows = self._rows(init.numel())
        others = cols.sum(0) - cols
        square, block = cols.square().sum(1), cols[:, :rows].square().sum(1)
        index, member = torch.zeros(max(n, 1), dtype=torch.long), torch.zeros(max(n, 1))
        index[list(clients)], member[list(clients)] = torch.arange(len(clients)), 1.0
        tables = {
            "others": others,
            "square": square.sum() - square,
            "block": block.sum() - block,
            "index": index.to(init.device),
            "member": member.to(init.device),
        }
        if view.round not in self._clients:  # a runner's timing trial before the round is planned
            return view.round, 1, tables
        self._tables = (view.round, len(clients), tables)
        return self._tables

    def _check_names(self, view: StepView) -> None:
        if not self._names or set(self._names) != set(view.trained):
            raise RuntimeError(
                f"FedMTL flattens the module's trainable parameters {self._names[:4]}... (read at setup) but "
                f"the phase trains {sorted(view.trained)[:4]}...: keep requires_grad as it was when fit began."
            )

    def _rows(self, d: int) -> int:
        return d if self.chunk is None else d // self.chunk * self.chunk

    def _regularizer(self, view: StepView) -> Tensor | None:
        _, m, tables = self._round_tables(view)
        client = view.client.clamp(max=tables["index"].numel() - 1)
        k = _row(tables["index"], client)
        w = torch.cat([view.trained[n].reshape(-1) for n in self._names])
        d = w.numel()
        rows, diagonal, off = self._rows(d), (1 - 1 / m) ** 2, 1 / m**2
        others = _row(tables["others"], k)
        square = w.square().sum() + _row(tables["square"], k)
        block = w[:rows].square().sum() + _row(tables["block"], k)
        trace = (diagonal - off) * block + off * (w[:rows] + others[:rows]).square().sum()
        strength = 10.0 ** -(int(math.log10(d) + 1) + 1) if self.strength is None else self.strength
        return _row(tables["member"], client) * strength * (square + trace)

    def objective(self, phase: str) -> Objective:
        """The regularizer, in the phases that train everything."""
        return Objective(
            terms=(LossTerm(self._regularizer, "Fed-MTL regularizer", phases=frozenset({"all"})),)
        )

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """Uploads the client's flattened end weights (kept by :meth:`aggregate` when the round closes)."""
        flat = torch.cat([end.end[n].detach().reshape(-1) for n in self._names])
        return ClientOutcome(upload={**end.shared(), UPLOAD: flat})

    def aggregate(
        self, server: ServerState, results: RoundResults, failures: Sequence[ClientFault]
    ) -> tuple[ServerState, dict[str, float]]:
        """Keeps every surviving client's end weights (the next rounds' columns); the server is unchanged."""
        for update in results.updates:
            self._bank[update.client] = update.upload[UPLOAD].detach().clone()
        return server, {}

    def state_dict(self) -> dict[str, Any]:
        """The clients' kept weights and the planned rounds' clients."""
        return {"names": self._names, "bank": self._bank, "clients": self._clients}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a checkpoint of an earlier version, which kept
        ``(round, start, end)`` per client, keeps the end weights)."""
        self._reset()
        self._names = list(state.get("names", [])) or self._names
        bank = {int(c): v for c, v in state.get("bank", {}).items()}
        self._bank = {c: (v[2] if isinstance(v, tuple | list) else v) for c, v in bank.items()}
        self._clients = {int(r): (tuple(c), int(n)) for r, (c, n) in state.get("clients", {}).items()}
        self._loaded = True

    def __repr__(self) -> str:
        return f"FedMTL(chunk={self.chunk}, strength={self.strength})"


register_algorithm(FedMTL())


def _row(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 0-dim integer ``index`` computed inside ``vmap`` and ``torch.func.grad`` (sample-level
    DP differentiates the term so), where plain indexing with it is refused as data-dependent."""
    return table.index_select(0, index.reshape(1))[0]
