"""How wide the vectorized runner runs: the memory bound, the measured lane choice of ``runner="auto"``,
and that every width computes what the sequential path computes."""

import logging

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedrep import FederatedStrategy, RunnerSettings
from lightning_fedrep.federation.module import feature_chunks
from lightning_fedrep.runners.lockstep import sizing
from lightning_fedrep.runners.lockstep.group import ClientGroup
from tests.fixtures import quiet_trainer, tiny_datamodule
from tests.test_engine_equivalence import DeclaredNet, LossNet, assert_same
from tests.test_engine_equivalence import fit as run


def fit(runner, rounds=3, algorithm="fedrep", **kwargs):
    return run(runner, rounds=rounds, per_round=5, algorithm=algorithm, **kwargs)[0]


assert_same_federation = assert_same


@pytest.fixture(scope="module")
def sequential():
    return fit("sequential")


def lanes_measured(faster: bool):
    return lambda wide, narrow, device, repeats=3, **kwargs: (faster, 2.0 if not faster else 1.0, 1.5)


def test_body_phase_one_client_at_a_time_equals_sequential(sequential, monkeypatch, caplog):
    monkeypatch.setattr(sizing, "faster_lane_width", lanes_measured(False))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto")
    assert "the other phases one client at a time" in caplog.text
    assert strategy.runner_report.runner == "vectorized" and strategy.lockstep_engine.lane_width == 1
    assert_same_federation(sequential, strategy)


def test_body_phase_in_lockstep_equals_sequential(sequential, monkeypatch, caplog):
    monkeypatch.setattr(sizing, "faster_lane_width", lanes_measured(True))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto")
    assert "the other phases in lockstep" in caplog.text
    assert strategy.runner_settings["lane_width"] is None
    assert_same_federation(sequential, strategy)


def test_auto_runs_sequentially_where_the_engine_gains_nothing(monkeypatch, caplog):
    # FedAvg has no head phase to cache; if lockstep is measured slower there is nothing left to gain
    monkeypatch.setattr(sizing, "faster_lane_width", lanes_measured(False))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("auto", algorithm="fedavg", rounds=1)
    assert strategy.runner_report.runner == "sequential"
    assert "sequential runner (no cached features and no gain in lockstep" in caplog.text


@pytest.mark.parametrize(
    ("settings", "margin"),
    [
        (dict(), 0.0),  # cached head epochs keep the engine, fused: both widths pay Lightning once per phase
        (dict(steps_per_call=1), sizing.LOCKSTEP_MARGIN),  # one-lane calls pay it per client step
        (dict(algorithm="fedavg"), sizing.LOCKSTEP_MARGIN),  # narrow would be the sequential runner
    ],
    ids=["fedrep-fused", "fedrep-unfused", "fedavg"],
)
def test_lockstep_keeps_a_margin_only_where_narrow_lanes_pay_a_cost_the_timing_leaves_out(
    monkeypatch, settings, margin
):
    """Catches the 5% lockstep margin applied where narrow lanes stay fused in the engine (it took lockstep
    for a CIFAR CNN's body epoch measured 1% slower, 15% slower in the round), or dropped where they pay
    Lightning's per-step cost per client step."""
    seen, steps, timed = [], [], []
    step = ClientGroup.step
    monkeypatch.setattr(
        ClientGroup, "step", lambda group, active: steps.append(len(active)) or step(group, active)
    )

    def measured(wide, narrow, device, repeats=3, margin=sizing.LOCKSTEP_MARGIN, **kwargs):
        seen.append(margin)
        wide()
        for work in narrow:
            work()
        timed.extend(steps)
        steps.clear()
        return True, 1.0, 1.0

    monkeypatch.setattr(sizing, "faster_lane_width", measured)
    fit("auto", rounds=1, **{"algorithm": "fedrep", **settings})
    assert seen == [margin]
    assert steps and timed == [5] + [1] * 5  # each timed step includes the optimizer's update


def test_memory_budget_chunks_the_round_into_groups(sequential, caplog):
    unbounded = fit("vectorized", rounds=1)
    params = sum(p.numel() * p.element_size() for p in LossNet().parameters())
    per_client = unbounded.runner_settings["client_bytes"]
    assert per_client > params * (2 + sizing.OPTIMIZER_SLOTS)  # tensors, state, activations, features
    assert unbounded.runner_settings["group_width"] > 5
    budget = 2 * per_client + 1
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy = fit("vectorized", memory=budget)
    assert "groups of up to 2 clients" in caplog.text
    assert strategy.runner_settings["group_width"] == 2
    assert_same_federation(sequential, strategy)


def test_activation_bytes_counts_what_autograd_saves():
    x = torch.randn(7, 5)
    w = torch.randn(5, 3, requires_grad=True)
    # the matmul saves its input x for w's gradient; the sum saves nothing
    assert sizing.activation_bytes(lambda: (x @ w).sum()) == x.numel() * x.element_size()
    assert sizing.group_width(budget=100, per_client=30) == 3
    assert sizing.group_width(budget=10, per_client=30) == 1


