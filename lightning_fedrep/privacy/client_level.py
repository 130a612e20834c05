"""Client-level differential privacy with a trusted server: ``FederatedStrategy(privacy=ClientLevelDP(...))``.

Each sampled client's whole dataset is the unit of privacy, and what is released is the sequence of global
shared tensors (FedRep's body; a head never leaves its client, so it needs no privatizing). Each round the
server clips every surviving client's update of the shared tensors to a flat L2 norm and adds Gaussian noise
to their sum (:class:`~lightning_fedrep.privacy.aggregator.ClippedNoisyMean`), before any server step of the
algorithm (server momentum, FedOpt), which only post-processes the private mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_fedrep.federation.api.aggregation import Aggregator
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.privacy.aggregator import ClippedNoisyMean
from lightning_fedrep.privacy.clipping import AdaptiveClipping, update_noise_multiplier


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

    Args:
        clip: the flat L2 norm ``C`` every client's update is clipped to (> 0); with ``adaptive``, the
            first round's clip.
        noise_multiplier: ``z``, the noise std on the sum of clipped updates in units of ``clip`` (>= 0;
            ``0`` adds no noise and protects nothing). Give this or ``target_epsilon``.
        target_epsilon: the ε to spend over the run, from which ``z`` is solved (needs the accountant).
        delta: the δ of (ε, δ)-DP, in (0, 1).
        adaptive: adaptive clipping (:class:`~lightning_fedrep.privacy.clipping.AdaptiveClipping`), or
            ``None`` for a fixed clip.
    """

    def __init__(
        self,
        clip: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        adaptive: AdaptiveClipping | None = None,
    ):
        owner = "ClientLevelDP"
        self.clip = check_real("clip", clip, 0.0, low_open=True, owner=owner)
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                "ClientLevelDP takes exactly one of noise_multiplier= (the noise std in units of clip) and "
                f"target_epsilon= (the ε to spend over the run), got noise_multiplier={noise_multiplier!r} and "
                f"target_epsilon={target_epsilon!r}."
            )
        if target_epsilon is not None:
            check_real("target_epsilon", target_epsilon, 0.0, low_open=True, owner=owner)
            raise NotImplementedError(
                "ClientLevelDP(target_epsilon=...) needs the privacy accountant, which this build does not wire "
                "yet: pass noise_multiplier= instead."
            )
        self.noise_multiplier = check_real("noise_multiplier", noise_multiplier, 0.0, owner=owner)
        self.target_epsilon = target_epsilon
        self.delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True, owner=owner)
        if adaptive is not None and not isinstance(adaptive, AdaptiveClipping):
            raise TypeError(
                f"ClientLevelDP(adaptive=...) must be an AdaptiveClipping or None, got {type(adaptive).__name__}."
            )
        self.adaptive = adaptive
        if adaptive is not None and adaptive.count_noise_std is not None:
            update_noise_multiplier(self.noise_multiplier, adaptive.count_noise_std)  # refuse it now
        self.current_clip = self.clip
        """The clip of the next round (moves under adaptive clipping; saved with the federation)."""
        self.rounds = 0
        """The rounds released so far."""

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

    def aggregator(self, like: Mapping[str, Tensor], round_index: int, seed: int) -> Aggregator:
        """This round's :class:`~lightning_fedrep.privacy.aggregator.ClippedNoisyMean` with the current clip."""
        return ClippedNoisyMean(
            like, self.current_clip, self.noise_multiplier, seed, round_index, self.adaptive
        )

    def after_round(self, aggregator: Aggregator, round_index: int, num_clients: int) -> dict[str, float]:
        """Count the released round, move an adaptive clip; the history gets ``privacy/clip`` (the clip this
        round used) and, under adaptive clipping, ``privacy/unclipped_fraction`` (noised, so releasable)."""
        if not isinstance(aggregator, ClippedNoisyMean):
            raise TypeError(
                f"ClientLevelDP aggregates with ClippedNoisyMean, got {type(aggregator).__name__}."
            )
        self.rounds += 1
        metrics = {"privacy/clip": aggregator.clip}
        if self.adaptive is not None:
            fraction = aggregator.unclipped_fraction
            self.current_clip = self.adaptive.next_clip(aggregator.clip, fraction)
            metrics["privacy/unclipped_fraction"] = fraction
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.current_clip, "rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current_clip = float(state.get("clip", self.clip))
        self.rounds = int(state.get("rounds", 0))

    def __repr__(self) -> str:
        return (
            f"ClientLevelDP(clip={self.clip}, noise_multiplier={self.noise_multiplier}, delta={self.delta}, "
            f"adaptive={self.adaptive!r})"
        )
