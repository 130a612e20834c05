"""``lightning-fedrep``: the LightningCLI command that runs recipe YAMLs.

    lightning-fedrep fit --config recipes/digits/fedrep.yaml
    lightning-fedrep test --config recipes/digits/fedrep.yaml --ckpt_path runs/.../last.ckpt
    lightning-fedrep fit --config recipes/digits/fedrep.yaml --print_config
    lightning-fedrep report runs/digits/digits-fedrep/<run id> [more run folders: one figure overlays them]
    lightning-fedrep fit --config recipes/digits/fedrep.yaml --seeds 1,2,3   # sibling run folders seed-1, ...
    lightning-fedrep table runs/digits [more run folders or folders holding them]   # mean ± std over seeds

``lightning-fedrep --help`` lists them all. A setting the command refuses (when the objects are built or
at the fit's set-up) stops it with one paragraph and exit status 2, and leaves no run folder behind
(:mod:`lightning_fedrep.app.refusals`, :class:`lightning_fedrep.app.runfolder.RunFolderRecord`).

Models and data modules are chosen by ``class_path`` (any LightningModule and any
``FederatedDataModule``), the strategy by ``trainer.strategy`` (a ``class_path`` with its
``init_args``, or a registered name such as ``fedrep``). W&B runs offline unless you are logged in.
"""

from __future__ import annotations

import difflib
import os
import pickle
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

import lightning_fedrep  # noqa: F401  (registers the strategy names)
import lightning_fedrep.data  # noqa: F401  (short class names: --data DigitsDataModule, --data.help ...)
import lightning_fedrep.data.digits  # noqa: F401
import lightning_fedrep.data.low_rank  # noqa: F401
import lightning_fedrep.models  # noqa: F401  (short class names: --model MLPClassifier, --model.help ...)
from lightning_fedrep.app import seeds as seed_sweep
from lightning_fedrep.app.quiet import quiet_unactionable_messages
from lightning_fedrep.app.refusals import Refused, refusal_message, traceback_wanted
from lightning_fedrep.app.runfolder import (
    CHECKPOINTS,
    RunFolderRecord,
    config_filename,
    folder_of_checkpoint,
    launcher_run_id,
    missing_checkpoint,
    missing_folders,
    new_run_folder,
    place_run,
    run_name,
)
from lightning_fedrep.callbacks.run_files import write_rows
from lightning_fedrep.callbacks.summary import RunSummary
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.federation import FederationMismatch
from lightning_fedrep.federation.checkpoint.reading import CheckpointError, read_checkpoint
from lightning_fedrep.lightning import internals
from lightning_fedrep.lightning.strategy import FederatedStrategyMixin


