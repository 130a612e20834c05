"""When the vectorized runner computes exactly what the sequential path computes, and when not.

:func:`sequential_reasons` lists every reason found (checked at ``setup``, before any step). With
``runner="auto"`` any reason sends the run to the sequential path with a one-line message; with
``runner="vectorized"`` it is an error naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_fedrep.federation.api.objective import Objective
from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.federation.module.split import TensorLayout
from lightning_fedrep.runners.settings import Randomness

if TYPE_CHECKING:
    from lightning_fedrep.runners.constraints import Constraints

PER_PARAMETER_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)
"""Optimizers whose update of a parameter reads only that parameter's gradient and state, so one
optimizer over K per-client copies is exactly K optimizers."""

_RANDOM_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)
"""Layers that draw random numbers in train mode: refused under ``randomness="exact"``, taken under
``randomness="per_client"`` (each client then draws its own)."""

PER_CLIENT_FIX = "randomness='per_client' lets the vectorized runner draw each client's own"
"""How the exact contract's refusal of a random layer names the fix."""


def random_layers(module: nn.Module) -> list[str]:
    """The submodules of ``module`` that draw random numbers in train mode, as ``'name' (Class)``."""
    return [
        f"{name!r} ({type(sub).__name__})"
        for name, sub in module.named_modules()
        if isinstance(sub, _RANDOM_MODULES) and getattr(sub, "p", 1.0) != 0
    ]


def module_reasons(
    module: nn.Module, layout: TensorLayout, constraints: Constraints, randomness: Randomness = "exact"
) -> list[str]:
    """What in the module (and its Lightning facts, ``constraints``) keeps the engine from being exact, or,
    under ``randomness="per_client"``, from drawing each client's own random numbers (random layers are then
    no reason)."""
    reasons = []
    if declared_loss(module) is None:
        reasons.append(
            "the module declares no pure loss (set `fedrep_loss` to what training_step computes, e.g. "
            "fedrep_loss = 'cross_entropy')"
        )
    if not constraints.automatic_optimization:
        reasons.append("manual optimization")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            reasons.append(f"batch norm in train mode ({name!r} uses batch statistics)")
        elif isinstance(sub, _RANDOM_MODULES) and getattr(sub, "p", 1.0) != 0 and randomness == "exact":
            reasons.append(f"random layer {name!r} ({type(sub).__name__}) in train mode ({PER_CLIENT_FIX})")
    overridden = constraints.overridden_hooks
    if overridden:
        reasons.append(
            f"the module overrides {', '.join(overridden)} (the engine steps its own per-client copies)"
        )
    buffers = {n for n, _ in module.named_buffers()}
    if buffers & set(layout.local):
        reasons.append("buffers kept per client (buffers='local', or the algorithm's keep_local)")
    return reasons


def trainer_reasons(constraints: Constraints) -> list[str]:
    """What in the Trainer's settings or the optimizers (``constraints``) keeps the engine from being exact."""
    reasons = []
    optimizers = constraints.optimizers
    if str(constraints.precision) not in ("32-true", "32", "64-true", "64"):
        reasons.append(f"precision {constraints.precision!r} (the engine runs full precision)")
    if constraints.gradient_clip_val:
        reasons.append("gradient clipping (gradient_clip_val)")
    if len(optimizers) != 1:
        reasons.append(f"{len(optimizers)} optimizers (the engine steps one)")
    elif type(optimizers[0]) not in PER_PARAMETER_OPTIMIZERS:
        reasons.append(
            f"{type(optimizers[0]).__name__} is not an optimizer the engine knows to be per-parameter "
            f"({', '.join(o.__name__ for o in PER_PARAMETER_OPTIMIZERS)})"
        )
    return reasons


def federation_reasons(objectives: Mapping[str, Objective], callbacks: Sequence[object]) -> list[str]:
    """What the local objectives (each phase part's: the algorithm's and the callbacks' terms and
    transforms) or the federated callbacks add that the engine cannot vectorize."""
    names = dict.fromkeys(name for objective in objectives.values() for name in objective.not_vmappable())
    reasons = [f"{name} cannot run in lockstep (vmappable=False)" for name in names]
    rules = dict.fromkeys(
        o.step.name for o in objectives.values() if o.step is not None and not o.step.vmappable
    )
    reasons += [f"the step rule {name!r} cannot run in lockstep (vmappable=False)" for name in rules]
    for callback in callbacks:
        if getattr(callback, "needs_client_timing", False):
            reasons.append(f"{type(callback).__name__} measures each client's step time")
    return reasons
