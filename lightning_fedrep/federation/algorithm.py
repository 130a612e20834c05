"""The server side of the Algorithm API v2: declared tensors, what a client hands back, the server state.

An algorithm declares extra per-client tensors (:class:`ClientTensors`, e.g. SCAFFOLD's control variate
``c_i``) and server tensors (:class:`ServerTensors`, e.g. SCAFFOLD's ``c`` or a server momentum) as the
class attributes ``Algorithm.client_tensors`` / ``Algorithm.server_tensors``. The federation keeps the
client tensors in the client store (stacked like the local part, a template for clients that never
trained) and the server tensors in its state; both are checkpointed (version 3), rolled back with an
interrupted round, and lent/gathered between processes with the client's record.

After a client's last local step the federation calls ``Algorithm.finish_client(ClientEnd)``, which returns
a :class:`ClientOutcome` (what the aggregator receives, the client's new declared tensors, per-client
metrics). At the round's close a v2 ``Algorithm.aggregate(server, results, failures)`` receives the
:class:`ServerState` and the :class:`RoundResults` and returns the new server state and metrics for the
round's history row. No Lightning here (the core).
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_fedrep.federation.aggregation import Aggregator, ClientUpdate

__all__ = [
    "ClientEnd",
    "ClientMap",
    "ClientOutcome",
    "ClientTensors",
    "EvaluationSpec",
    "RoundResults",
    "ScoredForward",
    "ServerState",
    "ServerTensors",
    "declared_names",
    "declared_templates",
    "evaluation_spec",
    "scored_tensors",
    "scoring_forward",
    "uses_results",
]

Init = Literal["zeros", "module"] | Callable[[str, Tensor, torch.Generator], Tensor]
"""``"zeros"``, the module's values at fit start (only with ``like``), or a callable
``init(name, template, generator) -> Tensor`` (see :class:`ClientTensors`)."""
Shapes = Mapping[str, tuple[int, ...]] | tuple[int, ...]
ShapesOf = Callable[[Mapping[str, Mapping[str, tuple[int, ...]]]], Shapes]
"""``shapes(groups) -> shapes``: ``groups`` maps each group (``"shared"``, ``"local"``, ``"model"``, ``"body"``,
``"head"``) to its tensors' shapes by name."""


@dataclass(frozen=True)
class ClientTensors:
    """Extra per-client tensors, shaped like a group's tensors (``like``) or given explicitly (``shapes``).

    ``like`` is ``"shared"`` (the tensors the server aggregates), ``"local"`` (those each client keeps),
    ``"model"`` (both: a per-client slot a ``Phase(slot=name)`` can train, Ditto's ``"personal"``),
    ``"body"`` or ``"head"``: one tensor ``"<name>.<tensor name>"`` per tensor of it. ``shapes`` is a
    tuple (one tensor named ``name``) or a mapping ``key -> shape`` (tensors ``"<name>.<key>"``), or a
    callable ``shapes(groups)`` returning one of those from the groups' shapes (FedCP's policy network,
    sized by the head's input).

    ``init``: ``"zeros"``, ``"module"`` (a copy of the ``like`` tensor at fit start), or a callable
    ``init(name, template, generator) -> Tensor`` run once per tensor when the federation first snapshots
    its state (fit start, after Lightning's seeding; a resumed run loads the checkpoint instead):
    ``template`` is the tensor's zeros (the ``like`` tensor's values with ``like=``), ``generator`` a CPU
    ``torch.Generator`` seeded from the strategy's ``seed`` and ``name``, so every process and every run with
    the same seed draws the same values (a random initialization, FedCP's ``nn.Linear``-like policy network).
    """

    name: str
    like: str | None = None
    shapes: Shapes | ShapesOf | None = None
    init: Init = "zeros"
    dtype: torch.dtype | None = None
    """``None``: the dtype of the ``like`` tensors (float32 for ``shapes``)."""


