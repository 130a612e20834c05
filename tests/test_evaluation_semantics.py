"""What ``validate``/``test`` evaluate is what the user named, and the run summary describes that call.

A fitted strategy holds a federation (a body, a head per client): ``trainer.test(fitted_module)`` scores
it; ``trainer.test(any_module, ckpt_path=...)`` scores the checkpoint's federation; another module object
without ``ckpt_path`` is refused (its weights would be replaced without a word); a fresh strategy scores
the given module's own weights for every client. ``RunSummary`` writes each call's own per-client values.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedrep import FedRepStrategy, RunSummary
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule


def new_strategy():
    return FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=5)


def fitted(tmp_path):
    torch.manual_seed(0)
    model, strategy = TinyNet(), new_strategy()
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6, seed=1))
    return model, trainer


def scores(trainer, model, **kwargs):
    return trainer.test(model, datamodule=tiny_datamodule(num_clients=6, seed=1), verbose=False, **kwargs)[0]


def test_another_module_without_a_checkpoint_is_refused_after_fit(tmp_path):
    model, trainer = fitted(tmp_path)
    before = {k: v.clone() for k, v in trainer.strategy.global_tensors().items()}
    for call in (trainer.test, trainer.validate):
        with pytest.raises(ValueError, match=r"another module.*ckpt_path"):
            call(TinyNet(), datamodule=tiny_datamodule(num_clients=6, seed=1), verbose=False)
    for name, value in trainer.strategy.global_tensors().items():  # nothing was written or lost
        assert torch.equal(value, before[name])
    assert "test/acc" in scores(trainer, model)  # the fitted module still evaluates the federation


def test_a_checkpoint_named_with_another_module_is_what_is_scored(tmp_path):
    model, trainer = fitted(tmp_path)
    live = scores(trainer, model)
    last = scores(trainer, TinyNet(), ckpt_path=tmp_path / "ck" / "epoch=2.ckpt")
    first = scores(trainer, TinyNet(), ckpt_path=tmp_path / "ck" / "epoch=0.ckpt")
    assert last["test/acc"] == pytest.approx(live["test/acc"], abs=1e-6)
    fresh = quiet_trainer(strategy=new_strategy())  # the same checkpoint in a new Trainer
    assert scores(fresh, TinyNet(), ckpt_path=tmp_path / "ck" / "epoch=0.ckpt") == pytest.approx(first)
    assert first["test/loss"] != pytest.approx(last["test/loss"])


def test_a_fresh_strategy_scores_the_given_modules_own_weights_for_every_client():
    torch.manual_seed(3)
    model = TinyNet()
    datamodule = tiny_datamodule(num_clients=6, seed=1)
    values = scores(quiet_trainer(strategy=new_strategy()), model)
    datamodule.setup("test")
    accuracies = []
    with torch.no_grad():
        for client in range(6):
            x, y = zip(
                *[
                    datamodule.client_data(client, "test").dataset[i]
                    for i in datamodule.client_data(client, "test").indices
                ]
            )
            accuracies.append((model(torch.stack(x)).argmax(1) == torch.stack(y)).float().mean().item())
    assert values["test/acc"] == pytest.approx(sum(accuracies) / 6, abs=1e-6)


def test_the_summary_of_each_test_call_holds_that_calls_per_client_values(tmp_path):
    model, trainer = fitted(tmp_path)
    summary = RunSummary(dirpath=str(tmp_path / "out"), print_table=False)
    tester = quiet_trainer(strategy=new_strategy(), callbacks=[summary])
    for epoch in (0, 2):
        values = scores(tester, TinyNet(), ckpt_path=tmp_path / "ck" / f"epoch={epoch}.ckpt")
        written = json.loads((tmp_path / "out" / "summary.test.json").read_text())
        per_client = written["per_client"]["test"]["test/acc"]
        assert len(per_client) == 6
        assert sum(per_client.values()) / 6 == pytest.approx(values["test/acc"], abs=1e-6)
        assert written["test"]["test/acc"] == pytest.approx(values["test/acc"])
