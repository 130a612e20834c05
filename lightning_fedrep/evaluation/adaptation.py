"""``EvaluationAdaptation``: the adaptation an algorithm's ``EvaluationSpec.adapt`` asks for before each client
is scored (Per-FedAvg's epochs, HF-MAML's one step), on the fine-tuning machinery of
:class:`~lightning_fedrep.evaluation.finetuning.ClientFineTuning`. No Lightning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.evaluation.finetuning import (
    ClientFineTuning,
    FineTuningContext,
    own_values,
    training_lr,
)
from lightning_fedrep.evaluation.finetuning_optimizer import FineTuningOptimizer
from lightning_fedrep.federation.api.algorithm import PART_GROUPS


class EvaluationAdaptation(ClientFineTuning):
    """The adaptation an algorithm asks for before evaluation (``EvaluationSpec.adapt``: Per-FedAvg's epochs,
    HF-MAML's one step): before each validation and test (never the sanity check), every evaluated client's
    scored model trains the phase's part (``"all"``, ``"head"``, ``"body"``) on the client's own training data
    for the phase's epochs or steps, with plain SGD (no momentum, no weight decay) at ``lr`` (``None``: the
    module optimizer's learning rate), and evaluation scores the result; the stored state does not change.

    :class:`~lightning_fedrep.evaluation.finetuning.ClientFineTuning`'s machinery with the spec's tuned part,
    start (the scored model) and optimizer. The strategy creates it at its ``setup`` and runs it before each
    pass (it is not one of the Trainer's callbacks).

    Args:
        algorithm: the algorithm's name, in messages.
        phase: the spec's ``adapt`` (a ``Phase``: the part it trains, its epochs or steps).
        lr: the spec's ``adapt_lr`` (``None``: the module optimizer's learning rate).
        context_of: builds a pass's :class:`~lightning_fedrep.evaluation.finetuning.FineTuningContext` from
            what :meth:`adapt` is handed (the Lightning face's ``finetuning_context(trainer, module)``).
    """

    _what = "scored model"

    def __init__(
        self, algorithm: str, phase: Any, lr: float | None, context_of: Callable[..., FineTuningContext]
    ):
        super().__init__(epochs=max(1, phase.epochs or 1), lr=lr, cache_features=phase.train == "head")
        self.owner = "EvaluationSpec.adapt"
        self.epochs = phase.epochs if phase.epochs is not None else 1
        self.steps = phase.steps
        self.phase = phase
        self.algorithm = algorithm
        self.context_of = context_of

    def setup(self, context: FineTuningContext) -> None:
        """At the strategy's ``setup``, before anything runs: refuse a module without a declared loss, data
        without clients, or a part without parameters (``context``: the run's)."""
        self.prepare(context.module, context.data)
        self._tuned_names(context)

    def adapt(self, *run: Any) -> None:
        """Adapt every evaluated client and have the coming evaluation score the adapted models (``run``: what
        ``context_of`` builds this pass's context from, the face's Trainer and module)."""
        context = self.context_of(*run)
        federation = context.federation
        self.last_round = federation.round_index  # seeds the batches
        tuned = self.tune(context)
        federation.set_evaluation_tensors(
            {c: {**federation.evaluation_tensors(c), **t} for c, t in tuned.items()}
        )

    def _what_for(self, module_name: str) -> str:
        return (
            f"Algorithm {self.algorithm!r} adapts each client's scored model before evaluation "
            f"(EvaluationSpec.adapt={self.phase!r}) on {module_name}"
        )

    def _refusal_words(self, module_name: str) -> tuple[str, str, str]:
        what_for = self._what_for(module_name)
        return f"{what_for} with its per-sample loss", what_for, ""

    def _tuned_names(self, context: FineTuningContext) -> list[str]:
        """The parameters of the phase's part (``"all"``: every trainable group)."""
        federation = context.federation
        parameters = dict(context.module.named_parameters())
        groups = PART_GROUPS[self.phase.train]
        names = [
            n
            for n in federation.shared_names + federation.local_names
            if n in parameters and federation.split.group(n) in groups
        ]
        if not names:
            raise ValueError(
                f"{self._what_for(type(context.module).__name__)}, but its part {self.phase.train!r} holds no "
                "parameters: adapt 'all', or pass head=... to the strategy."
            )
        return names

    def _fine_tuning_optimizer(self, context: FineTuningContext, names: list[str]) -> FineTuningOptimizer:
        """Plain SGD at ``lr`` (the module optimizer's learning rate when ``None``); a log line names it."""
        lr = self.lr if self.lr is not None else training_lr(context)
        source = (
            "(EvaluationSpec.adapt_lr)" if self.lr is not None else "(the module optimizer's learning rate)"
        )
        chosen = FineTuningOptimizer(source, torch.optim.SGD, (({"lr": lr}, tuple(names)),))
        description = f"plain SGD, lr={lr} {source}, {self.phase!r}"
        if description != self._described:
            self._described = description
            context.info(f"Algorithm {self.algorithm!r} adapts each evaluated client with {description}.")
        return chosen

    def _starting_heads(
        self, context: FineTuningContext, names: list[str], clients: list[int]
    ) -> Callable[[int], dict[str, Tensor]]:
        federation = context.federation
        shared = federation.global_view()
        return lambda c: own_values(federation.evaluation_tensors(c), shared, names)

    def _own_tensors(self, context: FineTuningContext, client: int) -> dict[str, Tensor]:
        return {n: t.detach().clone() for n, t in context.federation.evaluation_tensors(client).items()}