class FakeClock:
    """A clock that reads ``now``; the timed work advances it, so timings are exact on a loaded machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def work(self, *seconds: float):
        """A step whose i-th call costs ``seconds[i]`` on this clock."""
        costs = iter(seconds)

        def step() -> None:
            self.now += next(costs)

        return step


@pytest.mark.parametrize(
    ("wide_costs", "faster"),
    [
        ((50.0, 3.0, 2.5), True),
        ((50.0, 3.0, 2.62), True),
        ((50.0, 3.0, 2.65), False),
        ((50.0, 2.7, 3.0), False),
    ],
)
def test_faster_lane_width_times_best_of_repeats_after_a_warm_up(wide_costs, faster):
    """Restated rule: one untimed warm-up of each, then the best of ``repeats`` timings; the wide step wins
    when at most 5% slower (2.62 s vs 2.5 s: within, 2.65 s: not). Catches timing the warm-up
    (``wide()``/``all_narrow()`` before the loop dropped: 50 s counted), ``max`` for ``min`` (3.0 not 2.5), no
    margin (2.62 s lost) and a margin read the wrong way round (``narrow_s * (1 - margin)``)."""
    clock = FakeClock()
    wide = clock.work(*wide_costs)
    narrow = [clock.work(40.0, 1.0, 1.5), clock.work(40.0, 1.5, 1.0)]  # 2.5 s for both, twice
    chosen, wide_s, narrow_s = sizing.faster_lane_width(wide, narrow, torch.device("cpu"), 2, clock=clock)
    assert chosen == faster
    assert (wide_s, narrow_s) == (pytest.approx(min(wide_costs[1:])), pytest.approx(2.5))


def test_faster_lane_width_interleaves_the_two_timings():
    """Each timed repeat runs the wide step and then the narrow ones (a load that comes and goes slows both
    alike); a close call (equal times) runs every repeat. Catches timing every wide repeat before every narrow
    one."""
    clock, calls = FakeClock(), []

    def step(name):
        def run():
            calls.append(name)
            clock.now += 1.0 if name == "w" else 0.5

        return run

    sizing.faster_lane_width(step("w"), [step("n1"), step("n2")], torch.device("cpu"), 3, clock=clock)
    assert calls == ["w", "n1", "n2"] + ["w", "n1", "n2"] * 3


def test_faster_lane_width_estimates_the_narrow_steps_from_a_sample():
    """Restated rule: with more than ``sample + 1`` clients, the first narrow client is an untimed warm-up and
    the next ``sample`` are timed, their time scaled to all clients (20 clients, 3 timed at 1 s each: 20 s);
    the others never run. Catches timing the warm-up client (its 30 s counted), scaling by the wrong count
    (3 s or 60 s) and running every client."""
    clock, ran = FakeClock(), []

    def client(k):
        def run():
            ran.append(k)
            clock.now += 30.0 if k == 0 and ran.count(0) == 1 else 1.0

        return run

    wide = clock.work(99.0, 19.0, 19.0, 19.0)
    chosen, wide_s, narrow_s = sizing.faster_lane_width(
        wide, [client(k) for k in range(20)], torch.device("cpu"), clock=clock, sample=3
    )
    assert (chosen, wide_s, narrow_s) == (True, pytest.approx(19.0), pytest.approx(20.0))
    assert sorted(set(ran)) == [0, 1, 2, 3] and ran.count(0) == 1


@pytest.mark.parametrize(
    ("wide_costs", "timed_repeats", "faster"),
    [
        ((50.0, 1.0, 1.0, 1.0), 1, True),  # lockstep 2x faster: decided after one repeat
        ((50.0, 4.0, 4.0, 4.0), 1, False),  # 2x slower: decided after one repeat
        ((50.0, 2.5, 2.5, 1.9), 3, True),  # within 30%: timed again, the best of three
        ((50.0, 2.5, 1.5, 1.9), 2, True),  # the second repeat is clearly apart: stops there
    ],
)
def test_faster_lane_width_decides_a_clear_gap_after_one_repeat(wide_costs, timed_repeats, faster):
    """Restated rule: after a repeat whose best times are more than ``1 + clear`` (30%) apart either way it
    stops; a closer call is timed again, up to ``repeats``. Catches a gap read one way only (2x slower timed
    three times), an early stop on a close call and a gap taken from the last repeat instead of the best."""
    clock = FakeClock()
    wide = clock.work(*wide_costs)
    narrow = [clock.work(10.0, 1.0, 1.0, 1.0), clock.work(10.0, 1.0, 1.0, 1.0)]  # 2 s a repeat
    chosen, wide_s, _ = sizing.faster_lane_width(wide, narrow, torch.device("cpu"), clock=clock)
    assert chosen == faster
    assert wide_s == pytest.approx(min(wide_costs[1 : timed_repeats + 1]))
    assert clock.now == pytest.approx(
        50.0 + 20.0 + sum(wide_costs[1 : timed_repeats + 1]) + 2.0 * timed_repeats
    )


def test_probe_width_is_a_quarter_unless_that_is_a_small_sample():
    assert sizing.probe_width(100) == 25
    assert sizing.probe_width(33) == 9  # a quarter, rounded up
    assert sizing.probe_width(32) == sizing.probe_width(29) == 8  # a quarter as large as the sample
    assert sizing.probe_width(28) == 28  # a quarter (7) under the sample: the full width at once
    assert sizing.probe_width(20) == 20


@pytest.mark.parametrize(("faster_at_quarter", "widths"), [(False, [8]), (True, [8, 32])])
def test_auto_times_the_full_width_only_where_a_quarter_of_it_gains(
    monkeypatch, caplog, faster_at_quarter, widths
):
    """``auto`` first times a quarter of the first group (8 of 32 clients); where lockstep is slower there it
    runs one client at a time without timing the full width (and says so), else it times the full width and
    that timing decides. Catches a full-width timing always paid, or the quarter's win taken as the answer."""
    timed: list[int] = []

    def measured(wide, narrow, device, repeats=3, **kwargs):
        timed.append(len(narrow))
        return (faster_at_quarter if len(timed) == 1 else False), 3.0, 2.0

    monkeypatch.setattr(sizing, "faster_lane_width", measured)
    torch.manual_seed(0)
    strategy = FederatedStrategy(algorithm="fedavg", clients_per_round=32, seed=5, runner="auto")
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=32, classes_per_client=1, seed=3))
    assert timed == widths
    assert strategy.runner_report.runner == "sequential"  # FedAvg, slower in lockstep: nothing to gain
    said = "slower in lockstep at a quarter of the width, not timed at 32"
    assert (said in caplog.text) == (not faster_at_quarter)


