"""``FineTunedEvaluation`` (SRPFL's evaluation): each client's head is fine-tuned on its training data before it
is scored, from the average of the last round's heads or from its own; checked against a plain PyTorch loop."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_fedrep import FedRepStrategy, FineTunedEvaluation
from lightning_fedrep.federation.api.epochs import epoch_settings
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

HEAD = ("classifier.weight", "classifier.bias")


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


def client_tensors(dm, client, split):
    data = dm.client_data(client, split)
    x, y = data.dataset.tensors
    return x[data.indices], y[data.indices]


def reference_accuracy(model, body, head, dm, client, epochs, lr, momentum=0.5, weight_decay=1e-4):
    """Head-only SGD on the client's whole training set per step (full batch, so order does not matter),
    then its accuracy on its evaluation data."""
    net = copy.deepcopy(model)
    net.load_state_dict({**net.state_dict(), **body, **head})
    for p in net.parameters():
        p.requires_grad_(False)
    groups = [  # the official fine-tuning optimizer: weight decay on the weight, not the bias
        {"params": [net.classifier.weight.requires_grad_(True)], "weight_decay": weight_decay},
        {"params": [net.classifier.bias.requires_grad_(True)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum)
    x, y = client_tensors(dm, client, "train")
    for _ in range(epochs):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    x, y = client_tensors(dm, client, "test")
    with torch.no_grad():
        return (net(x).argmax(-1) == y).float().mean().item()


def fit(callback, algorithm="fedrep", runner="auto", rounds=2):
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=6, batch_size=8)
    strategy = FedRepStrategy(
        algorithm=algorithm, head="classifier", clients_per_round=2, seed=4,
        **epoch_settings(algorithm, head_epochs=1, body_epochs=1),
        runner=runner,
    )  # fmt: skip
    model = LossNet()
    initial = copy.deepcopy(model)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, callbacks=[callback])
    trainer.fit(model, datamodule=dm)
    return trainer, strategy, dm, initial


@pytest.mark.parametrize("runner", ["sequential", "auto"])
def test_every_client_is_scored_after_fine_tuning_the_average_of_the_last_rounds_heads(runner):
    callback = FineTunedEvaluation(epochs=3, lr=0.2, batch_size=10_000, optimizer="sgd")
    trainer, strategy, dm, initial = fit(callback, runner=runner)
    federation = strategy.federation
    body = {n: t for n, t in federation.global_tensors().items() if n not in HEAD}
    last = list(strategy.round_plan(1).clients)
    assert callback.last_round_clients == last
    sizes = torch.tensor([float(len(dm.client_data(c))) for c in last])  # weighted as the aggregation
    average = {
        n: sum(w * federation.client_tensors(c)[n] for w, c in zip(sizes / sizes.sum(), last)) for n in HEAD
    }
    sampled = set(strategy.round_plan(0).clients) | set(last)
    never = [c for c in range(6) if c not in sampled]
    assert never, "the check below needs a client that never took part"
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        expected = reference_accuracy(initial, body, average, dm, client, epochs=3, lr=0.2)
        assert measured[client] == pytest.approx(expected, abs=1e-6), client
    for client in never:  # scored with a fine-tuned head; its stored head is still the initial one
        assert torch.equal(federation.client_tensors(client)["classifier.weight"], initial.classifier.weight)


def test_the_stored_start_fine_tunes_each_clients_own_head_and_leaves_it_stored():
    callback = FineTunedEvaluation(epochs=2, start="stored", lr=0.1, batch_size=10_000, optimizer="sgd")
    trainer, strategy, dm, initial = fit(callback)
    federation = strategy.federation
    body = {n: t for n, t in federation.global_tensors().items() if n not in HEAD}
    stored = {c: federation.client_tensors(c) for c in range(6)}
    (result,) = trainer.validate(trainer.lightning_module, datamodule=dm, verbose=False)
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        head = {n: stored[client][n] for n in HEAD}
        assert measured[client] == pytest.approx(reference_accuracy(initial, body, head, dm, client, 2, 0.1))
        assert all(torch.equal(federation.client_tensors(client)[n], stored[client][n]) for n in HEAD)
    assert result["val/acc"] == pytest.approx(sum(measured.values()) / 6)


def test_fedavg_fine_tunes_the_global_head_per_client_and_keeps_the_global_model():
    callback = FineTunedEvaluation(epochs=2, lr=0.1, batch_size=10_000, optimizer="sgd")
    trainer, strategy, dm, initial = fit(callback, algorithm="fedavg")
    federation = strategy.federation
    global_tensors = federation.global_tensors()
    body = {n: t for n, t in global_tensors.items() if n not in HEAD}
    head = {n: global_tensors[n] for n in HEAD}
    measured = strategy.client_metrics["val"].per_client("val/acc")
    for client in range(6):
        assert measured[client] == pytest.approx(reference_accuracy(initial, body, head, dm, client, 2, 0.1))
    live = dict(trainer.lightning_module.named_parameters())
    assert all(torch.equal(live[n].detach(), t) for n, t in global_tensors.items())


def test_without_a_declared_loss_it_is_refused_before_training():
    dm = tiny_datamodule(num_clients=4)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[FineTunedEvaluation()])
    with pytest.raises(ValueError, match="fedrep_loss"):
        trainer.fit(TinyNet(), datamodule=dm)
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epochs": 0}, "epochs"),
        ({"start": "global"}, "start"),
        ({"loss": "hinge"}, "loss"),
        ({"stages": ["fit"]}, "stages"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"optimizer": torch.optim.Adam, "lr": 0.1}, "lr"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        FineTunedEvaluation(**kwargs)


class BatchNormNet(LossNet):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU())
        self.classifier = torch.nn.Linear(12, 4)


def test_fine_tuning_in_train_mode_leaves_the_training_and_its_batch_norm_statistics_alone():
    """Fine-tuning runs the module in train mode (batch norm updates running statistics there): the federation
    trained with the callback evaluating every round is the one trained without it, buffers included."""

    def train(callbacks):
        torch.manual_seed(0)
        dm = tiny_datamodule(num_clients=4, batch_size=8)
        strategy = FedRepStrategy(
            head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=1
        )
        trainer = quiet_trainer(strategy=strategy, max_epochs=2, callbacks=callbacks)
        trainer.fit(BatchNormNet(), datamodule=dm)
        if callbacks:
            trainer.validate(trainer.lightning_module, datamodule=dm, verbose=False)
        return strategy.federation

    plain, evaluated = train([]), train([FineTunedEvaluation(epochs=2)])
    for name, tensor in plain.global_tensors().items():
        assert torch.equal(tensor, evaluated.global_tensors()[name]), name
    for client in range(4):
        for name, tensor in plain.client_tensors(client).items():
            assert torch.equal(tensor, evaluated.client_tensors(client)[name]), (client, name)


def test_a_checkpoints_evaluation_repeats_the_scores_logged_when_it_was_written(tmp_path):
    callback = FineTunedEvaluation(epochs=2, lr=0.1)  # batch 8: the batch order matters
    trainer, strategy, dm, _ = fit(callback)
    logged = strategy.client_metrics["val"].per_client("val/acc")
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    again = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=4)
    fresh = quiet_trainer(strategy=again, callbacks=[FineTunedEvaluation(epochs=2, lr=0.1)])
    fresh.validate(
        LossNet(), datamodule=tiny_datamodule(num_clients=6, batch_size=8), ckpt_path=tmp_path / "c.ckpt"
    )
    assert again.client_metrics["val"].per_client("val/acc") == pytest.approx(logged)


class DictBatches(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base
        self.targets = base.tensors[1]  # the partitioner's labels

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return {"x": x, "y": y}


def test_batches_that_are_not_pairs_are_refused_when_fit_starts_or_split_by_unpack():
    from lightning_fedrep import FederatedDataModule, ShardPartitioner
    from tests.fixtures import tiny_datasets

    class DictNet(LossNet):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch["x"]), batch["y"])

        def validation_step(self, batch, batch_idx):
            self.log("val_ce", F.cross_entropy(self(batch["x"]), batch["y"]))

    train, test = tiny_datasets()
    dm = FederatedDataModule(DictBatches(train), DictBatches(test), ShardPartitioner(4, 2), batch_size=8)
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, runner="sequential"
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[FineTunedEvaluation(epochs=1)])
    with pytest.raises(TypeError, match="unpack"):
        trainer.fit(DictNet(), datamodule=dm)
    assert trainer.global_step == 0
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, runner="sequential"
    )
    unpack = FineTunedEvaluation(epochs=1, unpack=lambda batch: (batch["x"], batch["y"]))
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[unpack])
    trainer.fit(DictNet(), datamodule=dm)
    assert trainer.global_step > 0 and len(strategy.client_metrics["val"].samples) == 4


def test_it_runs_under_bf16_true_precision():
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=1, precision="bf16-true", callbacks=[FineTunedEvaluation(epochs=1)]
    )
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=4))
    assert len(strategy.client_metrics["val"].per_client("val/acc")) == 4


# ----------------------------------------------------------------------------- the fine-tuning optimizer


class AdamNet(LossNet):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02, betas=(0.8, 0.95), weight_decay=1e-3)


def reference_adam_head(model, body, head, dm, client, epochs):
    """Head-only Adam (the module's class and hyper-parameters) on the client's whole training set per step;
    returns the fitted head's accuracy and mean cross-entropy on the client's evaluation data."""
    net = copy.deepcopy(model)
    net.load_state_dict({**net.state_dict(), **body, **head})
    for p in net.parameters():
        p.requires_grad_(False)
    params = [net.classifier.weight.requires_grad_(True), net.classifier.bias.requires_grad_(True)]
    optimizer = torch.optim.Adam(params, lr=0.02, betas=(0.8, 0.95), weight_decay=1e-3)
    x, y = client_tensors(dm, client, "train")
    for _ in range(epochs):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    x, y = client_tensors(dm, client, "test")
    with torch.no_grad():
        logits = net(x)
    return (logits.argmax(-1) == y).float().mean().item(), F.cross_entropy(logits, y).item()


def test_an_adam_module_fine_tunes_with_adam_and_its_hyper_parameters_and_says_so(caplog):
    """Catches fine-tuning an Adam module with SGD at Adam's learning rate: make ``optimizer="sgd"`` the
    default (the old behaviour) and every client's loss differs from a plain PyTorch Adam loop's."""
    import logging

    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=6, batch_size=8)
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=4, runner="sequential"
    )
    model = AdamNet()
    initial = copy.deepcopy(model)
    callback = FineTunedEvaluation(epochs=3, start="stored", batch_size=10_000)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(model, datamodule=dm)
    federation = strategy.federation
    body = {n: t for n, t in federation.global_tensors().items() if n not in HEAD}
    metrics = strategy.client_metrics["val"]
    for client in range(6):
        head = {n: federation.client_tensors(client)[n] for n in HEAD}
        accuracy, loss = reference_adam_head(initial, body, head, dm, client, epochs=3)
        assert metrics.per_client("val/loss")[client] == pytest.approx(loss, rel=1e-5), client
        assert metrics.per_client("val/acc")[client] == pytest.approx(accuracy, abs=1e-6), client
    lines = [r.getMessage() for r in caplog.records if "FineTunedEvaluation fine-tunes" in r.getMessage()]
    assert len(lines) == 1 and "with Adam (lr=0.02, betas=(0.8, 0.95)" in lines[0], lines
    assert "AdamNet.configure_optimizers()" in lines[0]


def test_a_declared_optimizer_and_an_override_reaching_a_missing_hyper_parameter():
    """A callable ``params -> Optimizer`` is what fine-tunes; ``momentum=`` on an Adam module is refused
    when fit starts, naming ``momentum`` (it would otherwise be dropped without a word)."""
    import functools

    dm = tiny_datamodule(num_clients=4)
    declared = FineTunedEvaluation(epochs=1, optimizer=functools.partial(torch.optim.Adagrad, lr=0.1))
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[declared])
    trainer.fit(LossNet(), datamodule=dm)
    head = {n: torch.zeros(()) for n in HEAD}
    assert isinstance(
        declared.fine_tuning_optimizer(trainer, trainer.lightning_module).build(head), torch.optim.Adagrad
    )
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[FineTunedEvaluation(momentum=0.9)])
    with pytest.raises(ValueError, match=r"momentum=0.9.*Adam has none"):
        trainer.fit(AdamNet(), datamodule=dm)
    assert trainer.global_step == 0


SRPFL_RECIPES = sorted(
    p
    for p in (Path(__file__).resolve().parents[1] / "recipes" / "srpfl").glob("*.yaml")
    if "FineTunedEvaluation" in p.read_text()
)


@pytest.mark.parametrize("recipe", SRPFL_RECIPES, ids=lambda p: p.name)
def test_the_srpfl_recipes_fine_tune_with_the_official_sgd(recipe):
    """The SRPFL code fine-tunes with SGD(momentum 0.5, weight decay 1e-4 on weights, none on biases) at the
    training rate: a recipe that leaves ``optimizer`` to the module must configure exactly that optimizer."""
    import importlib

    import yaml

    config = yaml.safe_load(recipe.read_text())
    (tuned,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("FineTunedEvaluation")]
    choice = tuned.get("init_args", {}).get("optimizer", "module")
    if (
        choice == "sgd"
    ):  # the callback's own SRPFL SGD (FedAvg/LG recipes, whose training SGD has no momentum)
        return
    assert choice == "module"
    module_path, name = config["model"]["class_path"].rsplit(".", 1)
    model = getattr(importlib.import_module(module_path), name)(**config["model"].get("init_args", {}))
    optimizer = model.configure_optimizers()
    assert type(optimizer) is torch.optim.SGD
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        assert group["momentum"] == 0.5 and group["lr"] == config["model"]["init_args"]["lr"]
        for p in group["params"]:
            assert group["weight_decay"] == (0.0 if names[id(p)].endswith("bias") else 1e-4), names[id(p)]


# ----------------------------------------------------------------------------- cached features


class HeadlineNet(LossNet):
    fedrep_evaluation = "headline"  # the engine then scores every client's head in one batched pass


class DoubledNet(LossNet):
    def forward(self, x):
        return 2 * self.classifier(self.body(x))  # the head's output is not the model's output


class NoisyTransform:
    def __repr__(self):
        return "RandomNoise()"

    def __call__(self, x):
        return x + 0.5 * torch.randn_like(x)


class NoisyData(torch.utils.data.Dataset):
    """The tiny data with a random transform (fresh noise at every fetch)."""

    def __init__(self, base):
        self.base, self.targets, self.transform = base, base.tensors[1], NoisyTransform()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return self.transform(x), y


def noisy_datamodule():
    from lightning_fedrep import FederatedDataModule, ShardPartitioner
    from tests.fixtures import tiny_datasets

    train, test = tiny_datasets()
    return FederatedDataModule(NoisyData(train), test, ShardPartitioner(6, 2), batch_size=8, seed=0)


def fine_tuned_metrics(cache, model=LossNet, runner="auto", datamodule=None):
    """Per-client ``val/acc`` and ``val/loss`` after one round, fine-tuned in batches of 8 (the order matters),
    and the callback's feature-cache decision."""
    callback = FineTunedEvaluation(epochs=3, lr=0.1, cache_features=cache)
    torch.manual_seed(0)
    dm = datamodule() if datamodule else tiny_datamodule(num_clients=6, batch_size=8)
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=4, runner=runner
    )
    quiet_trainer(strategy=strategy, max_epochs=1, callbacks=[callback]).fit(model(), datamodule=dm)
    metrics = strategy.client_metrics["val"]
    return metrics.per_client("val/acc"), metrics.per_client("val/loss"), callback.cache_decision


