"""Moved to :mod:`lightning_fedrep.runners.lockstep.optimizers`; this old import path is the same module."""

import sys

from lightning_fedrep.runners.lockstep import optimizers as _moved

sys.modules[__name__] = _moved
