"""``lightning-fedrep fit --seeds`` (one recipe over seeds, sibling run folders) and ``lightning-fedrep table``
(mean ± sample std over seeds beside the paper's number, and the accuracy-vs-round figure over seeds).

References are restated here: numpy's mean and ``std(ddof=1)`` of the values read straight from each run's
``summary.json`` / ``history.csv`` with ``json``/``csv``, and the recipe header's rule for the figure
(``X_last10``: the last-10 mean, ``finetune/X``: the fine-tuning evaluation, else the last round).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_fedrep.app.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fit --config recipes/digits/fedrep.yaml --seeds 1,2`` for 3 rounds; the folder holding the seeds."""
    root = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("WANDB_MODE", "disabled")
        main(
            [
                "fit",
                "--config",
                str(RECIPES / "digits" / "fedrep.yaml"),
                "--seeds",
                "1,2",
                "--trainer.max_epochs=3",
                "--trainer.enable_progress_bar=false",
            ]
        )
    (group,) = {p.parent.parent for p in (root / "runs" / "digits").rglob("summary.json")}
    return group


def summaries(group: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(group.glob("*/summary.json"))}


def test_seeds_run_into_sibling_folders_each_with_its_seeds(sweep: Path):
    """Each seed has its own ``seed-<s>`` folder beside the other's, and its saved config sets
    ``seed_everything``, the strategy's and the data module's seed to ``s``, so the partitions differ.
    Catches a seed not applied to the data (``apply_seed`` skipping ``data``: the same partition in every
    run) or to the strategy, and seeds written into one folder (``seed_folder`` ignored)."""
    assert sorted(p.name for p in sweep.iterdir()) == ["seed-1", "seed-2"]
    partitions = []
    for seed in (1, 2):
        folder = sweep / f"seed-{seed}"
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["seed_everything"] == seed
        assert config["trainer"]["strategy"]["init_args"]["seed"] == seed
        assert config["data"]["init_args"]["seed"] == seed
        assert config["trainer"]["max_epochs"] == 3  # the command's other settings are kept
        with (folder / "partition.csv").open() as handle:
            partitions.append(sorted((r["client"], r["label"]) for r in csv.DictReader(handle)))
        assert "Seeds table: figure val/acc_last10" in (folder / "recipe.yaml").read_text()
    assert partitions[0] != partitions[1]


def test_table_is_the_mean_and_sample_std_of_the_summaries(sweep: Path, capsys: pytest.CaptureFixture):
    """``table`` on the sweep: one row for the recipe whose mean and std are numpy's ``mean`` and
    ``std(ddof=1)`` of ``results.last10["val/acc"]`` (the digits header's figure) over the seeds' summaries;
    CSV, Markdown and the printed table agree. Catches the population std (``n - 1`` -> ``n`` in ``Row.std``)
    and another figure read (``"last10"`` -> ``"final"`` in ``figure_value``)."""
    out = sweep.parent / "table"
    main(["table", str(sweep), "--out", str(out)])
    values = np.array([s["results"]["last10"]["val/acc"] for s in summaries(sweep).values()])
    with (out / "table.csv").open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["recipe"] == "digits/fedrep.yaml" and row["figure"] == "val/acc_last10"
    assert row["seeds"] == "1 2" and row["n"] == "2"
    assert float(row["mean"]) == pytest.approx(values.mean(), rel=1e-12)
    assert float(row["std"]) == pytest.approx(values.std(ddof=1), rel=1e-12)
    shown = f"{100 * values.mean():.2f} ± {100 * values.std(ddof=1):.2f}%"
    assert shown in (out / "table.md").read_text() and shown in capsys.readouterr().out


def history_column(run: Path, metric: str) -> dict[float, float]:
    with (run / "history.csv").open() as handle:
        return {float(r["round"]): float(r[metric]) for r in csv.DictReader(handle) if r.get(metric)}


def test_the_figure_draws_the_mean_over_seeds_with_a_band_of_one_std(sweep: Path):
    """The figure's line is the per-round numpy mean of the seeds' ``history.csv`` ``val/acc`` and its band
    spans mean ± ``std(ddof=1)``. Catches the line drawn from one seed, or the band drawn as ± the
    population std (``n - 1`` -> ``n`` in ``seed_curves``)."""
    from lightning_fedrep.app.table import collect, figure

    rows = collect([sweep])
    fig = figure(rows)
    ax = fig.axes[0]
    histories = [history_column(sweep / f"seed-{s}", "val/acc") for s in (1, 2)]
    rounds = sorted(histories[0])
    grid = np.array([[h[r] for r in rounds] for h in histories])
    mean, std = grid.mean(axis=0), grid.std(axis=0, ddof=1)
    (line,) = ax.get_lines()
    np.testing.assert_allclose(line.get_xdata(), rounds)
    np.testing.assert_allclose(line.get_ydata(), mean, rtol=1e-12)
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    for r, low, high in zip(rounds, mean - std, mean + std):
        ys = vertices[np.isclose(vertices[:, 0], r), 1]
        assert ys.min() == pytest.approx(low, rel=1e-9) and ys.max() == pytest.approx(high, rel=1e-9)
    import matplotlib.pyplot as plt

    plt.close(fig)


