"""Fused lockstep (``RunnerSettings.steps_per_call``): one Lightning step runs several lockstep steps of a phase.

The reference is the unfused engine (``steps_per_call=1``: one lockstep step per Lightning step) on
the same batches, itself checked against the sequential path and plain loops in ``test_engine.py`` and the
algorithms' golden tests: fused calls must give the same tensors bit for bit, the same logged loss and the
same kept optimizer state, with ``global_step`` counting calls.
"""

from __future__ import annotations

import logging
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, Timer
from lightning.pytorch.loggers import CSVLogger

from lightning_fedrep.runners.lockstep import sizing
from lightning_fedrep.runners.lockstep.engine import over_lanes
from tests.test_engine import DeclaredNet, Net, assert_kept_states_equal, assert_same, fit

FUSED_CASES = {
    "fedrep": dict(algorithm="fedrep"),  # head epochs on cached features, then the body epoch
    "fedrep-groups-of-2": dict(algorithm="fedrep", width=2),
    "fedrep-keep-adam": dict(algorithm="fedrep", client_optimizer_state="keep", model="adam"),
    "fedavg": dict(algorithm="fedavg"),
    "lg_fedavg": dict(algorithm="lg_fedavg"),
    "fedprox": dict(algorithm="fedprox"),  # a loss term inside the vmap
    "scaffold": dict(algorithm="scaffold"),  # declared tensors, gradient transforms
    "per_fedavg": dict(algorithm="per_fedavg"),  # a step rule writing client state each step
}


def fused_fit(steps_per_call, case, **kwargs):
    settings = dict(case)
    optimizer = settings.pop("model", "sgd")
    return fit(
        "vectorized",
        model=lambda: Net(optimizer=optimizer),
        steps_per_call=steps_per_call,
        **settings,
        **kwargs,
    )


def assert_same_run(expected, expected_trainer, got, got_trainer):
    assert_same(expected, got, exact=True)
    assert_kept_states_equal(expected, got)
    assert torch.equal(
        got_trainer.callback_metrics["train/loss"], expected_trainer.callback_metrics["train/loss"]
    )
    assert [r["clients"] for r in got.history] == [r["clients"] for r in expected.history]


@pytest.mark.parametrize("steps_per_call", ["auto", 3])
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_calls_equal_one_lockstep_step_per_lightning_step(case, steps_per_call):
    """Catches a fused call that skips or repeats a lockstep step, steps a client in a call's last step twice,
    masks the wrong clients after the first step of a call, or draws another batch than the unfused step."""
    unfused, unfused_trainer = fused_fit(1, FUSED_CASES[case])
    fused, fused_trainer = fused_fit(steps_per_call, FUSED_CASES[case])
    assert_same_run(unfused, unfused_trainer, fused, fused_trainer)

    engine = fused.lockstep_engine
    schedules = [engine.schedule(fused.round_plan(r)) for r in range(3)]
    lengths = [s.length for s in schedules]
    if steps_per_call == "auto":
        assert fused.runner_settings["steps_per_call"] is None
        assert lengths == [len(s.segments) for s in schedules]  # one call per phase of a group
    else:
        assert lengths == [sum(math.ceil(g.length / 3) for g in s.segments) for s in schedules]
    assert fused_trainer.global_step == sum(lengths)
    assert unfused_trainer.global_step == sum(s.lockstep_steps for s in schedules)


def test_fused_calls_of_one_client_at_a_time_equal_unfused(monkeypatch):
    """``auto``'s one-client lanes (uncached phases one client at a time, fused per lane). Catches a call
    that runs past its lane's segment into the next client's."""
    monkeypatch.setattr(sizing, "faster_lane_width", lambda *args, **kwargs: (False, 2.0, 1.0))
    unfused, unfused_trainer = fit("auto", steps_per_call=1)
    fused, fused_trainer = fit("auto")
    assert fused.runner_settings["lane_width"] == 1 and fused.runner_settings["steps_per_call"] is None
    assert_same_run(unfused, unfused_trainer, fused, fused_trainer)
    plans = [fused.round_plan(r) for r in range(3)]
    # one call for the group's head epochs on cached features, then one per client's body epoch
    assert fused_trainer.global_step == sum(1 + len(p.work) for p in plans)


