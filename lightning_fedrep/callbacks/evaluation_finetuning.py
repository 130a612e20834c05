"""``FineTunedEvaluation``: every evaluation scores each client after fitting its own head (SRPFL's protocol)."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_fedrep.data.loaders import datasets_are_deterministic
from lightning_fedrep.evaluation.head_tuning import (
    HEADS_TOGETHER_BYTES,
    ClientHead,
    HeadFineTuning,
    NotBatchable,
    groups_by_bytes,
)
from lightning_fedrep.federation import RoundResult
from lightning_fedrep.federation.api.algorithm import PART_GROUPS
from lightning_fedrep.federation.api.arguments import check_bool, check_choice, check_int, check_real
from lightning_fedrep.federation.module.feature_chunks import FEATURE_CHUNK, feature_chunk_of
from lightning_fedrep.federation.module.losses import NAMED_LOSSES, declared_loss
from lightning_fedrep.federation.module.stateless import StatelessCall, stateless_call
from lightning_fedrep.federation.module.untouched import untouched_random_state
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.internals import configured_learning_rate, configured_optimizers
from lightning_fedrep.models.optim import weight_decay_groups

LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[list[Tensor]], Optimizer]
FeatureSplit = Any
"""The strategy's :meth:`~lightning_fedrep.FedRepStrategy.feature_split` (``features``, ``head``, ``how``)."""

OFFICIAL_MOMENTUM = 0.5
OFFICIAL_WEIGHT_DECAY = 1e-4
"""The SRPFL code's fine-tuning SGD (``optimizer="sgd"``): momentum 0.5, weight decay 1e-4 on weights."""

_FLAGS = (
    "foreach",
    "maximize",
    "capturable",
    "differentiable",
    "fused",
    "initial_lr",
    "decoupled_weight_decay",
)
"""Optimizer group entries that are implementation switches, not hyper-parameters (left out of the log line)."""


@dataclass(frozen=True)
class FineTuningOptimizer:
    """How each client's head is fine-tuned: an optimizer class and one hyper-parameter group per set of
    tuned parameter names (``factory`` instead, for an optimizer the user declares as a callable)."""

    source: str
    """Where the choice comes from, in words (for the log line that names it)."""
    optimizer_class: type[Optimizer] | None = None
    """The optimizer class (``None`` with ``factory``)."""
    groups: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = ()
    """``(hyper-parameters, tuned parameter names)`` for each parameter group."""
    factory: OptimizerFactory | None = None

    def build(self, head: dict[str, Tensor]) -> Optimizer:
        """A fresh optimizer over ``head``'s tensors."""
        if self.factory is not None:
            return self.factory(list(head.values()))
        groups = [{**hyper, "params": [head[n] for n in names]} for hyper, names in self.groups]
        return _construct(self.optimizer_class, groups)

    def describe(self) -> str:
        """One line: the class and its hyper-parameters per group of tuned parameters, and where they come from."""
        if self.factory is not None:
            return f"the declared optimizer {getattr(self.factory, '__name__', repr(self.factory))} ({self.source})"
        groups = "; ".join(
            ", ".join(f"{k}={v}" for k, v in hyper.items() if k not in _FLAGS and v is not None)
            + f" for {', '.join(names)}"
            for hyper, names in self.groups
        )
        return f"{self.optimizer_class.__name__} ({groups}) {self.source}"


