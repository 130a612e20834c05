"""The command's habits (issue 43): ``lightning-fedrep --help`` lists every subcommand and ``--seeds``; a
refused setting prints one paragraph (no traceback), exits with status 2 and leaves no run folder behind
(nor anything new in an existing one); an error that is not a refusal keeps its traceback; the digits
recipes save ``checkpoints/last.ckpt``, which ``lightning-fedrep test --ckpt_path`` reads as the docs write it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.nn import functional as F

from lightning_fedrep.app.cli import build_cli, main
from lightning_fedrep.app.refusals import Refused, refusal_message
from lightning_fedrep.federation.api.arguments import check_int
from tests.fixtures import MarkedTinyNet, documented_pages

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "digits" / "fedrep.yaml"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.callbacks.init_args.figures=false"]
# W&B keeps the mode (offline, disabled) of its first run in a process: in-process runs here leave it alone
NO_WANDB = "--trainer.logger=false"
SUBCOMMANDS = ("fit", "validate", "test", "predict", "table", "report")


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes, but W&B's own debug logs (``wandb/<run>/logs/``): the
    detached ``wandb-core`` service of an earlier command may still append to them when this is read."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not _wandb_debug_log(p.relative_to(folder))
    }


def _wandb_debug_log(path: Path) -> bool:
    return len(path.parts) > 3 and path.parts[0] == "wandb" and path.parts[2] == "logs"


def refused(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run the command (in this process), expect a refusal; the one line it printed."""
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error, error
    lines = [line for line in error.splitlines() if line.startswith("lightning-fedrep: error: ")]
    assert len(lines) == 1, error
    return lines[0]


def test_help_lists_every_subcommand_and_seeds_each_with_a_description(capsys):
    """Bug: ``--help`` listed only Lightning's fit/validate/test/predict (two of them cut mid-sentence),
    neither ``table``, ``report`` (run by ``main`` before any parsing) nor ``--seeds`` (taken off the
    command line by ``main``) (``list_package_commands`` not called)."""
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: lightning-fedrep ")
    listed = text.split("Available subcommands:", 1)[1]
    entries = {
        line.split()[0]: line for line in listed.splitlines() if line.startswith("    ") and line.split()
    }
    for name in SUBCOMMANDS:
        assert name in entries and len(entries[name].split()) > 3, name  # named, with its description
    assert re.search(r"--seeds S1,S2,\.\.\.\s+fit only: run fit once per seed", text)
    for name in ("table", "report"):  # each runs its own help; build_cli refuses what only main runs
        with pytest.raises(SystemExit) as stop:
            main([name, "--help"])
        assert stop.value.code == 0 and f"lightning-fedrep {name}" in capsys.readouterr().out
        with pytest.raises(SystemExit) as stop:
            build_cli([name])
        assert stop.value.code == 2 and "not by build_cli" in capsys.readouterr().err


