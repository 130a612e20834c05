"""The strategy's one runner setting: which runner runs a fit's local work, and the vectorized runner's
sizing (``FederatedStrategy(runner=...)``).

``runner="auto"``, ``"vectorized"`` or ``"sequential"`` chooses with every other setting at its default;
:class:`RunnerSettings` carries the choice with the rest. Both are checked when the strategy is built
(:func:`runner_settings`); :mod:`~lightning_fedrep.runners.selection` acts on them at ``setup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_fedrep.federation.api.arguments import check_bool

RunnerChoice = Literal["auto", "vectorized", "sequential"]
StepsPerCall = int | Literal["auto"]
CHOICES: tuple[str, ...] = get_args(RunnerChoice)
Randomness = Literal["exact", "per_client"]
RANDOMNESS: tuple[str, ...] = get_args(Randomness)

OLD_KEYWORDS = {
    "engine": "runner=<choice>",
    "engine_width": "runner=RunnerSettings(width=...)",
    "engine_memory": "runner=RunnerSettings(memory=...)",
    "engine_steps_per_call": "runner=RunnerSettings(steps_per_call=...)",
    "engine_compile": "runner=RunnerSettings(compile=...)",
}
"""The strategy's runner keywords before 0.x folded them into ``runner`` (refused, naming the new form)."""


@dataclass(frozen=True)
class RunnerSettings:
    """How a round's local work runs: ``FederatedStrategy(runner=RunnerSettings(...))`` (a recipe:
    ``runner: {class_path: lightning_fedrep.RunnerSettings, init_args: {choice: vectorized, width: 8}}``).
    Checked when built; each error names the setting.

    Args:
        choice: ``"vectorized"``: a round's clients train together in lockstep (one Lightning step = one
            local step of every client; ``torch.func``), head phases on cached body features; exact, but only
            for a module that declares its loss (``fedrep_loss``), has no random layers or batch norm, and an
            element-wise optimizer without gradient clipping (an error lists what is missing).
            ``"sequential"``: one client step per Lightning step, the user's ``training_step`` as is.
            ``"auto"``: vectorized where exact, else sequential with a one-line message saying why; it also
            times once per fit whether an uncached phase (FedRep's body epoch) is faster in lockstep or one
            client at a time (logged, checkpointed), sequential where nothing is gained.
        width: at most this many clients train together; ``None``: a round's clients, as many as ``memory``
            allows.
        memory: bytes a lockstep group may take (tensors, gradients, optimizer state, one step's activations,
            cached features, per client); ``None``: half a GPU's free memory, a quarter of the host's RAM.
        steps_per_call: lockstep steps per Lightning step (``global_step`` counts calls). ``"auto"``: a group's
            whole phase, or one where something needs a step per local step (docs: Fused lockstep); an int:
            at most that many (``1``: unfused; more is refused where something needs one).
        compile: compile the vectorized runner's head steps on cached features (``torch.compile``; docs:
            Compiled head steps): seconds of compiling per fit, faster steps after; close to eager, not
            bit-exact.
    """

    choice: RunnerChoice = "auto"
    width: int | None = None
    memory: int | None = None
    steps_per_call: StepsPerCall = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ValueError(
                f"RunnerSettings.choice must be 'auto', 'vectorized' or 'sequential', got {self.choice!r}."
            )
        _check_positive_or_none("width", self.width, "a client count", "a round's clients")
        _check_positive_or_none(
            "memory", self.memory, "a number of bytes", "half a GPU's free memory, a quarter of the RAM"
        )
        _check_steps_per_call(self.steps_per_call, self.choice)
        check_bool("RunnerSettings.compile", self.compile)
        if self.compile and self.choice == "sequential":
            raise ValueError(
                "RunnerSettings(compile=True) compiles the vectorized runner's head steps on cached features, "
                "but choice='sequential' runs the user's training_step. Pass choice='auto' or "
                "choice='vectorized', or leave compile at False."
            )


def runner_settings(runner: Any) -> RunnerSettings:
    """The strategy's ``runner`` argument as :class:`RunnerSettings` (a choice's name stands for its
    defaults); refuses anything else, at construction."""
    if isinstance(runner, RunnerSettings):
        return runner
    if isinstance(runner, str) and runner in CHOICES:
        return RunnerSettings(runner)
    raise ValueError(
        "runner must be 'auto', 'vectorized' or 'sequential', or a RunnerSettings (e.g. "
        f"RunnerSettings('vectorized', width=8)), got {runner!r}."
    )


def randomness_setting(randomness: Any) -> Randomness:
    """The strategy's ``randomness`` argument, checked at construction: ``"exact"`` (the vectorized runner
    computes what the sequential runner computes, draw for draw, so it refuses random layers in train mode) or
    ``"per_client"`` (it takes them, each client drawing its own random numbers: the same distribution as the
    sequential runner, not the same draws)."""
    if isinstance(randomness, str) and randomness in RANDOMNESS:
        return randomness  # type: ignore[return-value]
    raise ValueError(
        "randomness must be 'exact' (the vectorized runner equals the sequential runner draw for draw and "
        "refuses random layers such as dropout) or 'per_client' (it takes them, each client drawing its own "
        f"random numbers: the same distribution, not the same draws), got {randomness!r}."
    )


def refuse_old_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse the runner keywords the strategy took before ``runner`` (``engine``, ``engine_width``, ...),
    naming what to pass instead."""
    old = [name for name in kwargs if name in OLD_KEYWORDS]
    if old:
        instead = "; ".join(f"{name}= -> {OLD_KEYWORDS[name]}" for name in old)
        raise TypeError(
            f"The strategy takes no {', '.join(name + '=' for name in old)} any more: the runner settings are "
            f"one argument, runner ({instead}). E.g. runner='vectorized', or "
            "runner=RunnerSettings('auto', width=8, memory=2**30, steps_per_call=1, compile=True) "
            "(lightning_fedrep.RunnerSettings)."
        )


def _check_positive_or_none(name: str, value: Any, what: str, default: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"RunnerSettings.{name} must be {what} >= 1 or None ({default}), got {value!r}.")


def _check_steps_per_call(value: Any, choice: str) -> None:
    """``"auto"`` or an int >= 1, and more than one only where the vectorized runner may run."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            "RunnerSettings.steps_per_call must be 'auto' or a number of lockstep steps >= 1 (1: one per "
            f"Lightning step), got {value!r}."
        )
    if choice == "sequential" and value != "auto" and value > 1:
        raise ValueError(
            f"RunnerSettings(steps_per_call={value}) fuses lockstep steps of the vectorized runner, but "
            "choice='sequential' runs one client step per Lightning step (the user's training_step). Pass "
            "choice='auto' or choice='vectorized', or leave steps_per_call at 'auto'."
        )
