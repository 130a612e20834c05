"""Privacy accounting: the ε that a composition of sampled Gaussian mechanism steps spends, computed by an
established library (never by a formula written here), and the noise multiplier that meets a target ε.

A *step* is one release of a Gaussian mechanism on a sampled subset: a server round under client-level DP (the
clients of the round's cohort), or one local step of DP-SGD under sample-level DP (the examples of the
batch). Its noise multiplier σ is the noise std divided by the clip norm C that bounds each unit's
contribution (each client's update, each example's gradient). The accountant records the steps as they run
(:meth:`PrivacyAccountant.step`), reports ε for a δ (:meth:`PrivacyAccountant.epsilon`), solves for σ before a
run (:meth:`PrivacyAccountant.noise_multiplier_for`) and travels in a checkpoint
(:meth:`PrivacyAccountant.state_dict`). Which library computes what:

=========  ===============================================  ==============================================
accountant sampling ``"poisson"`` (add/remove one unit)      sampling ``"without_replacement"`` (replace one)
=========  ===============================================  ==============================================
``"rdp"``  Opacus's RDP analysis (``RDPAccountant``)         dp-accounting's ``RdpAccountant`` with
                                                             ``SampledWithoutReplacementDpEvent``
``"pld"``  dp-accounting's ``PLDAccountant``                 refused: dp-accounting's PLD accountant does not
                                                             model it
=========  ===============================================  ==============================================

No Lightning here. Opacus and dp-accounting are the ``privacy`` extra, imported when an accountant is built.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Literal, get_args

import numpy as np

from lightning_fedrep.federation.api.arguments import check_choice, check_int, check_real

AccountantKind = Literal["rdp", "pld"]
Sampling = Literal["poisson", "without_replacement"]
ACCOUNTANTS: tuple[str, ...] = get_args(AccountantKind)
"""The accountant kinds :class:`PrivacyAccountant` takes: ``"rdp"`` (Rényi DP) and ``"pld"`` (privacy loss
distributions, tighter)."""
SAMPLINGS: tuple[str, ...] = get_args(Sampling)
"""How the units of a step are drawn: ``"poisson"`` (each independently with probability ``sample_rate``) or
``"without_replacement"`` (a fixed-size subset, ``sample_rate * population`` units, uniformly at random)."""

INSTALL_HINT = 'pip install "lightning-fedrep[privacy]"'
MAX_NOISE_MULTIPLIER = 2.0**20
"""The largest σ :meth:`PrivacyAccountant.noise_multiplier_for` tries (about 1e6) before calling a target
unreachable."""
MIN_NOISE_MULTIPLIER = 2.0**-6
"""The smallest σ :meth:`PrivacyAccountant.noise_multiplier_for` returns: a target that less noise meets is met
by this one too (and the libraries are slow to account a very small σ)."""
SOLVER_TOLERANCE = 1e-5
"""How close to the smallest σ that meets a target :meth:`PrivacyAccountant.noise_multiplier_for` lands
(relative; the σ it returns always meets the target)."""
STATE_VERSION = 1
PLD_HINT = ", or use accountant='pld' (tighter: RDP's conversion has a floor set by its largest order)"

Entry = tuple[float, float, int]
"""One run of identical steps in the history: ``(noise_multiplier, sample_rate, steps)``."""


def _library(module: str) -> ModuleType:
    """``module`` imported, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"Privacy accounting needs {module.split('.')[0]!r}, which is not installed. Install the "
            f"privacy extra: {INSTALL_HINT}"
        ) from error


