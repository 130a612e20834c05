"""``lightning-fedrep``: the LightningCLI command that runs recipe YAMLs.

    lightning-fedrep fit --config recipes/digits/fedrep.yaml
    lightning-fedrep test --config recipes/digits/fedrep.yaml --ckpt_path runs/.../last.ckpt
    lightning-fedrep fit --config recipes/digits/fedrep.yaml --print_config

Models and data modules are chosen by ``class_path`` (any LightningModule and any
``FederatedDataModule``), the strategy by ``trainer.strategy`` (a ``class_path`` with its
``init_args``, or a registered name such as ``fedrep``). W&B runs offline unless you are logged in.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_fedrep  # noqa: F401  (registers the strategy names)
from lightning_fedrep.callbacks.summary import RunSummary
from lightning_fedrep.data.module import FederatedDataModule


def wandb_credentials_present() -> bool:
    """Whether W&B could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def check_strategy_name(name: str) -> None:
    """Refuse a strategy name neither Lightning nor this package registered, listing this package's."""
    if name in StrategyRegistry or name == "auto":
        return
    ours = sorted(
        n
        for n in StrategyRegistry
        if StrategyRegistry[n]["strategy"].__module__.startswith("lightning_fedrep")
    )
    close = difflib.get_close_matches(name, list(StrategyRegistry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    sys.stderr.write(
        f"lightning-fedrep: error: trainer.strategy={name!r} is not a registered strategy.{hint} This package's: "
        f"{', '.join(ours)} (or class_path: lightning_fedrep.FederatedStrategy); Lightning's: "
        f"{', '.join(sorted(n for n in StrategyRegistry if n not in ours and 'find_unused' not in n))}.\n"
    )
    raise SystemExit(2)


def configuration_error(error: BaseException) -> str:
    """The cause of a failed instantiation: jsonargparse reports a class's own error among the union's
    alternatives ("Expected a <class 'str'>", ...); keep only the class's."""
    lines = [line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- ")]
    causes = [
        line
        for line in lines
        if not line.startswith(("Expected a", "Not a valid subclass", "Problem with given class_path"))
    ]
    return "; ".join(causes) if causes else str(error).splitlines()[0]


class LogConfigCallback(SaveConfigCallback):
    """Saves ``config.yaml`` in the run folder (Lightning's behaviour) and also sends the whole run
    configuration (strategy, data, model, trainer) to every logger, so W&B shows it."""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = self.config.as_dict() if hasattr(self.config, "as_dict") else dict(self.config)
        config.pop("config", None)
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class FedRepCLI(LightningCLI):
    """LightningCLI whose data modules are ``FederatedDataModule`` subclasses; hands the run's
    configuration to ``RunSummary`` so ``summary.json`` records it."""

    def before_instantiate_classes(self) -> None:
        if "WANDB_MODE" not in os.environ and not wandb_credentials_present():
            os.environ["WANDB_MODE"] = "offline"  # never block on the network
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy") if hasattr(config, "get") else None
        if isinstance(strategy, str):
            check_strategy_name(strategy)

    @override
    def instantiate_classes(self) -> None:
        """Build the configured objects; a bad value stops the command with its cause on one line (not a
        traceback through the parser), unless ``LIGHTNING_FEDREP_TRACEBACK=1``."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            if os.environ.get("LIGHTNING_FEDREP_TRACEBACK") == "1":
                raise
            sys.stderr.write(
                f"lightning-fedrep: error: the configuration is not valid: {configuration_error(error)}\n"
                "(set LIGHTNING_FEDREP_TRACEBACK=1 for the full traceback)\n"
            )
            raise SystemExit(2) from None

    def _attach_config(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunSummary):
                callback.config = config.clone().as_dict() if hasattr(config, "as_dict") else dict(config)

    def before_fit(self) -> None:
        self._attach_config()

    def before_test(self) -> None:
        self._attach_config()

    def before_validate(self) -> None:
        self._attach_config()


def build_cli(args: ArgsType = None, run: bool = True) -> FedRepCLI:
    """Parse ``args`` (the command line by default), build and, with ``run``, execute the subcommand."""
    return FedRepCLI(
        L.LightningModule,
        FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=LogConfigCallback,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-fedrep`` console script."""
    build_cli(args)


if __name__ == "__main__":
    main()
