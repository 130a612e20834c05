"""A module restored by ``load_from_checkpoint`` and evaluated by a new strategy is not scored silently with its
one head, a plain-loader prediction with the untrained head warns, and the per-client accessors say what
they return.

Lightning's ``MyModule.load_from_checkpoint(best)`` reads the checkpoint's ``state_dict`` (the global body
and the *initial* head) and leaves nothing on the module that names the file, so a new strategy cannot load
the clients' heads by itself: it warns, naming ``ckpt_path``. The references are plain forwards of the
restored module and of the checkpoint's tensors read straight from the file (``torch.load``), per client.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedrep import Algorithm, EvaluationSpec, FederatedStrategy, FedRepStrategy, Phase
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

NUM_CLIENTS = 4
MODULE_ALONE = r"the given module's own weights.*load_from_checkpoint\(path\).*Pass ckpt_path=path"


def fedrep(**kwargs):
    return FedRepStrategy(
        head="classifier", clients_per_round=1.0, head_epochs=1, body_epochs=1, seed=5, **kwargs
    )


def datamodule():
    return tiny_datamodule(num_clients=NUM_CLIENTS, seed=1)


@pytest.fixture(scope="module")
def best_checkpoint(tmp_path_factory):
    """A FedRep fit's best checkpoint (``ModelCheckpoint`` on ``val/acc``), the fitted strategy and Trainer."""
    torch.manual_seed(0)
    saver = ModelCheckpoint(dirpath=tmp_path_factory.mktemp("ck"), monitor="val/acc", mode="max")
    strategy = fedrep()
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(TinyNet(), datamodule=datamodule())
    return saver.best_model_path, strategy, trainer


def client_test_data(client):
    dm = datamodule()
    dm.setup("test")
    data = dm.client_data(client, "test")
    return data.dataset.tensors[0][data.indices], data.dataset.tensors[1][data.indices]


def mean_accuracy(state_of_client):
    """The mean over clients of a plain forward's test accuracy, client ``c`` on ``state_of_client(c)``."""
    net, accuracies = TinyNet(), []
    for client in range(NUM_CLIENTS):
        net.load_state_dict(state_of_client(client))
        x, y = client_test_data(client)
        with torch.no_grad():
            accuracies.append((net(x).argmax(1) == y).float().mean().item())
    return sum(accuracies) / NUM_CLIENTS


def checkpoint_client_state(path):
    """Client ``c``'s model read off the file: its ``state_dict`` with the client's stored local tensors."""
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["lightning_fedrep"]
    local = entry["clients"]["local"]

    def state(client):
        tensors = local.get(client, entry["clients"]["template"])
        return {**checkpoint["state_dict"], **dict(zip(entry["local_names"], tensors))}

    return state


def test_a_restored_module_tested_by_a_new_strategy_warns_naming_ckpt_path(best_checkpoint):
    """Catches the silent untrained head: remove the ``module_alone_note(...)`` warning from ``lightning/evaluating.py``'s ``setup`` and
    ``trainer.test(MyModule.load_from_checkpoint(best))`` scores every client with the initial head without
    a word. ``ckpt_path=best`` scores each client's own head (read from the file) and does not warn."""
    best, _, _ = best_checkpoint
    restored = TinyNet.load_from_checkpoint(best)
    with pytest.warns(UserWarning, match=MODULE_ALONE) as caught:
        alone = quiet_trainer(strategy=fedrep()).test(restored, datamodule=datamodule(), verbose=False)[0]
    message = next(str(w.message) for w in caught if "own weights" in str(w.message))
    assert "TinyNet.load_from_checkpoint(path)" in message and "'classifier.weight'" in message
    own_weights = {k: v.clone() for k, v in restored.state_dict().items()}
    assert alone["test/acc"] == pytest.approx(mean_accuracy(lambda c: own_weights), abs=1e-6)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = quiet_trainer(strategy=fedrep())
        federated = trainer.test(TinyNet(), datamodule=datamodule(), ckpt_path=best, verbose=False)[0]
    assert not [w for w in record if "own weights" in str(w.message)]
    assert federated["test/acc"] == pytest.approx(mean_accuracy(checkpoint_client_state(best)), abs=1e-6)
    assert federated["test/acc"] > alone["test/acc"] + 0.2  # what the warning is about


def test_every_evaluation_of_a_strategy_holding_only_a_module_warns_and_a_fitted_one_does_not(
    best_checkpoint,
):
    """Validate and predict warn too, and so does a second call on the same strategy (still no federation);
    the strategy that fitted, evaluating its own module, does not."""
    best, fitted, trainer = best_checkpoint
    strategy = fedrep()
    fresh = quiet_trainer(strategy=strategy)
    restored = TinyNet.load_from_checkpoint(best)
    for call in (fresh.validate, fresh.test):
        with pytest.warns(
            UserWarning, match=rf"trainer\.{call.__name__}\(\) scores every client with {MODULE_ALONE}"
        ):
            call(restored, datamodule=datamodule(), verbose=False)
    with pytest.warns(UserWarning, match=rf"trainer\.predict\(\) predicts with {MODULE_ALONE}"):
        quiet_trainer(strategy=fedrep()).predict(restored, datamodule=datamodule())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.test(trainer.lightning_module, datamodule=datamodule(), verbose=False)
    assert not [w for w in record if "own weights" in str(w.message)]


