"""FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2): FedAdam, FedYogi and
FedAdagrad as server optimizers any algorithm that shares something can take
(``FedRep().with_server_optimizer(FedAdam())``, or ``FederatedStrategy(algorithm="fedrep",
server_optimizer="fedadam")`` from a recipe), and FedAvg with each of them by name (``"fedadam"``,
``"fedyogi"``, ``"fedadagrad"``, and their ``_ddp`` names).

Each round the clients train from x_t as the algorithm says; ``Δ_t`` is what the algorithm's server step
returns minus x_t (FedAvg: the sample-weighted mean of the surviving clients' models minus x_t; under
client-level DP, the private mean's). Then, elementwise over the shared floating-point tensors::

    m_t = β1 m_{t-1} + (1 - β1) Δ_t
    v_t = v_{t-1} + Δ_t²                                    (Adagrad)
    v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)      (Yogi)
    v_t = β2 v_{t-1} + (1 - β2) Δ_t²                        (Adam)
    x_{t+1} = x_t + η m_t / (√v_t + τ)

``variant="paper"`` (the default): m starts at 0 and v at τ² (the paper's v_{-1} ≥ τ², at its bound), no bias
correction. ``variant="flower"``: Flower's strategies (``flwr.server.strategy.fed{adam,yogi,adagrad}``): m and v
start at 0, and FedAdam's η is multiplied by √(1 - β2^(r+1)) / (1 - β1^(r+1)), r the number of server steps so
far counting this one (Flower's ``server_round`` when every round aggregates). Flower's FedAdagrad also fixes
β1 = 0: pass ``beta1=0.0``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.arguments import check_choice, check_real
from lightning_fedrep.federation.api.declared import ServerTensors
from lightning_fedrep.federation.api.exchange import ServerState
from lightning_fedrep.federation.api.registry import (
    get_algorithm,
    register_algorithm,
    register_server_optimizer,
)
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer

__all__ = ["FedAdagrad", "FedAdam", "FedOpt", "FedYogi"]

Variant = Literal["paper", "flower"]
STEPS = "fedopt_steps"
"""The server tensor counting the optimizer's steps (an int64 scalar): FedAdam's bias correction reads it."""


def _filled(name: str, template: Tensor, generator: torch.Generator, value: float) -> Tensor:
    """A declared tensor's ``init``: ``template``'s shape and dtype, every element ``value`` (v_{-1} = τ²)."""
    return torch.full_like(template, value)


class FedOpt(ServerOptimizer):
    """An adaptive server optimizer of Reddi et al.'s Algorithm 2 (subclasses give the second moment's rule).

    Args:
        lr: η, the server learning rate (> 0); default: the subclass's (Flower's: FedAdam and FedAdagrad 0.1,
            FedYogi 0.01; the paper grid-searches η per task).
        beta1: β1, the first moment's decay in [0, 1) (the paper's 0.9).
        beta2: β2, the second moment's decay in [0, 1) (the paper's 0.99; FedAdagrad does not read it).
        tau: τ, the adaptivity (> 0; the paper's usual 1e-3).
        variant: ``"paper"`` (v starts at τ², no bias correction) or ``"flower"`` (m and v start at 0; FedAdam
            corrects η for the bias as Flower does).

    State (declared server tensors over the shared tensors only, by name): ``fedopt_m.<name>``,
    ``fedopt_v.<name>`` and the step count ``fedopt_steps``. Integer shared tensors (BatchNorm's
    ``num_batches_tracked``) take the algorithm's value unchanged.
    """

    name = "fedopt"
    default_lr = 0.1
    bias_correction = False
    """Whether ``variant="flower"`` corrects η for the moments' bias (Flower's FedAdam only)."""

    def __init__(
        self,
        lr: float | None = None,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        variant: Variant = "paper",
    ):
        owner = type(self).__name__
        self.lr = check_real("lr", self.default_lr if lr is None else lr, 0.0, low_open=True, owner=owner)
        self.beta1 = check_real("beta1", beta1, 0.0, 1.0, high_open=True, owner=owner)
        self.beta2 = check_real("beta2", beta2, 0.0, 1.0, high_open=True, owner=owner)
        self.tau = check_real("tau", tau, 0.0, low_open=True, owner=owner)
        self.variant: Variant = check_choice("variant", variant, ("paper", "flower"), owner=owner)

    def second_moment(self, v: Tensor, square: Tensor) -> Tensor:
        """v_t (the rule that names the optimizer), elementwise: ``v`` is v_{t-1}, ``square`` is Δ_t²."""
        raise NotImplementedError

    def server_tensors(self) -> tuple[ServerTensors, ...]:
        """m and v shaped like the shared tensors (v from τ² or 0, per ``variant``), and the step count."""
        v_init: str | Callable = "zeros"
        if self.variant == "paper":
            v_init = functools.partial(_filled, value=self.tau**2)
        return (
            ServerTensors("fedopt_m", like="shared"),
            ServerTensors("fedopt_v", like="shared", init=v_init),
            ServerTensors(STEPS, shapes=(), dtype=torch.int64),
        )

    def step_size(self, steps: int) -> float:
        """η of server step number ``steps`` (1 for the first): Flower's FedAdam corrects it for the bias."""
        if self.variant != "flower" or not self.bias_correction:
            return self.lr
        return self.lr * (1 - self.beta2 ** (steps + 1)) ** 0.5 / (1 - self.beta1 ** (steps + 1))

    def step(self, server: ServerState, new: ServerState) -> tuple[ServerState, dict[str, float]]:
        """x_{t+1} = x_t + η m_t / (√v_t + τ), with Δ_t = ``new.shared`` - x_t."""
        steps = server.tensors[STEPS] + 1
        lr = self.step_size(int(steps))
        shared, tensors = {}, {STEPS: steps}
        for name, start in server.shared.items():
            if not start.is_floating_point():
                continue  # the algorithm's value stands
            delta = new.shared[name] - start
            m = self.beta1 * server.tensors[f"fedopt_m.{name}"] + (1 - self.beta1) * delta
            v = self.second_moment(server.tensors[f"fedopt_v.{name}"], delta.square())
            shared[name] = start + lr * m / (v.sqrt() + self.tau)
            tensors[f"fedopt_m.{name}"], tensors[f"fedopt_v.{name}"] = m, v
        return new.replace(shared=shared, tensors=tensors), {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lr={self.lr!r}, beta1={self.beta1!r}, beta2={self.beta2!r}, tau={self.tau!r}, "
            f"variant={self.variant!r})"
        )


