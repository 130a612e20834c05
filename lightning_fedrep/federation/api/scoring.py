"""What evaluation scores for each client (:class:`EvaluationSpec`, returned by ``Algorithm.evaluation()``):
the tensors of a client's scored model, and the ``forward`` it predicts with where the algorithm gives one.
No Lightning here (the core).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["EvaluationSpec", "ScoredForward", "evaluation_spec", "scored_tensors", "scoring_forward"]

Score = Literal["personal", "global", "slot", "mixture"]
SCORES: tuple[str, ...] = ("personal", "global", "slot", "mixture")
Mix = Callable[[Mapping[str, Tensor], Mapping[str, Tensor], int], Mapping[str, Tensor]]
"""``mix(global tensors, the client's slot tensors, client) -> the tensors evaluation scores``."""
Forward = Callable[..., Any]
"""``forward(module, client_state, server, *args, **kwargs) -> output`` (``EvaluationSpec.forward``)."""


@dataclass(frozen=True)
class EvaluationSpec:
    """What evaluation scores for each client (returned by ``Algorithm.evaluation()``).

    ``score``: ``"personal"`` (the global shared part with the client's local part; the default),
    ``"global"`` (the server's global model for every client: only for algorithms that share everything),
    ``"slot"`` (the client's declared slot ``slot``, a ``ClientTensors(slot, like="model")``: Ditto's
    ``"personal"``), or ``"mixture"`` (``mix(global, slot values, client)``, e.g. APFL's
    ``α·v + (1−α)·w``; ``global`` maps every model tensor name to the global shared part and the client's
    local part, ``slot values`` the same names to the client's slot ``slot``; tensors ``mix`` leaves out
    keep the ``global`` values). A mixture's slot may be any declared ``ClientTensors`` with ``like`` (FedRoD's
    ``like="head"``): ``slot values`` then holds only the names it covers.

    ``adapt``: before scoring, each evaluated client's scored model first trains on the client's own training
    data for this phase (``Phase("all", epochs=5)``: Per-FedAvg; ``Phase("all", steps=1)``: HF-MAML) with
    plain SGD (no momentum, no weight decay) at ``adapt_lr`` (``None``: the module optimizer's learning
    rate); the stored state does not change.

    ``forward``: how the scored model predicts, for algorithms whose prediction is not the module's own
    ``forward`` with some tensors (FedCP's policy network and global head). ``forward(module, client_state,
    server, *args, **kwargs)`` is called in place of ``module.forward(*args, **kwargs)`` wherever client ``c``'s
    model is scored or handed out (validation, test, ``trainer.predict``, ``strategy.client_model(c)``): the
    user's ``validation_step`` calling ``self(x)`` gets ``forward(module, client_state_c, server, x)``.
    ``module`` holds the tensors ``score`` selects for ``c`` (as without ``forward``); ``client_state`` is
    ``c``'s declared client tensors by name (``"<name>.<tensor>"`` / ``"<name>"``, as ``StepView.client_state``;
    the templates for a client that never trained), ``server`` the declared server tensors by name (as
    ``ServerState.tensors``); both are views: do not modify them. It must be a pure function of its inputs
    (no random numbers), and must not call ``module(...)`` or ``module.forward`` (that is itself): call the
    class's method, ``type(module).forward(module, x)``, or ``module.forward_features``/``forward_head``.
    A module-level function (or a picklable callable) keeps ``client_model(c)`` picklable. Not combined with
    ``adapt`` (refused here) nor with ``FineTunedEvaluation`` (refused at set-up); the lockstep runner
    evaluates such a spec per batch (``strategy.runner_report.evaluation`` says so).
    """

    score: Score = "personal"
    slot: str | None = None
    mix: Mix | None = None
    adapt: Any = None
    """A ``Phase`` (``lightning_fedrep.Phase``; typed loosely: the algorithms module imports this one)."""
    adapt_lr: float | None = None
    forward: Forward | None = None

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"EvaluationSpec.score must be one of {list(SCORES)}, got {self.score!r}.")
        if self.score in ("slot", "mixture"):
            if not isinstance(self.slot, str) or not self.slot or self.slot == "model":
                raise ValueError(
                    f"EvaluationSpec(score={self.score!r}) needs slot= naming a declared per-client slot "
                    f"(a ClientTensors(name, like='model')), got slot={self.slot!r}."
                )
        elif self.slot is not None:
            raise ValueError(
                f"EvaluationSpec.slot is read only by score='slot' or 'mixture', got slot={self.slot!r} with "
                f"score={self.score!r}; drop slot= or choose one of those scores."
            )
        if (self.score == "mixture") != (self.mix is not None):
            raise ValueError(
                "EvaluationSpec.mix is the mixture score='mixture' evaluates (and only it): give "
                f"mix=(global, slot, client) -> tensors with score='mixture', got score={self.score!r}, "
                f"mix={self.mix!r}."
            )
        if self.mix is not None and not callable(self.mix):
            raise TypeError(
                f"EvaluationSpec.mix must be a callable (global, slot, client) -> tensors, got {self.mix!r}."
            )
        self._check_adapt()
        self._check_forward()

    def _check_forward(self) -> None:
        if self.forward is None:
            return
        if not callable(self.forward):
            raise TypeError(
                "EvaluationSpec.forward must be a callable (module, client_state, server, *args, **kwargs) -> "
                f"output (the scored model's prediction) or None, got {self.forward!r}."
            )
        if self.adapt is not None:
            raise ValueError(
                "EvaluationSpec.forward and adapt= cannot be combined: the adaptation trains the module's own "
                f"forward, not forward={self.forward!r} with the declared tensors; drop adapt= (or forward=)."
            )

    def _check_adapt(self) -> None:
        if self.adapt is not None:
            if not all(hasattr(self.adapt, a) for a in ("train", "epochs", "steps", "slot", "num_steps")):
                raise TypeError(
                    f"EvaluationSpec.adapt must be a Phase (e.g. Phase('all', epochs=5)) or None, got {self.adapt!r}."
                )
            if self.adapt.slot != "model":
                raise ValueError(
                    f"EvaluationSpec.adapt trains the scored model itself; leave its slot at 'model', got "
                    f"slot={self.adapt.slot!r} (choose what is scored with score=/slot=)."
                )
        if self.adapt_lr is None:
            return
        if self.adapt is None:
            raise ValueError(
                f"EvaluationSpec.adapt_lr={self.adapt_lr!r} is the adaptation's learning rate, but adapt is None; "
                "give adapt=Phase(...) or drop adapt_lr."
            )
        if (
            isinstance(self.adapt_lr, bool)
            or not isinstance(self.adapt_lr, int | float)
            or not (math.isfinite(self.adapt_lr) and self.adapt_lr > 0)
        ):
            raise ValueError(
                f"EvaluationSpec.adapt_lr must be a positive finite number or None (the module optimizer's "
                f"learning rate), got {self.adapt_lr!r}."
            )


