"""The personalized evaluation passes of a federated strategy (validation, test), Lightning-free.

:class:`FederatedEvaluation` owns what lives from one pass to the next: the evaluation loader it serves, the
batched evaluation chosen for it, the algorithm's adaptation before a pass, the pass under way, and every
stage's last per-client metrics (``strategy.client_metrics``). The strategy creates it and calls it from its
hooks; what needs Lightning (the user's step, ``module.log``, the Trainer's counters) is handed in.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from lightning_fedrep.evaluation.metrics import CaptureLogs, ClientMetrics, EvaluationPass
from lightning_fedrep.evaluation.records import gather_pass, non_finite_note, partial_pass_note, pass_values
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.sharding import IdleStep

PASS_VERBS = {
    "validate": ("scores every client with", "score"),
    "test": ("scores every client with", "score"),
    "predict": ("predicts with", "predict with"),
}
"""What a pass does with a model, for :func:`module_alone_note`: ``(sentence verb, infinitive)`` by call."""


class FederatedEvaluation:
    """The evaluation passes of one strategy, and the per-client metrics they leave.

    Args:
        capture: captures the user's step's ``self.log`` per client (the Lightning side).
        batch_size: counts a batch's samples (the Lightning side).
    """

    def __init__(self, capture: CaptureLogs, batch_size: Callable[[Any], int]):
        self._capture, self._batch_size = capture, batch_size
        self.client_metrics: dict[str, ClientMetrics] = {}
        """Per stage (``"val"``, ``"test"``, ``"sanity"``, ``"finetune/val"``), the last pass's per-client metrics."""
        self.loader: Any = None
        """The evaluation loader being served (an ``EvalLoader``; ``None`` before any evaluation)."""
        self.batched: Any = None
        """The batched evaluation of :attr:`loader`'s client chunks (``None``: one batch per step)."""
        self.adaptation: Any = None
        """What adapts each client's scored model before a pass (``EvaluationSpec.adapt``), or ``None``."""
        self.current: EvaluationPass | None = None
        """The pass under way (``None`` between passes)."""
        self.module_alone = False
        """Whether the evaluated state is the given module's own weights alone (no fit, no checkpoint)."""

    def take_state(self, federation: Federation, device: Any, fit: bool, restored: bool) -> None:
        """At ``setup``: the federation takes its state (the module's weights the first time, else what it
        holds, moved to ``device``); :attr:`module_alone` says whether that is the given module's weights alone,
        taken by a ``validate``/``test``/``predict`` that neither fitted nor restored a checkpoint. A later
        evaluation by the same strategy still holds the module's weights, untrained as a federation."""
        self.module_alone = not fit and not restored and (self.module_alone or not federation.has_state)
        federation.initialize(device)

    def serve(self, loader: Any, batched: Any) -> None:
        """Evaluate ``loader`` from now on, its client chunks with ``batched`` (``None``: per batch)."""
        self.loader, self.batched = loader, batched

    @property
    def evaluated_clients(self) -> list[int]:
        """The clients this process evaluates in the current (or last) pass (``[]`` before any)."""
        return list(self.loader.evaluated_clients) if self.loader is not None else []

    def begin(self, stage: str, federation: Federation, headline: bool, adapt_on: tuple | None) -> None:
        """Before a pass: the federation evaluates the global shared part with each client's own part, adapted
        first where the algorithm asks for it (``adapt_on``: the adaptation's ``(trainer, module)``; ``None``
        in the sanity check)."""
        federation.begin_evaluation()
        if self.adaptation is not None and adapt_on is not None:
            self.adaptation.adapt(*adapt_on)
        self.current = EvaluationPass(stage, self._capture, self._batch_size, headline=headline)

    def end(self, stage: str, federation: Federation, headline: bool) -> bool:
        """After a pass: keep its per-client metrics, restore training's state; whether the next passes compute
        the headline metrics (``headline``, or ``False`` where this pass turned them off)."""
        evaluation, self.current = self.current, None
        if evaluation is not None:
            headline = evaluation.headline
            if evaluation.metrics.samples:
                self.client_metrics["sanity" if stage == "sanity" else evaluation.key] = (
                    evaluation.named_metrics()
                )
        federation.end_evaluation()
        return headline

    def step(
        self,
        batch: Any,
        batch_idx: int,
        module: nn.Module,
        federation: Federation,
        user_step: Callable[[], Any],
        context: Callable[[], AbstractContextManager],
    ) -> Any:
        """One evaluation batch: a chunk of clients evaluated together (the loader yields chunks exactly when
        :attr:`batched` is set), nothing on an idle step (this process has evaluated all its clients), else
        the user's step on the batch's client's personalized model (with the algorithm's forward, if any)."""
        evaluation = self.current
        if isinstance(batch, IdleStep):
            return None
        if self.batched is not None:
            self.batched.add(batch, module, federation, evaluation.metrics, evaluation.stage, context)
            return None
        client = self.loader.client_of(batch_idx)
        federation.evaluate_client(client)
        with federation.scoring(module, client):
            return evaluation.step(module, user_step, batch, client, context)

    def finish(
        self,
        federation: Federation,
        collective: Collective,
        plan_of: Callable[[int], RoundPlan],
        in_fit: bool,
        cut: tuple[int | None, str] | None,
        warn: Callable[[str], None],
    ) -> dict[str, tuple[float, dict[str, Any]]]:
        """After a pass's last batch: gather it over the processes, keep its per-client metrics (complete now:
        callbacks' ``on_*_end`` hooks run before the strategy's), warn what it could not score, and record a
        validation in fit (``in_fit``) in the history; every value to log, with its logging options.
        ``cut``: the batches Lightning ran and why it may have cut the pass short (``None`` in the sanity
        check). A fine-tuning round's names take its prefix (``client_metrics["finetune/val"]``)."""
        evaluation = self.current
        if collective.distributed:
            gather_pass(evaluation, collective.all_gather_object)
        prefix = ""
        if evaluation.stage == "val" and federation.round_index >= 0 and federation.client_sizes is not None:
            prefix = plan_of(federation.round_index).prefix
        evaluation.name_under(prefix)
        if evaluation.metrics.samples:
            self.client_metrics["sanity" if cut is None else evaluation.key] = evaluation.named_metrics()
        notes = [non_finite_note(evaluation), evaluation.nothing_logged_note()]
        if cut is not None:
            notes.insert(0, self._partial_pass_note(*cut))
        for note in notes:
            if note is not None:
                warn(note)
        values = pass_values(evaluation, federation.history, federation.round_index, prefix, in_fit)
        return {
            key: (value, evaluation.logging_options(key.removeprefix(prefix)))
            for key, value in values.items()
        }

    def _partial_pass_note(self, batches_run: int | None, cause: str) -> str | None:
        """What a pass cut short (``limit_val_batches``, ``fast_dev_run``: ``cause``) evaluated."""
        if self.loader is None:
            return None
        sizes = [len(data) for data in self.loader.clients]
        return partial_pass_note(self.current, sizes, batches_run, len(self.loader), cause)


