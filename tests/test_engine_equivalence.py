"""The vectorized engine computes what the sequential path computes: every algorithm, SGD with momentum
and weight decay and Adam, kept and reset optimizer state, equal and unequal client sizes, chunked
groups, LR schedulers, a bit-exact mid-round resume, fine-tuning rounds. The fallbacks and refusals,
more optimizers and head shapes are in ``tests/test_engine.py``."""

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy
from lightning_fedrep.engine import sizing
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule


class LossNet(TinyNet):
    """TinyNet declaring its loss; the engine finds its head (``classifier``, called last) by itself."""

    fedrep_loss = "cross_entropy"

    def __init__(self, optimizer: str = "sgd", scheduler: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.scheduler = scheduler

    def configure_optimizers(self):
        hp = self.hparams
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=hp.weight_decay)
        else:
            optimizer = super().configure_optimizers()
        if not self.scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class DeclaredNet(LossNet):
    """Declares its feature split (``forward_features`` / ``forward_head``)."""

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(features)


def unequal_datamodule(seed=3):
    """Six clients of 7 to 41 samples: different step counts in every phase."""
    g = torch.Generator().manual_seed(seed)
    sizes = [7, 41, 13, 22, 30, 9]
    clients = []
    for n in sizes:
        x = torch.randn(n, 6, generator=g)
        clients.append(TensorDataset(x, ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())))
    return FederatedDataModule.from_client_datasets(clients, clients, batch_size=8, seed=seed)


def fit(engine, algorithm="fedrep", data="equal", model_cls=LossNet, rounds=3, per_round=4, **kwargs):
    model_kwargs = {k: kwargs.pop(k) for k in ("optimizer", "scheduler") if k in kwargs}
    torch.manual_seed(0)
    model = model_cls(**model_kwargs)
    dm = tiny_datamodule(num_clients=8, seed=3) if data == "equal" else unequal_datamodule()
    trainer_kwargs = kwargs.pop("trainer", {})
    strategy = FederatedStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=per_round,
        head_epochs=2,
        body_epochs=1,
        local_epochs=2,
        seed=5,
        engine=engine,
        **kwargs,
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, **{"limit_val_batches": 0, **trainer_kwargs}
    )
    trainer.fit(model, datamodule=dm)
    return strategy, trainer


def assert_same(a, b, atol=1e-5):
    for name, value in a.global_tensors().items():
        torch.testing.assert_close(b.global_tensors()[name], value, atol=atol, rtol=1e-4, msg=name)
    assert a.num_clients == b.num_clients
    for client in range(a.num_clients):
        for name, value in a.client_tensors(client).items():
            torch.testing.assert_close(
                b.client_tensors(client)[name], value, atol=atol, rtol=1e-4, msg=f"{client} {name}"
            )


CASES = [
    ("fedrep", "sgd", "reset", "equal"),
    ("fedrep", "sgd", "keep", "unequal"),
    ("fedrep", "adam", "keep", "unequal"),
    ("fedrep", "adam", "reset", "equal"),
    ("fedper", "sgd", "reset", "unequal"),
    ("fedper", "adam", "keep", "equal"),
    ("lg_fedavg", "sgd", "keep", "unequal"),
    ("fedavg", "sgd", "reset", "unequal"),
    ("fedavg", "adam", "reset", "equal"),
    ("local", "adam", "keep", "unequal"),
]


@pytest.mark.parametrize("algorithm,optimizer,state,data", CASES, ids=["-".join(c) for c in CASES])
def test_engine_equals_sequential(algorithm, optimizer, state, data):
    kwargs = dict(algorithm=algorithm, data=data, optimizer=optimizer, client_optimizer_state=state)
    sequential, seq_trainer = fit("sequential", **kwargs)
    vectorized, vec_trainer = fit("vectorized", **kwargs)
    assert vectorized._engine is not None and sequential._engine is None
    assert vec_trainer.global_step < seq_trainer.global_step  # one Lightning step = one lockstep
    assert_same(sequential, vectorized)
    if state == "keep":
        kept_seq = sequential.federation.store.optimizer_states
        kept_vec = vectorized.federation.store.optimizer_states
        assert kept_seq.keys() == kept_vec.keys() and kept_seq
        for client, per_optimizer in kept_seq.items():
            for index, entries in per_optimizer[0].items():
                for key, value in entries.items():
                    torch.testing.assert_close(kept_vec[client][0][index][key], value, atol=1e-5, rtol=1e-4)


