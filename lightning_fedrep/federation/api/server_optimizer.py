"""A server optimizer: a server step the federation runs right after ``Algorithm.aggregate``, on the shared
tensors (FedOpt's FedAdam, FedYogi, FedAdagrad; a server momentum).

It treats ``Δ = aggregate's shared tensors - the round's starting ones`` as a pseudo-gradient and replaces the
shared tensors by its own step from the round's start; its state is declared server tensors
(:meth:`ServerOptimizer.server_tensors`), so it is checkpointed (mid-round too), rolled back with an interrupted
round and held alike on every process. Any algorithm takes one with
:meth:`~lightning_fedrep.federation.api.algorithm.Algorithm.with_server_optimizer`. Because it reads only what
``aggregate`` returned, it composes with every aggregator: under ``privacy=ClientLevelDP(...)`` it steps from the
private mean. No Lightning here (the core).
"""

from __future__ import annotations

from lightning_fedrep.federation.api.declared import ServerTensors
from lightning_fedrep.federation.api.exchange import ServerState

__all__ = ["ServerOptimizer"]


class ServerOptimizer:
    """A server step after ``Algorithm.aggregate`` (subclass it; ``lightning_fedrep.FedAdam`` is one).

    ``name`` names it in the algorithm names it makes (``"fedrep_fedadam"``).
    """

    name: str = "server_optimizer"

    def server_tensors(self) -> tuple[ServerTensors, ...]:
        """The optimizer's state, declared like ``Algorithm.server_tensors`` (e.g.
        ``ServerTensors("fedopt_m", like="shared")``), added to the algorithm's by ``with_server_optimizer``;
        their names must differ from the algorithm's. Asked once, when the optimizer is attached."""
        return ()

    def step(self, server: ServerState, new: ServerState) -> tuple[ServerState, dict[str, float]]:
        """The server step at a round's close, right after ``Algorithm.aggregate`` (every process alike, so a pure
        function of its arguments): ``server`` is the state the round started from (``server.shared``: x_t,
        ``server.tensors``: every declared server tensor, the optimizer's included), ``new`` what ``aggregate``
        returned. Return ``(new.replace(shared=..., tensors=...), metrics)``: every shared tensor's value after the
        step, the optimizer's server tensors, and floats for the round's history row (``{}`` for none)."""
        raise NotImplementedError
