"""One optimizer per client of a lockstep group, over the group's stacked tensors.

:class:`ViewOptimizers` runs the user's optimizer class over per-client *views* ``stacked[n][k]``, each
its own parameter with its own state: for an optimizer whose update of a parameter reads only that
parameter's gradient and state (SGD, Adam, ...) that is exactly K separate optimizers. :class:`StackedSGD`
is ``torch.optim.SGD``'s update written on the stacked rows of the clients that step, one update per
tensor instead of one per client and tensor. Both step a set of clients at one factor on the learning rate
(a client's ``lr_scale``, as the sequential runner scales every param group's ``lr`` for a step). Both keep
each client's state in the sequential path's format (``{parameter index: {"momentum_buffer": ...}}``), so kept
optimizer state and checkpoints move between the engines.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

ClientState = dict[int, dict[str, Any]]
"""A client's optimizer state: the user optimizer's parameter index -> its state entries."""


def client_optimizers(
    stacked: dict[str, Tensor], user_optimizer: torch.optim.Optimizer, param_names: Sequence[str | None]
) -> ViewOptimizers | StackedSGD:
    """:class:`StackedSGD` for a plain ``torch.optim.SGD`` (float learning rates, not fused), else
    :class:`ViewOptimizers`."""
    plain_sgd = type(user_optimizer) is torch.optim.SGD and all(
        not isinstance(g["lr"], Tensor) and not g.get("fused") and not g.get("differentiable")
        for g in user_optimizer.param_groups
    )
    cls = StackedSGD if plain_sgd else ViewOptimizers
    return cls(stacked, user_optimizer, param_names)


class ViewOptimizers:
    """The user's optimizer class over per-client views of the stacked tensors."""

    def __init__(
        self,
        stacked: dict[str, Tensor],
        user_optimizer: torch.optim.Optimizer,
        param_names: Sequence[str | None],
    ):
        clients = len(next(iter(stacked.values()))) if stacked else 0
        self.param_names = list(param_names)
        self.views = {
            n: [t.detach()[k].requires_grad_(True) for k in range(clients)] for n, t in stacked.items()
        }
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
        if defaults.get("foreach", False) is None:
            defaults["foreach"] = True  # K small updates per tensor: one fused loop instead of K
        for group in groups:
            if group.get("foreach", False) is None:
                group["foreach"] = True
        # only what the constructor takes: AdamW's defaults hold Adam's `decoupled_weight_decay`, which
        # AdamW.__init__ refuses (the param groups still carry it)
        self.optimizer = type(user_optimizer)(groups, **_constructor_kwargs(type(user_optimizer), defaults))

    def sync(self, user_optimizer: torch.optim.Optimizer) -> None:
        """Take the user optimizer's current hyper-parameters (an LR scheduler changes them per round)."""
        for mine, theirs in zip(self.optimizer.param_groups, user_optimizer.param_groups):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = value

    @torch.no_grad()
    def step(
        self, leaves: Mapping[str, Tensor], start: int, active: Sequence[bool], lr_scale: float = 1.0
    ) -> None:
        """One step of each active client ``start + j`` from the gradients on the lanes' ``leaves``, at
        ``lr_scale`` times each param group's learning rate (put back after the step)."""
        if lr_scale == 1.0:
            self._step(leaves, start, active)
            return
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self._step(leaves, start, active)
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr

    def _step(self, leaves: Mapping[str, Tensor], start: int, active: Sequence[bool]) -> None:
        stepped = []
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            views = self.views[name]
            for j, on in enumerate(active):
                if on:
                    views[start + j].grad = leaf.grad[j]
                    stepped.append(views[start + j])
        self.optimizer.step()
        for view in stepped:
            view.grad = None

    def client_state(self, k: int, names: set[str]) -> ClientState:
        state: ClientState = {}
        for index, name in enumerate(self.param_names):
            if name in names and name in self.views:
                entries = self.optimizer.state.get(self.views[name][k])
                if entries:
                    state[index] = {key: _copy(v) for key, v in entries.items()}
        return state

    def load_client_state(self, k: int, kept: Mapping[int, Mapping[str, Any]]) -> None:
        for index, entries in kept.items():
            name = self.param_names[index]
            if name is not None and name in self.views:
                self.optimizer.state[self.views[name][k]] = {key: _copy(v) for key, v in entries.items()}

    def clear(self) -> None:
        self.optimizer.state.clear()