def wandb_credentials_present() -> bool:
    """Whether W&B could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


RUN_FOLDER_VARIABLE = "LIGHTNING_FEDREP_RUN_FOLDER"
"""Set by the command to its run folder, so that the processes Lightning's launcher starts share it; set
by the user, every command of the process (and of every process) writes into that folder."""
_RUN_FOLDER_GIVEN: str | None = None
"""The variable's value when ``build_cli`` was entered: the caller's choice (the command's own setting is
restored when it returns)."""
_SWEEP: seed_sweep.Sweep | None = None
"""The seed of the ``--seeds`` run now being built (``None`` outside a sweep)."""

PROGRAM = "lightning-fedrep"
DESCRIPTION = (
    "Personalized federated learning with PyTorch Lightning: runs recipe YAMLs (fit, validate, test, predict; "
    "fit --seeds runs once per seed) and reads finished run folders (table, report)."
)
FIT_DESCRIPTION = (
    "Runs the full optimization routine: one federated training, one Lightning epoch per round. "
    f"{seed_sweep.FLAG} S1,S2,... runs it once per seed (see {PROGRAM} --help)."
)
SUBCOMMANDS = {
    "fit": f"Trains the federation, one Lightning epoch per round ({seed_sweep.FLAG}: once per seed).",
    "validate": "Scores each client's personalized model on its validation data (--ckpt_path).",
    "test": "Scores each client's personalized model on its test data (--ckpt_path).",
    "predict": "Each client's predictions by its personalized model (--ckpt_path), saved in the run folder.",
    "table": "Mean ± std over seeds of each recipe's figure, beside the paper's number, from run folders.",
    "report": "Draws a run folder's figures again, or overlays several runs in one figure.",
}
"""The one-line summaries ``--help`` lists: Lightning's subcommands, then the two :func:`main` runs itself
(before any LightningCLI parsing)."""
SEEDS_HELP = (
    "fit only: run fit once per seed (--seeds 1,2,3), each seed s into its own run folder seed-<s> beside "
    "the others, with seed_everything and the strategy's and the data's seed set to s; "
    f"{PROGRAM} table reads them."
)


def refuse(message: str) -> NoReturn:
    """Stop the command with ``message`` on one line of standard error and exit status 2 (argparse's)."""
    sys.stderr.write(f"{PROGRAM}: error: {message}\n")
    raise SystemExit(2)


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
    raise Refused(
        f"trainer.strategy={name!r} is not a registered strategy.{hint} This package's: "
        f"{', '.join(ours)} (or class_path: lightning_fedrep.FederatedStrategy); Lightning's: "
        f"{', '.join(sorted(n for n in StrategyRegistry if n not in ours and 'find_unused' not in n))}."
    )


class RunStart(Callback):
    """Notes when the command's run gets past its set-up: its first training batch (or, for validate,
    test and predict, its first evaluation batch). A refusal before that takes back what the command
    added to the file system; after it, the run folder stays."""

    acts_per_local_step = False
    """Its batch hooks note the first batch only: the engine may fuse local steps into one Lightning step."""

    def __init__(self) -> None:
        self.started = False

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.started = True

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.started = self.started or not trainer.sanity_checking

    @override
    def on_test_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.started = True

    @override
    def on_predict_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.started = True


def list_package_commands(parser: LightningArgumentParser) -> None:
    """Complete what ``--help`` lists: ``table`` and ``report`` (which :func:`main` runs itself) beside
    Lightning's subcommands, each with its line of :data:`SUBCOMMANDS` (Lightning's own lines are cut from
    the Trainer's docstrings mid-sentence), and ``--seeds`` (which :func:`main` takes off the command line)."""
    subcommands = parser._subcommands_action  # jsonargparse's action holding Lightning's subcommands
    if subcommands is not None:
        for listed in subcommands._choices_actions:  # argparse's entries of the subcommand list
            listed.help = SUBCOMMANDS.get(listed.dest, listed.help)
        for name, summary in SUBCOMMANDS.items():
            if name not in subcommands.choices:
                subcommands.add_subcommand(name, LightningArgumentParser(description=summary), help=summary)
    parser.add_argument(seed_sweep.FLAG, metavar="S1,S2,...", default=None, help=SEEDS_HELP)


class LogConfigCallback(SaveConfigCallback):
    """Saves ``config.yaml`` in the run folder and also sends the whole run configuration (strategy, data,
    model, trainer) to every logger, so W&B shows it. (Lightning saves it in the first logger's
    ``log_dir``, ``logs/fit`` for a TensorBoard or CSV logger: the command gives it an absolute
    ``config_filename`` in the run folder, which ``os.path.join(log_dir, ...)`` keeps.)"""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = self.config.as_dict() if hasattr(self.config, "as_dict") else dict(self.config)
        config.pop("config", None)
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class FedRepCLI(LightningCLI):
    """LightningCLI whose data modules are ``FederatedDataModule`` subclasses; hands the run's
    configuration to ``RunSummary`` so ``summary.json`` records it. A refusal (see
    :mod:`lightning_fedrep.app.refusals`) while it builds the objects or sets the run up stops it with one
    paragraph and exit status 2, after taking back what it added to the file system."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.run_start = RunStart()
        self._run_record: RunFolderRecord | None = None
        defaults = dict(kwargs.pop("trainer_defaults", None) or {})
        defaults["callbacks"] = [*_as_list(defaults.get("callbacks")), self.run_start]
        try:
            super().__init__(*args, trainer_defaults=defaults, **kwargs)
        except Exception as error:
            message = refusal_message(error)
            if message is None:
                raise
            self._take_back_refused_run()
            if traceback_wanted():
                raise
            sys.stderr.write(f"{PROGRAM}: error: {message}\n")
            raise SystemExit(2) from None

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        list_package_commands(self.parser)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse as Lightning does; refuse what only :func:`main` runs (``table``, ``report``, ``--seeds``), which
        ``--help`` lists but a :func:`build_cli` call would not run."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand in SUBCOMMANDS and subcommand not in self.subcommands():
            raise Refused(f"{subcommand} is run by {PROGRAM} ({__name__}.main), not by build_cli.")
        if self.config.get(seed_sweep.FLAG[2:]) is not None:
            raise Refused(f"{seed_sweep.FLAG} is read by {PROGRAM} ({__name__}.main), not by build_cli.")

    def _take_back_refused_run(self) -> None:
        """A refusal before the run started: end its W&B run (files closed) and remove what the command
        added to the file system (nothing of a run folder that existed before, nothing on other ranks)."""
        if self.run_start.started or self._run_record is None:
            return
        if hasattr(self, "trainer"):
            self._finish_wandb()
        self._run_record.remove_additions()

    def before_instantiate_classes(self) -> None:
        if "WANDB_MODE" not in os.environ and not wandb_credentials_present():
            os.environ["WANDB_MODE"] = "offline"  # never block on the network
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy") if hasattr(config, "get") else None
        if isinstance(strategy, str):
            check_strategy_name(strategy)
        if _SWEEP is not None:
            seed_sweep.check_single_process(config)
            seed_sweep.apply_seed(config, _SWEEP.seed)
        if self.subcommand in ("fit", "validate", "test", "predict"):
            self.run_folder = self._place_run(config)

    def _place_run(self, config: Any) -> Path:
        """Choose the command's run folder (see ``lightning_fedrep.app.runfolder``) and point the configuration
        at it: the folder of ``ckpt_path``'s run, the folder the launching process or the user named in
        ``LIGHTNING_FEDREP_RUN_FOLDER``, the launcher job's, or a new one."""
        missing = missing_checkpoint(config.get("ckpt_path"))
        if missing:
            raise Refused(f"{missing}; pass the path of a checkpoint file (or best/last).")
        folder = folder_of_checkpoint(config.get("ckpt_path"))
        if folder is not None and _allows_new_federation(config):
            rank_zero_info(
                f"allow_new_federation=True: this command writes into a new run folder, not into the run of "
                f"ckpt_path ({folder}), whose files another federation must not replace."
            )
            folder = None
        resumed = folder is not None
        given = os.environ.get(RUN_FOLDER_VARIABLE)
        if given and (int(os.environ.get("LOCAL_RANK", "0")) > 0 or given == _RUN_FOLDER_GIVEN):
            folder = Path(given)  # a process Lightning's launcher started, or the user's choice
            resumed = resumed or (folder / "config.yaml").is_file()
            record = RunFolderRecord.existing_or_new(folder)
        elif folder is None:
            root = Path(config.trainer.get("default_root_dir") or ".")
            job = launcher_run_id()
            if job is not None and _SWEEP is None:
                folder = root / run_name(config) / job
                resumed = (folder / "config.yaml").is_file()
                record = RunFolderRecord.existing_or_new(folder)
                folder.mkdir(parents=True, exist_ok=True)
            else:
                folder, record = _new_folder(root, run_name(config))
        else:  # the run of ckpt_path
            record = RunFolderRecord.existing_or_new(folder)
        if rank_zero_only.rank == 0:  # other processes leave the shared folder to the first
            self._run_record = record
        os.environ[RUN_FOLDER_VARIABLE] = str(folder)  # inherited by the processes the launcher starts
        folder = folder.resolve()
        place_run(config, folder, resumed, self.subcommand)
        if resumed:  # its checkpoints are meant to be there
            warnings.filterwarnings(
                "ignore", message=f"Checkpoint directory {re.escape(str(folder / CHECKPOINTS))} exists"
            )
        return folder

    @override
    def _parse_ckpt_path(self) -> None:
        """Lightning reads ``ckpt_path``'s hyper-parameters while it parses the command: a file it cannot read
        (truncated, corrupt, or holding objects a weights-only load refuses) stops the command here, on one
        line naming it, before any folder is made."""
        try:
            super()._parse_ckpt_path()
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile):
            subcommand = self.config.get("subcommand")
            path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if path is None or traceback_wanted():
                raise
            try:
                _read_checkpoint(path, weights_only=True)
            except CheckpointError as error:
                raise Refused(f"ckpt_path={str(path)!r}: {_one_line(error)}") from None
            raise

    def _check_checkpoint(self) -> None:
        """Refuse ``ckpt_path`` when it was saved by another federation than this command's data (and, for
        ``fit``, strategy settings), on one line, before anything is written; what the strategy would refuse
        once the data are loaded."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        path = config.get("ckpt_path")
        strategy = self.trainer.strategy
        if path is None or not Path(str(path)).is_file() or not isinstance(strategy, FederatedStrategyMixin):
            return
        try:
            checkpoint = _read_checkpoint(path, weights_only=config.get("weights_only") is not False)
            strategy.checkpoint_changes(checkpoint, self.datamodule, self.subcommand or "fit")
        except (CheckpointError, FederationMismatch) as error:
            if traceback_wanted():
                raise
            raise Refused(f"ckpt_path={str(path)!r}: {_one_line(error)}") from None

    def _attach_config(self) -> None:
        """Hand the configuration to ``RunSummary``; point checkpoints, the summary and the saved config at
        the run folder (callbacks given their own folder keep it)."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        folder = getattr(self, "run_folder", None)
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger):
                internals.drop_wandb_anonymous_flag(logger)
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunSummary):
                callback.config = config.clone().as_dict() if hasattr(config, "as_dict") else dict(config)
                if folder is not None and callback.dirpath is None:
                    callback.dirpath = str(folder)
            if folder is None:
                continue
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(folder / CHECKPOINTS)
            if isinstance(callback, LogConfigCallback):
                callback.config_filename = str(folder / config_filename(folder, self.subcommand or "fit"))

    def _finish_wandb(self) -> None:
        """End this command's W&B run, so a later command in the same process starts its own."""
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger) and logger._experiment is not None:
                logger.experiment.finish()

    def after_fit(self) -> None:
        self._finish_wandb()

    def after_validate(self) -> None:
        self._finish_wandb()

    def after_test(self) -> None:
        self._finish_wandb()

    def before_predict(self) -> None:
        self._check_checkpoint()
        self._attach_config()

    def after_predict(self) -> None:
        """Write the predictions into the run folder: ``predictions.pt`` (every batch's output and client)
        and, for one value per sample, ``predictions.csv`` (client, sample of the client, prediction)."""
        self._finish_wandb()
        folder = getattr(self, "run_folder", None)
        outputs = self.trainer.predict_loop.predictions
        if folder is None or not outputs or not self.trainer.is_global_zero:
            return
        clients = list(getattr(self.trainer.strategy, "prediction_clients", []))
        mode = getattr(self.trainer.strategy, "prediction_mode", None)
        torch.save({"predictions": outputs, "clients": clients, "mode": mode}, folder / "predictions.pt")
        if len(clients) == len(outputs) and all(
            isinstance(o, torch.Tensor) and o.dim() == 1 for o in outputs
        ):
            rows, seen = [], {}
            for client, output in zip(clients, outputs):
                for value in output.tolist():
                    rows.append({"client": client, "sample": seen.get(client, 0), "prediction": value})
                    seen[client] = seen.get(client, 0) + 1
            write_rows(folder / "predictions.csv", rows, first=["client", "sample", "prediction"])
        print(f"{mode or 'plain'} predictions in {folder / 'predictions.pt'}")

    def before_fit(self) -> None:
        self._check_checkpoint()
        self._attach_config()

    def before_test(self) -> None:
        self._check_checkpoint()
        self._attach_config()

    def before_validate(self) -> None:
        self._check_checkpoint()
        self._attach_config()


