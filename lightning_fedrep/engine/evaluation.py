"""Moved to :mod:`lightning_fedrep.runners.lockstep.evaluation`; this old import path is the same module."""

import sys

from lightning_fedrep.runners.lockstep import evaluation as _moved

sys.modules[__name__] = _moved
