"""Driving the live ``nn.Module``: writing tensors into its own parameters (never rebinding them), phase
masks, per-client optimizer state, and the evaluation swaps.

:class:`LiveModule` is the part of :class:`~lightning_fedrep.federation.Federation` that touches the module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.algorithm import PART_GROUPS, Part
from lightning_fedrep.federation.api.scoring import (
    EvaluationSpec,
    ScoredForward,
    evaluation_spec,
    scored_tensors,
    scoring_forward,
)
from lightning_fedrep.federation.round import _LiveClient
from lightning_fedrep.federation.store import OptimizerState


class LiveModule:
    """The live module of a :class:`~lightning_fedrep.federation.Federation` (one of its parts)."""

    @property
    def live_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between clients)."""
        return None if self._live is None else self._live.client

    @property
    def module(self) -> nn.Module | None:
        """The module the federation drives (its tensors are written into it), once attached."""
        return getattr(self, "_module", None)

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Drive ``module`` (and its optimizers): called when the module, its device or optimizers change."""
        self._module = module
        self._named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        self._optimizers = list(optimizers)

    def load_client(self, client: int) -> None:
        """Make ``client`` live: the round's global shared part, its local part (as ``Algorithm.start_client``
        changes them) and, if kept, its optimizer state (the shared part's optimizer state restarts)."""
        self._write_personal(client)
        self._live = _LiveClient(client)
        self.live_phase = None
        changed = self.begin_client(client)  # Algorithm.start_client, where overridden
        self._write(list(changed), list(changed.values()))
        kept = self.store.optimizer_states.get(client, {})
        for index, optimizer in enumerate(self._optimizers):
            optimizer.state.clear()
            params = _optimizer_params(optimizer)
            for param_index, state in kept.get(index, {}).items():
                optimizer.state[params[param_index]] = {
                    k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()
                }

    def set_phase(self, part: Part) -> None:
        """Make only the parameters ``part`` trains trainable (the others get no gradient)."""
        trains = PART_GROUPS[part]
        for name, param in self._module.named_parameters():
            group = self.split.group(name)
            if group != "frozen":
                param.requires_grad_(group in trains)
                if group not in trains:
                    param.grad = None
        self.live_phase = part

    def release_phases(self) -> None:
        """Make every non-frozen parameter trainable again (when training ends)."""
        for name, param in self._module.named_parameters():
            if self.split.group(name) != "frozen":
                param.requires_grad_(True)
        self.live_phase = None

    def begin_evaluation(self) -> None:
        """Evaluate the global shared part; keep the live client's training tensors aside if mid-round."""
        self._require_state()
        if self.round_open and self._live is not None:
            self._eval_stash = [
                t.detach().clone() for t in self._tensors(self.shared_names + self.local_names)
            ]
            self._live.fresh = True
        self._write(self.shared_names, self.global_state)
        self._eval_client = None

    @property
    def evaluation_spec(self) -> EvaluationSpec:
        """What evaluation scores: ``algorithm.evaluation()`` (asked once)."""
        if getattr(self, "_evaluation_spec", None) is None:
            self._evaluation_spec = evaluation_spec(self.algorithm)
        return self._evaluation_spec

    def _scores_shared(self) -> bool:
        """Whether evaluation may write a client's own values into shared tensors."""
        slots = self.evaluation_spec.score in ("slot", "mixture")
        return slots or bool(self.store.finetuned or self._eval_tensors)

    def evaluate_client(self, client: int) -> None:
        """Give the module ``client``'s personalized model for its evaluation batches."""
        if client != self._eval_client:
            if self._scores_shared():  # some client's own shared tensors may be live
                self._write(self.shared_names, self.global_state)
            personal = self.evaluation_tensors(client)
            self._write(list(personal), list(personal.values()))
            self._eval_client = client

    def set_evaluation_tensors(self, tensors: Mapping[int, Mapping[str, Tensor]]) -> None:
        """For the coming evaluation only, score each listed client with these tensors (by name, shared or
        local) in place of its stored ones; the stored state is not changed, and the override ends with the
        evaluation (``FineTunedEvaluation`` sets the heads it fine-tuned this way)."""
        self._require_state()
        known = set(self.shared_names) | set(self.local_names)
        for client, named in tensors.items():
            self.check_client(client)
            unknown = set(named) - known
            if unknown:
                raise KeyError(f"{sorted(unknown)} are neither shared nor local tensors of the federation.")
        self._eval_tensors = {c: dict(named) for c, named in tensors.items()}

    def scored_tensors(self, client: int) -> dict[str, Tensor]:
        """What evaluation scores for ``client`` on top of the global shared part, before any adaptation
        (the algorithm's :class:`EvaluationSpec`: its local part, nothing, a slot, a mixture). Not copies."""
        return scored_tensors(
            self.evaluation_spec,
            client,
            self.global_view(),
            self.store.personal(client, self.local_names),
            lambda: self.store.client_state(client),
        )

    def scoring(self, module: nn.Module, client: int) -> AbstractContextManager:
        """While the block runs, ``module.forward`` predicts as ``client``'s scored model: the algorithm's
        ``EvaluationSpec.forward`` with the client's declared tensors and the server tensors (restored after;
        nothing changes without one). ``-1``: a client that never trained (the templates)."""
        return scoring_forward(
            module, self.evaluation_spec, lambda: self.store.client_state(client), self.server_tensors
        )

    def scored_forward(self, module: nn.Module, client: int) -> ScoredForward | None:
        """A standalone ``forward`` for ``module`` predicting as ``client``'s scored model, over copies of
        its declared tensors and the server tensors (``None`` without ``EvaluationSpec.forward``)."""
        forward = self.evaluation_spec.forward
        if forward is None:
            return None
        state = {n: t.detach().clone() for n, t in self.store.client_state(client).items()}
        server = {n: t.detach().clone() for n, t in self.server_tensors.items()}
        return ScoredForward(forward, module, state, server)

    def evaluation_tensors(self, client: int) -> dict[str, Tensor]:
        """What makes ``client``'s model its own in the current evaluation (not copies: do not modify):
        :meth:`scored_tensors`, with those set by :meth:`set_evaluation_tensors` in their place."""
        return {**self.scored_tensors(client), **self._eval_tensors.get(client, {})}

    def end_evaluation(self) -> None:
        """Put back what training had live before the evaluation."""
        if self._eval_stash is not None:
            self._write(self.shared_names + self.local_names, self._eval_stash)
            self._eval_stash = None
        else:
            if self._scores_shared():  # the shared part may hold a client's own values
                self._write(self.shared_names, self.global_state)
            if self._live is not None:
                self._write(self.local_names, self.store.get(self._live.client))
        self._eval_tensors = {}
        self._eval_client = None

    def load_personalized(self, client: int) -> None:
        """Write ``client``'s personalized model into the module: what evaluation scores (before any
        adaptation); ``-1``: a new client's model (the global shared part and the initial local part)."""
        self._write_personal(client)
        if client != -1 and self.evaluation_spec.score != "personal":
            own = self.scored_tensors(client)
            self._write(list(own), list(own.values()))

    def _tensors(self, names: Iterable[str]) -> list[Tensor]:
        return [self._named[n] for n in names]

    @torch.no_grad()
    def _write(self, names: Sequence[str], values: Sequence[Tensor]) -> None:
        targets = self._tensors(names)
        if targets:
            torch._foreach_copy_(targets, list(values))

    def _write_personal(self, client: int) -> None:
        self._write(self.shared_names, self.global_state)
        personal = self.store.personal(client, self.local_names)
        self._write(list(personal), list(personal.values()))

    def _optimizer_snapshot(self) -> OptimizerState:
        """The optimizer state of the client's local parameters (the shared part restarts every round)."""
        local = {id(t) for t in self._tensors(self.local_names)}
        snapshot: OptimizerState = {}
        for index, optimizer in enumerate(self._optimizers):
            snapshot[index] = {
                i: {
                    k: v.detach().clone() if isinstance(v, Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
                for i, p in enumerate(_optimizer_params(optimizer))
                if id(p) in local and optimizer.state.get(p)
            }
        return snapshot


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
