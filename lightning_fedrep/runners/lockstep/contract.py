"""What the vectorized engine needs to know about a module: its pure loss and its body/head split.

The user's ``training_step`` is opaque, so the engine runs only on a module that *declares* the loss
its ``training_step`` computes (``fedrep_loss``). To cache the frozen body's output it also needs the
model as ``head(features(x))``: declared with ``forward_features`` / ``forward_head`` (timm's names),
or detected when the head submodule is called last and its output is the model's output. Both are
checked on a probe batch before they are trusted (:mod:`lightning_fedrep.federation.feature_split`, in the
core, where FedCP finds the same split).
"""

from __future__ import annotations

from lightning_fedrep.federation.feature_split import (  # noqa: F401 (re-exported: moved to the core)
    FeatureSplit,
    find_feature_split,
    same_tensor,
)
from lightning_fedrep.losses import (  # noqa: F401 (re-exported: the engine's old import path)
    NAMED_LOSSES,
    LossFn,
    cross_entropy_per_sample,
    declared_loss,
    mse_per_sample,
)