class BatchCounter(L.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1


class BatchHookNet(Net):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


PER_STEP_NEEDS = {
    "max_steps": (dict(trainer=dict(max_steps=1000)), "max_steps=1000 counts Lightning steps"),
    "val_check_interval": (
        dict(trainer=dict(val_check_interval=0.5, limit_val_batches=None)),
        "val_check_interval=0.5 validates inside a round",
    ),
    "step checkpoints": (
        dict(trainer=dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(every_n_train_steps=50)])),
        "ModelCheckpoint saves inside a round (every 50)",
    ),
    "a per-batch callback": (
        dict(trainer=dict(callbacks=[BatchCounter()])),
        "BatchCounter acts per training step (on_train_batch_end)",
    ),
    "a per-batch module hook": (dict(model=BatchHookNet), "BatchHookNet acts per training step"),
}


@pytest.mark.parametrize("need", sorted(PER_STEP_NEEDS))
def test_what_acts_per_step_keeps_auto_unfused_and_refuses_a_fused_count(need, caplog, tmp_path):
    """Catches fusing where something counts or hooks Lightning steps as local steps (it would see one call
    for a whole phase), and a silently ignored explicit count."""
    kwargs, reason = PER_STEP_NEEDS[need]
    kwargs = {**kwargs, "trainer": {"default_root_dir": tmp_path, **kwargs.get("trainer", {})}}
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, trainer = fit("vectorized", **kwargs)
    assert strategy.runner_settings["steps_per_call"] == 1
    assert f"one lockstep step per Lightning step ({reason}" in " ".join(caplog.messages)
    engine = strategy.lockstep_engine
    assert trainer.global_step == sum(
        engine.schedule(strategy.round_plan(r)).lockstep_steps for r in range(3)
    )
    with pytest.raises(
        ValueError, match=f"RunnerSettings\\(steps_per_call=4\\) runs 4 lockstep steps.*{reason[:20]}"
    ):
        fit("vectorized", steps_per_call=4, **kwargs)


def test_display_clock_and_lr_callbacks_and_epoch_checkpoints_leave_auto_fused(tmp_path):
    """The progress bar, ``Timer``, ``LearningRateMonitor`` and a round-end ``ModelCheckpoint`` do not count
    local steps: ``auto`` fuses with them. Catches a too-wide per-step check (every callback overriding a
    batch hook)."""
    callbacks = [Timer(duration="00:01:00:00"), LearningRateMonitor(), ModelCheckpoint(dirpath=tmp_path)]
    logger = CSVLogger(tmp_path)
    trainer = dict(callbacks=callbacks, enable_checkpointing=True, enable_progress_bar=True, logger=logger)
    strategy, _ = fit("vectorized", trainer=trainer)
    assert strategy.runner_settings["steps_per_call"] is None


class FirstBatchNote(BatchCounter):
    """Counts batches like :class:`BatchCounter` but declares that a fused call does not change what it
    means (``acts_per_local_step = False``), as the command's ``RunStart`` does."""

    acts_per_local_step = False


def test_a_callback_that_declares_it_does_not_count_local_steps_leaves_auto_fused():
    """Catches the declaration ignored (the command's ``RunStart``, which notes the first batch, made every
    run of ``lightning-fedrep`` unfused: one Lightning step per local step) and a fused run that skips the
    callback's hooks (it still sees every call)."""
    note = FirstBatchNote()
    strategy, trainer = fit("vectorized", trainer=dict(callbacks=[note]))
    assert strategy.runner_settings["steps_per_call"] is None
    assert note.batches == trainer.global_step > 0


def test_the_commands_run_start_note_leaves_auto_fused():
    from lightning_fedrep.app.cli import RunStart

    strategy, _ = fit("vectorized", trainer=dict(callbacks=[RunStart()]))
    assert strategy.runner_settings["steps_per_call"] is None


def test_a_smoke_run_is_never_fused():
    strategy, trainer = fit("vectorized", steps_per_call=4, trainer=dict(fast_dev_run=True))
    assert strategy.runner_settings["steps_per_call"] == 1 and trainer.global_step == 1


RESUME = dict(algorithm="fedrep", client_optimizer_state="keep")


