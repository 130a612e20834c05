"""The Trainer's and the module's facts the runner selection reads, as a plain
:class:`~lightning_fedrep.runners.constraints.Constraints` (the runners import no Lightning)."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, Timer
from lightning.pytorch.callbacks.progress import ProgressBar

from lightning_fedrep.runners.constraints import Constraints

MODULE_STEP_HOOKS = (
    "backward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "optimizer_zero_grad",
)
"""LightningModule hooks around the optimizer step; the vectorized runner steps its own per-client copies."""

PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)
"""Callback and module hooks Lightning calls once per training step: one that acts there needs a Lightning
step per local step, so the engine does not fuse lockstep steps (``RunnerSettings.steps_per_call``)."""

NOT_PER_LOCAL_STEP = (ProgressBar, Timer, LearningRateMonitor)
"""Lightning callbacks whose per-batch hooks only display, check the clock or log the (per-round) learning
rate: fused calls change how often, not what (the progress bar counts calls, ``Timer`` stops at a call's end).
A callback of one's own says the same with a class attribute ``acts_per_local_step = False``."""


def constraints_of(
    trainer: L.Trainer, module: L.LightningModule, optimizers: Sequence[torch.optim.Optimizer]
) -> Constraints:
    """What the runner selection needs of ``trainer`` and ``module``."""
    overridden = tuple(
        h for h in MODULE_STEP_HOOKS if getattr(type(module), h) is not getattr(L.LightningModule, h)
    )
    return Constraints(
        precision=str(trainer.precision),
        gradient_clip_val=trainer.gradient_clip_val,
        optimizers=tuple(optimizers),
        automatic_optimization=module.automatic_optimization,
        overridden_hooks=overridden,
        convert_input=trainer.precision_plugin.convert_input,
        to_device=move_data_to_device,
        smoke=bool(trainer.fast_dev_run),
        per_step_needs=per_step_needs(trainer, module),
    )


def per_step_needs(trainer: L.Trainer, module: L.LightningModule) -> tuple[str, ...]:
    """What in ``trainer`` or ``module`` needs a Lightning step per local step (empty: lockstep steps may be
    fused into one Lightning step)."""
    needs = []
    if trainer.max_steps not in (-1, None):
        needs.append(f"max_steps={trainer.max_steps} counts Lightning steps")
    interval = trainer.val_check_interval
    if trainer.check_val_every_n_epoch is None or isinstance(interval, int) or interval != 1.0:
        needs.append(f"val_check_interval={interval!r} validates inside a round")
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            every = callback._every_n_train_steps or callback._train_time_interval
            if every:
                needs.append(f"ModelCheckpoint saves inside a round (every {every})")
            continue
        if isinstance(callback, NOT_PER_LOCAL_STEP) or not getattr(callback, "acts_per_local_step", True):
            continue
        hooks = _overridden(type(callback), L.Callback)
        if hooks:
            needs.append(f"{type(callback).__name__} acts per training step ({', '.join(hooks)})")
    hooks = _overridden(type(module), L.LightningModule)
    if hooks:
        needs.append(f"{type(module).__name__} acts per training step ({', '.join(hooks)})")
    return tuple(needs)


def _overridden(cls: type, base: type) -> tuple[str, ...]:
    return tuple(h for h in PER_BATCH_HOOKS if getattr(cls, h, None) is not getattr(base, h, None))