def fake_run(folder: Path, recipe: str, seed: int, results: dict, lr: float = 0.05) -> Path:
    """A run folder as ``--seeds`` leaves it: ``summary.json`` and the recipe's header as ``recipe.yaml``."""
    folder.mkdir(parents=True)
    config = {"seed_everything": seed, "config": [f"recipes/{recipe}"], "model": {"init_args": {"lr": lr}}}
    (folder / "summary.json").write_text(json.dumps({"results": results, "config": config}))
    (folder / "recipe.yaml").write_text((RECIPES / recipe).read_text())
    (folder / "history.csv").write_text("round,val/acc\n0,0.5\n")
    return folder


def test_table_reads_each_recipes_own_figure_and_paper_number(tmp_path: Path):
    """Three recipes whose headers name three kinds of figure: ``finetune/val/acc`` (FedAvg + FT),
    ``val/acc`` of the last round (Local Only) and ``val/acc_weighted_last10`` (FEMNIST FedRep); runs that
    differ in a setting other than the seed are separate rows; ``--paper fedrep-table1`` keeps only Table 1
    recipes. Catches the last-10 mean read for every figure, or the seed not removed from the grouping key."""
    from lightning_fedrep.app.table import collect

    rng = np.random.default_rng(0)
    expected = {}
    for recipe, section, name in (
        ("cifar10/100_2_fedavg_ft.yaml", "finetune", "finetune/val/acc"),
        ("cifar10/100_2_local.yaml", "final", "val/acc"),
        ("femnist/150_3_fedrep.yaml", "last10", "val/acc_weighted"),
    ):
        values = rng.uniform(0.5, 0.9, size=3)
        for seed, value in zip((1, 2, 3), values):
            decoy = {"final": {name: 0.0}, "last10": {name: 0.1}, "finetune": {name: 0.2}}
            decoy[section] = {name: float(value)}
            fake_run(tmp_path / recipe / f"seed-{seed}", recipe, seed, decoy)
        expected[recipe] = values
    fake_run(tmp_path / "other" / "seed-1", "digits/fedrep.yaml", 1, {"last10": {"val/acc": 0.7}}, lr=0.1)
    fake_run(tmp_path / "other" / "seed-2", "digits/fedrep.yaml", 2, {"last10": {"val/acc": 0.8}}, lr=0.2)
    rows = {row.recipe: row for row in collect([tmp_path])}
    for recipe, values in expected.items():
        row = rows[recipe]
        assert row.mean == pytest.approx(values.mean(), rel=1e-12)
        assert row.std == pytest.approx(values.std(ddof=1), rel=1e-12)
    assert rows["cifar10/100_2_fedavg_ft.yaml"].paper == "87.65%"  # FedRep Table 1, restated
    assert rows["femnist/150_3_fedrep.yaml"].paper == "78.56%"
    assert rows["cifar10/100_2_local.yaml"].paper_seeds.startswith("5 ")
    assert len([r for r in rows if r.startswith("digits/fedrep.yaml")]) == 2  # lr 0.1 and 0.2: two rows
    kept = collect([tmp_path], paper="fedrep-table1")
    assert sorted(row.recipe for row in kept) == sorted(expected)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["fit", "--config", "x.yaml", "--seeds", "1,x"], "--seeds='1,x'"),
        (["fit", "--config", "x.yaml", "--seeds", "1,1"], "repeats a seed"),
        (["test", "--config", "x.yaml", "--seeds", "1,2"], "'test'"),
        (["fit", "--config", "x.yaml", "--seeds", "1,2", "--seed_everything", "3"], "drop --seed_everything"),
        (
            [
                "fit",
                "--config",
                str(RECIPES / "digits" / "fedrep.yaml"),
                "--seeds",
                "1,2",
                "--trainer.devices=2",
            ],
            "trainer.devices=1",
        ),
    ],
)
def test_bad_seeds_are_refused_on_one_line(
    argv: list[str],
    words: str,
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """A bad ``--seeds`` stops the command before any run (no run folder), naming the option and the fix."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert not list(tmp_path.iterdir())
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and words in err


def test_the_recipes_readme_lists_the_seeds_each_paper_averaged():
    """recipes/README.md's last column, restated from the digests: FedRep's official scripts run 5 seeds
    (fedrep.md §5), the SRPFL scripts 4 (10, 20, 30, 40; srpfl.md §2), FLUTE does not say (flute.md §6)."""
    rows = {}
    for line in (RECIPES / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[-1]
    assert {p for p in rows if p.startswith(("cifar10/", "cifar100/", "femnist/"))} and all(
        v.startswith("5 ") for p, v in rows.items() if p.startswith(("cifar10/", "cifar100/", "femnist/"))
    )
    assert all(v.startswith("4 ") for p, v in rows.items() if p.startswith("srpfl/c"))
    assert all(v.startswith("not stated") for p, v in rows.items() if p.startswith("flute/"))
    assert rows["digits/fedrep.yaml"].startswith("—")
