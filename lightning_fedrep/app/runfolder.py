"""Where the ``lightning-fedrep`` command puts a run: one folder per run holding everything it writes.

    <trainer.default_root_dir>/<run name>/<run id>/
        config.yaml               the command's configuration (a later call into the folder writes
                                  config.<subcommand>.yaml, config.<subcommand>.2.yaml, ...)
        checkpoints/              every ModelCheckpoint without its own dirpath
        summary.json              RunSummary after fit (summary.validate.json, summary.test.json after those)
        history.csv, clients.csv, participation.csv, partition.csv, clients_<stage>.csv
        figures/*.png
        logs/<call>/              TensorBoard's and CSVLogger's files, one folder per command (fit, test, fit-2 ...)
        wandb/                    W&B's offline files (one W&B run per run folder)

The run name is the W&B run's ``name`` (``digits-fedrep``) or the first config file's stem; the run id
is the start time (``20261124-194500``). A command given ``--ckpt_path`` inside a run folder
(``<run>/checkpoints/x.ckpt``) continues or evaluates that run, so it writes into that folder.

Processes started by Lightning's own launcher share the folder of the command that started them. Processes
started by another launcher each run the command: under ``torchrun`` or ``srun`` with more than one task,
the run id is the launcher's job (``torchrun-<rendezvous id>``, ``slurm-<job id>.<step>``), the same in
every process; or set ``LIGHTNING_FEDREP_RUN_FOLDER`` to the folder for every process.

A command refused before its run starts (a setting refused when the objects are built or at the fit's
set-up) leaves nothing behind: :class:`RunFolderRecord` notes what the command added (the folders it
made, or the entries an existing run folder held before) and removes exactly that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
LOGS = "logs"
_LOGGER_DIRS = {"WandbLogger", "TensorBoardLogger", "CSVLogger"}
_NAMED_CHECKPOINTS = ("best", "last", "hpc", "registry")


def folder_of_checkpoint(checkpoint: str | Path | None) -> Path | None:
    """The run folder a checkpoint belongs to (``<run>/checkpoints/x.ckpt`` with ``<run>/config.yaml``)."""
    if checkpoint is None or str(checkpoint) in _NAMED_CHECKPOINTS:
        return None
    path = Path(checkpoint)
    if path.is_file() and path.parent.name == CHECKPOINTS and has_config(path.parent.parent):
        return path.parent.parent
    return None


def has_config(folder: Path) -> bool:
    """Whether ``folder`` holds a run's ``config.yaml`` (or, for a run made before the command saved it in
    the run folder with a TensorBoard or CSV logger, in a logger's folder: ``logs/fit``, ``lightning_logs/version_0``)."""
    return (folder / "config.yaml").is_file() or any(
        next(folder.glob(pattern), None) is not None
        for pattern in (f"{LOGS}/*/config.yaml", "lightning_logs/*/config.yaml")
    )


def missing_checkpoint(checkpoint: str | Path | None) -> str | None:
    """Why ``ckpt_path`` cannot be loaded (a local path that is not a file), else ``None``."""
    if checkpoint is None or str(checkpoint) in _NAMED_CHECKPOINTS or "://" in str(checkpoint):
        return None
    path = Path(checkpoint)
    if path.is_file():
        return None
    return f"ckpt_path={str(checkpoint)!r} is {'a folder' if path.is_dir() else 'not a file'}"


def new_run_folder(root: Path, name: str) -> Path:
    """A folder for a new run under ``root/name``, named by the start time (never an existing one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = root / name / stamp, 1
    while True:
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:  # another run started in the same second
            n += 1
            folder = root / name / f"{stamp}-{n}"


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first: what making ``folder``
    would create."""
    return [path for path in (folder, *folder.parents) if not path.exists()]