class PrivacyAccountant:
    """The ε spent by a sequence of sampled Gaussian mechanism steps, accounted by Opacus or dp-accounting.

    Build one per privacy unit's guarantee (one for the server under client-level DP; one per client under
    sample-level DP), call :meth:`step` after each release, and read :meth:`epsilon`. Steps with different
    noise multipliers or sample rates compose (adaptive clipping changes σ from round to round).

    Sampling decides the neighbouring relation, as the libraries model it:

    - ``"poisson"``: each unit joins a step independently with probability ``sample_rate``; datasets are
      neighbours when one unit is added or removed, so a sum of updates clipped to C has sensitivity C.
      ``sample_rate=1`` is a step on every unit (no amplification), e.g. every client in every round.
    - ``"without_replacement"``: a step draws exactly ``sample_rate * population`` units of ``population``;
      datasets are neighbours when one unit is replaced by another (the population size is public), so the
      sum's sensitivity is 2C and the library is handed ``noise_multiplier / 2`` (Wang, Balle and
      Kasiviswanathan 2019, Theorem 27, state their bound for sensitivity 1). This is how this project's
      cohorts are drawn (a fixed count of distinct clients per round).

    A shuffle-and-partition schedule (each unit exactly once per epoch, as CENTAUR's code does) is neither:
    account it with ``sample_rate=1`` (no amplification).

    Args:
        accountant: ``"rdp"`` (Rényi DP: Opacus's analysis under Poisson sampling, orders 1.1 to 63 and the
            conversion of Balle et al. 2020, the numbers Opacus's ``PrivacyEngine`` reports; dp-accounting's
            ``RdpAccountant`` without replacement) or ``"pld"`` (dp-accounting's privacy loss distributions:
            tighter, Poisson sampling only).
        sampling: ``"poisson"`` or ``"without_replacement"`` (see above).
        population: how many units the steps sample from (clients, or a client's examples): required with
            ``sampling="without_replacement"``, where ``sample_rate * population`` must be a whole number;
            refused with ``"poisson"``, which does not use it.

    Raises:
        ImportError: the library the accountant needs is missing (install ``lightning-fedrep[privacy]``).

    Example::

        accountant = PrivacyAccountant("rdp")
        sigma = accountant.noise_multiplier_for(target_epsilon=8.0, delta=1e-5, sample_rate=0.04, steps=2250)
        for _ in range(2250):
            accountant.step(noise_multiplier=sigma, sample_rate=0.04)
        accountant.epsilon(delta=1e-5)  # at most 8.0
    """

    def __init__(
        self,
        accountant: AccountantKind = "rdp",
        sampling: Sampling = "poisson",
        population: int | None = None,
    ) -> None:
        owner = "PrivacyAccountant"
        self.accountant: str = check_choice("accountant", accountant, ACCOUNTANTS, owner)
        self.sampling: str = check_choice("sampling", sampling, SAMPLINGS, owner)
        if sampling == "without_replacement":
            if population is None:
                raise ValueError(
                    "PrivacyAccountant(population=...) is required with sampling='without_replacement': the "
                    "number of units each step draws from (the clients of the federation, or a client's "
                    "examples)."
                )
            population = check_int("population", population, 1, owner=owner)
        elif population is not None:
            raise ValueError(
                f"PrivacyAccountant(population={population!r}) has no effect with sampling='poisson', which "
                "needs only each step's sample_rate: drop it, or use sampling='without_replacement'."
            )
        if accountant == "pld" and sampling == "without_replacement":
            raise ValueError(
                "PrivacyAccountant(accountant='pld') does not model sampling='without_replacement' "
                "(dp-accounting's PLD accountant has no event for it): use accountant='rdp', or "
                "sampling='poisson' if the units are drawn that way."
            )
        self.population: int | None = population
        self._history: list[Entry] = []
        self._accounting_library()  # a missing library is an ImportError now, not in the middle of a run

    # ------------------------------------------------------------------------------------------ recording

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` releases of the Gaussian mechanism, each on units sampled at ``sample_rate``, with
        noise std ``noise_multiplier`` times the clip norm. Called after each release (a round's noised
        aggregate, a DP-SGD step), or once for many identical ones.

        Args:
            noise_multiplier: σ, the noise std over the clip norm C (> 0).
            sample_rate: the probability that a unit takes part (Poisson), or the fraction of the population
                drawn (without replacement), in (0, 1].
            steps: how many identical releases to record (>= 1).
        """
        entry = self._entry(noise_multiplier, sample_rate, steps, "step")
        if self._history and self._history[-1][:2] == entry[:2]:
            last = self._history[-1]
            self._history[-1] = (last[0], last[1], last[2] + entry[2])
        else:
            self._history.append(entry)

    @property
    def history(self) -> tuple[Entry, ...]:
        """The recorded steps as runs of identical ones: ``(noise_multiplier, sample_rate, steps)``."""
        return tuple(self._history)

    @property
    def steps(self) -> int:
        """How many steps have been recorded."""
        return sum(entry[2] for entry in self._history)

    # ------------------------------------------------------------------------------------------ reporting

    def epsilon(self, delta: float) -> float:
        """The ε of (ε, δ)-DP that the recorded steps spend together (0 before any step).

        Args:
            delta: δ, in (0, 1); usually well below 1 / (the number of units).
        """
        delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True, owner="epsilon")
        return self._epsilon_of(self._history, delta) if self._history else 0.0

    def noise_multiplier_for(
        self, target_epsilon: float, delta: float, sample_rate: float, steps: int
    ) -> float:
        """The smallest noise multiplier σ (to a relative 1e-5, and at least 1/64) at which ``steps`` releases
        at ``sample_rate`` spend at most ``target_epsilon`` at ``delta``, by this accountant's kind and
        sampling. Run before training; the recorded history is not used or changed.

        Args:
            target_epsilon: the budget ε (> 0).
            delta: δ, in (0, 1).
            sample_rate: as in :meth:`step`, in (0, 1].
            steps: how many releases the run will make (>= 1): server rounds for client-level DP, local
                steps for sample-level DP (not epochs).

        Raises:
            ValueError: the target cannot be reached: even σ = 2^20 (about 1e6) spends more (the message names
                the smallest reachable ε; raise ``target_epsilon`` or ``delta``, or use ``accountant="pld"``).
        """
        owner = "noise_multiplier_for"
        target = check_real("target_epsilon", target_epsilon, 0.0, low_open=True, owner=owner)
        delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True, owner=owner)
        _, sample_rate, steps = self._entry(1.0, sample_rate, steps, owner)

        def spent(sigma: float) -> float:
            with warnings.catch_warnings():  # Opacus warns when the best order is its largest (large σ)
                warnings.simplefilter("ignore")
                return self._epsilon_of([(sigma, sample_rate, steps)], delta)

        low, high = self._bracket(spent, target, delta, sample_rate, steps)
        if low is None:
            return high
        brentq = _library("scipy.optimize").brentq
        sigma = brentq(lambda s: spent(s) - target, low, high, rtol=SOLVER_TOLERANCE) * (
            1.0 + SOLVER_TOLERANCE
        )
        for _ in range(100):  # the root is met to a tolerance, the budget exactly
            if sigma >= high or spent(sigma) <= target:
                return min(sigma, high)
            sigma *= 1.0 + SOLVER_TOLERANCE
        return high

    def _bracket(
        self, spent: Callable[[float], float], target: float, delta: float, sample_rate: float, steps: int
    ) -> tuple[float | None, float]:
        """σ values around the solution, ``(low, high)`` with ``spent(low) > target >= spent(high)``, found by
        doubling or halving from 1 (a small σ is costly to account); ``low`` is ``None`` when even
        :data:`MIN_NOISE_MULTIPLIER` meets the target."""
        high = 1.0
        if spent(high) <= target:
            low = high / 2.0
            while spent(low) <= target:
                if low <= MIN_NOISE_MULTIPLIER:
                    return None, low
                low, high = low / 2.0, low
            return low, high
        while True:
            low, high = high, 2.0 * high
            if spent(high) <= target:
                return low, high
            if high >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"noise_multiplier_for(target_epsilon={target:g}) cannot be reached with "
                    f"accountant={self.accountant!r}, sampling={self.sampling!r}, delta={delta:g}, "
                    f"sample_rate={sample_rate:g} and steps={steps}: even noise_multiplier={high:g} spends "
                    f"epsilon={spent(high):.4g}, about the smallest this accountant reaches. Raise "
                    f"target_epsilon or delta, or make fewer steps{PLD_HINT if self.accountant == 'rdp' else ''}."
                )

    # ------------------------------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores (plain numbers and strings, loadable with ``torch.load(weights_only=True)``):
        the configuration and the recorded history, so that a resumed run reports the uninterrupted run's ε."""
        return {
            "version": STATE_VERSION,
            "accountant": self.accountant,
            "sampling": self.sampling,
            "population": self.population,
            "history": [list(entry) for entry in self._history],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the history of :meth:`state_dict`, replacing this accountant's own. The configuration must
        match (an ε accounted one way is not continued another way).

        Args:
            state_dict: what :meth:`state_dict` returned.
        """
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: state version {state_dict.get('version')!r} is not "
                f"{STATE_VERSION}; it was not written by this PrivacyAccountant.state_dict."
            )
        for key in ("accountant", "sampling", "population"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(
                    f"PrivacyAccountant.load_state_dict: the stored {key}={state_dict.get(key)!r} differs from "
                    f"this accountant's {key}={getattr(self, key)!r}; build the accountant with "
                    f"{key}={state_dict.get(key)!r} to continue the stored run."
                )
        self._history = [self._entry(*entry, "load_state_dict") for entry in state_dict["history"]]

    def __repr__(self) -> str:
        population = "" if self.population is None else f", population={self.population}"
        return (
            f"PrivacyAccountant(accountant={self.accountant!r}, sampling={self.sampling!r}{population}; "
            f"{self.steps} steps)"
        )

    # ------------------------------------------------------------------------------------------ internals

    def _entry(self, noise_multiplier: Any, sample_rate: Any, steps: Any, owner: str) -> Entry:
        """One run of steps, checked (``owner`` names the method the arguments were given to)."""
        sigma = check_real("noise_multiplier", noise_multiplier, 0.0, low_open=True, owner=owner)
        rate = check_real("sample_rate", sample_rate, 0.0, 1.0, low_open=True, owner=owner)
        count = check_int("steps", steps, 1, owner=owner)
        if self.population is not None:
            size = round(rate * self.population)
            if size < 1 or not math.isclose(size, rate * self.population, rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(
                    f"{owner}(sample_rate={rate!r}) draws {rate * self.population:g} of population="
                    f"{self.population} units: with sampling='without_replacement' it must be a whole "
                    f"number >= 1; pass sample_rate=<units drawn> / {self.population}."
                )
        return (sigma, rate, count)

    def _accounting_library(self) -> ModuleType:
        """The library that accounts for this kind and sampling (Opacus's RDP analysis, or dp-accounting)."""
        if self.accountant == "rdp" and self.sampling == "poisson":
            return _library("opacus.accountants.rdp")
        return _library("dp_accounting")  # imports its pld and rdp modules

    def _epsilon_of(self, history: list[Entry], delta: float) -> float:
        """ε of ``history`` at ``delta``, by this accountant's library."""
        library = self._accounting_library()
        if library.__name__ == "dp_accounting":
            return _dp_accounting(self, library, history, delta)
        return _opacus_rdp(library, history, delta)


def _opacus_rdp(rdp: ModuleType, history: list[Entry], delta: float) -> float:
    """ε of Opacus's ``RDPAccountant`` over ``history`` (its history holds the same triples)."""
    accountant = rdp.RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta))


def _dp_accounting(
    owner: PrivacyAccountant, dp_accounting: ModuleType, history: list[Entry], delta: float
) -> float:
    """ε of dp-accounting's accountant over ``history``, each run of steps as a self-composed event."""
    events = [
        dp_accounting.SelfComposedDpEvent(_event(owner, dp_accounting, sigma, rate), count)
        for sigma, rate, count in history
    ]
    if owner.accountant == "pld":
        accountant = dp_accounting.pld.PLDAccountant()
        accountant.compose(dp_accounting.ComposedDpEvent(events))
        return float(accountant.get_epsilon(delta))
    # rdp without replacement (replace-one neighbours, the relation the library models it under): RDP adds up
    # over composed steps, so each distinct step's curve is computed once (about 0.1 s each) and summed
    curves = [(_rdp_curve(dp_accounting, event.event), event.count) for event in events]
    orders = curves[0][0][0]
    total = sum(count * np.asarray(rdp, dtype=np.float64) for (_, rdp), count in curves)
    epsilon, _ = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(orders, total, delta)
    return float(epsilon)


@functools.lru_cache(maxsize=64)
def _rdp_curve(dp_accounting: ModuleType, event: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The orders and RDP values of one step ``event`` under the replace-one relation, as dp-accounting's
    ``RdpAccountant`` computes them (its ``get_epsilon`` reads the same two arrays); cached, since every
    round's ε composes the same step again."""
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event)
    return tuple(accountant._orders.tolist()), tuple(accountant._rdp.tolist())


def _event(owner: PrivacyAccountant, dp_accounting: ModuleType, sigma: float, rate: float) -> Any:
    """One step as a dp-accounting event."""
    if owner.sampling == "poisson":
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        return gaussian if rate == 1.0 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)
    assert owner.population is not None
    # replace-one: the sum of updates clipped to C moves by up to 2C, and the library's σ is over sensitivity
    gaussian = dp_accounting.GaussianDpEvent(sigma / 2.0)
    size = round(rate * owner.population)
    return dp_accounting.SampledWithoutReplacementDpEvent(owner.population, size, gaussian)
