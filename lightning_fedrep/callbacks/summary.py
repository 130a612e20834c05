"""``RunSummary``: what a run measured, per client and over clients, in a plain file and in W&B."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lightning_fedrep.callbacks.figures import FIGURES, run_figures, save
from lightning_fedrep.callbacks.finetuning import HeadFineTuning
from lightning_fedrep.callbacks.privacy_record import privacy_section, wandb_summary
from lightning_fedrep.callbacks.run_files import HISTORY, write_run_files, write_stage_files
from lightning_fedrep.federation.api.arguments import check_bool
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


def fine_tuning(trainer: L.Trainer) -> dict[str, Any] | None:
    """The run's ``HeadFineTuning`` as it describes itself (:meth:`HeadFineTuning.describe`), ``None``
    without one: ``summary.json``'s ``fine_tuning``, which names the run ``fedavg + head fine-tuning``."""
    described = [c.describe() for c in trainer.callbacks if isinstance(c, HeadFineTuning)]
    return described[0] if described else None


def privacy(strategy: Any) -> dict[str, Any]:
    """The run's privacy mechanism and the ε it spent (``summary.json``'s ``privacy``,
    :func:`~lightning_fedrep.callbacks.privacy_record.privacy_section`): the strategy's mechanism as it
    describes itself (``strategy.config.privacy.describe()``) and the last ``privacy/epsilon`` of the history
    (every round's row, evaluated or not); ``"no privacy mechanism"`` without ``privacy=``."""
    mechanism = strategy.config.privacy
    rows = strategy.federation.history.rows if strategy.federation is not None else []
    return privacy_section(None if mechanism is None else mechanism.describe(), rows)


def stage_keys(per_client: dict[str, Any], stage: str) -> list[str]:
    """The keys of ``per_client`` that hold an evaluation of ``stage``: the stage itself (``"val"``), then the
    same stage under a prefix (``"finetune/val"``, a fine-tuning round's validation)."""
    return [k for k in per_client if k == stage] + [k for k in per_client if k.endswith(f"/{stage}")]


def headline_of(per_client: dict[str, Any], key: str) -> str | None:
    """The metric a per-client table shows for ``key``: ``<key>/acc`` if measured, else ``<key>/loss``."""
    for name in (f"{key}/acc", f"{key}/loss"):
        if per_client.get(name):
            return name
    return None


class RunSummary(FederatedCallback):
    """At the end of every ``fit``, ``validate`` and ``test`` (once per call, after the strategy's
    evaluation), write what the run measured into its folder and print a per-client table.

    ``summary.json`` holds the final, last-10-round and best-round figures (``strategy.results()``), every client's
    metrics of the last evaluation of each stage (``per_client``, keyed as ``strategy.client_metrics``:
    ``val``, ``test``, and ``finetune/val`` for the fine-tuned models' ``finetune/val/acc`` ...), the
    fine-tuning (``fine_tuning``: ``HeadFineTuning``'s description, or ``None``), the privacy mechanism and the
    ε it spent (``privacy``: ``callbacks.summary.privacy``; its ``statement`` is printed after the tables and, with a
    ``WandbLogger``, goes to the W&B run summary as ``privacy/guarantee`` with ``privacy/epsilon``), the
    history, faults and the run's configuration (the CLI fills it in); beside it ``history.csv``,
    ``clients.csv`` (per client, per round), ``participation.csv``, ``partition.csv``, ``clients_<stage>.csv`` (see
    ``lightning_fedrep.callbacks.run_files``) and, with matplotlib and ``figures=True``, the PNGs of
    ``lightning_fedrep.callbacks.figures`` under ``figures/`` (``lightning-fedrep report`` draws them again).
    The folder is ``dirpath``, by default the Trainer's run folder (next to ``checkpoints/``). With a
    ``WandbLogger`` the per-client metrics go to W&B as a table and a histogram, the figures as images,
    and validation metrics are plotted against the round; with a ``TensorBoardLogger`` the figures go
    to TensorBoard. The printed table and W&B's ``clients/<key>`` table and histogram come one per key
    of the stage, each named as the summary it belongs to (``val/acc`` the last federated round's,
    ``finetune/val/acc`` the fine-tuned models').

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
            "fine_tuning": fine_tuning(trainer),
            "privacy": privacy(strategy),
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
        # fit's figures are its last round's and its fine-tuning's; validate/test report what the call measured
        results = summary["results"]
        figures = (
            {**results.get("final", {}), **results.get("finetune", {})}
            if call == "fit"
            else summary["metrics"]
        )
        for key in stage_keys(summary["per_client"], stage):
            per_client = summary["per_client"][key]
            name = headline_of(per_client, key)
            if name is None:
                continue
            self._to_wandb(trainer, key, per_client, name)
            if self.print_table:
                self._print_table(per_client[name], name, figures)
        # a run without a privacy mechanism prints nothing here: its summary.json says so
        if self.print_table and summary["privacy"]["mechanism"] is not None:
            print(f"\nPrivacy: {summary['privacy']['statement']}")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update(wandb_summary(summary["privacy"]))

    def _print_table(self, values: dict[int, float], name: str, figures: dict[str, float]) -> None:
        """The per-client values of ``name``, ten clients a line, then the summaries of the same name."""
        print(f"\nPer-client {name} ({len(values)} clients), summary in {self.path}")
        for row in range(0, len(values), 10):
            chunk = list(values.items())[row : row + 10]
            print("  " + "  ".join(f"#{c:<4d}{v:<9.4g}" for c, v in chunk))
        key, _, metric = name.rpartition("/")
        shown = {
            k: v
            for k, v in figures.items()
            if k.rpartition("/")[0] == key and k.rpartition("/")[2].startswith(metric)
        }
        print("  " + "   ".join(f"{k} {v:.4g}" for k, v in shown.items()))

    def _to_wandb(
        self, trainer: L.Trainer, key: str, per_client: dict[str, dict[int, float]], name: str
    ) -> None:
        for logger in trainer.loggers:
            if not isinstance(logger, WandbLogger):
                continue
            names = [n for n in per_client if n != "samples"]
            clients = sorted(per_client["samples"])
            rows = [[c, per_client["samples"][c]] + [per_client[n].get(c) for n in names] for c in clients]
            logger.log_table(key=f"clients/{key}", columns=["client", "samples", *names], data=rows)
            import wandb

            logger.experiment.log({f"clients/{key}_hist": wandb.Histogram(list(per_client[name].values()))})

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
