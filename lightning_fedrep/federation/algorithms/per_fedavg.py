"""Per-FedAvg (Fallah et al., NeurIPS 2020), as the official FedRep repository runs it (``--alg maml``,
``LocalUpdateMAML``).

Every client trains the whole model; each batch is split into a *support* part (its first ``int(0.8 n)``
rows) and a *query* part (the rest). With ``lr`` the optimizer's learning rate and the inner learning rate
``lr_in = lr * inner_scale`` (official: ``lr * 0.001``), the step's gradient is

* ``step="maml"`` (the paper's, the default)::

      g = grad_w L_query(w - lr_in * grad L_support(w))       (first_order=True: the inner gradient is a constant)

* ``step="official"`` (what the official code computes: it builds the adapted weights but never uses them,
  backpropagating ``L_support(w)`` and ``L_query(w)`` at ``w``)::

      g = grad L_support(w) + grad L_query(w)

and the client's optimizer steps on ``g`` (the official SGD with momentum 0.5: pass it in
``configure_optimizers``). The server takes the sample-weighted mean, as FedAvg. The logged loss is the
objective differentiated (``L_query`` after the inner step, or ``L_support + L_query``).

Runners: both (a :class:`~lightning_fedrep.federation.api.objective.StepRule`, run per client inside the lockstep
runner's ``vmap``). Needs the module's ``fedrep_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.objective import Objective, PureLoss, StepOutcome, StepRule, StepView
from lightning_fedrep.federation.api.registry import register_algorithm
from lightning_fedrep.federation.api.scoring import EvaluationSpec

__all__ = ["PerFedAvg"]

STEPS = ("maml", "official")


class PerFedAvg(Algorithm):
    """Per-FedAvg: every local step is a MAML step on the batch's support/query split (80/20).

    Args:
        step: ``"maml"`` (the paper's meta-gradient) or ``"official"`` (the official code's sum of the
            support and query gradients at ``w``); see the module docstring.
        first_order: with ``step="maml"``, treat the inner gradient as a constant (first-order MAML).
        inner_scale: the inner learning rate as a fraction of the optimizer's (official: 0.001).
        support: the fraction of each batch's rows in the support part (official: 0.8).
        adapt_epochs: epochs of all-parameter training on the client's own data before it is scored
            (official: 5); 0 scores the global model as it is.

    Evaluation scores the global model after ``adapt_epochs`` epochs of plain SGD at the module's learning
    rate on each client's training data (``EvaluationSpec("global", adapt=Phase("all", epochs=5))``); the
    stored model does not change. The official code runs these 5 epochs once, in its extra last round, with
    its momentum-0.5 SGD; here they run before every evaluation, without momentum.

    ``Trainer(strategy="per_fedavg")`` uses ``PerFedAvg()``.
    """

    def __init__(
        self,
        step: Literal["maml", "official"] = "maml",
        first_order: bool = False,
        inner_scale: float = 1e-3,
        support: float = 0.8,
        adapt_epochs: int = 5,
    ):
        super().__init__(
            "per_fedavg",
            {"body", "head"},
            "Per-FedAvg: a MAML step on each batch's 80/20 support/query split; FedAvg server.",
        )
        if step not in STEPS:
            raise ValueError(
                f"PerFedAvg step={step!r} is not one of {STEPS}: 'maml' (the paper's) or 'official'."
            )
        if not isinstance(first_order, bool):
            raise TypeError(f"PerFedAvg first_order must be True or False, got {first_order!r}.")
        self.step, self.first_order = step, first_order
        self.inner_scale = check_real("inner_scale", inner_scale, 0.0, owner="PerFedAvg")
        self.support = check_real("support", support, 0.0, owner="PerFedAvg")
        if not 0 < self.support < 1:
            raise ValueError(
                f"PerFedAvg support={support!r} must lie strictly between 0 and 1 (official: 0.8)."
            )

        if isinstance(adapt_epochs, bool) or not isinstance(adapt_epochs, int) or adapt_epochs < 0:
            raise ValueError(
                f"PerFedAvg adapt_epochs must be an integer >= 0 (official: 5), got {adapt_epochs!r}."
            )
        self.adapt_epochs = adapt_epochs

    def evaluation(self) -> EvaluationSpec:
        """The global model, adapted for ``adapt_epochs`` epochs on each client's data before scoring."""
        if not self.adapt_epochs:
            return EvaluationSpec("global")
        return EvaluationSpec("global", adapt=Phase("all", epochs=self.adapt_epochs))

    def objective(self, phase: str) -> Objective:
        """The MAML (or official) step rule, in every phase."""
        return Objective(step=StepRule(self._grads, f"Per-FedAvg {self.step} step"))

    def _grads(self, loss: PureLoss, view: StepView, x: Tensor, y: Tensor) -> StepOutcome:
        support, query = self._split(view.mask, x)
        rest = dict(view.tensors)

        def at(w: Mapping[str, Tensor], rows: Tensor) -> Tensor:
            return loss({**rest, **w}, x, y, rows)

        if self.step == "official":

            def both(w: dict[str, Tensor]) -> Tensor:
                return at(w, support) + at(w, query)

            grads, value = torch.func.grad_and_value(both)(dict(view.trained))
            return StepOutcome(grads, value)
        lr_in = (0.0 if view.lr is None else view.lr) * self.inner_scale

        def outer(w: dict[str, Tensor]) -> Tensor:
            inner = torch.func.grad(lambda u: at(u, support))(w)
            if self.first_order:
                inner = {n: g.detach() for n, g in inner.items()}
            return at({n: w[n] - lr_in * inner[n] for n in w}, query)

        grads, value = torch.func.grad_and_value(outer)(dict(view.trained))
        return StepOutcome(grads, value)

    def _split(self, mask: Tensor | None, x: Tensor) -> tuple[Tensor, Tensor]:
        """The support and query rows as masks: the first ``int(support * n)`` of the ``n`` real rows, the rest
        (tensor ops only, so the rule also runs per client inside the lockstep runner's ``vmap``)."""
        if mask is None:  # the sequential runner: every row is real
            n = x.shape[0]
            if not 0 < int(self.support * n) < n:
                raise ValueError(
                    f"Per-FedAvg splits each batch {self.support:g}/{1 - self.support:g} into support and query "
                    f"rows; a batch of {n} rows leaves one part empty: use batches of at least 2 rows."
                )
            mask = x.new_ones(n, dtype=torch.get_default_dtype())
        k = torch.floor(self.support * mask.sum().double())
        position = torch.cumsum(mask, 0) - 1
        support = mask * (position < k).to(mask.dtype)
        return support, mask - support

    def __repr__(self) -> str:
        return (
            f"PerFedAvg(step={self.step!r}, first_order={self.first_order}, inner_scale={self.inner_scale}, "
            f"support={self.support}, adapt_epochs={self.adapt_epochs})"
        )


register_algorithm(PerFedAvg())
