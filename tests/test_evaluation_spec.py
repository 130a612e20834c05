"""``Algorithm.evaluation() -> EvaluationSpec``: what evaluation scores (the personal model, the global one, a
declared slot, a mixture) and the adaptation before scoring, against plain PyTorch written independently.

The federation is the one of ``tests/test_ditto.py`` (every client's training data one batch), whose plain
Ditto loop gives the global model ``w`` and every client's personal model ``v``; an algorithm here is Ditto
scoring another ``EvaluationSpec``. Each test computes the expected per-client test accuracy and loss from
``w``/``v`` with a plain forward pass (and, for ``adapt``, a plain SGD loop) and compares the logged means,
``client_model`` and the personalized predictions (what evaluation scores is what users get out).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import Ditto, EvaluationSpec, FederatedStrategy, Phase, personalized_state_dict
from tests.fixtures import quiet_trainer
from tests.test_ditto import (
    LAM,
    LOCAL_EPOCHS,
    NUM_CLIENTS,
    PER_ROUND,
    ROUNDS,
    SEED,
    _xy,
    full_batch_datamodule,
    plain_ditto,
)
from tests.test_engine_equivalence import LossNet

ALPHA = 0.75


class HeadlineNet(LossNet):
    """LossNet whose evaluation steps log only the headline metrics: the batched evaluation applies."""

    fedrep_evaluation = "headline"


class ScoredDitto(Ditto):
    """Ditto whose evaluation scores ``spec``."""

    evaluation_slot = None

    def __init__(self, spec: EvaluationSpec):
        super().__init__(lam=LAM)
        self.spec = spec

    def evaluation(self) -> EvaluationSpec:
        return self.spec


def mixture(g, v, client):
    """APFL's evaluated model ``α·v + (1−α)·w``."""
    return {n: ALPHA * v[n] + (1 - ALPHA) * g[n] for n in g}


def fit(spec: EvaluationSpec, net: type = LossNet, head: str | None = None):
    torch.manual_seed(0)
    init = net()
    dm = full_batch_datamodule()
    strategy = FederatedStrategy(
        algorithm=ScoredDitto(spec),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        head="classifier" if net is HeadlineNet else head,  # the batched evaluation needs the head
    )
    model = copy.deepcopy(init)
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model


def scores(init, dm, models):
    """Plain PyTorch: the mean over clients of the test accuracy and cross-entropy of ``models[c]``."""
    accuracy, loss = [], []
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(models[client], strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            out = net(x)
        accuracy.append((out.argmax(1) == y).double().mean().item())
        loss.append(F.cross_entropy(out, y).item())
    return sum(accuracy) / NUM_CLIENTS, sum(loss) / NUM_CLIENTS


def assert_scored(metrics, expected):
    accuracy, loss = expected
    assert abs(metrics["test/acc"] - accuracy) < 1e-6
    assert abs(metrics["test/loss"] - loss) < 1e-4 * max(1.0, abs(loss))


def assert_same(got, want, what):
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=(what, name))


def expected_models(score, w, v):
    if score in ("personal", "global"):  # Ditto keeps no local part: its personal model is the global one
        return {c: w for c in range(NUM_CLIENTS)}
    if score == "slot":
        return v
    return {c: mixture(w, v[c], c) for c in range(NUM_CLIENTS)}


SPECS = {
    "personal": EvaluationSpec("personal"),
    "global": EvaluationSpec("global"),
    "slot": EvaluationSpec("slot", slot="personal"),
    "mixture": EvaluationSpec("mixture", slot="personal", mix=mixture),
}


@pytest.mark.parametrize(
    "score, net",
    [
        ("personal", LossNet),
        ("global", LossNet),
        ("slot", HeadlineNet),
        ("mixture", LossNet),
        ("mixture", HeadlineNet),
    ],
)
def test_each_score_is_what_evaluation_client_model_predict_and_export_give(score, net, tmp_path):
    """Golden test per score kind: the logged test accuracy/loss, ``client_model(c)``, the personalized
    predictions and ``personalized_state_dict`` are the models a plain loop expects (``HeadlineNet``: through
    the batched evaluation). Fails if a kind scores another model (e.g. ``"global"`` returning the slot in
    ``scored_tensors``, ``"mixture"`` with ``α`` and ``1−α`` swapped), if prediction loads the local part only
    (``load_personalized`` without the scored tensors), if the batched evaluation reads
    ``store.personal`` instead of ``evaluation_tensors``, or if the checkpoint's ``state_dict`` (client ``-1``
    in ``personalized_state``) holds a slot's initial values instead of the global model."""
    strategy, init, dm, trainer, model = fit(SPECS[score], net)
    w, v = plain_ditto(init, dm)
    models = expected_models(score, w, v)
    for client in range(NUM_CLIENTS):
        assert_same(
            dict(strategy.client_model(client).named_parameters()), models[client], ("client_model", client)
        )
    trainer.save_checkpoint(tmp_path / "ditto.ckpt")
    saved = torch.load(tmp_path / "ditto.ckpt", weights_only=True)["state_dict"]
    assert_same(saved, w, "the checkpoint's state_dict is the global model")
    assert_same(personalized_state_dict(tmp_path / "ditto.ckpt", -1), w, "a new client's model")
    for client in range(NUM_CLIENTS):
        exported = personalized_state_dict(tmp_path / "ditto.ckpt", client, algorithm=strategy.algorithm)
        assert_same(exported, models[client], ("export", client))
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert (strategy._evaluation.batched is not None) == (net is HeadlineNet)
    assert_scored(metrics, scores(init, dm, models))
    strategy.predict = "personalized"
    outputs = trainer.predict(model, datamodule=dm)
    by_client: dict[int, list[torch.Tensor]] = {}
    for client, out in zip(strategy.prediction_clients, outputs):
        by_client.setdefault(client, []).append(out)
    for client, outs in by_client.items():
        net_c = copy.deepcopy(init)
        net_c.load_state_dict(models[client], strict=False)
        x, _ = _xy(dm, client, "test")
        with torch.no_grad():
            torch.testing.assert_close(
                torch.cat(outs), net_c(x), rtol=1e-4, atol=1e-5, msg=("predict", client)
            )


