"""Moved to :mod:`lightning_fedrep.runners.selection` (this old import path keeps working)."""

from lightning_fedrep.runners.selection import (
    Decision,
    EngineMode,
    RunnerSelection,
    build_engine,
    start_engine,
)

__all__ = ["Decision", "EngineMode", "RunnerSelection", "build_engine", "start_engine"]