def module_alone_note(
    federation: Federation, algorithm: Algorithm, module_name: str, call: str, reads_clients: bool
) -> str | None:
    """What ``trainer.<call>()`` of the given module's own weights means when the algorithm keeps a part of
    the model per client: every client gets the module's one copy of that part, as a module restored by
    ``load_from_checkpoint`` and evaluated without ``ckpt_path`` does (``None`` otherwise, and for
    predictions that do not read the clients, ``reads_clients=False``)."""
    personal = [*federation.local_names, *(t.name for t in algorithm.client_tensors)]
    if not personal or (call == "predict" and not reads_clients):
        return (
            None  # predict="new_client" asks for the global part with the initial one: what the module holds
        )
    scores, score = PASS_VERBS.get(call, PASS_VERBS["test"])
    return (
        f"trainer.{call}() {scores} the given module's own weights: this strategy holds no federated state (no "
        f"fit, no ckpt_path), so every client gets the module's one {some_names(personal)}, which algorithm "
        f"{algorithm.name!r} keeps per client. A module from {module_name}.load_from_checkpoint(path) does not "
        "hold the clients' own: they are in the checkpoint's 'lightning_fedrep' entry, which load_from_checkpoint "
        "does not read (its state_dict holds the initial, untrained ones). Pass ckpt_path=path "
        f"(trainer.{call}(model, ckpt_path=path), also with a new Trainer) to {score} every client's own model."
    )


def some_names(names: list[str], shown: int = 4) -> str:
    """``names`` for a message: the first ``shown`` of them, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(name) for name in names[:shown]) + more
