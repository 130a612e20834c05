"""Compiled cached head steps (``FederatedStrategy(runner=RunnerSettings(compile=True))``).

A head step on cached features is small (a FedRep CIFAR round has 500 of them: 10 clients, batch 10, a
64 -> 10 head): its cost is the per-operation overhead of ``vmap``, ``functional_call`` and autograd, not
arithmetic. :class:`CompiledHeadStep` computes such a step's gradients and per-client losses in one
``torch.compile``-d function (forward and backward traced together with ``torch.func.grad_and_value``); the
clients' optimizers then step as on the eager path. Only the cached head step of a phase without loss terms
is compiled; every other step runs as before.

Compiling costs seconds (once per fit and input shape: a group width, a batch size), so it pays off over
many rounds, never in one: it is opt-in. A compile that fails (no C++ compiler for inductor on a CPU, an
operation dynamo cannot trace in one graph) warns once and the engine steps eagerly from then on; nothing is
lost, since the failing call changed nothing. An error of the step itself (out of memory, a bad label) is raised
as on the eager path.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation.module.losses import masked_mean

HeadCall = Callable[[dict[str, Tensor], Tensor], Tensor]
Lanes = Callable[[Callable[..., Any], int], Callable[..., Any]]
LaneLosses = Callable[[Any, Tensor, Tensor, Tensor], Tensor]


class CompiledHeadStep:
    """One cached head step's gradients and losses for every lane, compiled.

    Args:
        head: the feature split's head (``head(tensors, features)``).
        loss_fn: the module's declared per-sample loss.
        per_sample: whether ``loss_fn`` may run once on every lane's samples (a named loss), else per lane.
        over_lanes: the engine's ``vmap`` over lanes (a plain call for one lane).
        lane_losses: the engine's per-lane mean loss from all lanes' outputs (named losses).
    """

    def __init__(
        self,
        head: HeadCall,
        loss_fn: Any,
        per_sample: bool,
        over_lanes: Lanes,
        lane_losses: LaneLosses,
    ):
        self.failure: str | None = None
        """Why compiling failed (the engine steps eagerly since), or ``None``."""

        def total(
            trained: dict[str, Tensor],
            fixed: dict[str, Tensor],
            frozen: dict[str, Tensor],
            inputs: Tensor,
            targets: Tensor,
            mask: Tensor,
            active: Tensor,
        ) -> tuple[Tensor, Tensor]:
            lanes = mask.shape[0]
            if per_sample:

                def output(own: dict[str, Tensor], rest: dict[str, Tensor], x: Tensor) -> Tensor:
                    return head({**fixed, **rest, **own}, x)

                outputs = over_lanes(output, lanes)(trained, frozen, inputs)
                losses = lane_losses(loss_fn, outputs, targets, mask)
            else:

                def client_loss(
                    own: dict[str, Tensor], rest: dict[str, Tensor], x: Tensor, y: Tensor, m: Tensor
                ) -> Tensor:
                    return masked_mean(loss_fn(head({**fixed, **rest, **own}, x), y), m)

                losses = over_lanes(client_loss, lanes)(trained, frozen, inputs, targets, mask)
            losses = losses * active
            return losses.sum(), losses

        self._total = total
        # fullgraph: a graph break must raise (and fall back with the warning), not run eagerly unannounced
        self._compiled = torch.compile(
            _own_code(torch.func.grad_and_value(total, has_aux=True)), dynamic=False, fullgraph=True
        )
        self._reached: frozenset[str] | None = None

    def __call__(
        self,
        trained: dict[str, Tensor],
        fixed: dict[str, Tensor],
        frozen: dict[str, Tensor],
        inputs: Tensor,
        targets: Tensor,
        mask: Tensor,
        active: Tensor,
    ) -> tuple[dict[str, Tensor], Tensor] | None:
        """The gradient of every trained tensor (``[lanes, ...]``) and each lane's loss (zero where ``active``
        is), or ``None`` where compiling failed (then the engine's eager step runs)."""
        if self.failure is not None:
            return None
        args = (trained, fixed, frozen, inputs, targets, mask, active)
        if self._reached is None:
            self._reached = self._reached_by_loss(*args)
        try:
            grads, (_, losses) = self._compiled(*args)
        except Exception as error:
            if not _is_compile_failure(error):
                raise
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(
                f"lightning_fedrep: compile=True could not compile the cached head step "
                f"({self.failure}); the engine steps eagerly from here on (the same computation, not faster).",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return {n: g for n, g in grads.items() if n in self._reached}, losses

    def _reached_by_loss(self, trained: dict[str, Tensor], *rest: Any) -> frozenset[str]:
        """The trained tensors the loss reaches, by one eager autograd pass (the first step): autograd leaves
        the others' gradients unset, so their optimizer skips them (no weight decay, no momentum), where
        ``grad`` would hand them zeros."""
        leaves = {n: t.detach().requires_grad_(True) for n, t in trained.items()}
        with torch.enable_grad():
            loss, _ = self._total(leaves, *rest)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        return frozenset(n for n, g in zip(leaves, grads) if g is not None)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``fn``, under a code object of its own. Torch's compile cache and its recompile limit
    (8 graphs) are kept per code object, and ``grad_and_value``'s wrapper is one code object for the whole
    process: every fit's graphs would count against one limit. This way each engine counts its own (its group
    widths and batch sizes); a later fit traces again and finds the compiled code in inductor's caches."""

    def call(*args: Any) -> Any:
        return fn(*args)

    return types.FunctionType(
        call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__
    )


def _is_compile_failure(error: Exception) -> bool:
    """Whether ``error`` comes from tracing or compiling (dynamo, inductor: the eager step may still run), not
    from running the step (out of memory, a device-side assert), which the eager step would meet as well."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    return isinstance(error, TorchDynamoException | FailOnRecompileLimitHit)
