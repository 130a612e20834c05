"""``RunSummary``: what a run measured, per client and over clients, in a plain file and in W&B."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lightning_fedrep.arguments import check_bool
from lightning_fedrep.callbacks.figures import FIGURES, run_figures, save
from lightning_fedrep.callbacks.run_files import HISTORY, write_run_files, write_stage_files
from lightning_fedrep.lightning.callback import FederatedCallback


def run_folder(trainer: L.Trainer) -> Path:
    """The run's folder, where Lightning's ``ModelCheckpoint`` puts ``checkpoints/`` as well:
    ``<save_dir>/<name>/<version>`` of the first logger, else the default root directory."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    save_dir = logger.save_dir or trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(save_dir) / str(logger.name) / version


class RunSummary(FederatedCallback):
    """At the end of every ``fit``, ``validate`` and ``test`` (once per call, after the strategy's
    evaluation), write what the run measured into its folder and print a per-client table.

    ``summary.json`` holds the final and last-10-round figures (``strategy.results()``), every client's
    metrics of the last evaluation of each stage, the history, faults and the run's configuration (the
    CLI fills it in); beside it ``history.csv``, ``clients.csv`` (per client, per round),
    ``participation.csv``, ``partition.csv``, ``clients_<stage>.csv`` (see
    ``lightning_fedrep.callbacks.run_files``) and, with matplotlib and ``figures=True``, the PNGs of
    ``lightning_fedrep.callbacks.figures`` under ``figures/`` (``lightning-fedrep report`` draws them again).
    The folder is ``dirpath``, by default the Trainer's run folder (next to ``checkpoints/``). With a
    ``WandbLogger`` the per-client metrics go to W&B as a table and a histogram, the figures as images,
    and validation metrics are plotted against the round; with a ``TensorBoardLogger`` the figures go
    to TensorBoard.

    Args:
        dirpath: the folder the files go to (``None``: the Trainer's run folder).
        filename: the summary's file name in that folder.
        print_table: print the per-client table at the end of each stage.
        figures: draw the figures (needs matplotlib).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "summary.json",
        print_table: bool = True,
        figures: bool = True,
    ):
        if dirpath is not None and not isinstance(dirpath, str | Path):
            raise TypeError(f"RunSummary(dirpath=...) must be a folder path or None, got {dirpath!r}.")
        if not isinstance(filename, str) or not filename or "/" in filename:
            raise ValueError(
                f"RunSummary(filename=...) must be a file name such as 'summary.json', got {filename!r}."
            )
        check_bool("print_table", print_table, owner="RunSummary")
        check_bool("figures", figures, owner="RunSummary")
        self.figures = figures
        self._warned_no_matplotlib = False
        self.dirpath = dirpath
        self.filename = filename
        self.print_table = print_table
        self.config: dict[str, Any] | None = None
        self.path: Path | None = None

    def summary(self, trainer: L.Trainer) -> dict[str, Any]:
        """The summary of ``trainer``'s run as a dict (what the file holds)."""
        strategy = self.strategy(trainer)
        per_client = {}
        for stage, metrics in strategy.client_metrics.items():
            if stage == "sanity":
                continue
            per_client[stage] = {name: metrics.per_client(name) for name in metrics.names}
            per_client[stage]["samples"] = dict(metrics.samples)
        return {
            "algorithm": strategy.algorithm.name,
            "rounds_completed": trainer.current_epoch,
            "global_step": trainer.global_step,
            "results": strategy.results(),
            "test": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")},
            "per_client": per_client,
            "history": strategy.history,
            "faults": [dataclasses.asdict(f) for f in strategy.faults],
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
            "config": self.config,
        }

    @rank_zero_only
    def _write(self, trainer: L.Trainer, stage: str) -> None:
        summary = self.summary(trainer)
        folder = Path(self.dirpath) if self.dirpath else run_folder(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        call = str(trainer.state.fn.value) if trainer.state.fn is not None else "fit"
        stem, dot, suffix = self.filename.rpartition(".")
        name = (
            self.filename
            if call == "fit"
            else (f"{stem}.{call}.{suffix}" if dot else f"{self.filename}.{call}")
        )
        self.path = folder / name
        self.path.write_text(json.dumps(summary, indent=2, default=str))
        # the run's tables come from fit; validate/test of a checkpoint add theirs (or start them in a new folder)
        if call == "fit" or not (folder / HISTORY).is_file():
            write_run_files(folder, self.strategy(trainer), trainer.datamodule)
        else:
            write_stage_files(folder, self.strategy(trainer))
        if self.figures and not trainer.fast_dev_run:  # a smoke run draws nothing (its loggers are off too)
            self._draw(trainer, folder, stage)
        per_client = summary["per_client"].get(stage, {})
        accuracy = per_client.get(f"{stage}/acc") or per_client.get(f"{stage}/loss")
        if accuracy:
            self._to_wandb(trainer, stage, per_client)
            if self.print_table:
                name = f"{stage}/acc" if per_client.get(f"{stage}/acc") else f"{stage}/loss"
                print(f"\nPer-client {name} ({len(accuracy)} clients), summary in {self.path}")
                for row in range(0, len(accuracy), 10):
                    chunk = list(accuracy.items())[row : row + 10]
                    print("  " + "  ".join(f"#{c:<4d}{v:<9.4g}" for c, v in chunk))
                # fit's figures are its last round's; validate/test report what this call measured
                figures = (
                    summary["results"].get("final", {})
                    if call == "fit"
                    else {k: v for k, v in summary["metrics"].items() if k.startswith(f"{stage}/")}
                )
                shown = {k: v for k, v in figures.items() if k.split("/")[-1].startswith(name.split("/")[-1])}
                print("  " + "   ".join(f"{k} {v:.4g}" for k, v in shown.items()))

    def _to_wandb(self, trainer: L.Trainer, stage: str, per_client: dict[str, dict[int, float]]) -> None:
        for logger in trainer.loggers:
            if not isinstance(logger, WandbLogger):
                continue
            names = [n for n in per_client if n != "samples"]
            clients = sorted(per_client["samples"])
            rows = [[c, per_client["samples"][c]] + [per_client[n].get(c) for n in names] for c in clients]
            logger.log_table(key=f"clients/{stage}", columns=["client", "samples", *names], data=rows)
            key = f"{stage}/acc" if f"{stage}/acc" in per_client else f"{stage}/loss"
            import wandb

            logger.experiment.log({f"clients/{stage}_hist": wandb.Histogram(list(per_client[key].values()))})

    def _draw(self, trainer: L.Trainer, folder: Path, stage: str) -> None:
        try:
            figures = run_figures(folder, stage)
        except ImportError as error:
            if not self._warned_no_matplotlib:
                rank_zero_warn(f"RunSummary draws no figures: {error} Or pass RunSummary(figures=False).")
                self._warned_no_matplotlib = True
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                for stem, fig in figures.items():
                    logger.experiment.add_figure(
                        f"figures/{stem}", fig, global_step=trainer.global_step, close=False
                    )
        paths = save(figures, folder / FIGURES)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                for path in paths:
                    logger.log_image(key=f"figures/{path.stem}", images=[str(path)])

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Plot W&B's validation metrics against the round (the strategy logs ``round`` with them)."""
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                logger.experiment.define_metric("round")
                for prefix in ("val", "finetune"):
                    logger.experiment.define_metric(f"{prefix}/*", step_metric="round")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "val")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # inside fit, the summary waits for the fit's end
            self._write(trainer, "val")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test")
