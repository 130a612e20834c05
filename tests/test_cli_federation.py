"""A checkpoint is evaluated only on its own federation, and a run's folder holds its own files.

- ``validate``/``test``/``predict`` of a checkpoint compare the data module's clients (number, sizes,
  which samples each holds) with the checkpoint's fingerprint, not just their number, in Python and in
  the command; the command refuses another federation on one line before it writes anything, and with
  ``allow_new_federation=True`` writes into a new run folder, never into the checkpoint's run.
- With TensorBoard or CSV loggers, ``config.yaml`` lands in the run folder, so ``--ckpt_path`` calls
  find the run (they used to open a new folder each time).
- A checkpoint file that does not read is refused by the command on one line naming it; new-client
  predictions (the global body only) are not compared with the checkpoint's partition.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_fedrep import DirichletPartitioner, FederatedDataModule, FedRepStrategy
from lightning_fedrep.app.cli import build_cli
from tests.fixtures import TinyNet, quiet_trainer, tiny_datasets

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits" / "fedrep.yaml"
FAST = [
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=true",
    "--trainer.strategy.init_args.head_epochs=1",
    "--trainer.callbacks.init_args.figures=false",
]


def dirichlet_datamodule(alpha: float) -> FederatedDataModule:
    train, test = tiny_datasets()
    return FederatedDataModule(train, test, partitioner=DirichletPartitioner(8, alpha=alpha), batch_size=8)


def strategy(**kwargs) -> FedRepStrategy:
    return FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0, **kwargs)


@pytest.fixture(scope="module")
def dirichlet_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dirichlet") / "alpha_0.5.ckpt"
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1, limit_val_batches=0)
    trainer.fit(TinyNet(), datamodule=dirichlet_datamodule(0.5))
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_evaluating_a_checkpoint_on_another_partition_of_as_many_clients_is_refused(
    dirichlet_checkpoint, call
):
    """Bug: evaluation compared only the number of clients (``federation_changes(num_clients=...)``), so a
    Dirichlet(alpha=100) federation of 8 clients was scored with the heads of the alpha=0.5 one."""
    run = getattr(quiet_trainer(strategy=strategy()), call)
    with pytest.raises(ValueError, match="saved by another federation") as refused:
        run(TinyNet(), datamodule=dirichlet_datamodule(100.0), ckpt_path=dirichlet_checkpoint)
    assert "partition" in str(refused.value) and "num_clients" not in str(refused.value)
    run = getattr(quiet_trainer(strategy=strategy()), call)
    run(TinyNet(), datamodule=dirichlet_datamodule(0.5), ckpt_path=dirichlet_checkpoint)  # its own: fine


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> Path:
    """One digits run with a CSVLogger (no W&B), with a checkpoint."""
    root = tmp_path_factory.mktemp("csv_run")
    cli = build_cli(
        [
            "fit",
            "--config",
            str(RECIPE),
            *FAST,
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.default_root_dir={root / 'runs'}",
        ]
    )
    return Path(cli.trainer.default_root_dir)


def checkpoint_of(run: Path) -> Path:
    """The run's ``last.ckpt`` (the digits recipes save it beside the last round's ``epoch=...ckpt``)."""
    return run / "checkpoints" / "last.ckpt"


def test_with_lightnings_default_logger_the_config_and_a_later_test_stay_in_the_run_folder(
    tmp_path, monkeypatch
):
    """Bug: Lightning's SaveConfigCallback wrote ``config.yaml`` into the first logger's ``log_dir``
    (``lightning_logs/version_0`` for the default TensorBoard logger), so ``folder_of_checkpoint`` did not
    recognise the run and every ``--ckpt_path`` call opened a new run folder (``config_filename`` in
    ``_attach_config`` not made absolute)."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(RECIPE), *FAST, "--trainer.logger=true"]
    run = Path(build_cli(["fit", *args]).trainer.default_root_dir)
    assert (run / "config.yaml").is_file() and (run / "lightning_logs").is_dir()
    assert not list(run.glob("*/*/config.yaml"))  # not in the logger's folder
    build_cli(["test", *args, f"--ckpt_path={checkpoint_of(run)}"])
    assert [p.name for p in run.parent.iterdir()] == [run.name]  # no second run folder
    assert (run / "config.test.yaml").is_file() and (run / "summary.test.json").is_file()


