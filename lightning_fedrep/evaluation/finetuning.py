"""Fine-tuning every evaluated client on its own training data before an evaluation scores it, with no
Lightning: :class:`ClientFineTuning`, the machinery of the ``FineTunedEvaluation`` callback (SRPFL's protocol)
and of :class:`~lightning_fedrep.evaluation.adaptation.EvaluationAdaptation` (what an algorithm's
``EvaluationSpec.adapt`` asks for). It reads a run through a :class:`FineTuningContext`, which whoever drives
it builds (the Lightning face builds it from its Trainer: ``lightning/evaluating.py``); the optimizer it
fine-tunes with is chosen in :mod:`.finetuning_optimizer`."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fedrep.evaluation.finetuning_optimizer import (
    FineTuningOptimizer,
    OptimizerFactory,
    check_optimizer_choice,
    module_optimizer,
    official_sgd,
)
from lightning_fedrep.evaluation.head_tuning import (
    HEADS_TOGETHER_BYTES,
    ClientHead,
    HeadFineTuning,
    NotBatchable,
    groups_by_bytes,
)
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.arguments import check_bool, check_choice, check_int, check_real
from lightning_fedrep.federation.module.feature_chunks import FEATURE_CHUNK, feature_chunk_of
from lightning_fedrep.federation.module.losses import NAMED_LOSSES, declared_loss
from lightning_fedrep.federation.module.stateless import StatelessCall, stateless_call
from lightning_fedrep.federation.module.untouched import untouched_random_state

LossFn = Callable[[Tensor, Tensor], Tensor]
FeatureSplit = Any
"""The module as ``head(features(x))``
(:class:`~lightning_fedrep.federation.module.feature_split.FeatureSplit`: ``features``, ``head``, ``how``)."""


class ClientTrainingData(Protocol):
    """The clients' training data fine-tuning reads (a ``FederatedDataModule`` is one)."""

    batch_size: int
    """The training batch size (the fine-tuning's unless it sets its own)."""

    @property
    def num_clients(self) -> int:
        """How many clients there are."""

    def client_data(self, client: int) -> Sized:
        """``client``'s training samples."""

    def client_batches(self, client: int, index_batches: Iterable[Tensor]) -> Iterator[Any]:
        """``client``'s training samples in ``index_batches`` (one tensor of positions ``0 .. n-1`` within the
        client per batch), collated as the training's own batches."""


@dataclass(frozen=True)
class FineTuningContext:
    """What ``ClientFineTuning`` (the machinery of ``FineTunedEvaluation`` and of ``EvaluationSpec.adapt``) reads
    of a run when it fine-tunes (or checks a step), handed in by whoever drives it: the Lightning face builds one
    from its Trainer (``lightning_fedrep.lightning.evaluating.finetuning_context``) for each evaluation."""

    module: nn.Module
    """The module whose forward is fine-tuned (its own tensors are never changed)."""
    federation: Federation
    """The run's federation: the global shared part, each client's own tensors, the rounds' participation."""
    data: ClientTrainingData
    """The clients' training data."""
    evaluated_clients: Sequence[int]
    """The clients the coming evaluation scores (this process's share on several)."""
    device: torch.device
    """Where the module's tensors are."""
    to_device: Callable[[Any], Any]
    """A batch (or part of one) moved to :attr:`device` as the training moves its batches."""
    optimizers: Callable[[], Sequence[Optimizer]]
    """The training's optimizers (in a call that trains none, such as a lone test: those the module configures),
    for the module's optimizer class, hyper-parameters and learning rate."""
    feature_split: Callable[[Sequence[str], Tensor], FeatureSplit | None]
    """The module as ``head(features(x))`` with the given tensors as the head, verified on a probe batch, or
    ``None``."""
    fit_heads_together: Callable[[HeadFineTuning, Sequence[ClientHead]], list[dict[str, Tensor]]]
    """Many clients' heads fine-tuned at once on their cached features (raises
    :class:`~lightning_fedrep.evaluation.head_tuning.NotBatchable` where that would not be one client at a
    time's computation)."""
    why_batches_vary: Callable[[Sequence[int]], str | None]
    """Why these clients' training batches are not a fixed function of their samples (batches drawn by the data
    module itself, random transforms), or ``None``: their features may then be computed once."""
    convert_input: Callable[[Any], Any]
    """The inputs as the training's precision takes them (a cast, or unchanged)."""
    step_context: Callable[[], AbstractContextManager[Any]]
    """The context a training step runs in at the training's precision (autocast, or none)."""
    smoke: bool
    """A smoke run (Lightning's ``fast_dev_run``): one fine-tuning step per client."""
    info: Callable[[str], None]
    """Where the log lines go (on one process only)."""


