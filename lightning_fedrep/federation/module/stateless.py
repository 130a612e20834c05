"""Running a module on given tensors (``torch.func.functional_call``), as the runners do every step.

``functional_call`` by default looks for tied tensors (one parameter under two names) on every call, a walk
over every submodule that costs a small head step about as much as its arithmetic. :func:`stateless_call`
decides once whether the module has any: where it has none, tying cannot change what runs, and the call
skips the walk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

StatelessCall = Callable[..., Any]
"""``call(tensors, *args)``: the module's forward on ``args`` with ``tensors`` (``{full name: tensor}``) in
place of its own (any it lacks are its own)."""


def has_tied_tensors(module: nn.Module) -> bool:
    """Whether one parameter or buffer of ``module`` appears under two names (tied weights)."""
    parameters = sum(1 for _ in module.named_parameters(remove_duplicate=False))
    buffers = sum(1 for _ in module.named_buffers(remove_duplicate=False))
    return parameters != len(dict(module.named_parameters())) or buffers != len(dict(module.named_buffers()))


def stateless_call(module: nn.Module) -> StatelessCall:
    """``module``'s forward on given tensors: ``functional_call`` with ``tie_weights`` only where the module
    ties tensors (decided now: a module that ties tensors later must be wrapped again)."""
    tie = has_tied_tensors(module)

    def call(tensors: Mapping[str, Tensor], *args: Any) -> Any:
        return torch.func.functional_call(module, dict(tensors), args, tie_weights=tie)

    return call