def test_with_a_csv_logger_the_config_and_a_later_test_stay_in_the_run_folder(csv_run, tmp_path, monkeypatch):
    """The same bug with a CSVLogger (``config.yaml`` in ``logs/fit``)."""
    monkeypatch.chdir(tmp_path)
    assert (csv_run / "config.yaml").is_file() and (csv_run / "logs" / "fit" / "metrics.csv").is_file()
    assert not list(csv_run.glob("*/*/config.yaml"))
    build_cli(
        [
            "test",
            "--config",
            str(RECIPE),
            *FAST,
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--ckpt_path={checkpoint_of(csv_run)}",
        ]
    )
    assert [p.name for p in csv_run.parent.iterdir()] == [csv_run.name] and not Path("runs").exists()
    assert (csv_run / "config.test.yaml").is_file() and (csv_run / "logs" / "test" / "metrics.csv").is_file()


REFUSED = {
    "test, another partition": ["test", "--data.init_args.classes_per_client=3"],
    "validate, another partition": ["validate", "--data.init_args.classes_per_client=3"],
    "predict personalized, 5 clients": [
        "predict",
        "--data.init_args.num_clients=5",
        "--trainer.strategy.init_args.predict=personalized",
    ],
    "fit, another seed": ["fit", "--trainer.max_epochs=2", "--trainer.strategy.init_args.seed=1"],
}


@pytest.mark.parametrize("call", REFUSED.values(), ids=REFUSED.keys())
def test_the_command_refuses_another_federation_on_one_line_before_writing_anything(
    csv_run, tmp_path, monkeypatch, capsys, call
):
    """Bug: the command ran ``trainer.<call>`` on another federation's checkpoint: with as many clients the
    test scored it (0.205 instead of 0.52 in the issue) and replaced the run's ``summary.test.json``;
    otherwise the strategy's refusal came as a traceback after ``config.<call>.yaml`` was written (remove
    ``self._check_checkpoint()`` from ``before_<call>``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    before = files_of(csv_run)
    checkpoint = checkpoint_of(csv_run)
    with pytest.raises(SystemExit) as stop:
        build_cli(
            [
                call[0],
                "--config",
                str(RECIPE),
                *FAST,
                "--trainer.logger=false",
                *call[1:],
                f"--ckpt_path={checkpoint}",
            ]
        )
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1, error
    assert f"ckpt_path='{checkpoint}'" in error and "saved by another federation" in error
    assert files_of(csv_run) == before and [p.name for p in csv_run.parent.iterdir()] == [csv_run.name]

    loose = tmp_path / "loose.ckpt"  # outside a run folder: the new folder it made is removed
    loose.write_bytes(checkpoint.read_bytes())
    with pytest.raises(SystemExit):
        build_cli(
            [
                call[0],
                "--config",
                str(RECIPE),
                *FAST,
                "--trainer.logger=false",
                *call[1:],
                f"--ckpt_path={loose}",
            ]
        )
    assert not Path("runs").exists()


def test_allow_new_federation_evaluates_into_a_new_run_folder(csv_run, tmp_path, monkeypatch):
    """Bug: with ``allow_new_federation=True`` the command evaluated another federation inside the
    checkpoint's run folder, replacing its ``summary.test.json`` (the ``_allows_new_federation`` branch
    of ``_place_run`` removed)."""
    monkeypatch.chdir(tmp_path)
    before = files_of(csv_run)
    cli = build_cli(
        [
            "test",
            "--config",
            str(RECIPE),
            *FAST,
            "--trainer.logger=false",
            "--data.init_args.classes_per_client=3",
            "--trainer.strategy.init_args.allow_new_federation=true",
            f"--ckpt_path={checkpoint_of(csv_run)}",
        ]
    )
    folder = Path(cli.trainer.default_root_dir)
    assert folder.parent.parent == (tmp_path / "runs" / "digits").resolve() and folder != csv_run
    assert len(json.loads((folder / "summary.test.json").read_text())["per_client"]["test"]["test/acc"]) == 20
    assert files_of(csv_run) == before


def test_a_run_saved_before_the_fix_with_its_config_in_a_logger_folder_is_still_found(tmp_path):
    """Bug: only ``<run>/config.yaml`` marked a run folder, so a run whose config Lightning had put in
    ``logs/fit`` or ``lightning_logs/version_0`` got a new folder at every call (``has_config`` ->
    ``(folder / "config.yaml").is_file()``)."""
    from lightning_fedrep.app.runfolder import config_filename, folder_of_checkpoint

    for logs in ("logs/fit", "lightning_logs/version_0"):
        run = tmp_path / logs.split("/")[0] / "run"
        (run / logs).mkdir(parents=True)
        (run / logs / "config.yaml").write_text("seed_everything: 0\n")
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"")
        assert folder_of_checkpoint(run / "checkpoints" / "last.ckpt") == run
        assert config_filename(run, "test") == "config.test.yaml"


class RunsCode:
    """Unpickling this runs code (writes a file): an object a weights-only load refuses."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["truncated", "unsafe"])
