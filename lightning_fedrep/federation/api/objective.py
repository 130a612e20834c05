"""The local objective: one type for the loss terms and step transforms of algorithms and callbacks.

Both runners apply an :class:`Objective` at every local step, in this order::

    loss (the user's step, or the declared loss in lockstep) + every LossTerm
    -> backward -> every GradTransform -> the client's optimizer step -> every ParamTransform

A :class:`StepRule` (``Objective.step``) replaces "loss -> backward" by a program over the module's declared
pure loss (a meta/inner step, a mixing step): its gradients are set on the trained tensors, then the
transforms and the optimizer step run as above, and finally its ``client_state`` updates are written into the
client's declared per-client tensors. It needs the module's ``fedrep_loss``; the lockstep runner runs it per
client inside its ``vmap`` (``view.mask`` marks the real rows there), unless it says ``vmappable=False``.

A term or transform is a function of a :class:`StepView`. On the sequential runner its tensors are the live
module's; inside the lockstep runner's ``torch.func.vmap`` they are one client's slices, so one function
written with tensor ops runs on both. ``vmappable=False`` says it cannot run inside the ``vmap``:
``runner="auto"`` then runs sequentially (saying why, naming it) and ``runner="vectorized"`` is refused.
No Lightning here (the core).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.module.losses import (
    cross_entropy_per_sample,
    declared_loss,
    masked_mean,
    required_loss,
)
from lightning_fedrep.federation.module.stateless import stateless_call

__all__ = [
    "GradTransform",
    "LossTerm",
    "Objective",
    "ParamTransform",
    "PureLoss",
    "StepOutcome",
    "StepRule",
    "StepView",
    "cross_entropy_per_sample",
    "declared_loss",
    "masked_mean",
    "pure_loss",
    "refuse_removed_hooks",
    "required_loss",
]

_EMPTY: Mapping[str, Tensor] = {}


@dataclass(frozen=True)
class StepView:
    """One client's local step, as loss terms and transforms see it (read-only).

    Attributes:
        tensors: the client's module tensors by full name (parameters and buffers); those the phase
            trains carry gradients.
        trained: the subset of ``tensors`` the phase trains.
        server: the round-start global shared tensors by name, with the algorithm's declared server tensors
            (``Algorithm.server_tensors``), on both runners.
        client: the client index as a 0-dim integer tensor (batched under ``vmap``): index per-client
            tables with it (``table[client]``), never turn it into a Python number in a vmappable term.
        phase: the part the phase trains (``"head"``, ``"body"``, ``"all"``): Python branches on it are fine.
        round: the round index.
        step: the client's local step in the round on the sequential runner; in lockstep, its step in the
            phase (the lanes' steps in earlier phases may differ).
        client_step: the client's local step in the round, counted across its phases, on both runners: an
            ``int`` on the sequential runner, a 0-dim integer tensor in lockstep (batched under ``vmap``). Key
            per-step randomness with it (``lightning_fedrep.privacy.noise``).
        lr: the client's learning rate (the optimizer's first param group's, times the client's ``lr_scale``),
            or ``None`` if unknown; in lockstep, where the clients of one step have different ``lr_scale``, a
            0-dim tensor (batched under ``vmap``): use it in tensor arithmetic, not in a Python ``if``.
        features: the head's input on the batch when the term asks for it (``needs_features``), else ``None``.
        mask: ``[batch]``, 1 for real rows and 0 for padding (lockstep runner); ``None`` on the
            sequential runner, where every row is real.
        client_state: the client's declared per-client tensors (``Algorithm.client_tensors``; in lockstep
            its own row of the group's stack). ``finish_client`` updates them, and a :class:`StepRule` through
            its :class:`StepOutcome` ``client_state`` (after each step); never a term or transform.
        batch: the raw batch, as ``training_step`` received it, on the sequential runner (``None`` in
            lockstep): a term that reads it is ``vmappable=False``.
        batch_idx: Lightning's batch index on the sequential runner (``None`` in lockstep).
        slot: the slot the phase trains (``"model"``, or a per-client slot an algorithm declares, e.g.
            Ditto's ``"personal"``).
    """

    tensors: Mapping[str, Tensor]
    trained: Mapping[str, Tensor]
    server: Mapping[str, Tensor]
    client: Tensor
    phase: str
    round: int
    step: int
    lr: float | Tensor | None = None
    features: Tensor | None = None
    mask: Tensor | None = None
    client_state: Mapping[str, Tensor] = field(default_factory=lambda: _EMPTY)
    batch: Any = None
    batch_idx: int | None = None
    slot: str = "model"
    client_step: int | Tensor | None = None


@dataclass(frozen=True)
class LossTerm:
    """A scalar added to the client's loss at every step of the phases it applies to.

    Args:
        fn: ``fn(view) -> Tensor | None`` (``None`` adds nothing). If vmappable: tensor ops only, no
            ``.item()`` or Python ``if`` on tensor values, no in-place updates of the view's tensors.
        name: names the term in the runner report and in errors.
        vmappable: ``False`` makes ``runner="auto"`` run sequentially (and ``"vectorized"`` refuse).
        needs_features: the term reads ``view.features`` (the lockstep runner then runs the module as
            ``head(features(x))``, and needs such a split; the sequential runner captures the input of
            ``features_of``).
        features_of: the submodule whose input ``features`` means (required with ``needs_features``).
        phases: the phase parts it applies to (``None``: every phase).
    """

    fn: Callable[[StepView], Tensor | None]
    name: str
    vmappable: bool = True
    needs_features: bool = False
    features_of: str | None = None
    phases: frozenset[str] | None = None

    def applies(self, phase: str) -> bool:
        """Whether the term is added in a phase training ``phase``."""
        return self.phases is None or phase in self.phases


@dataclass(frozen=True)
class GradTransform:
    """Maps the client's gradients (of its trained tensors, by name) before its optimizer step."""

    fn: Callable[[Mapping[str, Tensor], StepView], Mapping[str, Tensor]]
    """``fn(grads, view) -> grads``: the new gradients by name (a name left out keeps its gradient)."""
    name: str
    """The transform's name in reports and errors."""
    vmappable: bool = True
    """Whether ``fn`` runs inside the lockstep runner's ``vmap`` (``False`` keeps ``runner="auto"`` sequential)."""


@dataclass(frozen=True)
class ParamTransform:
    """Maps the client's trained tensors (by name) after its optimizer step, without grad."""

    fn: Callable[[Mapping[str, Tensor], StepView], Mapping[str, Tensor]]
    """``fn(tensors, view) -> tensors``: the new trained tensors by name (a name left out keeps its value)."""
    name: str
    """The transform's name in reports and errors."""
    vmappable: bool = True
    """Whether ``fn`` runs inside the lockstep runner's ``vmap`` (``False`` keeps ``runner="auto"`` sequential)."""


PureLoss = Callable[[Mapping[str, Tensor], Tensor, Tensor, "Tensor | None"], Tensor]
"""``loss(tensors, x, y, mask) -> scalar``: the module run functionally on ``tensors`` (any it lacks are the
module's own), its declared per-sample loss averaged over the real rows (``mask``: 1 real, 0 padding;
``None``: every row)."""


def pure_loss(module: torch.nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> PureLoss:
    """The ``PureLoss`` of ``module`` with its declared per-sample loss ``loss_fn`` (``fedrep_loss``)."""

    forward = stateless_call(module)

    def loss(tensors: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        return masked_mean(loss_fn(forward(tensors, x), y), mask)

    return loss


@dataclass(frozen=True)
class StepOutcome:
    """What a :class:`StepRule` computed for one local step.

    Attributes:
        grads: the gradient of each trained tensor it moves, by name (a trained tensor it leaves out gets no
            gradient: the optimizer skips it).
        loss: the step's loss, what the runner logs as ``train/loss``.
        client_state: new values of some of the client's declared tensors (``Algorithm.client_tensors``), by
            full name (``"personal.fc.weight"``), written after the optimizer step and the transforms.
    """

    grads: Mapping[str, Tensor]
    loss: Tensor
    client_state: Mapping[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRule:
    """Replaces "loss of the batch -> backward" of a local step by a program over the declared pure loss.

    Args:
        fn: ``fn(loss, view, x, y) -> StepOutcome``: ``loss`` is the module's ``PureLoss``, ``view`` the
            step's :class:`StepView` (its tensors detached: differentiate with ``torch.func.grad``), ``(x, y)``
            the step's batch. The user's ``training_step`` does not run.
        name: names the rule in the runner report and in errors.
        vmappable: ``True``: ``fn`` uses tensor ops only (as a vmappable :class:`LossTerm`) and reads the real
            rows from ``view.mask`` (``None`` on the sequential runner: every row is real; in lockstep the
            batch is zero-padded), so the lockstep runner runs it per client inside its ``vmap``. ``False``:
            ``runner="auto"`` runs sequentially (saying why, naming the rule), ``"vectorized"`` refuses.

    The runner sets the trained tensors' gradients to ``grads``, runs the gradient transforms, the client's
    optimizer step (momentum, weight decay apply), the parameter transforms, then writes ``client_state``.
    Needs the module's ``fedrep_loss`` (refused at setup without it), and no loss terms beside it.
    """

    fn: Callable[[PureLoss, StepView, Tensor, Tensor], StepOutcome]
    name: str
    vmappable: bool = True


@dataclass(frozen=True)
class Objective:
    """What a client's local step adds to the plain loss-and-optimizer step (see the module docstring).

    ``step``: a :class:`StepRule` replacing the loss and backward (at most one per phase: an algorithm's and a
    callback's cannot be combined).
    """

    terms: tuple[LossTerm, ...] = ()
    """Scalars added to every local step's loss."""
    grad_transforms: tuple[GradTransform, ...] = ()
    """Maps of the gradients before the optimizer step, in order."""
    param_transforms: tuple[ParamTransform, ...] = ()
    """Maps of the trained tensors after the optimizer step, in order."""
    step: StepRule | None = None

    def __post_init__(self) -> None:
        if self.step is not None and not isinstance(self.step, StepRule):
            raise TypeError(f"Objective.step must be a StepRule or None, got {self.step!r}.")
        for kind, items, cls in (
            ("terms", self.terms, LossTerm),
            ("grad_transforms", self.grad_transforms, GradTransform),
            ("param_transforms", self.param_transforms, ParamTransform),
        ):
            if not isinstance(items, tuple) or not all(isinstance(i, cls) for i in items):
                raise TypeError(f"Objective.{kind} must be a tuple of {cls.__name__}, got {items!r}.")
            for item in items:
                if isinstance(item, LossTerm) and item.needs_features and not item.features_of:
                    raise ValueError(
                        f"LossTerm {item.name!r} sets needs_features=True without features_of: name the "
                        "submodule whose input the features are (e.g. features_of='classifier')."
                    )

    def __add__(self, other: Objective) -> Objective:
        if self.step is not None and other.step is not None:
            raise ValueError(
                f"Two step rules for one local step: {self.step.name!r} and {other.step.name!r}; a step "
                "computes the gradients once, so at most one objective (the algorithm's or one callback's) may "
                "set Objective.step."
            )
        return Objective(
            self.terms + other.terms,
            self.grad_transforms + other.grad_transforms,
            self.param_transforms + other.param_transforms,
            self.step if self.step is not None else other.step,
        )

    def for_phase(self, phase: str) -> Objective:
        """Only the terms that apply to ``phase``."""
        return Objective(
            tuple(t for t in self.terms if t.applies(phase)),
            self.grad_transforms,
            self.param_transforms,
            self.step,
        )

    @property
    def empty(self) -> bool:
        return not (self.terms or self.grad_transforms or self.param_transforms or self.step)

    @property
    def needs_features(self) -> bool:
        return any(t.needs_features for t in self.terms)

    def not_vmappable(self) -> list[str]:
        """The names of the terms and transforms that cannot run inside the lockstep runner's ``vmap``."""
        items = (*self.terms, *self.grad_transforms, *self.param_transforms)
        return [i.name for i in items if not i.vmappable]


_PORT = 'def objective(self, phase): return Objective(terms=(LossTerm(lambda view: <the term>, "<name>"),))'
"""The one-line shape of a loss term declared through ``objective``, shown in the refusals below."""

_REMOVED_HOOKS: dict[tuple[str, str], str] = {
    ("Algorithm", "loss_term"): (
        "{cls}.loss_term(module, global_state) is a removed hook: nothing calls it, so its term would be "
        "silently left out of the loss. Port it to Algorithm.objective(phase), which both runners run:\n    {port}\n"
        "where the term reads view.tensors (the client's tensors by name; view.trained: those the phase trains) "
        "instead of the module's parameters, and view.server instead of global_state."
    ),
    ("FederatedCallback", "loss_term"): (
        "{cls}.loss_term(trainer, pl_module, batch, step) is a removed hook: nothing calls it, so its term "
        "would be silently left out of the loss. Port it to FederatedCallback.objective(phase), which both "
        "runners run:\n    {port}\nwhere the term reads view.tensors instead of pl_module's parameters, "
        "view.client, view.phase, view.round and view.batch_idx instead of step, and view.batch instead of batch "
        "(a term that reads the batch is LossTerm(..., vmappable=False)); keep what it needs of the trainer in "
        "setup(trainer, pl_module, stage), which runs before objective."
    ),
    ("FederatedCallback", "vectorized_loss_term"): (
        "{cls}.vectorized_loss_term(trainer, pl_module) is a removed hook: nothing calls it, so its term would "
        "be silently left out of the loss. Port it (with its loss_term) to FederatedCallback.objective(phase), "
        "one function of the step's view that both runners run:\n    {port}\nwhere fn(tensors, features, "
        "mask, client, phase) reads view.tensors, view.features (with LossTerm(..., needs_features=True, "
        "features_of='<the submodule whose input they are>')), view.mask (None on the sequential runner), "
        "view.client and view.phase."
    ),
}


_CALLBACK_OBJECTIVE = (
    " The callback hook objective(trainer, pl_module, phase) lost its first two arguments: keep what it needs of "
    "them in setup(trainer, pl_module, stage), which runs before it."
)


def refuse_removed_hooks(owner: object, kind: str) -> None:
    """Refuse ``owner``, an algorithm (``kind="Algorithm"``) or a federated callback (``"FederatedCallback"``),
    whose class still defines a hook of the removed loss-term route (``loss_term``, ``vectorized_loss_term``) or
    an ``objective`` that does not take ``(phase)``: the runners would never call it, and the run would train
    without its term. Runs when an algorithm is constructed and when the strategy's ``setup`` takes the
    callbacks; the ``TypeError`` names the hook and shows its port to ``objective(phase)``."""
    cls = type(owner)
    for hook in ("loss_term", "vectorized_loss_term"):
        message = _REMOVED_HOOKS.get((kind, hook))
        if message is not None and callable(getattr(cls, hook, None)):
            raise TypeError(message.format(cls=cls.__name__, port=_PORT))
    objective = getattr(owner, "objective", None)
    if objective is not None and not _takes_phase(objective):
        raise TypeError(
            f"{cls.__name__}.objective must take one argument, objective(phase) -> Objective (as "
            f"Algorithm.objective and FederatedCallback.objective do), got {cls.__name__}.objective"
            f"{inspect.signature(objective)}." + (_CALLBACK_OBJECTIVE if kind == "FederatedCallback" else "")
        )


def _takes_phase(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` (a bound ``objective``) can be called as ``hook(phase)``."""
    try:
        inspect.signature(hook).bind("all")
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): it is called as documented
        return True
    return True
