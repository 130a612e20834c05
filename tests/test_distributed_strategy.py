"""The multi-process strategy without processes: its names, its arguments, how recipes select it, and
the single-device strategy refusing several devices (the runs themselves: ``test_distributed.py``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedrep import ALGORITHMS, FederatedDDPStrategy, FederatedStrategy
from lightning_fedrep.app.cli import build_cli
from tests.fixtures import TinyNet, tiny_datamodule

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits" / "fedrep.yaml"


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_has_a_ddp_strategy_name(algorithm):
    trainer = L.Trainer(strategy=f"{algorithm}_ddp", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is FederatedDDPStrategy
    assert trainer.strategy.algorithm.name == algorithm
    assert trainer.world_size == 2
    assert f"{algorithm}_ddp" in StrategyRegistry


def test_process_group_timeout_is_seconds_or_a_timedelta():
    assert FederatedDDPStrategy(timeout=12)._timeout == timedelta(seconds=12)
    assert FederatedDDPStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        FederatedDDPStrategy(timeout=0)
    with pytest.raises(ValueError, match="algorithm"):
        FederatedDDPStrategy(algorithm="no_such_algorithm")


def test_a_recipe_runs_on_several_processes_by_naming_the_ddp_class():
    """The multi-process command of docs/distributed.md: the recipe's federated settings carry over to the DDP class."""
    cli = build_cli(
        [
            "--config",
            str(RECIPE),
            "--trainer.strategy.class_path=lightning_fedrep.FederatedDDPStrategy",
            "--trainer.devices=2",
            "--trainer.logger=false",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is FederatedDDPStrategy
    assert strategy.algorithm.name == "fedrep"
    assert strategy.config.clients_per_round == 0.5
    assert [p.train for p in strategy.config.phases] == ["head", "body"]
    assert cli.trainer.world_size == 2


def test_the_single_device_strategy_refuses_several_devices():
    trainer = L.Trainer(
        strategy=FederatedStrategy(head="classifier"),
        accelerator="cpu",
        devices=2,
        logger=False,
        max_epochs=1,
    )
    with pytest.raises(
        ValueError, match="runs on one device, but the Trainer was given devices=2.*fedrep_ddp"
    ):
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())
