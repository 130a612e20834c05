"""The privacy accountant (``lightning_fedrep.privacy.PrivacyAccountant``) against known answers.

References: the libraries' own tests (Opacus ``tests/accountants_test.py``; dp-accounting
``pld/pld_privacy_accountant_test.py``), values derived from them in ``../shared/reference/privacy.md`` section 7,
and closed forms written here: the Gaussian mechanism's RDP α/(2σ²) per step with Balle et al.'s (2020)
conversion, and the analytic Gaussian's δ(ε) (Balle and Wang 2018). Tests that need the ``privacy`` extra skip
where it is missing.
"""

from __future__ import annotations

import math
import pickle
import re
import sys

import pytest
import torch

from lightning_fedrep.privacy import PrivacyAccountant
from lightning_fedrep.privacy.accounting import INSTALL_HINT


@pytest.fixture
def extra() -> None:
    """Skip a test that accounts where the ``privacy`` extra (Opacus, dp-accounting) is not installed."""
    pytest.importorskip("opacus")
    pytest.importorskip("dp_accounting")


def recorded(accountant: PrivacyAccountant, *entries: tuple[float, float, int]) -> PrivacyAccountant:
    for sigma, rate, steps in entries:
        accountant.step(noise_multiplier=sigma, sample_rate=rate, steps=steps)
    return accountant


def gaussian_rdp_epsilon(entries: list[tuple[float, int]], delta: float, orders: list[float]) -> float:
    """ε of full-participation Gaussian steps ``(sigma, steps)``: RDP Σ T·α/(2σ²), converted by Balle et al.
    2020, Theorem 21 (the conversion Opacus uses), minimised over ``orders``."""
    per_order = sum(steps / (2 * sigma**2) for sigma, steps in entries)
    return min(a * per_order + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1) for a in orders)


def analytic_gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with sensitivity over std ``mu`` (Balle and Wang 2018, Theorem 8)."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    return phi(-epsilon / mu + mu / 2) - math.exp(epsilon) * phi(-epsilon / mu - mu / 2)


# ------------------------------------------------------------------------------------------ known answers


def test_rdp_equals_opacus_known_answer(extra):
    """Opacus ``accountants_test.py:94-104``: RDP, q 0.04, σ 1.5, 2,250 steps, δ 1e-5 → ε 7.32911117143.
    Catches another RDP analysis behind ``"rdp"`` (dp-accounting's gives 7.32933) or a lost step."""
    accountant = recorded(PrivacyAccountant("rdp"), (1.5, 0.04, 2250))
    assert accountant.epsilon(1e-5) == pytest.approx(7.32911117143, abs=1e-10)


def test_steps_one_by_one_equal_steps_at_once(extra):
    """2,250 calls of ``step()`` are the same history as one call with ``steps=2250``."""
    one_by_one = PrivacyAccountant("rdp")
    for _ in range(2250):
        one_by_one.step(noise_multiplier=1.5, sample_rate=0.04)
    assert one_by_one.history == ((1.5, 0.04, 2250),)
    assert one_by_one.epsilon(1e-5) == pytest.approx(7.32911117143, abs=1e-10)