@dataclass(frozen=True)
class RunFolderRecord:
    """What a command adds to the file system for its run folder, noted when the folder is chosen (before
    anything is written), so that a refused command can take exactly that away again.

    ``made``: the folders the command creates, deepest first (the run folder itself first when it is
    new). ``before``: for a run folder that already existed (a run continued with ``--ckpt_path``, a folder
    named by ``LIGHTNING_FEDREP_RUN_FOLDER``), every path it held; ``None`` for a new one.
    """

    folder: Path
    made: tuple[Path, ...] = ()
    before: frozenset[Path] | None = None

    @classmethod
    def new(cls, folder: Path, made: list[Path]) -> RunFolderRecord:
        """The record of a run folder this command made (with the parents in ``made``)."""
        return cls(folder, tuple(made))

    @classmethod
    def existing_or_new(cls, folder: Path) -> RunFolderRecord:
        """The record of ``folder`` as it is now: its contents if it exists, else the folders writing into
        it will make."""
        if folder.is_dir():
            return cls(folder, (), frozenset(folder.rglob("*")))
        return cls(folder, tuple(missing_folders(folder)))

    def remove_additions(self) -> None:
        """Remove what the command added: the folders it made (with everything in them; a parent only if
        nothing else was put there meanwhile), or the paths that were not in the existing run folder."""
        if self.before is not None:
            for path in sorted(self.folder.rglob("*"), key=lambda p: len(p.parts)):
                if path not in self.before and (path.exists() or path.is_symlink()):
                    _remove(path)
        for folder in self.made:
            if folder == self.folder:
                shutil.rmtree(folder, ignore_errors=True)
            elif folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def launcher_run_id(environ: dict[str, str] | None = None) -> str | None:
    """The run id every process of a multi-process job started by ``torchrun`` or ``srun`` agrees on (the
    rendezvous id, or the agent's process id when it is ``none``; the SLURM job and step), else ``None``."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in env:
        run_id = env["TORCHELASTIC_RUN_ID"]
        return f"torchrun-{run_id if run_id != 'none' else f'agent{os.getppid()}'}"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    return None


def wandb_run_id(folder: Path) -> str:
    """The W&B run id of a run folder: its run id and a digest of its absolute path (two runs started in
    the same second elsewhere get different ids; the same folder always gets the same one)."""
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:8]
    return f"{folder.name}-{digest}"


def run_name(config: Any) -> str:
    """The W&B run's name if the configuration sets one, else the first config file's stem, else ``run``."""
    for logger in _loggers(config.trainer.get("logger")):
        name = _init_args(logger).get("name")
        if _class_name(logger) == "WandbLogger" and name:
            return str(name)
    files = config.get("config") or []
    return Path(str(files[0])).stem if files else "run"


def place_run(config: Any, folder: Path, resumed: bool, call: str = "fit") -> None:
    """Point the configuration's Trainer and loggers at ``folder`` (before anything is built; absolute, as
    W&B's service process resolves relative paths from its own working directory). A W&B id or name the
    configuration sets is kept; TensorBoard/CSV write into ``logs/<call>`` (``<call>-2``, ... for later
    calls of the same kind), so that no command deletes or mixes another's files."""
    folder = folder.resolve()
    config.trainer.default_root_dir = str(folder)
    for logger in _loggers(config.trainer.get("logger")):
        kind, args = _class_name(logger), _init_args(logger)
        if kind not in _LOGGER_DIRS or args is None:
            continue
        args["save_dir"] = str(folder)
        if kind == "WandbLogger":
            if not args.get("id") and not args.get("version"):
                args["id"] = wandb_run_id(folder)
            if resumed:
                args["resume"] = "allow"
        else:
            args["name"], args["version"] = LOGS, _logger_version(folder / LOGS, call)


def _logger_version(logs: Path, call: str) -> str:
    return _first_free(logs, call, lambda n: f"{call}-{n}")


def _first_free(folder: Path, first: str, nth: Callable[[int], str]) -> str:
    """``first`` if ``folder`` holds nothing of that name, else the first free ``nth(2)``, ``nth(3)``, ..."""
    name, n = first, 1
    while (folder / name).exists():
        n += 1
        name = nth(n)
    return name


def config_filename(folder: Path, subcommand: str) -> str:
    """``config.yaml`` for a run's first call, ``config.<subcommand>[.n].yaml`` for later ones."""
    if not has_config(folder):
        return "config.yaml"
    return _first_free(folder, f"config.{subcommand}.yaml", lambda n: f"config.{subcommand}.{n}.yaml")


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
