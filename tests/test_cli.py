"""The ``lightning-fedrep`` command and the recipes it runs (in-process, offline)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_fedrep.app.cli import build_cli
from tests.fixtures import documented_pages

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def run_cli(*args):
    return build_cli(list(args))


def test_recipes_match_their_generator():
    run = subprocess.run(
        [sys.executable, str(RECIPES / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def readme_digits_example() -> tuple[dict[int, float], str]:
    """The per-client val/acc values and the summary line that README.md and docs/getting-started.md print for
    the digits recipe (every page that shows the example shows the same figures)."""
    marker = "Per-client val/acc (20 clients), summary in runs/digits"
    blocks = set()
    for text in documented_pages().values():
        if marker in text:
            block = text[text.index(marker) :]
            blocks.add(block[: block.index("```")])
    assert len(blocks) == 1, f"the pages show {len(blocks)} different digits examples"
    block = blocks.pop()
    shown = {int(c): float(v) for c, v in re.findall(r"#(\d+)\s+([\d.]+)", block)}
    line = next(line.strip() for line in block.splitlines() if line.strip().startswith("val/acc "))
    return shown, line


def test_digits_fedrep_recipe_runs_as_shipped(tmp_path, monkeypatch, capsys):
    """The documented CLI example (README.md, docs/getting-started.md): the whole recipe (30 rounds), offline,
    prints what the pages show, and its
    summary restates per-client values (numpy: mean, sample-weighted mean, std, linear 10th percentile, min,
    the mean of the last 10 rounds). Catches a change to the recipe's result that the pages do not show
    (e.g. ``alpha=weight`` -> ``alpha=1.0`` in ``WeightedAverage.add``), a summary figure computed another way
    (``std(correction=0)`` -> ``std()``) and ``last10`` over another number of rounds (``LAST_ROUNDS = 9``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = run_cli(
        "fit", "--config", str(RECIPES / "digits" / "fedrep.yaml"), "--trainer.enable_progress_bar=false"
    )
    out = capsys.readouterr().out
    assert "Per-client val/acc (20 clients)" in out
    summary_files = list(Path("runs/digits").rglob("summary.json"))
    assert len(summary_files) == 1
    summary = json.loads(summary_files[0].read_text())
    assert summary["rounds_completed"] == 30 and summary["algorithm"] == "fedrep"
    shown, line = readme_digits_example()
    assert len(shown) >= 10 and line in out  # the pages' figures, as printed
    per_client = {int(c): v for c, v in summary["per_client"]["val"]["val/acc"].items()}
    samples = {int(c): n for c, n in summary["per_client"]["val"]["samples"].items()}
    assert sorted(per_client) == sorted(samples) == list(range(20))
    for client, value in shown.items():
        assert f"{per_client[client]:.4g}" == f"{value:.4g}", client
    values = np.array([per_client[c] for c in range(20)])
    weights = np.array([samples[c] for c in range(20)], dtype=float)
    np.testing.assert_allclose(values * weights, np.round(values * weights), atol=1e-6)  # k of n correct
    final = summary["results"]["final"]
    expected = {
        "val/acc": values.mean(),
        "val/acc_weighted": (values * weights).sum() / weights.sum(),
        "val/acc_std": values.std(),
        "val/acc_p10": np.percentile(values, 10),
        "val/acc_min": values.min(),
    }
    assert {k: final[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    last10 = np.mean([row["val/acc"] for row in summary["history"] if row["round"] >= 20])
    assert summary["results"]["last10"]["val/acc"] == pytest.approx(last10, rel=1e-9)
    assert summary["config"]["trainer"]["strategy"]["init_args"]["head_epochs"] == 5
    assert list((summary_files[0].parent / "wandb").glob("offline-run-*")), "W&B did not log offline"
    assert cli.trainer.strategy.algorithm.name == "fedrep"


@pytest.mark.parametrize(
    "recipe",
    sorted(
        str(p.relative_to(RECIPES))
        for d in ("digits", "srpfl")
        for p in (RECIPES / d).glob("*.yaml")
        if d == "digits" or p.name.startswith("digits_")
    ),
)
def test_every_digits_recipe_smoke(recipe, tmp_path, monkeypatch):
    if recipe.startswith("digits/dp_"):  # DP (client-level, sample-level) accounts with the privacy extra
        pytest.importorskip("opacus")
        pytest.importorskip("dp_accounting")
    monkeypatch.chdir(tmp_path)
    cli = run_cli("fit", "--config", str(RECIPES / recipe), "--trainer.fast_dev_run=true")
    assert cli.trainer.global_step >= 1
    if recipe.startswith("digits/dp_"):  # the mechanism ran and accounted the round
        assert "privacy/epsilon" in cli.trainer.strategy.federation.history.rows[0]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (RECIPES / "synthetic").glob("*.yaml")))
def test_every_synthetic_recipe_smoke(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = run_cli("fit", "--config", str(RECIPES / "synthetic" / recipe), "--trainer.fast_dev_run=true")
    assert cli.trainer.global_step >= 1


def test_synthetic_recipe_reduced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = run_cli(
        "fit",
        "--config",
        str(RECIPES / "synthetic" / "fedrep_linear.yaml"),
        "--trainer.max_epochs=60",
        "--trainer.check_val_every_n_epoch=60",
        "--trainer.enable_progress_bar=false",
    )
    start = cli.model.hparams  # init="mom": the body starts at the method-of-moments estimate
    assert start.init == "mom"
    assert (
        cli.trainer.callback_metrics["val/principal_angle"] < 0.05
    )  # plain loop: ~1.5e-2 at t=50, 1e-3 at 100


def test_strategy_by_registered_name_and_cli_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = run_cli(
        "fit",
        "--config",
        str(RECIPES / "digits" / "fedrep.yaml"),
        "--trainer.fast_dev_run=true",
        "--trainer.strategy=fedper",
        "--trainer.logger=false",
    )
    assert cli.trainer.strategy.algorithm.name == "fedper"


def test_print_config_shows_the_strategy_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", str(RECIPES / "digits" / "fedrep.yaml"), "--print_config")
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["init_args"]["head_epochs"] == 5
    assert config["data"]["class_path"] == "lightning_fedrep.data.digits.DigitsDataModule"


def test_console_script_exits_zero_on_help():
    run = subprocess.run(
        [sys.executable, "-m", "lightning_fedrep.app.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "fit" in run.stdout


def write_recipe(tmp_path: Path, **strategy_args) -> Path:
    """The digits FedRep recipe with the strategy's init_args overridden (in YAML, as a user writes them)."""
    recipe = yaml.safe_load((RECIPES / "digits" / "fedrep.yaml").read_text())
    recipe["trainer"]["strategy"]["init_args"].update(strategy_args)
    recipe["trainer"]["logger"] = False
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("written, sampled", [("1", 1), ("1.0", 20), ("0.25", 5), ("3", 3)])
def test_clients_per_round_in_yaml_an_integer_is_a_count_a_float_a_fraction(
    tmp_path, monkeypatch, written, sampled
):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path)
    path.write_text(path.read_text().replace("clients_per_round: 0.5", f"clients_per_round: {written}"))
    cli = run_cli("fit", "--config", str(path), "--trainer.fast_dev_run=true")
    assert len(cli.trainer.strategy.round_plan(0).clients) == sampled


@pytest.mark.parametrize(
    "override, message",
    [
        ("--trainer.strategy.init_args.algorithm=fedrepp", "Unknown algorithm 'fedrepp'; choose one of"),
        ("--trainer.strategy.init_args.clients_per_round=5.0", "clients_per_round=5.0 is a float above 1"),
        ("--data.init_args.batch_size=0", "DigitsDataModule(batch_size=...) must be an integer >= 1"),
        (
            "--trainer.strategy=fedrepp",
            "trainer.strategy='fedrepp' is not a registered strategy. Did you mean 'fedrep'?",
        ),
    ],
)
def test_a_refused_value_in_a_recipe_stops_the_command_with_its_cause(
    tmp_path, monkeypatch, capsys, override, message
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FEDREP_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stop:
        run_cli("fit", "--config", str(write_recipe(tmp_path)), override)
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error and len(error.strip().splitlines()) <= 3


@pytest.mark.parametrize(
    "written, flags, expected",
    [
        ({"runner": "sequential"}, (), {"choice": "sequential"}),
        (
            {
                "runner": {
                    "class_path": "lightning_fedrep.RunnerSettings",
                    "init_args": {"choice": "sequential", "width": 2},
                }
            },
            (),
            {"choice": "sequential", "width": 2},
        ),
        (
            {"runner": {"choice": "sequential", "memory": 2**20}},
            (),
            {"choice": "sequential", "memory": 2**20},
        ),
        ({}, ("--trainer.strategy.init_args.runner.width=3",), {"width": 3}),
    ],
    ids=["choice", "class_path", "dict", "flag"],
)
def test_the_runner_setting_is_written_in_a_recipe_or_on_the_command_line(
    tmp_path, monkeypatch, written, flags, expected
):
    """Catches a ``runner`` the command cannot build from a recipe (a name, ``class_path``/``init_args``, the
    dataclass's fields) or from a ``--...runner.<field>`` flag."""
    from lightning_fedrep import RunnerSettings

    monkeypatch.chdir(tmp_path)
    cli = run_cli(
        "fit", "--config", str(write_recipe(tmp_path, **written)), "--trainer.fast_dev_run=true", *flags
    )
    assert cli.trainer.strategy.runner == RunnerSettings(**expected)


@pytest.mark.parametrize("old", [{"engine": "vectorized"}, {"engine_width": 4}], ids=str)
def test_a_recipe_with_an_old_engine_key_stops_naming_it(tmp_path, monkeypatch, capsys, old):
    """The keys before ``runner`` (``engine``, ``engine_width``, ...) stop the command (jsonargparse names the
    key), not silently ignored."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        run_cli("fit", "--config", str(write_recipe(tmp_path, **old)), "--trainer.fast_dev_run=true")
    assert stop.value.code == 2
    assert f"Option '{next(iter(old))}' is not accepted" in capsys.readouterr().err


def test_every_strategy_argument_has_help_text_and_short_class_names_work(capsys):
    import inspect

    from lightning_fedrep import FederatedDDPStrategy, FederatedStrategy
    from lightning_fedrep.session.session import FederatedSession

    def arguments(function):
        return [n for n in inspect.signature(function).parameters if n not in ("self", "kwargs", "args")]

    shared = arguments(FederatedSession.__init__)
    for cls in (FederatedStrategy, FederatedDDPStrategy):
        with pytest.raises(SystemExit):
            run_cli("fit", "--trainer.strategy.help", f"lightning_fedrep.{cls.__name__}")
        text = capsys.readouterr().out
        for name in shared + arguments(cls.__init__):
            flag = f"--trainer.strategy.{name} "
            assert flag in text, name
            after = text.split(flag, 2)[-1].split("\n", 1)[1].strip()
            assert not after.startswith("(type:"), f"{cls.__name__}({name}=...) has no help text"
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", "MLPClassifier")
    assert "--model.hidden" in capsys.readouterr().out


def test_a_run_prints_no_message_a_user_cannot_act_on(tmp_path):
    env = {**__import__("os").environ, "WANDB_MODE": "offline"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_fedrep.app.cli",
            "fit",
            "--config",
            str(RECIPES / "digits" / "fedrep.yaml"),
            "--trainer.max_epochs=1",
            "--trainer.enable_progress_bar=false",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    for message in ("LeafSpec", "litlogger", "anonymous setting", "smaller than the logging interval"):
        assert message not in output, message