class FineTunedEvaluation(FederatedCallback):
    """Before each validation and test, every evaluated client fine-tunes its head on its own training data
    for ``epochs`` epochs (the rest of the model frozen), and the evaluation scores those fine-tuned heads;
    the clients' stored state is not changed, so training goes on from it.

    This is the SRPFL paper's evaluation (the official code's ``--FT_epoch 10``: head-only SGD, momentum 0.5,
    weight decay 1e-4, batch 10, the training learning rate), under which clients that never took part in a
    round still fit their own head on the learned representation. The fine-tuning optimizer is by default
    the module's own (its class and each head parameter's hyper-parameters from ``configure_optimizers``;
    for the SRPFL recipes' models that is the official SGD), and a log line says which one runs. Add it to any recipe's
    ``trainer.callbacks``; it needs the module's per-sample loss (``fedrep_loss`` or ``loss=``) and batches it can
    split into ``(inputs, target)`` (``unpack=`` otherwise), and checks both on one batch when fit starts.

    Args:
        epochs: fine-tuning epochs over the client's training data.
        start: the head each client starts from. ``"average"``: the mean of the heads of the last round's
            clients, weighted by their training samples as the aggregation (the official code's averaged
            model; for an algorithm that averages the head, the global head); ``"stored"``: the client's own
            stored head.
        optimizer: ``"module"``: the class and hyper-parameters of the optimizer that holds each tuned
            parameter in the module's ``configure_optimizers`` (the current learning rate during fit);
            ``"sgd"``: the SRPFL code's SGD (momentum 0.5, weight decay 1e-4 on weights, not biases, the
            training learning rate); or a callable ``params -> Optimizer`` (e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``). A fresh optimizer per client and evaluation.
        lr: overrides the learning rate of ``"module"``/``"sgd"``; ``None`` keeps the training rate.
        momentum, weight_decay: override those of ``"module"`` (refused where its class has none) or
            ``"sgd"`` (``None``: 0.5 and 1e-4).
        batch_size: the fine-tuning batch size; ``None`` takes the data module's.
        loss: the per-sample loss (``"cross_entropy"``, ``"mse"`` or a callable ``(output, target) ->
            per-sample losses``); ``None`` uses the module's declared ``fedrep_loss``.
        stages: which evaluations fine-tune (``"val"``, ``"test"``); the sanity check never does.
        seed: seeds each client's batch order (per round and client, so reruns are equal, and a
            checkpoint's evaluation repeats the one logged when it was written).
        unpack: ``batch -> (inputs, target)`` for batches that are not ``(inputs, target, ...)``
            sequences; the module's ``forward(inputs)`` and the loss then run on them.
        cache_features: fine-tune on cached features where that is today's computation: the model is
            ``head(features(x))`` (declared ``forward_features``/``forward_head`` or the head module called
            last, verified on a probe batch), the tuned parameters are that head, the training data has no
            random transforms and the body's output does not depend on train mode (no batch norm, no
            dropout in the body). Each client's features are then computed once (one pass) and its
            ``epochs`` of head steps run on them, same batches and optimizer, equal to the full forward
            passes within float error; otherwise the full passes run and a log line says why. On cached
            features the clients step together (the strategy's ``fit_heads_together``) unless the
            head cannot be batched (random draws, buffer updates): then one client at a time.

    What is fine-tuned: the client's local parameters (the head for FedRep/FedPer, the local representation
    for LG-FedAvg), or the head for algorithms without a local part (FedAvg). The cost is ``epochs`` passes
    over every evaluated client's training data per evaluation: validate less often
    (``check_val_every_n_epoch``) on large federations, as the official code does (``--test_freq``). Under
    ``fast_dev_run`` each client takes one fine-tuning step.
    """

    needs_every_client = True  # the "average" start reads the last round's clients' heads
    owner = "FineTunedEvaluation"
    """Who fine-tunes, in log lines."""
    steps: int | None = None
    """A total step budget per client in place of ``epochs`` (the adaptation of ``EvaluationSpec.adapt``)."""

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
        _check_optimizer(optimizer, lr, momentum, weight_decay)
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
        self._forward: tuple[L.LightningModule, StatelessCall] | None = None
        """The module the fine-tuning steps run, with its stateless call (made at its first step)."""
        self._loss_fn: LossFn | None = None
        self.last_round_clients: list[int] = []
        """The clients of the last aggregated round (before any: the heads of the clients that ever trained)."""
        self.last_round = -1
        """The last round that ended (seeds the fine-tuning batches, so a checkpoint's evaluation repeats)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse, before anything runs, a module without a known loss or without a head."""
        super().setup(trainer, pl_module, stage)
        self._prepare_run(trainer, pl_module)

    def _prepare_run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At setup: take this run's loss (``loss``, else the module's declared one) and refuse a module without
        one or data without clients (the refusals' words are :meth:`_no_loss` and :meth:`_no_client_data`)."""
        self._chunk = None  # this run's inputs decide it
        if isinstance(self.loss, str):
            self._loss_fn = NAMED_LOSSES[self.loss]
        elif self.loss is not None:
            self._loss_fn = self.loss
        else:
            self._loss_fn = declared_loss(pl_module)
        if self._loss_fn is None:
            raise ValueError(self._no_loss(pl_module))
        if trainer.datamodule is None or not hasattr(trainer.datamodule, "client_data"):
            raise ValueError(self._no_client_data(pl_module))

    def _no_loss(self, pl_module: L.LightningModule) -> str:
        """The refusal of a module that declares no loss (and none was passed)."""
        return (
            f"FineTunedEvaluation needs the training loss: set fedrep_loss = 'cross_entropy' (or 'mse', or a "
            f"callable) on {type(pl_module).__name__}, or pass FineTunedEvaluation(loss=...)."
        )

    def _no_client_data(self, pl_module: L.LightningModule) -> str:
        """The refusal of a data module without per-client training data."""
        return (
            "FineTunedEvaluation fine-tunes on each client's training data: pass a FederatedDataModule "
            "as datamodule=."
        )

    def on_round_end(self, trainer: L.Trainer, pl_module: L.LightningModule, result: RoundResult) -> None:
        """Remember the round's clients: the ``"average"`` start is the mean of their heads."""
        self.last_round = result.round
        if result.aggregated and result.clients:
            self.last_round_clients = [r.client for r in result.clients]

    def state_dict(self) -> dict[str, Any]:
        return {"last_round_clients": list(self.last_round_clients), "last_round": self.last_round}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_round_clients = list(state_dict.get("last_round_clients", []))
        self.last_round = int(state_dict.get("last_round", -1))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "val" in self.stages and not trainer.sanity_checking:
            self._fine_tune(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "test" in self.stages:
            self._fine_tune(trainer, pl_module)

    def tuned_names(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """The parameter names of ``pl_module`` each client fine-tunes (its local parameters in ``trainer``'s
        federation, else the head)."""
        federation = self.federation(trainer)
        parameters = dict(pl_module.named_parameters())
        local = [n for n in federation.local_names if n in parameters]
        names = local or [n for n in federation.split.head if n in parameters]
        if not names:
            raise ValueError(
                "FineTunedEvaluation needs a head to fine-tune: pass head=... to the strategy or set `fedrep_head` "
                "on the module."
            )
        return names

    def _fine_tune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.federation(trainer).set_evaluation_tensors(self._tuned(trainer, pl_module))

    def _tuned(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[int, dict[str, Tensor]]:
        """Every evaluated client's fine-tuned tensors by name."""
        names = self.tuned_names(trainer, pl_module)
        clients = self.strategy(trainer).evaluated_clients
        starts = self._starting_heads(trainer, names, clients)
        optimizer = self.fine_tuning_optimizer(trainer, pl_module)
        tuned: dict[int, dict[str, Tensor]] = {}
        with self._training_mode(pl_module):
            split = self._cached_split(trainer, pl_module, names, clients)
            if split is not None:
                tuned.update(
                    self._fit_heads_together(trainer, pl_module, names, clients, starts, optimizer, split)
                )
            for client in clients:
                if client in tuned:
                    continue
                if len(trainer.datamodule.client_data(client)) == 0:
                    tuned[client] = starts(client)
                    continue
                if split is not None:
                    tuned[client] = self._fit_head_cached(
                        trainer, pl_module, client, starts(client), optimizer, split
                    )
                    continue
                batches = self._client_batches(trainer, client)
                if trainer.fast_dev_run:  # a smoke run: one step per client
                    batches = itertools.islice(batches, 1)
                tuned[client] = self._fit_head(trainer, pl_module, client, starts(client), batches, optimizer)
        return tuned

    def _cached_split(
        self, trainer: L.Trainer, pl_module: L.LightningModule, names: list[str], clients: list[int]
    ) -> FeatureSplit | None:
        """The verified split to fine-tune on cached features, or ``None`` (a log line says why, when that
        changes)."""
        split, why = self._feature_split(trainer, pl_module, names, clients)
        decision = (
            f"{self.owner} caches each client's features ({split.how}): one feature pass per client."
            if split is not None
            else f"{self.owner} runs full forward passes (no feature cache: {why})."
        )
        if decision != self.cache_decision:
            self.cache_decision = decision
            rank_zero_info(decision)
        return split

    def _feature_split(
        self, trainer: L.Trainer, pl_module: L.LightningModule, names: list[str], clients: list[int]
    ) -> tuple[FeatureSplit | None, str]:
        """The split and ``""``, or ``None`` and why the cached computation would not be today's."""
        from lightning_fedrep.data.module import FederatedDataModule

        datamodule = trainer.datamodule
        with_data = [c for c in clients if len(datamodule.client_data(c))]
        if not self.cache_features:
            return None, "cache_features=False"
        if not with_data:
            return None, "no evaluated client has training data"
        if type(datamodule).client_batches is not FederatedDataModule.client_batches:
            return None, f"{type(datamodule).__name__} draws its own batches"
        why = datasets_are_deterministic(datamodule.client_data(c).dataset for c in with_data)
        if why is not None:
            return None, why
        with untouched_random_state():  # a data set's transforms must not shift the run's generators
            largest = max(with_data, key=lambda c: len(datamodule.client_data(c)))  # batch norm needs > 1
            probe_size = min(len(datamodule.client_data(largest)), 16)
            batch = next(iter(datamodule.client_batches(largest, [torch.arange(probe_size)])))
            inputs, target = self._inputs_and_target(batch)
        if not isinstance(inputs, Tensor) or not isinstance(target, Tensor):
            return None, "the batches' inputs and targets are not tensors"
        probe = trainer.precision_plugin.convert_input(move_data_to_device(inputs, pl_module.device))
        with untouched_random_state(), trainer.precision_plugin.train_step_context():
            split = self.strategy(trainer).feature_split(names, probe)
            if split is None:
                return None, (
                    "the module's output is not head(features(x)) with the tuned parameters as the head: declare "
                    "forward_features/forward_head"
                )
            if not self._train_mode_free(trainer, pl_module, split, probe):
                return None, "the body's output depends on train mode (batch norm or dropout in the body)"
        return split, ""

    def _train_mode_free(
        self, trainer: L.Trainer, pl_module: L.LightningModule, split: FeatureSplit, probe: Tensor
    ) -> bool:
        """Whether the body's output on ``probe`` is the same in train mode (twice, different random
        draws) as in eval mode: then no batch statistics and no randomness enter the features."""
        state = {n: t.detach().clone() for n, t in pl_module.named_buffers()}  # batch norm updates them
        state.update({n: t.detach() for n, t in pl_module.named_parameters()})
        with torch.no_grad():
            pl_module.eval()
            try:
                reference = split.features(dict(state), probe)
            finally:
                pl_module.train()
            for seed in (0, 1):
                torch.manual_seed(seed)
                if not _same(split.features(dict(state), probe), reference):
                    return False
        return True

    def _fit_head_cached(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        client: int,
        start: dict[str, Tensor],
        chosen: FineTuningOptimizer,
        split: FeatureSplit,
    ) -> dict[str, Tensor]:
        """:meth:`_fit_head` on the client's features, computed once: the same batches, optimizer and loss."""
        head = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        optimizer = chosen.build(head)
        state = self._client_state(trainer, pl_module, client, head)
        features, target = self._client_features(trainer, pl_module, client, state, split)
        steps: Iterator[Tensor] = (b for epoch in self._index_batches(trainer, client) for b in epoch)
        if trainer.fast_dev_run:  # a smoke run: one step per client
            steps = itertools.islice(steps, 1)
        plugin = trainer.precision_plugin
        for index in steps:
            index = index.to(features.device)
            optimizer.zero_grad(set_to_none=True)
            with plugin.train_step_context():
                output = split.head(state, features[index])
                loss = self._loss_fn(output, target[index]).float().mean()
            loss.backward()
            optimizer.step()
        return {n: t.detach() for n, t in head.items()}

    def _fit_heads_together(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        names: list[str],
        clients: list[int],
        starts: Callable[[int], dict[str, Tensor]],
        chosen: FineTuningOptimizer,
        split: FeatureSplit,
    ) -> dict[int, dict[str, Tensor]]:
        """:meth:`_fit_head_cached` of every client with training data, in groups that step together (the
        strategy's ``fit_heads_together``; at most ``HEADS_TOGETHER_BYTES`` of padded features each, computed
        group by group): the same batches, optimizers and loss. The clients it tuned: none (one client at a time
        then, and a log line says why) where the clients' models differ in more than the tuned tensors, fewer
        than two clients have data, or the heads cannot step together (``NotBatchable``)."""
        datamodule = trainer.datamodule
        with_data = [c for c in clients if len(datamodule.client_data(c))]
        if len(with_data) < 2 or any(set(self._own_tensors(trainer, c)) - set(names) for c in with_data):
            return {}
        state = self._client_state(trainer, pl_module, with_data[0], starts(with_data[0]))
        tuning = HeadFineTuning(
            split.head,
            {n: t for n, t in state.items() if n not in names},
            chosen.build,
            self._loss_fn,
            trainer.precision_plugin.train_step_context,
        )
        first = self._client_features(trainer, pl_module, with_data[0], state, split)
        sample_bytes = first[0][0].numel() * first[0].element_size()
        sizes = [len(datamodule.client_data(c)) for c in with_data]
        tuned: dict[int, dict[str, Tensor]] = {}
        for group in groups_by_bytes(sizes, sample_bytes, HEADS_TOGETHER_BYTES):
            members = [with_data[i] for i in group]
            cached = [
                first if c == with_data[0] else self._client_features(trainer, pl_module, c, state, split)
                for c in members
            ]
            clients_heads = []
            for client, (features, target) in zip(members, cached):
                steps = [b for epoch in self._index_batches(trainer, client) for b in epoch]
                if trainer.fast_dev_run:  # a smoke run: one step per client
                    steps = steps[:1]
                clients_heads.append(ClientHead(starts(client), features, target, steps))
            try:
                heads = self.strategy(trainer).fit_heads_together(tuning, clients_heads)
            except NotBatchable as why:  # raised before any of the group's clients stepped
                self._tell_together(f"{self.owner} steps the heads one client at a time ({why}).")
                return tuned
            tuned.update(zip(members, heads))
        self._tell_together(f"{self.owner} steps the clients' heads together ({len(with_data)} clients).")
        return tuned

    def _tell_together(self, line: str) -> None:
        """Log whether the heads are fine-tuned together (when that changes)."""
        if line != self.together_decision:
            self.together_decision = line
            rank_zero_info(line)

    def _client_features(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        client: int,
        state: dict[str, Tensor],
        split: FeatureSplit,
    ) -> tuple[Tensor, Tensor]:
        """The body's output and the targets of all the client's training samples, in their order."""
        plugin = trainer.precision_plugin
        size = len(trainer.datamodule.client_data(client))
        features, targets = [], []
        with torch.no_grad():
            for batch in trainer.datamodule.client_batches(
                client, self._feature_chunks(trainer, client, size, pl_module.device)
            ):
                inputs, target = self._inputs_and_target(batch)
                inputs = plugin.convert_input(move_data_to_device(inputs, pl_module.device))
                with plugin.train_step_context():
                    features.append(split.features(state, inputs))
                targets.append(move_data_to_device(target, pl_module.device))
        return torch.cat(features), torch.cat(targets)

    def _feature_chunks(
        self, trainer: L.Trainer, client: int, size: int, device: torch.device
    ) -> tuple[Tensor, ...]:
        """The client's sample positions ``0 .. size - 1`` in chunks of one feature pass each
        (:func:`~lightning_fedrep.federation.module.feature_chunks.feature_chunk` of a sample's input bytes, read once: from the
        first client with samples)."""
        positions = torch.arange(size)
        if not size:
            return ()
        if self._chunk is None:
            first = next(iter(trainer.datamodule.client_batches(client, [positions[:1]])))
            inputs, _ = self._inputs_and_target(first)
            self._chunk = feature_chunk_of(device, inputs) if isinstance(inputs, Tensor) else FEATURE_CHUNK
        return positions.split(self._chunk)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Check, before the first round, that a fine-tuning step runs on this module and data (one forward
        and loss on a client's first batch), so a mismatch does not wait for the first validation."""
        clients = [c for c in range(trainer.datamodule.num_clients) if len(trainer.datamodule.client_data(c))]
        if "val" not in self.stages or not clients:
            return
        self.fine_tuning_optimizer(trainer, pl_module)
        client = clients[0]
        names = self.tuned_names(trainer, pl_module)
        start = _own_values(self.federation(trainer).client_tensors(client), self._shared(trainer), names)
        batch = next(self._client_batches(trainer, client))
        with self._training_mode(pl_module):
            self._loss(trainer, pl_module, self._client_state(trainer, pl_module, client, start), batch)

    def fine_tuning_optimizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> FineTuningOptimizer:
        """The optimizer each client's head fine-tunes with (``optimizer``; ``trainer`` and ``pl_module`` give the
        training's learning rate where it needs one); a log line names it."""
        names = self.tuned_names(trainer, pl_module)
        if callable(self.optimizer):
            chosen = FineTuningOptimizer("optimizer=<callable>", factory=self.optimizer)
        elif self.optimizer == "sgd":
            chosen = self._official_sgd(trainer, pl_module, names)
        else:
            chosen = self._module_optimizer(trainer, pl_module, names)
        description = chosen.describe()
        if description != self._described:
            self._described = description
            rank_zero_info(f"{self.owner} fine-tunes each client's {self._what} with {description}.")
        return chosen

    _what = "head"

    def _official_sgd(
        self, trainer: L.Trainer, pl_module: L.LightningModule, names: list[str]
    ) -> FineTuningOptimizer:
        lr = self.lr if self.lr is not None else _training_lr(trainer, pl_module)
        momentum = OFFICIAL_MOMENTUM if self.momentum is None else self.momentum
        decay = OFFICIAL_WEIGHT_DECAY if self.weight_decay is None else self.weight_decay
        groups = tuple(
            ({"lr": lr, "momentum": momentum, "weight_decay": group["weight_decay"]}, tuple(group["params"]))
            for group in weight_decay_groups([(n, n) for n in names], decay)
        )
        return FineTuningOptimizer(
            "(optimizer='sgd': the SRPFL code's fine-tuning SGD)", torch.optim.SGD, groups
        )

    def _module_optimizer(
        self, trainer: L.Trainer, pl_module: L.LightningModule, names: list[str]
    ) -> FineTuningOptimizer:
        """The class and each tuned parameter's group hyper-parameters of the module's optimizer."""
        optimizers = list(trainer.optimizers) or configured_optimizers(pl_module)
        found: dict[int, tuple[Optimizer, dict[str, Any], list[str]]] = {}
        for name in names:
            parameter = pl_module.get_parameter(name)
            located = [
                (o, g) for o in optimizers for g in o.param_groups if any(p is parameter for p in g["params"])
            ]
            if not located:
                raise ValueError(
                    f"FineTunedEvaluation(optimizer='module') fine-tunes {name} with the optimizer that trains it, "
                    f"but no optimizer of {type(pl_module).__name__}.configure_optimizers() holds it. Pass "
                    "optimizer='sgd' (the SRPFL code's) or a callable params -> Optimizer."
                )
            optimizer, group = located[0]
            found.setdefault(id(group), (optimizer, group, []))[2].append(name)
        classes = {type(o) for o, _, _ in found.values()}
        if len(classes) > 1:
            listed = ", ".join(sorted(c.__name__ for c in classes))
            raise ValueError(
                f"FineTunedEvaluation(optimizer='module'): the head's parameters are trained by several optimizer "
                f"classes ({listed}); pass optimizer='sgd' or a callable params -> Optimizer."
            )
        groups = tuple(
            (
                self._overridden({k: v for k, v in group.items() if k != "params"}, type(optimizer)),
                tuple(tuned),
            )
            for optimizer, group, tuned in found.values()
        )
        source = f"(optimizer='module': {type(pl_module).__name__}.configure_optimizers())"
        return FineTuningOptimizer(source, classes.pop(), groups)

    def _overridden(self, hyper: dict[str, Any], optimizer_class: type) -> dict[str, Any]:
        """The module's group hyper-parameters with this callback's ``lr``/``momentum``/``weight_decay``."""
        for key, value in (("lr", self.lr), ("momentum", self.momentum), ("weight_decay", self.weight_decay)):
            if value is None:
                continue
            if key not in hyper:
                raise ValueError(
                    f"FineTunedEvaluation({key}={value}) overrides the module's optimizer's {key}, but "
                    f"{optimizer_class.__name__} has none. Leave {key} unset, or pass optimizer='sgd' or a "
                    "callable params -> Optimizer."
                )
            hyper[key] = value
        return hyper

    @contextlib.contextmanager
    def _training_mode(self, pl_module: L.LightningModule) -> Iterator[None]:
        """Gradients on (evaluation runs in inference mode) and the module in train mode, as the official code."""
        was_training = pl_module.training
        with torch.inference_mode(False), torch.enable_grad():
            pl_module.train()
            try:
                yield
            finally:
                pl_module.train(was_training)

    def _client_batches(self, trainer: L.Trainer, client: int) -> Iterator[Any]:
        """``epochs`` shuffled passes over the client's training samples (the data set's transforms and the
        data module's collation apply)."""
        for batches in self._index_batches(trainer, client):
            yield from trainer.datamodule.client_batches(client, batches)

    def _index_batches(self, trainer: L.Trainer, client: int) -> Iterator[tuple[Tensor, ...]]:
        """Per epoch, the client's batches of sample positions (seeded per round and client)."""
        datamodule = trainer.datamodule
        batch_size = self.batch_size or int(datamodule.batch_size)
        generator = torch.Generator().manual_seed(
            self.seed * 1_000_003 + (self.last_round + 1) * 10_007 + client
        )
        size = len(datamodule.client_data(client))
        left = self.steps
        epochs = self.epochs if left is None else -(-left // max(1, -(-size // batch_size)))
        for _ in range(epochs):
            batches = torch.randperm(size, generator=generator).split(batch_size)
            if left is not None:  # a step budget: the last epoch is cut
                batches, left = batches[:left], left - len(batches[:left])
            yield batches

    def _shared(self, trainer: L.Trainer) -> dict[str, Tensor]:
        return self.federation(trainer).global_view()

    def _client_state(
        self, trainer: L.Trainer, pl_module: L.LightningModule, client: int, head: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """The client's whole model for ``functional_call``: global shared part, its own local part, ``head``;
        buffers are copies (batch norm updates them in train mode; the stored ones must not change)."""
        federation = self.federation(trainer)
        state = {n: t.detach() for n, t in pl_module.named_parameters()}
        state.update({n: t.detach().clone() for n, t in pl_module.named_buffers()})
        state.update({n: t.detach().clone() for n, t in federation.global_view().items()})
        state.update(self._own_tensors(trainer, client))  # copies
        state.update(head)
        return state

    def _own_tensors(self, trainer: L.Trainer, client: int) -> dict[str, Tensor]:
        """Copies of the tensors that make ``client``'s model its own before fine-tuning."""
        return self.federation(trainer).client_tensors(client)

    def _inputs_and_target(self, batch: Any) -> tuple[Any, Any]:
        try:
            return (self.unpack or _inputs_and_target)(batch)
        except (TypeError, ValueError, IndexError, KeyError) as error:
            raise TypeError(
                f"FineTunedEvaluation could not split a training batch into (inputs, target): {error}. Pass "
                "FineTunedEvaluation(unpack=lambda batch: (inputs, target))."
            ) from error

    def _loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, state: dict[str, Tensor], batch: Any
    ) -> Tensor:
        inputs, target = self._inputs_and_target(batch)
        plugin = trainer.precision_plugin
        inputs = plugin.convert_input(move_data_to_device(inputs, pl_module.device))
        target = move_data_to_device(target, pl_module.device)
        with plugin.train_step_context():
            return self._loss_fn(self._stateless(pl_module)(state, inputs), target).float().mean()

    def _stateless(self, pl_module: L.LightningModule) -> StatelessCall:
        """``pl_module``'s forward on given tensors (:func:`~lightning_fedrep.federation.module.stateless.stateless_call`), made once
        per module."""
        if self._forward is None or self._forward[0] is not pl_module:
            self._forward = (pl_module, stateless_call(pl_module))
        return self._forward[1]

    def _starting_heads(
        self, trainer: L.Trainer, names: list[str], clients: list[int]
    ) -> Callable[[int], dict[str, Tensor]]:
        federation = self.federation(trainer)
        shared = self._shared(trainer)
        if self.start == "stored":
            return lambda c: _own_values(federation.client_tensors(c), shared, names)
        # the official averaged model: the last round's clients' heads, weighted as the aggregation
        takers = self.last_round_clients or sorted(federation.history.participation) or clients
        weights = torch.tensor(
            [
                float(len(trainer.datamodule.client_data(c)))
                if federation.config.weighting == "samples"
                else 1.0
                for c in takers
            ],
            dtype=torch.float64,
        )
        weights = weights / weights.sum() if weights.sum() > 0 else torch.full_like(weights, 1 / len(takers))
        heads = [_own_values(federation.client_tensors(c), shared, names) for c in takers]
        average = {
            n: sum(float(w) * h[n].double() for w, h in zip(weights, heads)).to(heads[0][n].dtype)
            for n in names
        }
        return lambda c: {n: t.clone() for n, t in average.items()}

    def _fit_head(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        client: int,
        start: dict[str, Tensor],
        batches: Iterator[Any],
        chosen: FineTuningOptimizer,
    ) -> dict[str, Tensor]:
        head = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        optimizer = chosen.build(head)
        state = self._client_state(trainer, pl_module, client, head)
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            self._loss(trainer, pl_module, state, batch).backward()
            optimizer.step()
        return {n: t.detach() for n, t in head.items()}


class EvaluationAdaptation(FineTunedEvaluation):
    """The adaptation an algorithm asks for before evaluation (``EvaluationSpec.adapt``: Per-FedAvg's epochs,
    HF-MAML's one step): before each validation and test (never the sanity check), every evaluated client's
    scored model trains the phase's part (``"all"``, ``"head"``, ``"body"``) on the client's own training data
    for the phase's epochs or steps, with plain SGD (no momentum, no weight decay) at ``lr`` (``None``: the
    module optimizer's learning rate), and evaluation scores the result; the stored state does not change.

    :class:`FineTunedEvaluation`'s machinery with the spec's tuned part, start (the scored model) and
    optimizer. The strategy creates and runs it (it is not one of the Trainer's callbacks).
    """

    needs_every_client = False
    owner = "EvaluationSpec.adapt"
    _what = "scored model"

    def __init__(self, algorithm: str, phase: Any, lr: float | None):
        super().__init__(epochs=max(1, phase.epochs or 1), lr=lr, cache_features=phase.train == "head")
        self.epochs = phase.epochs if phase.epochs is not None else 1
        self.steps = phase.steps
        self.phase = phase
        self.algorithm = algorithm

    def _what_for(self, pl_module: L.LightningModule) -> str:
        return (
            f"Algorithm {self.algorithm!r} adapts each client's scored model before evaluation "
            f"(EvaluationSpec.adapt={self.phase!r}) on {type(pl_module).__name__}"
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse, before anything runs, a module without a declared loss or data without clients."""
        self._prepare_run(trainer, pl_module)
        self.tuned_names(trainer, pl_module)

    def _no_loss(self, pl_module: L.LightningModule) -> str:
        return (
            f"{self._what_for(pl_module)} with its per-sample loss: set fedrep_loss = 'cross_entropy' (or "
            f"'mse', or a callable) on {type(pl_module).__name__}."
        )

    def _no_client_data(self, pl_module: L.LightningModule) -> str:
        return (
            f"{self._what_for(pl_module)} on each client's training data: pass a FederatedDataModule as "
            "datamodule=."
        )

    def adapt(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Adapt every evaluated client and have the coming evaluation score the adapted models."""
        federation = self.federation(trainer)
        self.last_round = federation.round_index  # seeds the batches
        tuned = self._tuned(trainer, pl_module)
        federation.set_evaluation_tensors(
            {c: {**federation.evaluation_tensors(c), **t} for c, t in tuned.items()}
        )

    def tuned_names(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """The parameters of the phase's part (``"all"``: every trainable group)."""
        federation = self.federation(trainer)
        parameters = dict(pl_module.named_parameters())
        groups = PART_GROUPS[self.phase.train]
        names = [
            n
            for n in federation.shared_names + federation.local_names
            if n in parameters and federation.split.group(n) in groups
        ]
        if not names:
            raise ValueError(
                f"{self._what_for(pl_module)}, but its part {self.phase.train!r} holds no parameters: adapt "
                "'all', or pass head=... to the strategy."
            )
        return names

    def fine_tuning_optimizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> FineTuningOptimizer:
        """Plain SGD at ``lr`` (the module optimizer's learning rate when ``None``); a log line names it."""
        names = self.tuned_names(trainer, pl_module)
        lr = self.lr if self.lr is not None else _training_lr(trainer, pl_module)
        source = (
            "(EvaluationSpec.adapt_lr)" if self.lr is not None else "(the module optimizer's learning rate)"
        )
        chosen = FineTuningOptimizer(source, torch.optim.SGD, (({"lr": lr}, tuple(names)),))
        description = f"plain SGD, lr={lr} {source}, {self.phase!r}"
        if description != self._described:
            self._described = description
            rank_zero_info(f"Algorithm {self.algorithm!r} adapts each evaluated client with {description}.")
        return chosen

    def _starting_heads(
        self, trainer: L.Trainer, names: list[str], clients: list[int]
    ) -> Callable[[int], dict[str, Tensor]]:
        federation = self.federation(trainer)
        shared = self._shared(trainer)
        return lambda c: _own_values(federation.evaluation_tensors(c), shared, names)

    def _own_tensors(self, trainer: L.Trainer, client: int) -> dict[str, Tensor]:
        return {n: t.detach().clone() for n, t in self.federation(trainer).evaluation_tensors(client).items()}


def _check_optimizer(optimizer: Any, lr: Any, momentum: Any, weight_decay: Any) -> None:
    if isinstance(optimizer, str) and optimizer in ("module", "sgd"):
        return
    if isinstance(optimizer, str) or not callable(optimizer):
        raise ValueError(
            "FineTunedEvaluation(optimizer=...) must be 'module' (the module's optimizer class and "
            "hyper-parameters), 'sgd' (the SRPFL code's fine-tuning SGD) or a callable params -> Optimizer, "
            f"got {optimizer!r}."
        )
    given = [
        n for n, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)) if v is not None
    ]
    if given:
        raise ValueError(
            f"FineTunedEvaluation({', '.join(given)}=...) overrides the 'module' or 'sgd' optimizer; a callable "
            "optimizer takes its own (e.g. functools.partial(torch.optim.Adam, lr=1e-3)). Set them there."
        )


def _construct(optimizer_class: type[Optimizer], groups: list[dict[str, Any]]) -> Optimizer:
    """``optimizer_class(groups)``; every group carries all hyper-parameters, and a required constructor
    argument (``lr`` of some optimizers) is taken from the first group."""
    parameters = inspect.signature(optimizer_class).parameters
    required = {
        n: groups[0][n]
        for n, p in parameters.items()
        if p.default is inspect.Parameter.empty and n in groups[0] and n != "params"
    }
    return optimizer_class(groups, **required)


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN."""
    return a.shape == b.shape and bool(
        torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    )


def _inputs_and_target(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch of type {type(batch).__name__} is not an (inputs, target, ...) sequence")


def _own_values(
    personal: dict[str, Tensor], shared: dict[str, Tensor], names: list[str]
) -> dict[str, Tensor]:
    return {n: (personal[n] if n in personal else shared[n]).detach().clone() for n in names}


def _training_lr(trainer: L.Trainer, pl_module: L.LightningModule) -> float:
    if trainer.optimizers:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    return configured_learning_rate(pl_module)  # validate/test configure no optimizer
