"""The client-level DP aggregator: clipped update deltas, summed in float64, noised once per round.

:class:`ClippedNoisyMean` is :class:`~lightning_fedrep.federation.api.aggregation.WeightedMean` over each
surviving client's update delta (its upload minus the round's starting global values), clipped to a flat L2
norm, every client weighing 1; at the round's close it adds Gaussian noise to the sums and divides by the
**planned** cohort. The noise comes from a generator seeded by the strategy's seed and the round, so every
process and a resumed run draw the same.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import ClientUpdate, WeightedAverage, WeightedMean
from lightning_fedrep.federation.plan import round_generator
from lightning_fedrep.privacy.clipping import AdaptiveClipping, clip_flat, update_noise_multiplier

NOISE_KEY = zlib.crc32(b"privacy/client_level")
"""The key of the noise's stream among the round's draws (``RoundPlan.generator`` uses the same scheme)."""


def noise_generator(seed: int, round_index: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for round ``round_index``'s noise, seeded from the strategy's ``seed`` and
    the round (never the global RNG): the same draws on every process and in a resumed run."""
    draw = round_generator(seed, round_index, 0x5EED, NOISE_KEY)
    value = int(torch.randint(0, 2**62, (1,), generator=draw))
    return torch.Generator(device=device).manual_seed(value)


