"""CENTAUR's models (``lightning_fedrep.models.CENTAURCNN``, ``CENTAURMLP``) against the official code's
(``shenzebang/CENTAUR-Privacy-Federated-Representation-Learning`` @71e092e, ``models/models.py``), restated here
as plain PyTorch: the same layer names and shapes (so the official weights load), the same outputs on the same
weights, the official body/head split, and the engine's probe accepting them (the recipes keep the engine)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.models import CENTAURCNN, CENTAURMLP
from lightning_fedrep.runners.lockstep.probe import loss_label, probe_problem


class OfficialCNN(nn.Module):
    """The official ``CNNCifar10`` (fc 384, 32) / ``CNNCifar100`` (fc 128, 32) forward, without ``args``."""

    def __init__(self, num_classes: int, fc1: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, fc1)
        self.fc2 = nn.Linear(fc1, 32)
        self.fc3 = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 64 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class OfficialMLP(nn.Module):
    """The official EMNIST ``MLP`` forward."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer_input = nn.Linear(784, 256)
        self.relu = nn.ReLU()
        self.layer_hidden1 = nn.Linear(256, 128)
        self.layer_hidden2 = nn.Linear(128, 16)
        self.layer_out = nn.Linear(16, num_classes)

    def forward(self, x):
        x = x.view(-1, x.shape[1] * x.shape[-2] * x.shape[-1])
        x = self.relu(self.layer_input(x))
        x = self.relu(self.layer_hidden1(x))
        x = self.relu(self.layer_hidden2(x))
        return self.layer_out(x)


def count(module: nn.Module, head: str) -> tuple[int, int]:
    """(body, head) parameter counts."""
    body = sum(p.numel() for n, p in module.named_parameters() if not n.startswith(head))
    return body, sum(p.numel() for n, p in module.named_parameters() if n.startswith(head))


@pytest.mark.parametrize(
    ("num_classes", "hidden", "sizes"),
    [(10, (384, 32), (734_432, 330)), (100, (128, 32), (316_384, 3_300))],
    ids=["cifar10", "cifar100"],
)
def test_centaur_cnn_is_the_official_cnn(num_classes, hidden, sizes):
    """Catches a width, layer order or activation off the official CNN: its state dict loads into ours and
    both give the same class scores (ours as log-probabilities)."""
    torch.manual_seed(0)
    official = OfficialCNN(num_classes, hidden[0])
    ours = CENTAURCNN(num_classes=num_classes, hidden=hidden)
    ours.load_state_dict(official.state_dict())
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(ours(x), F.log_softmax(official(x), dim=1))
    assert ours.fedrep_head == "fc3" and count(ours, "fc3") == sizes
    assert (ours.hparams.momentum, ours.hparams.weight_decay, ours.hparams.lr) == (0.9, 1e-4, 0.01)


def test_centaur_mlp_is_the_official_mlp():
    torch.manual_seed(0)
    official = OfficialMLP()
    ours = CENTAURMLP()
    ours.load_state_dict(official.state_dict())
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(ours(x), official(x))
    torch.testing.assert_close(ours(x.flatten(1)), official(x))
    assert ours.fedrep_head == "layer_out" and count(ours, "layer_out") == (235_920, 170)


def test_centaur_models_pass_the_engines_probe():
    """They declare what their ``training_step`` computes, so the recipes keep the vectorized runner."""
    g = torch.Generator().manual_seed(0)
    cases = [
        (CENTAURCNN(), torch.randn(8, 3, 32, 32, generator=g)),
        (CENTAURCNN(num_classes=100, hidden=(128, 32)), torch.randn(8, 3, 32, 32, generator=g)),
        (CENTAURMLP(), torch.randn(8, 1, 28, 28, generator=g)),
    ]
    for module, x in cases:
        y = torch.randint(0, module.hparams.num_classes, (8,), generator=g)
        loss = declared_loss(module)
        assert loss is not None, type(module).__name__
        problem = probe_problem(module, loss, loss_label(module.fedrep_loss), [((x, y), 0, "a batch")])
        assert problem is None, (type(module).__name__, problem)
