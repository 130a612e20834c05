"""Data habits that went wrong silently or deep in a stack (issue 43): the validation split carved off each
client's training data and what keeps it apart from the test split; the warning when a fit selects rounds
on validation metrics computed on test data; dict samples under a partitioner; float class ids; dict
batches without the headline; a pass that logs nothing; clients tested on classes they never trained on."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from lightning_fedrep import FederatedDataModule, FedRepStrategy
from lightning_fedrep.data.partition import IIDPartitioner, ShardPartitioner
from lightning_fedrep.lightning.monitoring import selection_on_test_note
from tests.fixtures import TinyNet, quiet_trainer, reference_generator, tiny_datamodule, tiny_datasets


def fedrep(**settings) -> FedRepStrategy:
    return FedRepStrategy(
        head="classifier", clients_per_round=1.0, head_epochs=1, runner="sequential", **settings
    )


def messages(record, text: str) -> list[str]:
    return [str(w.message) for w in record if text in str(w.message)]


# ----------------------------------------------------------------------------- the validation split


def test_val_fraction_keeps_each_clients_seeded_share_of_its_training_data_for_validation():
    """The split as documented, restated: client ``c`` of ``n`` training samples keeps
    ``min(round(f * n), n - 1)`` of them for validation, the first entries of a permutation drawn with
    ``(seed, -1, c)``; the rest train; the test split is untouched. Catches a split of another size or drawn
    from another generator (not reproducible from the seed as documented)."""
    whole = tiny_datamodule(num_clients=6, seed=3)
    whole.setup()
    carved = tiny_datamodule(num_clients=6, seed=3, val_fraction=0.3)
    carved.setup()
    assert carved.has_validation_split and not whole.has_validation_split
    for client in range(6):
        indices = whole.client_data(client).indices
        n = len(indices)
        perm = torch.randperm(n, generator=reference_generator(3, -1, client))
        n_val = min(round(0.3 * n), n - 1)
        assert torch.equal(carved.client_data(client, "val").indices, indices[perm[:n_val]].sort().values)
        assert torch.equal(carved.client_data(client).indices, indices[perm[n_val:]].sort().values)
        assert torch.equal(
            carved.client_data(client, "test").indices, whole.client_data(client, "test").indices
        )


def test_holdout_and_few_shot_clients_keep_their_validation_and_test_splits_apart():
    """Catches the derived data modules taking the validation split for the test split (``test = self._val if
    ... else self._test`` in ``holdout``/``with_train_samples``): ``evaluate_new_clients`` then reported
    ``test/acc`` on validation data. Expected: each client's own splits of the data module they come from."""
    dm = tiny_datamodule(num_clients=8, seed=1, val_fraction=0.25)
    dm.setup()
    federation, new = dm.holdout(2, seed=5)
    kept = sorted(set(range(8)) - set(torch.randperm(8, generator=reference_generator(5, -2))[:2].tolist()))
    few = new.with_train_samples(3)
    for derived, originals in ((federation, kept), (few, [c for c in range(8) if c not in kept])):
        assert derived.has_validation_split
        for client, original in enumerate(originals):
            for split in ("val", "test"):
                got = derived.client_data(client, split).indices
                assert torch.equal(got, dm.client_data(original, split).indices), (client, split)


def test_explicit_client_validation_sets_are_validated_on_and_exclude_val_fraction():
    """``from_client_datasets(val=...)``: validation runs on the given sets (the validation loader holds them),
    test on the test sets; with ``val_fraction`` too it is refused, naming both."""
    train, test = tiny_datasets()
    halves = [TensorDataset(*(t[i::2] for t in train.tensors)) for i in range(2)]
    checks = [TensorDataset(*(t[i::4] for t in test.tensors)) for i in range(2)]
    tests = [TensorDataset(*(t[i + 2 :: 4] for t in test.tensors)) for i in range(2)]
    dm = FederatedDataModule.from_client_datasets(halves, tests, val=checks, batch_size=8)
    assert dm.has_validation_split
    assert [c.dataset for c in dm.val_dataloader().clients] == checks
    assert [c.dataset for c in dm.test_dataloader().clients] == tests
    with pytest.raises(ValueError, match=r"val=\.\.\.\) and val_fraction=0\.2"):
        FederatedDataModule.from_client_datasets(halves, tests, val=checks, val_fraction=0.2)


# ----------------------------------------------------------------------------- selecting rounds on test data


