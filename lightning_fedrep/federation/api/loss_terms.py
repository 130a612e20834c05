"""The deprecated callback loss-term types (superseded by :mod:`lightning_fedrep.federation.api.objective`).

:class:`LiveStep` is what a callback's deprecated ``loss_term`` is asked for; :class:`VectorizedLossTerm` is
its pure per-client form (``vectorized_loss_term``). ``FederatedCallback.objective`` adapts both into one
:class:`~lightning_fedrep.federation.api.objective.LossTerm`. Free of Lightning, in the core
(``lightning_fedrep.lightning.callback`` re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Part

__all__ = ["LiveStep", "VectorizedLossTerm", "adds_loss_term", "no_loss_term"]

_NO_LOSS_TERM = "__fedrep_no_loss_term__"

_F = TypeVar("_F", bound=Callable[..., Any])


def no_loss_term(hook: _F) -> _F:
    """Mark a base class's ``loss_term`` as the no-op default, so :func:`adds_loss_term` can tell an override."""
    setattr(hook, _NO_LOSS_TERM, True)
    return hook


def adds_loss_term(obj: object) -> bool:
    """Whether ``obj``'s class has a ``loss_term`` other than a default marked by :func:`no_loss_term`
    (duck typing: the engine needs no callback base class to ask)."""
    hook = getattr(type(obj), "loss_term", None)
    return hook is not None and not getattr(hook, _NO_LOSS_TERM, False)


@dataclass(frozen=True)
class LiveStep:
    """The local step a loss term is asked for: round, client, the phase that trains, Lightning's batch index."""

    round: int
    client: int
    phase: Part
    batch_idx: int
    """Lightning's batch index of the step."""


@dataclass(frozen=True)
class VectorizedLossTerm:
    """A callback's loss term as a pure function of one client's tensors, applied by the vectorized engine.

    The engine calls it inside its ``torch.func.vmap`` over a lockstep step's clients, once per client
    and step, right after the client's loss on its batch::

        fn(tensors, features, mask, client, phase) -> Tensor | None

    * ``tensors``: the client's module tensors by full name (``dict[str, Tensor]``): its own trainable
      ones (those the phase trains carry gradients) and the fixed ones (buffers, frozen parameters);
    * ``features``: the head's input for the client's batch (``[batch, ...]``, padding rows included),
      or ``None`` when ``needs_features`` is ``False``;
    * ``mask``: ``[batch]``, ``1`` for real rows and ``0`` for padding; padding rows must not contribute;
    * ``client``: the client id as a 0-dim integer tensor (batched under ``vmap``): index per-client
      tables with it (``table[client]`` or ``torch.index_select(table, 0, client.reshape(1))``), never
      turn it into a Python number;
    * ``phase``: the segment's phase (``"head"``, ``"body"``, ``"all"``), a Python string, the same for
      every client of the call (Python branches on it are fine).

    It returns a scalar added to the client's loss (exactly what :meth:`FederatedCallback.loss_term`
    adds on the sequential path), or ``None`` to add nothing. Under ``vmap`` it must avoid Python
    control flow on tensor values (``if t > 0``, ``.item()``, ``.tolist()``) and in-place updates of
    its inputs. Clients that do not step are masked out by the engine.

    ``needs_features=True`` makes the engine compute each client's output as
    ``head(features(x))`` with the module's feature split (so the features exist); a run whose module
    has no feature split (``forward_features``/``forward_head``, or a head module called last) then
    stays sequential (``engine="auto"``) or is refused (``engine="vectorized"``). With
    ``needs_features=False`` the module's ``forward`` runs as usual. ``features_of`` names the
    submodule whose *input* the term means by ``features``: the engine checks on a probe batch that
    the split's features are exactly that input, and otherwise treats the run as above.
    """

    fn: Callable[[dict[str, Tensor], Tensor | None, Tensor, Tensor, str], Tensor | None]
    needs_features: bool = True
    features_of: str | None = None

    def __call__(
        self, tensors: dict[str, Tensor], features: Tensor | None, mask: Tensor, client: Tensor, phase: str
    ) -> Tensor | None:
        return self.fn(tensors, features, mask, client, phase)
