"""The privacy mechanism as the federation core sees it: a small protocol, no DP in here.

The core never imports :mod:`lightning_fedrep.privacy`. A mechanism given as ``FederationConfig.privacy``
(the strategy's ``privacy=``) subclasses :class:`PrivacyMechanism`. A server-side mechanism (client-level DP)
privatizes each round's aggregate; a client-side one (sample-level DP-SGD) privatizes every local step and
leaves the aggregation to the algorithm. The core calls it at these points:

* :meth:`PrivacyMechanism.check` when the federation is configured (the strategy's construction and the
  federation's): refuse an algorithm or a setting it cannot make private, naming why;
* :meth:`PrivacyMechanism.prepare` before each aggregating round opens, with the federation's size and the
  round's planned cohort;
* :meth:`PrivacyMechanism.aggregator` when an aggregating round opens (and when a mid-round checkpoint is
  resumed), **in place of** ``Algorithm.aggregator``: the aggregator that privatizes the uploads, so
  ``Algorithm.aggregate`` and its server optimizer (``Algorithm.with_server_optimizer``: FedOpt) only
  post-process the private ``results.reduced`` (server momentum, FedAdam);
* :meth:`PrivacyMechanism.after_round` once the server step of a round that aggregated has run: the mechanism
  updates its own state (an adaptive clip, its accountant) and returns columns for the round's history row;
* :meth:`PrivacyMechanism.bind_data` when the training data is bound (the clients' sizes, the batch size);
  :meth:`PrivacyMechanism.check_module` at a fit's ``setup``, with the module;
  :meth:`PrivacyMechanism.local_objective` when a phase's local objective is resolved (the algorithm's and
  the callbacks' combined), to privatize the local step;
* :meth:`PrivacyMechanism.open_round` / :meth:`PrivacyMechanism.close_round` around every round that trains
  (federated or not), with its plan: the local steps to account;
* :meth:`PrivacyMechanism.state_dict` / :meth:`PrivacyMechanism.load_state_dict` with the federation's state
  (checkpoints, including mid-round ones).

Outside the core, ``RunSummary`` reads :meth:`PrivacyMechanism.describe` for the run folder's summary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_fedrep.federation.api.aggregation import Aggregator
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.objective import Objective


class PrivacyMechanism:
    """A differential privacy mechanism of a federation: the server's on each aggregating round's uploads
    (:class:`lightning_fedrep.privacy.ClientLevelDP`) or the clients' on each local step
    (:class:`lightning_fedrep.privacy.SampleLevelDP`). Every hook has a do-nothing default."""

    batch_sampling: str | None = None
    """How the clients' training batches must be drawn for the mechanism's guarantee: ``"poisson"`` when its
    accounting needs Poisson batches inside the clients (sample-level DP-SGD: every sample joins each local
    step independently; the strategy then calls ``RoundLoader.use_sampling("poisson")`` when it binds the
    training data, and refuses a loader that draws its own batches); ``None``: the loader's own sampling."""

    def check(self, algorithm: Algorithm, config: Any) -> None:
        """Refuse (raise, naming the argument or the algorithm and the fix) an ``algorithm`` or a
        ``config`` (the :class:`~lightning_fedrep.federation.state.FederationConfig`) the mechanism cannot make
        private. Called when the federation is configured, before any round."""

    def prepare(self, num_clients: int, cohort: int) -> None:
        """Before each aggregating round opens (every process alike): the federation's size ``num_clients`` and
        the round's planned ``cohort`` (how many clients it samples). Calibrate what depends on them (the noise for a
        target ε, the accountant's sampling), or refuse a round the budget does not cover. The default does
        nothing."""

    def aggregator(self, like: Mapping[str, Tensor], round_index: int, seed: int) -> Aggregator | None:
        """The aggregator of round ``round_index`` (called when it opens, and when a mid-round checkpoint of it
        is resumed; the core then calls ``expect(planned clients)`` or ``load_state_dict``). ``like``: the
        shared tensors' values at the round's start (not copies: read them, never modify them); ``seed``: the
        strategy's seed (draw noise from a generator seeded by ``seed`` and the round, never the global RNG,
        so that every process and a resumed run draw the same). The default returns ``None``: the algorithm's own
        aggregator (``Algorithm.aggregator``) aggregates."""
        return None

    def after_round(self, aggregator: Aggregator, round_index: int, num_clients: int) -> dict[str, float]:
        """After the server step of a round that aggregated (every process alike): update the mechanism's state
        from what ``aggregator`` (this round's, reduced over processes) released, and return columns for the
        round's history row (e.g. ``privacy/clip``, ``privacy/epsilon``). ``round_index``: the round;
        ``num_clients``: the federation's size."""
        return {}

    def bind_data(self, client_sizes: Sequence[int], batch_size: int) -> None:
        """When the training data is bound (every fit, before any round; every process alike): ``client_sizes``,
        each client's number of training examples, and ``batch_size``, the training batch size. The default does
        nothing."""

    def check_module(self, module: Any) -> None:
        """At a fit's ``setup``, with the module: refuse (raise, naming the layer or attribute and the fix) a
        module the mechanism cannot make private. The default accepts every module."""

    def local_objective(self, objective: Objective, phase: str) -> Objective:
        """The local objective of a phase training ``phase`` (``"head"``, ``"body"``, ``"all"``), given the
        algorithm's and the callbacks' combined ``objective``: a client-side mechanism returns it with its step
        rule (refusing what it cannot privatize, naming it). Resolved once per fit and phase. The default
        returns ``objective`` unchanged."""
        return objective

    def open_round(self, plan: Any) -> None:
        """When a round that trains opens, federated or not (every process alike): ``plan``, its :class:`~lightning_fedrep.federation.plan.RoundPlan` (the clients and
        their local steps). Refuse a round the budget does not cover here, before it trains. Not called again
        when a mid-round checkpoint resumes the round (the mechanism's state comes back with it). The default does
        nothing."""

    def close_round(self, plan: Any) -> dict[str, float]:
        """When a round closes, federated or not (every process alike, once): account its local steps
        (``plan``: its :class:`~lightning_fedrep.federation.plan.RoundPlan`) and return columns for its history
        row. The default returns none."""
        return {}

    def describe(self) -> dict[str, Any]:
        """The mechanism's settings and state as a run's summary records them (``summary.json``'s
        ``privacy.mechanism``, read by ``RunSummary`` at the end of each call): plain numbers and strings, the
        ``mechanism``'s name first. The default names the class only; a mechanism adds what its guarantee
        rests on (clip, noise multiplier, δ, accountant, sampling)."""
        return {"mechanism": type(self).__name__}

    def state_dict(self) -> dict[str, Any]:
        """The mechanism's state across rounds (saved with the federation)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state``, what :meth:`state_dict` returned."""
