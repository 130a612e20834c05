"""Moved to :mod:`lightning_fedrep.lightning.checks`; this old import path is the same module (kept for existing code)."""

import sys

from lightning_fedrep.lightning import checks as _moved

sys.modules[__name__] = _moved
