"""What a run leaves behind: one folder per run (config, checkpoints, summary, tables, figures, W&B files),
never overwritten by another run, written into by the test of its checkpoint; the tables hold what the
strategy measured; ``lightning-fedrep report`` draws the figures again and overlays runs."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

from lightning_fedrep import FedRepStrategy, RunSummary
from lightning_fedrep.app.cli import build_cli, main
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits" / "fedrep.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 5000, path  # a drawn figure, not an empty canvas


def column(table: list[dict[str, str]], name: str) -> list[float]:
    """The non-empty values of ``name`` in rows read by the ``csv`` module (not the library's reader)."""
    return [float(r[name]) for r in table if r.get(name)]


def only_axes(figure):
    """The figure's data axes (a heatmap's colour bar is an axes too)."""
    return figure.axes[0]


def assert_curve_figure(figure, run: Path, x: str, metric: str = "val/acc") -> None:
    """A run's ``<metric>`` vs ``x`` figure draws history.csv: the client mean, the 10th percentile and the band
    from the worst client up to the mean, each named in the legend."""
    history = [r for r in rows(run / "history.csv") if r.get(metric) and r.get(x)]
    xs = column(history, x)
    ax = only_axes(figure)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"client mean", "10th percentile"}
    assert list(lines["client mean"].get_xdata()) == xs and list(lines["10th percentile"].get_xdata()) == xs
    assert list(lines["client mean"].get_ydata()) == column(history, metric)
    assert list(lines["10th percentile"].get_ydata()) == column(history, f"{metric}_p10")
    (band,) = ax.collections
    assert band.get_label() == "worst client .. mean"
    corners = {(float(a), float(b)) for a, b in band.get_paths()[0].vertices}
    mean, low = column(history, metric), column(history, f"{metric}_min")
    assert corners == set(zip(xs, mean)) | set(zip(xs, low))
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert legend == {"client mean", "10th percentile", "worst client .. mean"}
    assert ax.get_ylabel() == metric


def assert_run_figures_draw_the_tables(run: Path) -> None:
    """Each figure of ``run_figures(run)`` holds the values of the run folder's tables (not just axes)."""
    import numpy as np

    from lightning_fedrep.app.report import run_figures

    figures = run_figures(run)
    try:
        assert_curve_figure(figures["accuracy_vs_round"], run, "round")
        history = rows(run / "history.csv")
        if column(history, "sim/time"):
            assert_curve_figure(figures["accuracy_vs_time"], run, "sim/time")
        collapse = sorted(k for k in history[0] if k.startswith("nc/"))
        if collapse:
            lines = only_axes(figures["neural_collapse"]).get_lines()
            assert [line.get_label() for line in lines] == collapse
            for key, line in zip(collapse, lines):
                assert list(line.get_ydata()) == column(history, key), key
        clients = rows(run / "clients.csv")
        rounds = sorted({int(r["round"]) for r in clients})
        ids = sorted({int(r["client"]) for r in clients})
        grid = np.full((len(ids), len(rounds)), np.nan)
        for r in clients:
            grid[ids.index(int(r["client"])), rounds.index(int(r["round"]))] = float(r["val/acc"])
        (image,) = only_axes(figures["client_round_heatmap"]).images
        np.testing.assert_array_equal(np.ma.filled(image.get_array(), np.nan), grid)  # clients x rounds

        last = column(rows(run / "clients_val.csv"), "val/acc")
        bars = only_axes(figures["client_histogram"]).patches
        counts, edges = np.histogram(last, bins=len(bars))
        assert [b.get_height() for b in bars] == counts.tolist()
        np.testing.assert_allclose([b.get_x() for b in bars], edges[:-1], rtol=0, atol=1e-12)

        sampled = {int(r["client"]): float(r["rounds"]) for r in rows(run / "participation.csv")}
        drawn = {
            round(b.get_x() + b.get_width() / 2): b.get_height()
            for b in only_axes(figures["participation"]).patches
        }
        assert drawn == sampled

        partition = rows(run / "partition.csv")
        ax = only_axes(figures["partition"])
        for container in ax.containers:  # one stack layer per label, one bar per client
            label = int(container.get_label())
            expected = {int(r["client"]): float(r["samples"]) for r in partition if int(r["label"]) == label}
            got = {round(b.get_x() + b.get_width() / 2): b.get_height() for b in container.patches}
            assert {c: h for c, h in got.items() if h} == expected, label
        assert len(ax.containers) == len({r["label"] for r in partition})
    finally:
        import matplotlib.pyplot as plt

        for figure in figures.values():
            plt.close(figure)


