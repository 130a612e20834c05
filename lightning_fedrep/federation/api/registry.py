"""The algorithms by name: :func:`register_algorithm` makes an :class:`~.algorithm.Algorithm` available as
``FederatedStrategy(algorithm="name")`` and, after ``import lightning_fedrep``, as ``Trainer(strategy="name")``;
:func:`register_server_optimizer` makes a :class:`~.server_optimizer.ServerOptimizer` available as
``FederatedStrategy(server_optimizer="name")``.

The built-ins register themselves when :mod:`lightning_fedrep.federation.algorithms` is imported (which
``import lightning_fedrep`` does); this module imports none of them. No Lightning here: the package adds the
strategy names through :func:`on_register`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer

ALGORITHMS: dict[str, Algorithm] = {}
"""The registered algorithms by name (each is also a strategy name after ``import lightning_fedrep``)."""


_LISTENERS: list[Callable[[Algorithm], None]] = []


def on_register(listener: Callable[[Algorithm], None]) -> None:
    """Call ``listener(algorithm)`` for every algorithm registered from now on. ``import lightning_fedrep``
    uses it to add the strategy names (``"name"``, ``"name_ddp"``) to Lightning's registry, so this module
    stays free of Lightning."""
    _LISTENERS.append(listener)


def register_algorithm(algorithm: Algorithm, *, override: bool = False) -> Algorithm:
    """Make ``algorithm`` available by name: ``FederatedStrategy(algorithm=algorithm.name)`` and, at any
    time after ``import lightning_fedrep``, ``Trainer(strategy=algorithm.name)`` and ``"<name>_ddp"``.

    Args:
        algorithm: the :class:`Algorithm` to register under ``algorithm.name``.
        override: replace an algorithm registered under the same name (without it, that is an error).

    Returns:
        ``algorithm``, so a module can write ``MINE = register_algorithm(Mine())``.

    Example:
        An algorithm that averages only the heads and keeps each client's body, by name:

        >>> import lightning_fedrep
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> class HeadAverage(lightning_fedrep.Algorithm):
        ...     def __init__(self):
        ...         super().__init__("head_average", {"head"}, "average the heads, keep each body")
        >>> algorithm = lightning_fedrep.register_algorithm(HeadAverage())
        >>> lightning_fedrep.FederatedStrategy(algorithm="head_average", head="classifier").algorithm.name
        'head_average'
        >>> "head_average" in StrategyRegistry and "head_average_ddp" in StrategyRegistry
        True
    """
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"register_algorithm takes an Algorithm, got {type(algorithm).__name__}.")
    if algorithm.name in ALGORITHMS and not override:
        raise ValueError(f"An algorithm named {algorithm.name!r} is registered already; pass override=True.")
    ALGORITHMS[algorithm.name] = algorithm
    for listener in _LISTENERS:
        listener(algorithm)
    return algorithm


def get_algorithm(algorithm: str | Algorithm) -> Algorithm:
    """An algorithm object from a registered name (or the object itself), with an error listing names."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if isinstance(algorithm, str) and algorithm in ALGORITHMS:
        return ALGORITHMS[algorithm]
    raise ValueError(
        f"Unknown algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)} or pass an Algorithm object."
    )


SERVER_OPTIMIZERS: dict[str, ServerOptimizer] = {}
"""The registered server optimizers by name (``"fedadam"``, ``"fedyogi"``, ``"fedadagrad"``): what
``FederatedStrategy(server_optimizer="name")`` attaches (a copy) to its algorithm."""


def register_server_optimizer(optimizer: ServerOptimizer, *, override: bool = False) -> ServerOptimizer:
    """Make ``optimizer`` available by name: ``FederatedStrategy(server_optimizer=optimizer.name)`` (and
    ``server_optimizer: name`` in a CLI recipe) attaches a copy of it to the strategy's algorithm.

    Args:
        optimizer: the :class:`~.server_optimizer.ServerOptimizer`, with the settings the name stands for,
            registered under ``optimizer.name``.
        override: replace a server optimizer registered under the same name (without it, that is an error).

    Returns:
        ``optimizer``.
    """
    if not isinstance(optimizer, ServerOptimizer):
        raise TypeError(f"register_server_optimizer takes a ServerOptimizer, got {type(optimizer).__name__}.")
    if optimizer.name in SERVER_OPTIMIZERS and not override:
        raise ValueError(
            f"A server optimizer named {optimizer.name!r} is registered already; pass override=True."
        )
    SERVER_OPTIMIZERS[optimizer.name] = optimizer
    return optimizer


def get_server_optimizer(name: str) -> ServerOptimizer:
    """A fresh copy of the server optimizer registered as ``name``, with an error listing the names."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(
            f"Unknown server optimizer {name!r}; choose one of {sorted(SERVER_OPTIMIZERS)} or pass a "
            "ServerOptimizer object (e.g. FedAdam(lr=0.01))."
        )
    return copy.deepcopy(SERVER_OPTIMIZERS[name])
