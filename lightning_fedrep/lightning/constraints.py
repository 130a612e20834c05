"""The Trainer's and the module's facts the runner selection reads, as a plain
:class:`~lightning_fedrep.runners.constraints.Constraints` (the runners import no Lightning)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_fedrep.runners.constraints import Constraints

MODULE_STEP_HOOKS = (
    "backward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "optimizer_zero_grad",
)
"""LightningModule hooks around the optimizer step; the lockstep engine steps its own per-client copies."""


def constraints_of(
    trainer: L.Trainer,
    module: L.LightningModule,
    optimizers: Sequence[torch.optim.Optimizer],
    lr_scheduler_configs: Sequence[Any],
) -> Constraints:
    """What the runner selection needs of ``trainer`` and ``module``."""
    overridden = tuple(
        h for h in MODULE_STEP_HOOKS if getattr(type(module), h) is not getattr(L.LightningModule, h)
    )
    return Constraints(
        precision=str(trainer.precision),
        gradient_clip_val=trainer.gradient_clip_val,
        optimizers=tuple(optimizers),
        step_schedulers=any(config.interval == "step" for config in lr_scheduler_configs),
        automatic_optimization=module.automatic_optimization,
        overridden_hooks=overridden,
        convert_input=trainer.precision_plugin.convert_input,
        to_device=move_data_to_device,
        smoke=bool(trainer.fast_dev_run),
    )
