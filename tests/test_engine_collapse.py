"""The neural-collapse (FLUTE) penalties on the vectorized engine equal the sequential path's; loss
terms without a vectorized form keep runs sequential."""

import logging

import pytest
import torch

from lightning_fedrep import FederatedCallback, FederatedStrategy, Phase
from lightning_fedrep.callbacks import NeuralCollapse
from tests.fixtures import quiet_trainer
from tests.test_engine_equivalence import DeclaredNet, LossNet, assert_same, unequal_datamodule

FLUTE_STAR = [Phase("head", epochs=1), Phase("all", epochs=1), Phase("head", epochs=1)]


def fit(engine, phases=None, callback=None, model_cls=DeclaredNet, rounds=3):
    torch.manual_seed(0)
    callback = callback or NeuralCollapse(lam=0.3, mu=0.01, nu=0.002, server_step=True, log_metrics=False)
    strategy = FederatedStrategy(
        head="classifier",
        clients_per_round=4,
        head_epochs=2,
        body_epochs=1,
        phases=phases,
        seed=5,
        engine=engine,
        client_optimizer_state="keep",
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=[callback])
    trainer.fit(model_cls(), datamodule=unequal_datamodule())
    return strategy


@pytest.mark.parametrize("phases", [None, FLUTE_STAR], ids=["fedrep", "flute-star"])
def test_penalties_on_the_engine_equal_the_sequential_path(phases):
    sequential = fit("sequential", phases)
    vectorized = fit("vectorized", phases)
    assert vectorized._engine is not None and vectorized._engine.loss_terms
    assert_same(sequential, vectorized)


def test_the_feature_penalty_ignores_padding_rows():
    # unequal clients have padded rows in every lockstep step: only nu touches the features
    only_nu = NeuralCollapse(lam=0.0, mu=0.0, nu=0.05, log_metrics=False)
    sequential = fit("sequential", callback=only_nu)
    vectorized = fit("vectorized", callback=NeuralCollapse(lam=0.0, mu=0.0, nu=0.05, log_metrics=False))
    assert_same(sequential, vectorized)
    no_penalty = fit("vectorized", callback=NeuralCollapse(lam=0.0, mu=0.0, nu=0.0, log_metrics=False))
    body = "body.0.weight"
    assert not torch.allclose(no_penalty.global_tensors()[body], vectorized.global_tensors()[body], atol=1e-6)


class Sharpness(FederatedCallback):
    """A loss term with no vectorized form."""

    def loss_term(self, trainer, pl_module, batch, step):
        return 0.01 * pl_module.classifier.weight.square().sum()


def test_a_loss_term_without_a_vectorized_form_keeps_the_run_sequential(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto", callback=Sharpness(), rounds=1)
    assert strategy._engine is None
    assert "Sharpness adds a loss term without a vectorized form" in caplog.text
    with pytest.raises(ValueError, match="Sharpness adds a loss term without a vectorized form"):
        fit("vectorized", callback=Sharpness(), rounds=1)


def test_feature_penalty_on_another_module_keeps_the_run_sequential():
    callback = NeuralCollapse(nu=0.01, features_module="body", log_metrics=False)
    assert not callback.has_vectorized_loss_term()
    assert fit("auto", callback=callback, rounds=1)._engine is None


class ScaledOutput(LossNet):
    """Its output is not its head's output (no feature split can be found)."""

    def forward(self, x):
        return 2.0 * self.classifier(self.body(x))


def test_penalties_need_the_heads_input(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto", model_cls=ScaledOutput, rounds=1)
    assert strategy._engine is None
    assert "vectorized loss terms need the head's input" in caplog.text
    with pytest.raises(ValueError, match="vectorized loss terms need the head's input"):
        fit("vectorized", model_cls=ScaledOutput, rounds=1)
