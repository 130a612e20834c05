"""``EvaluationSpec(forward=...)``: an algorithm's own prediction function (FedCP's), used wherever a client's
model is scored or handed out, against plain PyTorch written independently.

The toy algorithm is FedPer-shaped (the body shared, the head per client) with a declared server tensor
``scale`` and a declared client tensor ``shift``, set by ``aggregate``/``finish_client`` to known values; it
predicts ``forward_head(forward_features(x)) * scale + shift``. Each test recomputes that prediction from the
stored tensors with ``F.linear``/``F.relu`` (the tiny MLP restated) and compares what the library logs,
predicts and hands out.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import (
    Algorithm,
    EvaluationSpec,
    FederatedStrategy,
    FineTunedEvaluation,
    Phase,
)
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome
from lightning_fedrep.federation.api.scoring import scoring_forward
from lightning_fedrep.runners.runner_report import PER_BATCH_FORWARD
from tests.fixtures import quiet_trainer, tiny_datamodule
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet

NUM_CLIENTS, ROUNDS, CLASSES = 4, 2, 4
SHIFT = torch.tensor([0.5, -0.5, 1.0, 0.0])
SCALE_STEP = 1.5


def scaled(module: nn.Module, client_state, server, x):
    """The toy algorithm's prediction (module-level: ``client_model`` stays picklable)."""
    return module.forward_head(module.forward_features(x)) * server["scale"] + client_state["shift"]


class ScaledFedPer(Algorithm):
    """FedPer with ``shift = (c + 1)·SHIFT + round`` per client and ``scale += 1.5`` per round."""

    client_tensors = (ClientTensors("shift", shapes=(CLASSES,)),)
    server_tensors = (ServerTensors("scale", shapes=(1,)),)

    def __init__(self, forward=scaled):
        super().__init__("scaled_fedper", {"body"}, "FedPer scored through a declared scale and shift.")
        self.forward = forward

    def finish_client(self, end):
        shift = (end.client + 1) * SHIFT.to(end.end[end.shared_names[0]].device) + end.round
        return ClientOutcome(upload=end.shared(), client_state={"shift": shift})

    def aggregate(self, server, results, failures):
        return server.replace(
            shared=dict(results.reduced), tensors={"scale": server.tensors["scale"] + SCALE_STEP}
        ), {}

    def evaluation(self) -> EvaluationSpec:
        return EvaluationSpec(forward=self.forward)


class OwnStepNet(DeclaredNet):
    """Its evaluation and prediction steps call ``self(x)``; the test step logs its own cross-entropy too."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_ce", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class HeadlineNet(OwnStepNet):
    """Logs only the headline metrics: the lockstep runner's batched evaluation would apply."""

    fedrep_evaluation = "headline"

    def validation_step(self, batch, batch_idx):
        pass

    def test_step(self, batch, batch_idx):
        pass


def plain(tensors, x):
    """The tiny MLP (``TinyNet``) restated with its stored tensors."""
    h = F.relu(F.linear(x, tensors["body.0.weight"], tensors["body.0.bias"]))
    h = F.relu(F.linear(h, tensors["body.3.weight"], tensors["body.3.bias"]))
    return F.linear(h, tensors["classifier.weight"], tensors["classifier.bias"])


def expected(strategy, client, x):
    """``plain(x) * scale + shift`` from the stored tensors; the stored scale and shift checked against the
    toy's rules (every client trains in every round)."""
    scale = strategy.federation.server_tensors["scale"]
    shift = strategy.federation.store.client_state(client)["shift"] if client != -1 else torch.zeros(CLASSES)
    torch.testing.assert_close(scale, torch.tensor([SCALE_STEP * ROUNDS]))
    if client != -1:
        torch.testing.assert_close(shift, (client + 1) * SHIFT + (ROUNDS - 1))
    tensors = {**strategy.global_tensors(), **strategy.client_tensors(client)}
    with torch.no_grad():
        return plain(tensors, x) * scale + shift


def fit(net=OwnStepNet, runner="sequential", algorithm=None, callbacks=(), **kwargs):
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=16)
    strategy = FederatedStrategy(
        algorithm=algorithm or ScaledFedPer(),
        head="classifier",
        clients_per_round=1.0,
        seed=2,
        local_epochs=1,
        runner=runner,
        **kwargs,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, callbacks=list(callbacks))
    model = net()
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, trainer, model, dm


def assert_scores(strategy, trainer, model, dm, user_metric=True):
    """Per client: the logged test accuracy and loss (and the user's own ``test_ce``) are those of the
    expected prediction; the module's own forward is back afterwards."""
    trainer.test(model, datamodule=dm, verbose=False)
    metrics = strategy.client_metrics["test"]
    for client in range(NUM_CLIENTS):
        x, y = _xy(dm, client, "test")
        out = expected(strategy, client, x)
        acc = (out.argmax(1) == y).double().mean().item()
        assert metrics.per_client("test/acc")[client] == pytest.approx(acc, abs=1e-9), client
        loss = F.cross_entropy(out, y).item()
        assert metrics.per_client("test/loss")[client] == pytest.approx(loss, rel=1e-5), client
        if user_metric:
            assert metrics.per_client("test_ce")[client] == pytest.approx(loss, rel=1e-5), client
    assert "forward" not in model.__dict__


