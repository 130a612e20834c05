"""A checkpoint belongs to its federation: resuming or evaluating it with other clients, another
partition or other planning settings is refused (or explicitly allowed), and client ids outside the
federation raise."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy, personalized_state_dict
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, reference_clients, tiny_datamodule


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
        (dict(num_clients=8), {"first_state": "average"}, "first_state 'initial' -> 'average'"),
    ],
    ids=["clients", "partition", "batch_size", "seed", "clients_per_round", "phases", "first_state"],
)
def test_resuming_with_another_federation_is_refused_naming_what_differs(checkpoint, data, settings, change):
    trainer = quiet_trainer(strategy=strategy(**settings), max_epochs=3, limit_val_batches=0)
    with pytest.raises(ValueError, match="saved by another federation") as refused:
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(**data), ckpt_path=checkpoint)
    assert change in str(refused.value) and "allow_new_federation=True" in str(refused.value)


def test_a_checkpoint_saved_before_first_state_was_fingerprinted_still_resumes(checkpoint, tmp_path):
    """Only what the saved fingerprint records is compared: a checkpoint without ``first_state`` (written
    before it was part of the fingerprint) resumes with either setting. Catches a comparison of every key of
    the current fingerprint (``saved.get(key) != value`` in ``fingerprint_changes``), which would refuse every
    older checkpoint."""
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["lightning_fedrep"]["federation"]["first_state"] == "initial"
    del saved["lightning_fedrep"]["federation"]["first_state"]
    older = tmp_path / "older.ckpt"
    torch.save(saved, older)
    s = strategy(first_state="average")
    trainer = quiet_trainer(strategy=s, max_epochs=3, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=8), ckpt_path=older)
    assert trainer.current_epoch == 3 and s.federation.round_index == 2


def test_testing_with_another_number_of_clients_is_refused(checkpoint):
    trainer = quiet_trainer(strategy=strategy())
    with pytest.raises(ValueError, match="num_clients 8 -> 4"):
        trainer.test(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=checkpoint)
    trainer = quiet_trainer(strategy=strategy())
    trainer.test(TinyNet(), datamodule=tiny_datamodule(num_clients=8), ckpt_path=checkpoint)  # its own: fine


def plain_fedrep_client(state, dm, client, round_index):
    """One FedRep client's round written out: fresh SGD from ``state``, 1 head-only then 1 body-only epoch."""
    model = TinyNet()
    model.load_state_dict(state)
    optimizer = model.configure_optimizers()
    per_epoch = math.ceil(dm.client_num_samples(client) / dm.batch_size)
    batches = client_batches(dm, dm.seed, round_index, client, 2 * per_epoch)
    for trains in ("head", "body"):
        for name, p in model.named_parameters():
            p.requires_grad_((name in HEAD) == (trains == "head"))
        for _ in range(per_epoch):
            x, y = next(batches)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def test_a_new_federation_when_allowed_starts_its_clients_from_the_global_state(checkpoint):
    """A 4-client federation resumed from the 8-client checkpoint, 2 clients a round: in round 2 the two
    sampled clients train from the checkpoint's global body and the *initial* head (a plain loop gives
    their heads and the averaged body), and the two others hold exactly the initial head, not the old
    federation's heads of the same ids. Catches the old federation's heads handed to the new clients
    (``self.store.local.clear()`` removed from ``Federation.adopt_new_federation``)."""
    saved_model = torch.load(checkpoint, weights_only=True)["state_dict"]
    torch.manual_seed(0)
    initial_head = {k: v for k, v in TinyNet().state_dict().items() if k in HEAD}  # the checkpoint's init
    torch.manual_seed(1)
    s = strategy(allow_new_federation=True)
    with pytest.warns(UserWarning, match="allow_new_federation=True: a new federation"):
        quiet_trainer(strategy=s, max_epochs=3, limit_val_batches=0).fit(
            TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=checkpoint
        )
    assert s.federation.num_clients == 4 and s.federation.round_index == 2
    dm = tiny_datamodule(num_clients=4)
    dm.setup()
    trained = reference_clients(4, 2, 0, 2)
    assert list(s.round_plan(2).clients) == trained
    start = {**{k: v for k, v in saved_model.items() if k not in HEAD}, **initial_head}
    states = {c: plain_fedrep_client(start, dm, c, round_index=2) for c in trained}
    sizes = {c: float(dm.client_num_samples(c)) for c in trained}
    for name, value in s.global_tensors().items():
        expected = sum(states[c][name] * sizes[c] for c in trained) / sum(sizes.values())
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
    for client in range(4):
        expected = states[client] if client in trained else initial_head
        for name in HEAD:
            torch.testing.assert_close(
                s.client_state_dict(client)[name],
                expected[name],
                rtol=1e-5,
                atol=1e-6,
                msg=f"{client} {name}",
            )
    assert set(s.federation.store.local) == set(trained)


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
