"""HF-MAML, Per-FedAvg's Hessian-free variant (Fallah et al., NeurIPS 2020), as SRPFL's baseline (the official
SRPFL code's ``LocalUpdateHFMAML`` in ``models/Update.py`` and ``test_MAML`` in ``utils/test_utils.py``).

Every client trains the whole model. With ``f_D`` the loss on the rows ``D``, a local step on the batches
``D, D', D''`` computes::

    d = grad f_D'(w - alpha * grad f_D(w))
    g = d - alpha * (grad f_D''(w + delta * d) - grad f_D''(w - delta * d)) / (2 * delta)

and the client's optimizer steps on ``g``: the outer learning rate ``beta`` is the optimizer's (official: plain
SGD, lr 0.1, no momentum, no weight decay: set it in ``configure_optimizers``). The server takes the
sample-weighted mean, as FedAvg. The logged loss is ``f_D'(w - alpha * grad f_D(w))``.

``parts=3`` (the paper's independent ``D, D', D''``, the default): each batch is split into three consecutive
parts (as ``torch.tensor_split(batch, 3)``). With a shuffled loader three consecutive batches of ``B`` rows are
the same draw as one batch of ``3B`` split in three, so a recipe sets the data module's batch size to ``3B``
(official ``B = 10``: 30); an epoch then has a third of the steps. ``parts=1`` is what the official code
computes: ``D = D' = D''``, the whole batch for all three gradients (batch size ``B``).

Not reproduced from the official code (both come from ``net.state_dict()`` aliasing the parameters, which
``load_state_dict`` overwrites; checked by running its loop): its network only takes ``w <- w - alpha *
grad f_D(w)`` steps, and it returns the meta-step of its last batch alone, taken from ``w1 = w - alpha *
grad f_D(w)`` with the one-sided ``(grad f(w1 + delta * d) - grad f(w1)) / (2 * delta)``; its evaluation adds
each client's adaptation step to the global model the next clients start from (and keeps it). It reads
``local_ep``: its ``HFMAML_local_ep`` flag is ignored (the recipes use ``local_ep``, default 5).

Evaluation adapts as SRPFL's ``test_MAML`` does (checked against ``shenzebang/SRPFL`` ``utils/test_utils.py``): from
the global model, one plain SGD step at ``alpha`` on the gradient of one shuffled training batch of the client (the
loader's ``local_bs`` rows), then the client's test split is scored; the reported figure pools the clients' correct
predictions. Two things differ and neither is an adaptation this code skips: ``test_MAML`` runs on ``net_glob``
itself, whose ``state_dict()`` tensors alias its parameters, so each client's step is taken from the model the
previous clients' steps left, and the sum of all the steps stays in the global model that the next round trains
(here every client adapts from the global model, which does not change); and with ``parts=3`` the adaptation batch
is the ``3B`` rows of a training batch (official ``B``), the same expected gradient. Why HF-MAML scores about as
FedAvg on a digits federation (40 clients x 3 classes, 25 rounds: 0.420 against 0.424): the adaptation is one step
at ``alpha = 1e-2``, a tenth of one training step at the official ``beta = 0.1``, so the scored model is within that
step of the global one, and HF-MAML's global model is FedAvg's up to terms of order ``alpha`` (its meta-gradient is
the gradient at ``w - alpha * grad f_D(w)``, corrected by ``alpha`` times a Hessian-vector product). With the
official settings the evaluation cannot personalize much; ``HFMAML(alpha=...)`` takes a larger step (in training's
inner step too).

Runners: both (a :class:`~lightning_fedrep.federation.api.objective.StepRule`, run per client inside the lockstep
runner's ``vmap``). Needs the module's ``fedrep_loss``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["HFMAML"]


class HFMAML(Algorithm):
    """HF-MAML: a MAML step with a finite-difference Hessian-vector product; FedAvg server.

    Args:
        alpha: the inner (adaptation) learning rate (official: 1e-2); also evaluation's adaptation step.
        delta: the finite-difference radius of the Hessian-vector product (official: 1e-3).
        parts: ``3`` splits each batch into the independent ``D, D', D''`` (the paper's); ``1`` uses the whole
            batch for all three (the official code's).

    Evaluation scores the global model after one plain SGD step at ``alpha`` on one batch of each client's
    training data (``EvaluationSpec("global", adapt=Phase("all", steps=1), adapt_lr=alpha)``), as the official
    ``test_MAML``; the stored model does not change. The batch is the data module's (official: ``B = 10``
    rows; with ``parts=3`` it has ``3B``).

    ``Trainer(strategy="hf_maml")`` uses ``HFMAML()``.
    """

    def __init__(self, alpha: float = 1e-2, delta: float = 1e-3, parts: Literal[1, 3] = 3):
        super().__init__(
            "hf_maml",
            {"body", "head"},
            "HF-MAML: a MAML step with a finite-difference Hessian-vector product; FedAvg server.",
        )
        self.alpha = check_real("alpha", alpha, 0.0, low_open=True, owner="HFMAML")
        self.delta = check_real("delta", delta, 0.0, low_open=True, owner="HFMAML")
        if isinstance(parts, bool) or parts not in (1, 3):
            raise ValueError(
                f"HFMAML parts={parts!r} must be 3 (each batch split into D, D', D'': the paper's) or 1 (the "
                "whole batch for all three gradients: the official code's)."
            )
        self.parts = parts

    def evaluation(self) -> EvaluationSpec:
        """The global model after one SGD step at ``alpha`` on one batch of each client's training data."""
        return EvaluationSpec("global", adapt=Phase("all", steps=1), adapt_lr=self.alpha)

    def objective(self, phase: str) -> Objective:
        """The Hessian-free MAML step rule, in every phase."""
        return Objective(step=StepRule(self._grads, "HF-MAML step"))

    def _grads(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        first, second, third = self._split(view.mask, x)
        rest, w = dict(view.tensors), dict(view.trained)

        def grad(at: dict[str, Tensor], rows: Tensor | None) -> tuple[dict[str, Tensor], Tensor]:
            return torch.func.grad_and_value(lambda u: loss({**rest, **u}, x, y, rows))(at)

        g, _ = grad(w, first)
        d, value = grad({n: w[n] - self.alpha * g[n] for n in w}, second)
        plus, _ = grad({n: w[n] + self.delta * d[n] for n in w}, third)
        minus, _ = grad({n: w[n] - self.delta * d[n] for n in w}, third)
        scale = self.alpha / (2 * self.delta)
        return StepOutcome({n: d[n] - scale * (plus[n] - minus[n]) for n in w}, value)

    def _split(self, mask: Tensor | None, x: Tensor) -> tuple[Tensor | None, ...]:
        """``D, D', D''`` as row masks: three consecutive parts of the real rows (tensor ops only, so the rule
        also runs per client inside the lockstep runner's ``vmap``), or the whole batch thrice (``parts=1``)."""
        if self.parts == 1:
            return mask, mask, mask
        if mask is None:  # the sequential runner: every row is real
            if x.shape[0] < 3:
                raise ValueError(
                    f"HF-MAML (parts=3) splits each batch into three parts D, D', D''; a batch of {x.shape[0]} "
                    "rows leaves one empty: use batches of at least 3 rows (3x the official 10), or parts=1."
                )
            mask = x.new_ones(x.shape[0], dtype=torch.get_default_dtype())
        position = torch.cumsum(mask, 0) - 1
        part = torch.floor(3 * position / mask.sum().clamp_min(1.0))
        return tuple(mask * (part == k).to(mask.dtype) for k in range(3))

    def __repr__(self) -> str:
        return f"HFMAML(alpha={self.alpha}, delta={self.delta}, parts={self.parts})"


register_algorithm(HFMAML())
