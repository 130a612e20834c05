"""The FedRep family as objects: what each algorithm shares, its local phases, how a round aggregates.

The strategy never checks an algorithm's name. It asks the algorithm object:

* ``shares`` — which groups of the body/head split the server averages (``{"body"}`` for FedRep and
  FedPer, ``{"head"}`` for LG-FedAvg, both for FedAvg, none for Local Only); everything else stays on
  the client;
* :meth:`Algorithm.default_phases` — the local work when only the epoch shorthands are given;
* :meth:`Algorithm.aggregator` — what reduces the round's per-client updates (a streaming
  ``WeightedMean`` by default; ``Stacked`` keeps every client's update, for median or trimmed mean);
* :meth:`Algorithm.aggregate` — the server step: the new server state from the round's results;
* :meth:`Algorithm.with_server_optimizer` — the same algorithm with a server optimizer (FedAdam, ...) stepping
  from what ``aggregate`` returns;
* :meth:`Algorithm.objective` — the local objective of a phase: loss terms added to every local
  training loss (e.g. FedProx's proximal term) and step transforms (``federation.objective``);
* :meth:`Algorithm.keep_local` — tensors every client keeps whatever ``shares`` says (FedBN's BatchNorm layers);
* :meth:`Algorithm.state_dict` — server state the algorithm keeps across rounds (saved in checkpoints).

A new algorithm is a subclass (or an instance) passed as ``FederatedStrategy(algorithm=...)``, or
registered by name with :func:`~.registry.register_algorithm`; the strategy needs no change. The built-ins (FedRep,
FedPer, LG-FedAvg, FedAvg, Local Only) are such subclasses, one module each in
:mod:`lightning_fedrep.federation.algorithms`, registered by ``import lightning_fedrep``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from lightning_fedrep.federation.api.aggregation import Aggregator, ClientFault, WeightedMean
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import (
    ClientEnd,
    ClientOutcome,
    ClientStart,
    RoundResults,
    ServerState,
    StartOutcome,
)
from lightning_fedrep.federation.api.objective import Objective, refuse_removed_hooks
from lightning_fedrep.federation.api.scoring import EvaluationSpec
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer
from lightning_fedrep.federation.module.split import ParameterSplit

Part = Literal["head", "body", "all"]
"""What trains in a local phase: the head, the body, or both."""

Group = Literal["head", "body"]
"""A group of the body/head split."""

PART_GROUPS: dict[str, tuple[Group, ...]] = {"head": ("head",), "body": ("body",), "all": ("head", "body")}
"""The split groups each phase part trains."""


@dataclass(frozen=True)
class Phase:
    """One stage of a client's local work: which part trains, for how many epochs or steps.

    Exactly one of ``epochs`` (passes over the client's training data, turned into a step count
    per client when the round is planned) or ``steps`` (optimizer steps) is given. ``slot`` names the
    values the phase trains: ``"model"`` (the global shared part and the client's local part), or a
    per-client copy of the whole model the algorithm declares as ``ClientTensors(slot, like="model",
    init="module")`` (Ditto's ``"personal"``), made live for the phase and stored back at its end.
    """

    train: Part
    """The part that trains: ``"head"``, ``"body"`` or ``"all"``."""
    epochs: int | None = None
    steps: int | None = None
    slot: str = "model"

    def __post_init__(self) -> None:
        if self.train not in PART_GROUPS:
            raise ValueError(f"Phase.train must be 'head', 'body' or 'all', got {self.train!r}.")
        if (self.epochs is None) == (self.steps is None):
            raise ValueError(f"Give a phase exactly one of epochs= or steps=, got {self!r}.")
        if not isinstance(self.slot, str) or not self.slot:
            raise ValueError(f"Phase.slot must be a slot name such as 'model', got {self.slot!r}.")
        budget = self.epochs if self.epochs is not None else self.steps
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"A phase's epochs/steps must be a non-negative integer, got {budget!r}.")

    def __repr__(self) -> str:  # the slot only when it is not "model": checkpoints fingerprint this text
        slot = "" if self.slot == "model" else f", slot={self.slot!r}"
        return f"Phase(train={self.train!r}, epochs={self.epochs!r}, steps={self.steps!r}{slot})"

    def num_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of this phase for a client with ``steps_per_epoch`` batches per epoch."""
        return self.steps if self.steps is not None else self.epochs * steps_per_epoch


def parse_phases(phases: Sequence[Phase | dict]) -> tuple[Phase, ...]:
    """Accept phases as ``Phase`` objects or as dicts (the form YAML recipes give)."""
    if isinstance(phases, str | dict) or not isinstance(phases, Sequence):
        raise TypeError(
            f"phases must be a list of Phase objects or dicts, got {type(phases).__name__} ({phases!r})."
        )
    parsed = []
    for index, phase in enumerate(phases):
        if isinstance(phase, Phase):
            parsed.append(phase)
            continue
        if not isinstance(phase, dict):
            raise TypeError(
                f"phases[{index}] must be a Phase or a dict such as {{'train': 'head', 'epochs': 10}}, got {phase!r}."
            )
        try:
            parsed.append(Phase(**phase))
        except (TypeError, ValueError) as error:
            raise type(error)(f"phases[{index}]: {error}") from None
    parsed = tuple(parsed)
    if not parsed:
        raise ValueError("phases must name at least one phase, e.g. [{'train': 'all', 'epochs': 1}].")
    return parsed


EPOCH_SHORTHANDS = ("head_epochs", "body_epochs", "local_epochs")
"""The strategy's epoch shorthands an algorithm may declare in :attr:`Algorithm.epochs`."""


def _check_epochs(cls: type[Algorithm]) -> None:
    """Refuse ``cls.epochs`` naming something other than the epoch shorthands, or a ``default_phases`` that
    does not take the declared shorthands by name (it is called with those and no others)."""
    declared, where = cls.epochs, f"{cls.__name__}.epochs"
    if isinstance(declared, str) or not isinstance(declared, tuple):
        raise TypeError(
            f"{where} must be a tuple of epoch shorthands such as ('local_epochs',), got {declared!r}."
        )
    unknown = [n for n in declared if n not in EPOCH_SHORTHANDS]
    if unknown:
        raise ValueError(
            f"{where} = {declared!r}: {unknown[0]!r} is not an epoch shorthand; declare some of {EPOCH_SHORTHANDS}."
        )
    if len(set(declared)) != len(declared):
        raise ValueError(f"{where} = {declared!r} names a shorthand twice: name each at most once.")
    parameters = list(inspect.signature(cls.default_phases).parameters.values())[1:]  # after self
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    takes = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in parameters if p.default is p.empty and p.kind is not p.VAR_POSITIONAL}
    if not set(declared) <= takes or not required <= set(declared):
        signature = ", ".join(["self", *(p.name for p in parameters)])
        raise TypeError(
            f"{cls.__name__}.default_phases({signature}) is called with the epoch shorthands {where} declares, "
            f"by name: {declared!r}. Make the two agree, e.g. epochs = ('head_epochs', 'body_epochs') with "
            "def default_phases(self, head_epochs, body_epochs)."
        )


class Algorithm:
    """A federated algorithm of the FedRep family: what the server averages and how clients train.

    The base class is FedAvg-shaped: every phase trains jointly for ``local_epochs``, and the server
    replaces the shared part by the (sample-weighted) mean of the participants'. Subclasses override
    the methods below; the strategy calls them and nothing else.

    Args:
        name: the algorithm's name (also its registered strategy name).
        shares: the split groups the server averages: ``"body"``, ``"head"``, both, or none.
        description: one line for ``StrategyRegistry`` and the CLI.
    """

    def __init__(self, name: str, shares: Iterable[Group], description: str):
        groups = frozenset(shares)
        unknown = groups - {"body", "head"}
        if unknown:
            raise ValueError(f"Algorithm shares must be among 'body' and 'head', got {sorted(unknown)}.")
        self.name = name
        self.shares: frozenset[Group] = groups
        self.description = description
        refuse_removed_hooks(self, "Algorithm")
        _refuse_v1_aggregate(self)

    @property
    def needs_split(self) -> bool:
        """Whether the algorithm must know which parameters are the head (it shares one group only)."""
        return len(self.shares) == 1

    epochs: tuple[str, ...] = ("local_epochs",)
    """The strategy's epoch shorthands :meth:`default_phases` reads, among ``"head_epochs"``, ``"body_epochs"``
    and ``"local_epochs"`` (FedRep: ``("head_epochs", "body_epochs")``). The strategy passes exactly these, by
    name, and refuses any other set away from its default (it would change nothing). Checked when the class is
    defined."""

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """Local phases when the user gives only the epoch shorthands (called at construction), from the
        shorthands :attr:`epochs` declares, by name: the default trains everything for ``local_epochs``."""
        return (Phase("all", epochs=local_epochs),)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_epochs(cls)

    def aggregator(self, like: Mapping[str, Tensor]) -> Aggregator:
        """A new aggregator for an aggregating round (called when the round opens, and when a mid-round
        checkpoint is resumed). ``like`` maps the shared tensor names to the round's starting global values.

        The default is the streaming ``WeightedMean`` (float64 weighted sums). Return
        ``Stacked(like)`` to receive every client's update in :meth:`aggregate` (``results.updates``,
        ``results.aggregator.stacked()``): coordinate-wise median, trimmed mean, FedNova, as user code.
        """
        return WeightedMean(like)

    def aggregate(
        self, server: ServerState, results: RoundResults, failures: Sequence[ClientFault]
    ) -> tuple[ServerState, dict[str, float]]:
        """The server step: the new server state at the end of a round, and metrics for the round's history row.

        Called once per aggregating round in which at least one client survived, at the round's close, on
        every process alike (after the processes' updates are combined), so it must be a pure function of
        its arguments and of the algorithm's own state.

        ``server`` is the :class:`~.exchange.ServerState` the round started from: ``server.shared`` the
        global shared tensors by name, ``server.tensors`` the declared server tensors
        (:attr:`server_tensors`), ``server.num_clients`` the federation's size. ``results`` is the round's
        :class:`~.exchange.RoundResults`: ``results.reduced`` maps each name the :meth:`aggregator`
        received to its reduction (with the default ``WeightedMean``, the participants' mean weighted by
        their training samples, or uniform, summed in float64 and cast to the tensor's dtype),
        ``results.aggregator`` the aggregator itself (``Stacked``: every update), ``results.clients`` the
        surviving clients, ``results.weight`` their total aggregation weight, ``results.plan`` the round's
        plan. ``failures`` holds a ``ClientFault`` for each client left out of the round (non-finite values,
        an error), in plan order; none of them is in ``results``.

        Return ``(server.replace(shared=..., tensors=...), metrics)``: every shared and declared server
        tensor by name (``replace`` keeps those not given), optionally a ``client_map``
        (:class:`~.exchange.ServerState`), and a dict of floats joined to the round's history row (``{}``
        for none). The default is FedAvg's server step: the shared tensors become the aggregator's
        reduction (the weighted mean), the server tensors stay, no metrics.
        """
        return server.replace(shared={n: results.reduced[n] for n in server.shared}), {}

    def configure_round(self, plan: Any, server: ServerState) -> Any:
        """The round's plan as the algorithm wants it: which clients, which phases, per-client settings.
        ``plan`` and the return value are :class:`~lightning_fedrep.federation.plan.RoundPlan` (typed loosely: the
        plan module imports this one).

        Called once per round when it is first planned, on every process, before the federated
        callbacks' ``configure_round``; return ``plan`` or ``plan.replace(clients=..., phases=...,
        settings={client: {"lr_scale": 0.5}})``. ``server`` is a read-only copy of the server state the
        round starts from (``server.shared``: the global shared tensors, ``server.tensors``: the declared
        server tensors, ``server.num_clients``). Draw only from ``plan.generator(key)`` (seeded from the
        strategy's seed, the round and ``key``), never the global RNG, so every process plans alike and a
        resumed run repeats the plan. The default returns ``plan`` unchanged.
        """
        return plan

    def objective(self, phase: str) -> Objective:
        """The local objective of a phase training ``phase`` (``"head"``, ``"body"``, ``"all"``): loss terms
        and step transforms (``lightning_fedrep.federation.api.objective``), run by both runners where they
        are vmappable. Called once per fit and phase part, at ``setup`` (after :meth:`setup`). The default adds
        nothing."""
        return Objective()

    client_tensors: tuple[ClientTensors, ...] = ()
    """Extra per-client tensors the algorithm keeps (e.g. SCAFFOLD's control variates): stored, checkpointed,
    rolled back and moved between processes with the client; :meth:`finish_client` updates them."""

    server_tensors: tuple[ServerTensors, ...] = ()
    """Extra server tensors (e.g. server momentum); :meth:`aggregate` reads and replaces them."""

    evaluation_slot: str | None = None
    """``None``: evaluation scores each client's model (global shared part + its local part); a slot name
    (a ``ClientTensors(name, like="model")``, e.g. Ditto's ``"personal"``): it scores that slot."""

    def evaluation(self) -> EvaluationSpec:
        """What evaluation scores for each client (:class:`~lightning_fedrep.EvaluationSpec`: the personal
        model, the global one, a slot, a mixture; optionally adapted first). Asked once, at ``setup``. The
        default scores ``evaluation_slot`` where it is set, else each client's personal model."""
        if self.evaluation_slot is not None:
            return EvaluationSpec("slot", slot=self.evaluation_slot)
        return EvaluationSpec()

    def start_client(self, start: ClientStart) -> StartOutcome:
        """Before a client's first local step of an aggregating round, once its tensors are live: new starting
        values of some of its shared and local tensors, new values of some of its declared client tensors
        (FedALA's blend of its stored model with the global one, per-client state set up at a first
        participation, FedDBE; an alignment before training, FedAS). The default changes nothing, and is not
        called at all when a class does not override it.

        Called once per client and round, on the process that holds the client, on both runners (the lockstep
        runner calls it for every client of a group before the group's first step, the sequential runner when
        the client is loaded): make it a function of ``start`` and of the algorithm's own settings, not of the
        clients finished earlier in the round. What it changes is undone with the client when the client is
        left out of the round or the round is rolled back; a round resumed from a mid-round checkpoint does not
        call it again for a client that had started. ``ClientEnd.start`` then holds the values it returned.
        ``start.data`` reads the client's training samples
        (:class:`~lightning_fedrep.federation.api.exchange.ClientSamples`).
        """
        return StartOutcome()

    def finish_client(self, end: ClientEnd) -> ClientOutcome:
        """After a client's last local step of a round: what it uploads to the aggregator, its new declared
        client tensors, its metrics (called once per client that trained with finite values). The default
        uploads the shared tensors' end values and leaves the client tensors as they are; the uploads reach
        :meth:`aggregate` through the round's :meth:`aggregator`.
        """
        return ClientOutcome(upload=end.shared())

    def keep_local(self, module: nn.Module) -> Collection[str]:
        """Names of ``module``'s tensors (parameters and buffers) every client keeps to itself whatever
        ``shares`` and the strategy's ``buffers=`` say: never uploaded nor averaged, trained, stored,
        checkpointed and scored per client like the local part of the split (FedBN's BatchNorm layers, chosen
        by module type). Called when the strategy resolves the module's layout (when it connects to the
        module, and at ``setup``), before :meth:`setup`; must depend on the module only. A name that is not a
        trainable parameter or buffer of the module is refused there. The default keeps nothing more."""
        return ()

    def setup(self, module: nn.Module, split: ParameterSplit, datamodule: Any) -> None:
        """Called at the strategy's ``setup`` (every stage, every process), once the head/body split is resolved
        and before any step: check the module (raise naming what to change) or read the data (``datamodule``:
        the Trainer's data module, or ``None``). The default does nothing; FedRoD checks its head and reads the
        clients' label counts here."""

    @property
    def server_optimizer(self) -> ServerOptimizer | None:
        """The server optimizer that steps after :meth:`aggregate` (``None``: none); set by
        :meth:`with_server_optimizer`."""
        return getattr(self, "_server_optimizer", None)

    def with_server_optimizer(
        self, optimizer: ServerOptimizer, name: str | None = None, description: str | None = None
    ) -> Algorithm:
        """A copy of this algorithm whose server step continues with ``optimizer`` (e.g. ``FedAdam()``): at
        each round's close the federation runs :meth:`aggregate`, then ``optimizer.step(server, new)``, which
        treats ``Δ = new.shared - server.shared`` (over the round's surviving clients) as a pseudo-gradient and
        steps the shared tensors from the round's start. The optimizer's state is added to
        :attr:`server_tensors` (checkpointed, mid-round too). Local work, uploads, evaluation and the
        aggregator are the algorithm's own, so it composes with every algorithm that shares something, and
        with ``privacy=ClientLevelDP(...)`` (it steps from the private mean).

        Args:
            optimizer: the :class:`~.server_optimizer.ServerOptimizer`.
            name: the copy's name (default ``"<name>_<optimizer.name>"``, e.g. ``"fedrep_fedadam"``).
            description: the copy's one-line description (default: this one's, naming the optimizer).
        """
        if not isinstance(optimizer, ServerOptimizer):
            raise TypeError(
                f"with_server_optimizer(optimizer=...) takes a ServerOptimizer such as FedAdam(), got "
                f"{type(optimizer).__name__} ({optimizer!r})."
            )
        if self.server_optimizer is not None:
            raise ValueError(
                f"{self.name!r} already steps with {self.server_optimizer!r}: attach one server optimizer, to the "
                "algorithm without one."
            )
        if not self.shares:
            raise ValueError(
                f"{self.name!r} shares nothing with the server, so a server optimizer has nothing to step: "
                "use an algorithm that shares the body, the head or both."
            )
        declared = tuple(optimizer.server_tensors())
        taken = {spec.name for spec in self.server_tensors} & {spec.name for spec in declared}
        if taken:
            raise ValueError(
                f"{optimizer!r} declares server tensors named {sorted(taken)}, which {self.name!r} declares too: "
                "rename the optimizer's."
            )
        copied = copy.deepcopy(self)
        copied.name = name if name is not None else f"{self.name}_{optimizer.name}"
        copied.description = description if description is not None else f"{self.description} + {optimizer!r}"
        copied.server_tensors = (*self.server_tensors, *declared)
        copied._server_optimizer = optimizer
        return copied

    def state_dict(self) -> dict[str, Any]:
        """Server state kept across rounds (e.g. server momentum); saved with the federation."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``, what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, shares={sorted(self.shares)})"


_V1_PORT = (
    "write aggregate(self, server, results, failures) -> (ServerState, metrics) instead; the default v1 "
    "body `return average.mean(global_state)` becomes `return server.replace(shared=results.reduced), {}` "
    "(global_state is list(server.shared.values()), average is results.aggregator, average.failures is "
    "failures; see Algorithm.aggregate's docstring)."
)


def _refuse_v1_aggregate(algorithm: Algorithm) -> None:
    """Refuse (``TypeError``, at construction) an ``aggregate`` override that cannot take the server step's
    three arguments ``(server, results, failures)``: the removed v1 ``(global_state, average)`` or a typo."""
    cls = type(algorithm)
    if cls.aggregate is Algorithm.aggregate:
        return
    signature = inspect.signature(algorithm.aggregate)
    try:
        signature.bind(None, None, None)
    except TypeError:
        parameters = ", ".join(signature.parameters)
        if list(signature.parameters)[:2] == ["global_state", "average"]:
            raise TypeError(
                f"{cls.__name__}.aggregate({parameters}) is the removed v1 server step: {_V1_PORT}"
            ) from None
        raise TypeError(
            f"{cls.__name__}.aggregate({parameters}) cannot take the server step's arguments (server, "
            f"results, failures): {_V1_PORT}"
        ) from None
