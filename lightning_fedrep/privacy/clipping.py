"""Clipping a client's update to a flat L2 norm, and adaptive clipping (Andrew et al. 2021).

:func:`clip_flat` scales a client's update (its shared tensors' changes, all together) to L2 norm at most
``clip``. :class:`AdaptiveClipping` moves the clip toward a target quantile of the clients' update norms
from a noised count of the unclipped clients, and :func:`update_noise_multiplier` gives the noise multiplier
left to the update once that count's noise has taken its share of the privacy budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedrep.federation.api.arguments import check_real


def flat_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of ``tensors`` taken as one flat vector (a 0-d tensor; float64 where they are)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def clip_flat(tensors: Sequence[Tensor], clip: float) -> tuple[Tensor, Tensor]:
    """Scale ``tensors`` in place by ``min(1, clip / norm)``, ``norm`` their flat L2 norm; returns ``norm``
    (before clipping) and the scale, as 0-d tensors (no host synchronization)."""
    norm = flat_norm(tensors)
    scale = (clip / norm.clamp_min(torch.finfo(norm.dtype).tiny)).clamp(max=1.0)
    for t in tensors:
        t.mul_(scale)
    return norm, scale


class AdaptiveClipping:
    """Adaptive clipping to a quantile of the update norms (Andrew, Thakkar, McMahan, Ramaswamy 2021), as
    pfl-research does it: each client also reports whether its update norm was at most this round's clip
    ``C``; the server adds noise to that count, and after the round (whose update noise used ``C``) sets
    ``C <- C * exp(-learning_rate * (b - target_quantile))``, ``b`` the noised fraction of unclipped clients.
    Starting from ``ClientLevelDP(clip=...)``, ``C`` drifts geometrically toward the ``target_quantile`` of
    the norms.

    The count is released too: its Gaussian noise (std ``count_noise_std`` on the sum of the clients'
    centred indicators ``1[norm <= C] - 1/2``, sensitivity 1/2) takes part of the budget, and the update's
    noise multiplier becomes ``z_update = (z**-2 - (2 * count_noise_std)**-2) ** -1/2`` so that the pair
    spends what one Gaussian mechanism of multiplier ``z`` (``ClientLevelDP``'s ``noise_multiplier``, the one
    accounted) spends (Andrew et al., Theorem 1).

    Args:
        target_quantile: the quantile of the clients' update norms the clip tracks, in (0, 1).
        learning_rate: the geometric step ``eta`` (Andrew et al. and pfl-research: 0.2).
        count_noise_std: the std of the count's noise; ``None``: the planned cohort / 20 (Andrew et al.'s and
            Flower's default; pfl-research recommends cohort / 10). A smaller value leaves the update less
            noise to spend; it must stay above ``1 / (2 z)``.
    """

    def __init__(
        self, target_quantile: float = 0.5, learning_rate: float = 0.2, count_noise_std: float | None = None
    ):
        owner = "AdaptiveClipping"
        self.target_quantile = check_real(
            "target_quantile", target_quantile, 0.0, 1.0, low_open=True, high_open=True, owner=owner
        )
        self.learning_rate = check_real("learning_rate", learning_rate, 0.0, low_open=True, owner=owner)
        self.count_noise_std = (
            None
            if count_noise_std is None
            else check_real("count_noise_std", count_noise_std, 0.0, low_open=True, owner=owner)
        )

    def count_std(self, cohort: int) -> float:
        """The std of the noise on the count of unclipped clients for a planned cohort of ``cohort``."""
        return self.count_noise_std if self.count_noise_std is not None else cohort / 20

    def next_clip(self, clip: float, unclipped_fraction: float) -> float:
        """The clip of the next round, from this round's ``clip`` and its noised ``unclipped_fraction``."""
        return clip * math.exp(-self.learning_rate * (unclipped_fraction - self.target_quantile))

    def __repr__(self) -> str:
        return (
            f"AdaptiveClipping(target_quantile={self.target_quantile}, learning_rate={self.learning_rate}, "
            f"count_noise_std={self.count_noise_std})"
        )


def update_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """The update's noise multiplier ``(z**-2 - (2 * count_std)**-2) ** -1/2`` that, with the count's noise
    of std ``count_std`` (sensitivity 1/2), spends what one Gaussian mechanism of multiplier ``z`` =
    ``noise_multiplier`` spends; ``0`` when ``z`` is (no noise at all). Refused where it is not positive
    (the count's noise would need the whole budget)."""
    if noise_multiplier == 0:
        return 0.0
    rest = noise_multiplier**-2 - (2 * count_std) ** -2 if count_std > 0 else -math.inf
    if rest <= 0:
        raise ValueError(
            f"Adaptive clipping with noise_multiplier={noise_multiplier} and a count noise std of {count_std} "
            f"leaves the update no budget: the count's noise must have std > 1 / (2 * noise_multiplier) = "
            f"{1 / (2 * noise_multiplier):g}. Raise AdaptiveClipping(count_noise_std=...) (default: the planned "
            "cohort / 20), sample more clients per round, or raise noise_multiplier."
        )
    return rest**-0.5