def test_faster_lane_width_defaults_to_the_wall_clock():
    """The public default stays ``time.perf_counter`` (catches a default that times nothing)."""
    import inspect
    import time

    assert inspect.signature(sizing.faster_lane_width).parameters["clock"].default is time.perf_counter


def test_resumed_run_keeps_the_measured_widths(tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "faster_lane_width", lanes_measured(False))
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=8, seed=3)
    kwargs = dict(head="classifier", clients_per_round=5, head_epochs=2, body_epochs=1, seed=5, runner="auto")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1)
    first = FederatedStrategy(**kwargs)
    trainer = quiet_trainer(
        strategy=first, max_epochs=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[checkpoint]
    )
    trainer.fit(LossNet(), datamodule=dm)
    saved = sorted(tmp_path.glob("*.ckpt"))[0]

    monkeypatch.setattr(sizing, "faster_lane_width", lanes_measured(True))  # would choose lockstep now
    resumed = FederatedStrategy(**kwargs)
    trainer = quiet_trainer(strategy=resumed, max_epochs=2, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=8, seed=3), ckpt_path=saved)
    assert resumed.runner_settings["lane_width"] == 1
    for name, value in first.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value)


@pytest.mark.parametrize("value", [0, -5, 1.5, True])
def test_bad_memory_setting_is_refused(value):
    with pytest.raises(ValueError, match="RunnerSettings.memory"):
        FederatedStrategy(head="classifier", runner=RunnerSettings(memory=value))


def test_a_feature_cache_on_a_cpu_reads_chunks_that_hold_half_a_mebibyte_of_input():
    """``feature_chunk``: on a CPU as many samples as hold 512 KiB of input, 32 to 1,024 (a CIFAR image of
    12,288 bytes: 42; a 64-float MLP input: 1,024); on an accelerator always 1,024."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert feature_chunks.feature_chunk(cpu, 3 * 32 * 32 * 4) == (512 << 10) // 12288 == 42
    assert feature_chunks.feature_chunk(cpu, 64 * 4) == feature_chunks.FEATURE_CHUNK == 1024
    assert feature_chunks.feature_chunk(cpu, 10**7) == 32
    assert (
        feature_chunks.feature_chunk(cuda, 3 * 32 * 32 * 4)
        == feature_chunks.feature_chunk(cuda, 10**7)
        == 1024
    )


def test_features_cached_in_small_chunks_equal_the_sequential_path(monkeypatch):
    """A chunk of 32 samples (the smallest) splits the 41-sample client's feature pass in two: the cached
    head epochs still train what the sequential path trains."""
    monkeypatch.setattr(feature_chunks, "CPU_FEATURE_CHUNK_BYTES", 1)
    sequential, _ = run("sequential", data="unequal", model_cls=DeclaredNet, per_round=6)
    chunked, _ = run("vectorized", data="unequal", model_cls=DeclaredNet, per_round=6)
    assert chunked.runner_settings["split"] == "forward_features/forward_head"
    assert chunked._selection.engine.feature_chunk == 32
    assert_same(sequential, chunked)
