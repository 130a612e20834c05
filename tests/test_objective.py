"""Step transforms of the local objective (``GradTransform`` before the optimizer step, ``ParamTransform``
after it) on both runners, against a plain PyTorch loop; the deprecated ``Algorithm.loss_term`` adapter."""

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import Algorithm, GradTransform, Objective, ParamTransform
from tests.fixtures import reference_clients
from tests.test_fedprox import LOCAL_EPOCHS, NUM_CLIENTS, PER_ROUND, ROUNDS, fit

HALF, PULL = 0.5, 0.3


class Transformed(Algorithm):
    """FedAvg whose gradients are halved before each step and whose parameters are pulled towards the
    round-start global ones after it: ``w <- w - lr * PULL * (w - w_global)``."""

    def __init__(self):
        super().__init__("transformed", {"body", "head"}, "test")

    def objective(self, phase):
        def halve(grads, view):
            return {n: HALF * g for n, g in grads.items()}

        def pull(params, view):
            return {n: w - view.lr * PULL * (w - view.server[n]) for n, w in params.items()}

        return Objective(
            grad_transforms=(GradTransform(halve, "halve"),), param_transforms=(ParamTransform(pull, "pull"),)
        )


def plain_loop(init, dm):
    global_state = {k: v.clone() for k, v in init.state_dict().items()}
    for r in range(ROUNDS):
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}
        weight = 0.0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, 4, r):
            model = copy.deepcopy(init)
            model.load_state_dict(global_state)
            optimizer = model.configure_optimizers()
            lr = optimizer.param_groups[0]["lr"]
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                for p in model.parameters():
                    p.grad.mul_(HALF)
                optimizer.step()
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.sub_(lr * PULL * (p - global_state[n]))
            for k, v in model.state_dict().items():
                total[k] += v.double() * len(x)
            weight += len(x)
        global_state = {k: (v / weight).float() for k, v in total.items()}
    return global_state


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_grad_and_param_transforms_equal_a_plain_loop(runner):
    """Fails if a runner skips a transform, runs the gradient transform after the optimizer step (or the
    parameter transform before it), or applies it to clients that do not step."""
    strategy, init, dm = fit(runner, Transformed())
    dm.setup()
    expected = plain_loop(init, dm)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)


class LegacyProx(Algorithm):
    def __init__(self):
        super().__init__("legacy_prox", {"body", "head"}, "test")

    def loss_term(self, module, global_state):
        return 0.25 * sum((p - global_state[n]).pow(2).sum() for n, p in module.named_parameters())


def test_the_deprecated_loss_term_still_runs_sequentially_with_a_warning():
    """The v1 ``Algorithm.loss_term`` keeps working (sequential runner, the reason names it) and warns,
    naming ``Algorithm.objective``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy, _, _ = fit("auto", LegacyProx())
    assert strategy.runner_report.engine == "sequential"
    assert "LegacyProx.loss_term" in strategy.runner_report.reason
    assert any(
        issubclass(w.category, DeprecationWarning) and "Algorithm.objective" in str(w.message) for w in caught
    )
