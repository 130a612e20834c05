"""Driving the live ``nn.Module``: writing tensors into its own parameters (never rebinding them), phase
masks, per-client optimizer state, and the evaluation swaps.

:class:`LiveModule` is the part of :class:`~lightning_fedrep.federation.Federation` that touches the module;
what it writes comes from the federation's :class:`~lightning_fedrep.federation.state.FederationState`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.algorithm import PART_GROUPS, Part
from lightning_fedrep.federation.api.scoring import ScoredForward, scoring_forward
from lightning_fedrep.federation.store import OptimizerState

if TYPE_CHECKING:
    from lightning_fedrep.federation.state import FederationState


class LiveModule:
    """The live module of a :class:`~lightning_fedrep.federation.Federation`: the ``nn.Module`` (and its
    optimizers) into whose own tensors the clients' tensors of ``state`` are written.

    Args:
        state: the federation's stored state (global shared part, client store, evaluation spec).
    """

    def __init__(self, state: FederationState):
        self.state = state
        self._module: nn.Module | None = None
        self.named: dict[str, Tensor] = {}
        """The attached module's buffers and parameters by name (the tensors written into)."""
        self.optimizers: list[torch.optim.Optimizer] = []
        self.phase: Part | None = None
        """The part whose parameters are trainable (``None``: every non-frozen parameter)."""
        self._eval_stash: list[Tensor] | None = None
        self._eval_client: int | None = None
        self._eval_tensors: dict[int, dict[str, Tensor]] = {}

    @property
    def module(self) -> nn.Module | None:
        """The module the federation drives (its tensors are written into it), once attached."""
        return self._module

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Drive ``module`` (and its optimizers): called when the module, its device or optimizers change."""
        self._module = module
        self.named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        self.optimizers = list(optimizers)

    def tensors(self, names: Iterable[str]) -> list[Tensor]:
        """The module's own tensors of ``names`` (not copies)."""
        return [self.named[n] for n in names]

    @torch.no_grad()
    def write(self, names: Sequence[str], values: Sequence[Tensor]) -> None:
        """Copy ``values`` into the module's tensors of ``names``."""
        targets = self.tensors(names)
        if targets:
            torch._foreach_copy_(targets, list(values))

    def write_global(self) -> None:
        """Write the global shared part into the module."""
        self.write(self.state.shared_names, self.state.global_state)

    def write_personal(self, client: int) -> None:
        """Write the global shared part and ``client``'s personal tensors (its local part, what it
        fine-tuned) into the module."""
        self.write_global()
        personal = self.state.store.personal(client, self.state.local_names)
        self.write(list(personal), list(personal.values()))

    def set_phase(self, part: Part) -> None:
        """Make only the parameters ``part`` trains trainable (the others get no gradient)."""
        trains = PART_GROUPS[part]
        for name, param in self._module.named_parameters():
            group = self.state.split.group(name)
            if group != "frozen":
                param.requires_grad_(group in trains)
                if group not in trains:
                    param.grad = None
        self.phase = part

    def release_phases(self) -> None:
        """Make every non-frozen parameter trainable again (when training ends)."""
        for name, param in self._module.named_parameters():
            if self.state.split.group(name) != "frozen":
                param.requires_grad_(True)
        self.phase = None

    def load_optimizer_state(self, kept: Mapping[int, OptimizerState]) -> None:
        """Restart every optimizer with ``kept`` (a client's kept state, by optimizer index; ``{}``: none)."""
        for index, optimizer in enumerate(self.optimizers):
            optimizer.state.clear()
            params = _optimizer_params(optimizer)
            for param_index, state in kept.get(index, {}).items():
                optimizer.state[params[param_index]] = {
                    k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()
                }

    def clear_optimizer_state(self) -> None:
        """Restart every optimizer (a new slot is live in the module's parameters)."""
        for optimizer in self.optimizers:
            optimizer.state.clear()

    def optimizer_snapshot(self) -> OptimizerState:
        """The optimizer state of the client's local parameters (the shared part restarts every round)."""
        local = {id(t) for t in self.tensors(self.state.local_names)}
        snapshot: OptimizerState = {}
        for index, optimizer in enumerate(self.optimizers):
            snapshot[index] = {
                i: {
                    k: v.detach().clone() if isinstance(v, Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
                for i, p in enumerate(_optimizer_params(optimizer))
                if id(p) in local and optimizer.state.get(p)
            }
        return snapshot

    def client_lr(self) -> float | None:
        """The clients' learning rate: the first optimizer's first param group's (``None`` without one)."""
        optimizers = self.optimizers
        return float(optimizers[0].param_groups[0]["lr"]) if optimizers else None

    def training_tensors(self) -> list[Tensor]:
        """Copies of what training has live in the shared and local tensors (kept aside during an evaluation)."""
        if self._eval_stash is not None:
            return self._eval_stash
        return [t.detach().clone() for t in self.tensors(self.state.shared_names + self.state.local_names)]

    def begin_evaluation(self, keep_training: bool) -> None:
        """Evaluate the global shared part; ``keep_training``: a client is live mid-round, its training
        tensors are kept aside until :meth:`end_evaluation`."""
        self.state.require_state()
        if keep_training:
            self._eval_stash = [
                t.detach().clone() for t in self.tensors(self.state.shared_names + self.state.local_names)
            ]
        self.write_global()
        self._eval_client = None

    def _scores_shared(self) -> bool:
        """Whether evaluation may write a client's own values into shared tensors."""
        slots = self.state.evaluation_spec.score in ("slot", "mixture")
        return slots or bool(self.state.store.finetuned or self._eval_tensors)

    def evaluate_client(self, client: int) -> None:
        """Give the module ``client``'s personalized model for its evaluation batches."""
        if client != self._eval_client:
            if self._scores_shared():  # some client's own shared tensors may be live
                self.write_global()
            personal = self.evaluation_tensors(client)
            self.write(list(personal), list(personal.values()))
            self._eval_client = client

    def set_evaluation_tensors(self, tensors: Mapping[int, Mapping[str, Tensor]]) -> None:
        """For the coming evaluation only, score each listed client with these tensors (by name, shared or
        local) in place of its stored ones; the stored state is not changed, and the override ends with the
        evaluation (``FineTunedEvaluation`` sets the heads it fine-tuned this way)."""
        self.state.require_state()
        known = set(self.state.shared_names) | set(self.state.local_names)
        for client, named in tensors.items():
            self.state.check_client(client)
            unknown = set(named) - known
            if unknown:
                raise KeyError(f"{sorted(unknown)} are neither shared nor local tensors of the federation.")
        self._eval_tensors = {c: dict(named) for c, named in tensors.items()}

    def evaluation_tensors(self, client: int) -> dict[str, Tensor]:
        """What makes ``client``'s model its own in the current evaluation (not copies: do not modify):
        ``FederationState.scored_tensors``, with those set by :meth:`set_evaluation_tensors` in their place."""
        return {**self.state.scored_tensors(client), **self._eval_tensors.get(client, {})}

    def end_evaluation(self, live_client: int | None) -> None:
        """Put back what training had live before the evaluation (``live_client``: the round's live client)."""
        if self._eval_stash is not None:
            self.write(self.state.shared_names + self.state.local_names, self._eval_stash)
            self._eval_stash = None
        else:
            if self._scores_shared():  # the shared part may hold a client's own values
                self.write_global()
            if live_client is not None:
                self.write(self.state.local_names, self.state.store.get(live_client))
        self._eval_tensors = {}
        self._eval_client = None

    def load_personalized(self, client: int) -> None:
        """Write ``client``'s personalized model into the module: what evaluation scores (before any
        adaptation); ``-1``: a new client's model (the global shared part and the initial local part)."""
        self.write_personal(client)
        if client != -1 and self.state.evaluation_spec.score != "personal":
            own = self.state.scored_tensors(client)
            self.write(list(own), list(own.values()))

    def scoring(self, module: nn.Module, client: int) -> AbstractContextManager[Any]:
        """While the block runs, ``module.forward`` predicts as ``client``'s scored model: the algorithm's
        ``EvaluationSpec.forward`` with the client's declared tensors and the server tensors (restored after;
        nothing changes without one). ``-1``: a client that never trained (the templates)."""
        state = self.state
        return scoring_forward(
            module, state.evaluation_spec, lambda: state.store.client_state(client), state.server_tensors
        )

    def scored_forward(self, module: nn.Module, client: int) -> ScoredForward | None:
        """A standalone ``forward`` for ``module`` predicting as ``client``'s scored model, over copies of
        its declared tensors and the server tensors (``None`` without ``EvaluationSpec.forward``)."""
        forward = self.state.evaluation_spec.forward
        if forward is None:
            return None
        state = {n: t.detach().clone() for n, t in self.state.store.client_state(client).items()}
        server = {n: t.detach().clone() for n, t in self.state.server_tensors.items()}
        return ScoredForward(forward, module, state, server)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
