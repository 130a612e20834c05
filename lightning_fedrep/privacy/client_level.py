"""Client-level differential privacy with a trusted server: ``FederatedStrategy(privacy=ClientLevelDP(...))``.

Each sampled client's whole dataset is the unit of privacy, and what is released is the sequence of global
shared tensors (FedRep's body; a head never leaves its client, so it needs no privatizing). Each round the
server clips every surviving client's update of the shared tensors to a flat L2 norm and adds Gaussian noise
to their sum (:class:`~lightning_fedrep.privacy.aggregator.ClippedNoisyMean`), before any server step of the
algorithm (server momentum, FedOpt), which only post-processes the private mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch import Tensor

from lightning_fedrep.federation.api.aggregation import Aggregator
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.privacy.accounting import PrivacyAccountant
from lightning_fedrep.privacy.aggregator import ClippedNoisyMean
from lightning_fedrep.privacy.budget import ClientLevelBudget
from lightning_fedrep.privacy.clipping import AdaptiveClipping, update_noise_multiplier
from lightning_fedrep.privacy.settings import noise_settings


class ClientLevelDP(PrivacyMechanism):
    """Client-level DP (DP-FedAvg, and DP-FedRep / CENTAUR where the algorithm shares the body only): per
    round, ``new = start + (sum_i clip_C(upload_i - start) + N(0, (z C)^2 I)) / m`` over the shared
    tensors, ``m`` the planned cohort, every client weighing 1.

    The noise std on the mean is ``noise_multiplier * clip / m`` (Flower's, CENTAUR's, Opacus's and
    pfl-research's convention). Shared floating-point buffers (BatchNorm's running statistics under
    ``buffers="shared"``) are clipped and noised with the parameters, inside the one delta; integer buffers
    (``num_batches_tracked``) are not released at all: they keep their values from before training.

    Refused at construction: ``weighting="samples"`` (sample weights let one client's data move the sum by
    more than ``clip``: pass ``weighting="uniform"``), an algorithm that shares nothing (Local Only), and one
    that chooses its own aggregator (SCAFFOLD's control-variate changes, FedCP's extra uploads, L2GD's
    unweighted mean, Fed-MTL's stacked weights: the mechanism would replace it and drop what it receives).

    Accounting (``accountant="rdp"``, the default): every released round is one step of a
    :class:`~lightning_fedrep.privacy.accounting.PrivacyAccountant` (Opacus / dp-accounting, the ``privacy``
    extra), sampled as the cohort is drawn (``lightning_fedrep.privacy.budget``: ``m`` distinct clients of
    ``N``, or every client), and the history gets ``privacy/epsilon`` (at ``delta``) every round. With
    ``target_epsilon`` the noise multiplier is solved before the first round for ``rounds`` rounds, and a round
    beyond them is refused. ``accountant=None`` accounts nothing and reports no ε (e.g. ``noise_multiplier=0``).

    Args:
        clip: the flat L2 norm ``C`` every client's update is clipped to (> 0); with ``adaptive``, the
            first round's clip.
        noise_multiplier: ``z``, the noise std on the sum of clipped updates in units of ``clip`` (>= 0;
            ``0`` adds no noise and protects nothing: only with ``accountant=None``). Give this or
            ``target_epsilon``.
        target_epsilon: the ε the whole run may spend; ``z`` is solved from it for ``rounds`` rounds (at the
            first round, when the cohort's sampling is known). Needs ``rounds`` and an accountant.
        delta: the δ of (ε, δ)-DP, in (0, 1); usually below 1 / (number of clients).
        adaptive: adaptive clipping (:class:`~lightning_fedrep.privacy.clipping.AdaptiveClipping`), or
            ``None`` for a fixed clip.
        accountant: ``"rdp"``, ``"pld"`` (tighter; rounds on every client only) or ``None`` (no accounting).
        rounds: the rounds the budget covers (the Trainer's ``max_epochs``): required with ``target_epsilon``;
            with ``noise_multiplier``, optional (a round beyond it is refused).
    """

    def __init__(
        self,
        clip: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        adaptive: AdaptiveClipping | None = None,
        accountant: Literal["rdp", "pld"] | None = "rdp",
        rounds: int | None = None,
    ):
        settings = noise_settings(
            "ClientLevelDP",
            "the ε to spend over the run",
            ("rdp", "pld"),
            clip=clip,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            rounds=rounds,
            accountant=accountant,
        )
        self.clip, self.delta, self.rounds = settings.clip, settings.delta, settings.rounds
        self.noise_multiplier, self.target_epsilon = settings.noise_multiplier, settings.target_epsilon
        self.accountant = settings.accountant
        if adaptive is not None and not isinstance(adaptive, AdaptiveClipping):
            raise TypeError(
                f"ClientLevelDP(adaptive=...) must be an AdaptiveClipping or None, got {type(adaptive).__name__}."
            )
        self.adaptive = adaptive
        if (
            adaptive is not None
            and adaptive.count_noise_std is not None
            and self.noise_multiplier is not None
        ):
            update_noise_multiplier(self.noise_multiplier, adaptive.count_noise_std)  # refuse it now
        self._check_library()
        self.budget = (
            None
            if self.accountant is None
            else ClientLevelBudget(self.accountant, self.delta, self.target_epsilon, self.rounds)
        )
        """The accountant of the released rounds (``None`` with ``accountant=None``)."""
        self.current_clip = self.clip
        """The clip of the next round (moves under adaptive clipping; saved with the federation)."""
        self.current_noise_multiplier = self.noise_multiplier
        """The noise multiplier the rounds use: the given one, or the one solved for ``target_epsilon``."""
        self.released = 0
        """The rounds released so far."""

    def _check_library(self) -> None:
        """A missing ``privacy`` extra refused at construction (an ``ImportError`` naming it)."""
        if self.accountant is not None:  # an ImportError naming the privacy extra now, not at the first round
            PrivacyAccountant(self.accountant, "poisson")
            if self.accountant == "rdp":
                PrivacyAccountant("rdp", "without_replacement", population=2)

    def check(self, algorithm: Algorithm, config: Any) -> None:
        """Refuse sample weighting, an algorithm that shares nothing, and one with its own aggregator."""
        if config.weighting != "uniform":
            raise ValueError(
                f"privacy=ClientLevelDP(...) needs weighting='uniform', got weighting={config.weighting!r}: "
                "sample weights let one client's data move the average by more than clip / m, which breaks the "
                "noise's calibration. Pass weighting='uniform' to the strategy."
            )
        name = type(algorithm).__name__
        if type(algorithm).aggregator is not Algorithm.aggregator:
            raise ValueError(
                f"{name} ({algorithm.name!r}) chooses its own aggregator ({name}.aggregator), which receives "
                "what the client-level DP mechanism cannot privatize (uploads beyond the shared tensors, weights "
                "of its own, or every client's update kept apart): the mechanism replaces the aggregator by its "
                "clipped noisy mean of the shared tensors. Use an algorithm whose server step reads only "
                "results.reduced (FedRep, FedPer, FedAvg, LG-FedAvg, ...), or train it without privacy=."
            )
        if not algorithm.shares:
            raise ValueError(
                f"{name} ({algorithm.name!r}) shares nothing with the server: client-level DP has nothing to "
                "privatize (every client trains alone). Train it without privacy=."
            )

    def prepare(self, num_clients: int, cohort: int) -> None:
        """Before a round: the accountant for the cohort's sampling, the noise for a target ε (first round), a
        round beyond the budget's ``rounds`` refused."""
        if self.budget is not None:
            self.current_noise_multiplier = self.budget.prepare(
                num_clients, cohort, self.current_noise_multiplier
            )
        elif self.rounds is not None and self.released >= self.rounds:
            raise RuntimeError(
                f"ClientLevelDP(rounds={self.rounds}) released {self.released} rounds: set the Trainer's "
                f"max_epochs={self.rounds}."
            )

    def aggregator(self, like: Mapping[str, Tensor], round_index: int, seed: int) -> Aggregator:
        """This round's :class:`~lightning_fedrep.privacy.aggregator.ClippedNoisyMean` with the current clip."""
        if self.current_noise_multiplier is None:
            raise RuntimeError(
                "ClientLevelDP: the noise multiplier is solved in prepare(), before the first round."
            )
        return ClippedNoisyMean(
            like, self.current_clip, self.current_noise_multiplier, seed, round_index, self.adaptive
        )

    def after_round(self, aggregator: Aggregator, round_index: int, num_clients: int) -> dict[str, float]:
        """Count the released round ``round_index`` (its ``aggregator``, reduced; ``num_clients``: the federation's
        size), move an adaptive clip; the history gets ``privacy/clip`` (the clip this
        round used), ``privacy/noise_multiplier``, ``privacy/epsilon`` (with an accountant: the ε spent so far at
        ``delta``) and, under adaptive clipping, ``privacy/unclipped_fraction`` (noised, so releasable)."""
        if not isinstance(aggregator, ClippedNoisyMean):
            raise TypeError(
                f"ClientLevelDP aggregates with ClippedNoisyMean, got {type(aggregator).__name__}."
            )
        self.released += 1
        metrics = {"privacy/clip": aggregator.clip, "privacy/noise_multiplier": aggregator.noise_multiplier}
        if self.budget is not None:
            metrics["privacy/epsilon"] = self.budget.spend(aggregator.noise_multiplier)
        if self.adaptive is not None:
            fraction = aggregator.unclipped_fraction
            self.current_clip = self.adaptive.next_clip(aggregator.clip, fraction)
            metrics["privacy/unclipped_fraction"] = fraction
        return metrics

    def describe(self) -> dict[str, Any]:
        """The mechanism as a run's summary records it (``summary.json``'s ``privacy.mechanism``): the settings
        given (``clip``, ``target_epsilon``, ``delta``, ``accountant``, ``rounds``, ``adaptive``: its
        ``target_quantile``, ``learning_rate``, ``count_noise_std`` or ``None``), the noise multiplier the rounds
        use (``noise_multiplier``: the given one, or the one solved for ``target_epsilon``; ``None`` before the
        first round then), the clip of the next round (``current_clip``), the rounds ``released`` and the
        sampling as accounted (``sampling``, ``sample_rate``, ``population``; ``None`` without an accountant or
        before the first round). No ε: the run's history holds the ε each round spent."""
        accountant = None if self.budget is None else self.budget.accountant
        adaptive = self.adaptive
        return {
            "mechanism": type(self).__name__,
            "unit": "client",
            "clip": self.clip,
            "adaptive": None
            if adaptive is None
            else {
                "target_quantile": adaptive.target_quantile,
                "learning_rate": adaptive.learning_rate,
                "count_noise_std": adaptive.count_noise_std,
            },
            "current_clip": self.current_clip,
            "noise_multiplier": self.current_noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "sampling": None if accountant is None else accountant.sampling,
            "sample_rate": None if self.budget is None else self.budget.sample_rate,
            "population": None if accountant is None else accountant.population,
            "rounds": self.rounds,
            "released": self.released,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "clip": self.current_clip,
            "noise_multiplier": self.current_noise_multiplier,
            "released": self.released,
            "budget": None if self.budget is None else self.budget.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current_clip = float(state.get("clip", self.clip))
        self.current_noise_multiplier = state.get("noise_multiplier", self.noise_multiplier)
        self.released = int(state.get("released", 0))
        if self.budget is not None:
            self.budget.load_state_dict(state.get("budget") or {})

    def __repr__(self) -> str:
        return (
            f"ClientLevelDP(clip={self.clip}, noise_multiplier={self.noise_multiplier}, "
            f"target_epsilon={self.target_epsilon}, delta={self.delta}, adaptive={self.adaptive!r}, "
            f"accountant={self.accountant!r}, rounds={self.rounds})"
        )
