"""The runner protocol's per-process wrapper and the round driver, without a Trainer: ``Sharded`` is always
on, so on one process it must be the round itself, and on several it must idle exactly the steps past this
rank's share; ``FederatedRun`` turns a step that trained nothing into what Lightning expects."""

from __future__ import annotations

import torch

from lightning_fedrep.federation.api.algorithm import Phase
from lightning_fedrep.federation.collective import Collective
from lightning_fedrep.federation.plan import plan_round
from lightning_fedrep.federation.run import NOTHING_RAN, CallbackBus, FederatedRun
from lightning_fedrep.runners.sharded import Sharded

SIZES = [7, 41, 13, 22, 30, 9]
PHASES = (Phase("head", epochs=1), Phase("body", epochs=1))


def plan():
    return plan_round(0, list(range(6)), PHASES, SIZES, batch_size=5)


class Recording:
    """A runner that records what the wrapper hands it."""

    vectorized = False

    def __init__(self):
        self.begun: list[tuple[object, int]] = []
        self.stepped = 0

    def schedule(self, plan, own=True):
        return plan

    def open_round(self, plan):
        pass

    def begin_step(self, plan, step):
        self.begun.append((plan, step))

    def loss(self, batch, batch_idx, user_step):
        return user_step()

    def logged_loss(self):
        return ()

    def step(self, optimizer_step, closure):
        self.stepped += 1
        return optimizer_step()

    def end_step(self):
        pass


class Rank(Collective):
    """This process as ``rank`` of ``world`` (no collective is called by the wrapper's schedule)."""

    def __init__(self, rank, world):
        self._rank, self._world = rank, world

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world


def drive(wrapper, p, steps):
    """Run ``steps`` Lightning steps; returns each step's (loss, optimizer output, closure calls)."""
    seen = []
    for step in range(steps):
        calls = []
        wrapper.begin_step(p, step)
        loss = wrapper.loss(None, step, lambda step=step: f"loss {step}")
        out = wrapper.step(lambda: "stepped", lambda calls=calls, step=step: calls.append(step))
        seen.append((loss, out, len(calls)))
    return seen


def test_on_one_process_the_wrapper_is_the_round_itself():
    """Catches the always-on wrapper changing a one-process run (e.g. ``schedule.idle(step)`` replaced by
    ``schedule.idle(step + 1)``: the round's last step would train nothing). Reference: the plan's own
    length and steps, every step handed to the runner with the whole plan, the user's loss and optimizer."""
    p = plan()
    inner = Recording()
    wrapper = Sharded(inner)
    schedule = wrapper.schedule(p)
    assert schedule.length == p.length and schedule.lengths == (p.length,) and schedule.local is p
    seen = drive(wrapper, p, p.length)
    assert inner.begun == [(p, step) for step in range(p.length)]
    assert seen == [(f"loss {step}", "stepped", 0) for step in range(p.length)]


def test_a_rank_with_less_work_idles_after_its_share():
    """Catches idle steps that train or step (e.g. ``Sharded.step`` calling the runner on an idle step: the
    optimizer would step a client twice). Reference: the rule restated — rank r trains the steps of its
    clients (each client's steps in the plan) one after another, then runs the closure alone, returning
    ``NOTHING_RAN`` as its loss, up to the longest rank's count."""
    p = plan()
    lengths = []
    for rank in (0, 1):
        inner = Recording()
        wrapper = Sharded(inner, Rank(rank, 2))
        schedule = wrapper.schedule(p)
        own = sum(p.steps_of(c) for c in schedule.local.clients)
        lengths.append(own)
        seen = drive(wrapper, p, schedule.length)
        assert seen[:own] == [(f"loss {s}", "stepped", 0) for s in range(own)]
        assert seen[own:] == [(NOTHING_RAN, None, 1)] * (schedule.length - own)
        assert inner.stepped == own and [s for _, s in inner.begun] == list(range(own))
    assert sum(lengths) == p.length and lengths[0] != lengths[1]
    assert Sharded(Recording(), Rank(0, 2)).schedule(p).length == max(lengths)


def test_a_step_that_trained_nothing_gives_lightning_a_zero_or_none():
    """Catches ``NOTHING_RAN`` reaching Lightning (e.g. ``return output`` for it in ``FederatedRun.loss``):
    under automatic optimization Lightning needs a loss with a gradient (a zero), under manual ``None``."""
    p = plan()

    class Federation:
        round_open, round_index = True, 0

        def plan(self, round_index, configure):
            return p

    wrapper = Sharded(Recording(), Rank(1, 2))
    zero = lambda: torch.zeros((), requires_grad=True)  # noqa: E731
    run = FederatedRun(Federation(), wrapper, CallbackBus(), zero)
    last = wrapper.schedule(p).length - 1  # rank 1 has the lighter share: its last step is idle
    wrapper.begin_step(p, last)
    automatic = run.loss(None, last, lambda: "loss", True, lambda: False, lambda loss: None)
    assert isinstance(automatic, torch.Tensor) and automatic.item() == 0 and automatic.requires_grad
    assert run.loss(None, last, lambda: "loss", False, lambda: False, lambda loss: None) is None
