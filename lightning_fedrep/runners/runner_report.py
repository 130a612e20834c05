"""Which runner ran a fit's training steps, and why: the public ``strategy.runner_report``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

RunnerName = Literal["vectorized", "sequential"]
DecidedAt = Literal["setup", "first loader", "checkpoint"]
RandomnessName = Literal["exact", "per_client"]

PHASE_PARTS = ("head", "body", "all")
SEQUENTIAL = "sequential: one client step per Lightning step, the module's own training_step"
LOCKSTEP = "vectorized: clients in lockstep under torch.func"
EXACT_DRAWS = (
    "exact: the vectorized runner computes what the sequential runner computes, draw for draw (no random layer "
    "runs in train mode)"
)
PER_CLIENT_DRAWS = (
    "per_client: every client of a lockstep step draws its own random numbers (dropout masks), from a generator "
    "keyed by the strategy's seed, the round, the phase, the local step and the step's clients: the same "
    "distribution as the sequential runner, not the same draws; reproducible for a seed and across a resume"
)
PER_CLIENT_LINE = (
    "Randomness: per_client (each client draws its own random numbers, keyed by the seed, round, phase, step "
    "and the step's clients: the same distribution as the sequential runner, not the same draws)."
)
"""What the vectorized runner's log line adds under ``randomness="per_client"``."""
SEQUENTIAL_DRAWS = (
    "sequential: the module's training_step draws from torch's global generator (seed_everything seeds it, "
    "checkpoints hold it)"
)


def randomness_contract(runner: RunnerName, randomness: RandomnessName) -> str:
    """The randomness contract that runs, in words: the sequential runner's own draws, or the vectorized
    runner's under the strategy's ``randomness`` setting."""
    if runner == "sequential":
        return SEQUENTIAL_DRAWS
    return PER_CLIENT_DRAWS if randomness == "per_client" else EXACT_DRAWS


PER_BATCH_FORWARD = (
    "per batch on each client's model with the algorithm's EvaluationSpec.forward (not batched over clients)"
)


@dataclass(frozen=True)
class RunnerReport:
    """The runner decision of a fit (read-only; ``FederatedStrategy.runner_report``).

    Attributes:
        runner: ``"vectorized"`` or ``"sequential"`` (the names of the ``runner=`` setting): what runs the
            training steps.
        reason: why, the text of the one log line (``lightning_fedrep: <runner> runner (<reason>).``).
        decided_at: ``"setup"`` (the settings, module, Trainer, algorithm and callbacks), ``"first loader"``
            (probe batches, feature cache, widths, measured gain) or ``"checkpoint"`` (a resumed run keeps
            the runner of the run that saved it). A ``"setup"`` report that says ``"vectorized"`` is
            provisional: the first training loader may still send the fit to the sequential path.
        phases: how each kind of phase (``"head"``, ``"body"``, ``"all"``) runs, where it differs: under the
            vectorized runner head phases may run on cached body features.
        evaluation: how validation and test run where the vectorized runner does not batch them (``None``:
            as the runner decides): an algorithm's ``EvaluationSpec.forward`` is evaluated per batch
            (``PER_BATCH_FORWARD``).
        randomness: the strategy's ``randomness`` setting (``"exact"`` or ``"per_client"``).
        randomness_contract: the contract that ran, in words: ``EXACT_DRAWS`` or ``PER_CLIENT_DRAWS`` on the
            vectorized runner, ``SEQUENTIAL_DRAWS`` on the sequential runner (whatever the setting).
    """

    runner: RunnerName
    reason: str
    decided_at: DecidedAt
    phases: Mapping[str, str] = field(default_factory=dict)
    evaluation: str | None = None
    randomness: RandomnessName = "exact"
    randomness_contract: str = EXACT_DRAWS

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", MappingProxyType(dict(self.phases)))

    @classmethod
    def sequential(cls, reason: str, decided_at: DecidedAt) -> RunnerReport:
        """The sequential path for every phase, chosen for ``reason`` (in words) when ``decided_at`` says."""
        return cls("sequential", reason, decided_at, dict.fromkeys(PHASE_PARTS, SEQUENTIAL))

    @classmethod
    def vectorized(
        cls, reason: str, decided_at: DecidedAt, cached: Iterable[str] = (), how: str = ""
    ) -> RunnerReport:
        """The vectorized runner, chosen for ``reason`` (in words) when ``decided_at`` says; the phase kinds in
        ``cached`` train on cached features (``how``: the split)."""
        cached = set(cached)
        phases = {
            p: f"{LOCKSTEP}, on cached features ({how})" if p in cached else LOCKSTEP for p in PHASE_PARTS
        }
        return cls("vectorized", reason, decided_at, phases)

    def __str__(self) -> str:
        return f"{self.runner} runner ({self.reason}), decided at {self.decided_at}"
