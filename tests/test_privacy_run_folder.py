"""The mechanism and its ε in the run folder: ``summary.json``'s ``privacy``, the printed line, the figures, the
``lightning-fedrep report`` line and the ``lightning-fedrep table`` column.

Every value is read back independently: the final ε from ``history.csv`` with the ``csv`` module (and, for the
accounted run, recomputed by dp-accounting from the run's own sampling: 4 of 8 clients without replacement, σ 1,
3 rounds), the mechanism's settings against what the test passed, the figures' lines against the history's
columns, and a run without a mechanism checked for the absence of every privacy entry.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from lightning_fedrep import FederatedStrategy, RunSummary
from lightning_fedrep.callbacks.privacy_record import privacy_section, wandb_summary
from lightning_fedrep.privacy import AdaptiveClipping, ClientLevelDP
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

ROUNDS, CLIENTS, COHORT, DELTA = 3, 8, 4, 1e-5
FIGURE_HEADER = "# Seeds table: figure val/acc; paper —; seeds the paper averaged: —\n"


def needs_extra() -> None:
    pytest.importorskip("dp_accounting")
    pytest.importorskip("opacus")


def fit_into(
    folder: Path, privacy=None, name: str = "run", model=None
) -> tuple[FederatedStrategy, Path, str]:
    """A FedRep fit of ``ROUNDS`` rounds, ``COHORT`` of ``CLIENTS`` clients, validated every round, with a
    ``RunSummary`` into ``folder/name`` (its config naming a recipe with a table header); the strategy, the run
    folder and what the summary printed."""
    import contextlib
    import io

    run = folder / name
    recipe = folder / f"{name}.yaml"
    recipe.write_text(FIGURE_HEADER)
    summary = RunSummary(str(run))
    summary.config = {"config": [str(recipe)], "seed_everything": 1, "name": name}
    strategy = FederatedStrategy(
        head="classifier",
        clients_per_round=COHORT,
        head_epochs=1,
        seed=3,
        weighting="uniform",
        privacy=privacy,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=1.0, callbacks=[summary])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(
            model if model is not None else TinyNet(),
            datamodule=tiny_datamodule(num_clients=CLIENTS, seed=1, batch_size=8),
        )
    return strategy, run, printed.getvalue()


def history_csv(run: Path) -> list[dict[str, str]]:
    with (run / "history.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def column(run: Path, name: str) -> list[tuple[float, float]]:
    """``(round, value)`` of every ``history.csv`` row holding ``name``, read with the ``csv`` module."""
    return [(float(r["round"]), float(r[name])) for r in history_csv(run) if r.get(name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[FederatedStrategy, Path, str]]:
    """Three runs side by side: accounted client-level DP, adaptive clipping without an accountant, and no
    mechanism."""
    needs_extra()
    folder = tmp_path_factory.mktemp("privacy_runs")
    adaptive = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_noise_std=1.0)
    return {
        "dp": fit_into(folder, ClientLevelDP(clip=1.0, noise_multiplier=1.0, delta=DELTA), "dp"),
        "unaccounted": fit_into(
            folder,
            ClientLevelDP(clip=0.5, noise_multiplier=1.0, delta=DELTA, adaptive=adaptive, accountant=None),
            "unaccounted",
        ),
        "plain": fit_into(folder, None, "plain"),
    }


def test_describe_states_the_settings_passed_and_no_epsilon():
    """``ClientLevelDP.describe()`` before any round: the arguments as given, the sampling not known yet.
    Catches a setting reported from another attribute (the adaptive clip's quantile, the given noise)."""
    adaptive = AdaptiveClipping(target_quantile=0.7, learning_rate=0.1, count_noise_std=2.0)
    mechanism = ClientLevelDP(clip=2.5, noise_multiplier=1.3, delta=1e-6, adaptive=adaptive, accountant=None)
    assert mechanism.describe() == {
        "mechanism": "ClientLevelDP",
        "unit": "client",
        "clip": 2.5,
        "adaptive": {"target_quantile": 0.7, "learning_rate": 0.1, "count_noise_std": 2.0},
        "current_clip": 2.5,
        "noise_multiplier": 1.3,
        "target_epsilon": None,
        "delta": 1e-6,
        "accountant": None,
        "sampling": None,
        "sample_rate": None,
        "population": None,
        "rounds": None,
        "released": 0,
    }
    json.dumps(mechanism.describe())  # plain values: summary.json holds them as they are


def test_the_summary_states_the_mechanism_and_the_last_rounds_epsilon(runs):
    """``summary.json``'s ``privacy``: the ε of ``history.csv``'s last row (and dp-accounting's ε of the same
    three rounds), the settings passed, the sampling as drawn; the printed line says the same. Catches the ε
    of another round (the first, or the last evaluated one's ``results.final``), a δ or a sampling invented
    by the summary."""
    import dp_accounting

    strategy, run, printed = runs["dp"]
    section = json.loads((run / "summary.json").read_text())["privacy"]
    spent = column(run, "privacy/epsilon")
    assert [r for r, _ in spent] == list(range(ROUNDS))
    assert section["epsilon"] == spent[-1][1] and section["epsilon_round"] == ROUNDS - 1
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        CLIENTS,
        COHORT,
        dp_accounting.GaussianDpEvent(1.0 / 2),  # replace-one: sensitivity 2 clip
    )
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, ROUNDS))
    assert math.isclose(section["epsilon"], accountant.get_epsilon(DELTA), rel_tol=1e-9)
    mechanism = section["mechanism"]
    expected = {"mechanism": "ClientLevelDP", "clip": 1.0, "noise_multiplier": 1.0, "delta": DELTA}
    expected |= {"accountant": "rdp", "adaptive": None, "target_epsilon": None, "released": ROUNDS}
    expected |= {"sampling": "without_replacement", "sample_rate": COHORT / CLIENTS, "population": CLIENTS}
    assert {k: mechanism[k] for k in expected} == expected
    assert section["delta"] == DELTA
    epsilon = f"ε {spent[-1][1]:.4g} at δ 1e-05 after round {ROUNDS - 1}"
    assert f"{COHORT} of {CLIENTS} clients per round without replacement" in section["statement"]
    assert section["statement"].endswith(epsilon)
    assert f"Privacy: {section['statement']}" in printed
    assert strategy.config.privacy.describe() == mechanism


