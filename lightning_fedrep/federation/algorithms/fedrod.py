"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022): a shared body with a *generic* head trained with the balanced softmax, and a *personalized* head
per client on top of the generic logits.

What was followed: the authors' repository (github.com/hongyouc/Fed-RoD) releases only a README (no code), and
FLUTE's ``CNNCifarRoD`` is missing from its released ``Nets.py``. The rule here is the plain (linear
personalized head, no hypernetwork) variant as PFLlib implements it (github.com/TsingZ0/PFLlib,
``clientrod.py``, by FedCP's authors). Per local step, on the batch ``(x, y)``, with ``f = body(x)``,
``z_g = W_g f + b_g`` (the module's head) and ``n`` the client's training label counts::

    (a) body, W_g, b_g <- the client's optimizer step on  CE(z_g + log n, y)          (balanced softmax)
    (b) W_p, b_p       <- plain SGD (the same lr) on     CE(z_g.detach() + W_p f.detach() + b_p, y)

both gradients at the step's starting values. The server takes the sample-weighted mean of the body and the
generic head (everything the module has); the personalized head stays with the client. Evaluation scores
``z_g + z_p``, the logits of the head ``(W_g + W_p, b_g + b_p)`` (exact, the heads being linear), with the
current global model and the client's personalized head.

How it is computed (no features needed): ``z_g + log n`` is the module run with its head bias shifted by
``log n``, so (a) is the module's declared loss at ``{b_g: b_g + log n}``; (b)'s gradient in ``(W_p, b_p)`` is
the declared loss's gradient in the head at ``(W_g + W_p, b_g + b_p)`` with the body held fixed. Both need the
module's ``fedrep_loss`` to be the softmax cross-entropy of the head's logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ServerState
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["FedRoD", "client_label_counts"]

SLOT = "phead"
COUNTS = ("data", "batch")
ABSENT = -1e30
"""``log n`` of an absent class: ``exp`` of it is exactly 0 in float32, as ``log 0 = -inf`` (PFLlib), but a
zero-padded lockstep row labelled with such a class stays finite (its loss is masked out)."""


def client_label_counts(datamodule: Any, num_classes: int) -> Tensor:
    """Each client's training label counts, ``[num_clients, num_classes]``, from a ``FederatedDataModule``
    (``client_data(c, "train")``, after its ``setup``): what :class:`FedRoD` reads with ``label_counts="data"``."""
    rows = []
    for client in range(datamodule.num_clients):
        data = datamodule.client_data(client, "train")
        labels = _labels(data.dataset, data.indices)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise ValueError(
                f"client_label_counts: client {client} has labels outside 0..{num_classes - 1}; pass the "
                "model's number of classes as num_classes."
            )
        rows.append(torch.bincount(labels, minlength=num_classes).float())
    return torch.stack(rows)


def _labels(dataset: Any, indices: Tensor) -> Tensor:
    """The labels of ``dataset``'s samples ``indices``: its ``targets`` (torchvision) or a ``TensorDataset``'s
    second tensor read whole, else each sample's second item."""
    tensors = getattr(dataset, "tensors", None)
    targets = getattr(dataset, "targets", None)
    if targets is None and isinstance(tensors, tuple) and len(tensors) >= 2:
        targets = tensors[1]
    if targets is not None:
        return torch.as_tensor(targets)[indices].long()
    return torch.as_tensor([int(dataset[i][1]) for i in indices.tolist()], dtype=torch.long)


def _check_counts(label_counts: object) -> Tensor | str:
    if isinstance(label_counts, str):
        if label_counts not in COUNTS:
            raise ValueError(f"FedRoD(label_counts={label_counts!r}) must be one of {COUNTS} or a tensor.")
        return label_counts
    if not isinstance(label_counts, Tensor) or label_counts.dim() != 2 or label_counts.is_complex():
        raise TypeError(
            "FedRoD(label_counts=...) must be 'data', 'batch' or a [num_clients, num_classes] tensor of each "
            f"client's training label counts (client_label_counts(datamodule, num_classes)), got {label_counts!r}."
        )
    counts = label_counts.detach().float()
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError(
            "FedRoD(label_counts=...) must hold finite counts >= 0 (a client's number of training samples of "
            "each class)."
        )
    return counts


def _linear_head(module: nn.Module, head: tuple[str, ...]) -> nn.Linear:
    """The head's ``nn.Linear``, refusing any other head (FedRoD sums two heads' logits as one linear head)."""
    owner = {name.rpartition(".")[0] for name in head}
    layer = module.get_submodule(next(iter(owner))) if len(owner) == 1 else None
    if not isinstance(layer, nn.Linear) or layer.bias is None or len(head) != 2:
        raise ValueError(
            f"FedRoD needs the module's head to be one linear layer with a bias (nn.Linear(d, C, bias=True)), "
            f"got head parameters {list(head)}: pass head= naming the final nn.Linear."
        )
    return layer


class FedRoD(Algorithm):
    """FedRoD: a FedAvg body and generic head (balanced softmax), and a linear personalized head per client.

    Args:
        label_counts: the ``n`` of the balanced softmax. ``"data"`` (the default, and
            ``Trainer(strategy="fedrod")``): each client's training label counts, read from the Trainer's
            ``FederatedDataModule`` at ``setup`` (PFLlib counts the client's whole training set); ``"batch"``:
            the labels of each step's batch (the same when a client's batch is its whole data set); or a
            ``[num_clients, num_classes]`` tensor (``client_label_counts(datamodule, num_classes)``).

    The personalized head is a declared ``ClientTensors("phead", like="head", init="module")``: it starts as
    a copy of the module's initial head (PFLlib's ``copy.deepcopy(self.model.predictor)``), is updated at every
    step through the step rule's ``client_state``, checkpointed and rolled back with the client.

    Needs the module's ``fedrep_loss`` (softmax cross-entropy) and a head that is one ``nn.Linear`` with a bias
    (``weight [C, d]``, ``bias [C]``): another head, a module without a head split, ``"data"`` without a
    ``FederatedDataModule`` and a table without one column per class are refused at ``setup``, a table without
    one row per client when the first round is planned. Runners: both (the step rule runs per client inside
    the lockstep runner's ``vmap``).

    ``Trainer(strategy="fedrod")`` uses ``FedRoD()``.
    """

    client_tensors = (ClientTensors(SLOT, like="head", init="module"),)

    def __init__(self, label_counts: Tensor | Literal["data", "batch"] = "data"):
        super().__init__(
            "fedrod",
            {"body", "head"},
            "FedRoD: FedAvg body + generic head (balanced softmax), a personalized linear head per client.",
        )
        self.label_counts = _check_counts(label_counts)
        self._table = self.label_counts if isinstance(self.label_counts, Tensor) else None
        self._mode = "table" if self._table is not None else self.label_counts

    @property
    def needs_split(self) -> bool:
        """Always: the personalized head is shaped like the module's head."""
        return True

    def setup(self, module: nn.Module, split: Any, datamodule: Any) -> None:
        """Refuse a head that is not one ``nn.Linear`` with a bias (``split``: the module's ``ParameterSplit``);
        read the clients' label counts (``"data"``)."""
        classes = _linear_head(module, split.head).out_features
        if self._mode == "data":
            if datamodule is None or not hasattr(datamodule, "client_data"):
                raise ValueError(
                    "FedRoD(label_counts='data') reads each client's label counts from a FederatedDataModule: "
                    "pass datamodule= to the Trainer, or give label_counts='batch' or a table."
                )
            self._table = client_label_counts(datamodule, classes)
        elif isinstance(self.label_counts, Tensor) and self.label_counts.shape[1] != classes:
            raise ValueError(
                f"FedRoD(label_counts=...) has {self.label_counts.shape[1]} columns but the head has {classes} "
                "classes: give one column per class."
            )

    def configure_round(self, plan: Any, server: ServerState) -> Any:
        """The plan unchanged; refuses (when the first round is planned) a ``label_counts`` table without one
        row per client."""
        if self._table is not None and self._table.shape[0] != server.num_clients:
            raise ValueError(
                f"FedRoD(label_counts=...) has {self._table.shape[0]} rows but the federation has "
                f"{server.num_clients} clients: give one row per client (client_label_counts(datamodule, "
                "num_classes))."
            )
        return plan

    def evaluation(self) -> EvaluationSpec:
        """The summed logits ``z_g + z_p``: the global model with the head ``(W_g + W_p, b_g + b_p)``."""

        def summed(
            global_: Mapping[str, Tensor], personal: Mapping[str, Tensor], client: int
        ) -> dict[str, Tensor]:
            return {n: global_[n] + p for n, p in personal.items()}

        return EvaluationSpec("mixture", slot=SLOT, mix=summed)

    def objective(self, phase: str) -> Objective:
        """The FedRoD step rule, in every phase."""
        return Objective(step=StepRule(self._step, "FedRoD balanced-softmax and personalized-head step"))

    def _head(self, view: StepView) -> tuple[str, str]:
        """The head's weight and bias names (the personalized head's tensors; ``setup`` checked them)."""
        names = sorted(k[len(SLOT) + 1 :] for k in view.client_state if k.startswith(f"{SLOT}."))
        weight, bias = sorted(names, key=lambda n: -view.tensors[n].dim())
        return weight, bias

    def _log_counts(self, view: StepView, y: Tensor, classes: int, like: Tensor) -> Tensor:
        if self._mode == "batch":
            rows = (y[:, None] == torch.arange(classes, device=y.device)).to(like.dtype)
            counts = (rows if view.mask is None else rows * view.mask[:, None].to(like.dtype)).sum(0)
        elif self._table is None:
            raise RuntimeError("FedRoD reads the clients' label counts in setup(), which has not run.")
        else:
            counts = self._table.to(device=like.device, dtype=like.dtype)[view.client]
        log = counts.clamp_min(torch.finfo(like.dtype).tiny).log()
        return torch.where(counts > 0, log, torch.full_like(counts, ABSENT))

    def _step(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        weight, bias = self._head(view)
        rest, trained = dict(view.tensors), dict(view.trained)
        shift = self._log_counts(view, y, rest[bias].shape[0], rest[bias])

        def generic(t: Mapping[str, Tensor]) -> Tensor:
            full = {**rest, **t}
            return loss({**full, bias: full[bias] + shift}, x, y, view.mask)

        grads, value = torch.func.grad_and_value(generic)(trained)
        personal = {n: view.client_state[f"{SLOT}.{n}"] for n in (weight, bias)}
        summed = {n: rest[n] + personal[n] for n in personal}
        head_grads = torch.func.grad(lambda h: loss({**rest, **h}, x, y, view.mask))(summed)
        lr = 0.0 if view.lr is None else view.lr
        return StepOutcome(grads, value, {f"{SLOT}.{n}": personal[n] - lr * head_grads[n] for n in personal})

    def __repr__(self) -> str:
        counts = self.label_counts
        return f"FedRoD(label_counts={counts if isinstance(counts, str) else tuple(counts.shape)!r})"


register_algorithm(FedRoD())
