"""Step transforms of the local objective (``GradTransform`` before the optimizer step, ``ParamTransform``
after it) on both runners, against a plain PyTorch loop; algorithms and callbacks still written for the removed
loss-term route (``loss_term``, ``vectorized_loss_term``, a callback's ``objective(trainer, pl_module, phase)``)
are refused, and the port the refusal shows trains what the old term did."""

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import Algorithm, FederatedCallback, GradTransform, LossTerm, Objective, ParamTransform
from tests.fixtures import reference_clients
from tests.test_fedprox import LOCAL_EPOCHS, NUM_CLIENTS, PER_ROUND, ROUNDS, fit, plain_fedprox

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
    """A FedProx written for the removed loss-term route (``mu / 2 = 0.25``)."""

    def __init__(self):
        super().__init__("legacy_prox", {"body", "head"}, "test")

    def loss_term(self, module, global_state):
        return 0.25 * sum((p - global_state[n]).pow(2).sum() for n, p in module.named_parameters())


def test_an_algorithm_with_the_removed_loss_term_is_refused_at_construction():
    """Nothing calls ``loss_term`` any more: accepted, the run would train without the term. The error names
    the hook and shows its one-line port to ``objective(phase)``."""
    with pytest.raises(
        TypeError, match=r"LegacyProx\.loss_term\(module, global_state\) is a removed hook"
    ) as caught:
        LegacyProx()
    assert (
        'def objective(self, phase): return Objective(terms=(LossTerm(lambda view: <the term>, "<name>"),))'
        in str(caught.value)
    )
    assert "view.server instead of global_state" in str(caught.value)


class PortedProx(Algorithm):
    """``LegacyProx`` ported as its refusal says: the same term, of the step's view, in ``objective``."""

    def __init__(self):
        super().__init__("ported_prox", {"body", "head"}, "test")

    def objective(self, phase):
        return Objective(
            terms=(
                LossTerm(
                    lambda view: (
                        0.25 * sum((w - view.server[n]).pow(2).sum() for n, w in view.trained.items())
                    ),
                    "ported proximal term",
                ),
            )
        )


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_the_ported_loss_term_equals_the_plain_loop_on_both_runners(engine):
    """The port trains what the old term trained (FedProx with ``mu = 0.5``, written out in plain PyTorch), now
    on the lockstep runner too."""
    strategy, init, dm = fit(engine, PortedProx())
    assert strategy.runner_report.runner == engine
    dm.setup()
    for name, value in plain_fedprox(init, dm, mu=0.5).items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)


class LegacyCallbackTerm(FederatedCallback):
    def loss_term(self, trainer, pl_module, batch, step):
        return 0.01 * pl_module.classifier.weight.square().sum()


class LegacyVectorizedTerm(FederatedCallback):
    def vectorized_loss_term(self, trainer, pl_module):
        return lambda tensors, features, mask, client, phase: None


class LegacyObjective(FederatedCallback):
    def objective(self, trainer, pl_module, phase):
        return Objective()


class Started(FederatedCallback):
    """Records that a training batch started (a refusal at set-up comes before any)."""

    def __init__(self):
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


@pytest.mark.parametrize(
    "callback,message",
    [
        (
            LegacyCallbackTerm(),
            r"LegacyCallbackTerm\.loss_term\(trainer, pl_module, batch, step\) is a removed hook",
        ),
        (
            LegacyVectorizedTerm(),
            r"LegacyVectorizedTerm\.vectorized_loss_term\(trainer, pl_module\) is a removed hook",
        ),
        (
            LegacyObjective(),
            r"LegacyObjective\.objective must take one argument, objective\(phase\) -> Objective",
        ),
    ],
    ids=["loss_term", "vectorized_loss_term", "objective(trainer, pl_module, phase)"],
)
def test_a_callback_with_a_removed_hook_is_refused_at_setup(callback, message):
    """A callback still written for the removed route is refused when the strategy's ``setup`` takes the
    callbacks, before any step; the error names the hook and shows the port to ``objective(phase)``."""
    started = Started()
    with pytest.raises(TypeError, match=message) as caught:
        fit("sequential", Algorithm("fedavg", {"body", "head"}, "test"), callbacks=[callback, started])
    assert started.batches == 0
    text = str(caught.value)
    assert "def objective(self, phase)" in text or "setup(trainer, pl_module, stage)" in text
