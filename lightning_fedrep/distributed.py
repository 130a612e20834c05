"""Moved to :mod:`lightning_fedrep.lightning.ddp`; this old import path is the same module (kept for existing
code and recipes' ``class_path``)."""

import sys

from lightning_fedrep.lightning import ddp as _moved

sys.modules[__name__] = _moved