def test_full_participation_rdp_is_the_gaussian_closed_form(extra):
    """With every unit in every step (q 1), heterogeneous steps (σ 2 ×10, then σ 4 ×30, as adaptive clipping
    would make) compose to Σ T·α/(2σ²), converted at Opacus's orders. Catches a history that drops or merges
    different noise multipliers, or sampling applied at q 1."""
    from opacus.accountants import RDPAccountant

    accountant = recorded(PrivacyAccountant("rdp"), (2.0, 1.0, 10), (4.0, 1.0, 30))
    expected = gaussian_rdp_epsilon([(2.0, 10), (4.0, 30)], 1e-5, RDPAccountant.DEFAULT_ALPHAS)
    assert accountant.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("sigma", "rate", "steps", "delta_at_one"),
    [
        (math.sqrt(3), 1.0, 3, 0.126936),  # pld_privacy_accountant_test.py:253-274 (Gaussian, composed 3x)
        (0.5, 0.2, 3, 0.15594),  # :276-288 (Poisson sampled Gaussian, composed 3x)
    ],
)
def test_pld_equals_dp_accounting_known_answers(extra, sigma, rate, steps, delta_at_one):
    """dp-accounting's PLD tests: δ(ε=1) = the listed value ± 1e-3, i.e. ε(δ - 1e-3) ≥ 1 ≥ ε(δ + 1e-3)."""
    accountant = recorded(PrivacyAccountant("pld"), (sigma, rate, steps))
    assert accountant.epsilon(delta_at_one - 1e-3) >= 1.0 >= accountant.epsilon(delta_at_one + 1e-3)


@pytest.mark.parametrize(("sigma", "delta"), [(0.5, 0.1), (1.0, 0.01), (3.0, 0.001), (2.0, 1e-5)])
def test_pld_without_sampling_is_the_analytic_gaussian(extra, sigma, delta):
    """PLD at q 1 is tight: the analytic Gaussian's δ at the reported ε is the asked δ (PLD rounds ε up, so
    δ comes out at most the asked one, within 1%). Composing 3 steps of σ√3 is one step of σ."""
    for steps, noise in ((1, sigma), (3, sigma * math.sqrt(3))):
        epsilon = recorded(PrivacyAccountant("pld"), (noise, 1.0, steps)).epsilon(delta)
        achieved = analytic_gaussian_delta(epsilon, 1.0 / sigma)
        assert 0.99 * delta <= achieved <= delta * (1 + 1e-9), (steps, epsilon, achieved)


def test_without_replacement_is_replace_one_with_twice_the_sensitivity(extra):
    """A fixed-size draw of the whole population (m = N) is the Gaussian mechanism under replace-one
    adjacency: the sum of C-clipped updates moves by up to 2C, so ε(σ) is add/remove's ε(σ/2) (dp-accounting's
    own RDP accountant as the reference). Catches σ handed to the library without the factor 2 (ε far too
    small). Drawing fewer than all (m < N) amplifies: ε falls."""
    import dp_accounting

    whole = recorded(PrivacyAccountant("rdp", "without_replacement", population=10), (3.0, 1.0, 100))
    reference = dp_accounting.rdp.RdpAccountant()
    reference.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 100))
    assert whole.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    part = recorded(PrivacyAccountant("rdp", "without_replacement", population=10), (3.0, 0.2, 100))
    assert part.epsilon(1e-5) < 0.6 * whole.epsilon(1e-5)


# ------------------------------------------------------------------------------------------ solving for σ


def test_noise_multiplier_for_matches_opacus_get_noise_multiplier(extra):
    """Opacus ``accountants_test.py:132-234``: ``get_noise_multiplier(ε 8, δ 1e-5, q 0.04, steps 2000)`` =
    1.3562 with RDP, found by a bisection that stops within 0.01 of ε (so from above): ours is at most that
    and within 0.5%, and spends 8 to 1e-3."""
    accountant = PrivacyAccountant("rdp")
    sigma = accountant.noise_multiplier_for(target_epsilon=8.0, delta=1e-5, sample_rate=0.04, steps=2000)
    assert 1.3562 * 0.995 <= sigma <= 1.3562
    assert accountant.history == ()  # solving records nothing
    spent = recorded(accountant, (sigma, 0.04, 2000)).epsilon(1e-5)
    assert 8.0 - 1e-3 <= spent <= 8.0


@pytest.mark.parametrize(("rounds", "opacus_sigma"), [(200, 57.5), (40, 25.625), (400, 81.25)])
def test_noise_multiplier_for_centaur_settings(extra, rounds, opacus_sigma):
    """The σ CENTAUR's settings imply (ε 1, δ 1e-5, every client every round; privacy.md section 2, found with
    Opacus's coarse bisection): ours is at most that and within 1%."""
    sigma = PrivacyAccountant("rdp").noise_multiplier_for(1.0, 1e-5, sample_rate=1.0, steps=rounds)
    assert opacus_sigma * 0.99 <= sigma <= opacus_sigma


