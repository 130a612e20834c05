"""Moved to :mod:`lightning_fedrep.runners.report` (this old import path keeps working)."""

from lightning_fedrep.runners.report import (
    LOCKSTEP,
    PHASE_PARTS,
    SEQUENTIAL,
    DecidedAt,
    Engine,
    EngineReport,
    RunnerReport,
)

__all__ = ["LOCKSTEP", "PHASE_PARTS", "SEQUENTIAL", "DecidedAt", "Engine", "EngineReport", "RunnerReport"]
