"""Bad input fails early with a message naming it: labels the model cannot score, string labels, an
unreadable or damaged checkpoint, a federated state of another version, a plain Lightning checkpoint
resumed into a federated fit, and an epoch setting the algorithm ignores."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_fedrep import FederatedDataModule, FedRepStrategy, Phase, personalized_state_dict
from lightning_fedrep.data.partition import ShardPartitioner
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.epochs import epoch_settings
from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.checkpoint.reading import CheckpointError
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule, tiny_datasets

# ----------------------------------------------------------------------------- labels


class CountingNet(TinyNet):
    """TinyNet (4 outputs) counting its training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def client_sets(bad_client: int, bad_label: int, split: str, classes: int = 4):
    g = torch.Generator().manual_seed(0)
    train, test = [], []
    for client in range(4):
        x = torch.randn(24, 6, generator=g)
        y = torch.randint(0, classes, (24,), generator=g)
        if client == bad_client:
            y[5 if split == "train" else 20] = bad_label
        train.append(TensorDataset(x[:16], y[:16]))
        test.append(TensorDataset(x[16:], y[16:]))
    return train, test


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
@pytest.mark.parametrize("split,label", [("train", 15), ("val", 4), ("train", -1)])
def test_a_label_the_model_cannot_score_is_refused_before_any_step_naming_the_client(runner, split, label):
    """Catches the label check missing (drop ``self.check_labels(loader, probe)`` from ``data/binding.py``'s ``DataBinding.bind_training``):
    the run then fails inside a step with ``Target 15 is out of bounds`` (or vmap's ``index 15 is out of
    bounds``), naming no client. Without a sanity check, a validation label is refused before any step too
    (Lightning loads the validation data at the fit's start). The expected client, label and class count are
    the data's and TinyNet's."""
    train, test = client_sets(bad_client=2, bad_label=label, split=split)
    model = TinyNet()
    model.fedrep_loss = "cross_entropy"  # lets the vectorized runner run it
    strategy = FedRepStrategy(head="classifier", clients_per_round=1.0, head_epochs=1, runner=runner)
    datamodule = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)  # no sanity check
    with pytest.raises(ValueError) as refused:
        trainer.fit(model, datamodule=datamodule)
    message = str(refused.value)
    assert f"Client 2's {split} data has label {label}" in message, message
    assert "the model outputs 4 classes" in message and "0..3" in message, message
    assert trainer.global_step == 0  # (the vectorized runner's probes may call training_step)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_a_label_the_model_cannot_score_is_refused_under_a_true_precision(precision):
    """Catches the label check silently off where the trainer converts the model (fails when
    ``_check_labels`` does not hand ``precision_plugin.convert_input`` to ``output_width``: the float32
    probe batch meets the converted model, the forward raises, the check returns ``None`` and the run
    fails inside a step with ``Target 15 is out of bounds``, naming no client). Expected: the data's
    client and label, TinyNet's 4 outputs."""
    train, test = client_sets(bad_client=2, bad_label=15, split="train")
    strategy = FedRepStrategy(head="classifier", clients_per_round=1.0, head_epochs=1, runner="sequential")
    datamodule = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, precision=precision, limit_val_batches=0)
    with pytest.raises(
        ValueError, match="Client 2's train data has label 15, but the model outputs 4 classes"
    ):
        trainer.fit(CountingNet(), datamodule=datamodule)
    assert trainer.global_step == 0


