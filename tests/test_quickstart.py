"""The README's quickstart (``make demo``) on the bundled digits data, shortened to a few rounds."""

import json

import torch

from lightning_fedrep import quickstart
from lightning_fedrep.data.digits import DigitsDataModule, load_digits_tensors


def test_digits_are_the_real_offline_data():
    train, test = load_digits_tensors(test_fraction=0.2, seed=0)
    assert len(train) + len(test) == 1797
    assert train.tensors[0].shape[1] == 64 and set(train.tensors[1].tolist()) == set(range(10))
    assert train.tensors[0].mean(0).abs().max() < 1e-4  # standardised with training statistics
    dm = DigitsDataModule(num_clients=20, classes_per_client=2)
    dm.setup()
    for cid in range(20):
        train_classes = torch.unique(dm.client_data(cid).dataset.tensors[1][dm.client_data(cid).indices])
        test_classes = torch.unique(
            dm.client_data(cid, "test").dataset.tensors[1][dm.client_data(cid, "test").indices]
        )
        assert len(train_classes) == 2 and torch.equal(train_classes, test_classes)


def test_quickstart_runs_and_writes_a_summary(tmp_path, capsys):
    quickstart.main(["--rounds", "3", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"fedrep", "fedavg"}
    for result in summary.values():
        assert len(result["per_client_acc"]) == 20
        assert 0.0 <= result["test"]["test/acc"] <= 1.0
    assert "FedRep - FedAvg mean client accuracy" in capsys.readouterr().out
