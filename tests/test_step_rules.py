"""``StepRule`` (``Objective.step``) on the sequential runner: the surrogate loss hands Lightning's backward
exactly the rule's gradients, the rule's loss is what is logged, and the configurations it cannot run are
refused at setup (no declared loss, two rules, loss terms beside a rule) or fall back from the lockstep runner
naming the rule."""

from dataclasses import replace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_fedrep import (
    FederatedCallback,
    FederatedStrategy,
    FedProx,
    LossTerm,
    Objective,
    PerFedAvg,
    StepOutcome,
    StepRule,
)
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.declared import ClientTensors
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule
from tests.test_engine_equivalence import LossNet

RULE_LOSS = 7.25


class OddGradients(Algorithm):
    """FedAvg whose step rule returns gradients no loss of the model has: ``g = 1/3 + step`` everywhere, with
    values that need every bit of float32 (so a surrogate losing precision shows)."""

    def __init__(self, seen):
        super().__init__("odd_gradients", {"body", "head"}, "test algorithm")
        self.seen = seen

    def objective(self, phase):
        def rule(loss, view, x, y):
            grads = {
                n: torch.full_like(t, 1 / 3) * (1 + view.step) + torch.rand_like(t)
                for n, t in view.trained.items()
            }
            self.seen.append({n: g.clone() for n, g in grads.items()})
            return StepOutcome(grads, torch.tensor(RULE_LOSS))

        return Objective(step=StepRule(rule, "odd gradients", vmappable=False))


class GradientsSeen(Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def fit(algorithm, model=None, runner="auto", callbacks=(), rounds=1):
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=2, seed=1, local_epochs=1, runner=runner
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=list(callbacks)
    )
    trainer.fit(
        model if model is not None else LossNet(), datamodule=tiny_datamodule(num_clients=3, batch_size=64)
    )
    return strategy, trainer


def test_the_optimizer_sees_exactly_the_rules_gradients_and_its_loss_is_logged():
    """Fails if the surrogate loses precision (``grads[name].detach().half().to(param.dtype)`` in
    ``_surrogate``) or if the step rule's loss is not logged as ``train/loss`` (``logged_loss`` returning
    ``None``)."""
    seen, captured = [], GradientsSeen()
    strategy, trainer = fit(OddGradients(seen), runner="sequential", callbacks=[captured])
    assert strategy.runner_report.runner == "sequential"
    assert len(seen) == len(captured.grads) > 0
    for expected, got in zip(seen, captured.grads):
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    assert trainer.callback_metrics["train/loss"].item() == RULE_LOSS


def test_a_step_rule_without_a_declared_loss_is_refused_at_setup():
    """TinyNet declares no ``fedrep_loss``: the fit stops at setup naming it (before any step)."""
    with pytest.raises(ValueError, match="fedrep_loss"):
        fit(PerFedAvg(), model=TinyNet())


class SecondRule(FederatedCallback):
    def objective(self, phase):
        return Objective(step=StepRule(lambda *a: None, "callback rule"))


class ExtraTerm(FederatedCallback):
    def objective(self, phase):
        return Objective(terms=(LossTerm(lambda view: None, "extra term"),))


def test_two_step_rules_are_refused_naming_both():
    with pytest.raises(ValueError, match="callback rule.*Per-FedAvg maml step"):
        fit(PerFedAvg(), callbacks=[SecondRule()])


def test_loss_terms_beside_a_step_rule_are_refused():
    """A rule replaces the loss: a term added to it would be silently ignored."""
    with pytest.raises(ValueError, match="extra term"):
        fit(PerFedAvg(), callbacks=[ExtraTerm()])


def test_objectives_with_a_step_each_do_not_add():
    rule = StepRule(lambda *a: None, "a")
    with pytest.raises(ValueError, match="Two step rules"):
        Objective(step=rule) + Objective(step=StepRule(lambda *a: None, "b"))
    assert (Objective(step=rule) + Objective()).step is rule
    assert (Objective() + Objective(step=rule)).step is rule and not Objective(step=rule).empty


class SequentialPerFedAvg(PerFedAvg):
    def objective(self, phase):
        return Objective(step=replace(super().objective(phase).step, vmappable=False))


