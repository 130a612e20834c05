"""Issue 25 item 6: an algorithm registered after import is a strategy name, and ``strategy.runner_report``
says which engine ran, why and when it was decided (checked against the log line, Lightning's step count
and the known fallbacks)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_fedrep import (
    ALGORITHMS,
    Algorithm,
    FederatedDDPStrategy,
    FederatedStrategy,
    RunnerReport,
    register_algorithm,
)
from tests.test_engine import SMALL, fit


def _unregister(name: str) -> None:
    ALGORITHMS.pop(name, None)
    for key in (name, f"{name}_ddp"):
        if key in StrategyRegistry and StrategyRegistry[key]["strategy"] in (
            FederatedStrategy,
            FederatedDDPStrategy,
        ):
            StrategyRegistry.pop(key)


@pytest.fixture
def myalgo() -> Iterator[Algorithm]:
    algorithm = register_algorithm(Algorithm("myalgo", {"body"}, "My algorithm: the body is averaged."))
    yield algorithm
    _unregister("myalgo")


def test_an_algorithm_registered_after_import_is_a_strategy_name(myalgo):
    """Catches ``register_algorithm`` not telling Lightning's registry (``on_register`` dropped from
    ``lightning_fedrep/__init__.py``): ``Trainer(strategy="myalgo")`` then raises."""
    trainer = L.Trainer(strategy="myalgo", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is FederatedStrategy and trainer.strategy.algorithm.name == "myalgo"
    ddp = L.Trainer(
        strategy="myalgo_ddp", accelerator="cpu", devices=2, logger=False
    )  # constructs, launches nothing
    assert type(ddp.strategy) is FederatedDDPStrategy and ddp.strategy.algorithm.name == "myalgo"
    assert StrategyRegistry["myalgo"]["description"] == myalgo.description


def test_a_name_lightning_uses_stays_lightnings_and_says_so():
    """Catches a silent clash: an algorithm named ``"ddp"`` is usable as ``FederatedStrategy(algorithm="ddp")``,
    ``Trainer(strategy="ddp")`` stays Lightning's DDP, and a warning says so."""
    try:
        with pytest.warns(
            UserWarning, match=r"Trainer\(strategy='ddp'\) keeps naming Lightning's DDPStrategy"
        ):
            register_algorithm(Algorithm("ddp", {"body"}, "clash"))
        assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
        assert FederatedStrategy(algorithm="ddp", head="classifier").algorithm.name == "ddp"
    finally:
        _unregister("ddp")


def _engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_fedrep: ")]


def test_runner_report_of_the_sequential_setting(caplog):
    """Catches ``build_engine`` not reporting ``runner="sequential"`` (the report stays ``None``)."""
    assert FederatedStrategy(head="classifier").runner_report is None  # before setup
    strategy, trainer = fit("sequential", **SMALL)
    report = strategy.runner_report
    assert (report.runner, report.reason, report.decided_at) == ("sequential", "runner='sequential'", "setup")
    assert set(report.phases) == {"head", "body", "all"}
    assert all(how.startswith("sequential") for how in report.phases.values())
    assert trainer.global_step == strategy.round_plan(0).length  # one client step per Lightning step


def test_runner_report_of_a_fallback_names_its_reason(caplog):
    """Catches the report not following a fallback at setup (``decide`` dropped before ``return None`` in
    ``build_engine``): ``on_client_error="skip"`` needs each client's own steps."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, trainer = fit("auto", on_client_error="skip", **SMALL)
    report = strategy.runner_report
    assert report.runner == "sequential" and report.decided_at == "setup"
    assert "on_client_error='skip'" in report.reason
    assert _engine_lines(caplog) == [f"lightning_fedrep: sequential runner ({report.reason})."]
    assert trainer.global_step == strategy.round_plan(0).length


def test_runner_report_of_the_vectorized_engine(caplog):
    """Catches the report left at setup's provisional answer (``decide`` not passed to ``start_engine``):
    the decision is the first loader's, with the head phase on cached features."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        strategy, trainer = fit("auto", **SMALL)
    report = strategy.runner_report
    assert report.runner == "vectorized" and report.decided_at == "first loader"
    assert _engine_lines(caplog) == [f"lightning_fedrep: vectorized runner ({report.reason})."]
    assert trainer.global_step < strategy.round_plan(0).length  # clients really ran in lockstep
    assert "cached features" in report.phases["head"] and "cached" not in report.phases["body"]
    assert str(report).startswith("vectorized runner (head phases on cached features")


def test_runner_report_of_a_run_resumed_from_a_sequential_checkpoint(tmp_path):
    """Catches the report left at setup's provisional "vectorized" when a resumed ``runner="auto"`` run keeps
    the sequential path of the run that wrote the checkpoint (``_decide_engine`` dropped from
    ``FederatedStrategyMixin.load_checkpoint``'s fallback)."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    small = {**SMALL, "rounds": 2}
    fit("sequential", trainer=dict(enable_checkpointing=True, callbacks=[saver]), **{**small, "rounds": 1})
    strategy, trainer = fit("auto", ckpt_path=tmp_path / "epoch=0.ckpt", **small)
    report = strategy.runner_report
    assert (report.runner, report.decided_at) == ("sequential", "checkpoint")
    assert trainer.global_step == strategy.round_plan(0).length + strategy.round_plan(1).length


def test_runner_report_is_read_only():
    report = RunnerReport.sequential("runner='sequential'", "setup")
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.runner = "vectorized"  # type: ignore[misc]
    with pytest.raises(TypeError):
        report.phases["head"] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        FederatedStrategy(head="classifier").runner_report = report  # type: ignore[misc]
