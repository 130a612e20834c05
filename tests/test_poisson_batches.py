"""Poisson batches (``RoundLoader(sampling="poisson")``, what sample-level DP-SGD's accounting assumes): every
sample joins each step independently with probability ``q = min(1, batch_size / n)``; empty batches on both
fetcher paths; the vectorized runner pads each step to its largest batch and trains what the sequential runner
trains; a privacy mechanism with ``batch_sampling="poisson"`` switches the loader at bind time."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep import FederatedDataModule, FederatedStrategy
from lightning_fedrep.data.binding import DataBinding
from lightning_fedrep.data.loaders import ClientData, RoundLoader, _BatchFetcher
from lightning_fedrep.federation import WeightedMean
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from tests.fixtures import TinyNet, quiet_trainer, reference_generator, runner_setting


def poisson_loader(sizes, batch_size, seed=7, dim=3):
    g = torch.Generator().manual_seed(0)
    total = sum(sizes)
    data = TensorDataset(torch.randn(total, dim, generator=g), torch.arange(total))
    starts = torch.tensor([0, *sizes]).cumsum(0)
    clients = [ClientData(data, torch.arange(int(a), int(a) + n)) for a, n in zip(starts, sizes)]
    return RoundLoader(clients, batch_size, seed, sampling="poisson")


def indicators(loader, client, steps, round_index=0):
    n = loader.client_size(client)
    rows = torch.zeros(steps, n)
    for s, positions in enumerate(loader.client_positions(client, round_index, 0, steps)):
        assert torch.equal(positions, positions.sort().values)  # ascending
        rows[s, positions] = 1.0
    return rows


# ----------------------------------------------------------------------------- the sampling itself


def test_each_sample_joins_each_step_with_probability_q():
    n, batch_size, steps = 40, 10, 3000
    loader = poisson_loader([n], batch_size)
    q = batch_size / n
    assert loader.sample_rate(0) == q
    rows = indicators(loader, 0, steps)
    rate = rows.mean(0)
    sigma = (q * (1 - q) / steps) ** 0.5
    assert ((rate - q).abs() < 5 * sigma).all(), rate
    sizes = rows.sum(1)
    var = n * q * (1 - q)
    assert abs(sizes.mean().item() - n * q) < 5 * (var / steps) ** 0.5
    assert abs(sizes.var().item() / var - 1) < 0.15
    assert sizes.min() < batch_size < sizes.max()  # sizes vary around the batch size


def test_steps_are_independent():
    n, steps = 30, 3000
    rows = indicators(poisson_loader([n], 6), 0, steps)
    a, b = rows[:-1].flatten(), rows[1:].flatten()
    correlation = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(correlation) < 5 / a.numel() ** 0.5
    sizes = rows.sum(1)
    lagged = torch.corrcoef(torch.stack([sizes[:-1], sizes[1:]]))[0, 1]
    assert abs(lagged) < 5 / steps**0.5


def test_batch_size_at_least_the_client_takes_every_sample_every_step():
    loader = poisson_loader([5, 8], batch_size=8)
    assert loader.sample_rate(0) == loader.sample_rate(1) == 1.0
    for client, n in ((0, 5), (1, 8)):
        for positions in loader.client_positions(client, 3, 0, 6):
            assert torch.equal(positions, torch.arange(n))


def test_draws_follow_the_seeding_rule_and_resume_from_any_step():
    """Restated rule: step ``s`` of ``client`` in ``round`` includes position ``i`` iff the ``i``-th float64
    of ``torch.rand(n)`` from the generator of ``(seed, round, client, -1, s)`` is below ``q``."""
    sizes, batch_size, seed = [9, 23], 4, 11
    loader = poisson_loader(sizes, batch_size, seed=seed)
    for client, n in enumerate(sizes):
        q = batch_size / n
        full = loader.client_positions(client, 2, 0, 12)
        for step, positions in enumerate(full):
            drawn = torch.rand(
                n, generator=reference_generator(seed, 2, client, -1, step), dtype=torch.float64
            )
            assert torch.equal(positions, torch.nonzero(drawn < q).flatten())
        for first in (1, 5, 11):
            again = poisson_loader(sizes, batch_size, seed=seed).client_positions(
                client, 2, first, 12 - first
            )
            assert all(torch.equal(x, y) for x, y in zip(again, full[first:]))
    other_round = loader.client_positions(1, 3, 0, 12)
    assert any(not torch.equal(x, y) for x, y in zip(other_round, loader.client_positions(1, 2, 0, 12)))


def test_batches_index_the_clients_own_samples():
    loader = poisson_loader([6, 10], batch_size=3)
    for step, (x, y) in enumerate(loader.client_batches(1, 0, 0, 8)):
        positions = loader.client_positions(1, 0, step, 1)[0]
        assert torch.equal(y, 6 + positions)
        assert x.shape == (len(positions), 3)


def test_sampling_is_validated_and_shuffle_is_the_default():
    loader = poisson_loader([6], batch_size=3)
    with pytest.raises(ValueError, match="sampling must be one of 'shuffle', 'poisson', got 'bernoulli'"):
        loader.use_sampling("bernoulli")
    with pytest.raises(ValueError, match="sampling must be one of"):
        RoundLoader(loader.clients, 3, sampling="Poisson")
    shuffled = RoundLoader(loader.clients, 3)
    assert shuffled.sampling == "shuffle"
    assert [len(p) for p in shuffled.client_positions(0, 0, 0, 2)] == [3, 3]
    shuffled.use_sampling("poisson")
    assert shuffled.sampling == "poisson"


def test_probe_batch_is_a_full_shuffled_batch_under_poisson():
    loader = poisson_loader([12], batch_size=2)
    x, y = loader.probe_batch(0)
    shuffled = RoundLoader(loader.clients, 2, loader.seed)
    assert torch.equal(y, next(iter(shuffled.client_batches(0, 0, 0, 1)))[1])
    assert len(y) == 2


# ----------------------------------------------------------------------------- empty batches on both paths


class DictDataset(Dataset):
    """Samples as dicts (the DataLoader path of the fetcher)."""

    def __init__(self, n):
        self.x = torch.arange(n * 2, dtype=torch.float32).view(n, 2)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": i, "name": f"s{i}"}


def test_an_empty_index_batch_gives_a_zero_row_batch_on_the_tensor_path():
    data = TensorDataset(torch.randn(5, 3, 2), torch.arange(5))
    empty = torch.tensor([], dtype=torch.long)
    batches = list(_BatchFetcher().batches(data, [torch.tensor([1, 3]), empty]))
    assert batches[1][0].shape == (0, 3, 2) and batches[1][1].shape == (0,)
    assert batches[1][1].dtype == torch.long


@pytest.mark.parametrize("collate", [None, "custom"])
def test_an_empty_index_batch_gives_a_zero_row_batch_on_the_dataloader_path(collate):
    from torch.utils.data._utils.collate import default_collate

    fetcher = _BatchFetcher(collate_fn=(lambda items: default_collate(items)) if collate else None)
    data = DictDataset(6)
    empty = torch.tensor([], dtype=torch.long)
    index_batches = [empty, torch.tensor([4, 1]), empty, torch.tensor([2])]
    batches = list(fetcher.batches(data, index_batches))
    assert len(batches) == 4
    for batch in (batches[0], batches[2]):
        assert batch["x"].shape == (0, 2) and batch["x"].dtype == torch.float32
        assert batch["y"].shape == (0,) and batch["y"].dtype == torch.long
    assert torch.equal(batches[1]["y"], torch.tensor([4, 1])) and batches[1]["name"] == ["s4", "s1"]
    assert torch.equal(batches[3]["x"], data.x[[2]])
    only_empty = list(fetcher.batches(data, [empty]))
    assert only_empty[0]["x"].shape == (0, 2)

    tensor_data = TensorDataset(torch.randn(4, 3), torch.arange(4))
    custom = list(
        _BatchFetcher(collate_fn=lambda items: default_collate(items)).batches(tensor_data, [empty])
    )
    assert custom[0][0].shape == (0, 3) and custom[0][1].shape == (0,)


# ----------------------------------------------------------------------------- end to end: both runners


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


class PoissonDataModule(FederatedDataModule):
    """Its training loader draws Poisson batches (what a mechanism's ``batch_sampling`` sets at bind time)."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        loader.use_sampling("poisson")
        return loader


SIZES, BATCH = [12, 12, 9], 2
"""q = 1/6 and 2/9: some steps draw no sample, some more than the batch size (asserted)."""


def poisson_datamodule(cls=PoissonDataModule):
    g = torch.Generator().manual_seed(1)
    clients = []
    for n in SIZES:
        x = torch.randn(n, 6, generator=g)
        clients.append(TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()))
    return cls.from_client_datasets(clients, clients, batch_size=BATCH, seed=4)


