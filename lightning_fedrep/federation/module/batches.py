"""A training batch as the runners read it: ``(inputs, targets)`` tensors (the vectorized engine trains the
declared loss on them, a step rule reads them), with the reason a batch of another form is refused; and a
batch moved to a device without Lightning (:func:`move_to_device`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map


def is_pair(batch: Any) -> bool:
    """Whether ``batch`` is ``(inputs, targets)``: a list or tuple of two tensors."""
    return isinstance(batch, list | tuple) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)


def batch_problem(batch: Any, where: str) -> str | None:
    """Why ``batch`` is not ``(inputs, targets)`` tensors (naming ``where`` it was read), or ``None``."""
    if is_pair(batch):
        return None
    kind = type(batch).__name__
    if isinstance(batch, Mapping):
        kind = f"a {kind} with keys {sorted(map(str, batch))}"
    return f"the training batches are {kind}, not (inputs, targets) tensors ({where})"


def batch_pair(batch: Any, where: str) -> tuple[Tensor, Tensor]:
    """``batch`` as ``(inputs, targets)`` tensors, as the engine and a step rule read a training batch;
    a clear error naming ``where`` for any other batch."""
    problem = batch_problem(batch, where)
    if problem is not None:
        raise TypeError(f"{problem}: return (inputs, targets) tensors from the training data set.")
    return batch[0], batch[1]


def move_to_device(batch: Any, device: Any) -> Any:
    """Every tensor of a (nested: lists, tuples, dicts) batch on ``device``, and every other value that has a
    ``to`` method (as Lightning moves a batch), the rest as it is: for the code that runs without Lightning (the
    runners' default, the fine-tuning before an evaluation)."""
    return tree_map(lambda value: value.to(device) if _movable(value) else value, batch)


def _movable(value: Any) -> bool:
    return isinstance(value, Tensor) or (not isinstance(value, type) and callable(getattr(value, "to", None)))
