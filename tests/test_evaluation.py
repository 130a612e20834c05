"""Personalized evaluation: each client's own model on its own split, summarised over clients."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.evaluation.metrics import summarize
from tests.fixtures import (
    HEAD,
    TinyNet,
    client_batches,
    quiet_trainer,
    reference_clients,
    tiny_datamodule,
)


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


def plain_fedrep_work(init, dm, client, head_steps, body_steps):
    """One client's FedRep work in round 0 written out: fresh SGD, head-only steps, then body-only steps."""
    model = copy.deepcopy(init)
    optimizer = model.configure_optimizers()
    batches = client_batches(dm, dm.seed, 0, client, head_steps + body_steps)
    for trains, steps in (("head", head_steps), ("body", body_steps)):
        for name, p in model.named_parameters():
            p.requires_grad_((name in HEAD) == (trains == "head"))
        for _ in range(steps):
            x, y = next(batches)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def test_max_steps_mid_round_averages_the_clients_that_trained():
    """``max_steps`` stops round 0 three steps into the second client's body phase: the global body is
    the sample-weighted mean of the first client's body (2 head + 1 body epochs) and the second's (2 head
    epochs + 3 body steps), as a plain loop computes them; the two others keep the initial head. Catches
    the client cut short averaged with its round-start body instead of the body it trained (the line
    ``self.federation.live.write_global()`` planted before
    ``self.close_round()`` in ``FederatedRun.end_training``; a stop in a head phase cannot see it)."""
    torch.manual_seed(0)
    model = TinyNet()
    init = copy.deepcopy(model)
    dm = tiny_datamodule(num_clients=8, seed=2)
    dm.setup()
    strategy = FedRepStrategy(head="classifier", clients_per_round=4, head_epochs=2, seed=1)
    first, second, *others = strategy_clients = reference_clients(dm.num_clients, 4, 1, 0)  # seed 1, round 0
    per_epoch = {c: math.ceil(dm.client_num_samples(c) / dm.batch_size) for c in strategy_clients}
    max_steps = 3 * per_epoch[first] + 2 * per_epoch[second] + 3
    trainer = quiet_trainer(strategy=strategy, max_steps=max_steps, limit_val_batches=0)
    with pytest.warns(UserWarning, match="stopped inside round 0"):
        trainer.fit(model, datamodule=dm)
    assert list(strategy.round_plan(0).clients) == strategy_clients
    assert trainer.global_step == max_steps < strategy.round_plan(0).length
    assert not strategy.federation.round_open
    states = {
        first: plain_fedrep_work(init, dm, first, 2 * per_epoch[first], per_epoch[first]),
        second: plain_fedrep_work(init, dm, second, 2 * per_epoch[second], 3),
    }
    sizes = {c: float(dm.client_num_samples(c)) for c in states}
    for name, value in strategy.global_tensors().items():
        expected = sum(states[c][name] * sizes[c] for c in states) / sum(sizes.values())
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
    for client in range(dm.num_clients):
        expected = states.get(client, init.state_dict())
        for name in HEAD:
            torch.testing.assert_close(
                strategy.client_state_dict(client)[name], expected[name], rtol=1e-5, atol=1e-6
            )
    assert set(strategy.federation.store.local) == {first, second}


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
