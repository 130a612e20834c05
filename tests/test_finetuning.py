"""HeadFineTuning (FedAvg + FT, FedRep's final head round) and the new-client protocol."""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.app.new_clients import evaluate_new_clients
from lightning_fedrep.callbacks import HeadFineTuning
from lightning_fedrep.federation.api.epochs import epoch_settings
from tests.fixtures import HEAD, MarkedTinyNet, TinyNet, client_batches, quiet_trainer, tiny_datamodule

ROUNDS = 3


def fit(finetune=None, algorithm="fedavg"):
    torch.manual_seed(0)
    model = TinyNet()
    dm = tiny_datamodule(num_clients=6, seed=4)
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=3,
        seed=2,
        **epoch_settings(algorithm, head_epochs=1),
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, callbacks=[finetune] if finetune else [])
    trainer.fit(model, datamodule=dm)
    return model, dm, strategy, trainer


def plain_finetune(global_state, dm, client, epochs, head_only):
    """Fine-tune the global model on one client's data, written out in plain PyTorch."""
    model = TinyNet()
    model.load_state_dict(global_state)
    for name, p in model.named_parameters():
        p.requires_grad_(name in HEAD or not head_only)
    opt = model.configure_optimizers()
    steps = epochs * -(-dm.client_num_samples(client) // dm.batch_size)
    for x, y in client_batches(dm, dm.seed, ROUNDS, client, steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("mode", ["head", "full"])
def test_fedavg_finetuning_matches_plain_finetuning(mode):
    _, _, plain, _ = fit()
    global_state = plain.new_client_model().state_dict()
    model, dm, strategy, trainer = fit(HeadFineTuning(epochs=2, mode=mode))
    assert trainer.current_epoch == ROUNDS + 1
    # the federated rounds are unchanged and fine-tuning aggregates nothing
    for a, b in zip(plain.federation.global_state, strategy.federation.global_state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for cid in range(dm.num_clients):
        got = strategy.client_state_dict(cid)
        expected = plain_finetune(global_state, dm, cid, 2, head_only=mode == "head")
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
            if mode == "head" and name not in HEAD:
                assert torch.equal(got[name], global_state[name]), f"{name} changed in head-only mode"
        assert not torch.equal(got["classifier.weight"], global_state["classifier.weight"])
    assert "finetune/val/acc" in trainer.callback_metrics
    results = strategy.results()
    assert results["finetune"]["finetune/val/acc"] == pytest.approx(
        trainer.callback_metrics["finetune/val/acc"].item()
    )
    # the federated figures exclude the fine-tuning round
    assert max(h["round"] for h in strategy.history) == ROUNDS - 1


def test_finetuning_improves_fedavg_under_label_skew():
    model, dm, plain, trainer = fit()
    before = trainer.test(model, datamodule=dm, verbose=False)[0]["test/acc"]
    model, dm, strategy, trainer = fit(HeadFineTuning(epochs=5, mode="head"))
    after = trainer.test(model, datamodule=dm, verbose=False)[0]["test/acc"]
    assert after > before + 0.05, (before, after)


def test_fedrep_final_head_round_keeps_the_body():
    _, _, plain, _ = fit(algorithm="fedrep")
    _, dm, strategy, _ = fit(HeadFineTuning(epochs=1), algorithm="fedrep")
    for a, b in zip(plain.federation.global_state, strategy.federation.global_state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert set(strategy.federation.store.local) == set(
        range(dm.num_clients)
    )  # every client got the final round


def test_head_mode_needs_a_head():
    torch.manual_seed(0)
    trainer = quiet_trainer(
        strategy=FedRepStrategy(algorithm="fedavg", clients_per_round=2),
        max_epochs=1,
        callbacks=[HeadFineTuning()],
    )
    with pytest.raises(ValueError, match="needs to know the head"):
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())


class KeepStrategy(Callback):
    """Keeps the strategy of the fit it is passed to (``evaluate_new_clients`` returns only the summary)."""

    def on_fit_end(self, trainer, pl_module):
        self.strategy = trainer.strategy


def plain_new_client(start, dm, client, epochs):
    """A new client's head fitted over the frozen body, in plain PyTorch (the module's own SGD), and its
    test accuracy."""
    model = copy.deepcopy(start)
    for name, p in model.named_parameters():
        p.requires_grad_(name in HEAD)
    optimizer = model.configure_optimizers()
    steps = epochs * math.ceil(dm.client_num_samples(client) / dm.batch_size)
    for x, y in client_batches(dm, dm.seed, 0, client, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    test = dm.client_data(client, "test")
    x, y = test.dataset.tensors[0][test.indices], test.dataset.tensors[1][test.indices]
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    return model.state_dict(), accuracy


def test_new_clients_fit_a_head_over_the_frozen_body():
    """Each new client's fitted head, and the returned mean test accuracy, equal a plain-PyTorch head fit
    (the module's SGD, 5 epochs of the client's 8 samples or of all its samples) over the frozen body of
    the federation's new-client model. Catches ``samples`` ignored (``data = datamodule`` in
    ``evaluate_new_clients``) and the body trained too (``mode="full"`` there)."""
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=8, seed=4)
    dm.setup()
    federation, new = dm.holdout(2)
    assert federation.num_clients == 6 and new.num_clients == 2
    strategy = FedRepStrategy(clients_per_round=3, head_epochs=2, seed=1)
    quiet_trainer(strategy=strategy, max_epochs=3).fit(MarkedTinyNet(), datamodule=federation)
    start = strategy.new_client_model()
    before = copy.deepcopy(start.state_dict())
    sub = new.with_train_samples(8, seed=0)  # the subset evaluate_new_clients(seed=0) draws
    assert all(sub.client_num_samples(c) == min(8, new.client_num_samples(c)) for c in range(2))
    for samples, data in ((8, sub), (None, new)):
        kept = KeepStrategy()
        summary = evaluate_new_clients(start, new, epochs=5, samples=samples, seed=0, callbacks=[kept])
        accuracies = []
        for client in range(2):
            expected, accuracy = plain_new_client(start, data, client, epochs=5)
            got = kept.strategy.client_state_dict(client)
            for name, value in expected.items():
                torch.testing.assert_close(
                    got[name], value, rtol=1e-5, atol=1e-6, msg=f"{samples} {client} {name}"
                )
            accuracies.append(accuracy)
        assert summary["test/acc"] == pytest.approx(sum(accuracies) / 2, abs=1e-6), samples
    for name, value in start.state_dict().items():  # the model handed in is not modified
        assert torch.equal(value, before[name]), name