def strategy_for(runner, algorithm, **kwargs):
    epochs = dict(head_epochs=1, body_epochs=1) if algorithm == "fedrep" else dict(local_epochs=2)
    return FederatedStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=len(SIZES),
        seed=5,
        runner=runner_setting(runner, kwargs),
        **epochs,
        **kwargs,
    )


def fit(runner, algorithm, rounds=2, datamodule=PoissonDataModule, trainer=None, **kwargs):
    torch.manual_seed(0)
    strategy = strategy_for(runner, algorithm, **kwargs)
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **(trainer or {})).fit(
        LossNet(), datamodule=poisson_datamodule(datamodule)
    )
    return strategy


def assert_same(a, b, exact=False):
    def same(x, y, msg):
        if exact:
            assert torch.equal(x, y), msg
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=msg)

    for name, value in a.global_tensors().items():
        same(b.global_tensors()[name], value, name)
        assert value.isfinite().all()
    for client in range(len(SIZES)):
        for name, value in a.client_tensors(client).items():
            same(b.client_tensors(client)[name], value, f"{client} {name}")


def drawn_sizes(rounds, steps_per_client):
    dm = poisson_datamodule()
    dm.setup("fit")
    loader = dm.train_dataloader()
    return [
        len(p)
        for r in range(rounds)
        for c in range(len(SIZES))
        for p in loader.client_positions(c, r, 0, steps_per_client[c])
    ]


