"""A checkpoint belongs to its federation: resuming or evaluating it with other clients, another
partition or other planning settings is refused (or explicitly allowed), and client ids outside the
federation raise."""

from __future__ import annotations

import pytest
import torch

from lightning_fedrep import FedRepStrategy, personalized_state_dict
from tests.fixtures import HEAD, TinyNet, quiet_trainer, tiny_datamodule


def strategy(**kwargs):
    return FedRepStrategy(
        **{"head": "classifier", "clients_per_round": 0.5, "head_epochs": 1, "seed": 0, **kwargs}
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fingerprint") / "two_rounds.ckpt"
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy(), max_epochs=2, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=8))
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize(
    "data,settings,change",
    [
        (dict(num_clients=4), {}, "num_clients 8 -> 4"),
        (dict(num_clients=8, classes_per_client=4), {}, "partition"),
        (dict(num_clients=8, batch_size=16), {}, "batch_size 8 -> 16"),
        (dict(num_clients=8), {"seed": 1}, "seed 0 -> 1"),
        (dict(num_clients=8), {"clients_per_round": 1.0}, "clients_per_round '0.5' -> '1.0'"),
        (dict(num_clients=8), {"head_epochs": 2}, "phases"),
    ],
    ids=["clients", "partition", "batch_size", "seed", "clients_per_round", "phases"],
)
def test_resuming_with_another_federation_is_refused_naming_what_differs(checkpoint, data, settings, change):
    trainer = quiet_trainer(strategy=strategy(**settings), max_epochs=3, limit_val_batches=0)
    with pytest.raises(ValueError, match="saved by another federation") as refused:
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(**data), ckpt_path=checkpoint)
    assert change in str(refused.value) and "allow_new_federation=True" in str(refused.value)


def test_testing_with_another_number_of_clients_is_refused(checkpoint):
    trainer = quiet_trainer(strategy=strategy())
    with pytest.raises(ValueError, match="num_clients 8 -> 4"):
        trainer.test(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=checkpoint)
    trainer = quiet_trainer(strategy=strategy())
    trainer.test(TinyNet(), datamodule=tiny_datamodule(num_clients=8), ckpt_path=checkpoint)  # its own: fine


def test_a_new_federation_when_allowed_starts_its_clients_from_the_global_state(checkpoint):
    torch.manual_seed(0)
    init = TinyNet()
    s = strategy(allow_new_federation=True, clients_per_round=1.0)
    with pytest.warns(UserWarning, match="allow_new_federation=True: a new federation"):
        quiet_trainer(strategy=s, max_epochs=3, limit_val_batches=0).fit(
            init, datamodule=tiny_datamodule(num_clients=4), ckpt_path=checkpoint
        )
    saved = torch.load(checkpoint, weights_only=True)["lightning_fedrep"]
    assert s.federation.num_clients == 4 and s.federation.round_index == 2
    assert set(s.federation.store.local) == {
        0,
        1,
        2,
        3,
    }  # trained in round 2 from the template, not old heads
    assert saved["clients"]["template"][0].shape == s.federation.store.template[0].shape


def test_client_ids_outside_the_federation_raise(checkpoint):
    trainer = quiet_trainer(strategy=strategy(), max_epochs=2, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=8))
    with pytest.raises(IndexError, match=r"client must be a client id in 0\.\.7 .*got 999"):
        trainer.strategy.client_state_dict(999)
    with pytest.raises(IndexError, match="got -2"):
        trainer.strategy.client_tensors(-2)
    assert set(trainer.strategy.client_state_dict(-1)) >= set(HEAD)  # a client that never trained
    with pytest.raises(IndexError, match=r"0\.\.7 .*got 8"):
        personalized_state_dict(checkpoint, 8)
    assert set(personalized_state_dict(checkpoint, 7)) >= set(HEAD)


class RunsCode:
    """Unpickling this runs code (writes a file): what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_by_every_loading_path(checkpoint, tmp_path):
    hostile = torch.load(checkpoint, weights_only=True)
    marker = tmp_path / "ran"
    hostile["lightning_fedrep"]["algorithm_state"] = {"payload": RunsCode(marker)}
    path = tmp_path / "hostile.ckpt"
    torch.save(hostile, path)
    loaders = {
        "fit": lambda: quiet_trainer(strategy=strategy(), max_epochs=3, limit_val_batches=0).fit(
            TinyNet(), datamodule=tiny_datamodule(num_clients=8), ckpt_path=path
        ),
        "test": lambda: quiet_trainer(strategy=strategy()).test(
            TinyNet(), datamodule=tiny_datamodule(num_clients=8), ckpt_path=path
        ),
        "export": lambda: personalized_state_dict(path, 0),
    }
    for name, load in loaders.items():
        with pytest.raises(Exception, match="Weights only load failed|weights_only"):
            load()
        assert not marker.exists(), name