@pytest.mark.parametrize(
    ("kind", "sampling", "population", "rate", "steps", "target"),
    [
        ("rdp", "poisson", None, 0.01, 500, 1.0),
        ("pld", "poisson", None, 0.2, 20, 2.0),
        ("rdp", "without_replacement", 50, 0.1, 100, 4.0),
    ],
)
def test_solved_noise_multiplier_spends_the_target(extra, kind, sampling, population, rate, steps, target):
    """σ solved for a target ε, then ε recomputed: at most the target and within 0.1% of it (so σ is not far
    larger than needed)."""
    accountant = PrivacyAccountant(kind, sampling, population)
    sigma = accountant.noise_multiplier_for(target, 1e-5, sample_rate=rate, steps=steps)
    spent = recorded(accountant, (sigma, rate, steps)).epsilon(1e-5)
    assert target * (1 - 1e-3) <= spent <= target


def test_unreachable_target_is_refused_naming_what_is_reachable(extra):
    """Opacus's orders stop at 63, so RDP cannot certify ε below about 0.103 at δ 1e-5 however large σ is:
    the refusal names the argument and the smallest reachable ε. PLD reaches it."""
    with pytest.raises(ValueError, match=r"target_epsilon=0\.05\) cannot be reached.*epsilon=0\.10"):
        PrivacyAccountant("rdp").noise_multiplier_for(0.05, 1e-5, sample_rate=0.04, steps=2250)
    sigma = PrivacyAccountant("pld").noise_multiplier_for(0.05, 1e-5, sample_rate=1.0, steps=1)
    assert sigma > 50


def test_a_huge_target_gets_the_smallest_noise_multiplier(extra):
    """A target that any σ meets gets the solver's floor, 1/64, not a search towards 0."""
    assert PrivacyAccountant("rdp").noise_multiplier_for(1e6, 1e-5, sample_rate=0.01, steps=1) == 2.0**-6


# ------------------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_epsilon_is_monotone(extra, kind):
    """ε falls as σ rises, and rises with q and with the number of steps; no steps spend nothing."""

    def eps(sigma: float, rate: float, steps: int) -> float:
        return recorded(PrivacyAccountant(kind), (sigma, rate, steps)).epsilon(1e-5)

    assert PrivacyAccountant(kind).epsilon(1e-5) == 0.0
    assert eps(1.0, 0.1, 50) > eps(1.5, 0.1, 50) > eps(3.0, 0.1, 50)
    assert eps(1.5, 0.05, 50) < eps(1.5, 0.1, 50) < eps(1.5, 0.5, 50)
    assert eps(1.5, 0.1, 10) < eps(1.5, 0.1, 50) < eps(1.5, 0.1, 200)
    assert recorded(PrivacyAccountant(kind), (1.5, 0.1, 50)).epsilon(1e-3) < eps(1.5, 0.1, 50)