class StackedSGD:
    """``torch.optim.SGD`` (weight decay, momentum, dampening, Nesterov, maximize) on stacked rows.

    Per client and tensor, the update is SGD's: ``g = grad (+ wd * p)``; with momentum ``b = g`` on the
    client's first step, else ``b = momentum * b + (1 - dampening) * g``, and ``g = b`` (Nesterov:
    ``g + momentum * b``); ``p -= lr * g``. Only the rows of the clients that step are touched.
    """

    def __init__(
        self,
        stacked: dict[str, Tensor],
        user_optimizer: torch.optim.Optimizer,
        param_names: Sequence[str | None],
    ):
        self.stacked = stacked
        self.param_names = list(param_names)
        self.group_of: dict[str, int] = {}
        position = 0
        for g, group in enumerate(user_optimizer.param_groups):
            for _ in group["params"]:
                name = self.param_names[position]
                position += 1
                if name is not None and name in stacked:
                    self.group_of[name] = g
        self.hyper: list[dict[str, Any]] = []
        self.sync(user_optimizer)
        self.buffers: dict[str, Tensor] = {}
        self.has_buffer: dict[str, Tensor] = {}
        self._full: dict[str, tuple[int, int]] = {}

    def sync(self, user_optimizer: torch.optim.Optimizer) -> None:
        """Take the user optimizer's current hyper-parameters (an LR scheduler changes them per round)."""
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in user_optimizer.param_groups]

    @torch.no_grad()
    def step(
        self, leaves: Mapping[str, Tensor], start: int, active: Sequence[bool], lr_scale: float = 1.0
    ) -> None:
        """One SGD step of each active client ``start + j`` from the gradients on the lanes' ``leaves``, at
        ``lr_scale`` times each param group's learning rate."""
        hyper = self.hyper if lr_scale == 1.0 else [{**h, "lr": h["lr"] * lr_scale} for h in self.hyper]
        if all(active):
            self._step_all(leaves, slice(start, start + len(active)), hyper)
            return
        device = next(iter(self.stacked.values())).device if self.stacked else None
        chosen = torch.tensor([j for j, on in enumerate(active) if on], dtype=torch.long, device=device)
        if not len(chosen):
            return
        rows = chosen + start  # one copy to the device per step, not two per tensor
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            h = hyper[self.group_of[name]]
            param = self.stacked[name]
            rows_here = rows.to(param.device)
            grad = leaf.grad[chosen.to(leaf.grad.device)]
            p = param[rows_here]
            grad = self._direction(name, _decayed(grad, p, h), rows_here, h)
            param[rows_here] = p.add(grad, alpha=-h["lr"])

    def _step_all(self, leaves: Mapping[str, Tensor], rows: slice, hyper: list[dict[str, Any]]) -> None:
        """The step of the consecutive ``rows`` (every lane steps). The tensors of a param group whose rows all
        have momentum buffers step together, one ``torch._foreach_*`` op per stage (SGD's update, op for op);
        the others one by one (:meth:`_step_rows`)."""
        together: dict[int, list[tuple[str, Tensor]]] = {}
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            g = self.group_of[name]
            h = hyper[g]
            if h["momentum"] != 0 and not h["nesterov"] and self._all_have_buffers(name, rows):
                together.setdefault(g, []).append((name, leaf.grad))
            else:
                self._step_rows(name, leaf.grad, rows, h)
        for g, named_grads in together.items():
            h = hyper[g]
            params = [self.stacked[name][rows] for name, _ in named_grads]
            buffers = [self.buffers[name][rows] for name, _ in named_grads]
            grads = [grad for _, grad in named_grads]
            if h["maximize"]:
                grads = torch._foreach_neg(grads)
            if h["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=h["weight_decay"])
            torch._foreach_mul_(buffers, h["momentum"])
            torch._foreach_add_(buffers, grads, alpha=1 - h["dampening"])
            torch._foreach_add_(params, buffers, alpha=-h["lr"])

    def _step_rows(self, name: str, grad: Tensor, rows: slice, h: dict[str, Any]) -> None:
        """The step of one tensor's consecutive ``rows`` (every lane steps), in place on a view of them: no
        momentum, Nesterov, or a row's first step (its buffer made here)."""
        p = self.stacked[name][rows]
        p.add_(self._direction(name, _decayed(grad, p, h), rows, h), alpha=-h["lr"])

    def _direction(self, name: str, grad: Tensor, rows: slice | Tensor, h: dict[str, Any]) -> Tensor:
        """The update direction of ``rows`` from their (decayed) gradient, updating their momentum buffers."""
        momentum = h["momentum"]
        if momentum == 0:
            return grad
        buffers, has = self._buffers(name)
        first = ~has[rows]
        updated = buffers[rows].mul(momentum).add(grad, alpha=1 - h["dampening"])
        buf = torch.where(first.view(-1, *([1] * (grad.dim() - 1))), grad, updated)
        buffers[rows] = buf
        has[rows] = True
        return grad.add(buf, alpha=momentum) if h["nesterov"] else buf

    def _all_have_buffers(self, name: str, rows: slice) -> bool:
        """Whether every row of ``rows`` has a momentum buffer (remembered per tensor once true: buffers
        are only ever added, until :meth:`clear`)."""
        known = self._full.get(name)
        if known is not None and known[0] <= rows.start and rows.stop <= known[1]:
            return True
        has = self.has_buffer.get(name)
        if has is None or not bool(has[rows].all()):
            return False
        self._full[name] = (rows.start, rows.stop)
        return True

    def _buffers(self, name: str) -> tuple[Tensor, Tensor]:
        if name not in self.buffers:
            param = self.stacked[name]
            self.buffers[name] = torch.zeros_like(param)
            self.has_buffer[name] = torch.zeros(len(param), dtype=torch.bool, device=param.device)
        return self.buffers[name], self.has_buffer[name]

    def client_state(self, k: int, names: set[str]) -> ClientState:
        state: ClientState = {}
        for index, name in enumerate(self.param_names):
            if name in names and name in self.has_buffer and bool(self.has_buffer[name][k]):
                state[index] = {"momentum_buffer": self.buffers[name][k].detach().clone()}
        return state

    def load_client_state(self, k: int, kept: Mapping[int, Mapping[str, Any]]) -> None:
        for index, entries in kept.items():
            name = self.param_names[index]
            value = entries.get("momentum_buffer")
            if name is not None and name in self.stacked and value is not None:
                buffers, has = self._buffers(name)
                buffers[k] = value
                has[k] = True

    def clear(self) -> None:
        self.buffers, self.has_buffer, self._full = {}, {}, {}


def _decayed(grad: Tensor, p: Tensor, h: Mapping[str, Any]) -> Tensor:
    """SGD's gradient of parameters ``p`` before momentum: negated (``maximize``), plus weight decay."""
    if h["maximize"]:
        grad = -grad
    if h["weight_decay"] != 0:
        grad = grad.add(p, alpha=h["weight_decay"])
    return grad


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``cls.__init__`` accepts (all of them if it takes ``**kwargs``)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return defaults
    return {k: v for k, v in defaults.items() if k in parameters}


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value