class ModesSeen(L.Callback):
    """Every submodule's training mode when training starts (after the label check in ``setup``)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.modes = {name: m.training for name, m in pl_module.named_modules()}


def test_the_label_check_keeps_every_submodules_mode():
    """Catches the label check flattening submodule modes (fails when ``output_width`` restores the
    module with ``module.train(training)``: the body the user put in ``eval()``, a frozen feature
    extractor, is back in training mode). The reference: the modes set by hand before the fit."""
    train, test = client_sets(bad_client=-1, bad_label=0, split="train")
    model = TinyNet()
    model.train()
    model.body.eval()
    expected = {name: m.training for name, m in model.named_modules()}
    seen = ModesSeen()
    strategy = FedRepStrategy(head="classifier", clients_per_round=1.0, head_epochs=1, runner="sequential")
    datamodule = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0, callbacks=[seen])
    trainer.fit(model, datamodule=datamodule)
    assert seen.modes == expected and not seen.modes["body"] and seen.modes["classifier"]


def test_a_data_module_declaring_num_classes_is_checked_when_the_output_says_nothing():
    """Catches the declared ``num_classes`` being ignored (drop the ``datamodule.num_classes`` fallback in
    ``_check_labels``): a model whose output is not ``(batch, classes)`` scores nothing to compare with."""

    class DictNet(TinyNet):
        def forward(self, x):
            return {"logits": super().forward(x)}

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x)["logits"], y)

    class Declared(FederatedDataModule):
        num_classes = 3

    train, test = client_sets(bad_client=1, bad_label=3, split="train", classes=3)
    datamodule = Declared.from_client_datasets(train, test, batch_size=8)
    strategy = FedRepStrategy(head="classifier", clients_per_round=1.0, head_epochs=1, runner="sequential")
    with pytest.raises(
        ValueError, match=r"Client 1's train data has label 3, but the data module declares 3"
    ):
        quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
            DictNet(), datamodule=datamodule
        )


class NamedLabels(Dataset):
    """Samples whose labels are class names, with no ``targets`` attribute."""

    def __init__(self, base: TensorDataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return x, ("north", "east", "south", "west")[int(y)]


def test_string_labels_are_refused_naming_the_data_set():
    """Catches the string check missing in ``dataset_labels`` (partitioning) and in ``_check_labels``
    (explicit clients): without it ``torch.as_tensor`` fails with ``too many dimensions 'str'``, or the
    batch reaches ``cross_entropy`` as a list of strings."""
    train, test = tiny_datasets()
    partitioned = FederatedDataModule(NamedLabels(train), test, ShardPartitioner(4, 2))
    with pytest.raises(
        TypeError, match=r"FederatedDataModule\(train_set=\.\.\.\) has string labels \(e\.g\. '"
    ):
        partitioned.setup()
    explicit = FederatedDataModule.from_client_datasets([NamedLabels(train)], [test], batch_size=8)
    strategy = FedRepStrategy(head="classifier", clients_per_round=1.0, head_epochs=1)
    with pytest.raises(TypeError, match="The train data of client 0 has string labels .* must be integer"):
        quiet_trainer(strategy=strategy, max_epochs=1).fit(CountingNet(), datamodule=explicit)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_input") / "round1.ckpt"
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4))
    trainer.save_checkpoint(path)
    return path


def resume(path, max_epochs=2, stage="fit"):
    model = CountingNet()
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=max_epochs, limit_val_batches=0)
    getattr(trainer, stage)(model, datamodule=tiny_datamodule(num_clients=4), ckpt_path=path)
    return model, trainer


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_an_unreadable_checkpoint_file_is_one_error_naming_it(checkpoint, tmp_path, cut):
    """Catches the read not being wrapped (drop ``read_checkpoint`` in ``load_checkpoint``): torch's own
    ``PytorchStreamReader failed ...`` / ``OSError`` / ``UnpicklingError``, naming no file."""
    data = checkpoint.read_bytes()
    path = tmp_path / f"{cut}.ckpt"
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"\x80not a checkpoint" * 50, "empty": b""}[cut]
    )
    with pytest.raises(CheckpointError, match="truncated or corrupt") as refused:
        resume(path)
    assert str(path) in str(refused.value)
    with pytest.raises(CheckpointError, match=f"Cannot read the checkpoint {path}: the file is truncated"):
        personalized_state_dict(path, 0)


def damaged(checkpoint, tmp_path, change):
    state = torch.load(checkpoint, weights_only=True)
    change(state["lightning_fedrep"])
    path = tmp_path / "damaged.ckpt"
    torch.save(state, path)
    return path


def _first_client(fed):
    return next(iter(fed["clients"]["local"]))


DAMAGES = {
    "head of wrong shape": (
        lambda fed: fed["clients"]["local"].__setitem__(
            _first_client(fed), [torch.zeros(5, 8), torch.zeros(5)]
        ),
        r"\['clients'\]\['local'\]\[\d\]\[0\] \('classifier.weight'\) must be of shape \(4, 8\).*got shape \(5, 8\)",
    ),
    "global body of wrong shape": (
        lambda fed: fed["global"].__setitem__(0, torch.zeros(12, 7)),
        r"\['global'\]\[0\] \('body.0.weight'\) must be of shape \(12, 6\).*got shape \(12, 7\)",
    ),
    "template not tensors": (
        lambda fed: fed["clients"].__setitem__("template", [1.0, 2.0]),
        r"\['clients'\]\['template'\]\[0\] \('classifier.weight'\) must be a tensor, got float",
    ),
    "client id not an int": (
        lambda fed: fed["clients"]["local"].__setitem__("three", fed["clients"]["local"][_first_client(fed)]),
        r"\['clients'\]\['local'\] has the key 'three', which is not a client id in 0\.\.3",
    ),
    "round index a string": (
        lambda fed: fed["round"].__setitem__("index", "0"),
        r"\['round'\]\['index'\] must be an int, got str",
    ),
    "missing global": (
        lambda fed: fed.pop("global"),
        r"\['global'\] must be a list of tensors, got NoneType",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_damaged_federated_entry_is_refused_before_training_naming_it(checkpoint, tmp_path, damage):
    """Catches the entries going unchecked (drop ``check_federated_state`` in ``load_model_state_dict``): a
    raw ``TypeError``/``KeyError``, a shape error from ``_foreach_copy_`` naming no entry, or a head of the
    wrong shape stored silently until the client trains. Expected shapes are TinyNet's own."""
    change, expected = DAMAGES[damage]
    path = damaged(checkpoint, tmp_path, change)
    model = None
    with pytest.raises(CheckpointError, match=expected) as refused:
        model, _ = resume(path)
    assert str(path) in str(refused.value) and model is None
    with pytest.raises(CheckpointError, match=expected):
        resume(path, stage="test")


