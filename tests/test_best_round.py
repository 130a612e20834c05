"""The best round (``val/acc_best``, ``val/acc_weighted_best``: PFLlib's leaderboard figure, selected on the
evaluated split, optimistic) beside the last-10 headline (issue 41, item 4).

References are closed forms restated here: the maximum of the fabricated per-round values (numpy's
running maximum for the logged values), and for ``lightning-fedrep table`` numpy's mean and
``std(ddof=1)`` of the values written into fabricated run folders.
"""

from __future__ import annotations

import csv
import json
import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.evaluation.metrics import EvaluationPass
from lightning_fedrep.evaluation.records import pass_values
from lightning_fedrep.federation.history import History
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

ROOT = Path(__file__).resolve().parents[1]


def _pass(accs: dict[int, float], sizes: dict[int, int]) -> EvaluationPass:
    """A validation pass whose client ``c`` scored ``accs[c]`` on ``sizes[c]`` samples."""
    evaluation = EvaluationPass("val", lambda *a: nullcontext(set()), len)
    for client, acc in accs.items():
        evaluation.metrics.add("val/acc", client, acc * sizes[client], sizes[client])
        evaluation.metrics.samples[client] += sizes[client]
    return evaluation


def test_best_is_the_maximum_over_the_evaluated_rounds_and_survives_the_state_dict():
    """A fabricated history of 30 rounds (one NaN round, passed over): ``results()["best"]`` is the max of
    each headline accuracy's per-round values, ``best_round`` the first round reaching it, and a History
    restored from ``state_dict`` (what a checkpoint holds) gives the same. Catches ``min`` for ``max``, the
    last round's value, a NaN round winning, and a loss or a user metric swept in."""
    rng = np.random.default_rng(3)
    acc, pooled, loss = rng.random(30), rng.random(30), rng.random(30)
    pooled[7] = math.nan
    history = History()
    for r in range(30):
        history.add_evaluation(r, {"val/acc": acc[r], "val/acc_weighted": pooled[r], "val/loss": loss[r]})
    results = history.results()
    assert results["best"] == {"val/acc": acc.max(), "val/acc_weighted": np.nanmax(pooled)}
    assert results["best_round"] == {"val/acc": acc.argmax(), "val/acc_weighted": np.nanargmax(pooled)}
    restored = History()
    restored.load_state_dict(json.loads(json.dumps(history.state_dict())))
    assert restored.results()["best"] == results["best"]
    nan = History()
    nan.add_evaluation(0, {"val/acc": math.nan})
    assert math.isnan(nan.results()["best"]["val/acc"]) and nan.results()["best_round"] == {"val/acc": -1.0}


def test_logged_best_is_the_running_maximum_of_the_rounds_so_far():
    """``pass_values`` logs, each round, the maximum over the rounds so far of the client mean and of the
    pooled accuracy (total correct over total samples): numpy's running maximum of the restated values.
    Catches the round's own value logged as its best, and the mean over clients logged as the pooled best."""
    rng = np.random.default_rng(0)
    sizes = {0: 3, 1: 5, 2: 8}
    n = np.array(list(sizes.values()), dtype=float)
    history, logged, means, pooled = History(), [], [], []
    for round_index in range(15):
        accs = {c: float(rng.random()) for c in sizes}
        logged.append(pass_values(_pass(accs, sizes), history, round_index, prefix="", in_fit=True))
        acc = np.array([accs[c] for c in sizes])
        means.append(acc.mean())
        pooled.append((acc * n).sum() / n.sum())
    np.testing.assert_allclose([v["val/acc_best"] for v in logged], np.maximum.accumulate(means), rtol=1e-6)
    np.testing.assert_allclose(
        [v["val/acc_weighted_best"] for v in logged], np.maximum.accumulate(pooled), rtol=1e-6
    )
    assert "val/loss_best" not in logged[-1]


