"""Figures of a run, drawn from the files in its folder (``lightning_fedrep.callbacks.run_files``), and the
``lightning-fedrep report`` command that draws them again or overlays several runs.

    lightning-fedrep report runs/digits/fedrep/<run id>                 # -> <run>/figures/*.png
    lightning-fedrep report runs/quickstart/fedrep runs/quickstart/fedavg --out figures/

One run: accuracy vs round (client mean, with the band down to the 10th percentile and the worst
client), accuracy vs simulated time (when ``sim/time`` was recorded), the per-client accuracy
histogram of the last evaluation, a client x round accuracy heatmap, participation per client, the
partition's labels per client, and the neural-collapse metrics (when logged). Several runs: accuracy
vs round (and vs simulated time) of each run in one figure. Fine-tuned models (HeadFineTuning) appear
under their own name, finetune/val/acc, beside the federated rounds' val/acc. First a line per run: what
it trained (fedavg + head fine-tuning) and its figures (val/acc of the last federated round, finetune/val/acc
of the fine-tuned models) and, for a run under a privacy mechanism, the ε it spent (ε 2.31 at δ 1e-05 after
round 29), with its figures ε vs round and accuracy vs ε. Needs matplotlib (``pip install lightning-fedrep[plots]``).

The figures themselves are :mod:`lightning_fedrep.callbacks.figures` (``RunSummary`` draws the same ones after
a run); its public names stay importable from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_fedrep.callbacks.figures import (
    COUNTS,
    FIGURES,
    finetuned,
    headline,
    higher_is_better,
    overlay_figures,
    run_figures,
    run_label,
    run_labels,
    save,
)
from lightning_fedrep.callbacks.privacy_record import report_words, run_privacy
from lightning_fedrep.callbacks.run_files import HISTORY, read_rows

__all__ = [
    "COUNTS",
    "FIGURES",
    "figures_line",
    "headline",
    "higher_is_better",
    "main",
    "overlay_figures",
    "run_figures",
    "run_label",
    "run_labels",
    "save",
]


def figures_line(run: Path, label: str) -> str:
    """One line naming ``run`` (``label``) with its headline figures from ``history.csv``: the last federated
    round's ``val/acc`` and, after fine-tuning rounds, the fine-tuned models' ``finetune/val/acc`` beside it;
    under a privacy mechanism, the ε it spent (``ε 2.31 at δ 1e-05 after round 29``, or that it was not
    accounted)."""
    history = read_rows(run / HISTORY)
    metric = headline(sorted({k for r in history for k in r}))
    record = run_privacy(run)
    privacy = "" if record is None else f"; {report_words(record)}"
    if metric is None:
        return f"{label}: no {HISTORY} figures{privacy}"
    shown = []
    for name, what in ((metric, "last federated round"), (finetuned(metric), "fine-tuned models")):
        rows = [r for r in history if name in r]
        if rows:
            shown.append(f"{name} {rows[-1][name]:.4g} ({what}, round {int(rows[-1]['round'])})")
    return f"{label}: " + ", ".join(shown) + privacy


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """``lightning-fedrep report RUN_DIR [RUN_DIR ...] [--out DIR]``."""
    paragraphs = [" ".join(p.replace("``", "").split()) for p in __doc__.split("\n\n")]
    parser = argparse.ArgumentParser(
        prog="lightning-fedrep report", description=paragraphs[0], epilog=paragraphs[2]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each holding history.csv)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the PNGs go (default: <run>/figures for one run, ./figures for several)",
    )
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / HISTORY).is_file()]
    if missing:
        parser.error(f"not a run folder (no {HISTORY}): {', '.join(missing)}")
    for run, label in zip(args.runs, run_labels(args.runs)):
        print(figures_line(run, label))
    if len(args.runs) == 1:
        paths = save(run_figures(args.runs[0]), args.out or args.runs[0] / FIGURES)
    else:
        paths = save(overlay_figures(args.runs), args.out or Path(FIGURES))
    for path in paths:
        print(path)
    return paths