@pytest.mark.parametrize(
    ("kind", "sampling", "population"),
    [("rdp", "poisson", None), ("pld", "poisson", None), ("rdp", "without_replacement", 40)],
)
def test_resumed_accountant_reports_the_uninterrupted_epsilon(extra, tmp_path, kind, sampling, population):
    """A run of 12 steps whose σ changes every 4 steps (as adaptive clipping makes it change) against the same
    run saved after 5 steps (inside a run of equal steps) through ``torch.save``/``torch.load(weights_only=
    True)``, loaded into a fresh accountant, and continued: the same history and the same ε, bit for bit."""
    steps = [(1.0 + 0.25 * (i // 4), 0.1, 1) for i in range(12)]
    uninterrupted = recorded(PrivacyAccountant(kind, sampling, population), *steps)
    first = recorded(PrivacyAccountant(kind, sampling, population), *steps[:5])
    torch.save({"privacy": first.state_dict()}, tmp_path / "ckpt.pt")
    resumed = PrivacyAccountant(kind, sampling, population)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["privacy"])
    assert resumed.history == first.history and resumed.steps == 5
    recorded(resumed, *steps[5:])
    assert resumed.history == uninterrupted.history == ((1.0, 0.1, 4), (1.25, 0.1, 4), (1.5, 0.1, 4))
    assert resumed.epsilon(1e-5) == uninterrupted.epsilon(1e-5)
    copied = pickle.loads(pickle.dumps(resumed))  # a strategy holding one can be pickled (spawned processes)
    assert copied.history == resumed.history and copied.epsilon(1e-5) == resumed.epsilon(1e-5)


def test_state_of_another_configuration_is_refused(extra):
    """An ε accounted one way is not continued another way: the refusal names the differing key."""
    state = recorded(PrivacyAccountant("rdp"), (1.0, 0.1, 5)).state_dict()
    with pytest.raises(ValueError, match=r"stored accountant='rdp' differs.*accountant='pld'"):
        PrivacyAccountant("pld").load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"stored sampling='poisson' differs.*sampling='without_replacement'"
    ):
        PrivacyAccountant("rdp", "without_replacement", population=10).load_state_dict(state)
    fixed = PrivacyAccountant("rdp", "without_replacement", population=10).state_dict()
    with pytest.raises(ValueError, match=r"stored population=10 differs.*population=20"):
        PrivacyAccountant("rdp", "without_replacement", population=20).load_state_dict(fixed)
    with pytest.raises(ValueError, match="state version"):
        PrivacyAccountant("rdp").load_state_dict({**state, "version": 99})


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"accountant": "gdp"}, ValueError, r"accountant=\.\.\.\) must be one of 'rdp', 'pld'"),
        ({"sampling": "shuffle"}, ValueError, r"sampling=\.\.\.\) must be one of 'poisson'"),
        ({"sampling": "without_replacement"}, ValueError, r"population=\.\.\.\) is required"),
        ({"population": 100}, ValueError, r"population=100\) has no effect with sampling='poisson'"),
        (
            {"sampling": "without_replacement", "population": 0},
            ValueError,
            r"population=\.\.\.\) must be an integer >= 1",
        ),
        (
            {"sampling": "without_replacement", "population": 10.0},
            TypeError,
            r"population=\.\.\.\) must be an integer",
        ),
        (
            {"accountant": "pld", "sampling": "without_replacement", "population": 10},
            ValueError,
            r"accountant='pld'\) does not model sampling='without_replacement'.*use accountant='rdp'",
        ),
    ],
)
def test_bad_construction_is_refused(kwargs, error, words):
    """Checked before any library is imported, so these run without the extra too."""
    with pytest.raises(error, match=words):
        PrivacyAccountant(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"noise_multiplier": 0.0}, ValueError, r"step\(noise_multiplier=\.\.\.\) must be a number > 0"),
        (
            {"noise_multiplier": float("nan")},
            ValueError,
            r"noise_multiplier=\.\.\.\) must be a finite number",
        ),
        ({"noise_multiplier": "1"}, TypeError, r"noise_multiplier=\.\.\.\) must be a number"),
        ({"sample_rate": 0.0}, ValueError, r"sample_rate=\.\.\.\) must be a number in \(0, 1\]"),
        ({"sample_rate": 1.5}, ValueError, r"sample_rate=\.\.\.\) must be a number in \(0, 1\]"),
        ({"steps": 0}, ValueError, r"steps=\.\.\.\) must be an integer >= 1"),
        ({"steps": True}, TypeError, r"steps=\.\.\.\) must be an integer"),
    ],
)
def test_bad_step_is_refused(extra, kwargs, error, words):
    accountant = PrivacyAccountant()
    with pytest.raises(error, match=words):
        accountant.step(**{"noise_multiplier": 1.0, "sample_rate": 0.1, **kwargs})
    assert accountant.history == ()