def test_an_algorithm_that_keeps_nothing_per_client_does_not_warn():
    """FedAvg's clients all score the global model: a new strategy scoring a module is what it always does."""
    strategy = FederatedStrategy(algorithm="fedavg", clients_per_round=1.0, seed=5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy).test(TinyNet(), datamodule=datamodule(), verbose=False)
    assert not [w for w in record if "own weights" in str(w.message)]


# ----------------------------------------------------------------------------- predict on a plain loader


def test_auto_prediction_of_plain_batches_warns_that_the_head_is_untrained(best_checkpoint):
    """Catches the info line alone: remove the ``untrained_new_client_note`` warning from
    ``Prediction.begin`` and FedRep's predictions on a plain ``DataLoader`` come from the untrained head with
    only a log line. The predictions are the new-client model's (a plain forward of the checkpoint's
    ``state_dict``: global body, initial head)."""
    best, fitted, trainer = best_checkpoint
    x = torch.randn(5, 6)
    with pytest.warns(UserWarning, match=r"untrained 'classifier.weight'.*predict='new_client'"):
        (out,) = trainer.predict(trainer.lightning_module, DataLoader(TensorDataset(x), batch_size=5))
    assert fitted.prediction_mode == "new_client"
    net = TinyNet()
    net.load_state_dict(torch.load(best, weights_only=True)["state_dict"])
    with torch.no_grad():
        torch.testing.assert_close(out, net(x))


def test_an_explicit_new_client_prediction_is_logged_not_warned(best_checkpoint, caplog):
    """``predict="new_client"`` is a choice: after a fit, and by a new strategy on the restored module (which
    holds the new-client model: global body, initial head), only the log line says which model ran."""
    best, fitted, trainer = best_checkpoint
    x = torch.randn(5, 6)
    net = TinyNet()
    net.load_state_dict(torch.load(best, weights_only=True)["state_dict"])
    runs = [
        (trainer, trainer.lightning_module, fitted),
        (None, TinyNet.load_from_checkpoint(best), fedrep(predict="new_client")),
    ]
    fitted.predict = "new_client"
    try:
        for runner, module, strategy in runs:
            runner = runner or quiet_trainer(strategy=strategy)
            with (
                caplog.at_level(logging.INFO, logger="lightning.pytorch"),
                warnings.catch_warnings(record=True) as record,
            ):
                warnings.simplefilter("always")
                (out,) = runner.predict(module, DataLoader(TensorDataset(x), batch_size=5))
            assert not [w for w in record if "untrained" in str(w.message) or "own weights" in str(w.message)]
            assert any("new-client predictions" in r.getMessage() for r in caplog.records)
            with torch.no_grad():
                torch.testing.assert_close(out, net(x))
            caplog.clear()
    finally:
        fitted.predict = "auto"


# ----------------------------------------------------------------------------- per-client accessors


def test_per_client_names_a_mistyped_metric_and_the_pass_metrics(best_checkpoint):
    """Catches ``{}`` for a mistyped key: without the check, ``per_client("test/accuracy")`` returns an
    empty dict (and adds the name to ``names``)."""
    _, fitted, trainer = best_checkpoint
    trainer.test(trainer.lightning_module, datamodule=datamodule(), verbose=False)
    metrics = fitted.client_metrics["test"]
    with pytest.raises(KeyError, match=r"'test/accuracy' is not a metric.*'test/acc'"):
        metrics.per_client("test/accuracy")
    assert "test/accuracy" not in metrics.names
    values = metrics.per_client("test/acc")
    assert list(values) == list(range(NUM_CLIENTS))
    assert all(isinstance(c, int) and isinstance(v, float) for c, v in values.items())
    assert sum(values.values()) / NUM_CLIENTS == pytest.approx(trainer.callback_metrics["test/acc"].item())


class LossNet(TinyNet):
    """Declares its loss (an adapting evaluation trains with it)."""

    fedrep_loss = "cross_entropy"


class AdaptingFedPer(Algorithm):
    """FedPer whose evaluation first adapts each client's model for one step."""

    def __init__(self):
        super().__init__("adapting_fedper", {"body"}, "FedPer adapting before scoring.")

    def evaluation(self) -> EvaluationSpec:
        return EvaluationSpec(adapt=Phase("all", steps=1))


def shifted(module, client_state, server, x):
    return type(module).forward(module, x) + 1.0


class ForwardFedPer(AdaptingFedPer):
    """FedPer predicting with its own forward."""

    def evaluation(self) -> EvaluationSpec:
        return EvaluationSpec(forward=shifted)


@pytest.mark.parametrize(
    "algorithm, warning",
    [(AdaptingFedPer, "before the adaptation"), (ForwardFedPer, "module's tensors only")],
)
def test_client_state_dict_warns_once_per_strategy(algorithm, warning):
    """Catches a warning per call: without ``_warn_once``, four ``client_state_dict`` calls warn four times."""
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=algorithm(), head="classifier", clients_per_round=1.0, local_epochs=1, seed=5
    )
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
        LossNet(), datamodule=datamodule()
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        states = [strategy.client_state_dict(client) for client in range(NUM_CLIENTS)]
    assert len([w for w in record if warning in str(w.message)]) == 1
    for client, state in enumerate(states):
        torch.testing.assert_close(
            state["classifier.weight"], strategy.client_tensors(client)["classifier.weight"]
        )
