"""``NeuralCollapse``: FLUTE's neural-collapse penalties, its server step and NC metrics, as a callback.

FLUTE (Liu, Shen & Yang, ICML 2024) is FedRep's family (shared body, personal linear heads) with a
different local loss, an optional server-side step on the heads, and its own local schedule. The
loss and the server step come from this callback; the schedule is the strategy's ``phases``.

Schedules (``FederatedStrategy(algorithm="fedrep", phases=[...])``; the body is averaged, heads stay local):

=================  ====================================================  ==========================================
variant            ``phases``                                            official code flags
=================  ====================================================  ==========================================
FLUTE, CIFAR-10    ``[{train: all, epochs: 1}]``                         ``--local_ep 1 --local_rep_ep 1``
FLUTE*, CIFAR-10   ``[{train: head, epochs: 10}, {train: all, epochs: 1}]``  ``--local_ep 11 --local_rep_ep 1``
FLUTE, CIFAR-100   ``[{train: all, epochs: 5}]``                         ``--local_ep 5 --local_rep_ep 5``
FLUTE*, CIFAR-100  ``[{train: head, epochs: 10}, {train: all, epochs: 5}]``  ``--local_ep 15 --local_rep_ep 5``
=================  ====================================================  ==========================================

FLUTE* runs the head-only epochs first, as the official code does; the paper's text describes the
opposite order (joint epochs first, then 10 head-only epochs): swap the two phases for that. ``all``
epochs train body and head jointly (FedPer-like), unlike FedRep's ``body`` epochs (head frozen).
Recipes for the paper's Table 1: ``recipes/flute/``.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_fedrep.callbacks.neural_collapse_metrics import (
    class_masks,
    global_nc2,
    local_nc2,
    nc1,
    nc3,
    nc_regularizer,
    server_nc_step,
)
from lightning_fedrep.data.module import dataset_labels
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.arguments import (
    check_bool,
    check_choice,
    check_int,
    check_optional_int,
    check_real,
)
from lightning_fedrep.federation.api.objective import LossTerm, Objective, StepView
from lightning_fedrep.federation.plan import round_generator
from lightning_fedrep.lightning.callback import FederatedCallback

__all__ = ["NeuralCollapse"]


class NeuralCollapse(FederatedCallback):
    """FLUTE's neural-collapse regularisation and metrics for any module whose head is a linear classifier.

    **Penalties** (added to every client's training loss, :meth:`objective`)::

        λ R(W_i) + μ ||W_i||_F^2            every local step (head-only and joint epochs)
        + ν ||φ(X)||_F^2                    only while the body trains (phases "body" and "all")

    with ``W_i`` the client's classifier weight (``K x k``, no bias), ``R`` FLUTE's ETF-Gram regulariser
    (``lightning_fedrep.callbacks.neural_collapse_metrics.nc_regularizer``; the masked global
    K-simplex target, not squared),
    ``e_i`` the classes present in the client's *training data* (read from the data module when fit
    starts), and ``φ(X)`` the classifier's input on the current batch, summed over the batch (the input of
    ``features_module``, which both runners hand to the loss term). The official code's defaults: ``λ = 0.25``,
    ``μ = 0.0025``, ``ν = 0.0005``.

    **Server step** (``server_step=True``; the official code's ``--server_update 1``, off by default there
    too): after each round is aggregated, one gradient step of size ``server_lr`` on
    ``(1/n) sum_{i in S_t} R(W_i)`` over the round's participating clients' classifier weights (biases
    untouched), ``n = |S_t|`` (``server_weighting="participants"``, the code) or ``N``
    (``"all"``, the paper's ``1/N``). It runs in ``on_train_epoch_end``, i.e. after the round's validation,
    as in the code (local training, aggregation, evaluation, server step, NC metrics). Fine-tuning rounds
    (``RoundSpec(aggregate=False)``, e.g. ``HeadFineTuning``) get no server step.

    **Metrics** (logged after every ``metrics_every_n_rounds``-th round, after the server step, over
    *all* clients' current classifiers; ``lightning_fedrep.callbacks.neural_collapse_metrics`` has the
    formulas):

    * ``nc/global_nc2``: ``(1/N) sum_i R(W_i)``, the paper's Global NC2 (distance to the global optimum);
    * ``nc/local_nc2``: the same with the local S-simplex target, the paper's Averaged Local NC2
      (``S = local_classes``, the code's ``shard_per_user``, or by default each client's class count);
    * ``nc/nc1``: Papyan's ``tr(Σ_W Σ_B^+)/C`` of the features of every client's training samples (at
      most ``metrics_samples`` per client, a fixed seeded subset) under that client's model (global
      body plus its local part), pooled over clients;
    * ``nc/nc3``: ``||Ŵ_i/||Ŵ_i|| - M̂_i/||M̂_i||||_F^2`` (head rows vs globally centred class means, on
      the client's classes), averaged over clients.

    ``feature_metrics=False`` skips NC1/NC3 (they need a forward pass over the clients' data). A round
    with a ``RoundSpec`` prefix logs under it (``finetune/nc/...``). Every logged round is kept in
    :attr:`history` (saved in checkpoints) and recorded as columns of the strategy's history.

    Args:
        lam, mu, nu: weights of ``R(W_i)``, ``||W_i||_F^2`` and ``||φ(X)||_F^2``; ``0`` turns a term off
            (all three ``0`` gives the metrics alone, e.g. for a FedRep baseline).
        server_step, server_lr, server_weighting: the server step (see above).
        classifier: module name of the linear classifier; by default the one ``nn.Linear`` that owns
            the strategy's head parameters (``split.head``).
        features_module: module whose *input* is ``φ(X)``; by default the classifier. For
            ``lightning_fedrep.models.CIFAR100CNN`` use ``"drop"`` to penalise the features before
            its dropout, as the official code does.
        num_classes: ``K``; by default the classifier's number of rows.
        local_classes: ``S`` of the Local NC2 target (see above).
        log_metrics, feature_metrics, metrics_every_n_rounds: what to measure and how often.
        metrics_samples: training samples per client used for NC1/NC3.
        metrics_split: which split of each client the NC1/NC3 features come from (``"train"``, ``"val"``
            or ``"test"``); note that the CIFAR data modules' training split is read with augmentation.
        metrics_batch_size: batch size of that forward pass.
        seed: seeds the choice of the metric samples.
    """

    def __init__(
        self,
        lam: float = 0.25,
        mu: float = 0.0025,
        nu: float = 0.0005,
        server_step: bool = False,
        server_lr: float = 0.5,
        server_weighting: Literal["participants", "all"] = "participants",
        classifier: str | None = None,
        features_module: str | None = None,
        num_classes: int | None = None,
        local_classes: int | None = None,
        log_metrics: bool = True,
        feature_metrics: bool = True,
        metrics_every_n_rounds: int = 1,
        metrics_samples: int = 100,
        metrics_split: Literal["train", "val", "test"] = "train",
        metrics_batch_size: int = 256,
        seed: int = 0,
    ):
        owner = "NeuralCollapse"
        for name, value in (("lam", lam), ("mu", mu), ("nu", nu), ("server_lr", server_lr)):
            check_real(name, value, low=0.0, owner=owner)
        for name, flag in (
            ("server_step", server_step),
            ("log_metrics", log_metrics),
            ("feature_metrics", feature_metrics),
        ):
            check_bool(name, flag, owner=owner)
        check_choice("server_weighting", server_weighting, ("participants", "all"), owner=owner)
        check_choice("metrics_split", metrics_split, ("train", "val", "test"), owner=owner)
        for name, text in (("classifier", classifier), ("features_module", features_module)):
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{owner}({name}=...) must be a module name or None, got {text!r}.")
        check_optional_int("num_classes", num_classes, minimum=2, owner=owner)
        check_optional_int("local_classes", local_classes, minimum=1, owner=owner)
        if num_classes is not None and local_classes is not None and local_classes > num_classes:
            raise ValueError(
                f"{owner}(local_classes=...) must be at most num_classes={num_classes}, got {local_classes}."
            )
        check_int("metrics_every_n_rounds", metrics_every_n_rounds, minimum=1, owner=owner)
        check_int("metrics_samples", metrics_samples, minimum=1, owner=owner)
        check_int("metrics_batch_size", metrics_batch_size, minimum=1, owner=owner)
        check_int("seed", seed, owner=owner)
        self.lam, self.mu, self.nu = float(lam), float(mu), float(nu)
        self.server_step = server_step
        self.needs_every_client = server_step or log_metrics  # every head, on every process
        self.server_lr = float(server_lr)
        self.server_weighting = server_weighting
        self.classifier = classifier
        self.features_module = features_module
        self.num_classes = num_classes
        self.local_classes = local_classes
        self.log_metrics = log_metrics
        self.feature_metrics = feature_metrics
        self.metrics_every_n_rounds = metrics_every_n_rounds
        self.metrics_samples = metrics_samples
        self.metrics_split = metrics_split
        self.metrics_batch_size = metrics_batch_size
        self.seed = seed

        self.masks: Tensor | None = None
        """``e_i`` of every client, ``(N, K)`` floats (set when fit starts)."""
        self.weight_name: str | None = None
        """Parameter name of the classifier weight (e.g. ``"fc3.weight"``)."""
        self.history: list[dict[str, float]] = []
        """One entry per measured round: ``{"round": r, "nc/global_nc2": ..., ...}``."""
        self.server_round = -1
        """The last round whose server step was applied."""
        self._trainer: L.Trainer | None = None
        self._hook: Any = None
        self._collected: list[Tensor] | None = None
        self._device_masks: Tensor | None = None
        self._metric_samples: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Keep the Trainer: :meth:`objective`, asked at the strategy's ``setup`` right after, finds the
        classifier in its module (which ``configure_model`` may build only after this hook)."""
        super().setup(trainer, pl_module, stage)
        self._trainer = trainer

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Find the classifier, hook its input, and read every client's classes from the data."""
        federation = self.federation(trainer)
        name = self._classifier_name(pl_module, federation)
        classifier = pl_module.get_submodule(name)
        self.weight_name = f"{name}.weight" if name else "weight"
        if self.weight_name not in federation.local_names + federation.shared_names:
            raise ValueError(
                f"{self.weight_name} is neither a client's local tensor nor a shared one; is it frozen?"
            )
        num_classes = self.num_classes or classifier.weight.shape[0]
        if num_classes != classifier.weight.shape[0]:
            raise ValueError(
                f"num_classes={num_classes} but the classifier {name!r} has {classifier.weight.shape[0]} rows."
            )
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "client_data"):
            raise ValueError(
                "NeuralCollapse reads the clients' classes from a FederatedDataModule: pass datamodule=."
            )
        labels_cache: dict[int, Tensor] = {}
        labels = []
        for cid in range(datamodule.num_clients):
            data = datamodule.client_data(cid, "train")
            key = id(data.dataset)
            if key not in labels_cache:
                labels_cache[key] = dataset_labels(data.dataset)
            labels.append(labels_cache[key][data.indices])
        if self.local_classes is not None and self.local_classes > num_classes:
            raise ValueError(
                f"NeuralCollapse(local_classes=...) must be at most the {num_classes} classes, got {self.local_classes}."
            )
        if self.log_metrics and self.feature_metrics and self.metrics_split != "train":
            try:
                datamodule.client_data(0, self.metrics_split)
            except ValueError as error:
                raise ValueError(
                    f"NeuralCollapse(metrics_split={self.metrics_split!r}) but the data has no such split ({error}) "
                    "Use metrics_split='train', or give the data module that split (val_fraction=... for 'val')."
                ) from None
        self.masks = class_masks(labels, num_classes)
        self._device_masks = None
        self._metric_samples = {}
        features = self.features_module if self.features_module is not None else name
        self._remove_hook()
        self._hook = pl_module.get_submodule(features).register_forward_pre_hook(self._make_hook())

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = None
        if stage == "fit":
            self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _make_hook(self) -> Any:
        callback = self  # a closure, not a bound method: deep copies of the module share it, never copy us

        def capture_input(module: nn.Module, args: tuple) -> None:
            if not args or not isinstance(args[0], Tensor):
                return
            if callback._collected is not None:
                callback._collected.append(args[0].detach())

        return capture_input

    def _classifier_name(self, pl_module: L.LightningModule, federation: Federation) -> str:
        if self.classifier is not None:
            name = self.classifier
        else:
            head = federation.split.head
            owners = list(dict.fromkeys(p.rpartition(".")[0] for p in head))
            linear = [o for o in owners if isinstance(pl_module.get_submodule(o), nn.Linear)]
            if len(linear) != 1:
                raise ValueError(
                    f"NeuralCollapse needs one linear classifier; the strategy's head {list(head)} has "
                    f"{len(linear)} nn.Linear owners {linear}. Pass classifier='<module name>'."
                )
            name = linear[0]
        if not isinstance(pl_module.get_submodule(name), nn.Linear):
            raise TypeError(
                f"classifier {name!r} must be an nn.Linear, got {type(pl_module.get_submodule(name))}."
            )
        return name

    # ------------------------------------------------------------------ penalties
    def _masks_on(self, device: torch.device) -> Tensor:
        if self._device_masks is None or self._device_masks.device != device:
            self._device_masks = self.masks.to(device)
        return self._device_masks

    def objective(self, phase: str) -> Objective:
        """The penalties as one vmappable :class:`LossTerm` (both runners), for every phase:
        ``λ R(W_i) + μ ||W_i||_F^2 (+ ν ||φ(X)||_F^2 when the body trains)``.

        ``W_i`` is the client's classifier weight in the view's tensors, ``e_i`` the row ``client`` of the
        ``(N, K)`` class-mask table (read from the data at fit start), and ``φ(X)`` the view's features: the
        input of ``features_module`` (the classifier by default), summed over the batch's real rows only
        (padding masked on the lockstep runner). The features are asked for only when ``nu > 0``: the
        lockstep runner then needs a feature split whose features are exactly that input, and otherwise
        runs sequentially (``runner="auto"``)."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(
                "NeuralCollapse.objective(phase) is asked at the strategy's setup, after NeuralCollapse.setup("
                "trainer, pl_module, stage) kept the Trainer; call setup first."
            )
        name = self._classifier_name(trainer.lightning_module, self.federation(trainer))
        weight_name = f"{name}.weight" if name else "weight"
        feature_term = bool(self.nu) and phase in ("body", "all")
        callback = self  # a closure over the callback: its masks are read from the data at fit start

        def penalties(view: StepView) -> Tensor | None:
            if callback.masks is None:
                return None
            extra: Tensor | None = None
            if callback.lam or callback.mu:
                weight = view.tensors[weight_name]
                if callback.lam:
                    table = callback._masks_on(weight.device)
                    client_mask = (
                        torch.index_select(table, 0, view.client.reshape(1)).squeeze(0).to(weight.dtype)
                    )
                    extra = callback.lam * nc_regularizer(weight, client_mask)
                if callback.mu:
                    value = callback.mu * weight.square().sum()
                    extra = value if extra is None else extra + value
            if feature_term:
                features = view.features
                squares = features.square()
                if view.mask is not None:  # padding rows of a lockstep batch do not count
                    squares = squares * view.mask.to(features.dtype).reshape(
                        -1, *([1] * (features.dim() - 1))
                    )
                value = callback.nu * squares.sum()
                extra = value if extra is None else extra + value
            return extra

        features_of = self.features_module if self.features_module is not None else name
        term = LossTerm(
            penalties,
            "NeuralCollapse penalties",
            needs_features=self.nu > 0,
            features_of=features_of,
        )
        return Objective(terms=(term,))

    # ------------------------------------------------------------------ server step
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Catch up a server step that a checkpoint saved between validation and the step missed."""
        previous = trainer.current_epoch - 1
        if self.server_step and previous >= 0 and self.server_round < previous:
            self._apply_server_step(trainer, previous)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        round_index = trainer.current_epoch
        if self.server_step:
            self._apply_server_step(trainer, round_index)
        if self.log_metrics and self._measure_round(trainer, round_index):
            self._log_metrics(trainer, pl_module, round_index)

    def _measure_round(self, trainer: L.Trainer, round_index: int) -> bool:
        last = trainer.fit_loop.max_epochs is not None and round_index == trainer.fit_loop.max_epochs - 1
        return (round_index + 1) % self.metrics_every_n_rounds == 0 or last

    def _apply_server_step(self, trainer: L.Trainer, round_index: int) -> None:
        self.server_round = round_index
        plan = self.strategy(trainer).round_plan(round_index)
        if not plan.federated:
            return
        clients = plan.clients
        if not clients:
            return
        federation = self.federation(trainer)
        masks = self.masks[clients]
        normalizer = federation.num_clients if self.server_weighting == "all" else len(clients)
        if self.weight_name in federation.local_names:
            heads = torch.stack([federation.client_tensors(c)[self.weight_name] for c in clients])
            new = server_nc_step(heads, masks.to(heads), self.server_lr, normalizer)
            for client, weight in zip(clients, new):
                federation.update_client(client, {self.weight_name: weight})
        else:  # a shared classifier (FedAvg, LG-FedAvg): one weight, every participant's R on it
            weight = federation.global_tensors()[self.weight_name].requires_grad_(True)
            loss = nc_regularizer(weight.expand(len(clients), *weight.shape), masks.to(weight)).sum()
            (grad,) = torch.autograd.grad(loss / normalizer, weight)
            federation.update_global({self.weight_name: (weight - self.server_lr * grad).detach()})

    # ------------------------------------------------------------------ metrics
    def _all_heads(self, federation: Federation) -> Tensor:
        if self.weight_name in federation.local_names:
            return torch.stack(
                [federation.client_tensors(c)[self.weight_name] for c in range(federation.num_clients)]
            )
        weight = federation.global_tensors()[self.weight_name]
        return weight.expand(federation.num_clients, *weight.shape)

    @torch.no_grad()
    def compute_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """The NC metrics of the current state of ``trainer``'s federation, whose live module is
        ``pl_module`` (what ``on_train_epoch_end`` logs)."""
        heads = self._all_heads(self.federation(trainer)).detach().double().cpu()
        masks = self.masks.double()
        metrics = {
            "nc/global_nc2": float(global_nc2(heads, masks)),
            "nc/local_nc2": float(local_nc2(heads, masks, self.local_classes)),
        }
        if self.feature_metrics:
            features, labels = self._client_features(trainer, pl_module)
            metrics["nc/nc1"] = float(nc1(features, labels))
            metrics["nc/nc3"] = float(nc3(heads, masks, features, labels))
        return metrics

    def _log_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int) -> None:
        metrics = self.compute_metrics(trainer, pl_module)
        prefix = self.strategy(trainer).round_plan(round_index).prefix
        values = {prefix + k: v for k, v in metrics.items()}
        self.history = [h for h in self.history if h["round"] != round_index] + [
            {"round": round_index, **values}
        ]
        self.record(trainer, **values)
        for key, value in values.items():
            pl_module.log(
                key, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=trainer.world_size > 1
            )

    def _samples(self, datamodule: Any, client: int) -> tuple[Any, Tensor]:
        """A fixed, seeded subset of at most ``metrics_samples`` of the client's ``metrics_split`` samples."""
        data = datamodule.client_data(client, self.metrics_split)
        if client not in self._metric_samples:
            order = torch.randperm(len(data), generator=round_generator(self.seed, -7, client))
            self._metric_samples[client] = data.indices[order[: self.metrics_samples]].sort().values
        return data.dataset, self._metric_samples[client]

    def _client_features(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[Tensor, Tensor]:
        """Features (the features module's input) and labels of every client's metric samples, each
        under that client's model: the global shared part plus the client's local part."""
        federation = self.federation(trainer)
        datamodule = trainer.datamodule
        device = pl_module.device
        shared = federation.global_tensors()
        all_features, all_labels = [], []
        was_training = pl_module.training
        pl_module.eval()
        self._collected = []
        try:
            for client in range(federation.num_clients):
                tensors = {**shared, **federation.client_tensors(client)}
                dataset, index = self._samples(datamodule, client)
                for x, y in self._batches(dataset, index):
                    self._collected.clear()
                    torch.func.functional_call(pl_module, tensors, (x.to(device),), strict=False)
                    if not self._collected:
                        raise RuntimeError("The model's forward never ran the features module.")
                    all_features.append(self._collected[-1].flatten(1).double().cpu())
                    all_labels.append(torch.as_tensor(y).long().cpu())
        finally:
            self._collected = None
            pl_module.train(was_training)
        return torch.cat(all_features), torch.cat(all_labels)

    def _batches(self, dataset: Any, index: Tensor) -> Any:
        size = self.metrics_batch_size
        if isinstance(dataset, TensorDataset):
            for start in range(0, len(index), size):
                chunk = index[start : start + size]
                yield dataset.tensors[0][chunk], dataset.tensors[1][chunk]
            return
        loader = DataLoader(Subset(dataset, index.tolist()), batch_size=size, shuffle=False)
        for batch in loader:
            yield batch[0], batch[1]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history], "server_round": self.server_round}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self.server_round = int(state_dict.get("server_round", -1))
