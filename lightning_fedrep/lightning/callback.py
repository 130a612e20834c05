"""``FederatedCallback``: the one API through which callbacks take part in a federated run.

A federated callback is a Lightning ``Callback`` (every Lightning hook and ``state_dict`` work as
usual) with federated hooks the strategy calls, in the order of ``trainer.callbacks``: ``configure_round``,
``objective``, ``on_round_start``, ``on_client_start``, ``on_client_end`` and ``on_round_end`` (each one's
docstring says when it runs; the guide's table, docs/algorithms/adding.md, shows them side by side).

From any hook, :meth:`FederatedCallback.federation` gives the run's :class:`Federation`: read-only views
(``split``, ``shared_names``, ``local_names``, ``global_tensors()``, ``client_tensors(c)``,
``num_clients``, ``history``), the explicit updates ``update_global`` / ``update_client``, and
:meth:`FederatedCallback.record` adds the callback's own columns to the round's history row.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_fedrep.federation import ClientResult, Federation, RoundResult
from lightning_fedrep.federation.api.objective import Objective
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.session.api import FederatedStrategyAPI

__all__ = ["ClientResult", "FederatedCallback", "RoundResult"]


class FederatedCallback(Callback):
    """Base class of callbacks that take part in federated rounds (the hooks below; see the module docstring).

    Set ``needs_client_timing = True`` on a callback that reads ``ClientResult.seconds``: the strategy
    then times every client's steps (synchronising the device on GPU), which it skips otherwise.
    Set ``needs_every_client = True`` on one that reads or updates clients' state beyond what
    ``on_client_*`` hands it (a server step over all heads, metrics over every client): on several
    processes it needs every client on every rank, which ``client_store="sharded"`` refuses at setup.
    """

    needs_client_timing: bool = False
    needs_every_client: bool = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a Trainer whose strategy is not federated (subclasses call ``super().setup``)."""
        self.strategy(trainer)

    # ------------------------------------------------------------------ federated hooks
    def configure_round(self, trainer: L.Trainer, plan: RoundPlan) -> RoundPlan:
        """Return the round's plan, changed or not (once per round, before it starts).

        Args:
            trainer: the Lightning ``Trainer`` running the federation.
            plan: the round's :class:`~lightning_fedrep.RoundPlan` as the algorithm and the callbacks before
                this one left it; return it or ``plan.replace(clients=..., phases=..., aggregate=...)``.
        """
        return plan

    def objective(self, phase: str) -> Objective:
        """What the callback adds to every local step of a phase training ``phase`` (``"head"``, ``"body"``,
        ``"all"``): :class:`~lightning_fedrep.LossTerm` s added to the loss, gradient and parameter transforms
        around the optimizer step; the same hook as ``Algorithm.objective(phase)``, and the terms run as the
        algorithm's do. Called once per fit and phase part, at the strategy's ``setup``, after every callback's
        ``setup(trainer, pl_module, stage)``: keep there what the objective needs of the trainer or module, and
        read state that is set later (e.g. per-client tables) when the term runs. A term with
        ``vmappable=False`` keeps ``runner="auto"`` sequential (naming it) and is refused by
        ``runner="vectorized"``. The default adds nothing.

        Args:
            phase: the phase's part, ``"head"``, ``"body"`` or ``"all"``.
        """
        return Objective()

    def on_round_start(self, trainer: L.Trainer, pl_module: L.LightningModule, plan: RoundPlan) -> None:
        """Before the round's first step.

        Args:
            trainer: the Lightning ``Trainer`` running the federation.
            pl_module: the ``LightningModule`` being trained (the live client's tensors are loaded in it).
            plan: the round's :class:`~lightning_fedrep.RoundPlan` (after every ``configure_round``).
        """

    def on_client_start(self, trainer: L.Trainer, pl_module: L.LightningModule, client: int) -> None:
        """After ``client`` was loaded into the module, before its first step of the round (on several
        processes: only on the rank that trains it).

        Args:
            trainer: the Lightning ``Trainer`` running the federation.
            pl_module: the ``LightningModule`` being trained (the live client's tensors are loaded in it).
            client: the client's index.
        """

    def on_client_end(self, trainer: L.Trainer, pl_module: L.LightningModule, result: ClientResult) -> None:
        """After a client's last step of the round, once its state is stored (on several processes:
        only on the rank that trained it; decide from :meth:`on_round_end`'s result, which every rank sees).

        Args:
            trainer: the Lightning ``Trainer`` running the federation.
            pl_module: the ``LightningModule`` being trained (the live client's tensors are loaded in it).
            result: the client's :class:`~lightning_fedrep.ClientResult` (round, client, steps, seconds).
        """

    def on_round_end(self, trainer: L.Trainer, pl_module: L.LightningModule, result: RoundResult) -> None:
        """After the round's aggregation, before validation and checkpoints. On several processes
        ``result.clients`` holds every rank's clients and every rank holds every client's state.

        Args:
            trainer: the Lightning ``Trainer`` running the federation.
            pl_module: the ``LightningModule`` being trained (the live client's tensors are loaded in it).
            result: the round's :class:`~lightning_fedrep.RoundResult` (its plan, its clients' results,
                whether it aggregated).
        """

    # ------------------------------------------------------------------ helpers
    def strategy(self, trainer: L.Trainer) -> FederatedStrategyAPI:
        """The federated strategy of ``trainer`` (the Lightning ``Trainer``; a clear error if it has none)."""
        strategy = trainer.strategy
        if not isinstance(strategy, FederatedStrategyAPI):
            raise TypeError(
                f"{type(self).__name__} takes part in federated rounds: use it with a FederatedStrategy "
                f"(e.g. Trainer(strategy='fedrep')), not {type(strategy).__name__}."
            )
        return strategy

    def federation(self, trainer: L.Trainer) -> Federation:
        """The federation ``trainer`` (the Lightning ``Trainer``) runs: read-only views of the split and the
        tensors, and explicit updates."""
        return self.strategy(trainer).require_federation()

    def record(self, trainer: L.Trainer, **values: float) -> None:
        """Add ``values`` as columns of the current round's history row (``strategy.history``, summaries)
        of the federation ``trainer`` (the Lightning ``Trainer``) runs."""
        self.federation(trainer).record(**values)