def test_the_command_refuses_an_unreadable_checkpoint_on_one_line_naming_it_before_writing(
    csv_run, tmp_path, monkeypatch, capsys, kind
):
    """Bug: LightningCLI's own read of ``ckpt_path`` (for its hyper-parameters, while parsing) raised torch's
    error as a traceback naming no file: ``OSError: [Errno 22]`` for a truncated file, the ten-line
    weights-only message for an object other than tensors (remove ``FedRepCLI._parse_ckpt_path``); and the
    command's early check returned silently on any load failure (``except Exception: return``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    data = checkpoint_of(csv_run).read_bytes()
    path = tmp_path / f"{kind}.ckpt"
    marker = tmp_path / "ran"
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        checkpoint = torch.load(checkpoint_of(csv_run), weights_only=True)
        checkpoint.setdefault("hyper_parameters", {})["payload"] = RunsCode(marker)
        torch.save(checkpoint, path)
    with pytest.raises(SystemExit) as stop:
        build_cli(["test", "--config", str(RECIPE), *FAST, "--trainer.logger=false", f"--ckpt_path={path}"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1, error
    assert f"ckpt_path='{path}'" in error
    expected = "truncated or corrupt" if kind == "truncated" else "drop those objects and save it again"
    assert expected in error, error
    assert not Path("runs").exists() and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_new_client_predictions_of_another_partition_are_not_refused(dirichlet_checkpoint):
    """Bug: ``predict="new_client"`` was refused on another partition of the same clients, though it
    uses only the global body and the initial head, which any federation may use (the partition check in
    ``process_dataloader`` run for every predict mode). Reference: the checkpoint's ``state_dict`` (global
    body, initial head) in a plain TinyNet, on each client's test samples."""
    datamodule = dirichlet_datamodule(100.0)
    s = strategy(predict="new_client")
    outputs = quiet_trainer(strategy=s).predict(
        TinyNet(), datamodule=datamodule, ckpt_path=dirichlet_checkpoint
    )
    assert s.prediction_mode == "new_client"
    net = TinyNet()
    net.load_state_dict(torch.load(dirichlet_checkpoint, weights_only=True)["state_dict"])
    for client in range(8):
        data = datamodule.client_data(client, "test")
        x = data.dataset.tensors[0][data.indices]
        predicted = [o for o, c in zip(outputs, s.prediction_clients) if c == client]
        torch.testing.assert_close(torch.cat(predicted), net(x).detach(), msg=str(client))


def test_the_command_predicts_new_clients_of_another_partition(csv_run, tmp_path, monkeypatch):
    """The same bug in the command (``checkpoint_changes`` refusing before ``predict`` ran)."""
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "predict",
            "--config",
            str(RECIPE),
            *FAST,
            "--trainer.logger=false",
            "--data.init_args.classes_per_client=3",
            "--trainer.strategy.init_args.predict=new_client",
            f"--ckpt_path={checkpoint_of(csv_run)}",
        ]
    )
    assert cli.trainer.strategy.prediction_mode == "new_client"
    assert (Path(cli.trainer.default_root_dir) / "predictions.pt").is_file()