def test_best_survives_a_resume_from_a_checkpoint(tmp_path: Path):
    """Fit 2 rounds, plant an impossible pooled accuracy (1.5) in round 0 of the checkpoint's history, resume
    to 4 rounds: the logged ``val/acc_weighted_best`` of the resumed rounds and ``results()`` are 1.5 at round
    0, so the best is taken over the checkpointed rounds too, not only over those run after the resume."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)

    def trainer(rounds: int, *callbacks):
        strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1)
        return strategy, quiet_trainer(
            strategy=strategy,
            max_epochs=rounds,
            enable_checkpointing=bool(callbacks) and callbacks[0] is checkpoints,
            default_root_dir=tmp_path,
            callbacks=list(callbacks),
        )

    torch.manual_seed(0)
    _, first = trainer(2, checkpoints)
    first.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6))
    path = tmp_path / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["lightning_fedrep"]["history"]["evaluations"][0]["val/acc_weighted"] = 1.5
    torch.save(checkpoint, path)

    logged = []

    class Logged(Callback):
        def on_validation_end(self, trainer, pl_module):
            logged.append(float(trainer.callback_metrics["val/acc_weighted_best"]))

    strategy, resumed = trainer(4, Logged())
    resumed.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6), ckpt_path=path)
    assert logged == [1.5, 1.5]
    assert strategy.results()["best"]["val/acc_weighted"] == 1.5
    assert strategy.results()["best_round"]["val/acc_weighted"] == 0


# ----------------------------------------------------------------------------- lightning-fedrep table

SEEDS_LINE = "# Seeds table: figure val/acc_last10; paper —; seeds the paper averaged: 3\n"
BOARD_LINE = "# Leaderboard: figure val/acc_weighted_best; PFLlib 55.02 ± 0.33 (best round, pooled, 3 runs)\n"
ABSENT_LINE = "# Leaderboard: figure val/acc_weighted_best; PFLlib: not on the leaderboard\n"


def fake_run(folder: Path, recipe: str, header: str, seed: int, last10: float, best: float) -> Path:
    """A run folder as ``--seeds`` leaves it: ``summary.json`` and the recipe's header as ``recipe.yaml``."""
    folder.mkdir(parents=True)
    results = {
        "final": {"val/acc": 0.0, "val/acc_weighted": 0.0},
        "last10": {"val/acc": last10, "val/acc_weighted": 0.1},
        "best": {"val/acc": 0.2, "val/acc_weighted": best},
    }
    config = {"seed_everything": seed, "config": [f"recipes/{recipe}"]}
    (folder / "summary.json").write_text(json.dumps({"results": results, "config": config}))
    (folder / "recipe.yaml").write_text(header + "trainer:\n  max_epochs: 3\n")
    (folder / "history.csv").write_text("round,val/acc\n0,0.5\n")
    return folder


