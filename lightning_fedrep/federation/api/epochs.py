"""The strategy's epoch shorthands (``head_epochs``, ``body_epochs``, ``local_epochs``): their defaults, an
algorithm's default phases from those it declares (:attr:`~.algorithm.Algorithm.epochs`), the check that refuses
one that changes nothing, and :func:`epoch_settings`, which keeps only those an algorithm reads (for sweeps over
algorithms).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.registry import get_algorithm

EPOCH_DEFAULTS = {"head_epochs": 10, "body_epochs": 1, "local_epochs": 1}
"""The strategy's epoch shorthands and their defaults."""


def default_phases(algorithm: Algorithm, epochs: Mapping[str, int]) -> tuple[Phase, ...]:
    """``algorithm``'s default phases from the shorthands among ``epochs`` it declares in ``algorithm.epochs``
    (called by the strategy when no ``phases`` are given)."""
    return algorithm.default_phases(**{name: epochs[name] for name in algorithm.epochs})


def epoch_settings(algorithm: str | Algorithm, **epochs: int) -> dict[str, int]:
    """The epoch shorthands among ``epochs`` that ``algorithm`` reads, for a sweep over algorithms with one
    set of settings: ``FederatedStrategy(algorithm=a, **epoch_settings(a, head_epochs=2, local_epochs=2))``
    (the strategy refuses a shorthand that has no effect)."""
    unknown = set(epochs) - set(EPOCH_DEFAULTS)
    if unknown:
        raise TypeError(f"epoch_settings takes {sorted(EPOCH_DEFAULTS)}, got {sorted(unknown)}.")
    read = get_algorithm(algorithm).epochs
    return {name: value for name, value in epochs.items() if name in read}


def check_epoch_shorthands(
    algorithm: Algorithm,
    phases_given: bool,
    epochs: dict[str, int],
    defaults: dict[str, int],
    owner: str = "",
) -> None:
    """Refuse an epoch shorthand (``head_epochs``, ``body_epochs``, ``local_epochs``) set away from its
    default where it changes nothing: explicit ``phases`` are given, or ``algorithm``'s default phases do
    not read it (``algorithm.epochs`` does not name it: FedAvg has no head phase)."""
    changed = {name: value for name, value in epochs.items() if value != defaults[name]}
    if not changed:
        return
    read = algorithm.epochs
    for name, value in changed.items():
        given = f"{owner}({name}={value})" if owner else f"{name}={value}"
        if phases_given:
            raise ValueError(
                f"{given} has no effect: phases=... gives the local work. Drop {name}, or write it into the phases."
            )
        if name not in read:
            phases = ", ".join(_phase_text(p) for p in default_phases(algorithm, epochs))
            instead = " and ".join(read) if read else "no epoch setting (use phases=...)"
            hint = ", or use algorithm='fedrep' for a head phase" if name == "head_epochs" else ""
            raise ValueError(
                f"{given} has no effect with algorithm {algorithm.name!r}, whose local work is {phases}, set by "
                f"{instead}. Drop {name}{hint} (lightning_fedrep.federation.api.epochs.epoch_settings keeps only the "
                "shorthands an algorithm reads)."
            )


def _phase_text(phase: Phase) -> str:
    budget = f"{phase.epochs} epoch(s)" if phase.epochs is not None else f"{phase.steps} step(s)"
    return f"{phase.train} x {budget}"
