"""FedAvgCNN computes PFLlib's FedAvgCNN.

Reference: PFLlib's ``system/flcore/trainmodel/models.py`` ``FedAvgCNN`` (restated below as their module is
written) and its ``BaseHeadSplit`` (``fc`` moved into the head, ``nn.Identity`` in its place), loaded with
the same weights (the parameter names are PFLlib's); and one step of PFLlib's optimizer,
``torch.optim.SGD(model.parameters(), lr=0.005)`` on ``nn.CrossEntropyLoss``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fedrep.models import FedAvgCNN


class ReferenceFedAvgCNN(nn.Module):
    def __init__(self, in_features=1, num_classes=10, dim=1024):
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv2d(in_features, 32, kernel_size=5, padding=0, stride=1, bias=True),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=(2, 2)),
        )
        self.conv2 = nn.Sequential(
            nn.Conv2d(32, 64, kernel_size=5, padding=0, stride=1, bias=True),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=(2, 2)),
        )
        self.fc1 = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        out = self.conv1(x)
        out = self.conv2(out)
        out = torch.flatten(out, 1)
        out = self.fc1(out)
        return self.fc(out)


SETTINGS = [(1, 10, 28, 1024), (3, 10, 32, 1600), (3, 100, 32, 1600)]
IDS = ["fmnist", "cifar10", "cifar100"]


@pytest.mark.parametrize(("channels", "classes", "size", "dim"), SETTINGS, ids=IDS)
def test_same_output_body_and_head_as_pfllib(channels, classes, size, dim):
    torch.manual_seed(0)
    reference = ReferenceFedAvgCNN(channels, classes, dim)
    model = FedAvgCNN(channels, classes, size)
    model.load_state_dict(reference.state_dict())  # PFLlib's parameter names, unchanged
    x = torch.randn(6, channels, size, size)
    assert torch.allclose(model(x), reference(x), atol=1e-6)
    # PFLlib's BaseHeadSplit: base = the model with fc replaced by Identity, head = fc
    head = copy.deepcopy(reference.fc)
    base = reference
    base.fc = nn.Identity()
    assert torch.allclose(model.forward_features(x), base(x), atol=1e-6)
    assert torch.allclose(model.forward_head(model.forward_features(x)), head(base(x)), atol=1e-6)
    assert model.fedrep_head == "fc" and model.fedrep_loss == "cross_entropy"


def test_one_step_of_pfllibs_sgd():
    torch.manual_seed(1)
    reference = ReferenceFedAvgCNN(3, 10, 1600)
    model = FedAvgCNN(3, 10, 32)
    model.load_state_dict(reference.state_dict())
    x, y = torch.randn(10, 3, 32, 32), torch.randint(0, 10, (10,))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.005)
    nn.CrossEntropyLoss()(reference(x), y).backward()
    optimizer.step()
    ours = model.configure_optimizers()
    loss = model.training_step((x, y), 0)
    loss.backward()
    ours.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in ours.param_groups)
    assert ours.param_groups[0]["lr"] == 0.005


def test_too_small_images_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="image_size=12"):
        FedAvgCNN(1, 10, 12)
    with pytest.raises(ValueError, match="num_classes=0"):
        FedAvgCNN(1, 0, 28)