def test_a_rule_that_cannot_be_vmapped_falls_back_naming_it():
    """``runner="auto"`` runs sequentially and says which rule keeps it so; ``runner="vectorized"`` refuses.
    Fails if ``federation_reasons`` leaves the rule out (the engine would run a rule that cannot be vmapped)."""
    strategy, _ = fit(SequentialPerFedAvg(), runner="auto")
    report = strategy.runner_report
    assert report.runner == "sequential" and "Per-FedAvg maml step" in report.reason, report
    with pytest.raises(ValueError, match="step rule 'Per-FedAvg maml step' cannot run in lockstep"):
        fit(SequentialPerFedAvg(), runner="vectorized")


def test_a_vmappable_rule_runs_in_lockstep_without_a_feature_cache():
    """Per-FedAvg's rule is vmappable: ``runner="vectorized"`` runs it, and says that head phases do not train on
    cached features under a rule (it runs the whole module)."""
    strategy, _ = fit(PerFedAvg(), runner="vectorized")
    report = strategy.runner_report
    assert report.runner == "vectorized", report
    assert "the step rule 'Per-FedAvg maml step' runs the whole module" in report.reason, report


def test_a_plain_objective_still_trains_its_loss_terms():
    """FedProx (terms, no rule) is unchanged by the rule path: ``step`` stays ``None`` through ``for_phase``."""
    objective = FedProx(mu=0.1).objective("all").for_phase("all")
    assert objective.step is None and objective.terms


class NanForClientZero(Algorithm):
    """FedAvg whose rule moves nothing but writes ``c = 1`` for every client, NaN for client 0."""

    client_tensors = (ClientTensors("c", shapes=(1,)),)

    def __init__(self):
        super().__init__("nan_for_client_zero", {"body", "head"}, "test algorithm")

    def objective(self, phase):
        def rule(loss, view, x, y):
            grads = {n: torch.zeros_like(t) for n, t in view.trained.items()}
            value = torch.where(view.client == 0, torch.nan, 1.0).reshape(1)
            return StepOutcome(grads, loss(view.tensors, x, y, view.mask), {"c": value})

        return Objective(step=StepRule(rule, "nan for client 0"))


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_client_whose_steps_wrote_non_finite_declared_tensors_is_left_out_with_them_undone(runner):
    """``on_nonfinite="skip"``: client 0 is left out of the round and keeps its declared tensors as before the
    round (zeros); the others keep what their steps wrote. Fails if ``store_client`` does not check the tensors
    the steps wrote (``stepped`` left out of ``_nonfinite``) or ``_leave_out`` does not restore them."""
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=NanForClientZero(), clients_per_round=3, seed=1, local_epochs=1, runner=runner
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="Client 0 is left out"):
        trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=3, batch_size=64))
    assert strategy.runner_report.runner == runner
    store = strategy.federation.store
    assert torch.equal(store.client_state(0)["c"], torch.zeros(1))
    assert torch.equal(store.client_state(1)["c"], torch.ones(1))
    assert torch.equal(store.client_state(2)["c"], torch.ones(1))


def test_required_loss_is_the_declared_classification_loss_or_a_refusal_naming_the_algorithm():
    """``required_loss`` (the loss FedCP, FedDBE, GPFL, FedProto and FedPAC differentiate themselves): the
    declared callable as given, ``"cross_entropy"`` as the per-sample cross-entropy, anything else refused naming
    the algorithm, what the loss scores and the fix."""
    from torch import nn
    from torch.nn import functional as F

    from lightning_fedrep.federation.api.objective import required_loss

    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])

    class Named(nn.Linear):
        fedrep_loss = "cross_entropy"

    class Given(nn.Linear):
        fedrep_loss = staticmethod(lambda z, y: z.sum(1))

    loss = required_loss(Named(2, 3), "FedX", "h(rep)")
    torch.testing.assert_close(loss(logits, labels), F.cross_entropy(logits, labels, reduction="none"))
    assert required_loss(Given(2, 3), "FedX", "h(rep)") is Given.fedrep_loss
    for declared in (None, "mse"):

        class Other(nn.Linear):
            fedrep_loss = declared

        with pytest.raises(
            ValueError, match=r"FedX needs the module's fedrep_loss \(the per-sample loss of h\(rep\)\)"
        ):
            required_loss(Other(2, 3), "FedX", "h(rep)")
