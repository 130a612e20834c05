"""A group of clients training in lockstep: stacked copies of their tensors and their optimizers.

Every trainable tensor ``n`` of the module becomes one tensor ``stacked[n]`` of shape ``[K, ...]``
(client ``k``'s copy at ``[k]``); a segment differentiates a leaf view of its lanes' rows. The user's optimizer class runs
over per-client *views* ``stacked[n][k]``, each its own parameter with its own state, so an optimizer
whose update reads only a parameter's own gradient and state (SGD, Adam, ...) is exactly K separate
optimizers. A client that does not step gets no gradient, so nothing of it moves (momentum and weight
decay included) and its step counters stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.clients import OptimizerState


class ClientGroup:
    """K clients' trainable tensors, stacked, with one optimizer per client over views of them.

    Args:
        clients: the group's client ids, in order.
        start: each trainable name to a ``[K, ...]`` tensor of the clients' starting values (owned).
        user_optimizer: the optimizer ``configure_optimizers`` returned; its class, param groups and
            hyper-parameters are copied (its state is not used).
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
        self.views = {
            n: [t.detach()[k].requires_grad_(True) for k in range(len(self.clients))]
            for n, t in self.stacked.items()
        }
        self.param_names = list(param_names)
        self.steps = [0] * len(self.clients)
        self._lanes: tuple[int, int] = (0, len(self.clients))
        self._leaves: dict[str, Tensor] = {}
        self.optimizer = self._build_optimizer(user_optimizer)
        self._index = [
            (g, i) for g, group in enumerate(user_optimizer.param_groups) for i in range(len(group["params"]))
        ]
        for k, kept in enumerate(kept_states):
            if kept:
                self._load_client_state(k, kept.get(0, {}))

    def _build_optimizer(self, user_optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        groups, position = [], 0
        for group in user_optimizer.param_groups:
            views = []
            for _ in group["params"]:
                name = self.param_names[position]
                position += 1
                if name is not None and name in self.views:
                    views.extend(self.views[name])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": views})
        defaults = dict(user_optimizer.defaults)
        if "foreach" in defaults and defaults["foreach"] is None:
            defaults["foreach"] = True  # K small updates per tensor: one fused loop instead of K
        for group in groups:
            if group.get("foreach", False) is None:
                group["foreach"] = True
        return type(user_optimizer)(groups, **defaults)

    def lanes(self, lanes: tuple[int, int], names: set[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The tensors of the group positions ``lanes = (start, stop)`` for a segment: the trainable
        ``names`` as leaves that collect the lanes' gradients, the others plain (views, no copy)."""
        start, stop = lanes
        self._lanes = lanes
        self._leaves = {n: self.stacked[n][start:stop].requires_grad_(True) for n in names}
        rest = {n: t[start:stop] for n, t in self.stacked.items() if n not in names}
        return self._leaves, rest

    def sync_hyperparameters(self, user_optimizer: torch.optim.Optimizer) -> None:
        """Copy the user optimizer's current hyper-parameters (an LR scheduler changes them per round)."""
        for mine, theirs in zip(self.optimizer.param_groups, user_optimizer.param_groups):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = value

    @torch.no_grad()
    def step(self, active: Sequence[bool]) -> None:
        """One optimizer step of each active lane of the segment, from the gradients on its leaves."""
        start, _ = self._lanes
        stepped = []
        for name, leaf in self._leaves.items():
            grad, views = leaf.grad, self.views[name]
            if grad is None:
                continue
            for j, on in enumerate(active):
                if on:
                    views[start + j].grad = grad[j]
                    stepped.append(views[start + j])
            leaf.grad = None
        self.optimizer.step()
        for view in stepped:
            view.grad = None
        for j, on in enumerate(active):
            self.steps[start + j] += int(on)

    def client_tensors(self, k: int) -> dict[str, Tensor]:
        """Client ``k``'s current trainable tensors by name (views: copy what you keep)."""
        return {name: views[k] for name, views in self.views.items()}

    def client_optimizer_state(self, k: int, names: set[str]) -> OptimizerState:
        """Client ``k``'s optimizer state of the parameters ``names``, in the sequential path's format
        (optimizer 0, the user optimizer's parameter index)."""
        state: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(self.param_names):
            if name in names and name in self.views:
                entries = self.optimizer.state.get(self.views[name][k])
                if entries:
                    state[index] = {
                        key: v.detach().clone() if isinstance(v, Tensor) else v for key, v in entries.items()
                    }
        return {0: state}

    def _load_client_state(self, k: int, kept: Mapping[int, Mapping[str, Any]]) -> None:
        for index, entries in kept.items():
            name = self.param_names[index]
            if name is not None and name in self.views:
                view = self.views[name][k]
                self.optimizer.state[view] = {
                    key: v.clone() if isinstance(v, Tensor) else v for key, v in entries.items()
                }

    def state_dict(self) -> dict[str, Any]:
        """The group mid-segment: its tensors, each client's optimizer state and step counts."""
        names = set(self.views)
        return {
            "clients": list(self.clients),
            "stacked": {n: t.detach().clone() for n, t in self.stacked.items()},
            "optimizer": [self.client_optimizer_state(k, names)[0] for k in range(len(self.clients))],
            "steps": list(self.steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in state["stacked"].items():
                self.stacked[name].copy_(value)
        self.optimizer.state.clear()
        for k, kept in enumerate(state["optimizer"]):
            self._load_client_state(k, kept)
        self.steps = [int(s) for s in state["steps"]]
