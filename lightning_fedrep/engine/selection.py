"""Which engine runs a fit: the strategy's ``engine=`` setting against what is exact and what is faster.

:func:`build_engine` runs at ``setup`` (before any step): the reasons the vectorized engine would not
compute what the sequential path computes send ``engine="auto"`` to the sequential path with one line,
and make ``engine="vectorized"`` an error naming them. :func:`start_engine` runs when the first training
loader is bound: it decides the feature cache and the widths, and under ``"auto"`` keeps the sequential
path where the engine would gain nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_fedrep.algorithms import Algorithm
from lightning_fedrep.collective import Collective
from lightning_fedrep.engine.contract import declared_loss
from lightning_fedrep.engine.report import EngineReport
from lightning_fedrep.engine.runner import LockstepEngine
from lightning_fedrep.engine.validity import federation_reasons, module_reasons, trainer_reasons
from lightning_fedrep.federation import Federation
from lightning_fedrep.loss_terms import VectorizedLossTerm
from lightning_fedrep.plan import RoundPlan

EngineMode = Literal["auto", "vectorized", "sequential"]
Decide = Callable[[EngineReport], None]


def _ignore(report: EngineReport) -> None:
    """The default ``decide``: nobody keeps the report."""


def build_engine(
    mode: EngineMode,
    trainer: L.Trainer,
    module: L.LightningModule,
    federation: Federation,
    optimizers: Sequence[torch.optim.Optimizer],
    lr_scheduler_configs: Sequence[Any],
    algorithm: Algorithm,
    callbacks: Sequence[Any],
    loss_callbacks: Sequence[Any],
    width: int | None,
    decide: Decide = _ignore,
) -> LockstepEngine | None:
    """The vectorized engine for this fit, or ``None`` for the sequential path (``mode="auto"`` where it
    would not be exact); raises for ``mode="vectorized"`` where it would not be exact. ``decide`` receives
    the decision (:class:`EngineReport`)."""
    if mode == "sequential":
        decide(EngineReport.sequential("engine='sequential'", "setup"))
        return None
    terms = {id(c): _loss_term(c, c.vectorized_loss_term(trainer, module)) for c in loss_callbacks}
    reasons = (
        module_reasons(module, federation.layout)
        + trainer_reasons(trainer, optimizers, lr_scheduler_configs)
        + federation_reasons(algorithm, callbacks, {i for i, term in terms.items() if term is not None})
    )
    if federation.config.on_client_error == "skip":
        reasons.append(
            "on_client_error='skip' leaves out the one client whose step raised, which needs its own steps"
        )
    if reasons:
        if mode == "vectorized":
            raise ValueError(
                "engine='vectorized' would not compute what the sequential path computes: "
                f"{'; '.join(reasons)}. Remove what is listed, or pass engine='auto' (falls back to the "
                "sequential path) or engine='sequential'."
            )
        decide(EngineReport.sequential("; ".join(reasons), "setup"))
        rank_zero_info(f"lightning_fedrep: sequential engine ({'; '.join(reasons)}).")
        return None
    decide(EngineReport.vectorized("nothing at setup keeps it sequential; the first loader decides", "setup"))
    loss_terms = list(terms.values())
    return LockstepEngine(
        federation,
        module,
        optimizers[0],
        declared_loss(module),
        width,
        loss_terms=loss_terms,
        convert_input=trainer.precision_plugin.convert_input,
    )


def _loss_term(callback: Any, term: Any) -> VectorizedLossTerm | None:
    """A callback's ``vectorized_loss_term`` answer as a :class:`VectorizedLossTerm` (a plain callable
    gets the defaults), or ``None``."""
    if term is None or isinstance(term, VectorizedLossTerm):
        return term
    if not callable(term):
        raise TypeError(
            f"{type(callback).__name__}.vectorized_loss_term must return a VectorizedLossTerm, a callable or "
            f"None, got {term!r}."
        )
    return VectorizedLossTerm(term)


def start_engine(
    engine: LockstepEngine,
    mode: EngineMode,
    loader: Any,
    plan: RoundPlan,
    device: torch.device,
    memory: int | None,
    smoke: bool,
    collective: Collective | None = None,
    decide: Decide = _ignore,
) -> LockstepEngine | None:
    """On the fit's first training loader: check on probe batches that the engine trains what
    ``training_step`` trains, decide the feature cache and the widths and say so in one line; ``None``
    where ``mode="auto"`` keeps the sequential path (``mode="vectorized"`` raises where the engine
    would not train what the step trains). Later loaders change nothing.
    On several processes every rank takes the first probe problem any rank found (so all fall back
    together), caches features only where every rank can, takes rank 0's lane choice (its timing decides
    for all) and the smallest group width any rank's memory allows."""
    distributed = collective is not None and collective.distributed
    cache = engine.bind_loader(loader, device, collective.all_gather_object if distributed else None)
    if cache is None:
        return engine
    if engine.probe_problem is not None or engine.loss_terms_problem is not None:
        reason = engine.probe_problem or engine.loss_terms_problem
        fix = (
            "The engine runs no training_step: it trains mean(fedrep_loss(module(x), y)) on (inputs, targets) "
            "batches and logs only 'train/loss'; make the module match that"
            if engine.probe_problem is not None
            else "Declare forward_features/forward_head on the module (its features being what the loss terms "
            "take)"
        )
        if mode == "vectorized":
            raise ValueError(
                f"engine='vectorized' cannot run here: {reason}. {fix}, or pass engine='auto' (falls back to "
                "the sequential path) or engine='sequential'."
            )
        decide(EngineReport.sequential(reason, "first loader"))
        rank_zero_info(f"lightning_fedrep: sequential engine ({reason}).")
        return None
    if engine.caching and not any(phase.train == "head" for phase in plan.phases):
        cache = f"no head phase in the first round; any later one on cached features ({engine.split.how})"
    widths = engine.prepare(plan, device, measure=mode == "auto" and not smoke, memory=memory, smoke=smoke)
    if distributed:  # rank 0's timing, the smallest memory bound
        every = collective.all_gather_object(engine.settings())
        bounded = [s["group_width"] for s in every if s["group_width"]]
        engine.use_widths(
            {"group_width": min(bounded) if bounded else 0, "lane_width": every[0]["lane_width"]}
        )
    if mode == "auto" and not engine.gains(plan):
        no_gain = f"no cached features and no gain in lockstep: {widths}"
        decide(EngineReport.sequential(no_gain, "first loader"))
        rank_zero_info(f"lightning_fedrep: sequential engine ({no_gain}).")
        return None
    cached = ("head",) if engine.caching else ()
    how = engine.split.how if cached else ""
    decide(EngineReport.vectorized(f"{cache}; {widths}", "first loader", cached, how))
    rank_zero_info(f"lightning_fedrep: vectorized engine ({cache}; {widths}).")
    return engine
