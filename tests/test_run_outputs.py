"""What a run leaves behind: one folder per run (config, checkpoints, summary, tables, figures, W&B files),
never overwritten by another run, written into by the test of its checkpoint; the tables hold what the
strategy measured; ``lightning-fedrep report`` draws the figures again and overlays runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from lightning_fedrep import FedRepStrategy, RunSummary
from lightning_fedrep.cli import build_cli, main
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits" / "fedrep.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 5000, path  # a drawn figure, not an empty canvas


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
    logged = wandb_run.read_bytes()
    assert (
        b"val/*" in logged and b"figures/accuracy_vs_round" in logged
    )  # metrics by round, figures as images
    summary = json.loads((run / "summary.json").read_text())
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
