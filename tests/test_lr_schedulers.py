"""LR schedulers in a federated fit. A Lightning step is one client's local step (on the vectorized runner,
one step of a group of clients), so a scheduler Lightning steps per training step (``interval="step"``) would
tick across the round's clients: each client would train at another point of the schedule, by its place in
the round. It is refused at setup, on every engine, naming the fix: ``interval="epoch"`` steps once per
round, and every client of a round trains at the same rate."""

from __future__ import annotations

import pytest
import torch

from lightning_fedrep import FederatedStrategy
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

LR, GAMMA = 0.5, 0.5


class ScheduledNet(TinyNet):
    """Plain SGD at ``LR`` with ``ExponentialLR(GAMMA)`` at ``interval``; records the round, the client and the
    learning rate of every training step."""

    fedrep_loss = "cross_entropy"

    def __init__(self, interval: str):
        super().__init__()
        self.interval = interval
        self.seen: list[tuple[int, int, float]] = []

    def training_step(self, batch, batch_idx):
        (client,) = self.trainer.strategy.current_clients
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append((self.current_epoch, client, lr))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


class ManualScheduledNet(ScheduledNet):
    """Manual optimization: the module steps its own scheduler (Lightning steps none), after every step."""

    def __init__(self):
        super().__init__("step")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()
        return loss


def fit(model, runner="sequential", rounds=2):
    strategy = FederatedStrategy(
        head="classifier", algorithm="fedavg", clients_per_round=3, seed=0, runner=runner
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6, batch_size=32))
    return strategy


@pytest.mark.parametrize("runner", ["sequential", "vectorized", "auto"])
def test_a_step_interval_scheduler_is_refused_at_setup_naming_the_fix(runner):
    """Fails on the code before: the sequential runner trained with it, silently ("auto" fell back to it): in
    round 0 the first client (3 steps) trained at 0.5, 0.25, 0.125, the second at 0.0625 .. 0.0156, the third
    at 0.0078 .. 0.0020."""
    model = ScheduledNet("step")
    with pytest.raises(ValueError, match="interval='step'") as refused:
        fit(model, runner)
    assert "'interval': 'epoch'" in str(refused.value) and "ExponentialLR" in str(refused.value)
    assert model.seen == []  # at setup, before any step


def test_an_epoch_interval_scheduler_steps_once_per_round_for_every_client():
    """The fix the refusal names: every client of round ``r`` trains at ``LR * GAMMA**r`` (the reference: the
    closed form of ``ExponentialLR`` stepped once per round)."""
    model = ScheduledNet("epoch")
    strategy = fit(model, rounds=3)
    for r in range(3):
        seen = [(client, lr) for epoch, client, lr in model.seen if epoch == r]
        assert sorted({client for client, _ in seen}) == sorted(strategy.round_plan(r).clients)
        assert [lr for _, lr in seen] == pytest.approx([LR * GAMMA**r] * len(seen))


def test_manual_optimization_steps_its_own_scheduler_and_is_not_refused():
    """Under manual optimization the interval means nothing to Lightning: the module's own ``step()`` calls are
    the schedule (here one per step, as the module chose), and Lightning adds none."""
    model = ManualScheduledNet()
    fit(model, rounds=1)
    lrs = [lr for _, _, lr in model.seen]
    assert len(lrs) > 3
    assert lrs == pytest.approx([LR * GAMMA**k for k in range(len(lrs))])
