"""A group of clients training in lockstep: stacked copies of their tensors and their optimizers.

Every trainable tensor ``n`` of the module becomes one tensor ``stacked[n]`` of shape ``[K, ...]``
(client ``k``'s copy at ``[k]``); a segment differentiates a leaf view of its lanes' rows. Each client
has its own optimizer (:mod:`lightning_fedrep.runners.lockstep.optimizers`); a client that does not step is not
touched (momentum and weight decay included) and its step counters stay. A client's ``lr_scale`` (the round
plan's per-client setting) multiplies its learning rate for its steps, as on the sequential runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.store import OptimizerState
from lightning_fedrep.runners.lockstep.optimizers import client_optimizers


class ClientGroup:
    """K clients' trainable tensors, stacked, with one optimizer per client (:mod:`.optimizers`).

    Args:
        clients: the group's client ids, in order.
        start: each trainable name to a ``[K, ...]`` tensor of the clients' starting values (owned).
        user_optimizer: the optimizer ``configure_optimizers`` returned; its class, param groups and
            hyper-parameters are used (its state is not).
        param_names: the trainable name of each parameter of ``user_optimizer``, in its order
            (``None`` for a parameter the module does not train).
        kept_states: each client's kept optimizer state in the sequential path's format (or ``None``).
    """

    def __init__(
        self,
        clients: Sequence[int],
        start: dict[str, Tensor],
        user_optimizer: torch.optim.Optimizer,
        param_names: Sequence[str | None],
        kept_states: Sequence[OptimizerState | None],
    ):
        self.clients = tuple(clients)
        self.stacked = {n: t.detach() for n, t in start.items()}
        self.steps = [0] * len(self.clients)
        self.lr_scales: tuple[float, ...] = (1.0,) * len(self.clients)
        """Each client's factor on its learning rate this round (its plan's ``lr_scale``; set by the engine)."""
        self._lanes: tuple[int, int] = (0, len(self.clients))
        self._leaves: dict[str, Tensor] = {}
        self.optimizers = client_optimizers(self.stacked, user_optimizer, param_names)
        for k, kept in enumerate(kept_states):
            if kept:
                self.optimizers.load_client_state(k, kept.get(0, {}))

    def lanes(self, lanes: tuple[int, int], names: set[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The tensors of the group positions ``lanes = (start, stop)`` for a segment: the trainable
        ``names`` as leaves that collect the lanes' gradients, the others plain (views, no copy)."""
        start, stop = lanes
        self._lanes = lanes
        self._leaves = {n: self.stacked[n][start:stop].requires_grad_(True) for n in names}
        rest = {n: t[start:stop] for n, t in self.stacked.items() if n not in names}
        return self._leaves, rest

    def sync_hyperparameters(self, user_optimizer: torch.optim.Optimizer) -> None:
        """Take the user optimizer's current hyper-parameters (an LR scheduler changes them per round)."""
        self.optimizers.sync(user_optimizer)

    def step(self, active: Sequence[bool]) -> None:
        """One optimizer step of each active lane of the segment, from the gradients on its leaves; the lanes
        of each ``lr_scale`` step together at their learning rate."""
        start, stop = self._lanes
        scales = self.lr_scales[start:stop]
        if len(set(scales)) == 1:
            self.optimizers.step(self._leaves, start, active, scales[0])
        else:
            for scale in sorted(set(scales)):
                lanes = [on and s == scale for on, s in zip(active, scales)]
                if any(lanes):
                    self.optimizers.step(self._leaves, start, lanes, scale)
        for leaf in self._leaves.values():
            leaf.grad = None
        for j, on in enumerate(active):
            self.steps[start + j] += int(on)

    def client_tensors(self, k: int) -> dict[str, Tensor]:
        """Client ``k``'s current trainable tensors by name (views: copy what you keep)."""
        return {name: t[k] for name, t in self.stacked.items()}

    @torch.no_grad()
    def finite_clients(self) -> list[bool]:
        """Whether each client's trainable tensors are all finite (one check of the whole group)."""
        finite: Tensor | None = None
        for t in self.stacked.values():
            if t.is_floating_point():
                rows = torch.isfinite(t).reshape(len(t), -1).all(1)
                finite = rows if finite is None else finite & rows
        return [True] * len(self.clients) if finite is None else finite.tolist()

    def client_optimizer_state(self, k: int, names: set[str]) -> OptimizerState:
        """Client ``k``'s optimizer state of the parameters ``names``, in the sequential path's format
        (optimizer 0, the user optimizer's parameter index)."""
        return {0: self.optimizers.client_state(k, names)}

    def state_dict(self) -> dict[str, Any]:
        """The group mid-segment: its tensors, each client's optimizer state and step counts."""
        names = set(self.stacked)
        return {
            "clients": list(self.clients),
            "stacked": {n: t.detach().clone() for n, t in self.stacked.items()},
            "optimizer": [self.optimizers.client_state(k, names) for k in range(len(self.clients))],
            "steps": list(self.steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in state["stacked"].items():
                self.stacked[name].copy_(value)
        self.optimizers.clear()
        for k, kept in enumerate(state["optimizer"]):
            self.optimizers.load_client_state(k, kept)
        self.steps = [int(s) for s in state["steps"]]