class ClippedNoisyMean(WeightedMean):
    """The private mean of a round's updates (client-level DP, a trusted server):
    ``start + (sum_i clip(upload_i - start) + N(0, (z_update * clip)^2 I)) / m``.

    Each surviving client's upload of the shared floating-point tensors becomes its delta against the
    round's starting values ``like``, clipped to flat L2 norm ``clip`` over all of them together
    (``clip_flat``), and added to ``WeightedMean``'s float64 sums with
    weight 1 (the sums' sensitivity to one client is ``clip``; sample weights would break it). ``m`` is the
    planned cohort (:meth:`expect`), not the survivors: a client that fails still counts, so the noise on the
    mean keeps its std ``z * clip / m`` (Flower divides by the survivors' sampled count the same way but only
    warns; dividing by the survivors would under-noise). Non-floating shared tensors (BatchNorm's
    ``num_batches_tracked``) are not released: they keep the round's starting values.

    The noise is drawn once, at the first :meth:`result` (the round's close, after ``reduce`` on several
    processes), in float64 on the tensors' device from ``noise_generator``, then cast; from then on the
    sums hold the noised sums, so nothing read from the aggregator afterwards is unprivatized. A mid-round
    checkpoint (``state_dict``) holds the clipped sums, the count and the planned cohort.

    With ``adaptive`` each client also adds its centred indicator ``1[norm <= clip] - 1/2`` to a count; the
    count gets noise of std ``adaptive.count_std(m)`` and :attr:`unclipped_fraction` is the noised fraction
    of unclipped clients; the update's noise multiplier is then
    ``update_noise_multiplier`` of ``noise_multiplier``.

    Args:
        like: the shared tensors' values at the round's start (read, never modified).
        clip: this round's clip ``C`` (> 0).
        noise_multiplier: ``z``, the multiplier the accountant counts (the update's own is smaller under
            adaptive clipping).
        seed: the strategy's seed; ``round_index``: the round (both seed the noise).
        adaptive: the adaptive clipping settings, or ``None`` (a fixed clip, no count).
    """

    def __init__(
        self,
        like: Mapping[str, Tensor],
        clip: float,
        noise_multiplier: float,
        seed: int,
        round_index: int,
        adaptive: AdaptiveClipping | None = None,
    ):
        self._start = dict(like)
        private = {n: t for n, t in like.items() if t.is_floating_point()}
        super().__init__(private)
        self.private_names: tuple[str, ...] = tuple(private)
        """The names the mechanism releases (noised); the other shared names keep their starting values."""
        self.names = tuple(like)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.adaptive = adaptive
        self.seed, self.round_index = int(seed), int(round_index)
        device = next(iter(private.values())).device if private else torch.device("cpu")
        self.unclipped = torch.zeros((), dtype=torch.float64, device=device)
        """The sum of the clients' centred indicators ``1[norm <= clip] - 1/2`` (noised once released)."""
        self.planned = 0
        """The planned cohort ``m`` the noised sums are divided by (:meth:`expect`)."""
        self._released: dict[str, Tensor] | None = None

    def expect(self, clients: int) -> None:
        """The round opens with ``clients`` planned participants: the ``m`` of the mean (refusing an adaptive
        clip whose count noise would leave the update no budget)."""
        self.planned = int(clients)
        self.update_noise_multiplier()

    def update_noise_multiplier(self) -> float:
        """The noise multiplier of the update itself: ``noise_multiplier``, or less under adaptive clipping
        (the count's noise takes its share)."""
        if self.adaptive is None:
            return self.noise_multiplier
        return update_noise_multiplier(self.noise_multiplier, self.adaptive.count_std(self.planned))

    def clipped_delta(self, update: ClientUpdate) -> tuple[list[Tensor], Tensor]:
        """The clipped delta of one client's ``update`` (float64 copies, in :attr:`private_names`' order) and its
        norm before clipping. Refuses an upload holding names outside the shared tensors (nothing else can be privatized)."""
        extra = sorted(set(update.upload) - set(self.names))
        if extra:
            raise ValueError(
                f"Client {update.client} uploaded {extra}, which are not shared tensors: client-level DP "
                f"privatizes only the shared tensors {list(self.names)[:6]}... Upload only those "
                "(Algorithm.finish_client), or train without privacy=."
            )
        deltas = []
        for name in self.private_names:
            delta = update.upload[name].detach().to(torch.float64, copy=True)
            deltas.append(delta.sub_(self._start[name]))
        norm, _ = clip_flat(deltas, self.clip)
        return deltas, norm

    def add(self, update: ClientUpdate) -> None:
        """Add one surviving client's clipped delta (weight 1, whatever ``update.weight``)."""
        if self._released is not None:
            raise RuntimeError("This round's private mean was released already: no update can join it.")
        deltas, norm = self.clipped_delta(update)
        WeightedAverage.add(self, deltas, 1.0)
        self.unclipped += (norm <= self.clip).to(torch.float64) - 0.5

    def flat(self) -> Tensor:
        """The sums, the weight and the count in one float64 vector (one all-reduce over processes)."""
        return torch.cat([super().flat(), self.unclipped.reshape(1).to(torch.float64)])

    def load_flat(self, flat: Tensor) -> None:
        super().load_flat(flat[:-1])
        self.unclipped = flat[-1].clone().to(self.unclipped.device)

    def reduce(self, collective: Any) -> None:
        if self._released is not None:
            raise RuntimeError("This round's private mean was released already: reduce before result().")
        super().reduce(collective)

    def result(self) -> dict[str, Tensor]:
        """The private new values of every shared tensor (the noise is drawn at the first call)."""
        if self._released is None:
            self._released = self._release()
        return dict(self._released)

    @property
    def unclipped_fraction(self) -> float:
        """The noised fraction of the planned cohort whose update norm was at most the clip (after
        :meth:`result`; adaptive clipping only)."""
        if self._released is None or self.adaptive is None:
            raise RuntimeError(
                "The unclipped fraction is released with the round's result, under adaptive clipping."
            )
        return float(self.unclipped) / self.planned + 0.5

    def _release(self) -> dict[str, Tensor]:
        if self.planned < self.weight:
            raise RuntimeError(
                f"{self.weight:g} updates reached a round planned for {self.planned} clients: expect() the "
                "planned cohort when the round opens."
            )
        std = self.update_noise_multiplier() * self.clip
        generator = noise_generator(self.seed, self.round_index, self.unclipped.device)
        if std > 0:
            for total in self.sums:
                noise = torch.randn(
                    total.shape, generator=generator, dtype=torch.float64, device=total.device
                )
                total.add_(noise, alpha=std)
        if self.adaptive is not None:
            count_std = self.adaptive.count_std(self.planned)
            noise = torch.randn((), generator=generator, dtype=torch.float64, device=self.unclipped.device)
            self.unclipped = self.unclipped + count_std * noise
        out = {n: t.detach().clone() for n, t in self._start.items() if n not in self.private_names}
        for name, total in zip(self.private_names, self.sums):
            start = self._start[name]
            out[name] = (start.to(torch.float64) + total / self.planned).to(start.dtype)
        return {n: out[n] for n in self.names}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "unclipped": self.unclipped, "planned": self.planned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.unclipped = state["unclipped"].to(self.unclipped.device, torch.float64)
        self.planned = int(state["planned"])
