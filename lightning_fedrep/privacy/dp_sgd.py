"""DP-SGD's local step as a step rule: per-example gradients, each clipped, summed, noised, averaged.

At each local step of a client, on the tensors the phase trains (Abadi et al. 2016, as Opacus computes it):

    g = ( sum_i clip_C(grad loss(x_i, y_i)) + N(0, (z C)^2 I) ) / E[|batch|]

where ``clip_C(v) = v * min(1, C / (||v|| + 1e-6))`` over the flat vector of every trained tensor's gradient,
the batch is a Poisson sample of the client's examples (``RoundLoader``'s ``"poisson"`` sampling) and
``E[|batch|] = q n = min(B, n)``, what Opacus's optimizer divides by under ``loss_reduction="mean"``. The
per-example gradients come from ``torch.func`` (``vmap`` of ``grad`` over the batch's examples), so the rule runs
on the sequential runner and, per client, inside the vectorized runner's ``vmap`` over the clients (clients x
examples). The noise is :func:`~lightning_fedrep.privacy.noise.keyed_normal`, keyed by the seed, the round, the
client, its local step and the tensor's name: both runners draw the same noise.

Loss terms that do not read the batch (FedProx's and Ditto's proximal terms: functions of the parameters and
the server's tensors) add their gradient to the private one, unclipped and unnoised: they reveal nothing about
the examples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from lightning_fedrep.federation.api.objective import LossTerm, PureLoss, StepOutcome, StepView
from lightning_fedrep.privacy.noise import keyed_normal, name_key, noise_key

CLIP_EPSILON = 1e-6
"""Added to an example's gradient norm before dividing the clip by it (Opacus's constant)."""


def per_example_gradients(
    loss: PureLoss, view: StepView, x: Tensor, y: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """Each example's gradient of the declared loss with respect to the trained tensors (``[batch, ...]`` by
    name) and each example's loss (``[batch]``)."""
    trained = dict(view.trained)
    others = {n: t for n, t in view.tensors.items() if n not in trained}

    def example_loss(params: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss({**others, **params}, xi.unsqueeze(0), yi.unsqueeze(0), None)

    if x.shape[0] == 0:  # an empty Poisson batch: nothing to differentiate
        return {n: t.new_zeros((0, *t.shape)) for n, t in trained.items()}, x.new_zeros((0,))
    gradient = torch.func.grad_and_value(example_loss)
    grads, losses = torch.func.vmap(gradient, in_dims=(None, 0, 0), randomness="different")(trained, x, y)
    return grads, losses


def clipped_sum(grads: Mapping[str, Tensor], clip: float, mask: Tensor | None) -> dict[str, Tensor]:
    """The sum over examples of each example's gradient clipped to the flat L2 norm ``clip`` (rows where
    ``mask`` is 0, the padding, count nothing)."""
    squares = [g.reshape(g.shape[0], math.prod(g.shape[1:])).pow(2).sum(1) for g in grads.values()]
    norms = torch.stack(squares).sum(0).sqrt()
    factor = (clip / (norms + CLIP_EPSILON)).clamp(max=1.0)
    if mask is not None:
        factor = factor * mask.to(factor.dtype)
    return {n: torch.tensordot(factor.to(g.dtype), g, dims=1) for n, g in grads.items()}


def step_noise(
    view: StepView, seed: int, names: Sequence[str], like: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Standard normal noise shaped as each trained tensor, keyed by (``seed``, round, client, local step, name)."""
    step = view.client_step if view.client_step is not None else view.step
    return {
        name: keyed_normal(
            noise_key(seed, view.round, view.client, step, name_key(name)), like[name].shape, like[name].dtype
        )
        for name in names
    }


def dp_sgd_step(
    loss: PureLoss,
    view: StepView,
    x: Tensor,
    y: Tensor,
    *,
    clip: float,
    noise_multiplier: float,
    expected_batch: Tensor,
    seed: int,
    terms: Sequence[LossTerm] = (),
) -> StepOutcome:
    """One DP-SGD step of a client (the module docstring's formula), a step rule's function: ``loss`` the
    module's pure declared loss, ``view`` the step's view (its ``trained`` tensors are differentiated, its
    ``mask`` marks real rows), ``(x, y)`` the Poisson batch, ``clip`` the per-example norm bound C,
    ``noise_multiplier`` z, ``expected_batch`` each client's expected batch size (indexed by ``view.client``),
    ``seed`` the strategy's seed (the noise's key), ``terms`` the parameter-only loss terms added after the
    noise."""
    per_example, losses = per_example_gradients(loss, view, x, y)
    summed = clipped_sum(per_example, clip, view.mask)
    names = sorted(summed)
    noise = step_noise(view, seed, names, summed)
    denominator = expected_batch.to(view.client.device)[view.client]
    grads = {
        n: (summed[n] + (noise_multiplier * clip) * noise[n]) / denominator.to(summed[n].dtype) for n in names
    }
    if terms:
        extra = _term_gradients(view, terms)
        grads = {n: g + extra[n] if n in extra else g for n, g in grads.items()}
    mean_loss = _mean(losses, view.mask)
    return StepOutcome(grads=grads, loss=mean_loss.detach())


def _mean(losses: Tensor, mask: Tensor | None) -> Tensor:
    """The mean loss over the real rows (0 for an empty batch)."""
    if mask is None:
        return losses.mean() if losses.numel() else losses.new_zeros(())
    weights = mask.to(losses.dtype)
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


def _term_gradients(view: StepView, terms: Sequence[LossTerm]) -> dict[str, Tensor]:
    """The gradient of the sum of ``terms`` (functions of the parameters, not of the batch) with respect to the
    trained tensors."""

    def total(params: dict[str, Tensor]) -> Tensor:
        tensors = {**view.tensors, **params}
        value = None
        for term in terms:
            found = term.fn(replace(view, tensors=tensors, trained=params, features=None, batch=None))
            if found is not None:
                value = found if value is None else value + found
        return next(iter(params.values())).new_zeros(()) if value is None else value

    return torch.func.grad(total)(dict(view.trained))