def evaluation_spec(algorithm: Any) -> EvaluationSpec:
    """``algorithm.evaluation()``, checked to be an :class:`EvaluationSpec` (an error naming the algorithm)."""
    spec = algorithm.evaluation()
    if not isinstance(spec, EvaluationSpec):
        raise TypeError(
            f"{type(algorithm).__name__}.evaluation() must return an EvaluationSpec, got {spec!r}."
        )
    return spec


@torch.no_grad()
def scored_tensors(
    spec: EvaluationSpec,
    client: int,
    global_tensors: Mapping[str, Tensor],
    personal: Mapping[str, Tensor],
    client_state: Callable[[], Mapping[str, Tensor]],
) -> dict[str, Tensor]:
    """The tensors that make ``client``'s scored model (before ``spec.adapt``), on top of the global shared
    part: ``{}`` for ``"global"``, ``personal`` (its local part) for ``"personal"``, the slot's values of
    every model tensor for ``"slot"``, ``spec.mix(...)`` for ``"mixture"``. ``client_state()`` gives the
    client's declared tensors (read only for the slot scores). Not copies for ``"personal"``/``"slot"``."""
    if spec.score == "personal":
        return dict(personal)
    if spec.score == "global":
        return {}
    model = {**global_tensors, **personal}
    state = client_state()
    slot = {
        n: state[f"{spec.slot}.{n}"] for n in model if f"{spec.slot}.{n}" in state
    }  # a mixture's may be partial
    if spec.score == "slot":
        return slot
    mixed = dict(spec.mix(model, slot, client))
    unknown = set(mixed) - set(model)
    if unknown:
        raise KeyError(
            f"EvaluationSpec.mix returned {sorted(unknown)}, which are not tensors of the model; it must return "
            f"some of {sorted(model)}."
        )
    return {**personal, **{n: t.detach() for n, t in mixed.items()}}


class ScoredForward:
    """A client's scored model's ``forward`` (``EvaluationSpec.forward``), set as the module's instance
    attribute ``forward``: calling it calls ``forward(module, client_state, server, *args, **kwargs)``.

    A plain picklable object (when ``forward`` is): ``copy.deepcopy`` and ``torch.save`` of a module holding
    one keep it. ``client_state`` and ``server`` are moved to the device of the module's first parameter at
    each call (nothing moves when they are there already), so a handed-out model may be moved with ``.to()``.
    """

    def __init__(
        self,
        forward: Forward,
        module: torch.nn.Module,
        client_state: Mapping[str, Tensor],
        server: Mapping[str, Tensor],
    ):
        self.forward = forward
        self.module = module
        self.client_state = dict(client_state)
        self.server = dict(server)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        parameter = next(self.module.parameters(), None)
        client_state, server = self.client_state, self.server
        if parameter is not None:
            device = parameter.device
            client_state = {n: t.to(device) for n, t in client_state.items()}
            server = {n: t.to(device) for n, t in server.items()}
        return self.forward(self.module, client_state, server, *args, **kwargs)

    def __repr__(self) -> str:
        return f"ScoredForward({self.forward!r}, client_state={sorted(self.client_state)}, server={sorted(self.server)})"


def set_forward(module: torch.nn.Module, forward: ScoredForward | None) -> Any:
    """Make ``forward`` the module's instance ``forward`` (``None``: remove it); returns what was there
    (a value for :func:`restore_forward`)."""
    previous = module.__dict__.get("forward", _ABSENT)
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = forward
    return previous


def restore_forward(module: torch.nn.Module, previous: Any) -> None:
    """Put back the instance ``forward`` :func:`set_forward` returned (or none, the class's method)."""
    if previous is _ABSENT:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = previous


_ABSENT = object()


@contextmanager
def scoring_forward(
    module: torch.nn.Module,
    spec: EvaluationSpec,
    client_state: Callable[[], Mapping[str, Tensor]],
    server: Mapping[str, Tensor],
) -> Iterator[None]:
    """While the block runs, ``module.forward`` is ``spec.forward`` for a client (``client_state()``: its
    declared tensors; ``server``: the declared server tensors); restored afterwards, also on an exception.
    Does nothing without ``spec.forward``."""
    if spec.forward is None:
        yield
        return
    previous = set_forward(module, ScoredForward(spec.forward, module, client_state(), server))
    try:
        yield
    finally:
        restore_forward(module, previous)
