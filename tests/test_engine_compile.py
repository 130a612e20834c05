"""Compiled cached head steps (``compile=True``): the head steps on cached features computed by one
``torch.compile``-d function (gradients and losses of every client), the clients' optimizers as before.

The references are the eager engine on the same batches (itself checked against the sequential path in
``test_engine.py``) and the sequential path: compiled steps must give the same tensors within the engines'
tolerance (a compiled graph may fuse and reorder float operations, so not bit for bit), and exactly the same
where nothing is compiled. Compiling costs seconds per graph, so these tests share the module's shapes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.exc import CppCompileError, InductorError

from lightning_fedrep.runners.lockstep import compiled
from tests.test_engine import SMALL, DeclaredNet, DropoutNet, Net, assert_same, fit
from tests.test_engine_loss_paths import OwnLossNet


def compiled_engine_ran(strategy) -> bool:
    step = strategy.lockstep_engine._head_step
    return step is not None and step.failure is None and step._reached is not None


@pytest.fixture
def graphs(monkeypatch) -> CompileCounterWithBackend:
    """Counts the graphs the engine compiles and their operations (inductor still compiles them)."""
    counter, real_compile = CompileCounterWithBackend("inductor"), torch.compile
    monkeypatch.setattr(
        compiled.torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=counter, **kwargs)
    )
    return counter


MODELS = {"declared": DeclaredNet, "detected": Net, "own loss": OwnLossNet}


@pytest.mark.parametrize(
    "optimizer,model_name",
    [("sgd", "declared"), ("adam", "declared"), ("sgd", "detected"), ("sgd", "own loss")],
)
def test_compiled_head_steps_equal_eager_and_sequential(optimizer, model_name, graphs):
    """Catches compiled gradients that differ from autograd's (a wrong mask or lane, padding counted, the
    inactive lanes' losses kept), and a step that never ran compiled (no graph built, or one without the
    step's operations); a named loss runs once over all lanes, a user's own loss per lane."""
    model = lambda: MODELS[model_name](optimizer=optimizer)  # noqa: E731
    eager, _ = fit("vectorized", model=model)
    sequential, _ = fit("sequential", model=model)
    got, trainer = fit("vectorized", model=model, compile=True)
    assert compiled_engine_ran(got)
    assert graphs.frame_count >= 1 and graphs.op_count > 10
    assert got.runner_settings["compile"] is True
    assert_same(eager, got)
    assert_same(sequential, got)
    torch.testing.assert_close(
        trainer.callback_metrics["train/loss"], eager.lightning_module.trainer.callback_metrics["train/loss"]
    )


def test_unfused_compiled_steps_equal_fused_ones():
    """Unfused, Lightning backpropagates a surrogate of the compiled gradients: it must hand the optimizer
    exactly those gradients (bit for bit the fused run, whose steps write them directly)."""
    fused, fused_trainer = fit("vectorized", model=DeclaredNet, compile=True)
    unfused, unfused_trainer = fit("vectorized", model=DeclaredNet, compile=True, steps_per_call=1)
    assert compiled_engine_ran(fused) and compiled_engine_ran(unfused)
    assert_same(fused, unfused, exact=True)
    assert torch.equal(
        unfused_trainer.callback_metrics["train/loss"], fused_trainer.callback_metrics["train/loss"]
    )


class UnusedHeadParameterNet(DeclaredNet):
    """A head tensor the loss never reaches: autograd leaves its gradient unset, so SGD's weight decay and
    momentum never touch it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.classifier.register_parameter("spare", nn.Parameter(torch.ones(3)))


def test_a_head_tensor_the_loss_does_not_reach_is_not_stepped():
    """Catches the compiled step handing zeros (``grad`` of an unused input) to the optimizer, whose weight
    decay would then shrink the tensor the eager engine leaves alone."""
    eager, _ = fit("vectorized", model=UnusedHeadParameterNet)
    got, _ = fit("vectorized", model=UnusedHeadParameterNet, compile=True)
    assert compiled_engine_ran(got)
    assert got.lightning_module.classifier.spare.requires_grad
    for client in range(got.num_clients):
        assert torch.equal(got.client_tensors(client)["classifier.spare"], torch.ones(3))
    assert_same(eager, got)


