"""A per-client ``lr_scale`` (``configure_round`` settings) on the lockstep runner: each client of a group steps
at its own learning rate, as on the sequential runner (which scales every param group's ``lr`` for the step),
for the stacked SGD, the per-client view optimizers (Adam, AdamW), several param groups, an LR scheduler,
chunked groups and compiled head steps; and ``StepView.lr`` is each client's scaled rate in loss terms, step
transforms and step rules (per lane inside the ``vmap`` where the lanes' scales differ). The plain PyTorch loop
of a scaled round is in ``tests/test_configure_round.py``; this file compares the runners over the engines'
harder cases."""

from __future__ import annotations

import pytest
import torch

from lightning_fedrep import APFL, FedRep, LossTerm, Objective, ParamTransform
from tests.test_engine import DeclaredNet, Net, assert_same, fit

SCALES = (0.5, 1.0, 2.0, 0.25, 1.5, 3.0)
"""Client ``c`` trains at ``SCALES[c]`` times the optimizer's learning rate: every group mixes scales."""


def scaled(plan):
    return plan.replace(settings={c: {"lr_scale": SCALES[c]} for c in plan.clients})


class ScaledFedRep(FedRep):
    """FedRep whose clients each train at their own ``lr_scale``."""

    def configure_round(self, plan, server):
        return scaled(plan)


class LrReadingFedRep(ScaledFedRep):
    """Also reads ``view.lr`` in a loss term and in a parameter transform (a decoupled decay), so a client's
    tensors depend on the learning rate its view reports."""

    def objective(self, phase):
        def term(view):
            return view.lr * sum(t.square().sum() for t in view.trained.values())

        def decay(current, view):
            return {n: t * (1 - 0.5 * view.lr) for n, t in current.items()}

        return Objective(
            terms=(LossTerm(term, "lr-weighted l2"),), param_transforms=(ParamTransform(decay, "decay"),)
        )


class ScaledAPFL(APFL):
    """APFL (a step rule whose personal step reads ``view.lr``) with per-client ``lr_scale``."""

    def configure_round(self, plan, server):
        return scaled(plan)


def both(**kwargs):
    sequential, _ = fit("sequential", **kwargs)
    vectorized, _ = fit("vectorized", **kwargs)
    assert vectorized.runner_report.runner == "vectorized", vectorized.runner_report
    return sequential, vectorized


@pytest.mark.parametrize(
    "optimizer,scheduler,width",
    [("sgd", False, None), ("sgd_groups", True, 2), ("adam", False, None), ("adamw", True, 3)],
    ids=["stacked-sgd", "sgd-groups-scheduler-chunked", "adam", "adamw-scheduler-chunked"],
)
def test_lockstep_scales_each_clients_lr_as_the_sequential_runner(optimizer, scheduler, width):
    """Fails if the lockstep optimizers ignore ``lr_scale``, apply one client's to the whole group, or leave
    the scaled rate in the param groups (the scheduler's next rate would be off)."""
    model = lambda: Net(optimizer=optimizer, scheduler=scheduler)  # noqa: E731
    sequential, vectorized = both(model=model, algorithm=ScaledFedRep(), width=width, clients_per_round=6)
    assert_same(sequential, vectorized)
    plain, _ = fit("vectorized", model=model, algorithm="fedrep", width=width, clients_per_round=6)
    with pytest.raises(AssertionError):  # the scales changed something
        assert_same(plain, vectorized)


def test_step_view_lr_is_each_lanes_scaled_rate_in_terms_and_transforms():
    """A loss term and a parameter transform that read ``view.lr``, clients of different scales in one lockstep
    step. Fails if the lockstep view gives every lane the unscaled rate (or one lane's)."""
    sequential, vectorized = both(algorithm=LrReadingFedRep(), clients_per_round=6)
    assert_same(sequential, vectorized)


def test_step_rule_reads_each_lanes_scaled_rate():
    """APFL's step rule moves the personal model by ``view.lr``: per lane under the ``vmap``. Fails if the rule
    cannot take a tensor ``lr`` (``view.lr or 0.0``) or reads the unscaled rate."""
    sequential, vectorized = both(algorithm=ScaledAPFL(), clients_per_round=6, local_epochs=1)
    assert_same(sequential, vectorized)
    for client in range(6):
        for name, value in sequential.federation.store.client_state(client).items():
            got = vectorized.federation.store.client_state(client)[name]
            torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-4, msg=f"{client} {name}")


def test_compiled_head_steps_apply_lr_scale():
    """The compiled cached head step computes gradients only; the clients' optimizers step at their scaled
    rates after it. Fails if the compiled path bypasses the scaling."""
    sequential, _ = fit("sequential", model=DeclaredNet, algorithm=ScaledFedRep(), clients_per_round=6)
    compiled, _ = fit(
        "vectorized", model=DeclaredNet, algorithm=ScaledFedRep(), clients_per_round=6, compile=True
    )
    step = compiled.lockstep_engine._head_step
    assert step is not None and step.failure is None
    assert_same(sequential, compiled)
