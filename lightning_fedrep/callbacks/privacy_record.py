"""A run's privacy mechanism and the ε it spent, as its folder records them: ``summary.json``'s ``privacy``
section (written by :class:`~lightning_fedrep.callbacks.RunSummary`), the line the summary prints, the W&B
run summary's ``privacy/*`` entries, and the same read back from a run folder for ``lightning-fedrep report``
and ``lightning-fedrep table``.

Nothing here computes an ε: the mechanism describes its settings
(:meth:`~lightning_fedrep.federation.api.mechanism.PrivacyMechanism.describe`) and the ε is the last
``privacy/epsilon`` the run's history holds (the ε spent by every round released so far, at the mechanism's
δ). No Lightning here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_fedrep.callbacks.run_files import HISTORY, read_rows

EPSILON = "privacy/epsilon"
"""The history's column of the ε spent so far (a privacy mechanism with an accountant writes it every round)."""
NO_MECHANISM = "no privacy mechanism"
"""What the summary says of a run trained without ``privacy=``."""


def final_epsilon(rows: Sequence[Mapping[str, Any]]) -> tuple[float, int] | None:
    """The last ``privacy/epsilon`` of a history's ``rows`` and its round, ``None`` where no row has one."""
    spent = [row for row in rows if row.get(EPSILON) is not None]
    if not spent:
        return None
    return float(spent[-1][EPSILON]), int(spent[-1]["round"])


