"""``FineTunedEvaluation``: every evaluation scores each client after fitting its own head (SRPFL's protocol).

The callback is the Lightning side of :class:`~lightning_fedrep.evaluation.finetuning.ClientFineTuning` (the
Lightning-free machinery, shared with the adaptation of an algorithm's ``EvaluationSpec.adapt``): it hands the
machinery a :class:`~lightning_fedrep.evaluation.finetuning.FineTuningContext` built from its Trainer at each
hook."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_fedrep.evaluation.finetuning import ClientFineTuning, FineTuningContext
from lightning_fedrep.evaluation.finetuning_optimizer import (  # noqa: F401  (importable from here too)
    OFFICIAL_MOMENTUM,
    OFFICIAL_WEIGHT_DECAY,
    FineTuningOptimizer,
)
from lightning_fedrep.federation import RoundResult
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.evaluating import finetuning_context


class FineTunedEvaluation(ClientFineTuning, FederatedCallback):
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse, before anything runs, a module without a known loss or data without clients."""
        super().setup(trainer, pl_module, stage)
        self.prepare(pl_module, trainer.datamodule)

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

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Check, before the first round, that a fine-tuning step runs on this module and data (one forward
        and loss on a client's first batch), so a mismatch does not wait for the first validation."""
        if "val" in self.stages:
            self.check_step(self._context(trainer, pl_module))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "val" in self.stages and not trainer.sanity_checking:
            self._fine_tune(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "test" in self.stages:
            self._fine_tune(trainer, pl_module)

    def tuned_names(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """The parameter names of ``pl_module`` each client fine-tunes (its local parameters in ``trainer``'s
        federation, else the head)."""
        return self._tuned_names(self._context(trainer, pl_module))

    def fine_tuning_optimizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> FineTuningOptimizer:
        """The optimizer each client's head fine-tunes with (``optimizer``; ``trainer`` and ``pl_module`` give the
        training's learning rate where it needs one); a log line names it."""
        context = self._context(trainer, pl_module)
        return self._fine_tuning_optimizer(context, self._tuned_names(context))

    def _fine_tune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Fine-tune every evaluated client; the coming evaluation scores the fine-tuned tensors."""
        context = self._context(trainer, pl_module)
        context.federation.set_evaluation_tensors(self.tune(context))

    def _context(self, trainer: L.Trainer, pl_module: L.LightningModule) -> FineTuningContext:
        self.strategy(trainer)  # a clear error without a federated strategy
        return finetuning_context(trainer, pl_module)
