"""The new-client protocol: fit a head for clients that never trained, over a frozen learned body."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L

from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.federation.module.split import HeadSpec
from lightning_fedrep.lightning.strategy import FederatedStrategy


def evaluate_new_clients(
    model: L.LightningModule,
    datamodule: FederatedDataModule,
    epochs: int | None = 10,
    steps: int | None = None,
    samples: int | None = None,
    head: HeadSpec = None,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> dict[str, float]:
    """Fit each new client's head on (at most ``samples`` of) its training data over the frozen body
    of ``model``, for ``epochs`` epochs (or ``steps`` steps), and return the personalized test summary.

    ``model`` is the federation's model for a client that never trained: typically
    ``strategy.client_model(-1)`` (global body, initial head), or FedAvg's global model. It is not
    modified. The fit runs through :class:`FederatedStrategy` with no federated round and one
    :class:`HeadFineTuning` round (head-only, every new client, nothing aggregated), so the user's
    ``training_step`` and optimizer are used as in training.
    """
    module = copy.deepcopy(model)
    data = datamodule.with_train_samples(samples, seed) if samples is not None else datamodule
    strategy = FederatedStrategy(head=head, clients_per_round=1.0, seed=seed)
    finetuning = HeadFineTuning(epochs=epochs, steps=steps, mode="head")
    settings = dict(
        max_epochs=0,
        callbacks=[finetuning, *trainer_kwargs.pop("callbacks", [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    settings.update(trainer_kwargs)
    trainer = L.Trainer(strategy=strategy, **settings)
    trainer.fit(module, datamodule=data)
    return trainer.test(module, datamodule=data, verbose=False)[0]
