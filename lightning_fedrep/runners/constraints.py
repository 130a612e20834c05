"""What the runner selection needs to know of the Trainer and the module, as plain values.

The Lightning face (:func:`lightning_fedrep.lightning.constraints.constraints_of`) reads them; the runners
never import Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fedrep.federation.module.batches import move_to_device  # the default of Constraints.to_device


@dataclass(frozen=True)
class Constraints:
    """The Trainer's and the module's facts that decide whether the lockstep runner is exact.

    Attributes:
        precision: the Trainer's precision (``"32-true"``, ...).
        gradient_clip_val: the Trainer's gradient clipping (``None``/0: none).
        optimizers: the module's optimizers.
        automatic_optimization: the module's optimization mode.
        overridden_hooks: the module's step hooks that override Lightning's (the engine steps its copies).
        convert_input: what Lightning does to a training batch before the step (precision).
        to_device: how Lightning moves a batch to a device.
        smoke: a ``fast_dev_run`` (no timing; one batch a pass).
        per_step_needs: what needs a Lightning step per local step (a per-batch callback or module hook,
            ``max_steps``, mid-round validation or checkpoints): the engine then runs unfused.
    """

    precision: str = "32-true"
    gradient_clip_val: float | None = None
    optimizers: Sequence[torch.optim.Optimizer] = ()
    automatic_optimization: bool = True
    overridden_hooks: tuple[str, ...] = ()
    convert_input: Callable[[Any], Any] = field(default=lambda batch: batch)
    to_device: Callable[[Any, torch.device], Any] = move_to_device
    smoke: bool = False
    per_step_needs: tuple[str, ...] = ()
