"""The settings every Gaussian mechanism here takes (``ClientLevelDP``, ``SampleLevelDP``), checked in one place at
construction: the clip, the noise given directly or as a target ε, δ, the rounds the budget covers and the
accountant. No Lightning here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_fedrep.federation.api.arguments import check_choice, check_optional_int, check_real


@dataclass(frozen=True)
class NoiseSettings:
    """A Gaussian mechanism's settings, checked (see :func:`noise_settings`)."""

    clip: float
    noise_multiplier: float | None
    target_epsilon: float | None
    delta: float
    rounds: int | None
    accountant: str | None


def noise_settings(
    owner: str,
    spends: str,
    accountants: Sequence[str],
    *,
    clip: float,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float,
    rounds: int | None,
    accountant: str | None,
) -> NoiseSettings:
    """``owner``'s settings checked, or a ``ValueError`` naming the argument and the fix: ``clip`` > 0, exactly one
    of ``noise_multiplier`` (>= 0) and ``target_epsilon`` (> 0; ``spends`` says what it bounds), ``delta`` in (0, 1),
    ``rounds`` >= 1 or ``None``, ``accountant`` one of ``accountants`` or ``None``; a target ε needs ``rounds`` and
    an accountant, and an accounted run needs noise."""
    clip = check_real("clip", clip, 0.0, low_open=True, owner=owner)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            f"{owner} takes exactly one of noise_multiplier= (the noise std in units of clip) and "
            f"target_epsilon= ({spends}), got noise_multiplier={noise_multiplier!r} and "
            f"target_epsilon={target_epsilon!r}."
        )
    if noise_multiplier is not None:
        noise_multiplier = check_real("noise_multiplier", noise_multiplier, 0.0, owner=owner)
    if target_epsilon is not None:
        target_epsilon = check_real("target_epsilon", target_epsilon, 0.0, low_open=True, owner=owner)
    delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True, owner=owner)
    rounds = check_optional_int("rounds", rounds, 1, owner=owner)
    if accountant is not None:
        accountant = check_choice("accountant", accountant, tuple(accountants), owner)
    if target_epsilon is not None and (rounds is None or accountant is None):
        choices = " or ".join(repr(a) for a in accountants)
        raise ValueError(
            f"{owner}(target_epsilon=...) solves the noise for a number of rounds with an accountant: pass "
            f"rounds= (the Trainer's max_epochs) and accountant={choices}, got rounds={rounds!r}, "
            f"accountant={accountant!r}."
        )
    if noise_multiplier == 0 and accountant is not None:
        raise ValueError(
            f"{owner}(noise_multiplier=0) adds no noise: its epsilon is infinite. Pass a noise_multiplier > 0, or "
            "accountant=None to clip without accounting (no privacy)."
        )
    return NoiseSettings(clip, noise_multiplier, target_epsilon, delta, rounds, accountant)
