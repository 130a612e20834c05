"""``lightning-fedrep report``: its help text, whole-number ticks on the figures that count things, and
a legend that tells overlaid runs apart (on run folders written by hand, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fedrep.app.report import main, overlay_figures, run_figures
from lightning_fedrep.callbacks.run_files import write_rows


def fake_run(folder: Path, algorithm: str = "fedrep") -> Path:
    """A run folder with 3 rounds of 4 clients, each client sampled 1 to 3 times, 1 or 2 samples per label."""
    folder.mkdir(parents=True)
    write_rows(folder / "history.csv", [{"round": r, "val/acc": 0.5 + 0.1 * r} for r in range(3)])
    write_rows(
        folder / "clients.csv",
        [{"round": r, "client": c, "val/acc": 0.2 * c + 0.05 * r} for r in range(3) for c in range(4)],
    )
    write_rows(folder / "participation.csv", [{"client": c, "rounds": 1 + c % 3} for c in range(4)])
    write_rows(
        folder / "partition.csv",
        [{"client": c, "label": k, "samples": 1 + (c + k) % 2} for c in range(4) for k in range(2)],
    )
    (folder / "summary.json").write_text(json.dumps({"algorithm": algorithm}))
    return folder


def test_report_help_says_what_it_does_in_whole_sentences(capsys):
    """Bug: the description was ``__doc__.splitlines()[0]``, cut off mid-sentence ("... and the")."""
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "and the lightning-fedrep report command that draws them again or overlays several runs." in help_text
    )
    assert "Needs matplotlib" in help_text


def test_the_figures_that_count_clients_rounds_or_samples_have_whole_number_ticks(tmp_path):
    """Bug: matplotlib's default locator put 0.5-steps on the count axes of ``participation``,
    ``client_histogram`` and ``partition`` (the ``ylabel in COUNTS`` locator in ``_axes`` removed)."""
    figures = run_figures(fake_run(tmp_path / "run"))
    for stem in ("participation", "client_histogram", "partition"):
        ticks = figures[stem].axes[0].get_yticks()
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (stem, ticks)


def test_the_overlay_legend_tells_runs_of_the_same_name_apart(tmp_path):
    """Bug: ``run_label`` named ``exp1/fedrep`` and ``exp2/fedrep`` both "fedrep", and two runs started in the
    same second under two roots both "fedrep (20261124-194500)"."""
    runs = [fake_run(tmp_path / e / "fedrep") for e in ("exp1", "exp2")]
    runs += [fake_run(tmp_path / e / "digits" / "20261124-194500", "fedavg") for e in ("a", "b")]
    figure = overlay_figures(runs)["accuracy_vs_round"]
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels == [
        "exp1/fedrep",
        "exp2/fedrep",
        "fedavg (a/digits/20261124-194500)",
        "fedavg (b/digits/20261124-194500)",
    ]