@pytest.mark.parametrize("version", [99, 0, None])
def test_a_federated_state_of_another_version_is_refused_saying_which_load(checkpoint, tmp_path, version):
    """Catches the version going unchecked (``check_version`` accepting any version): a checkpoint of an
    unknown format would be read as if it were this one."""
    path = damaged(
        checkpoint,
        tmp_path,
        lambda fed: fed.__setitem__("version", version) if version is not None else fed.pop("version"),
    )
    found = "has no version field" if version is None else f"is version {version}"
    with pytest.raises(
        CheckpointError, match=f"{found}; this lightning_fedrep loads versions 1, 2 and 3 only"
    ):
        resume(path)


V1_ROUND = ("open", "index", "live_client", "live_part", "live_tensors", "average")
"""What version 1 saved of the round (the last four only inside a round)."""


def as_version_1(state: dict) -> dict:
    """A federated state as version 1 wrote it (``federated_state_dict`` of commit 42c9b91): the same names,
    global tensors, client store and RNG, the round without the finished clients, counters and loops, the
    history as a list of evaluated rows ``{"round": r, <metric>: value}``, and no fingerprint, faults,
    algorithm state or engine settings."""
    kept = ("algorithm", "shared_names", "local_names", "global", "clients", "torch_rng")
    evaluations = state["history"]["evaluations"]
    return {
        "version": 1,
        **{key: state[key] for key in kept},
        "round": {key: state["round"][key] for key in V1_ROUND if key in state["round"]},
        "history": [{"round": r, **values} for r, values in sorted(evaluations.items())],
    }


def fedrep_run(rounds, ckpt_path=None, **trainer_kw):
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kw)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=ckpt_path)
    return strategy, trainer


