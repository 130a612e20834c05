"""Bad input is refused early, with a message that says what to do; settings that would break rounds too."""

import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_fedrep  # noqa: F401  (registers the strategy names)
from lightning_fedrep import FedRepStrategy, SplitError, resolve_split
from tests.fixtures import MarkedTinyNet, TinyNet, quiet_trainer, tiny_datamodule, tiny_datasets


class Counting(TinyNet):
    steps = 0

    def training_step(self, batch, batch_idx):
        Counting.steps += 1
        return super().training_step(batch, batch_idx)


def fit(model=None, strategy=None, **trainer_kw):
    strategy = strategy or FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **trainer_kw)
    trainer.fit(model or TinyNet(), datamodule=tiny_datamodule())
    return trainer


def test_no_head_marked_names_the_last_linear():
    with pytest.raises(SplitError, match=r"No head is marked.*head='classifier'.*body\.0\.weight"):
        resolve_split(TinyNet())


def test_head_typo_suggests_closest_name():
    with pytest.raises(SplitError, match=r"'clasifier' matches no parameter\. Did you mean 'classifier'\?"):
        resolve_split(TinyNet(), "clasifier")


def test_regex_that_matches_nothing():
    with pytest.raises(SplitError, match=r"regex 'fc9' matches no parameter.*classifier\.weight"):
        resolve_split(TinyNet(), re.compile("fc9"))


def test_regex_and_lists_select_the_same_head():
    by_regex = resolve_split(TinyNet(), re.compile(r"^classifier\."))
    by_list = resolve_split(TinyNet(), ["classifier"])
    assert by_regex == by_list
    assert by_list.head == ("classifier.weight", "classifier.bias")
    assert "body.0.weight" in by_list.body


def test_head_covering_everything_leaves_no_body():
    with pytest.raises(SplitError, match="no body to share"):
        resolve_split(TinyNet(), ["body", "classifier"])


def test_frozen_parameters_are_refused_unless_allowed():
    model = TinyNet()
    model.body[0].weight.requires_grad_(False)
    with pytest.raises(SplitError, match=r"\['body\.0\.weight'\].*allow_frozen=True"):
        resolve_split(model, "classifier")
    split = resolve_split(model, "classifier", allow_frozen=True)
    assert split.frozen == ("body.0.weight",) and "body.0.weight" not in split.body
    before = model.body[0].weight.detach().clone()
    fit(model, FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, allow_frozen=True))
    assert torch.equal(model.body[0].weight, before)
    assert not model.body[0].weight.requires_grad


def test_frozen_head_is_refused():
    model = TinyNet()
    model.classifier.bias.requires_grad_(False)
    with pytest.raises(SplitError, match="could never train"):
        resolve_split(model, "classifier", allow_frozen=True)


def test_split_error_is_raised_at_connect_before_training():
    Counting.steps = 0
    with pytest.raises(SplitError):
        fit(Counting(), FedRepStrategy(head="nothing"))
    assert Counting.steps == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"accumulate_grad_batches": 2}, "accumulate gradients across different clients"),
        ({"limit_train_batches": 0.5}, "cut every round short"),
        ({"limit_train_batches": 3}, "cut every round short"),
        ({"overfit_batches": 2}, "overfit_batches is not supported"),
    ],
)
def test_settings_that_would_break_rounds_are_refused_before_training(flags, message):
    Counting.steps = 0
    with pytest.raises(ValueError, match=message):
        fit(Counting(), **flags)
    assert Counting.steps == 0


def test_plain_dataloader_is_refused_with_advice():
    train, _ = tiny_datasets()
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=1)
    with pytest.raises(TypeError, match="FederatedDataModule"):
        trainer.fit(TinyNet(), train_dataloaders=DataLoader(train, batch_size=8))


def test_parameters_missing_from_the_optimizer():
    class HeadOnlyOptimizer(TinyNet):
        def configure_optimizers(self):
            return torch.optim.SGD(self.classifier.parameters(), lr=0.1)

    with pytest.raises(ValueError, match=r"in no optimizer.*self\.parameters\(\)"):
        fit(HeadOnlyOptimizer())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"algorithm": "fedrepp"}, r"Unknown algorithm 'fedrepp'; choose one of"),
        ({"weighting": "size"}, "weighting must be"),
        ({"client_optimizer_state": "persist"}, "client_optimizer_state must be"),
        ({"buffers": "mine"}, "buffers must be"),
        ({"phases": [{"train": "neck", "epochs": 1}]}, "Phase.train must be"),
        ({"phases": [{"train": "head", "epochs": 1, "steps": 2}]}, "exactly one of epochs= or steps="),
    ],
)
def test_bad_strategy_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FedRepStrategy(head="classifier", **kwargs)


def test_more_clients_per_round_than_clients():
    with pytest.raises(ValueError, match="more than the 8 clients"):
        fit(strategy=FedRepStrategy(head="classifier", clients_per_round=9))


def test_registered_names_work_with_a_self_marking_module():
    for name in ("fedrep", "fedper", "lg_fedavg", "fedavg", "local"):
        trainer = quiet_trainer(strategy=name, max_epochs=1, limit_val_batches=0)
        assert isinstance(trainer.strategy, FedRepStrategy)
        assert trainer.strategy.algorithm.name == name
    trainer = quiet_trainer(strategy="fedrep", max_epochs=2)
    trainer.fit(MarkedTinyNet(), datamodule=tiny_datamodule())
    assert trainer.strategy.split.head == ("classifier.weight", "classifier.bias")
    assert "val/acc" in trainer.callback_metrics


def test_fast_dev_run_truncates_and_still_closes_the_round():
    trainer = L.Trainer(
        strategy=FedRepStrategy(head="classifier", clients_per_round=2),
        fast_dev_run=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    model = TinyNet()
    trainer.fit(model, datamodule=tiny_datamodule())
    assert trainer.global_step == 1
    assert not trainer.strategy.federation.round_open
    assert len(trainer.strategy.federation.store.local) == 1
