"""The privacy benchmarks (``benchmarks/privacy/``) run end to end at a reduced size (``--small``): a smoke check
of the scripts (their tables, the figure, the accounting they print), not of their timings or accuracies."""

from __future__ import annotations

import pytest

pytest.importorskip("opacus")  # client-level DP accounts with the privacy extra
pytest.importorskip("dp_accounting")

from benchmarks.privacy import client_level_overhead, digits_tradeoff, sample_level_speed  # noqa: E402


def test_digits_tradeoff_small_prints_the_table_and_writes_the_figure(tmp_path, capsys):
    figure = tmp_path / "tradeoff.png"
    summary = digits_tradeoff.main(["--small", "--figure", str(figure)])
    out = capsys.readouterr().out
    assert figure.is_file() and figure.stat().st_size > 0
    assert set(summary) == set(digits_tradeoff.LABELS)
    for method, per_epsilon in summary.items():
        assert sorted(per_epsilon) == list(digits_tradeoff.SMALL_EPSILONS), method
        assert all(0.0 <= mean <= 100.0 for mean, _ in per_epsilon.values())
    assert "| method | ε = 1 | ε = 8 |" in out and "DP-FedRep (CENTAUR)" in out
    spent = next(line for line in out.splitlines() if line.startswith("| ε spent"))
    for cell, target in zip(spent.strip("|").split("|")[1:], digits_tradeoff.SMALL_EPSILONS):
        assert 0.0 < float(cell) <= target * (1 + 1e-6)  # the accountant's ε, within the budget


def test_digits_tradeoff_runs_the_low_rank_problem_scored_by_mse(tmp_path, capsys):
    summary = digits_tradeoff.main(["--small", "--data", "low_rank", "--figure", str(tmp_path / "lr.png")])
    out = capsys.readouterr().out
    assert (tmp_path / "lr.png").is_file()
    assert "low-rank linear problem" in out and "test MSE" in out
    assert all(mean >= 0.0 for per_epsilon in summary.values() for mean, _ in per_epsilon.values())


def test_client_level_overhead_small_reports_every_variant_and_its_ratio(capsys):
    tables = client_level_overhead.main(["--small"])
    out = capsys.readouterr().out
    assert list(tables) == list(client_level_overhead.PARTICIPATION)
    for rows in tables.values():
        assert [row[0] for row in rows] == list(client_level_overhead.VARIANTS)
        assert rows[0][2] == "1.000x"  # the baseline against itself
    assert out.count("per-repeat ratios") == 2 * (len(client_level_overhead.VARIANTS) - 1)


def test_sample_level_speed_small_times_every_variant_and_shows_the_same_epsilon(capsys):
    tables = sample_level_speed.main(["--small"])
    out = capsys.readouterr().out
    variants = [*sample_level_speed.VARIANTS, sample_level_speed.OPACUS, sample_level_speed.OPACUS_BARE]
    assert list(tables) == list(sample_level_speed.WORKLOADS)
    for rows in tables.values():
        assert [row[0] for row in rows] == variants
        assert rows[variants.index(sample_level_speed.OPACUS)][2] == "1.00x"  # the baseline against itself
        assert all(float(row[1]) > 0 for row in rows)
    assert "| variant | a round, best (ms) | Opacus / this (best) |" in out
    assert out.count("per-repeat") == 4 * len(tables)
    gaps = [line.rsplit(" ", 1)[-1] for line in out.splitlines() if "largest difference" in line]
    assert len(gaps) == len(tables) and all(float(gap) < 1e-9 for gap in gaps)  # Opacus's ε is ours