def test_a_failed_compile_warns_and_steps_eagerly(monkeypatch):
    """Nothing is lost where compiling fails: a warning says so, and the run is the eager engine's bit for bit."""

    def failing_compile(fn, **kwargs):
        def run(*args):
            raise InductorError(CppCompileError(["g++"], "no working C++ compiler"), "")

        return run

    monkeypatch.setattr(compiled.torch, "compile", failing_compile)
    eager, _ = fit("vectorized", model=DeclaredNet)
    with pytest.warns(RuntimeWarning, match="could not compile the cached head step .*InductorError"):
        got, _ = fit("vectorized", model=DeclaredNet, compile=True)
    assert got.lockstep_engine._head_step.failure is not None
    assert_same(eager, got, exact=True)


class GraphBreakHeadNet(DeclaredNet):
    """A head dynamo cannot trace in one graph (eager and ``vmap`` run it as usual)."""

    def forward_head(self, features):
        torch._dynamo.graph_break()
        return self.classifier(features)


def test_a_head_dynamo_cannot_trace_in_one_graph_warns_and_steps_eagerly():
    """A real compile failure (not a stand-in): the graph break raises under ``fullgraph``, the run says so and
    is the eager engine's bit for bit."""
    eager, _ = fit("vectorized", model=GraphBreakHeadNet)
    with pytest.warns(RuntimeWarning, match="could not compile the cached head step"):
        got, _ = fit("vectorized", model=GraphBreakHeadNet, compile=True)
    assert "Unsupported" in got.lockstep_engine._head_step.failure
    assert_same(eager, got, exact=True)


def test_groups_of_other_widths_compile_their_own_graphs(graphs):
    """Groups of 3 and of 1 (4 clients a round): a graph per width, the one-lane group without ``vmap``."""
    eager, _ = fit("vectorized", model=DeclaredNet, width=3)
    got, _ = fit("vectorized", model=DeclaredNet, width=3, compile=True)
    assert compiled_engine_ran(got)
    assert graphs.frame_count >= 2
    assert_same(eager, got)


def test_the_engine_line_says_what_is_compiled(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fit("vectorized", model=DeclaredNet, compile=True, **SMALL)
        fit("vectorized", model=Net, algorithm="fedavg", compile=True, **SMALL)
        fit("auto", model=DropoutNet, compile=True, **SMALL)
    lines = [
        r.getMessage() for r in caplog.records if "lightning_fedrep: vectorized runner" in r.getMessage()
    ]
    assert len(lines) == 2
    assert "cached head steps compiled (torch.compile" in lines[0]
    assert (
        "compile=True compiles nothing here (no head phase on cached features in the first round)" in lines[1]
    )
    sequential = [
        r.getMessage() for r in caplog.records if "lightning_fedrep: sequential runner" in r.getMessage()
    ]
    assert len(sequential) == 1
    assert sequential[0].endswith("compile=True compiles nothing on it (it runs the module's training_step).")


def test_a_smoke_run_compiles_nothing_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        got, _ = fit("vectorized", model=DeclaredNet, compile=True, trainer=dict(fast_dev_run=True))
    assert got.lockstep_engine._head_step is None and got.runner_settings["compile"] is False
    lines = [
        r.getMessage() for r in caplog.records if "lightning_fedrep: vectorized runner" in r.getMessage()
    ]
    assert "compile=True compiles nothing here (fast_dev_run" in lines[0]


def test_nothing_is_compiled_where_no_head_phase_is_cached():
    eager, _ = fit("vectorized", algorithm="fedavg")
    got, _ = fit("vectorized", algorithm="fedavg", compile=True)
    assert got.lockstep_engine._head_step is None
    assert_same(eager, got, exact=True)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"compile": "yes"}, TypeError, "RunnerSettings.compile must be True or False"),
        ({"compile": 1}, TypeError, "RunnerSettings.compile must be True or False"),
        ({"choice": "sequential", "compile": True}, ValueError, "RunnerSettings\\(compile=True\\) compiles"),
    ],
    ids=str,
)
def test_bad_compile_setting_is_refused_at_construction(kwargs, error, match):
    from lightning_fedrep import RunnerSettings

    with pytest.raises(error, match=match):
        RunnerSettings(**kwargs)