@pytest.mark.parametrize("runner", ["sequential", "auto"])
def test_cached_features_score_every_client_as_the_full_forward_passes(runner):
    """Catches a cached step on the wrong samples' features: change ``features[index]`` to
    ``features[: len(index)]`` in ``_fit_head_cached`` and the per-client losses differ. Scored by the per-batch
    (``sequential``) and the batched (``auto`` with ``fedrep_evaluation = "headline"``) evaluation; equal within
    float error (a sample's features in a pass over the client's data and in a batch of 8 may differ in the
    last bits; here the accuracy is equal and the loss to 1e-6)."""
    acc, loss, decision = fine_tuned_metrics(True, HeadlineNet, runner)
    full_acc, full_loss, full_decision = fine_tuned_metrics(False, HeadlineNet, runner)
    assert "caches each client's features" in decision
    assert "cache_features=False" in full_decision
    assert acc == full_acc
    assert loss == pytest.approx(full_loss, rel=1e-6)


def test_cached_features_in_the_cpu_chunks_score_as_one_pass(monkeypatch):
    """``FineTunedEvaluation`` reads a client's features in the engine's CPU chunks
    (``feature_chunks.feature_chunk_of`` its inputs): at the smallest chunk, 32 samples, an
    80-sample client takes three passes, and every client scores as with one pass. Catches dropping all but
    the first chunk (the features then miss samples and the scores differ) or ignoring the rule."""
    from lightning_fedrep.evaluation import finetuning
    from lightning_fedrep.federation.module import feature_chunks

    one_pass = fine_tuned_metrics(True, HeadlineNet, "sequential")
    chunks = []
    rule = finetuning.feature_chunk_of
    monkeypatch.setattr(feature_chunks, "CPU_FEATURE_CHUNK_BYTES", 1)
    monkeypatch.setattr(
        finetuning,
        "feature_chunk_of",
        lambda device, inputs: chunks.append(rule(device, inputs)) or chunks[-1],
    )
    acc, loss, decision = fine_tuned_metrics(True, HeadlineNet, "sequential")
    assert "caches each client's features" in decision
    assert chunks and set(chunks) == {32}
    assert acc == one_pass[0]
    assert loss == pytest.approx(one_pass[1], rel=1e-6)


class DropoutNet(LossNet):
    def __init__(self):
        super().__init__(dropout=0.5)


@pytest.mark.parametrize(
    ("model", "datamodule", "reason"),
    [
        (DropoutNet, None, "depends on train mode"),
        (BatchNormNet, None, "depends on train mode"),
        (LossNet, noisy_datamodule, "augmented at random"),
        (DoubledNet, None, "not head(features(x))"),
    ],
    ids=["dropout", "batch-norm", "random-transform", "no-split"],
)
def test_without_an_exact_cache_it_runs_the_full_passes_and_says_why(model, datamodule, reason):
    """Catches caching where the features are not a fixed function of the sample: drop the train-mode check
    (dropout or batch norm in the body) or the random-transform check in ``_feature_split`` and the scores
    differ from the full passes' (``cache_features=False``)."""
    acc, loss, decision = fine_tuned_metrics(True, model, "sequential", datamodule)
    assert "runs full forward passes" in decision and reason in decision, decision
    full_acc, full_loss, _ = fine_tuned_metrics(False, model, "sequential", datamodule)
    assert acc == full_acc and loss == full_loss