def command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``lightning-fedrep ARGS`` as a user runs it: a new process (this checkout's package), W&B offline."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    env.pop("LIGHTNING_FEDREP_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "lightning_fedrep.app.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


def test_the_issues_refused_setting_prints_one_paragraph_and_leaves_no_run_folder(tmp_path):
    """The issue's example, as a user runs it: ``clients_per_round=40`` of the digits' 20 clients is refused
    at the fit's set-up, after the run folder, ``config.yaml`` and W&B's offline files were made. Bug: a
    20-frame traceback and a partial run folder."""
    run = command(
        "fit", "--config", str(RECIPE), "--trainer.strategy.init_args.clients_per_round=40", cwd=tmp_path
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    (line,) = [line for line in run.stderr.splitlines() if "error:" in line]
    assert line.startswith("lightning-fedrep: error: clients_per_round=40 is more than the 20 clients")
    assert sorted(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    "setting, message",
    [
        ("--trainer.strategy.init_args.clients_per_round=40", "clients_per_round=40 is more than"),  # set-up
        ("--trainer.accumulate_grad_batches=2", "accumulate_grad_batches"),  # set-up, Trainer check
        ("--data.init_args.batch_size=0", "DigitsDataModule(batch_size=...) must be an integer >= 1"),
        ("--trainer.strategy.init_args.algorithm=fedrepp", "Unknown algorithm 'fedrepp'"),  # union-typed
        ("--trainer.devices=0", "`Trainer(devices='0')` value is not a valid input"),  # Lightning's own
    ],
)
def test_a_refused_setting_stops_the_command_in_one_paragraph_with_no_run_folder(
    tmp_path, monkeypatch, capsys, setting, message
):
    """At construction and at the fit's set-up, the package's and Lightning's refusals print one line
    with the message and exit 2; the run folder the command made (empty, or holding ``config.yaml``) is
    removed with the folders above it it made. Bugs: set-up refusals came as tracebacks (the ``except``
    in ``FedRepCLI.__init__``), every refusal left its run folder (``_take_back_refused_run``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    line = refused(capsys, "fit", "--config", str(RECIPE), NO_WANDB, *QUIET, setting)
    assert message in line
    assert sorted(tmp_path.rglob("*")) == []


def test_a_seed_sweep_refused_at_its_first_seed_leaves_no_sweep_folder(tmp_path, monkeypatch, capsys):
    """``--seeds``: the refused first seed's folder and the sweep's folder above it are removed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    line = refused(
        capsys,
        *("fit", "--config", str(RECIPE), "--seeds", "1,2", NO_WANDB, *QUIET),
        "--trainer.strategy.init_args.clients_per_round=40",
    )
    assert "clients_per_round=40" in line
    assert sorted(tmp_path.rglob("*")) == []


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make demo``'s command, ``lightning-fedrep fit --config recipes/digits/fedrep.yaml``, run where a
    copy of the recipe lies, shortened to 2 rounds; its run folder."""
    root = tmp_path_factory.mktemp("demo")
    (root / "recipes" / "digits").mkdir(parents=True)
    (root / "recipes" / "digits" / "fedrep.yaml").write_bytes(RECIPE.read_bytes())
    run = command("fit", "--config", "recipes/digits/fedrep.yaml", "--trainer.max_epochs=2", *QUIET, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    (folder,) = (root / "runs" / "digits" / "digits-fedrep").iterdir()
    return folder


def test_the_digits_demo_saves_last_ckpt_and_the_documented_test_command_reads_it(demo_run):
    """Bug: the digits recipes switched checkpointing off, so the docs' ``lightning-fedrep test --config
    recipes/digits/fedrep.yaml --ckpt_path runs/digits/digits-fedrep/<run id>/checkpoints/last.ckpt`` had no
    file to read (``checkpoints=False`` in ``digits_recipe``). The command as the docs write it (the run id
    filled in), run where the demo ran, scores every client of the run, into the run's folder."""
    last = demo_run / "checkpoints" / "last.ckpt"
    assert last.is_file()
    assert torch.load(last, weights_only=True)["epoch"] == 1  # the last of the 2 rounds
    documented = {
        match.group(1)
        for text in documented_pages().values()
        for match in re.finditer(
            r"lightning-fedrep (test --config recipes/digits/\S+ --ckpt_path \S*?(?:<run id>\S*)?)(?:\s|$)",
            text,
        )
    }
    assert documented, "no page shows the digits demo's test command"
    for line in documented:
        (demo_run / "summary.test.json").unlink(missing_ok=True)
        run = command(*line.replace("<run id>", demo_run.name).split(), *QUIET, cwd=demo_run.parents[3])
        assert run.returncode == 0, run.stderr[-3000:]
        tested = json.loads((demo_run / "summary.test.json").read_text())
        assert len(tested["per_client"]["test"]["test/acc"]) == 20


def test_a_refused_call_into_an_existing_run_folder_takes_back_only_what_it_added(
    demo_run, tmp_path, monkeypatch, capsys
):
    """Continuing the demo run with a setting the fit's set-up refuses: the command wrote
    ``config.fit.yaml`` into the run's folder before the refusal; it removes that and nothing of the run
    (bug: ``RunFolderRecord.remove_additions`` ignoring what the folder held before would leave it, or
    removing the folder would lose the run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    before = files_of(demo_run)
    line = refused(
        capsys,
        *("fit", "--config", str(RECIPE), NO_WANDB, *QUIET, "--trainer.max_epochs=3"),
        *("--trainer.accumulate_grad_batches=2", f"--ckpt_path={demo_run / 'checkpoints' / 'last.ckpt'}"),
    )
    assert "accumulate_grad_batches" in line
    assert files_of(demo_run) == before
    assert sorted(tmp_path.iterdir()) == []


class ModuleWithItsOwnCheck(MarkedTinyNet):
    """A user's module whose own set-up refuses to run: its error is not the package's."""

    def setup(self, stage: str) -> None:
        raise ValueError("the module's own check failed")


def test_an_error_that_is_not_a_refusal_keeps_its_traceback(tmp_path, monkeypatch):
    """A ``ValueError`` of the user's module at set-up propagates as itself (its traceback printed by
    Python), not as the command's paragraph (bug: every ``ValueError`` taken for a refusal)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="the module's own check failed"):
        main(
            ["fit", "--config", str(RECIPE), NO_WANDB, *QUIET] + [f"--model={__name__}.ModuleWithItsOwnCheck"]
        )


def raise_from(function, *args):
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 (the error is the result)
        return error
    raise AssertionError("no error")


def test_refusals_are_the_errors_raised_on_purpose_by_the_package_or_lightning():
    """The rule behind the paragraphs: an argument check of the package (a ``raise`` statement in
    ``lightning_fedrep``), Lightning's ``MisconfigurationException`` and the command's own ``Refused``
    are refusals; an error Python raised inside the package (here a comparison of an int with a str in
    ``check_int``: a bug) and torch's error about the user's tensors are not."""
    message = refusal_message(raise_from(check_int, "rounds", 0, 1))
    assert (
        message
        == "rounds must be an integer >= 1, got 0. (set LIGHTNING_FEDREP_TRACEBACK=1 for the traceback)"
    )
    assert (
        refusal_message(Refused("ckpt_path='x' is not a file\nof this run"))
        == "ckpt_path='x' is not a file of this run"
    )
    assert "devices" in refusal_message(raise_from(_misconfigured))
    assert refusal_message(raise_from(check_int, "rounds", 3, "one")) is None
    assert refusal_message(raise_from(F.cross_entropy, torch.zeros(3, 2), torch.zeros(4).long())) is None
    assert refusal_message(raise_from(int, "three")) is None


def _misconfigured():
    raise MisconfigurationException("`Trainer(devices=0)` is not valid")