def test_declared_feature_split_chunked_groups_and_epoch_scheduler_equal_sequential():
    kwargs = dict(model_cls=DeclaredNet, data="unequal", scheduler=True, per_round=5)
    sequential, _ = fit("sequential", **kwargs)
    chunked, _ = fit("vectorized", engine_width=2, **kwargs)
    assert chunked._engine.split.how == "forward_features/forward_head"
    assert chunked._engine.group_width == 2
    assert_same(sequential, chunked)


def test_body_lanes_one_client_at_a_time_equal_sequential(monkeypatch):
    monkeypatch.setattr(sizing, "faster_lane_width", lambda *a, **k: (False, 2.0, 1.0))
    sequential, _ = fit("sequential", data="unequal", client_optimizer_state="keep")
    lanes, _ = fit("auto", data="unequal", client_optimizer_state="keep")
    assert lanes._engine.lane_width == 1
    assert_same(sequential, lanes)


def test_mid_round_resume_on_the_engine_is_bit_exact(tmp_path):
    kwargs = dict(data="unequal", client_optimizer_state="keep", optimizer="adam")
    uninterrupted, _ = fit("vectorized", **kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    fit("vectorized", trainer=dict(enable_checkpointing=True, callbacks=[checkpoint], max_steps=12), **kwargs)
    saved = tmp_path / "epoch=0-step=10.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    state = torch.load(saved, weights_only=True)["lightning_fedrep"]
    assert state["round"]["open"] and state["round"]["engine"] is not None  # inside a group

    torch.manual_seed(0)
    resumed = FederatedStrategy(
        head="classifier",
        clients_per_round=4,
        head_epochs=2,
        body_epochs=1,
        seed=5,
        engine="vectorized",
        client_optimizer_state="keep",
    )
    trainer = quiet_trainer(strategy=resumed, max_epochs=3, limit_val_batches=0)
    trainer.fit(LossNet(optimizer="adam"), datamodule=unequal_datamodule(), ckpt_path=saved)
    for name, value in uninterrupted.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(uninterrupted.num_clients):
        for name, value in uninterrupted.client_tensors(client).items():
            assert torch.equal(resumed.client_tensors(client)[name], value), (client, name)

    sequential = FederatedStrategy(head="classifier", clients_per_round=4, seed=5, engine="sequential")
    with pytest.raises(ValueError, match="saved inside round 0 by the vectorized engine"):
        quiet_trainer(strategy=sequential, max_epochs=3, limit_val_batches=0).fit(
            LossNet(optimizer="adam"), datamodule=unequal_datamodule(), ckpt_path=saved
        )


def test_max_steps_inside_a_round_closes_it_with_the_clients_that_trained():
    stopped, trainer = fit("vectorized", rounds=2, trainer=dict(max_steps=3))
    assert trainer.global_step == 3  # three lockstep steps of round 0's head phase
    assert not stopped.federation.round_open
    torch.manual_seed(0)
    initial = {n: p.detach() for n, p in LossNet().named_parameters()}
    for name, value in stopped.global_tensors().items():  # only heads trained: the body is unchanged
        torch.testing.assert_close(value, initial[name])
    trained = sorted(stopped.federation.store.local)
    assert trained == list(stopped.round_plan(0).clients)
    for client in trained:
        assert not torch.equal(
            stopped.client_tensors(client)["classifier.weight"], initial["classifier.weight"]
        )


def test_validation_and_early_stopping_run_each_round():
    stopping = EarlyStopping(monitor="val/acc", mode="max", patience=100)
    strategy, trainer = fit(
        "vectorized", rounds=3, trainer=dict(callbacks=[stopping], limit_val_batches=None)
    )
    assert [row["round"] for row in strategy.history] == [0, 1, 2]
    assert "val/acc" in trainer.callback_metrics


@pytest.mark.parametrize("mode", ["head", "full"])
def test_fine_tuning_rounds_on_the_engine_equal_sequential(mode):
    from lightning_fedrep.callbacks import HeadFineTuning

    def run(engine):
        return fit(
            engine, data="unequal", rounds=2, trainer=dict(callbacks=[HeadFineTuning(epochs=1, mode=mode)])
        )[0]

    sequential, vectorized = run("sequential"), run("vectorized")
    assert_same(sequential, vectorized)
    assert vectorized.federation.store.finetuned.keys() == sequential.federation.store.finetuned.keys()
    for client, tensors in sequential.federation.store.finetuned.items():
        for name, value in tensors.items():
            torch.testing.assert_close(
                vectorized.federation.store.finetuned[client][name], value, atol=1e-5, rtol=1e-4
            )
