"""The run's per-round history and the papers' figures computed from it, in one place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LAST_ROUNDS = 10
"""How many of the last evaluated rounds the papers average (``_last10``)."""
BEST_OF = ("acc", "acc_weighted")
"""The metrics (after a stage's ``/``) whose best round is kept (``_best``): the headline accuracy, as the
mean over clients and pooled over their samples (``val/acc_weighted``, the figure PFLlib's leaderboard
maximizes over rounds)."""


class History:
    """Per-round records of a federated run: evaluation summaries and callbacks' own columns.

    A round's row holds what validation measured after it (``val/acc``, ``val/acc_weighted``, ...,
    added by the strategy with :meth:`add_evaluation`) and what callbacks recorded for it
    (:meth:`record`, e.g. ``sim/time``). Only federated rounds have rows; the last fine-tuning
    evaluation is kept apart in :attr:`finetune`.
    """

    def __init__(self) -> None:
        self._evaluations: dict[int, dict[str, float]] = {}
        self._recorded: dict[int, dict[str, float]] = {}
        self._clients: dict[int, dict[str, dict[int, float]]] = {}
        self.finetune: dict[str, float] = {}
        """The summary of the last validation after a fine-tuning round (prefixed names)."""
        self.participation: dict[int, int] = {}
        """How many federated rounds each client was sampled for (clients never sampled are absent)."""

    def add_evaluation(self, round_index: int, values: dict[str, float]) -> None:
        """Set round ``round_index``'s evaluation summary (a later validation of the round replaces it)."""
        self._evaluations[round_index] = dict(values)

    def add_client_values(self, round_index: int, values: dict[str, dict[int, float]]) -> None:
        """Set round ``round_index``'s per-client evaluation values: ``{metric: {client: value}}``."""
        self._clients[round_index] = {name: dict(per_client) for name, per_client in values.items()}

    def client_values(self, round_index: int) -> dict[str, dict[int, float]]:
        """Round ``round_index``'s per-client evaluation values (``{}`` if it was not evaluated)."""
        return {name: dict(v) for name, v in self._clients.get(round_index, {}).items()}

    @property
    def client_rows(self) -> list[dict[str, Any]]:
        """Every evaluated round's per-client values, one row per (round, client):
        ``{"round": r, "client": c, <metric>: value, ...}``."""
        rows = []
        for r in sorted(self._clients):
            by_client: dict[int, dict[str, float]] = {}
            for name, per_client in self._clients[r].items():
                for client, value in per_client.items():
                    by_client.setdefault(int(client), {})[name] = value
            rows.extend({"round": r, "client": c, **by_client[c]} for c in sorted(by_client))
        return rows

    def count_participants(self, clients: Iterable[int]) -> None:
        """Count one more federated round for each of ``clients`` (when a round closes)."""
        for client in clients:
            self.participation[int(client)] = self.participation.get(int(client), 0) + 1

    def record(self, round_index: int, values: dict[str, float]) -> None:
        """Add or overwrite columns of round ``round_index``'s row."""
        self._recorded.setdefault(round_index, {}).update(values)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every round with an evaluation or recorded columns, in order:
        ``{"round": r, <evaluation summary>, <recorded columns>}`` (a round recorded but not evaluated,
        e.g. between ``check_val_every_n_epoch`` validations, has only its recorded columns)."""
        rounds = sorted(set(self._evaluations) | set(self._recorded))
        return [self._row(r) for r in rounds]

    @property
    def evaluated_rows(self) -> list[dict[str, Any]]:
        """The rows of the evaluated rounds only (what the papers' figures are computed from)."""
        return [self._row(r) for r in sorted(self._evaluations)]

    def is_evaluated(self, round_index: int) -> bool:
        """Whether round ``round_index`` has an evaluation."""
        return round_index in self._evaluations

    def _row(self, round_index: int) -> dict[str, Any]:
        return {
            "round": round_index,
            **self._evaluations.get(round_index, {}),
            **self._recorded.get(round_index, {}),
        }

    def recorded(self, round_index: int) -> dict[str, float]:
        """The columns callbacks recorded for a round (evaluated or not)."""
        return dict(self._recorded.get(round_index, {}))

    @property
    def evaluated_rounds(self) -> int:
        """How many rounds have an evaluation (the last-10 figures average ``min(10, this)`` of them)."""
        return len(self._evaluations)

    def last_rounds_mean(self) -> dict[str, float]:
        """Each evaluation metric's mean over the last (up to) 10 evaluated rounds that all have it."""
        last = [self._evaluations[r] for r in sorted(self._evaluations)[-LAST_ROUNDS:]]
        if not last:
            return {}
        return {k: sum(e[k] for e in last) / len(last) for k in last[-1] if all(k in e for e in last)}

    def best_rounds(self) -> tuple[dict[str, float], dict[str, float]]:
        """The best round so far of each headline accuracy (``<stage>/acc``, ``<stage>/acc_weighted``; see
        :data:`BEST_OF`): its maximum over the evaluated rounds, and the round that reached it first.

        The round is selected on the evaluated split (the test split without a validation split), so the
        value is optimistic: the leaderboard's figure, never the headline. Rounds whose value is NaN (a
        model with non-finite outputs) are passed over; a metric NaN in every round is NaN, at round -1.
        """
        best: dict[str, float] = {}
        where: dict[str, float] = {}
        for r in sorted(self._evaluations):
            for key, value in self._evaluations[r].items():
                if key.partition("/")[2] not in BEST_OF:
                    continue
                if key not in best or (value == value and not value <= best[key]):
                    best[key], where[key] = value, float(r if value == value else -1)
        return best, where

    def results(self) -> dict[str, dict[str, float]]:
        """The papers' figures: the last evaluated round (``final``), the mean over the last 10 evaluated
        rounds of every evaluation metric (``last10``), the best round of each headline accuracy (``best``, and
        the round, ``best_round``: selected on the evaluated split, optimistic), and the last fine-tuning
        evaluation (``finetune``)."""
        out: dict[str, dict[str, float]] = {}
        rows = self.evaluated_rows
        if rows:
            out["final"] = {k: v for k, v in rows[-1].items() if k != "round"}
            out["last10"] = self.last_rounds_mean()
            out["last10_rounds"] = {"rounds": float(min(LAST_ROUNDS, len(rows)))}
            out["best"], out["best_round"] = self.best_rounds()
        if self.finetune:
            out["finetune"] = dict(self.finetune)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "evaluations": {r: dict(v) for r, v in self._evaluations.items()},
            "recorded": {r: dict(v) for r, v in self._recorded.items()},
            "finetune": dict(self.finetune),
            "clients": {r: {n: dict(v) for n, v in per.items()} for r, per in self._clients.items()},
            "participation": dict(self.participation),
        }

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        if isinstance(state, list):  # checkpoints of version 1: a list of evaluated rows
            self._evaluations = {int(h["round"]): {k: v for k, v in h.items() if k != "round"} for h in state}
            self._recorded, self.finetune, self._clients, self.participation = {}, {}, {}, {}
            return
        self._evaluations = {int(r): dict(v) for r, v in state["evaluations"].items()}
        self._recorded = {int(r): dict(v) for r, v in state["recorded"].items()}
        self.finetune = dict(state.get("finetune", {}))
        self._clients = {
            int(r): {n: {int(c): v for c, v in per_client.items()} for n, per_client in per.items()}
            for r, per in state.get("clients", {}).items()
        }
        self.participation = {int(c): int(n) for c, n in state.get("participation", {}).items()}