def plain_adapted(init, dm, start, lr, steps, names=None):
    """Plain full-batch SGD (no momentum, no weight decay) on each client's training data from ``start[c]``,
    ``steps`` steps, training ``names`` only (all parameters when ``None``)."""
    adapted = {}
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(start[client], strict=False)
        trained = [p for n, p in net.named_parameters() if names is None or n in names]
        optimizer = torch.optim.SGD(trained, lr=lr)
        x, y = _xy(dm, client)
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        adapted[client] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return adapted


def test_adapt_epochs_at_adapt_lr_from_the_global_model():
    """Per-FedAvg's shape: ``EvaluationSpec("global", adapt=Phase("all", epochs=2), adapt_lr=0.2)`` scores
    each client's global model after 2 epochs of plain SGD at 0.2 on its own training data (one batch an
    epoch here). Fails if ``adapt_lr`` is ignored (the module's 0.05), momentum/weight decay of the module's
    optimizer are used, the adaptation starts from the slot, or it changes the stored state."""
    spec = EvaluationSpec("global", adapt=Phase("all", epochs=2), adapt_lr=0.2)
    strategy, init, dm, trainer, model = fit(spec)
    w, v = plain_ditto(init, dm)
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    adapted = plain_adapted(init, dm, {c: w for c in range(NUM_CLIENTS)}, 0.2, 2)
    assert_scored(metrics, scores(init, dm, adapted))
    assert abs(metrics["test/acc"] - scores(init, dm, {c: w for c in range(NUM_CLIENTS)})[0]) > 1e-3
    assert_same(strategy.global_tensors(), w, "global after test")


def test_adapt_steps_of_the_head_from_the_scored_slot_at_the_module_lr():
    """HF-MAML's shape (a step budget, not epochs) on Ditto's scored slot, head only, at the module
    optimizer's learning rate (0.05): 3 steps, so 3 passes over the one-batch clients. Fails if the step budget
    is ignored (``steps`` read as one epoch), the adaptation starts from the global model instead of the scored
    slot, trains the body too, or the stored slot changes."""
    spec = EvaluationSpec("slot", slot="personal", adapt=Phase("head", steps=3))
    strategy, init, dm, trainer, model = fit(spec, head="classifier")
    w, v = plain_ditto(init, dm)
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    head = {n for n, _ in init.classifier.named_parameters(prefix="classifier")}
    adapted = plain_adapted(init, dm, v, init.hparams.lr, 3, names=head)
    assert_scored(metrics, scores(init, dm, adapted))
    for client in range(NUM_CLIENTS):
        stored = strategy.federation.store.client_state(client)
        assert_same({n[len("personal.") :]: t for n, t in stored.items()}, v[client], ("stored", client))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"score": "best"}, "score"),
        ({"score": "slot"}, "slot"),
        ({"score": "global", "slot": "personal"}, "slot"),
        ({"score": "mixture", "slot": "personal"}, "mix"),
        ({"score": "slot", "slot": "personal", "mix": mixture}, "mix"),
        ({"adapt_lr": 0.1}, "adapt_lr"),
        ({"adapt": Phase("all", steps=1), "adapt_lr": -1.0}, "adapt_lr"),
        ({"adapt": Phase("all", steps=1, slot="personal")}, "adapt"),
        ({"adapt": "all"}, "adapt"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(kwargs, field):
    """Fails if a spec that cannot be scored is accepted at construction, or its error does not name the field."""
    with pytest.raises((ValueError, TypeError), match=field):
        EvaluationSpec(**kwargs)


def test_the_default_evaluation_follows_evaluation_slot():
    """The base class's ``evaluation()``: the slot where ``evaluation_slot`` is set (Ditto), else personal.
    Fails if the default ignores ``evaluation_slot`` (Ditto would score its global model)."""
    assert Ditto().evaluation() == EvaluationSpec("slot", slot="personal")
    assert ScoredDitto(EvaluationSpec()).evaluation() == EvaluationSpec("personal")
    from lightning_fedrep.federation.api.registry import get_algorithm

    assert get_algorithm("fedrep").evaluation() == EvaluationSpec("personal")