@pytest.mark.parametrize("where", ["round end", "mid-round"])
def test_a_version_1_checkpoint_resumes_like_the_uninterrupted_run(tmp_path, where):
    """``LOADABLE_VERSIONS`` promises version 1: a checkpoint rewritten in version 1's form (at a round's
    end, or inside round 1) resumes to the same body, heads and history as the run that never stopped.
    Catches version 1's history (a list of rows) not converted (drop the ``isinstance(state, list)`` branch
    of ``History.load_state_dict``), or a key version 1 lacks read as required (``state["faults"]`` in
    ``Federation.load_state_dict``, ``round_state["finished"]`` in ``restore_round``)."""
    saver = ModelCheckpoint(
        dirpath=tmp_path / "steps", every_n_train_steps=20, save_top_k=-1, filename="{step}"
    )
    full, _ = fedrep_run(2, callbacks=[saver], enable_checkpointing=True)
    if where == "round end":
        _, first = fedrep_run(1)
        first.save_checkpoint(tmp_path / "v2.ckpt")
        checkpoint = torch.load(tmp_path / "v2.ckpt", weights_only=True)
    else:
        saved = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "steps").glob("*.ckpt"))]
        rounds = [c["lightning_fedrep"]["round"] for c in saved]
        checkpoint = next(c for c, r in zip(saved, rounds) if r["open"] and r["index"] == 1)
    checkpoint["lightning_fedrep"] = as_version_1(checkpoint["lightning_fedrep"])
    assert checkpoint["lightning_fedrep"]["history"]  # round 0 was validated
    torch.save(checkpoint, tmp_path / "v1.ckpt")
    resumed, trainer = fedrep_run(2, ckpt_path=tmp_path / "v1.ckpt")
    assert trainer.current_epoch == 2 and resumed.federation.round_index == 1
    for name, value in full.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(4):
        for name, value in full.client_tensors(client).items():
            assert torch.equal(resumed.client_tensors(client)[name], value), (client, name)
    assert resumed.history == full.history and [row["round"] for row in full.history] == [0, 1]


def test_the_current_checkpoint_still_resumes(checkpoint):
    """The checks accept what this package writes: resuming runs the one remaining round."""
    model, trainer = resume(checkpoint, max_epochs=2)
    assert trainer.current_epoch == 2 and model.steps > 0


def test_a_plain_lightning_checkpoint_is_refused_in_a_federated_fit_and_evaluates_fine(tmp_path):
    """Catches the epoch counter carried over (drop ``refuse_plain_checkpoint_in_fit``): the plain
    checkpoint's 1 epoch counts as a round done, so ``max_epochs=3`` runs 2 rounds."""
    torch.manual_seed(0)
    train, _ = tiny_datasets()
    plain = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    plain.fit(TinyNet(), DataLoader(train, batch_size=32))
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    model = CountingNet()
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0)
    with pytest.raises(CheckpointError, match="has no federated state") as refused:
        trainer.fit(model, datamodule=tiny_datamodule(num_clients=4), ckpt_path=path)
    assert (
        str(path) in str(refused.value) and "load_from_checkpoint" in str(refused.value) and model.steps == 0
    )
    datamodule = tiny_datamodule(num_clients=4)
    evaluated = quiet_trainer(strategy=FedRepStrategy(head="classifier"))
    metrics = evaluated.test(TinyNet(), datamodule=datamodule, ckpt_path=path, verbose=False)
    net = TinyNet()  # every client scores the plain model: its accuracy on each client's test data, averaged
    net.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    accuracies = []
    for client in range(4):
        data = datamodule.client_data(client, "test")
        x, y = (t[data.indices] for t in data.dataset.tensors)
        accuracies.append((net(x).argmax(1) == y).double().mean().item())
    assert metrics[0]["test/acc"] == pytest.approx(sum(accuracies) / 4, abs=1e-6)


# ----------------------------------------------------------------------------- epoch settings


# the FedRep shorthands; every other built-in algorithm reads local_epochs
READS = {"fedrep": {"head_epochs", "body_epochs"}}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("name", ["head_epochs", "body_epochs", "local_epochs"])
def test_an_epoch_setting_the_algorithm_ignores_is_refused_at_construction(algorithm, name):
    """Catches ``FedRepStrategy(algorithm="fedavg", head_epochs=5)`` running FedAvg's one local epoch
    silently (drop ``check_epoch_shorthands`` from the strategy's ``__init__``). The rule restated: FedRep
    reads head_epochs and body_epochs, the other built-in algorithms local_epochs."""
    reads = name in READS.get(algorithm, {"local_epochs"})
    if reads:
        FedRepStrategy(algorithm=algorithm, **{name: 5})
    else:
        with pytest.raises(ValueError, match=rf"{name}=5\) has no effect with algorithm '{algorithm}'"):
            FedRepStrategy(algorithm=algorithm, **{name: 5})
    assert epoch_settings(algorithm, **{name: 5}) == ({name: 5} if reads else {})
    FedRepStrategy(algorithm=algorithm, **{name: {"head_epochs": 10}.get(name, 1)})  # the default: fine


