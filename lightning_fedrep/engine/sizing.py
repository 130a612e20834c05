"""Moved to :mod:`lightning_fedrep.runners.lockstep.sizing`; this old import path is the same module."""

import sys

from lightning_fedrep.runners.lockstep import sizing as _moved

sys.modules[__name__] = _moved