class ClientFineTuning:
    """Fine-tunes every evaluated client's own part on its own training data (the rest of the model frozen)
    before an evaluation scores it, from a start (the clients' average, their stored or their scored tensors)
    with a fresh optimizer per client; the clients' stored state is not changed. Full forward passes, or the
    head alone on each client's features computed once where that is the same computation, one client at a
    time or many together.

    The machinery of the public ``FineTunedEvaluation`` callback, whose arguments these are (its docstring
    describes them), and of :class:`~lightning_fedrep.evaluation.adaptation.EvaluationAdaptation`. It reads a
    run only through a :class:`FineTuningContext`. At setup :meth:`prepare` takes the run's loss (and refuses a
    module without one); before an evaluation :meth:`tune` fine-tunes; :meth:`check_step` runs one step early.
    """

    _what = "head"

    def __init__(
        self,
        epochs: int = 10,
        start: Literal["average", "stored"] = "average",
        lr: float | None = None,
        momentum: float | None = None,
        weight_decay: float | None = None,
        batch_size: int | None = None,
        loss: str | LossFn | None = None,
        stages: tuple[str, ...] | list[str] = ("val", "test"),
        seed: int = 0,
        unpack: Callable[[Any], tuple[Any, Any]] | None = None,
        optimizer: Literal["module", "sgd"] | OptimizerFactory = "module",
        cache_features: bool = True,
    ):
        owner = "FineTunedEvaluation"
        check_bool("cache_features", cache_features, owner=owner)
        check_int("epochs", epochs, minimum=1, owner=owner)
        check_choice("start", start, ("average", "stored"), owner=owner)
        if lr is not None:
            check_real("lr", lr, 0.0, low_open=True, owner=owner)
        if momentum is not None:
            check_real("momentum", momentum, 0.0, owner=owner)
        if weight_decay is not None:
            check_real("weight_decay", weight_decay, 0.0, owner=owner)
        check_optimizer_choice(optimizer, lr, momentum, weight_decay)
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1, owner=owner)
        if isinstance(loss, str) and loss not in NAMED_LOSSES:
            raise ValueError(
                f"{owner}(loss=...) must be one of {sorted(NAMED_LOSSES)}, a callable or None, got {loss!r}."
            )
        if loss is not None and not isinstance(loss, str) and not callable(loss):
            raise TypeError(f"{owner}(loss=...) must be a loss name or a callable, got {loss!r}.")
        stages = tuple(stages) if isinstance(stages, list | tuple) else (stages,)
        if not stages or any(s not in ("val", "test") for s in stages):
            raise ValueError(f"{owner}(stages=...) must list 'val' and/or 'test', got {stages!r}.")
        check_int("seed", seed, owner=owner)
        self.owner = owner
        """Who fine-tunes, in log lines."""
        self.steps: int | None = None
        """A total step budget per client in place of ``epochs`` (the adaptation of ``EvaluationSpec.adapt``)."""
        self.epochs = epochs
        self.start = start
        self.optimizer = optimizer
        self._described = ""
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.loss = loss
        self.stages = stages
        if unpack is not None and not callable(unpack):
            raise TypeError(
                f"{owner}(unpack=...) must be a callable batch -> (inputs, target), got {unpack!r}."
            )
        self.seed = seed
        self.unpack = unpack
        self.cache_features = cache_features
        self.cache_decision = ""
        """The last evaluation's feature-cache decision, one line (logged when it changes)."""
        self.together_decision = ""
        """Whether the last cached fine-tuning stepped the clients together, and why not, one line (logged when
        it changes)."""
        self._chunk: int | None = None
        self._forward: tuple[nn.Module, StatelessCall] | None = None
        """The module the fine-tuning steps run, with its stateless call (made at its first step)."""
        self._loss_fn: LossFn | None = None
        self.last_round_clients: list[int] = []
        """The clients of the last aggregated round (before any: the heads of the clients that ever trained)."""
        self.last_round = -1
        """The last round that ended (seeds the fine-tuning batches, so a checkpoint's evaluation repeats)."""

    # ------------------------------------------------------------------ the run's preconditions
    def prepare(self, module: nn.Module, data: Any) -> None:
        """At setup, before anything runs: take this run's loss (``loss``, else the one ``module`` declares) and
        refuse a module without one, or ``data`` without per-client training data (``client_data``)."""
        self._chunk = None  # this run's inputs decide it
        if isinstance(self.loss, str):
            self._loss_fn = NAMED_LOSSES[self.loss]
        elif self.loss is not None:
            self._loss_fn = self.loss
        else:
            self._loss_fn = declared_loss(module)
        needs_loss, fine_tunes, or_else = self._refusal_words(type(module).__name__)
        if self._loss_fn is None:
            raise ValueError(
                f"{needs_loss}: set fedrep_loss = 'cross_entropy' (or 'mse', or a callable) on "
                f"{type(module).__name__}{or_else}."
            )
        if data is None or not hasattr(data, "client_data"):
            raise ValueError(
                f"{fine_tunes} on each client's training data: pass a FederatedDataModule as datamodule=."
            )

    def _refusal_words(self, module_name: str) -> tuple[str, str, str]:
        """How :meth:`prepare`'s refusals name who needs the loss, who fine-tunes on the clients' data, and what
        else gives a loss (``module_name``: the module's class)."""
        return (
            "FineTunedEvaluation needs the training loss",
            "FineTunedEvaluation fine-tunes",
            ", or pass FineTunedEvaluation(loss=...)",
        )

    # ------------------------------------------------------------------ what is tuned, and how
    def _tuned_names(self, context: FineTuningContext) -> list[str]:
        """The parameter names of the module each client fine-tunes (its local parameters in the federation,
        else the head)."""
        federation = context.federation
        parameters = dict(context.module.named_parameters())
        local = [n for n in federation.local_names if n in parameters]
        names = local or [n for n in federation.split.head if n in parameters]
        if not names:
            raise ValueError(
                "FineTunedEvaluation needs a head to fine-tune: pass head=... to the strategy or set `fedrep_head` "
                "on the module."
            )
        return names

    def _fine_tuning_optimizer(self, context: FineTuningContext, names: list[str]) -> FineTuningOptimizer:
        """The optimizer each client's ``names`` fine-tune with (``optimizer``); a log line names it (when it
        changes)."""
        if callable(self.optimizer):
            chosen = FineTuningOptimizer("optimizer=<callable>", factory=self.optimizer)
        elif self.optimizer == "sgd":
            lr = self.lr if self.lr is not None else training_lr(context)
            chosen = official_sgd(names, lr, self.momentum, self.weight_decay)
        else:
            overrides = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
            chosen = module_optimizer(context.module, context.optimizers(), names, overrides)
        description = chosen.describe()
        if description != self._described:
            self._described = description
            context.info(f"{self.owner} fine-tunes each client's {self._what} with {description}.")
        return chosen

    # ------------------------------------------------------------------ fine-tuning
    def tune(self, context: FineTuningContext) -> dict[int, dict[str, Tensor]]:
        """Every evaluated client's fine-tuned tensors by name, before an evaluation (the caller hands them to
        the federation, which then scores them); the clients' stored state is not changed. ``context``: the
        run, as the evaluation starts."""
        names = self._tuned_names(context)
        clients = list(context.evaluated_clients)
        starts = self._starting_heads(context, names, clients)
        optimizer = self._fine_tuning_optimizer(context, names)
        tuned: dict[int, dict[str, Tensor]] = {}
        with _training_mode(context.module):
            split = self._cached_split(context, names, clients)
            if split is not None:
                tuned.update(self._fit_heads_together(context, names, clients, starts, optimizer, split))
            for client in clients:
                if client in tuned:
                    continue
                if len(context.data.client_data(client)) == 0:
                    tuned[client] = starts(client)
                    continue
                if split is not None:
                    tuned[client] = self._fit_head_cached(context, client, starts(client), optimizer, split)
                    continue
                batches = self._client_batches(context, client)
                if context.smoke:  # a smoke run: one step per client
                    batches = itertools.islice(batches, 1)
                tuned[client] = self._fit_head(context, client, starts(client), batches, optimizer)
        return tuned

    def check_step(self, context: FineTuningContext) -> None:
        """One fine-tuning forward and loss on the first batch of the first client with training data (the
        optimizer chosen too), before the first round: so a module or data that do not fit fail now, not at the
        first evaluation. ``context``: the run, as it starts."""
        data = context.data
        clients = [c for c in range(data.num_clients) if len(data.client_data(c))]
        if not clients:
            return
        names = self._tuned_names(context)
        self._fine_tuning_optimizer(context, names)
        client = clients[0]
        start = own_values(context.federation.client_tensors(client), context.federation.global_view(), names)
        batch = next(self._client_batches(context, client))
        with _training_mode(context.module):
            self._loss(context, self._client_state(context, client, start), batch)

    def _client_batches(self, context: FineTuningContext, client: int) -> Iterator[Any]:
        """``epochs`` shuffled passes over the client's training samples (the data set's transforms and the
        data module's collation apply)."""
        for batches in self._index_batches(context, client):
            yield from context.data.client_batches(client, batches)

    def _index_batches(self, context: FineTuningContext, client: int) -> Iterator[tuple[Tensor, ...]]:
        """Per epoch, the client's batches of sample positions (seeded per round and client)."""
        data = context.data
        batch_size = self.batch_size or int(data.batch_size)
        generator = torch.Generator().manual_seed(
            self.seed * 1_000_003 + (self.last_round + 1) * 10_007 + client
        )
        size = len(data.client_data(client))
        left = self.steps
        epochs = self.epochs if left is None else -(-left // max(1, -(-size // batch_size)))
        for _ in range(epochs):
            batches = torch.randperm(size, generator=generator).split(batch_size)
            if left is not None:  # a step budget: the last epoch is cut
                batches, left = batches[:left], left - len(batches[:left])
            yield batches

    def _client_state(
        self, context: FineTuningContext, client: int, head: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """The client's whole model for ``functional_call``: global shared part, its own local part, ``head``;
        buffers are copies (batch norm updates them in train mode; the stored ones must not change)."""
        module = context.module
        state = {n: t.detach() for n, t in module.named_parameters()}
        state.update({n: t.detach().clone() for n, t in module.named_buffers()})
        state.update({n: t.detach().clone() for n, t in context.federation.global_view().items()})
        state.update(self._own_tensors(context, client))  # copies
        state.update(head)
        return state

    def _own_tensors(self, context: FineTuningContext, client: int) -> dict[str, Tensor]:
        """Copies of the tensors that make ``client``'s model its own before fine-tuning."""
        return context.federation.client_tensors(client)

    def _inputs_and_target(self, batch: Any) -> tuple[Any, Any]:
        try:
            return (self.unpack or _inputs_and_target)(batch)
        except (TypeError, ValueError, IndexError, KeyError) as error:
            raise TypeError(
                f"FineTunedEvaluation could not split a training batch into (inputs, target): {error}. Pass "
                "FineTunedEvaluation(unpack=lambda batch: (inputs, target))."
            ) from error

    def _loss(self, context: FineTuningContext, state: dict[str, Tensor], batch: Any) -> Tensor:
        inputs, target = self._inputs_and_target(batch)
        inputs = context.convert_input(context.to_device(inputs))
        target = context.to_device(target)
        with context.step_context():
            return self._loss_fn(self._stateless(context.module)(state, inputs), target).float().mean()

    def _stateless(self, module: nn.Module) -> StatelessCall:
        """``module``'s forward on given tensors (:func:`~lightning_fedrep.federation.module.stateless.stateless_call`),
        made once per module."""
        if self._forward is None or self._forward[0] is not module:
            self._forward = (module, stateless_call(module))
        return self._forward[1]

    def _starting_heads(
        self, context: FineTuningContext, names: list[str], clients: list[int]
    ) -> Callable[[int], dict[str, Tensor]]:
        federation = context.federation
        shared = federation.global_view()
        if self.start == "stored":
            return lambda c: own_values(federation.client_tensors(c), shared, names)
        # the official averaged model: the last round's clients' heads, weighted as the aggregation
        takers = self.last_round_clients or sorted(federation.history.participation) or clients
        weights = torch.tensor(
            [
                float(len(context.data.client_data(c))) if federation.config.weighting == "samples" else 1.0
                for c in takers
            ],
            dtype=torch.float64,
        )
        weights = weights / weights.sum() if weights.sum() > 0 else torch.full_like(weights, 1 / len(takers))
        heads = [own_values(federation.client_tensors(c), shared, names) for c in takers]
        average = {
            n: sum(float(w) * h[n].double() for w, h in zip(weights, heads)).to(heads[0][n].dtype)
            for n in names
        }
        return lambda c: {n: t.clone() for n, t in average.items()}

    def _fit_head(
        self,
        context: FineTuningContext,
        client: int,
        start: dict[str, Tensor],
        batches: Iterator[Any],
        chosen: FineTuningOptimizer,
    ) -> dict[str, Tensor]:
        head = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        optimizer = chosen.build(head)
        state = self._client_state(context, client, head)
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            self._loss(context, state, batch).backward()
            optimizer.step()
        return {n: t.detach() for n, t in head.items()}

    # ------------------------------------------------------------------ on cached features
    def _cached_split(
        self, context: FineTuningContext, names: list[str], clients: list[int]
    ) -> FeatureSplit | None:
        """The verified split to fine-tune on cached features, or ``None`` (a log line says why, when that
        changes)."""
        split, why = self._feature_split(context, names, clients)
        decision = (
            f"{self.owner} caches each client's features ({split.how}): one feature pass per client."
            if split is not None
            else f"{self.owner} runs full forward passes (no feature cache: {why})."
        )
        if decision != self.cache_decision:
            self.cache_decision = decision
            context.info(decision)
        return split

    def _feature_split(
        self, context: FineTuningContext, names: list[str], clients: list[int]
    ) -> tuple[FeatureSplit | None, str]:
        """The split and ``""``, or ``None`` and why the cached computation would not be today's."""
        data = context.data
        with_data = [c for c in clients if len(data.client_data(c))]
        if not self.cache_features:
            return None, "cache_features=False"
        if not with_data:
            return None, "no evaluated client has training data"
        why = context.why_batches_vary(with_data)
        if why is not None:
            return None, why
        with untouched_random_state():  # a data set's transforms must not shift the run's generators
            largest = max(with_data, key=lambda c: len(data.client_data(c)))  # batch norm needs > 1
            probe_size = min(len(data.client_data(largest)), 16)
            batch = next(iter(data.client_batches(largest, [torch.arange(probe_size)])))
            inputs, target = self._inputs_and_target(batch)
        if not isinstance(inputs, Tensor) or not isinstance(target, Tensor):
            return None, "the batches' inputs and targets are not tensors"
        probe = context.convert_input(context.to_device(inputs))
        with untouched_random_state(), context.step_context():
            split = context.feature_split(names, probe)
            if split is None:
                return None, (
                    "the module's output is not head(features(x)) with the tuned parameters as the head: declare "
                    "forward_features/forward_head"
                )
            if not _train_mode_free(context.module, split, probe):
                return None, "the body's output depends on train mode (batch norm or dropout in the body)"
        return split, ""

    def _fit_head_cached(
        self,
        context: FineTuningContext,
        client: int,
        start: dict[str, Tensor],
        chosen: FineTuningOptimizer,
        split: FeatureSplit,
    ) -> dict[str, Tensor]:
        """:meth:`_fit_head` on the client's features, computed once: the same batches, optimizer and loss."""
        head = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        optimizer = chosen.build(head)
        state = self._client_state(context, client, head)
        features, target = self._client_features(context, client, state, split)
        steps: Iterator[Tensor] = (b for epoch in self._index_batches(context, client) for b in epoch)
        if context.smoke:  # a smoke run: one step per client
            steps = itertools.islice(steps, 1)
        for index in steps:
            index = index.to(features.device)
            optimizer.zero_grad(set_to_none=True)
            with context.step_context():
                output = split.head(state, features[index])
                loss = self._loss_fn(output, target[index]).float().mean()
            loss.backward()
            optimizer.step()
        return {n: t.detach() for n, t in head.items()}

    def _fit_heads_together(
        self,
        context: FineTuningContext,
        names: list[str],
        clients: list[int],
        starts: Callable[[int], dict[str, Tensor]],
        chosen: FineTuningOptimizer,
        split: FeatureSplit,
    ) -> dict[int, dict[str, Tensor]]:
        """:meth:`_fit_head_cached` of every client with training data, in groups that step together
        (``context.fit_heads_together``; at most ``HEADS_TOGETHER_BYTES`` of padded features each, computed
        group by group): the same batches, optimizers and loss. The clients it tuned: none (one client at a time
        then, and a log line says why) where the clients' models differ in more than the tuned tensors, fewer
        than two clients have data, or the heads cannot step together (``NotBatchable``)."""
        data = context.data
        with_data = [c for c in clients if len(data.client_data(c))]
        if len(with_data) < 2 or any(set(self._own_tensors(context, c)) - set(names) for c in with_data):
            return {}
        state = self._client_state(context, with_data[0], starts(with_data[0]))
        tuning = HeadFineTuning(
            split.head,
            {n: t for n, t in state.items() if n not in names},
            chosen.build,
            self._loss_fn,
            context.step_context,
        )
        first = self._client_features(context, with_data[0], state, split)
        sample_bytes = first[0][0].numel() * first[0].element_size()
        sizes = [len(data.client_data(c)) for c in with_data]
        tuned: dict[int, dict[str, Tensor]] = {}
        for group in groups_by_bytes(sizes, sample_bytes, HEADS_TOGETHER_BYTES):
            members = [with_data[i] for i in group]
            cached = [
                first if c == with_data[0] else self._client_features(context, c, state, split)
                for c in members
            ]
            clients_heads = []
            for client, (features, target) in zip(members, cached):
                steps = [b for epoch in self._index_batches(context, client) for b in epoch]
                if context.smoke:  # a smoke run: one step per client
                    steps = steps[:1]
                clients_heads.append(ClientHead(starts(client), features, target, steps))
            try:
                heads = context.fit_heads_together(tuning, clients_heads)
            except NotBatchable as why:  # raised before any of the group's clients stepped
                self._tell_together(context, f"{self.owner} steps the heads one client at a time ({why}).")
                return tuned
            tuned.update(zip(members, heads))
        self._tell_together(
            context, f"{self.owner} steps the clients' heads together ({len(with_data)} clients)."
        )
        return tuned

    def _tell_together(self, context: FineTuningContext, line: str) -> None:
        """Log whether the heads are fine-tuned together (when that changes)."""
        if line != self.together_decision:
            self.together_decision = line
            context.info(line)

    def _client_features(
        self, context: FineTuningContext, client: int, state: dict[str, Tensor], split: FeatureSplit
    ) -> tuple[Tensor, Tensor]:
        """The body's output and the targets of all the client's training samples, in their order."""
        size = len(context.data.client_data(client))
        features, targets = [], []
        with torch.no_grad():
            for batch in context.data.client_batches(client, self._feature_chunks(context, client, size)):
                inputs, target = self._inputs_and_target(batch)
                inputs = context.convert_input(context.to_device(inputs))
                with context.step_context():
                    features.append(split.features(state, inputs))
                targets.append(context.to_device(target))
        return torch.cat(features), torch.cat(targets)

    def _feature_chunks(self, context: FineTuningContext, client: int, size: int) -> tuple[Tensor, ...]:
        """The client's sample positions ``0 .. size - 1`` in chunks of one feature pass each
        (:func:`~lightning_fedrep.federation.module.feature_chunks.feature_chunk` of a sample's input bytes, read
        once: from the first client with samples)."""
        positions = torch.arange(size)
        if not size:
            return ()
        if self._chunk is None:
            first = next(iter(context.data.client_batches(client, [positions[:1]])))
            inputs, _ = self._inputs_and_target(first)
            self._chunk = (
                feature_chunk_of(context.device, inputs) if isinstance(inputs, Tensor) else FEATURE_CHUNK
            )
        return positions.split(self._chunk)


@contextlib.contextmanager
def _training_mode(module: nn.Module) -> Iterator[None]:
    """Gradients on (evaluation runs in inference mode) and the module in train mode, as the official code."""
    was_training = module.training
    with torch.inference_mode(False), torch.enable_grad():
        module.train()
        try:
            yield
        finally:
            module.train(was_training)


def _train_mode_free(module: nn.Module, split: FeatureSplit, probe: Tensor) -> bool:
    """Whether the body's output on ``probe`` is the same in train mode (twice, different random draws) as in
    eval mode: then no batch statistics and no randomness enter the features."""
    state = {n: t.detach().clone() for n, t in module.named_buffers()}  # batch norm updates them
    state.update({n: t.detach() for n, t in module.named_parameters()})
    with torch.no_grad():
        module.eval()
        try:
            reference = split.features(dict(state), probe)
        finally:
            module.train()
        for seed in (0, 1):
            torch.manual_seed(seed)
            if not _same(split.features(dict(state), probe), reference):
                return False
    return True


def training_lr(context: FineTuningContext) -> float:
    """The training's learning rate: its first optimizer's first group's."""
    optimizers = context.optimizers()
    if not optimizers:
        raise ValueError(f"{type(context.module).__name__}.configure_optimizers() returned no optimizer.")
    return float(optimizers[0].param_groups[0]["lr"])


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN."""
    return a.shape == b.shape and bool(
        torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    )


def _inputs_and_target(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch of type {type(batch).__name__} is not an (inputs, target, ...) sequence")


def own_values(personal: dict[str, Tensor], shared: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """Copies of a client's tensors ``names``: its own (``personal``) where it has them, else ``shared``."""
    return {n: (personal[n] if n in personal else shared[n]).detach().clone() for n in names}
