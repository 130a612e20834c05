"""The vectorized engine: a round's clients trained together in lockstep (``torch.func``), the head
phase on cached body features, and the rules for when that is exactly the sequential computation."""

from lightning_fedrep.engine.contract import FeatureSplit, declared_loss, find_feature_split
from lightning_fedrep.engine.runner import LockstepEngine, data_is_deterministic
from lightning_fedrep.engine.schedule import LockstepPlan, Segment, lockstep_plan
from lightning_fedrep.engine.validity import federation_reasons, module_reasons, trainer_reasons

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
