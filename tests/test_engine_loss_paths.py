"""How the engine turns outputs into each client's loss, and how it runs a module on given tensors.

A named per-sample loss (``fedrep_loss="cross_entropy"`` or ``"mse"``) runs once on every lane's samples
(``lane_mean_losses``); a loss of the user's own runs per lane inside the ``vmap``. References: a plain
per-client loop over the unmasked samples, and the sequential path. ``stateless_call`` skips
``functional_call``'s tied-weights walk only where the module ties nothing: checked against
``functional_call``'s default on a module that ties its head to its embedding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep.federation.module.losses import cross_entropy_per_sample, mse_per_sample
from lightning_fedrep.federation.module.stateless import has_tied_tensors, stateless_call
from lightning_fedrep.runners.lockstep.engine import PER_SAMPLE_LOSSES, lane_mean_losses
from tests.test_engine import Net, assert_same, fit


@pytest.mark.parametrize("name", ["cross_entropy", "mse"])
def test_lane_mean_losses_are_each_clients_mean_over_its_real_samples(name):
    """Catches a mean over the padding too, a sum over the wrong dimension, or a lane's loss mixed into
    another's: each lane's value is the plain mean of its unmasked samples' losses (0 for a lane with none)."""
    g = torch.Generator().manual_seed(0)
    lanes, batch, classes = 4, 6, 5
    outputs = torch.randn(lanes, batch, classes, generator=g)
    if name == "cross_entropy":
        loss_fn, targets = cross_entropy_per_sample, torch.randint(0, classes, (lanes, batch), generator=g)
    else:
        loss_fn, targets = mse_per_sample, torch.randn(lanes, batch, classes, generator=g)
    real = torch.tensor([6, 3, 0, 1])
    mask = (torch.arange(batch) < real[:, None]).float()
    got = lane_mean_losses(loss_fn, outputs, targets, mask)
    expected = []
    for k in range(lanes):
        n = int(real[k])
        expected.append(loss_fn(outputs[k, :n], targets[k, :n]).mean() if n else torch.tensor(0.0))
    torch.testing.assert_close(got, torch.stack(expected))
    assert loss_fn in PER_SAMPLE_LOSSES


def smoothed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A per-sample loss of the user's own (label smoothing): the engine runs it per lane."""
    return F.cross_entropy(output, target, reduction="none", label_smoothing=0.1)


class OwnLossNet(Net):
    fedrep_loss = staticmethod(smoothed_cross_entropy)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return smoothed_cross_entropy(self(x), y).mean()


@pytest.mark.parametrize("model", [Net, OwnLossNet], ids=["named", "own"])
def test_named_and_own_losses_train_what_the_sequential_path_trains(model):
    """Catches the all-lanes loss applied to a loss it must not take, or computing other values than the
    per-lane ``vmap`` did: the engine's clients and global model equal the sequential path's (FedRep: cached
    head epochs and the body epoch)."""
    sequential, _ = fit("sequential", model=model)
    vectorized, _ = fit("vectorized", model=model)
    assert vectorized.runner_report.runner == "vectorized"
    assert (vectorized.lockstep_engine.loss_fn in PER_SAMPLE_LOSSES) == (model is Net)
    assert_same(sequential, vectorized)


class TiedNet(nn.Module):
    """An embedding whose weight the output layer shares (a language model's tied head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.embed(tokens))


def test_stateless_call_keeps_tied_weights_tied_and_equals_functional_call():
    """Catches skipping the tie walk on a module that ties tensors: given one name of a tied pair, both uses
    must read the given tensor, as ``functional_call``'s default does; an untied module gives the same as
    the default too."""
    torch.manual_seed(0)
    tied, plain = TiedNet(), nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert has_tied_tensors(tied) and not has_tied_tensors(plain)
    tokens = torch.tensor([[1, 2, 3]])
    new_weight = torch.randn(7, 4)
    expected = torch.func.functional_call(tied, {"embed.weight": new_weight}, (tokens,))
    got = stateless_call(tied)({"embed.weight": new_weight}, tokens)
    assert torch.equal(got, expected)
    assert torch.equal(got, F.linear(F.embedding(tokens, new_weight), new_weight))  # both uses read it
    x = torch.randn(5, 3)
    tensors = {n: torch.randn_like(p) for n, p in plain.named_parameters()}
    assert torch.equal(stateless_call(plain)(tensors, x), torch.func.functional_call(plain, tensors, (x,)))