def test_a_mechanism_without_accountant_says_not_accounted_and_its_last_clip(runs):
    """Adaptive clipping, ``accountant=None``: no ε anywhere, "not accounted" said, and the next clip the summary
    reports is the last round's ``privacy/clip`` moved by its noised unclipped fraction (Andrew et al.'s step,
    restated). Catches a made-up ε (0, or one from a default accountant) and a stale ``current_clip``."""
    _, run, printed = runs["unaccounted"]
    section = json.loads((run / "summary.json").read_text())["privacy"]
    assert section["epsilon"] is None and not column(run, "privacy/epsilon")
    assert "not accounted (accountant=None), no ε" in section["statement"]
    assert f"Privacy: {section['statement']}" in printed
    mechanism = section["mechanism"]
    assert mechanism["accountant"] is None and mechanism["sampling"] is None
    assert mechanism["adaptive"] == {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_std": 1.0}
    (_, clip), (_, fraction) = column(run, "privacy/clip")[-1], column(run, "privacy/unclipped_fraction")[-1]
    assert mechanism["current_clip"] == pytest.approx(clip * math.exp(-0.2 * (fraction - 0.5)), rel=1e-12)
    assert not (run / "figures" / "epsilon_vs_round.png").exists()


def test_a_run_without_mechanism_records_no_privacy(runs):
    """No ``privacy=``: the summary says so plainly, the history has no privacy column, no ε figure. Catches a
    section that invents settings, and an empty ε figure drawn for every run."""
    _, run, printed = runs["plain"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy"] == {
        "mechanism": None,
        "epsilon": None,
        "delta": None,
        "epsilon_round": None,
        "statement": "no privacy mechanism",
    }
    assert not [c for c in history_csv(run)[0] if c.startswith("privacy/")]
    assert not [k for k in summary["results"]["final"] if k.startswith("privacy/")]
    assert "Privacy:" not in printed  # the console stays as it was; summary.json says there is none
    figures = {p.stem for p in (run / "figures").glob("*.png")}
    assert "accuracy_vs_round" in figures and not figures & {"epsilon_vs_round", "accuracy_vs_epsilon"}


def test_the_figures_draw_epsilon_per_round_and_accuracy_against_it(runs):
    """The accounted run's ``epsilon_vs_round`` draws ``history.csv``'s ``privacy/epsilon`` per round and
    ``accuracy_vs_epsilon`` its ``val/acc`` against it; the overlay of all three runs draws the ε of the
    accounted run only. Catches a curve of another column and the unaccounted runs drawn at ε 0."""
    import matplotlib.pyplot as plt

    from lightning_fedrep.app.report import overlay_figures, run_figures

    run = runs["dp"][1]
    assert (run / "figures" / "epsilon_vs_round.png").is_file()
    assert (run / "figures" / "accuracy_vs_epsilon.png").is_file()
    spent = column(run, "privacy/epsilon")
    accuracy = dict(column(run, "val/acc"))
    figures = run_figures(run)
    try:
        (line,) = figures["epsilon_vs_round"].axes[0].get_lines()
        assert list(zip(line.get_xdata(), line.get_ydata())) == spent
        assert "δ 1e-05" in figures["epsilon_vs_round"].axes[0].get_title()
        lines = {x.get_label(): x for x in figures["accuracy_vs_epsilon"].axes[0].get_lines()}
        mean = lines["client mean"]
        assert list(mean.get_xdata()) == [e for _, e in spent]
        assert list(mean.get_ydata()) == [accuracy[r] for r, _ in spent]
    finally:
        for figure in figures.values():
            plt.close(figure)
    overlay = overlay_figures([runs[k][1] for k in ("plain", "dp", "unaccounted")])
    try:
        (line,) = overlay["epsilon_vs_round"].axes[0].get_lines()
        assert list(line.get_ydata()) == [e for _, e in spent] and "dp" in line.get_label()
        assert len(overlay["accuracy_vs_epsilon"].axes[0].get_lines()) == 1
    finally:
        for figure in overlay.values():
            plt.close(figure)


def test_report_line_and_table_show_epsilon_where_a_run_has_it(runs, capsys):
    """``lightning-fedrep report`` names each run's ε (or that it was not accounted; nothing without a mechanism),
    and ``lightning-fedrep table`` gets an ε column only when a run has a mechanism. Catches ε shown for a
    run without one and a table whose columns shift for every run."""
    from lightning_fedrep.app.report import figures_line
    from lightning_fedrep.app.table import collect, csv_rows, markdown

    dp, unaccounted, plain = (runs[k][1] for k in ("dp", "unaccounted", "plain"))
    epsilon = column(dp, "privacy/epsilon")[-1][1]
    assert figures_line(dp, "dp").endswith(f"; ε {epsilon:.4g} at δ 1e-05 after round {ROUNDS - 1}")
    assert figures_line(unaccounted, "u").endswith("; ClientLevelDP not accounted (no ε)")
    assert "ε" not in figures_line(plain, "plain") and "privacy" not in figures_line(plain, "plain")

    rows = collect([dp.parent])
    table = markdown(rows)
    assert table.splitlines()[0].split(" | ")[4] == "ε"
    shown = {row.recipe: row for row in rows}
    by_name = {Path(r.runs[0]).name: r for r in shown.values()}
    lines = {name: next(x for x in table.splitlines() if f"`{r.recipe}`" in x) for name, r in by_name.items()}
    assert f"| {epsilon:.3g} (δ 1e-05) |" in lines["dp"]
    assert "| not accounted |" in lines["unaccounted"] and "| — |" in lines["plain"]
    by_recipe = {r["recipe"]: r for r in csv_rows(rows)}
    assert by_recipe[by_name["dp"].recipe]["epsilons"] == repr(epsilon)
    assert "ε" not in markdown(collect([plain])) and "epsilons" not in csv_rows(collect([plain]))[0]


def test_the_wandb_run_summary_entries():
    """The W&B run summary gets the statement, and with an accountant the mechanism, δ and final ε; no number
    without a mechanism."""
    described = ClientLevelDP(clip=1.0, noise_multiplier=1.0, accountant=None).describe() | {
        "accountant": "rdp"
    }
    rows = [
        {"round": 0, "privacy/epsilon": 1.5},
        {"round": 1, "val/acc": 0.5},
        {"round": 2, "privacy/epsilon": 2.0},
    ]
    section = privacy_section(described, rows)
    assert section["epsilon"] == 2.0 and section["epsilon_round"] == 2
    assert wandb_summary(section) == {
        "privacy/guarantee": section["statement"],
        "privacy/mechanism": "ClientLevelDP",
        "privacy/delta": 1e-5,
        "privacy/epsilon": 2.0,
    }
    assert wandb_summary(privacy_section(None, rows)) == {"privacy/guarantee": "no privacy mechanism"}


def test_the_wandb_run_summary_of_a_dp_run_states_its_guarantee(tmp_path, monkeypatch):
    """A DP fit with an offline ``WandbLogger``: W&B's run file holds the run summary's ``privacy/guarantee``,
    the statement ``summary.json`` holds. Catches the entries built but never sent."""
    needs_extra()
    from lightning.pytorch.loggers import WandbLogger

    from tests.test_run_outputs import wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(save_dir=str(tmp_path), project="privacy", offline=True)
    strategy = FederatedStrategy(
        head="classifier",
        clients_per_round=COHORT,
        head_epochs=1,
        seed=3,
        weighting="uniform",
        privacy=ClientLevelDP(clip=1.0, noise_multiplier=1.0, delta=DELTA),
    )
    summary = RunSummary(str(tmp_path / "run"), print_table=False, figures=False)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, logger=logger, callbacks=[summary])
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=CLIENTS, seed=1, batch_size=8))
    logger.experiment.finish()
    statement = json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"]["statement"]
    assert statement.startswith("ClientLevelDP (client-level, clip 1,")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file, b"privacy/guarantee")
    assert b"privacy/guarantee" in records and statement.encode() in records


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