@pytest.mark.parametrize(
    "algorithm,settings",
    [("fedrep", {}), ("fedrep", {"steps_per_call": 1}), ("fedavg", {"steps_per_call": 2})],
    ids=["fedrep-cached-fused", "fedrep-unfused", "fedavg-uncached-two-per-call"],
)
def test_vectorized_equals_sequential_on_poisson_batches(algorithm, settings):
    """Empty batches reach TinyNet's mean loss on the sequential runner: its loss is NaN, but its gradients are
    zeros (a sum over no sample), so the step is the engine's (a masked mean of no sample: 0, zero gradients)."""
    steps = [2 * -(-n // BATCH) for n in SIZES]  # two epochs a round
    sizes = drawn_sizes(2, steps)
    assert 0 in sizes and max(sizes) > BATCH, sizes
    sequential = fit("sequential", algorithm)
    vectorized = fit("vectorized", algorithm, **dict(settings))
    assert vectorized.runner_report.runner == "vectorized"
    assert_same(sequential, vectorized)


def test_mid_round_resume_on_poisson_batches_is_bit_exact(tmp_path):
    """The sampling is not checkpointed: the resumed fit's loader draws Poisson batches again (here its data
    module's; a mechanism's ``batch_sampling`` at bind time) and, batches being a function of the step, the same."""
    uninterrupted = fit("vectorized", "fedrep", steps_per_call=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    trainer = dict(enable_checkpointing=True, callbacks=[checkpoint], max_steps=5)
    fit("vectorized", "fedrep", trainer=trainer, steps_per_call=1)
    saved = tmp_path / "epoch=0-step=5.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    assert torch.load(saved, weights_only=True)["lightning_fedrep"]["round"]["open"]
    torch.manual_seed(0)
    resumed = strategy_for("vectorized", "fedrep", steps_per_call=1)
    quiet_trainer(strategy=resumed, max_epochs=2, limit_val_batches=0).fit(
        LossNet(), datamodule=poisson_datamodule(), ckpt_path=saved
    )
    assert_same(uninterrupted, resumed, exact=True)


# ----------------------------------------------------------------------------- binding


class NeedsPoisson(PrivacyMechanism):
    batch_sampling = "poisson"


class OwnBatches(RoundLoader):
    def client_batches(self, client, round_index, first_step, num_steps):
        return iter(())


def federation_with(mechanism):
    return SimpleNamespace(config=SimpleNamespace(privacy=mechanism))


def test_a_mechanism_that_needs_poisson_batches_switches_the_loader():
    loader = poisson_loader([6], 3)
    loader.use_sampling("shuffle")
    DataBinding.use_mechanism_sampling(loader, federation_with(None))
    assert loader.sampling == "shuffle"
    DataBinding.use_mechanism_sampling(loader, federation_with(PrivacyMechanism()))
    assert loader.sampling == "shuffle"
    DataBinding.use_mechanism_sampling(loader, federation_with(NeedsPoisson()))
    assert loader.sampling == "poisson"


def test_a_loader_that_draws_its_own_batches_is_refused():
    loader = OwnBatches(poisson_loader([6], 3).clients, 3)
    with pytest.raises(
        ValueError, match=r"NeedsPoisson needs 'poisson' batches .*privacy accounting.*OwnBatches"
    ):
        DataBinding.use_mechanism_sampling(loader, federation_with(NeedsPoisson()))
    assert loader.sampling == "shuffle"


class PoissonPassThrough(NeedsPoisson):
    """No privacy: the default weighted mean, Poisson batches (what a sample-level mechanism's clients draw)."""

    def aggregator(self, like, round_index, seed):
        return WeightedMean(like)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_fit_with_the_mechanism_trains_on_poisson_batches(runner):
    with_mechanism = fit(runner, "fedrep", datamodule=FederatedDataModule, privacy=PoissonPassThrough())
    assert_same(fit(runner, "fedrep"), with_mechanism, exact=runner == "sequential")
    shuffled = fit(runner, "fedrep", datamodule=FederatedDataModule)
    assert not torch.equal(
        shuffled.client_tensors(0)["classifier.weight"], with_mechanism.client_tensors(0)["classifier.weight"]
    )


def test_bind_training_applies_the_mechanisms_sampling(monkeypatch):
    binding = DataBinding(False, None, warn=lambda _: None, info=lambda _: None)
    loader = poisson_loader([6, 4], 3)
    loader.use_sampling("shuffle")
    seen = []
    monkeypatch.setattr(binding, "check_labels", lambda loader, probe: seen.append(loader.sampling))
    federation = SimpleNamespace(
        config=SimpleNamespace(privacy=NeedsPoisson()),
        bind_data=lambda *args: None,
        federation_changes=lambda: [],
    )
    binding.bind_training(loader, federation, probe=None)
    assert seen == ["poisson"] and loader.sampling == "poisson"