class FedAdam(FedOpt):
    """FedAdam: v_t = β2 v_{t-1} + (1 - β2) Δ_t² (η 0.1 by default, Flower's)."""

    name = "fedadam"
    bias_correction = True

    def second_moment(self, v: Tensor, square: Tensor) -> Tensor:
        return self.beta2 * v + (1 - self.beta2) * square


class FedYogi(FedOpt):
    """FedYogi: v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²) (η 0.01 by default, Flower's)."""

    name = "fedyogi"
    default_lr = 0.01

    def second_moment(self, v: Tensor, square: Tensor) -> Tensor:
        return v - (1 - self.beta2) * square * torch.sign(v - square)


class FedAdagrad(FedOpt):
    """FedAdagrad: v_t = v_{t-1} + Δ_t² (η 0.1 by default, Flower's; β2 unused)."""

    name = "fedadagrad"

    def second_moment(self, v: Tensor, square: Tensor) -> Tensor:
        return v + square


def _register() -> None:
    """Register each optimizer with its defaults as a server optimizer (``FederatedStrategy(server_optimizer=
    "fedadam")``), and FedAvg's clients with it as the algorithm of the same name (a copy of the registered
    ``"fedavg"``, which registers first)."""
    for optimizer in (FedAdam(), FedYogi(), FedAdagrad()):
        register_server_optimizer(optimizer)
        label = type(optimizer).__name__
        description = f"{label}: FedAvg's clients, the server steps with {label} (Reddi et al. 2021)."
        register_algorithm(
            get_algorithm("fedavg").with_server_optimizer(
                optimizer, name=optimizer.name, description=description
            )
        )


_register()