def test_a_sample_level_run_records_the_worst_clients_epsilon(tmp_path):
    """Under ``SampleLevelDP`` each client has its own ε: the summary's ε is the history's last
    ``privacy/epsilon`` (the worst client's, read with the csv module), the mechanism names that client and the
    clients' Poisson rates, and the statement says whose ε it is."""
    needs_extra()
    from lightning_fedrep.privacy import SampleLevelDP

    strategy, run, printed = fit_into(
        tmp_path, SampleLevelDP(clip=1.0, noise_multiplier=1.0), model=LossNet()
    )
    section = json.loads((run / "summary.json").read_text())["privacy"]
    last_round, last_epsilon = column(run, "privacy/epsilon")[-1]
    assert section["epsilon"] == pytest.approx(last_epsilon, rel=1e-9) and last_round == ROUNDS - 1
    mechanism = section["mechanism"]
    epsilons = strategy.federation.config.privacy.last_epsilons
    assert mechanism["unit"] == "example" and mechanism["worst_epsilon"] == pytest.approx(
        max(epsilons.values())
    )
    assert epsilons[mechanism["worst_client"]] == max(epsilons.values())
    assert mechanism["sample_rate_max"] <= 1.0 and mechanism["batch_size"] == 8
    assert f"the worst client's ε {last_epsilon:.4g}" in section["statement"]
    assert section["statement"] in printed