def test_bad_solver_and_epsilon_arguments_are_refused(extra):
    accountant = PrivacyAccountant()
    with pytest.raises(ValueError, match=r"epsilon\(delta=\.\.\.\) must be a number in \(0, 1\)"):
        accountant.epsilon(delta=0.0)
    with pytest.raises(
        ValueError, match=r"noise_multiplier_for\(target_epsilon=\.\.\.\) must be a number > 0"
    ):
        accountant.noise_multiplier_for(0.0, 1e-5, 0.1, 10)
    with pytest.raises(ValueError, match=r"noise_multiplier_for\(delta=\.\.\.\)"):
        accountant.noise_multiplier_for(1.0, 1.0, 0.1, 10)
    with pytest.raises(ValueError, match=r"noise_multiplier_for\(steps=\.\.\.\) must be an integer >= 1"):
        accountant.noise_multiplier_for(1.0, 1e-5, 0.1, 0)


def test_sample_rate_must_draw_whole_units_without_replacement(extra):
    """Without replacement a step draws ``sample_rate * population`` units: 0.15 of 10 is refused, naming the
    fix; 0.3 of 10 (3 units, a float that is not exactly 3/10) is accepted."""
    accountant = PrivacyAccountant("rdp", "without_replacement", population=10)
    with pytest.raises(ValueError, match=r"step\(sample_rate=0\.15\) draws 1\.5 of population=10.*/ 10"):
        accountant.step(noise_multiplier=1.0, sample_rate=0.15)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1 * 3)
    assert accountant.steps == 1


@pytest.mark.parametrize(
    ("kind", "sampling", "population", "missing"),
    [
        ("rdp", "poisson", None, "opacus"),
        ("pld", "poisson", None, "dp_accounting"),
        ("rdp", "without_replacement", 5, "dp_accounting"),
    ],
)
def test_missing_library_names_the_extra(monkeypatch, kind, sampling, population, missing):
    """Without the library an accountant needs, building it raises an ImportError naming the library and
    ``pip install "lightning-fedrep[privacy]"`` (simulated by hiding the library's modules)."""
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")] + [missing]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=rf"needs '{missing}'.*{re.escape(INSTALL_HINT)}"):
        PrivacyAccountant(kind, sampling, population)


def test_without_replacement_epsilon_is_the_librarys_own_over_mixed_steps():
    """Catches the cached per-step RDP curves summed wrongly (a count dropped, a σ's curve reused for another):
    runs of two noise multipliers against dp-accounting's ``RdpAccountant`` composing the same events itself,
    asked twice (the second answer comes from the cache)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = PrivacyAccountant("rdp", "without_replacement", 100)
    accountant.step(noise_multiplier=1.0, sample_rate=0.04, steps=50)
    first = accountant.epsilon(1e-5)
    accountant.step(noise_multiplier=2.0, sample_rate=0.04, steps=7)
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    events = {
        sigma: dp_accounting.SampledWithoutReplacementDpEvent(
            100, 4, dp_accounting.GaussianDpEvent(sigma / 2)
        )
        for sigma in (1.0, 2.0)
    }
    alone = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    alone.compose(dp_accounting.SelfComposedDpEvent(events[1.0], 50))
    both = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    both.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(events[1.0], 50),
                dp_accounting.SelfComposedDpEvent(events[2.0], 7),
            ]
        )
    )
    assert first == pytest.approx(alone.get_epsilon(1e-5), rel=1e-12)
    assert accountant.epsilon(1e-5) == pytest.approx(both.get_epsilon(1e-5), rel=1e-12)
    assert accountant.epsilon(1e-5) == pytest.approx(both.get_epsilon(1e-5), rel=1e-12)
