"""The optimizer each client's fine-tuning runs (:class:`FineTuningOptimizer`) and how
:class:`~lightning_fedrep.evaluation.finetuning.ClientFineTuning` chooses it: the module's own optimizer class
and hyper-parameters, the SRPFL code's SGD, or a callable the user passes. No Lightning."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fedrep.models.optim import weight_decay_groups

OptimizerFactory = Callable[[list[Tensor]], Optimizer]

OFFICIAL_MOMENTUM = 0.5
OFFICIAL_WEIGHT_DECAY = 1e-4
"""The SRPFL code's fine-tuning SGD (``optimizer="sgd"``): momentum 0.5, weight decay 1e-4 on weights."""

_FLAGS = (
    "foreach",
    "maximize",
    "capturable",
    "differentiable",
    "fused",
    "initial_lr",
    "decoupled_weight_decay",
)
"""Optimizer group entries that are implementation switches, not hyper-parameters (left out of the log line)."""


@dataclass(frozen=True)
class FineTuningOptimizer:
    """How each client's head is fine-tuned: an optimizer class and one hyper-parameter group per set of
    tuned parameter names (``factory`` instead, for an optimizer the user declares as a callable)."""

    source: str
    """Where the choice comes from, in words (for the log line that names it)."""
    optimizer_class: type[Optimizer] | None = None
    """The optimizer class (``None`` with ``factory``)."""
    groups: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = ()
    """``(hyper-parameters, tuned parameter names)`` for each parameter group."""
    factory: OptimizerFactory | None = None

    def build(self, head: dict[str, Tensor]) -> Optimizer:
        """A fresh optimizer over ``head``'s tensors."""
        if self.factory is not None:
            return self.factory(list(head.values()))
        groups = [{**hyper, "params": [head[n] for n in names]} for hyper, names in self.groups]
        return _construct(self.optimizer_class, groups)

    def describe(self) -> str:
        """One line: the class and its hyper-parameters per group of tuned parameters, and where they come from."""
        if self.factory is not None:
            return f"the declared optimizer {getattr(self.factory, '__name__', repr(self.factory))} ({self.source})"
        groups = "; ".join(
            ", ".join(f"{k}={v}" for k, v in hyper.items() if k not in _FLAGS and v is not None)
            + f" for {', '.join(names)}"
            for hyper, names in self.groups
        )
        return f"{self.optimizer_class.__name__} ({groups}) {self.source}"


def check_optimizer_choice(optimizer: Any, lr: Any, momentum: Any, weight_decay: Any) -> None:
    """Refuse (at construction) an ``optimizer`` that is none of ``"module"``, ``"sgd"`` or a callable, and
    ``lr``/``momentum``/``weight_decay`` given beside a callable (it takes its own)."""
    if isinstance(optimizer, str) and optimizer in ("module", "sgd"):
        return
    if isinstance(optimizer, str) or not callable(optimizer):
        raise ValueError(
            "FineTunedEvaluation(optimizer=...) must be 'module' (the module's optimizer class and "
            "hyper-parameters), 'sgd' (the SRPFL code's fine-tuning SGD) or a callable params -> Optimizer, "
            f"got {optimizer!r}."
        )
    given = [
        n for n, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)) if v is not None
    ]
    if given:
        raise ValueError(
            f"FineTunedEvaluation({', '.join(given)}=...) overrides the 'module' or 'sgd' optimizer; a callable "
            "optimizer takes its own (e.g. functools.partial(torch.optim.Adam, lr=1e-3)). Set them there."
        )


def official_sgd(
    names: Sequence[str], lr: float, momentum: float | None, weight_decay: float | None
) -> FineTuningOptimizer:
    """The SRPFL code's fine-tuning SGD over ``names`` at ``lr``: momentum 0.5 and weight decay 1e-4 on weights
    (not biases) where ``momentum``/``weight_decay`` are ``None``."""
    momentum = OFFICIAL_MOMENTUM if momentum is None else momentum
    decay = OFFICIAL_WEIGHT_DECAY if weight_decay is None else weight_decay
    groups = tuple(
        ({"lr": lr, "momentum": momentum, "weight_decay": group["weight_decay"]}, tuple(group["params"]))
        for group in weight_decay_groups([(n, n) for n in names], decay)
    )
    return FineTuningOptimizer("(optimizer='sgd': the SRPFL code's fine-tuning SGD)", torch.optim.SGD, groups)


def module_optimizer(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    names: Sequence[str],
    overrides: dict[str, float | None],
) -> FineTuningOptimizer:
    """The class and each tuned parameter's group hyper-parameters of the optimizer among ``optimizers`` (the
    module's) that trains it, with ``overrides`` (``lr``, ``momentum``, ``weight_decay``; ``None``: kept)."""
    found: dict[int, tuple[Optimizer, dict[str, Any], list[str]]] = {}
    for name in names:
        parameter = module.get_parameter(name)
        located = [
            (o, g) for o in optimizers for g in o.param_groups if any(p is parameter for p in g["params"])
        ]
        if not located:
            raise ValueError(
                f"FineTunedEvaluation(optimizer='module') fine-tunes {name} with the optimizer that trains it, "
                f"but no optimizer of {type(module).__name__}.configure_optimizers() holds it. Pass "
                "optimizer='sgd' (the SRPFL code's) or a callable params -> Optimizer."
            )
        optimizer, group = located[0]
        found.setdefault(id(group), (optimizer, group, []))[2].append(name)
    classes = {type(o) for o, _, _ in found.values()}
    if len(classes) > 1:
        listed = ", ".join(sorted(c.__name__ for c in classes))
        raise ValueError(
            f"FineTunedEvaluation(optimizer='module'): the head's parameters are trained by several optimizer "
            f"classes ({listed}); pass optimizer='sgd' or a callable params -> Optimizer."
        )
    groups = tuple(
        (
            _overridden({k: v for k, v in group.items() if k != "params"}, type(optimizer), overrides),
            tuple(tuned),
        )
        for optimizer, group, tuned in found.values()
    )
    source = f"(optimizer='module': {type(module).__name__}.configure_optimizers())"
    return FineTuningOptimizer(source, classes.pop(), groups)


def _overridden(
    hyper: dict[str, Any], optimizer_class: type, overrides: dict[str, float | None]
) -> dict[str, Any]:
    """The module's group hyper-parameters with the given ``lr``/``momentum``/``weight_decay``."""
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in hyper:
            raise ValueError(
                f"FineTunedEvaluation({key}={value}) overrides the module's optimizer's {key}, but "
                f"{optimizer_class.__name__} has none. Leave {key} unset, or pass optimizer='sgd' or a "
                "callable params -> Optimizer."
            )
        hyper[key] = value
    return hyper


def _construct(optimizer_class: type[Optimizer], groups: list[dict[str, Any]]) -> Optimizer:
    """``optimizer_class(groups)``; every group carries all hyper-parameters, and a required constructor
    argument (``lr`` of some optimizers) is taken from the first group."""
    parameters = inspect.signature(optimizer_class).parameters
    required = {
        n: groups[0][n]
        for n, p in parameters.items()
        if p.default is inspect.Parameter.empty and n in groups[0] and n != "params"
    }
    return optimizer_class(groups, **required)