def test_table_adds_the_leaderboard_figure_beside_the_headline(tmp_path: Path, capsys):
    """Two recipes with a ``# Leaderboard`` line (one on the leaderboard, one not) and one without: the
    table keeps the headline (last-10) and adds the best round's mean ± std over seeds (numpy's) and
    PFLlib's number; the recipe without the line shows dashes there. Catches the headline replaced by the
    best round, and the leaderboard figure read from another section (``last10``)."""
    from lightning_fedrep.app.cli import main

    rng = np.random.default_rng(1)
    last10, best = rng.uniform(0.4, 0.6, 3), rng.uniform(0.6, 0.8, 3)
    for seed in range(3):
        fake_run(
            tmp_path / "a" / f"seed-{seed}",
            "pfllib/a.yaml",
            BOARD_LINE + SEEDS_LINE,
            seed,
            last10[seed],
            best[seed],
        )
        fake_run(tmp_path / "b" / f"seed-{seed}", "pfllib/b.yaml", SEEDS_LINE + ABSENT_LINE, seed, 0.5, 0.7)
    fake_run(tmp_path / "c" / "seed-0", "digits/x.yaml", SEEDS_LINE, 0, 0.5, 0.9)
    out = tmp_path / "table"
    main(["table", str(tmp_path), "--out", str(out)])
    with (out / "table.csv").open() as handle:
        rows = {row["recipe"]: row for row in csv.DictReader(handle)}
    a = rows["pfllib/a.yaml"]
    assert float(a["mean"]) == pytest.approx(last10.mean(), rel=1e-12)
    assert a["leaderboard_figure"] == "val/acc_weighted_best"
    assert float(a["leaderboard_mean"]) == pytest.approx(best.mean(), rel=1e-12)
    assert float(a["leaderboard_std"]) == pytest.approx(best.std(ddof=1), rel=1e-12)
    assert a["leaderboard_pfllib"] == "55.02 ± 0.33 (best round, pooled, 3 runs)"
    assert rows["pfllib/b.yaml"]["leaderboard_pfllib"] == "not on the leaderboard"
    assert rows["digits/x.yaml"]["leaderboard_figure"] == ""
    text = (out / "table.md").read_text()
    shown = f"{100 * best.mean():.2f} ± {100 * best.std(ddof=1):.2f}%"
    line = next(line for line in text.splitlines() if "pfllib/a.yaml" in line)
    assert f"{100 * last10.mean():.2f} ± {100 * last10.std(ddof=1):.2f}%" in line
    assert f"| `val/acc_weighted_best` | {shown} | 55.02 ± 0.33 (best round, pooled, 3 runs) |" in line
    assert "| — | — | — |" in next(line for line in text.splitlines() if "digits/x.yaml" in line)
    assert shown in capsys.readouterr().out


def test_table_without_leaderboard_lines_is_unchanged(tmp_path: Path):
    """Recipes without the line: no leaderboard column in the Markdown or the CSV (the table as before)."""
    from lightning_fedrep.app.table import collect, csv_rows, markdown

    for seed in range(2):
        fake_run(tmp_path / "c" / f"seed-{seed}", "digits/x.yaml", SEEDS_LINE, seed, 0.5 + seed / 10, 0.9)
    rows = collect([tmp_path])
    assert markdown(rows).splitlines()[0] == (
        "| recipe | figure | seeds | mean ± std (ddof=1) | paper | seeds the paper averaged |"
    )
    assert not any(key.startswith("leaderboard") for key in csv_rows(rows)[0])


def test_table_reads_a_best_figure_from_the_best_section():
    """``X_best`` reads ``results["best"][X]``, and its curve is ``history.csv``'s ``X``."""
    from lightning_fedrep.app.table import curve_metric, figure_value

    results = {"final": {"val/acc": 0.1}, "last10": {"val/acc": 0.2}, "best": {"val/acc": 0.3}}
    assert figure_value(results, "val/acc_best") == 0.3
    assert figure_value(results, "val/acc_last10") == 0.2
    assert curve_metric("val/acc_weighted_best") == "val/acc_weighted"


# ----------------------------------------------------------------------------- the benchmark script


def test_best_round_bias_script_runs_reduced():
    """``benchmarks/evaluation/best_round_bias.py`` reduced to 3 rounds, one seed, one method: the figures it
    prints are the run's history (best = max of the pooled per-round values, best ≥ last-10 ≥ min)."""
    from benchmarks.evaluation.best_round_bias import figures, fit, report

    strategy = fit("fedavg", seed=0, rounds=3)
    got = figures(strategy)
    pooled = [100 * row["val/acc_weighted"] for row in strategy.history]
    assert len(pooled) == 3
    assert got["best"] == pytest.approx(max(pooled)) and got["final"] == pytest.approx(pooled[-1])
    assert got["last10"] == pytest.approx(np.mean(pooled))
    assert "best round (leaderboard)" in report({(3, 0.5): {"fedavg": [got]}}, [0])
