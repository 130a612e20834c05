"""Old import path of the client store: it lives in :mod:`lightning_fedrep.federation.store` (re-exported here)."""

from lightning_fedrep.federation.store import (
    FIRST_CHUNK_ROWS,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_ROWS,
    ClientNotHeld,
    ClientStore,
    OptimizerState,
    StackedRows,
)

__all__ = [
    "FIRST_CHUNK_ROWS",
    "MAX_CHUNK_BYTES",
    "MAX_CHUNK_ROWS",
    "ClientNotHeld",
    "ClientStore",
    "OptimizerState",
    "StackedRows",
]