@dataclass(frozen=True)
class ServerTensors(ClientTensors):
    """Extra server tensors (SCAFFOLD's ``c``, server momentum), held identically on every process."""


@dataclass(frozen=True)
class ClientEnd:
    """A client after its last local step of the round (views, not copies: valid during the call).

    ``start``/``end`` map the module's shared and local tensor names to their values at the start of the
    client's round and at the end of its work; ``client_state`` holds its declared client tensors as they
    were before the round, ``server`` the declared server tensors; ``lr`` is the first optimizer's first
    param group's learning rate (``None`` if unknown); ``slots`` the declared slots the client trained this
    round (``Phase(slot=...)``) at the end of its work, by ``"<slot>.<tensor name>"`` (stored with its
    declared tensors after ``finish_client``; ``{}`` when no phase trained a slot).
    """

    client: int
    round: int
    num_samples: int
    """The client's training samples."""
    steps: int
    """The local steps it ran this round."""
    lr: float | None
    start: Mapping[str, Tensor]
    end: Mapping[str, Tensor]
    client_state: Mapping[str, Tensor]
    server: Mapping[str, Tensor]
    shared_names: tuple[str, ...] = ()
    """The names of ``start``/``end`` the server shares (what :meth:`shared` returns)."""
    slots: Mapping[str, Tensor] = field(default_factory=dict)

    def shared(self) -> dict[str, Tensor]:
        """The end values of the shared tensors (what the default ``finish_client`` uploads)."""
        return {n: self.end[n] for n in self.shared_names}

    def tensors(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The end values of ``names``."""
        return {n: self.end[n] for n in names}


@dataclass(frozen=True)
class ClientOutcome:
    """What ``finish_client`` returns: the upload the aggregator receives (``ClientUpdate.upload``; its
    names must be those of ``Algorithm.aggregator``'s ``like``), new values of the client's declared tensors
    (those left out keep their values) and per-client metrics (their mean over the round's clients joins
    the round's history row under the same key)."""

    upload: Mapping[str, Tensor]
    client_state: Mapping[str, Tensor] = field(default_factory=dict)
    """New values of some of the client's declared tensors, by name."""
    metrics: Mapping[str, float] = field(default_factory=dict)


ClientMap = Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]]
"""``client_map(a client's declared tensors by name) -> new values of some of them`` (``ServerState``)."""


@dataclass(frozen=True)
class ServerState:
    """What the server holds between rounds: the global shared tensors and the declared server tensors,
    by name; ``num_clients`` is the federation's size. ``aggregate`` returns a new one (``replace``).

    ``client_map`` (returned by ``aggregate``, never stored): a server step that changes every client's
    declared tensors at once (L2GD's pull towards the average). It receives one client's declared tensors
    by name and returns new values of some of them (the others are kept); the federation applies it right
    after ``aggregate`` to every client it holds and to the template of those that never trained, on every
    process alike (so it must be a pure function of its input and of the server state), before evaluation
    or a checkpoint can see them.
    """

    shared: Mapping[str, Tensor]
    tensors: Mapping[str, Tensor]
    num_clients: int = 0
    client_map: ClientMap | None = None

    def replace(self, **changes: Any) -> ServerState:
        """A copy with ``changes`` (``shared=``, ``tensors=``: the names given replace those values)."""
        for key in ("shared", "tensors"):
            if key in changes:
                changes[key] = {**getattr(self, key), **changes[key]}
        return replace(self, **changes)


@dataclass(frozen=True)
class RoundResults:
    """The round as the server step sees it: the aggregator's reduction (``reduced``, its ``result()``),
    the aggregator itself (``Stacked`` holds every update), the surviving clients' ids, the total
    aggregation weight and the round's plan. Identical on every process."""

    reduced: Mapping[str, Tensor]
    aggregator: Aggregator
    clients: tuple[int, ...]
    weight: float
    plan: Any
    """The round's ``RoundPlan`` (typed loosely: the plan module imports the algorithms)."""

    @property
    def updates(self) -> list[ClientUpdate]:
        """Every client's update (only with an aggregator that keeps them, e.g. ``Stacked``)."""
        return list(getattr(self.aggregator, "updates", []))


def _names(spec: ClientTensors, groups: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor | tuple]:
    if (spec.like is None) == (spec.shapes is None):
        raise ValueError(f"{type(spec).__name__} {spec.name!r}: give exactly one of like= or shapes=.")
    if spec.like is not None:
        if spec.like not in groups:
            raise ValueError(
                f"{type(spec).__name__} {spec.name!r}: like={spec.like!r} is not a group; choose one of "
                f"{sorted(groups)}."
            )
        return {f"{spec.name}.{n}": t for n, t in groups[spec.like].items()}
    if spec.init == "module":
        raise ValueError(f"{type(spec).__name__} {spec.name!r}: init={spec.init!r} needs like=, not shapes=.")
    shapes = spec.shapes
    if callable(shapes):
        shapes = shapes(
            {g: {n: tuple(getattr(t, "shape", ())) for n, t in named.items()} for g, named in groups.items()}
        )
    if isinstance(shapes, Mapping):
        return {f"{spec.name}.{k}": tuple(s) for k, s in shapes.items()}
    return {spec.name: tuple(shapes)}


def _generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of a callable ``init``: seeded from the strategy's ``seed`` and the tensor's name."""
    return torch.Generator().manual_seed(
        ((seed & 0xFFFFFFFF) * 1_000_003 + zlib.crc32(name.encode())) % (2**61 - 1)
    )


def declared_templates(
    specs: Iterable[ClientTensors], groups: Mapping[str, Mapping[str, Tensor]], seed: int = 0
) -> dict[str, Tensor]:
    """The initial values of declared tensors by name, from ``groups`` (group name -> the module's tensors
    by name at fit start); ``seed`` (the strategy's) seeds a callable ``init``. A bad declaration is an error
    naming it."""
    out: dict[str, Tensor] = {}
    for spec in specs:
        if not callable(spec.init) and spec.init not in ("zeros", "module"):
            raise ValueError(
                f"{type(spec).__name__} {spec.name!r}: init must be 'zeros', 'module' or a callable "
                f"(name, template, generator) -> Tensor, got {spec.init!r}."
            )
        for name, like in _names(spec, groups).items():
            if name in out:
                raise ValueError(f"Two declared tensors are named {name!r}; give them different names.")
            if isinstance(like, Tensor):
                value = like.detach().clone() if spec.init != "zeros" else torch.zeros_like(like)
                value = value if spec.dtype is None else value.to(spec.dtype)
            else:
                value = torch.zeros(like, dtype=spec.dtype or torch.float32)
            out[name] = _initialized(spec, name, value, seed) if callable(spec.init) else value
    return out


def _initialized(spec: ClientTensors, name: str, template: Tensor, seed: int) -> Tensor:
    """A callable ``init``'s value of ``name``, checked to be a tensor of the template's shape."""
    value = spec.init(name, template, _generator(seed, name))  # type: ignore[operator]
    if not isinstance(value, Tensor) or value.shape != template.shape:
        raise ValueError(
            f"{type(spec).__name__} {spec.name!r}: init({name!r}, ...) must return a tensor of shape "
            f"{tuple(template.shape)}, got {getattr(value, 'shape', value)!r}."
        )
    return value.detach().to(template.device, template.dtype)


def declared_names(specs: Iterable[ClientTensors], groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The names of declared tensors (``groups``: group name -> tensor names as keys)."""
    return [name for spec in specs for name in _names(spec, groups)]


def uses_results(algorithm: Any) -> bool:
    """Whether ``algorithm.aggregate`` is the v2 server step ``(server, results, failures)`` rather than
    the v1 ``(global_state, average)`` (told apart by its parameter names)."""
    parameters = list(inspect.signature(algorithm.aggregate).parameters)
    return parameters[:2] == ["server", "results"]


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
