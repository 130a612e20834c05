"""The FedRep family as data: what each algorithm shares with the server and its local phases.

An algorithm is not a strategy subclass. It is a small description the one strategy core reads:
which part of the model is averaged by the server (``shared``), and which parts train in which
order on a client (``phases``). Everything the algorithm does not share stays on the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Part = Literal["head", "body", "all"]
Shared = Literal["body", "head", "all", "none"]


@dataclass(frozen=True)
class Phase:
    """One stage of a client's local work: which part trains, for how many epochs or steps.

    Exactly one of ``epochs`` (passes over the client's training data, turned into a step count
    per client when the round is planned) or ``steps`` (optimizer steps) is given.
    """

    train: Part
    epochs: int | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.train not in ("head", "body", "all"):
            raise ValueError(f"Phase.train must be 'head', 'body' or 'all', got {self.train!r}.")
        if (self.epochs is None) == (self.steps is None):
            raise ValueError(f"Give a phase exactly one of epochs= or steps=, got {self!r}.")
        budget = self.epochs if self.epochs is not None else self.steps
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"A phase's epochs/steps must be a non-negative integer, got {budget!r}.")

    def num_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of this phase for a client with ``steps_per_epoch`` batches per epoch."""
        return self.steps if self.steps is not None else self.epochs * steps_per_epoch


@dataclass(frozen=True)
class Algorithm:
    """What the server averages (``shared``) and the default local phases of one algorithm."""

    name: str
    shared: Shared
    needs_split: bool
    description: str

    def default_phases(self, head_epochs: int, body_epochs: int, local_epochs: int) -> tuple[Phase, ...]:
        """Local phases when the user gives only the epoch shorthands."""
        if self.name == "fedrep":
            return (Phase("head", epochs=head_epochs), Phase("body", epochs=body_epochs))
        return (Phase("all", epochs=local_epochs),)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "fedrep",
            "body",
            True,
            "FedRep: head epochs with the body frozen, then body epochs with the head frozen; "
            "the body is averaged, heads stay local.",
        ),
        Algorithm("fedper", "body", True, "FedPer: head and body trained jointly; the body is averaged."),
        Algorithm(
            "lg_fedavg",
            "head",
            True,
            "LG-FedAvg: trained jointly; the head part is averaged, the representation stays local.",
        ),
        Algorithm("fedavg", "all", False, "FedAvg: one global model, everything averaged."),
        Algorithm("local", "none", False, "Local Only: no communication, every client trains alone."),
    )
}


def get_algorithm(name: str) -> Algorithm:
    """Look up an algorithm by name, with an error that lists the valid names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"Unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}.") from None


def parse_phases(phases: Sequence[Phase | dict]) -> tuple[Phase, ...]:
    """Accept phases as ``Phase`` objects or as dicts (the form YAML recipes give)."""
    parsed = tuple(p if isinstance(p, Phase) else Phase(**p) for p in phases)
    if not parsed:
        raise ValueError("phases must name at least one phase, e.g. [{'train': 'all', 'epochs': 1}].")
    return parsed