def assert_overlay_draws_each_run(
    runs: list[Path], x: str = "round", stem: str = "accuracy_vs_round"
) -> None:
    """The overlay holds one line per run, in order, each with that run's history.csv values and a label that
    names the run, no two labels alike."""
    import matplotlib.pyplot as plt

    from lightning_fedrep.app.report import overlay_figures

    figures = overlay_figures(runs)
    try:
        lines = only_axes(figures[stem]).get_lines()
        assert len(lines) == len(runs)
        labels = [line.get_label() for line in lines]
        assert len(set(labels)) == len(runs)
        for run, line, label in zip(runs, lines, labels):
            history = [r for r in rows(run / "history.csv") if r.get("val/acc") and r.get(x)]
            assert run.name in label, (run, label)
            assert list(line.get_xdata()) == column(history, x)
            assert list(line.get_ydata()) == column(history, "val/acc")
        legend = [t.get_text() for t in only_axes(figures[stem]).get_legend().get_texts()]
        assert legend == labels
    finally:
        for figure in figures.values():
            plt.close(figure)


def wandb_records(path: Path, last: bytes, timeout: float = 120.0) -> bytes:
    """The W&B offline file once it holds ``last``: W&B's service writes the records after ``finish()``
    returns (the file holds only its 7-byte header at first), so reading it at once flakes."""
    import time

    deadline = time.monotonic() + timeout
    while last not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return data


def fit_recipe(tmp_path, *extra):
    cli = build_cli(
        [
            "fit",
            "--config",
            str(RECIPE),
            "--trainer.max_epochs=3",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=true",
            *extra,
        ]
    )
    return cli, Path(cli.trainer.default_root_dir)


def test_the_digits_recipe_leaves_one_complete_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli, run = fit_recipe(tmp_path)
    strategy = cli.trainer.strategy
    assert run.parent == Path("runs/digits/digits-fedrep").resolve() or run.parent.name == "digits-fedrep"
    assert (run / "config.yaml").is_file() and list((run / "checkpoints").glob("*.ckpt"))
    (wandb_run,) = (run / "wandb").glob("offline-run-*/run-*.wandb")  # W&B's files in the run folder
    logged = wandb_records(wandb_run, b"figures/accuracy_vs_round")
    assert (
        b"val/*" in logged and b"figures/accuracy_vs_round" in logged
    )  # metrics by round, figures as images
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy"]["statement"] == "no privacy mechanism"  # and the W&B run summary says so
    assert b"no privacy mechanism" in wandb_records(wandb_run, b"privacy/guarantee")
    assert summary["rounds_completed"] == 3 and "sanity" not in summary["per_client"]
    history = rows(run / "history.csv")
    assert [int(r["round"]) for r in history] == [0, 1, 2]
    for row, expected in zip(history, strategy.history):
        assert float(row["val/acc"]) == pytest.approx(expected["val/acc"])
    clients = rows(run / "clients.csv")
    assert len(clients) == 3 * 20
    for r in (0, 2):  # the mean over clients of each round is that round's val/acc
        values = [float(c["val/acc"]) for c in clients if int(c["round"]) == r]
        assert sum(values) / 20 == pytest.approx(strategy.history[r]["val/acc"])
    participation = {int(r["client"]): int(r["rounds"]) for r in rows(run / "participation.csv")}
    expected = {}
    for r in range(3):
        for c in strategy.round_plan(r).clients:
            expected[c] = expected.get(c, 0) + 1
    assert participation == expected and sum(participation.values()) == 3 * 10
    partition = rows(run / "partition.csv")
    datamodule = cli.datamodule
    assert sum(int(r["samples"]) for r in partition) == sum(len(datamodule.client_data(c)) for c in range(20))
    assert {len([r for r in partition if int(r["client"]) == c]) for c in range(20)} == {2}  # 2 classes each
    for name in (
        "accuracy_vs_round",
        "client_histogram",
        "client_round_heatmap",
        "participation",
        "partition",
    ):
        assert_png(run / "figures" / f"{name}.png")
    assert_run_figures_draw_the_tables(run)

    config = (run / "config.yaml").read_text()
    _, second = fit_recipe(tmp_path)  # a second run in the same root: its own folder
    assert second != run and second.parent == run.parent
    assert (run / "config.yaml").read_text() == config and (second / "config.yaml").is_file()

    checkpoint = next((run / "checkpoints").glob("*.ckpt"))  # testing it writes beside it
    build_cli(["test", "--config", str(RECIPE), f"--ckpt_path={checkpoint}"])
    tested = json.loads((run / "summary.test.json").read_text())
    assert len(tested["per_client"]["test"]["test/acc"]) == 20
    assert (run / "config.test.yaml").is_file() and (run / "config.yaml").read_text() == config
    assert len(rows(run / "clients_test.csv")) == 20 and len(rows(run / "history.csv")) == 3

    out = tmp_path / "report"
    main(["report", str(run), str(second), "--out", str(out)])
    assert_png(out / "accuracy_vs_round.png")
    assert_overlay_draws_each_run([run, second])
    main(["report", str(run), "--out", str(tmp_path / "again")])
    assert_png(tmp_path / "again" / "client_round_heatmap.png")