def _read_checkpoint(path: Any, weights_only: bool) -> dict[str, Any]:
    """The checkpoint at ``path`` (memory-mapped when it is a zip file, as ``torch.save`` writes them), or a
    :class:`CheckpointError` naming it: truncated, corrupt, or refused by ``weights_only``."""
    mmap = zipfile.is_zipfile(path)
    return read_checkpoint(
        path, lambda: torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    )


def _one_line(error: Exception) -> str:
    """``error``'s message on one line: a checkpoint ``weights_only`` refuses says how to load it anyway."""
    cause = str(error.__cause__ or "")
    if isinstance(error, CheckpointError) and "weights only load failed" in cause.lower():
        detail = next((line.strip() for line in cause.splitlines() if "Unsupported global" in line), "")
        return (
            "the checkpoint holds objects other than tensors, numbers, strings and containers, which a "
            f"weights-only load refuses ({detail or 'Weights only load failed'}). If you trust the file, load it "
            "with torch.load(path, weights_only=False) (unpickling can run code), drop those objects and save it "
            "again; else use another checkpoint."
        )
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _new_folder(root: Path, name: str) -> tuple[Path, RunFolderRecord]:
    """A new run folder under ``root/name`` (for ``--seeds``, the seed's folder beside the sweep's other
    seeds) and the record of every folder making it created."""
    made = missing_folders(root / name)
    if _SWEEP is None:
        folder = new_run_folder(root, name)
        return folder, RunFolderRecord.new(folder, [folder, *made])
    group = _SWEEP.group
    if group is None:  # the sweep's first seed makes the sweep's folder
        group = new_run_folder(root, name)
        made.insert(0, group)
    else:
        made = []
    folder = seed_sweep.seed_folder(group, _SWEEP.seed)
    return folder, RunFolderRecord.new(folder, [folder, *made])


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _allows_new_federation(config: Any) -> bool:
    """Whether the configured strategy sets ``allow_new_federation`` (a ``class_path`` with ``init_args``)."""
    strategy = config.trainer.get("strategy")
    args = strategy.get("init_args") if hasattr(strategy, "get") else None
    return bool(args.get("allow_new_federation")) if hasattr(args, "get") else False


