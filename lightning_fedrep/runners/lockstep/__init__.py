"""The lockstep runner: a round's clients trained together (``torch.func``), the head phase on cached body
features, and the rules for when that is exactly the sequential computation. ``runner.py``:
:class:`LockstepRunner` (the runner protocol); ``engine.py``: :class:`LockstepEngine`; ``schedule.py`` (lockstep
segments), ``group.py`` (stacked client tensors), ``optimizers.py``, ``probe.py``, ``validity.py`` (why not
exact), ``sizing.py`` (memory bound, lockstep timing), ``fusion.py`` (lockstep steps per Lightning step),
``compiled.py`` (compiled cached head steps), ``heads_together.py`` (heads fine-tuned together),
``evaluation.py`` (batched personalized evaluation), ``loading.py`` (what it reads from a loader). What it needs to know about the module (its declared
loss, its feature split) is in the core's :mod:`lightning_fedrep.federation.module`."""

from lightning_fedrep.runners.lockstep.engine import LockstepEngine, data_is_deterministic
from lightning_fedrep.runners.lockstep.runner import LockstepRunner
from lightning_fedrep.runners.lockstep.schedule import LockstepPlan, Segment, lockstep_plan
from lightning_fedrep.runners.lockstep.validity import federation_reasons, module_reasons, trainer_reasons

__all__ = [
    "LockstepEngine",
    "LockstepPlan",
    "LockstepRunner",
    "Segment",
    "data_is_deterministic",
    "federation_reasons",
    "lockstep_plan",
    "module_reasons",
    "trainer_reasons",
]