def test_the_history_keeps_every_rounds_per_client_values_and_participation_through_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=2)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    history = strategy.federation.history
    for r in range(3):
        per_client = history.client_values(r)["val/acc"]
        assert sum(per_client.values()) / len(per_client) == pytest.approx(strategy.history[r]["val/acc"])
    assert sum(history.participation.values()) == 9
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    restored = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=2)
    quiet_trainer(strategy=restored).test(
        TinyNet(), datamodule=tiny_datamodule(num_clients=6), ckpt_path=tmp_path / "c.ckpt", verbose=False
    )
    assert restored.federation.history.client_rows == history.client_rows
    assert restored.federation.history.participation == history.participation


def test_figures_go_to_tensorboard_and_validate_writes_its_own_summary(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="", version="")
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=2, logger=logger, callbacks=[RunSummary(print_table=False)]
    )
    model = TinyNet()
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6))
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events and sum(e.stat().st_size for e in events) > 20000  # the figures are in the event file
    trainer.validate(model, datamodule=tiny_datamodule(num_clients=6), verbose=False)
    summary = json.loads((tmp_path / "summary.validate.json").read_text())
    assert len(summary["per_client"]["val"]["val/acc"]) == 6


@pytest.mark.parametrize("mode", ["new_client", "personalized"])
def test_predict_runs_each_clients_test_samples_through_the_chosen_model(tmp_path, mode):
    from lightning_fedrep import FederatedDataModule, ShardPartitioner
    from lightning_fedrep.models import MLPClassifier
    from tests.fixtures import tiny_datasets

    train, test = tiny_datasets()
    data = FederatedDataModule(train, test, ShardPartitioner(4, 2), batch_size=8, eval_batch_size=16)
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=1.0, head_epochs=1, body_epochs=1, predict=mode
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=2)
    torch.manual_seed(0)
    model = MLPClassifier(in_features=6, hidden=12, features=8, num_classes=4)
    trainer.fit(model, datamodule=data)
    predictions = trainer.predict(model, datamodule=data)
    assert len(strategy.prediction_clients) == len(predictions)
    data.setup("test")
    for client in range(4):
        reference = strategy.client_model(client if mode == "personalized" else -1)
        subset = data.client_data(client, "test")
        x = torch.stack([subset.dataset[i][0] for i in subset.indices])
        got = torch.cat([p for p, c in zip(predictions, strategy.prediction_clients) if c == client])
        with torch.no_grad():
            assert torch.equal(got, reference(x).argmax(-1)), client


def test_client_model_before_any_fit_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="No federated state yet"):
        FedRepStrategy(head="classifier").client_model(0)


def test_the_summary_has_no_sanity_stage_and_marks_how_many_rounds_last10_averages(tmp_path):
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=3,
        num_sanity_val_steps=2,
        callbacks=[RunSummary(str(tmp_path), print_table=False)],
    )
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "sanity" in strategy.client_metrics and set(summary["per_client"]) == {"val"}
    assert summary["results"]["last10_rounds"] == {"rounds": 3.0}
    assert trainer.callback_metrics["val/last10_rounds"] == 3.0


LOGGERS = """
trainer:
  enable_checkpointing: true
  enable_progress_bar: false
  max_epochs: 2
  logger:
  - class_path: lightning.pytorch.loggers.WandbLogger
    init_args: {project: lightning-fedrep, name: digits-fedrep}
  - class_path: lightning.pytorch.loggers.CSVLogger
  - class_path: lightning.pytorch.loggers.TensorBoardLogger
"""