def build_cli(args: ArgsType = None, run: bool = True) -> FedRepCLI:
    """Parse ``args`` (the command line by default), build and, with ``run``, execute the subcommand."""
    quiet_unactionable_messages()
    global _RUN_FOLDER_GIVEN
    before = _RUN_FOLDER_GIVEN = os.environ.get(RUN_FOLDER_VARIABLE)
    try:
        return FedRepCLI(
            L.LightningModule,
            FederatedDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=LogConfigCallback,
            save_config_kwargs={"overwrite": False},
            parser_kwargs={
                "prog": PROGRAM,
                "description": DESCRIPTION,
                "fit": {"description": FIT_DESCRIPTION},
            },
            args=args,
            run=run,
        )
    finally:  # the command's folder was for its own launched processes, not for what the caller runs next
        if before is None:
            os.environ.pop(RUN_FOLDER_VARIABLE, None)
        else:
            os.environ[RUN_FOLDER_VARIABLE] = before


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-fedrep`` console script: Lightning's subcommands (``fit``,
    ``validate``, ``test``, ``predict``; ``fit ... --seeds 1,2,3`` runs once per seed), ``report RUN_DIR
    [RUN_DIR ...]`` (figures from run folders) and ``table FOLDER [...]`` (mean ± std over seeds)."""
    argv = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else None
    if argv and argv[0] == "report":
        from lightning_fedrep.app.report import main as report

        report(argv[1:])
        return
    if argv and argv[0] == "table":
        from lightning_fedrep.app.table import main as table

        table(argv[1:])
        return
    if argv and any(a == seed_sweep.FLAG or a.startswith(seed_sweep.FLAG + "=") for a in argv):
        run_seeds(argv)
        return
    build_cli(args)


def _copy_recipe(cli: FedRepCLI, folder: Path) -> None:
    """Copy the command's first config file into the run folder as ``recipe.yaml``: its header tells
    ``lightning-fedrep table`` the figure to read and the paper's number (``config.yaml`` drops comments)."""
    config = cli.config.get(cli.subcommand, cli.config) if cli.subcommand else cli.config
    files = config.get("config") or []
    source = Path(str(getattr(files[0], "absolute", files[0]))) if files else None
    if source is not None and source.is_file():
        shutil.copyfile(source, folder / "recipe.yaml")


def run_seeds(argv: list[str]) -> list[Path]:
    """``fit ... --seeds 1,2,3``: the command once per seed (``lightning_fedrep.app.seeds``), each into its own
    ``seed-<s>`` folder beside the others; returns the run folders."""
    global _SWEEP
    try:
        rest, seeds = seed_sweep.split_seeds(argv)
    except ValueError as error:
        refuse(str(error))
    if os.environ.get(RUN_FOLDER_VARIABLE):
        refuse(f"--seeds writes one run folder per seed: unset {RUN_FOLDER_VARIABLE} (it names one folder).")
    folders: list[Path] = []
    try:
        for seed in seeds or []:
            _SWEEP = seed_sweep.Sweep(seed, folders[0].parent if folders else None)
            cli = build_cli([*rest, f"--seed_everything={seed}"])
            folders.append(cli.run_folder)
            _copy_recipe(cli, cli.run_folder)
    finally:
        _SWEEP = None
    if folders:
        group = folders[0].parent
        print(f"{len(folders)} seeds in {group}; their table: lightning-fedrep table {group}")
    return folders


if __name__ == "__main__":
    main()