def test_evaluation_scores_the_algorithms_forward_on_the_sequential_runner():
    """Validation's and test's per-client accuracy and loss (the headline metrics and the user's own
    ``self(x)`` in ``test_step``) are ``plain(x)·scale + shift_c``. Fails if the client state is not the scored
    client's (``self.store.client_state(-1)`` in ``LiveModule.scoring``), or if evaluation ignores the forward
    (``with strategy.federation.scoring(...)`` removed from ``FederatedEvaluation.step``)."""
    strategy, trainer, model, dm = fit()
    assert strategy.client_metrics["val"].per_client("val/acc")  # validated every round
    assert_scores(strategy, trainer, model, dm)


def test_training_runs_the_modules_own_forward_after_evaluation():
    """Validation runs after each round; the next round trains with the class's forward: the trained tensors
    equal those of the same fit whose evaluation has no ``forward`` (which ``scale``/``shift`` would change:
    the forward's logits differ), and ``model(x)`` is the class's forward after the fit. Fails if the forward
    is not restored (``restore_forward`` skipped in ``scoring_forward``)."""
    strategy, _, model, _ = fit()
    reference, *_ = fit(algorithm=ScaledFedPer(forward=None))
    for name, value in reference.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)
    for client in range(NUM_CLIENTS):
        for name, value in reference.client_tensors(client).items():
            torch.testing.assert_close(strategy.client_tensors(client)[name], value, rtol=0, atol=0)
    assert "forward" not in model.__dict__
    x = torch.randn(5, 6)
    torch.testing.assert_close(model(x), type(model).forward(model, x))


def test_scoring_forward_is_restored_when_the_forward_raises():
    """An exception inside the block still restores the module's own forward. Fails without the
    ``try``/``finally`` in ``scoring_forward``."""

    def broken(module, client_state, server, x):
        raise RuntimeError("boom")

    model = DeclaredNet()
    with pytest.raises(RuntimeError, match="boom"):
        with scoring_forward(model, EvaluationSpec(forward=broken), dict, {}):
            model(torch.randn(2, 6))
    assert "forward" not in model.__dict__
    model(torch.randn(2, 6))


def test_predictions_and_client_models_use_the_forward():
    """``trainer.predict`` (personalized: each client's test samples; a new client's) and ``client_model(c)(x)``
    (also after ``copy.deepcopy`` and a ``torch.save``/``torch.load`` round trip, and ``new_client_model()``)
    predict ``plain(x)·scale + shift_c``. Fails if prediction ignores the forward (``Prediction.step``
    calling ``user_step`` outside ``federation.scoring``) or if ``client_model`` does not set it
    (``set_forward(module, ...scored_forward...)`` removed)."""
    strategy, trainer, model, dm = fit()
    strategy.predict = "personalized"
    outputs = trainer.predict(model, datamodule=dm)
    by_client: dict[int, list[torch.Tensor]] = {}
    for client, out in zip(strategy.prediction_clients, outputs):
        by_client.setdefault(client, []).append(out)
    assert sorted(by_client) == list(range(NUM_CLIENTS))
    for client, outs in by_client.items():
        x, _ = _xy(dm, client, "test")
        torch.testing.assert_close(torch.cat(outs), expected(strategy, client, x), msg=("predict", client))
    assert "forward" not in model.__dict__
    x = torch.randn(7, 6)
    for client in (*range(NUM_CLIENTS), -1):
        handed = strategy.client_model(client) if client != -1 else strategy.new_client_model()
        buffer = io.BytesIO()
        torch.save(handed, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for copy_ in (handed, copy.deepcopy(handed), loaded):
            with torch.no_grad():
                torch.testing.assert_close(
                    copy_(x), expected(strategy, client, x), msg=("client_model", client)
                )
    strategy.predict = "new_client"
    outputs = trainer.predict(model, datamodule=dm)
    assert "forward" not in model.__dict__
    by_client = {}
    for client, out in zip(strategy.prediction_clients, outputs):
        by_client.setdefault(client, []).append(out)
    for client, outs in by_client.items():
        x, _ = _xy(dm, client, "test")
        torch.testing.assert_close(torch.cat(outs), expected(strategy, -1, x), msg=("new client", client))


def test_the_lockstep_runner_evaluates_the_forward_per_batch():
    """On the lockstep runner with a headline-only module (whose evaluation it would batch over clients with
    the module's head) the logged per-client accuracy and loss are ``plain(x)·scale + shift_c``, and
    ``runner_report.evaluation`` names the per-batch evaluation. Fails if the lockstep runner ignores the forward
    (``scores_per_batch`` forced ``False`` in ``runners/batched_evaluation.py``)."""
    strategy, trainer, model, dm = fit(net=HeadlineNet, runner="vectorized")
    assert strategy.runner_report.runner == "vectorized"
    assert strategy.runner_report.evaluation == PER_BATCH_FORWARD
    assert_scores(strategy, trainer, model, dm, user_metric=False)


def test_a_forward_that_is_not_callable_or_is_combined_with_adapt_is_refused():
    with pytest.raises(TypeError, match="EvaluationSpec.forward must be a callable"):
        EvaluationSpec(forward=3)
    with pytest.raises(ValueError, match="forward and adapt= cannot be combined"):
        EvaluationSpec(forward=scaled, adapt=Phase("all", steps=1))


def test_fine_tuned_evaluation_with_a_forward_is_refused_at_setup():
    """Refused before any step. Fails without the check in ``evaluating.setup``."""
    with pytest.raises(ValueError, match="remove the FineTunedEvaluation callback"):
        fit(callbacks=[FineTunedEvaluation(epochs=1)])
