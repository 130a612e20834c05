"""The sequential runner: one client step per Lightning step, the user's own ``training_step``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.objective import Objective, StepOutcome, StepView, pure_loss
from lightning_fedrep.federation.module.batches import batch_pair
from lightning_fedrep.federation.module.losses import LossFn
from lightning_fedrep.federation.plan import RoundPlan
from lightning_fedrep.federation.run import NOTHING_RAN, Notify, StepLoss, live_view, step_loss


class SequentialRunner:
    """Trains a round's clients one after another: at each step it loads the step's client (handing the
    previous one to the federation), sets its phase, runs the user's step and applies the local objective
    (its loss terms added to the step's loss, its transforms around the optimizer step).

    Args:
        federation: the federated state the clients are loaded from and stored into.
        notify: tells the federated callbacks (``on_client_start``, ``on_client_end``).
        objective: the local objective of a phase part (``None``: nothing added).
        module: the live module (what the objective's :class:`StepView` reads).
        lr: the live client's learning rate (what ``StepView.lr`` holds), or ``None``.
        optimizers: the user's optimizers (their lrs are scaled by a client's ``lr_scale``).
        loss_fn: the module's declared per-sample loss (``fedrep_loss``), what a step rule differentiates.

    A phase whose objective has a :class:`~lightning_fedrep.federation.api.objective.StepRule` does not run the
    user's ``training_step``: the rule computes the gradients ``g`` on the batch's ``(x, y)`` and the step
    returns the surrogate ``sum((p * g).sum())`` (``g`` detached), whose gradient is exactly ``g``.
    """

    vectorized = False

    def __init__(
        self,
        federation: Federation,
        notify: Notify,
        objective: Callable[[str], Objective] | None = None,
        module: Any = None,
        lr: Callable[[], float | None] | None = None,
        optimizers: Callable[[], Sequence[torch.optim.Optimizer]] | None = None,
        loss_fn: LossFn | None = None,
    ):
        self.federation = federation
        self.notify = notify
        self.objective = objective
        self.module = module
        self.lr = lr or (lambda: None)
        self.optimizers = optimizers or (lambda: ())
        self._lr_scale = 1.0
        self._in_step = False
        self._idle = False
        self._client_step = 0
        self.loss_fn = loss_fn
        self._outcome: StepOutcome | None = None
        """The step rule's outcome of the step being run (its client_state is written after the step)."""
        self._rule_samples = 0
        """The samples of the batch the step rule ran on (what its loss is weighted by in ``train/loss``)."""

    def schedule(self, plan: RoundPlan, own: bool = True) -> RoundPlan:
        return plan

    def open_round(self, plan: RoundPlan) -> None:
        pass

    def begin_step(self, plan: RoundPlan, step: int) -> None:
        federation = self.federation
        location = plan.locate(step)
        if location.client != federation.live_client:
            self.finish()
            federation.load_client(location.client)
            self.notify("on_client_start", location.client)
        self._lr_scale = plan.work[location.work_index].lr_scale
        self._idle = federation.live_failed  # its step raised earlier in the round (on_client_error="skip")
        if not self._idle:
            federation.begin_step(location)
            self._client_step = location.client_step

    def loss(self, batch: Any, batch_idx: int, user_step: Callable[[], Any]) -> Any:
        if self._idle:
            return NOTHING_RAN
        objective = self._objective()
        self._outcome = None
        captured: dict[str, Tensor] = {}
        try:
            if objective is not None and objective.step is not None:
                return self._rule_loss(objective, batch, batch_idx)
            with _captured_features(self.module, objective, captured):
                output = user_step()
        except Exception as error:
            if self.federation.config.on_client_error != "skip":
                raise
            self.federation.fail_live_client(self._client_step, error)
            return NOTHING_RAN
        if objective is None or not objective.terms:
            return output
        return _with_terms(output, lambda: self._terms(objective, batch, batch_idx, captured))

    def _rule_loss(self, objective: Objective, batch: Any, batch_idx: int) -> Tensor:
        """The step rule's outcome on the batch, as the surrogate loss whose gradient is its ``grads``."""
        rule = objective.step
        if self.loss_fn is None:
            raise ValueError(
                f"The step rule {rule.name!r} needs the module's declared loss: set fedrep_loss on the module."
            )
        x, y = batch_pair(batch, f"the step rule {rule.name!r}")
        view = self._view(batch, batch_idx)
        detached = {n: t.detach() for n, t in view.tensors.items()}
        view = replace(
            view, tensors=detached, trained={n: detached[n] for n in view.trained}, batch=None, batch_idx=None
        )
        outcome = rule.fn(pure_loss(self.module, self.loss_fn), view, x, y)
        if not isinstance(outcome, StepOutcome):
            raise TypeError(f"The step rule {rule.name!r} must return a StepOutcome, got {outcome!r}.")
        unknown = sorted(set(outcome.grads) - set(view.trained))
        if unknown:
            raise KeyError(
                f"The step rule {rule.name!r} returned gradients for {unknown}, which the phase does not train "
                f"(it trains {sorted(view.trained)})."
            )
        self._outcome, self._rule_samples = outcome, x.shape[0]
        live = dict(self.module.named_parameters())
        return _surrogate({n: live[n] for n in outcome.grads}, outcome.grads)

    def _objective(self) -> Objective | None:
        if self.objective is None or self.federation.live_phase is None:
            return None
        return self.objective(self.federation.live_phase)

    def _view(self, batch: Any = None, batch_idx: int | None = None) -> StepView:
        lr = self.lr()  # inside the optimizer step the param groups already hold the scaled lr
        lr = lr * self._lr_scale if lr is not None and not self._in_step else lr
        return live_view(self.federation, self.module, batch, batch_idx, self._client_step, lr)

    def _terms(
        self, objective: Objective, batch: Any, batch_idx: int, captured: dict[str, Tensor]
    ) -> list[Any]:
        view = self._view(batch, batch_idx)
        found = []
        for term in objective.terms:
            features = None
            if term.needs_features:
                features = captured.get(term.features_of)
                if features is None:
                    raise RuntimeError(
                        f"LossTerm {term.name!r} needs the input of {term.features_of!r}, which training_step "
                        "never called: the step must run the model's forward through it."
                    )
            found.append(term.fn(replace(view, features=features)))
        return found

    def logged_loss(self) -> list[StepLoss]:
        """The step rule's loss on its batch (the user's step, which did not run, logs nothing); else none:
        the user's step logs its own."""
        outcome = self._outcome
        if outcome is None:
            return []
        return [step_loss(outcome.loss.detach().reshape(()), torch.tensor(self._rule_samples))]

    def step(self, optimizer_step: Callable[..., Any], closure: Callable[[], Any]) -> Any:
        """The user's optimizer step; the objective's gradient transforms run after the closure's backward
        (``optimizer_step`` takes the closure to run), its parameter transforms after the step."""
        if self._idle:
            closure()  # it trains nothing
            return None
        self._in_step = True
        try:
            with _ScaledLr(self.optimizers(), self._lr_scale):
                output = self._step(optimizer_step, closure)
        finally:
            self._in_step = False
        outcome, self._outcome = self._outcome, None
        if outcome is not None and outcome.client_state:
            self.federation.put_live_state(outcome.client_state)
        return output

    def _step(self, optimizer_step: Callable[..., Any], closure: Callable[[], Any]) -> Any:
        objective = self._objective()
        if objective is None or not (objective.grad_transforms or objective.param_transforms):
            return optimizer_step()

        def transformed() -> Any:
            loss = closure()
            self._transform_grads(objective)
            return loss

        output = optimizer_step(transformed) if objective.grad_transforms else optimizer_step()
        self._transform_params(objective)
        return output

    def _transform_grads(self, objective: Objective) -> None:
        view = self._view()
        trained = view.trained
        for transform in objective.grad_transforms:
            grads = {n: p.grad for n, p in trained.items() if p.grad is not None}
            for name, grad in transform.fn(grads, view).items():
                trained[name].grad = grad

    @torch.no_grad()
    def _transform_params(self, objective: Objective) -> None:
        view = self._view()
        for transform in objective.param_transforms:
            current = {n: p.detach() for n, p in view.trained.items()}
            for name, value in transform.fn(current, view).items():
                view.trained[name].copy_(value)

    def end_step(self) -> None:
        self.federation.end_step()

    def finish(self) -> None:
        result = self.federation.finish_client()
        if result is not None:
            self.notify("on_client_end", result)

    def abandon(self) -> None:
        self._idle = False

    @property
    def current_clients(self) -> tuple[int, ...]:
        client = self.federation.live_client
        return () if client is None else (client,)

    @property
    def current_phase(self) -> str | None:
        return self.federation.live_phase

    def settings(self) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_settings(self, settings: dict[str, Any] | None) -> None:
        pass

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


def _surrogate(params: dict[str, Tensor], grads: Any) -> Tensor:
    """``sum((p * g).sum())`` with ``g`` detached: its gradient with respect to each ``p`` is exactly ``g``."""
    total = None
    for name, param in params.items():
        term = (param * grads[name].detach().to(param.dtype)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("A step rule returned no gradients: it must move at least one trained tensor.")
    return total


def _with_terms(output: Any, terms: Callable[[], list[Any]]) -> Any:
    """``output`` (a loss, or a dict with ``"loss"``) plus every term that is not ``None``."""
    loss = output["loss"] if isinstance(output, dict) else output
    if loss is None:
        return output
    for extra in terms():
        if extra is not None:
            loss = loss + extra
    return {**output, "loss": loss} if isinstance(output, dict) else loss


class _captured_features:
    """While the user's step runs, keep the input of each submodule a loss term takes ``features`` from."""

    def __init__(self, module: Any, objective: Objective | None, captured: dict[str, Tensor]):
        names = []
        if objective is not None and module is not None:
            names = list(dict.fromkeys(t.features_of for t in objective.terms if t.needs_features))
        self.hooks = [
            module.get_submodule(name).register_forward_pre_hook(
                lambda _m, args, name=name: captured.__setitem__(name, args[0]) if args else None
            )
            for name in names
        ]

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        for hook in self.hooks:
            hook.remove()


class _ScaledLr:
    """Every param group's ``lr`` times the client's ``lr_scale`` for one optimizer step, then put back (so a
    checkpoint or an LR scheduler never sees the scaled value)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], factor: float):
        self.groups = [g for o in optimizers for g in o.param_groups] if factor != 1.0 else []
        self.factor = factor
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = [g["lr"] for g in self.groups]
        for group in self.groups:
            group["lr"] = group["lr"] * self.factor

    def __exit__(self, *exc: Any) -> None:
        for group, lr in zip(self.groups, self.saved):
            group["lr"] = lr