@pytest.mark.parametrize(
    "callback,named",
    [
        (lambda: ModelCheckpoint(monitor="val/acc", mode="max"), "ModelCheckpoint(monitor='val/acc')"),
        (lambda: EarlyStopping(monitor="val_ce"), "EarlyStopping(monitor='val_ce')"),
    ],
)
def test_selecting_rounds_on_a_validation_metric_computed_on_test_data_warns_once_at_setup(
    tmp_path, callback, named
):
    """Catches the silent selection on test data: with ``val_fraction=0`` validation is the test split, so a
    checkpoint or early stop on ``val/...`` picks rounds on test data. One warning at the fit's set-up (over
    two rounds), naming the callback, its metric and ``val_fraction``; none with a validation split."""
    for fraction, expected in ((0.0, 1), (0.25, 0)):
        trainer = quiet_trainer(
            strategy=fedrep(), max_epochs=2, callbacks=[callback()], enable_checkpointing=True,
            default_root_dir=tmp_path,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4, val_fraction=fraction))
        found = messages(record, "selects rounds on a validation metric")
        assert len(found) == expected, (fraction, found)
        if expected:
            assert named in found[0] and "val_fraction=0.1" in found[0], found[0]


def test_only_validation_metrics_of_federated_data_modules_without_a_validation_split_are_named():
    dm = tiny_datamodule()
    monitors = [ModelCheckpoint(monitor="finetune/val/acc"), EarlyStopping(monitor="train/loss")]
    assert "finetune/val/acc" in selection_on_test_note(monitors, dm)
    assert "train/loss" not in selection_on_test_note(monitors, dm)
    for quiet in ([ModelCheckpoint(), EarlyStopping(monitor="validity")], []):
        assert selection_on_test_note(quiet, dm) is None
    assert selection_on_test_note(monitors, tiny_datamodule(val_fraction=0.1)) is None
    assert selection_on_test_note(monitors, L.LightningDataModule()) is None


# ----------------------------------------------------------------------------- dict samples, float class ids


class DictSamples(Dataset):
    """``{"x": input, "y": label}`` samples of a TensorDataset; ``targets`` when ``with_targets``."""

    def __init__(self, data: TensorDataset, with_targets: bool = False) -> None:
        self.data = data
        if with_targets:
            self.targets = data.tensors[1]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.data[index]
        return {"x": x, "y": y}


def test_dict_samples_under_a_partitioner_are_refused_naming_their_keys_unless_they_store_targets():
    """Catches the bare ``KeyError: 1`` from reading ``dataset[i][1]`` of a dict sample. With a ``targets``
    attribute the partition is the TensorDataset's own (the partitioner sees the same labels)."""
    train, test = tiny_datasets()
    refused = FederatedDataModule(DictSamples(train), DictSamples(test), ShardPartitioner(4, 2))
    with pytest.raises(TypeError, match=r"dicts with keys \['x', 'y'\].*`targets` attribute"):
        refused.setup()
    stored = FederatedDataModule(
        DictSamples(train, with_targets=True), DictSamples(test, with_targets=True), ShardPartitioner(4, 2)
    )
    stored.setup()
    plain = FederatedDataModule(train, test, ShardPartitioner(4, 2))
    plain.setup()
    for client in range(4):
        for split in ("train", "test"):
            assert torch.equal(
                stored.client_data(client, split).indices, plain.client_data(client, split).indices
            )


class CountingNet(TinyNet):
    """TinyNet (4 class scores) counting its training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def float_clients(labels_of=lambda y: y.float()):
    train, test = tiny_datasets()
    return (
        [TensorDataset(train.tensors[0][i::4], labels_of(train.tensors[1][i::4])) for i in range(4)],
        [TensorDataset(test.tensors[0][i::4], labels_of(test.tensors[1][i::4])) for i in range(4)],
    )


def test_float_class_ids_of_explicit_clients_are_refused_before_any_step_as_under_a_partitioner():
    """Catches float class ids reaching the loss (``expected target dtype to be Long``, deep in a step):
    refused at the fit's set-up, before any training step, with the fix the partitioning path gives."""
    train, test = float_clients()
    model = CountingNet()
    dm = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    with pytest.raises(ValueError, match=r"client 0 .*torch\.float32.*4 class scores.*0\.\.3") as explicit:
        quiet_trainer(strategy=fedrep(), max_epochs=1).fit(model, datamodule=dm)
    assert model.steps == 0
    whole_train, whole_test = tiny_datasets()
    partitioned = FederatedDataModule(
        TensorDataset(whole_train.tensors[0], whole_train.tensors[1].float()),
        whole_test,
        ShardPartitioner(4, 2),
    )
    with pytest.raises(ValueError, match="partitioning needs integer class ids") as by_shards:
        partitioned.setup()
    fix = "Convert them to integers (e.g. TensorDataset(x, y.long())"
    assert fix in str(explicit.value) and fix in str(by_shards.value)


