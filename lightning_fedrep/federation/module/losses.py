"""The training losses a module can declare (``fedrep_loss``), by name or as a callable.

Neutral ground for the engine (which trains the declared loss) and the callbacks (fine-tuning on it):
no Lightning, no engine.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "NAMED_LOSSES",
    "LossFn",
    "cross_entropy_per_sample",
    "declared_loss",
    "masked_mean",
    "mse_per_sample",
    "required_loss",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss(output, target) -> per-sample losses`` (shape ``[batch]``); the training loss is their mean."""


def cross_entropy_per_sample(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample cross-entropy on logits (or log-probabilities) for integer class labels."""
    return F.cross_entropy(output, target, reduction="none")


def mse_per_sample(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample mean squared error over the output's elements."""
    diff = output.reshape(target.shape[0], -1) - target.reshape(target.shape[0], -1).to(output.dtype)
    return diff.pow(2).mean(dim=1)


def masked_mean(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """The mean of per-sample ``values`` over their last dimension, counting only the real samples (``mask``:
    1 real, 0 padding; 0 where a row has none); ``None``: every sample, over all of ``values``."""
    if mask is None:
        return values.mean()
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


NAMED_LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy_per_sample, "mse": mse_per_sample}


def declared_loss(module: nn.Module) -> LossFn | None:
    """The per-sample loss the module declares with ``fedrep_loss`` (a name or a callable), or ``None``."""
    loss = getattr(module, "fedrep_loss", None)
    if loss is None:
        return None
    if isinstance(loss, str):
        if loss not in NAMED_LOSSES:
            raise ValueError(
                f"fedrep_loss={loss!r} is not a known loss; use one of {sorted(NAMED_LOSSES)} or a callable."
            )
        return NAMED_LOSSES[loss]
    if not callable(loss):
        raise TypeError(
            f"fedrep_loss must be a loss name or a callable (output, target) -> per-sample loss, got {loss!r}."
        )
    return loss


def required_loss(module: nn.Module, owner: str, of: str) -> LossFn:
    """The per-sample classification loss an algorithm's own step differentiates: the module's ``fedrep_loss``
    when it is ``"cross_entropy"`` or a callable; otherwise (none, or another name) a ``ValueError`` naming
    ``owner`` (the algorithm), ``of`` (what the loss scores, e.g. ``"h(rep)"``) and the fix. Called at the
    algorithm's ``setup``."""
    loss = getattr(module, "fedrep_loss", None)
    if callable(loss):
        return loss
    if loss == "cross_entropy":
        return cross_entropy_per_sample
    raise ValueError(
        f"{owner} needs the module's fedrep_loss (the per-sample loss of {of}): set fedrep_loss = "
        f"'cross_entropy' (or a callable (output, target) -> per-sample loss), got {loss!r}."
    )