def test_a_fused_run_resumes_at_a_round_end_as_the_uninterrupted_one(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit("vectorized", trainer=dict(enable_checkpointing=True, callbacks=[saver]), rounds=1, **RESUME)
    resumed, _ = fit("vectorized", ckpt_path=tmp_path / "epoch=0.ckpt", **RESUME)
    whole, _ = fit("vectorized", **RESUME)
    assert resumed.runner_settings["steps_per_call"] is None
    assert_same(whole, resumed, exact=True)
    assert_kept_states_equal(whole, resumed)


def test_a_mid_round_unfused_checkpoint_resumes_its_round_unfused_then_fuses(tmp_path):
    """A checkpoint written inside a round by an unfused run (its loader position counts lockstep steps)
    resumed by a run that fuses: the open round keeps one lockstep step per Lightning step, later rounds
    fuse. Catches resuming the open round with fused calls (the position would skip most of the round)."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    fit("vectorized", trainer=dict(enable_checkpointing=True, callbacks=[saver], max_steps=5), **RESUME)
    resumed, trainer = fit("vectorized", ckpt_path=tmp_path / "step=5.ckpt", **RESUME)
    whole, _ = fit("vectorized", **RESUME)
    assert_same(whole, resumed, exact=True)
    assert_kept_states_equal(whole, resumed)
    engine = resumed.lockstep_engine
    schedules = [engine.schedule(resumed.round_plan(r)) for r in range(3)]
    assert not schedules[0].fused and schedules[1].fused and schedules[2].fused
    assert trainer.global_step == schedules[0].lockstep_steps + schedules[1].length + schedules[2].length


class HeadReadsBodyNet(Net):
    """A declared split whose head also reads a body tensor."""

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, features):
        return self.classifier(features) + self.body[0].bias.sum()

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


@pytest.mark.parametrize("model", ["declared", "head_reads_body"])
def test_a_cached_head_step_hands_the_head_only_what_it_reads(model):
    """A cached head step passes the head only the tensors it was seen to read on the probe (fewer tensors
    batched); a head that reads the body gets every tensor. Catches trusting a declared ``forward_head`` to
    read only the head (its body term would then come from the live module, not the client's rows)."""
    net = DeclaredNet if model == "declared" else HeadReadsBodyNet
    sequential, _ = fit("sequential", model=net)
    vectorized, _ = fit("vectorized", model=net)
    reads = vectorized.lockstep_engine.split.head_reads
    assert reads == (frozenset({"classifier.weight", "classifier.bias"}) if model == "declared" else None)
    assert_same(sequential, vectorized)


def test_one_lane_runs_its_row_without_vmap_and_equals_vmap():
    """``over_lanes(fn, 1)`` (no ``vmap``) gives what ``vmap(fn)`` gives on one lane: dict inputs, a 0-dim
    client id, a tuple output each with its lane dimension back, and gradients on the lanes' leaves."""

    def fn(tensors, x, client):
        out = torch.nn.functional.conv2d(x, tensors["w"]) + tensors["b"].view(1, -1, 1, 1)
        return out.square().mean() * (1 + client), out.flatten(1).sum(1)

    g = torch.Generator().manual_seed(0)
    x, client = torch.randn(1, 4, 3, 8, 8, generator=g), torch.tensor([2])
    results = []
    for run in (torch.func.vmap(fn), over_lanes(fn, 1)):
        leaves = {
            "w": torch.randn(1, 5, 3, 3, 3, generator=torch.Generator().manual_seed(1)),
            "b": torch.randn(1, 5, generator=torch.Generator().manual_seed(2)),
        }
        leaves = {n: t.requires_grad_(True) for n, t in leaves.items()}
        loss, per_sample = run(leaves, x, client)
        loss.sum().backward()
        results.append((loss.detach(), per_sample.detach(), {n: t.grad for n, t in leaves.items()}))
    (vmapped, direct) = results
    assert direct[0].shape == (1,) and direct[1].shape == (1, 4)
    torch.testing.assert_close(direct[0], vmapped[0])
    torch.testing.assert_close(direct[1], vmapped[1])
    for n in ("w", "b"):
        torch.testing.assert_close(direct[2][n], vmapped[2][n])
