"""Where the ``lightning-fedrep`` command puts a run: one folder per run holding everything it writes.

    <trainer.default_root_dir>/<run name>/<run id>/
        config.yaml               the command's configuration (a later call into the folder writes
                                  config.<subcommand>.yaml, config.<subcommand>.2.yaml, ...)
        checkpoints/              every ModelCheckpoint without its own dirpath
        summary.json              RunSummary after fit (summary.validate.json, summary.test.json after those)
        history.csv, clients.csv, participation.csv, partition.csv, clients_<stage>.csv
        figures/*.png
        wandb/                    W&B's offline files (the W&B run id is the run id)

The run name is the W&B run's ``name`` (``digits-fedrep``) or the first config file's stem; the run id
is the start time (``20261124-194500``). A command given ``--ckpt_path`` inside a run folder
(``<run>/checkpoints/x.ckpt``) continues or evaluates that run, so it writes into that folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
_LOGGER_DIRS = {"WandbLogger", "TensorBoardLogger", "CSVLogger"}


def folder_of_checkpoint(checkpoint: str | Path | None) -> Path | None:
    """The run folder a checkpoint belongs to (``<run>/checkpoints/x.ckpt`` with ``<run>/config.yaml``)."""
    if checkpoint is None or str(checkpoint) in ("best", "last", "hpc", "registry"):
        return None
    path = Path(checkpoint)
    if path.parent.name == CHECKPOINTS and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    return None


def new_run_folder(root: Path, name: str) -> Path:
    """A folder for a new run under ``root/name``, named by the start time (never an existing one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = root / name / stamp, 1
    while folder.exists():
        n += 1
        folder = root / name / f"{stamp}-{n}"
    folder.mkdir(parents=True)
    return folder


def run_name(config: Any) -> str:
    """The W&B run's name if the configuration sets one, else the first config file's stem, else ``run``."""
    for logger in _loggers(config.trainer.get("logger")):
        name = _init_args(logger).get("name")
        if _class_name(logger) == "WandbLogger" and name:
            return str(name)
    files = config.get("config") or []
    return Path(str(files[0])).stem if files else "run"


def place_run(config: Any, folder: Path, resumed: bool) -> None:
    """Point the configuration's Trainer and loggers at ``folder`` (before anything is built; absolute, as
    W&B's service process resolves relative paths from its own working directory)."""
    folder = folder.resolve()
    config.trainer.default_root_dir = str(folder)
    for logger in _loggers(config.trainer.get("logger")):
        kind, args = _class_name(logger), _init_args(logger)
        if kind not in _LOGGER_DIRS or args is None:
            continue
        args["save_dir"] = str(folder)
        if kind == "WandbLogger":
            args["id"] = folder.name
            if resumed:
                args["resume"] = "allow"
        else:  # TensorBoard/CSV write into <save_dir>/<name>/<version>: the run folder itself
            args["name"], args["version"] = "", ""


def config_filename(folder: Path, subcommand: str) -> str:
    """``config.yaml`` for a run's first call, ``config.<subcommand>[.n].yaml`` for later ones."""
    if not (folder / "config.yaml").exists():
        return "config.yaml"
    name, n = f"config.{subcommand}.yaml", 1
    while (folder / name).exists():
        n += 1
        name = f"config.{subcommand}.{n}.yaml"
    return name


def _loggers(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def _class_name(logger: Any) -> str:
    path = logger.get("class_path", "") if hasattr(logger, "get") else ""
    return str(path).rsplit(".", 1)[-1]


def _init_args(logger: Any) -> Any:
    if not hasattr(logger, "get"):
        return None
    if logger.get("init_args") is None:
        logger["init_args"] = type(logger)()
    return logger["init_args"]
