"""Client-level DP's privacy budget: which sampling a round's cohort is, the noise for a target ε, the ε spent.

:class:`ClientLevelBudget` keeps a :class:`~lightning_fedrep.privacy.accounting.PrivacyAccountant` over the server
rounds. This project draws a round's cohort as ``m`` distinct clients of ``N`` uniformly at random, so a round
is accounted as it is sampled: ``sampling="without_replacement"`` (replace-one neighbours, dp-accounting's RDP)
at rate ``m / N``; a round on every client (``m = N``) samples nothing and is the Gaussian mechanism itself,
accounted as ``sampling="poisson"`` at rate 1 (add/remove-one neighbours, as CENTAUR and Opacus count it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_fedrep.privacy.accounting import PrivacyAccountant


def cohort_sampling(num_clients: int, cohort: int) -> tuple[str, float]:
    """``(sampling, sample_rate)`` of a round drawing ``cohort`` distinct clients of ``num_clients``."""
    if cohort >= num_clients:
        return "poisson", 1.0
    return "without_replacement", cohort / num_clients


class ClientLevelBudget:
    """The ε a client-level DP run spends, round by round, by an established library.

    Args:
        accountant: ``"rdp"`` or ``"pld"`` (``PrivacyAccountant``'s kinds; PLD accounts only rounds on every
            client, since dp-accounting's PLD accountant has no fixed-size sampling).
        delta: the δ ε is reported at.
        target_epsilon: with ``rounds``, the budget the noise multiplier is solved for (``None``: given).
        rounds: the planned rounds; a round beyond them is refused (the budget covers no more).
    """

    def __init__(self, accountant: str, delta: float, target_epsilon: float | None, rounds: int | None):
        self.kind, self.delta = accountant, delta
        self.target_epsilon, self.rounds = target_epsilon, rounds
        self.accountant: PrivacyAccountant | None = None
        self.sample_rate: float | None = None

    def prepare(self, num_clients: int, cohort: int, noise_multiplier: float | None) -> float:
        """Before a round of ``cohort`` clients of ``num_clients``: build the accountant for that sampling (first
        round), refuse a sampling it was not built for or a round beyond ``rounds``, and return the noise
        multiplier (``noise_multiplier``, or the one solved for the target ε over the planned rounds)."""
        sampling, rate = cohort_sampling(num_clients, cohort)
        population = num_clients if sampling == "without_replacement" else None
        if self.accountant is None:
            if self.kind == "pld" and sampling == "without_replacement":
                raise ValueError(
                    f"ClientLevelDP(accountant='pld') cannot account rounds of {cohort} of {num_clients} clients "
                    "drawn without replacement (dp-accounting's PLD accountant has no event for it): use "
                    "accountant='rdp', or clients_per_round=1.0 (every client every round)."
                )
            self.accountant = PrivacyAccountant(self.kind, sampling, population)
        elif (self.accountant.sampling, self.accountant.population) != (sampling, population):
            raise ValueError(
                f"A round of {cohort} of {num_clients} clients is sampled {sampling!r}, but this run's accountant "
                f"counts rounds sampled {self.accountant.sampling!r} from {self.accountant.population} clients: "
                "client-level DP needs every round drawn the same way from the same federation."
            )
        if self.rounds is not None and self.accountant.steps >= self.rounds:
            raise RuntimeError(
                f"The privacy budget covers {self.rounds} rounds (ClientLevelDP(rounds={self.rounds})), all released: "
                f"a further round would spend more than planned. Set the Trainer's max_epochs={self.rounds}, or "
                "plan more rounds (which needs more noise for the same target_epsilon)."
            )
        self.sample_rate = rate
        if noise_multiplier is not None:
            return noise_multiplier
        return self.accountant.noise_multiplier_for(self.target_epsilon, self.delta, rate, self.rounds)

    def spend(self, noise_multiplier: float) -> float:
        """Count one released round with ``noise_multiplier``; the ε spent so far."""
        if self.accountant is None or self.sample_rate is None:
            raise RuntimeError("ClientLevelBudget.spend before prepare: the round's sampling is not known.")
        self.accountant.step(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)
        return self.accountant.epsilon(self.delta)

    def state_dict(self) -> dict[str, Any]:
        return {
            "accountant": None if self.accountant is None else self.accountant.state_dict(),
            "sample_rate": self.sample_rate,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("accountant")
        self.accountant = None
        if saved is not None:
            if saved["accountant"] != self.kind:
                raise ValueError(
                    f"The checkpoint's privacy budget was accounted with accountant={saved['accountant']!r}, this "
                    f"run's ClientLevelDP has accountant={self.kind!r}: use the same accountant to continue it."
                )
            self.accountant = PrivacyAccountant(saved["accountant"], saved["sampling"], saved["population"])
            self.accountant.load_state_dict(saved)
        self.sample_rate = state.get("sample_rate")