def test_resume_test_and_predict_write_into_the_run_folder_without_losing_its_files(tmp_path, monkeypatch):
    """A resumed fit, a test and a predict of the run's checkpoint write into its folder: each call keeps its
    own config and logger files (CSV/TensorBoard under logs/<call>), W&B continues the same run id, and the
    CLI's personalized predictions score what the test measured, client by client."""
    from lightning_fedrep.app.runfolder import wandb_run_id

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    overlay = tmp_path / "loggers.yaml"
    overlay.write_text(LOGGERS)
    base = ["--config", str(RECIPE), "--config", str(overlay)]
    cli = build_cli(["fit", *base])
    run = Path(cli.trainer.default_root_dir)
    assert (run / "logs" / "fit" / "metrics.csv").is_file()
    assert list((run / "logs" / "fit").glob("events.out.tfevents.*"))
    last = max((run / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    fit_metrics = (run / "logs" / "fit" / "metrics.csv").read_text()

    resumed = build_cli(["fit", *base, "--trainer.max_epochs=3", f"--ckpt_path={last}"])
    assert Path(resumed.trainer.default_root_dir) == run and resumed.trainer.current_epoch == 3
    assert (run / "config.fit.yaml").is_file() and (run / "logs" / "fit-2" / "metrics.csv").is_file()
    assert (run / "logs" / "fit" / "metrics.csv").read_text() == fit_metrics
    assert len(rows(run / "history.csv")) == 3
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{wandb_run_id(run)}") for p in runs)

    last = max((run / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    build_cli(["test", *base, f"--ckpt_path={last}"])
    assert (run / "logs" / "test" / "metrics.csv").is_file()
    assert (run / "logs" / "fit" / "metrics.csv").read_text() == fit_metrics
    tested = {int(r["client"]): float(r["test/acc"]) for r in rows(run / "clients_test.csv")}

    predicted = build_cli(
        ["predict", *base, "--trainer.strategy.init_args.predict=personalized", f"--ckpt_path={last}"]
    )
    assert torch.load(run / "predictions.pt", weights_only=False)["clients"]
    predictions = rows(run / "predictions.csv")
    datamodule = predicted.datamodule
    for client, accuracy in tested.items():
        subset = datamodule.client_data(client, "test")
        labels = [int(subset.dataset[i][1]) for i in subset.indices]
        mine = [int(r["prediction"]) for r in predictions if int(r["client"]) == client]
        assert len(mine) == len(labels)
        assert sum(p == y for p, y in zip(mine, labels)) / len(labels) == pytest.approx(accuracy), client

    import wandb

    assert wandb.run is None  # predict finished its W&B run: the next command starts its own


def test_a_missing_checkpoint_is_refused_before_any_folder_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        build_cli(["test", "--config", str(RECIPE), "--ckpt_path=runs/nothing/here.ckpt"])
    assert stop.value.code == 2
    assert "ckpt_path='runs/nothing/here.ckpt' is not a file" in capsys.readouterr().err
    assert not Path("runs").exists()


def test_the_wandb_id_is_the_users_or_unique_to_the_folder_and_the_run_folder_can_be_named(
    tmp_path, monkeypatch
):
    from jsonargparse import Namespace

    from lightning_fedrep.app import cli as command
    from lightning_fedrep.app.runfolder import launcher_run_id, place_run, wandb_run_id

    def config(**wandb):
        logger = Namespace(class_path="lightning.pytorch.loggers.WandbLogger", init_args=Namespace(**wandb))
        return Namespace(trainer=Namespace(logger=logger, default_root_dir=None))

    one, other = tmp_path / "a" / "run" / "20260101-000000", tmp_path / "b" / "run" / "20260101-000000"
    mine = config(id="my-id")
    place_run(mine, one, resumed=False)
    assert mine.trainer.logger.init_args.id == "my-id"
    ids = []
    for folder in (one, other, one):
        chosen = config()
        place_run(chosen, folder, resumed=False)
        ids.append(chosen.trainer.logger.init_args.id)
    assert (
        ids[0] != ids[1] and ids[0] == ids[2] == wandb_run_id(one) and ids[0].startswith("20260101-000000-")
    )

    assert launcher_run_id({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    assert launcher_run_id({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}) == "slurm-77.1"
    assert launcher_run_id({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "77"}) is None  # one task: a normal run
    assert launcher_run_id({}) is None

    monkeypatch.chdir(tmp_path)
    named = tmp_path / "named"
    monkeypatch.setenv(command.RUN_FOLDER_VARIABLE, str(named))
    cli = build_cli(["fit", "--config", str(RECIPE), "--trainer.fast_dev_run=true"])
    assert cli.run_folder == named.resolve() and not Path("runs").exists()
    monkeypatch.delenv(command.RUN_FOLDER_VARIABLE)
    cli = build_cli(["fit", "--config", str(RECIPE), "--trainer.fast_dev_run=true"])
    assert cli.run_folder.parent.parent == (tmp_path / "runs" / "digits").resolve()
    assert command.RUN_FOLDER_VARIABLE not in os.environ  # not left to what the caller starts next


def test_predicting_with_another_module_is_refused_as_predict(tmp_path):
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    with pytest.raises(ValueError, match=r"trainer\.predict\(\) was given another module"):
        trainer.predict(TinyNet(), datamodule=tiny_datamodule(num_clients=6))


def test_validate_of_an_earlier_checkpoint_prints_and_writes_what_it_measured(tmp_path, capsys):
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=1)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=4,
        enable_checkpointing=True,
        callbacks=[checkpoints, RunSummary(str(tmp_path), figures=False)],
    )
    torch.manual_seed(0)
    model = TinyNet()
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6))
    final = strategy.results()["final"]["val/acc"]
    capsys.readouterr()
    (validated,) = trainer.validate(
        model,
        datamodule=tiny_datamodule(num_clients=6),
        ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt",
        verbose=False,
    )
    assert validated["val/acc"] != pytest.approx(final)  # an earlier state, so the check below can fail
    out = capsys.readouterr().out
    assert f"val/acc {validated['val/acc']:.4g}" in out and f"val/acc {final:.4g} " not in out + " "
    summary = json.loads((tmp_path / "summary.validate.json").read_text())
    per_client = summary["per_client"]["val"]["val/acc"]
    assert sum(per_client.values()) / len(per_client) == pytest.approx(validated["val/acc"])
    assert summary["metrics"]["val/acc"] == pytest.approx(validated["val/acc"])


def write_history(run: Path, metric: str) -> None:
    from lightning_fedrep.callbacks.run_files import write_rows

    run.mkdir(parents=True, exist_ok=True)
    write_rows(
        run / "history.csv",
        [
            {"round": r, metric: 1 - r / 10, f"{metric}_p10": 0.9 - r / 10, f"{metric}_min": 0.8 - r / 10}
            for r in range(5)
        ],
    )


@pytest.mark.parametrize(
    ("metric", "lowest"),
    [("val/acc", "worst client"), ("val/loss", "lowest-loss client")],
)
def test_the_band_below_the_mean_is_named_for_what_it_is(tmp_path, metric, lowest):
    from lightning_fedrep.app.report import run_figures

    write_history(tmp_path, metric)
    figure = run_figures(tmp_path)["accuracy_vs_round"]
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert f"{lowest} .. mean" in labels
    assert not any("worst" in label for label in labels) or metric == "val/acc"


def test_losses_are_told_from_accuracies_by_their_name():
    from lightning_fedrep.app.report import higher_is_better

    assert higher_is_better("val/acc") and higher_is_better("test/acc_weighted")
    for loss in ("val/loss", "val/val_ce", "test/mse", "val/nll_loss", "val/error"):
        assert not higher_is_better(loss), loss


def test_the_client_histogram_shows_the_stage_asked_for_or_the_newest(tmp_path):
    import os

    from lightning_fedrep.app.report import run_figures
    from lightning_fedrep.callbacks.run_files import write_rows

    write_history(tmp_path, "val/acc")
    write_rows(tmp_path / "clients_test.csv", [{"client": c, "test/acc": 0.5} for c in range(4)])
    write_rows(tmp_path / "clients_val.csv", [{"client": c, "val/acc": 0.7} for c in range(4)])
    os.utime(tmp_path / "clients_test.csv", ns=(1, 1))  # a test of an earlier call

    def title(stage=None):
        return run_figures(tmp_path, stage)["client_histogram"].axes[0].get_title()

    assert "last val evaluation" in title() and "last val evaluation" in title("val")
    assert "last test evaluation" in title("test")


def test_rounds_between_validations_keep_their_recorded_columns_and_draw_time_and_collapse(tmp_path):
    """SRPFL's simulated time and the NC metrics are recorded every round; with validation every second
    round, history.csv still has every round, and the time and collapse figures are drawn."""
    from lightning_fedrep import AdaptiveParticipation, FixedExponential, NeuralCollapse
    from tests.fixtures import MarkedTinyNet

    strategy = FedRepStrategy(clients_per_round=1.0, head_epochs=1, body_epochs=1, seed=3)
    callbacks = [
        AdaptiveParticipation(2, 2, latency=FixedExponential(rate=1.0, seed=1)),
        NeuralCollapse(lam=0, mu=0, nu=0, metrics_samples=20),
        RunSummary(str(tmp_path), print_table=False),
    ]
    trainer = quiet_trainer(strategy=strategy, max_epochs=4, check_val_every_n_epoch=2, callbacks=callbacks)
    torch.manual_seed(0)
    trainer.fit(MarkedTinyNet(), datamodule=tiny_datamodule(num_clients=6))
    history = rows(tmp_path / "history.csv")
    assert [int(r["round"]) for r in history] == [0, 1, 2, 3]
    assert all(r["sim/time"] and r["nc/global_nc2"] for r in history)
    assert [bool(r["val/acc"]) for r in history] == [False, True, False, True]
    times = [float(r["sim/time"]) for r in history]
    assert times == sorted(times) and times[0] > 0
    assert strategy.results()["final"]["val/acc"] == pytest.approx(float(history[3]["val/acc"]))
    for name in ("accuracy_vs_time", "neural_collapse", "accuracy_vs_round"):
        assert_png(tmp_path / "figures" / f"{name}.png")
    assert_run_figures_draw_the_tables(tmp_path)


def write_table(path: Path, table: list[dict]) -> None:
    """A CSV file written with the ``csv`` module (every row has every column; ``""`` for none)."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


def write_run(run: Path, shift: float) -> None:
    """A run folder's tables: 6 rounds (round 2 not validated), 4 clients, simulated time and an NC metric."""
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"algorithm": "fedrep"}))
    mean = [0.5, 0.62, None, 0.58, 0.8, 0.77]
    write_table(
        run / "history.csv",
        [
            {
                "round": r,
                "val/acc": "" if m is None else m + shift,
                "val/acc_p10": "" if m is None else m + shift - 0.1,
                "val/acc_min": "" if m is None else m + shift - 0.25 + 0.01 * r,
                "sim/time": 1.5 * r * r + 0.25,
                "nc/global_nc2": 1.0 / (r + 1),
            }
            for r, m in enumerate(mean)
        ],
    )
    write_table(
        run / "clients.csv",
        [
            {"round": r, "client": c, "val/acc": round(0.1 * c + 0.05 * r + shift, 6)}
            for r in (0, 1, 3, 4, 5)
            for c in range(4)
        ],
    )
    write_table(
        run / "clients_val.csv", [{"client": c, "val/acc": v} for c, v in enumerate((0.3, 0.9, 0.95, 1.0))]
    )
    write_table(run / "participation.csv", [{"client": c, "rounds": r} for c, r in enumerate((3, 0, 5, 2))])
    write_table(
        run / "partition.csv",
        [{"client": c, "label": k, "samples": 10 * c + k + 1} for c in range(4) for k in (c % 3, 3 + c % 2)],
    )


def test_the_figures_draw_the_run_folders_values_and_the_overlay_one_line_per_run(tmp_path):
    """Inspects the matplotlib objects, not PNG sizes. Catches an axes-only figure (``ax.plot`` dropped in
    ``_curve``), a curve drawn from another column (``metric`` -> ``f"{metric}_p10"``), a band to the p10
    instead of the worst client (``low = f"{metric}_p10"``), a transposed heatmap (``grid`` built rounds x
    clients), participation bars out of place, and an overlay that draws only the first run (``for run, rows
    in list(histories.items())[:1]``) or names two runs alike (``run_label`` -> the algorithm only)."""
    first, second = tmp_path / "fedrep-a", tmp_path / "fedrep-b"
    write_run(first, 0.0)
    write_run(second, 0.1)
    assert_run_figures_draw_the_tables(first)
    assert_overlay_draws_each_run([first, second])
    assert_overlay_draws_each_run([first, second], "sim/time", "accuracy_vs_time")
