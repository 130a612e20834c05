"""Fused lockstep: how many lockstep steps the engine runs in one Lightning step.

Lightning's per-step cost (hooks, the loops' bookkeeping, the optimizer closure) is paid once per
Lightning step. Unfused, the engine pays it once per lockstep step; fused, one Lightning step runs a whole
phase of a group (or ``steps_per_call`` lockstep steps of it) in a tight loop, so the cost is paid once per
call. The arithmetic is the same, step for step (the same batches, losses, gradients and optimizer steps in
the same order): only what Lightning sees per step changes. It needs that nothing acts per Lightning step
with the meaning "one local step": the face lists what does (``Constraints.per_step_needs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_fedrep.runners.settings import StepsPerCall


def resolve_steps_per_call(
    setting: StepsPerCall, per_step_needs: Sequence[str], smoke: bool
) -> tuple[int | None, str]:
    """The engine's lockstep steps per Lightning step (``None``: a whole phase of a group) and the words for
    the engine's log line. ``setting`` is ``RunnerSettings.steps_per_call``; ``per_step_needs`` what
    needs a Lightning step per local step (refused with an int above one); a smoke run (``fast_dev_run``,
    one Lightning step a pass) is never fused."""
    if smoke:
        return 1, "one lockstep step per Lightning step (fast_dev_run)"
    if setting == "auto":
        if per_step_needs:
            return 1, f"one lockstep step per Lightning step ({'; '.join(per_step_needs)})"
        return None, "a whole phase of a group per Lightning step"
    if setting > 1 and per_step_needs:
        raise ValueError(
            f"RunnerSettings(steps_per_call={setting}) runs {setting} lockstep steps per Lightning step, but "
            f"{'; '.join(per_step_needs)}. Remove what is listed, or pass steps_per_call='auto' (one "
            "lockstep step per Lightning step where something needs it) or 1."
        )
    if setting == 1:
        return 1, "one lockstep step per Lightning step (steps_per_call=1)"
    return setting, f"up to {setting} lockstep steps per Lightning step"