def privacy_section(
    description: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """``summary.json``'s ``privacy``: the mechanism as it describes itself (``description``, ``None``
    without one), the final ε (:func:`final_epsilon` of the history's ``rows``) with its round and the
    mechanism's δ, and a ``statement`` in words (:func:`statement`)."""
    if description is None:
        return {
            "mechanism": None,
            "epsilon": None,
            "delta": None,
            "epsilon_round": None,
            "statement": NO_MECHANISM,
        }
    epsilon, round_index = final_epsilon(rows) or (None, None)
    return {
        "mechanism": dict(description),
        "epsilon": epsilon,
        "delta": description.get("delta"),
        "epsilon_round": round_index,
        "statement": statement(description, epsilon, round_index),
    }


def statement(description: Mapping[str, Any], epsilon: float | None, round_index: int | None) -> str:
    """The mechanism and its guarantee in one line: ``ClientLevelDP (client-level, clip 1, noise multiplier 1,
    δ 1e-05, rdp accountant, 4 of 8 clients per round without replacement): ε 2.31 at δ 1e-05 after round 2``;
    ``... : not accounted (accountant=None), no ε`` without an accountant."""
    name = description.get("mechanism", "privacy mechanism")
    settings = ", ".join(settings_words(description))
    head = f"{name} ({settings})" if settings else str(name)
    if epsilon is not None:
        words = epsilon_words(epsilon, description.get("delta"), round_index)
        if description.get("unit") == "example":  # one guarantee per client: the history holds the worst
            worst = description.get("worst_client")
            words = f"the worst client's {words}" + ("" if worst is None else f" (client {worst})")
        return f"{head}: {words}"
    if "accountant" in description and description["accountant"] is None:
        return f"{head}: not accounted (accountant=None), no ε"
    if description.get("released") == 0:
        return f"{head}: no round released yet, no ε spent"
    return f"{head}: no ε recorded"


def epsilon_words(epsilon: float, delta: float | None, round_index: int | None) -> str:
    """``ε 2.31 at δ 1e-05 after round 2`` (the parts that are known)."""
    words = f"ε {epsilon:.4g}"
    if delta is not None:
        words += f" at δ {delta:g}"
    if round_index is not None:
        words += f" after round {round_index}"
    return words


def settings_words(description: Mapping[str, Any]) -> list[str]:
    """The settings a guarantee rests on, in words, for those ``description`` holds."""
    words = []
    if description.get("unit"):
        words.append(f"{description['unit']}-level")
    adaptive = description.get("adaptive")
    if adaptive:
        clip = (
            f"adaptive clip from {description.get('clip'):g} toward quantile {adaptive['target_quantile']:g}"
        )
        if description.get("current_clip") is not None:
            clip += f" (next {description['current_clip']:.4g})"
        words.append(clip)
    elif description.get("clip") is not None:
        words.append(f"clip {description['clip']:g}")
    if description.get("noise_multiplier") is not None:
        noise = f"noise multiplier {description['noise_multiplier']:.4g}"
        if description.get("target_epsilon") is not None:
            noise += f" (solved for target ε {description['target_epsilon']:g})"
        words.append(noise)
    if description.get("delta") is not None:
        words.append(f"δ {description['delta']:g}")
    if "accountant" in description:
        accountant = description["accountant"]
        words.append(f"{accountant} accountant" if accountant else "no accountant")
    sampling = sampling_words(description)
    if sampling:
        words.append(sampling)
    return words


def sampling_words(description: Mapping[str, Any]) -> str | None:
    """How the accountant counted the sampling: ``4 of 8 clients per round without replacement``, ``every client
    every round``, ``Poisson sampling at rate 0.04``, under sample-level DP ``Poisson batches of 10 examples
    expected, rates 0.1 to 0.2`` (each client's rate); ``None`` where it is not known."""
    sampling, rate = description.get("sampling"), description.get("sample_rate")
    if description.get("unit") == "example" and description.get("batch_size"):
        low, high = description.get("sample_rate_min"), description.get("sample_rate_max")
        rates = "" if low is None else f", rates {low:.3g} to {high:.3g}"
        return f"Poisson batches of {description['batch_size']} examples expected{rates}"
    if sampling is None or rate is None:
        return None
    unit = description.get("unit") or "unit"
    population = description.get("population")
    if sampling == "without_replacement" and population:
        return f"{round(rate * population)} of {population} {unit}s per round without replacement"
    if rate == 1:
        return f"every {unit} every round"
    return f"{sampling} sampling at rate {rate:g}"


def wandb_summary(section: Mapping[str, Any]) -> dict[str, Any]:
    """The W&B run summary's ``privacy/*`` entries of a ``privacy`` section: ``privacy/guarantee`` (the
    statement), and with a mechanism ``privacy/mechanism``, ``privacy/delta`` and the final
    ``privacy/epsilon`` (where accounted)."""
    entries: dict[str, Any] = {"privacy/guarantee": section["statement"]}
    mechanism = section.get("mechanism")
    if mechanism is not None:
        entries["privacy/mechanism"] = mechanism.get("mechanism")
        if section.get("delta") is not None:
            entries["privacy/delta"] = section["delta"]
        if section.get("epsilon") is not None:
            entries[EPSILON] = section["epsilon"]
    return entries


def run_privacy(run: Path) -> dict[str, Any] | None:
    """A run folder's privacy: ``summary.json``'s ``privacy`` section with the final ε of ``history.csv`` (the
    last ``privacy/epsilon``, the same the section holds), ``None`` for a run without a mechanism (or a folder
    that records none). A folder whose summary predates the section gives the history's ε alone."""
    path = run / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    section = dict(summary.get("privacy") or {})
    last = final_epsilon(read_rows(run / HISTORY))
    if section.get("mechanism") is None and last is None:
        return None
    if last is not None:
        section["epsilon"], section["epsilon_round"] = last
    section.setdefault("mechanism", None)
    section.setdefault("delta", None)
    section.setdefault("statement", None)
    return section


def report_words(record: Mapping[str, Any]) -> str:
    """A run's privacy for a one-line report: ``ε 2.31 at δ 1e-05 after round 2``, or ``privacy not
    accounted`` / ``no ε recorded``."""
    if record.get("epsilon") is not None:
        return epsilon_words(record["epsilon"], record.get("delta"), record.get("epsilon_round"))
    mechanism = record.get("mechanism") or {}
    if "accountant" in mechanism and mechanism["accountant"] is None:
        return f"{mechanism.get('mechanism', 'privacy')} not accounted (no ε)"
    return "no ε recorded"
