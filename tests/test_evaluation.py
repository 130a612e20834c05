"""Personalized evaluation: each client's own model on its own split, summarised over clients."""

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.evaluation import summarize
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule


def trained(rounds=3, **trainer_kw):
    torch.manual_seed(0)
    model = TinyNet()
    dm = tiny_datamodule(num_clients=8, seed=2)
    strategy = FedRepStrategy(head="classifier", clients_per_round=4, head_epochs=2, seed=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kw)
    trainer.fit(model, datamodule=dm)
    return model, dm, strategy, trainer


def test_summary_matches_each_clients_own_model():
    model, dm, strategy, trainer = trained()
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    accs, ces, sizes = [], [], []
    for cid in range(dm.num_clients):
        personal = strategy.client_model(cid).eval()
        data = dm.client_data(cid, "test")
        x, y = data.dataset.tensors[0][data.indices], data.dataset.tensors[1][data.indices]
        with torch.no_grad():
            out = personal(x)
        accs.append((out.argmax(1) == y).double().mean().item())
        ces.append(F.cross_entropy(out, y).item())
        sizes.append(len(y))
    accs, sizes = torch.tensor(accs), torch.tensor(sizes, dtype=torch.float64)
    assert metrics["test/acc"] == pytest.approx(accs.mean().item(), abs=1e-6)
    assert metrics["test/acc_weighted"] == pytest.approx(
        ((accs * sizes).sum() / sizes.sum()).item(), abs=1e-6
    )
    assert metrics["test/acc_std"] == pytest.approx(accs.std(correction=0).item(), abs=1e-6)
    assert metrics["test/acc_p10"] == pytest.approx(torch.quantile(accs, 0.1).item(), abs=1e-6)
    assert metrics["test/acc_min"] == pytest.approx(accs.min().item(), abs=1e-6)
    assert metrics["test/loss"] == pytest.approx(sum(ces) / len(ces), rel=1e-5)
    # what the user's test_step logs is reduced over clients the same way
    assert metrics["test_ce"] == pytest.approx(metrics["test/loss"], rel=1e-5)
    # heads are personal: the same body with another client's head scores differently
    assert len({round(a, 6) for a in accs.tolist()}) > 1


def test_summarize_closed_form():
    s = summarize(torch.tensor([0.0, 0.5, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0, 5.0]))
    assert s[""] == pytest.approx(0.625)
    assert s["_weighted"] == pytest.approx((0 + 0.5 + 1 + 5) / 8)
    assert s["_min"] == 0.0
    assert s["_p10"] == pytest.approx(0.15)  # linear interpolation between 0 and 0.5
    assert s["_std"] == pytest.approx(torch.tensor([0.0, 0.5, 1.0, 1.0]).std(correction=0).item())


def test_validation_logs_summary_each_round():
    _, _, _, trainer = trained(rounds=2)
    for key in ("val/acc", "val/acc_weighted", "val/acc_std", "val/acc_p10", "val/loss", "val_ce_min"):
        assert key in trainer.callback_metrics, key


def test_mid_round_validation_does_not_change_training():
    """val_check_interval < 1 validates mid-round with the global body; training is unaffected."""
    plain_model, _, plain, _ = trained(rounds=2, limit_val_batches=0)
    model, _, strategy, trainer = trained(rounds=2, val_check_interval=0.5)
    for a, b in zip(plain.federation.global_state, strategy.federation.global_state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for cid, tensors in plain.federation.store.local.items():
        for a, b in zip(tensors, strategy.federation.store.local[cid]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unsampled_clients_keep_their_heads():
    model, dm, strategy, _ = trained(rounds=1, limit_val_batches=0)
    sampled = set(strategy.round_plan(0).clients)
    assert set(strategy.federation.store.local) == sampled and len(sampled) == 4
    for cid in set(range(dm.num_clients)) - sampled:
        head = strategy.client_state_dict(cid)["classifier.weight"]
        torch.testing.assert_close(head, strategy.federation.store.template[0])


def test_max_steps_mid_round_averages_the_clients_that_trained():
    torch.manual_seed(0)
    model = TinyNet()
    dm = tiny_datamodule(num_clients=8, seed=2)
    strategy = FedRepStrategy(head="classifier", clients_per_round=4, head_epochs=2, seed=1)
    length = None
    trainer = quiet_trainer(strategy=strategy, max_steps=10, limit_val_batches=0)
    with pytest.warns(UserWarning, match="stopped inside round 0"):
        trainer.fit(model, datamodule=dm)
    length = strategy.round_plan(0).length
    assert trainer.global_step == 10 < length
    assert not strategy.federation.round_open
    first = strategy.round_plan(0).work[0]
    assert set(strategy.federation.store.local) == {first.client} or first.steps < 10


def test_val_split_is_used_when_present():
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=8, seed=2, val_fraction=0.25)
    dm.setup()
    train_sizes = [dm.client_num_samples(c) for c in range(8)]
    val_sizes = [len(dm.client_data(c, "val")) for c in range(8)]
    assert all(v > 0 for v in val_sizes) and sum(train_sizes) + sum(val_sizes) == 480
    strategy = FedRepStrategy(head="classifier", clients_per_round=4, head_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(copy.deepcopy(TinyNet()), datamodule=dm)
    assert sum(strategy.client_metrics["val"].samples.values()) == sum(val_sizes)