class Regressor(L.LightningModule):
    """One real output per sample, trained with the mean squared error (``classifier`` is the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.classifier = nn.Linear(8, 1)
        self.steps = 0

    def forward(self, x):
        return self.classifier(self.body(x)).squeeze(1)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_whole_number_real_targets_of_a_one_output_model_still_train():
    """The refusal does not catch regression: targets 0.0..3.0 (whole numbers) for a model with one output
    per sample train, and are scored with the mean squared error."""
    train, test = float_clients()
    strategy = fedrep()
    model = Regressor()
    dm = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    quiet_trainer(strategy=strategy, max_epochs=1).fit(model, datamodule=dm)
    assert model.steps > 0 and "val/loss" in strategy.client_metrics["val"].names


# ----------------------------------------------------------------------------- evaluation that measures nothing


class DictNet(TinyNet):
    """TinyNet on ``{"x", "y"}`` batches; its validation step logs ``val/acc`` and ``val/loss`` itself when
    ``logs_headline``, else nothing."""

    def __init__(self, logs_headline: bool = False) -> None:
        super().__init__()
        self.logs_headline = logs_headline

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        if self.logs_headline:
            logits = self(batch["x"])
            self.log("val/acc", (logits.argmax(1) == batch["y"]).float().mean())
            self.log("val/loss", F.cross_entropy(logits, batch["y"]))


def dict_clients():
    train, test = float_clients(labels_of=lambda y: y)
    return [DictSamples(d) for d in train], [DictSamples(d) for d in test]


def test_dict_batches_warn_once_that_the_headline_is_not_computed():
    """Catches the silent loss of ``val/acc`` on dict batches: one warning over two rounds naming the keys
    and what to do; none when the step logs both headline keys itself (whose ``val/acc`` is then there)."""
    train, test = dict_clients()
    for logs, expected in ((False, 1), (True, 0)):
        strategy = fedrep()
        dm = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            quiet_trainer(strategy=strategy, max_epochs=2).fit(DictNet(logs_headline=logs), datamodule=dm)
        found = messages(record, "not (x, y) pairs")
        assert len(found) == expected, found
        if expected:
            assert "dicts with keys ['x', 'y'], not (x, y) pairs" in found[0] and "log val/acc" in found[0]
        else:
            assert "val/acc" in strategy.client_metrics["val"].names


class SilentNet(TinyNet):
    """TinyNet whose validation step logs nothing."""

    def validation_step(self, batch, batch_idx):
        self(batch[0])


def test_a_validation_pass_that_logs_nothing_warns_once():
    """Catches the silent pass: ``headline_metrics=False`` and a step that logs nothing evaluate nothing.
    Once over three rounds under Python's default filter (the same text each pass); not when the headline
    is on (it measures ``val/acc``)."""
    for headline, expected in ((False, 1), (True, 0)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("default")
            strategy = fedrep(headline_metrics=headline)
            quiet_trainer(strategy=strategy, max_epochs=3).fit(SilentNet(), datamodule=tiny_datamodule(4))
        found = messages(record, "logged no metric")
        assert len(found) == expected, found
        if expected:
            assert "validation_step logs nothing" in found[0], found[0]


# ----------------------------------------------------------------------------- classes a client never trained on


def unseen(train_sets, eval_sets) -> dict[int, set[int]]:
    """Each client's evaluation classes its training data lacks, by plain sets."""
    result = {}
    for client, (own, other) in enumerate(zip(train_sets, eval_sets)):
        missing = set(other.tensors[1].tolist()) - set(own.tensors[1].tolist())
        if missing:
            result[client] = missing
    return result


def test_test_classes_a_client_never_trained_on_warn_on_every_path():
    """Catches the warning given by two partitioners only: explicit client data sets and an IID split warn
    too, once, naming the clients and classes (the expected ones by plain sets); the shard split deals each
    client test samples of its own classes only, and says nothing."""
    train, test = tiny_datasets()
    clients = [TensorDataset(*(t[i::4] for t in train.tensors)) for i in range(4)]
    clients[1] = TensorDataset(
        clients[1].tensors[0][clients[1].tensors[1] != 3], clients[1].tensors[1][clients[1].tensors[1] != 3]
    )
    tests = [TensorDataset(*(t[i::4] for t in test.tensors)) for i in range(4)]
    expected = unseen(clients, tests)
    assert expected == {1: {3}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        FederatedDataModule.from_client_datasets(clients, tests)
    found = messages(record, "never trained on")
    threes = int((tests[1].tensors[1] == 3).sum())
    assert len(found) == 1, found
    assert "1 of 4 clients have test samples of classes" in found[0], found[0]
    assert f"({threes} of {len(test)} test samples; client 1: class 3 ({threes} samples))" in found[0]

    iid = FederatedDataModule(train, test, IIDPartitioner(60), seed=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        iid.setup()
    found = messages(record, "never trained on")
    as_sets = [
        TensorDataset(*(t[iid.client_data(c, split).indices] for t in data.tensors))
        for split, data in (("train", train), ("test", test))
        for c in range(60)
    ]
    expected = unseen(as_sets[:60], as_sets[60:])
    assert (
        expected
        and len(found) == 1
        and found[0].startswith(f"FederatedDataModule: {len(expected)} of 60 clients have test samples")
    )

    shards = tiny_datamodule(num_clients=8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        shards.setup()
    assert messages(record, "never trained on") == []
