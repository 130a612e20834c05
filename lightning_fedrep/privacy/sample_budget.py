"""Sample-level DP's privacy budget: one guarantee per client, the worst one reported.

Under sample-level DP each client's examples are the units, and a client's guarantee is spent by its own local
steps only: client ``c`` with ``n_c`` examples takes Poisson batches at rate ``q_c = min(1, B / n_c)`` (``B`` the
batch size), and after ``T_c`` steps at noise multiplier σ it has spent the ε of ``T_c`` sampled Gaussian
mechanism steps, by Opacus's RDP analysis (``compute_rdp`` for one step at ``q_c``, which RDP composition
multiplies by ``T_c``, and ``get_privacy_spent``: what Opacus's ``RDPAccountant`` computes for that history).
A round is counted for every client it plans (a client left out by a fault is still counted: conservative),
whether the client was sampled by the cohort or not is not used for amplification (conservative again).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_fedrep.privacy.accounting import PrivacyAccountant, _library


def sample_rate(client_size: int, batch_size: int) -> float:
    """A client's Poisson sampling rate: each example joins a step with probability ``min(1, B / n)``."""
    return 1.0 if client_size <= batch_size else batch_size / client_size


@functools.lru_cache(maxsize=4096)
def _step_rdp(noise_multiplier: float, rate: float) -> tuple[float, ...]:
    """Opacus's RDP of one sampled Gaussian step at Opacus's default orders (cached: every round reuses it)."""
    rdp = _library("opacus.accountants.analysis.rdp")
    orders = _library("opacus.accountants").RDPAccountant.DEFAULT_ALPHAS
    return tuple(
        np.atleast_1d(rdp.compute_rdp(q=rate, noise_multiplier=noise_multiplier, steps=1, orders=orders))
    )


def rdp_epsilon(noise_multiplier: float, rate: float, steps: int, delta: float) -> float:
    """The ε of ``steps`` sampled Gaussian steps at ``rate`` and ``noise_multiplier``, at ``delta`` (Opacus's RDP
    analysis; 0 for no step)."""
    if steps <= 0:
        return 0.0
    library = _library("opacus.accountants.analysis.rdp")
    orders = _library("opacus.accountants").RDPAccountant.DEFAULT_ALPHAS
    total = steps * np.asarray(_step_rdp(noise_multiplier, rate), dtype=np.float64)
    epsilon, _ = library.get_privacy_spent(orders=orders, rdp=total, delta=delta)
    return float(epsilon)


class SampleLevelBudget:
    """The ε each client has spent under sample-level DP, counted from the rounds' planned local steps.

    Args:
        delta: the δ every client's ε is reported at.
        target_epsilon: the budget no client may exceed (``None``: the noise multiplier is given, and only
            ``rounds`` bounds the run).
        rounds: the rounds the budget covers (with ``target_epsilon``: the rounds σ is solved for).
    """

    def __init__(self, delta: float, target_epsilon: float | None, rounds: int | None):
        _library("opacus.accountants.analysis.rdp")  # an ImportError naming the extra now
        self.delta, self.target_epsilon, self.rounds = delta, target_epsilon, rounds
        self.rates: tuple[float, ...] = ()
        """Each client's Poisson sampling rate (set by :meth:`bind`)."""
        self.steps: dict[int, int] = {}
        """The local steps each client has taken so far (accounted), by client."""
        self.rounds_done = 0

    def bind(self, client_sizes: Sequence[int], batch_size: int) -> None:
        """The clients' sampling rates from their sizes and the batch size."""
        self.rates = tuple(sample_rate(max(1, int(n)), batch_size) for n in client_sizes)

    def solve(self, steps_per_round: Mapping[int, int]) -> float:
        """The smallest σ (by :meth:`PrivacyAccountant.noise_multiplier_for`, Opacus's RDP) at which every
        client stays within ``target_epsilon`` after ``rounds`` rounds of ``steps_per_round[c]`` local steps
        each (every client in every round: conservative under partial participation)."""
        worst: dict[float, int] = {}
        for client, steps in steps_per_round.items():
            rate = self.rates[client]
            worst[rate] = max(worst.get(rate, 0), steps * int(self.rounds))
        accountant = PrivacyAccountant("rdp", "poisson")
        return max(
            accountant.noise_multiplier_for(self.target_epsilon, self.delta, rate, steps)
            for rate, steps in worst.items()
            if steps > 0
        )

    def refuse_beyond(self, noise_multiplier: float, planned: Mapping[int, int]) -> None:
        """Refuse a round (``planned``: its local steps by client) that the budget does not cover: one beyond
        ``rounds``, or one after which a client would exceed ``target_epsilon``."""
        if self.rounds is not None and self.rounds_done >= self.rounds:
            raise RuntimeError(
                f"The privacy budget covers {self.rounds} rounds (SampleLevelDP(rounds={self.rounds})), all "
                f"trained: a further round would spend more than planned. Set the Trainer's max_epochs="
                f"{self.rounds} (and count fine-tuning rounds), or plan more rounds (more noise for the same "
                "target_epsilon)."
            )
        if self.target_epsilon is None:
            return
        for client, steps in planned.items():
            total = self.steps.get(client, 0) + steps
            epsilon = rdp_epsilon(noise_multiplier, self.rates[client], total, self.delta)
            if epsilon > self.target_epsilon * (1 + 1e-9):
                raise RuntimeError(
                    f"Client {client} would spend epsilon={epsilon:.4g} > target_epsilon={self.target_epsilon:g} in "
                    f"this round ({total} local steps in all): the budget is spent. Stop training here (the "
                    "Trainer's max_epochs), or give SampleLevelDP more rounds= (more noise per step)."
                )

    def spend(self, noise_multiplier: float, planned: Mapping[int, int]) -> dict[int, float]:
        """Count a round's local steps (``planned``, by client); every client's ε so far, by client."""
        for client, steps in planned.items():
            self.steps[client] = self.steps.get(client, 0) + int(steps)
        self.rounds_done += 1
        return self.epsilons(noise_multiplier)

    def epsilons(self, noise_multiplier: float | None) -> dict[int, float]:
        """Every client's ε so far at ``delta`` (clients that never trained: none)."""
        if noise_multiplier is None:
            return {}
        return {
            client: rdp_epsilon(noise_multiplier, self.rates[client], steps, self.delta)
            for client, steps in sorted(self.steps.items())
        }

    def state_dict(self) -> dict[str, Any]:
        return {"steps": {int(c): int(s) for c, s in self.steps.items()}, "rounds_done": self.rounds_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = {int(c): int(s) for c, s in (state.get("steps") or {}).items()}
        self.rounds_done = int(state.get("rounds_done", 0))
