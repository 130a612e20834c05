"""Moved to :mod:`lightning_fedrep.runners.lockstep` (the lockstep runner); this old import path, and each
``lightning_fedrep.engine.<module>``, keep working."""

from lightning_fedrep.runners.lockstep import (
    FeatureSplit,
    LockstepEngine,
    LockstepPlan,
    Segment,
    data_is_deterministic,
    declared_loss,
    federation_reasons,
    find_feature_split,
    lockstep_plan,
    module_reasons,
    trainer_reasons,
)

__all__ = [
    "FeatureSplit",
    "LockstepEngine",
    "LockstepPlan",
    "Segment",
    "data_is_deterministic",
    "declared_loss",
    "federation_reasons",
    "find_feature_split",
    "lockstep_plan",
    "module_reasons",
    "trainer_reasons",
]
