"""The official FedRep reference models: sizes, heads, outputs and optimiser."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep.federation.module.split import resolve_split
from lightning_fedrep.models import CIFAR10CNN, CIFAR100CNN, FEMNISTMLP

# (model factory, input shape, total parameters, head name, head parameters) from pfl-libraries.md §4.1
MODELS = [
    (CIFAR10CNN, (3, 32, 32), 307_842, "fc3", 650, 10),
    (CIFAR100CNN, (3, 32, 32), 1_075_044, "fc3", 12_900, 100),
    (FEMNISTMLP, (1, 28, 28), 550_346, "layer_out", 650, 10),
]
IDS = ["cifar10", "cifar100", "femnist"]


@pytest.mark.parametrize("cls, shape, total, head, head_params, classes", MODELS, ids=IDS)
def test_parameter_counts_and_head(cls, shape, total, head, head_params, classes):
    model = cls()
    assert sum(p.numel() for p in model.parameters()) == total
    assert cls.fedrep_head == head
    split = resolve_split(model)
    assert split.head == (f"{head}.weight", f"{head}.bias")
    named = dict(model.named_parameters())
    assert sum(named[n].numel() for n in split.head) == head_params
    assert set(split.body) == set(named) - set(split.head)
    assert split.frozen == ()


def test_official_layer_names():
    assert [n for n, _ in CIFAR10CNN().named_parameters()] == [
        f"{layer}.{kind}" for layer in ("conv1", "conv2", "fc1", "fc2", "fc3") for kind in ("weight", "bias")
    ]
    cifar100 = dict(CIFAR100CNN().named_parameters())
    assert cifar100["conv2.weight"].shape == (128, 64, 5, 5)
    assert cifar100["fc1.weight"].shape == (256, 3200)
    assert cifar100["fc3.weight"].shape == (100, 128)
    mlp = dict(FEMNISTMLP().named_parameters())
    assert [tuple(mlp[f"{n}.weight"].shape) for n in ("layer_input", "layer_hidden1", "layer_hidden2")] == [
        (512, 784),
        (256, 512),
        (64, 256),
    ]


@pytest.mark.parametrize("cls, shape, total, head, head_params, classes", MODELS, ids=IDS)
def test_forward_shapes(cls, shape, total, head, head_params, classes):
    model = cls().eval()
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, classes)
    if cls is not FEMNISTMLP:  # the CNNs output log-probabilities, as the official code
        assert torch.allclose(out.exp().sum(1), torch.ones(3), atol=1e-5)


@pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")
def test_femnist_mlp_output_modes():
    torch.manual_seed(0)
    logits_model = FEMNISTMLP()
    softmax_model = FEMNISTMLP(output="softmax")
    softmax_model.load_state_dict(logits_model.state_dict())
    x = torch.rand(4, 1, 28, 28)
    logits = logits_model(x)
    assert torch.allclose(logits_model(x.flatten(1)), logits)  # flat input works too
    probs = softmax_model(x)
    assert torch.allclose(probs, logits.softmax(1), atol=1e-6)
    y = torch.tensor([0, 1, 2, 3])
    # the official quirk: cross-entropy applied to probabilities (a double softmax)
    loss = softmax_model.training_step((x, y), 0)
    assert torch.allclose(loss, F.cross_entropy(logits.softmax(1), y), atol=1e-6)
    assert not torch.allclose(loss, F.cross_entropy(logits, y))
    with pytest.raises(ValueError, match="logits"):
        FEMNISTMLP(output="probs")


@pytest.mark.parametrize("cls", [CIFAR10CNN, CIFAR100CNN, FEMNISTMLP], ids=IDS)
def test_optimizer_is_the_official_sgd(cls):
    model = cls()
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    decay, no_decay = optimizer.param_groups
    assert decay["lr"] == 0.01 and decay["momentum"] == 0.5
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(not names[id(p)].endswith("bias") for p in decay["params"])
    assert all(names[id(p)].endswith("bias") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)

    custom = cls(lr=0.1, momentum=0.9, weight_decay=0.0).configure_optimizers()
    assert custom.param_groups[0]["lr"] == 0.1 and custom.param_groups[0]["momentum"] == 0.9
    assert custom.param_groups[0]["weight_decay"] == 0.0
    assert cls(lr=0.1).hparams.lr == 0.1  # save_hyperparameters: load_from_checkpoint rebuilds it


def test_cifar100_dropout_only_in_training():
    model = CIFAR100CNN()
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    assert not torch.equal(a, model(x))


class OfficialCNN(torch.nn.Module):
    """The official ``CNNCifar`` (``widths=(64, 120, 64)``, no dropout) and ``CNNCifar100``
    (``widths=(128, 256, 128)``, ``Dropout(0.6)`` before ``fc3``), written out as in ``models/Nets.py``."""

    def __init__(self, widths: tuple[int, int, int], num_classes: int, dropout: float | None):
        super().__init__()
        channels, first, second = widths
        self.conv1 = torch.nn.Conv2d(3, 64, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.conv2 = torch.nn.Conv2d(64, channels, 5)
        self.fc1 = torch.nn.Linear(channels * 5 * 5, first)
        self.fc2 = torch.nn.Linear(first, second)
        self.fc3 = torch.nn.Linear(second, num_classes)
        self.dropout = dropout

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, self.fc1.in_features)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.dropout is not None:
            x = F.dropout(x, self.dropout, self.training)
        return F.log_softmax(self.fc3(x), dim=1)


@pytest.mark.parametrize(
    "cls, widths, classes, dropout",
    [(CIFAR10CNN, (64, 120, 64), 10, None), (CIFAR100CNN, (128, 256, 128), 100, 0.6)],
    ids=["cifar10", "cifar100"],
)
def test_cnns_compute_the_official_networks(cls, widths, classes, dropout):
    """Same weights, same outputs as the official network, in eval mode and (same draws) in train mode."""
    torch.manual_seed(0)
    model = cls()
    official = OfficialCNN(widths, classes, dropout)
    official.load_state_dict(model.state_dict())
    x = torch.randn(5, 3, 32, 32)
    for training in (False, True):
        model.train(training)
        official.train(training)
        torch.manual_seed(1)
        ours = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(ours, official(x))