def test_an_epoch_setting_next_to_explicit_phases_is_refused():
    """Catches phases silently overriding a shorthand (drop the ``phases_given`` branch)."""
    with pytest.raises(
        ValueError, match=r"head_epochs=2\) has no effect: phases=\.\.\. gives the local work"
    ):
        FedRepStrategy(phases=[Phase("all", epochs=1)], head_epochs=2)


class HeadThenJoint(Algorithm):
    """A user algorithm reading ``head_epochs`` and ``local_epochs``: a head phase, then a joint one."""

    epochs = ("head_epochs", "local_epochs")

    def __init__(self) -> None:
        super().__init__("head_then_joint", {"body"}, "head, then everything")

    def default_phases(self, head_epochs: int, local_epochs: int) -> tuple[Phase, ...]:
        return (Phase("head", epochs=head_epochs), Phase("all", epochs=local_epochs))


def test_an_algorithm_gets_the_epoch_shorthands_it_declares_and_no_other():
    """Fails if the strategy passes a shorthand the algorithm does not declare (``default_phases`` would raise
    a ``TypeError``), ignores a declared one, or lets an undeclared one through."""
    strategy = FedRepStrategy(algorithm=HeadThenJoint(), head_epochs=3, local_epochs=2)
    assert strategy.config.phases == (Phase("head", epochs=3), Phase("all", epochs=2))
    assert epoch_settings(HeadThenJoint(), head_epochs=3, body_epochs=4, local_epochs=2) == {
        "head_epochs": 3,
        "local_epochs": 2,
    }
    with pytest.raises(
        ValueError, match=r"body_epochs=4\) has no effect .* set by head_epochs and local_epochs"
    ):
        FedRepStrategy(algorithm=HeadThenJoint(), body_epochs=4)


def _algorithm_class(epochs, default_phases):
    return type("Mine", (Algorithm,), {"epochs": epochs, "default_phases": default_phases})


def _joint(self, local_epochs):
    return (Phase("all", epochs=local_epochs),)


@pytest.mark.parametrize(
    ("epochs", "phases", "error", "match"),
    [
        (
            ("local_epochs", "rounds"),
            _joint,
            ValueError,
            r"Mine\.epochs = .*'rounds' is not an epoch shorthand",
        ),
        (("local_epochs", "local_epochs"), _joint, ValueError, r"Mine\.epochs = .* names a shorthand twice"),
        ("local_epochs", _joint, TypeError, r"Mine\.epochs must be a tuple"),
        (
            ("head_epochs",),
            _joint,
            TypeError,
            r"default_phases\(self, local_epochs\) is called with .*'head_epochs'",
        ),
        (
            ("local_epochs",),
            lambda self, head_epochs, body_epochs, local_epochs: (),
            TypeError,
            r"default_phases\(self, head_epochs, body_epochs, local_epochs\) is called with",
        ),
    ],
    ids=["unknown", "repeated", "not-a-tuple", "not-taken", "not-declared"],
)
def test_a_bad_epochs_declaration_is_refused_when_the_class_is_defined(epochs, phases, error, match):
    """Fails if a declaration naming no shorthand, or disagreeing with ``default_phases``, passes until a fit
    calls ``default_phases`` (a ``TypeError`` far from its cause)."""
    with pytest.raises(error, match=match):
        _algorithm_class(epochs, phases)


def test_a_default_phases_taking_keywords_accepts_any_declaration():
    cls = _algorithm_class(("head_epochs", "body_epochs"), lambda self, **epochs: (Phase("all", epochs=1),))
    assert cls("mine", {"body"}, "").epochs == ("head_epochs", "body_epochs")
