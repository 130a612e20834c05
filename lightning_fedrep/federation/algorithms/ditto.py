"""Ditto (Li et al., ICML 2021), as the official FedRep repository runs it (``main_ditto.py``, ``LocalUpdateDitto``).

Every sampled client first trains the global model as FedAvg does (``local_epochs``; it uploads those weights
and the server takes their sample-weighted mean), then trains its own *personal* model ``v`` on the same data
for as many epochs, each step being the optimizer's step on the loss followed by the pull::

    v <- v - lr * lam * (v_0 - w_global)      v_0: v before the step; w_global: the round-start global model

The pull reads the pre-step weights and bypasses the optimizer (no momentum, no weight decay), as the
official code does. Evaluation scores the personal models.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.objective import GradTransform, Objective, ParamTransform, StepView
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["Ditto"]

SLOT = "personal"


class Ditto(Algorithm):
    """Ditto: a FedAvg global model plus a personal model per client, pulled towards the global one.

    Args:
        lam: the pull's weight λ, ``>= 0`` (the official ``--lam_ditto``, default 1; 0 trains the personal
            models alone).

    The personal model is a declared slot, ``ClientTensors("personal", like="model", init="module")``: it
    starts from the module's initial values ``w^0``, as in the paper's Algorithm 1, and is stored,
    checkpointed and rolled back with the client. The official ``main_ditto.py`` differs here: its ``w_locals``
    hold ``net_glob.state_dict()`` tensors, which *alias* the global model's parameters until a client first
    trains, so a client's personal model starts (and is evaluated, until it trains) from the *current* global
    model; its server also takes the unweighted mean (``w_k / m``; pass ``weighting="uniform"`` for it). The second phase,
    ``Phase("all", epochs=local_epochs, slot="personal")``, makes it live in the module's own parameters;
    its optimizer state starts fresh, as the official code builds a new optimizer for it.

    Runner: sequential. The pull is a parameter transform of the sequential runner (``runner="auto"`` says
    so and runs sequentially; ``runner="vectorized"`` is refused): the lockstep runner does not train
    declared slots.

    ``Trainer(strategy="ditto")`` (and ``"ditto_ddp"``) uses ``Ditto()``; pass another λ as
    ``FederatedStrategy(algorithm=Ditto(lam=0.1))``.
    """

    client_tensors = (ClientTensors(SLOT, like="model", init="module"),)
    evaluation_slot = SLOT

    def __init__(self, lam: float = 1.0):
        super().__init__(
            "ditto",
            {"body", "head"},
            "Ditto: a FedAvg global model, then a personal model per client pulled towards it (lam).",
        )
        self.lam = check_real("lam", lam, 0.0, owner="Ditto")

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """The global model's FedAvg epochs, then the personal model's, both ``local_epochs``."""
        return (Phase("all", epochs=local_epochs), Phase("all", epochs=local_epochs, slot=SLOT))

    def objective(self, phase: str) -> Objective:
        """The pull, applied after each step of the personal slot's phases (none in the global ones). It reads
        the personal weights as they were before the optimizer step: a gradient transform, which runs right
        before the step, keeps a copy of them (and leaves the gradients as they are)."""
        lam = self.lam
        before: dict[str, Tensor] = {}

        def keep(grads: Mapping[str, Tensor], view: StepView) -> dict[str, Tensor]:
            before.clear()
            if view.slot == SLOT and view.lr and lam:
                before.update({n: t.detach().clone() for n, t in view.trained.items() if n in view.server})
            return {}

        def pull(current: Mapping[str, Tensor], view: StepView) -> dict[str, Tensor]:
            if not before:
                return {}
            return {
                n: v - view.lr * lam * (before[n] - view.server[n]) for n, v in current.items() if n in before
            }

        runner = "(sequential runner only)"
        return Objective(
            grad_transforms=(GradTransform(keep, f"Ditto personal weights before the step {runner}", False),),
            param_transforms=(ParamTransform(pull, f"Ditto pull on the personal slot {runner}", False),),
        )

    def __repr__(self) -> str:
        return f"Ditto(lam={self.lam})"


register_algorithm(Ditto())
