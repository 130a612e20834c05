"""``lightning-fedrep table``: the papers' figure per recipe as mean ± std over seeds, beside the paper's number.

    lightning-fedrep fit --config recipes/digits/fedrep.yaml --seeds 1,2,3      # runs/digits/digits-fedrep/<id>/seed-*
    lightning-fedrep table runs/digits [more run folders, or folders holding them] [--paper digits] [--out DIR]

Every run folder (a folder with ``summary.json``) under the given paths is read; runs of the same recipe
with the same settings but their seeds form one row. The figure to read and the paper's number come from
the recipe's header line ``# Seeds table: figure F; paper P; seeds the paper averaged: N`` (the recipe
copied into the run folder as ``recipe.yaml`` by ``--seeds``, else the config file the run recorded):
``F_last10`` is ``results["last10"][F]`` of ``summary.json``, ``F_best`` the best round's ``results["best"][F]``,
``finetune/F`` is ``results["finetune"]``, any other name the last evaluated round (``results["final"]``). A
recipe that reproduces a row of PFLlib's leaderboard also has the line ``# Leaderboard: figure F; PFLlib N ± S
(...)`` (or ``PFLlib: not on the leaderboard``): the table then shows that figure's mean ± std over seeds (the
best round, selected on the test set: optimistic, never the headline) and the leaderboard's number as extra
columns. The std is the sample standard deviation (ddof=1, as the papers' ± over repeats); accuracies are
shown in %. Where a run trained under a privacy
mechanism, an ε column shows the ε its runs spent (``summary.json``'s ``privacy``, the last ``privacy/epsilon``
of ``history.csv``) at their δ. Writes ``table.md``, ``table.csv`` and
``accuracy_vs_round.png`` (each row's metric per round: the mean over seeds, with a band of ± one std)
into ``--out`` (default: the one folder given, else ``./table``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_fedrep.callbacks.privacy_record import run_privacy
from lightning_fedrep.callbacks.run_files import HISTORY, read_rows, write_rows

SUMMARY = "summary.json"
RECIPE_COPY = "recipe.yaml"
"""The recipe a ``--seeds`` run copies into its folder (its header names the figure and the paper's number)."""
HEADER = re.compile(
    r"^# Seeds table: figure (?P<figure>\S+); paper (?P<paper>.*?); seeds the paper averaged: (?P<seeds>.*)$"
)
LEADERBOARD = re.compile(r"^# Leaderboard: figure (?P<figure>\S+); PFLlib:? (?P<number>.*)$")
"""A recipe's optional line naming the leaderboard's figure and PFLlib's number (recipes/pfllib)."""
_SUFFIXES = {"_last10": "last10", "_best": "best"}
"""A figure's suffix and the ``results`` section of ``summary.json`` it is read from."""
_SEED_KEYS = (
    ("seed_everything",),
    ("trainer", "strategy", "init_args", "seed"),
    ("data", "init_args", "seed"),
)
_RUN_KEYS = (("config",), ("ckpt_path",), ("trainer", "default_root_dir"), ("trainer", "logger"))
PAPERS: dict[str, Callable[[str], bool]] = {
    "fedrep-table1": lambda recipe: recipe.startswith(("cifar10/", "cifar100/", "femnist/", "sent140/")),
    "flute-table1": lambda recipe: recipe.startswith("flute/"),
    "srpfl-fig3": lambda recipe: recipe.startswith("srpfl/") and not recipe.startswith("srpfl/digits_"),
    "digits": lambda recipe: recipe.startswith("digits/"),
    "synthetic": lambda recipe: recipe.startswith("synthetic/"),
}
"""``--paper``: which recipes (paths under ``recipes/``) a table keeps."""


@dataclass
class Row:
    """One recipe's runs: its figure over seeds and the paper's number."""

    recipe: str
    figure: str
    paper: str
    paper_seeds: str
    runs: list[Path] = field(default_factory=list)
    seeds: list[Any] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    privacy: list[dict[str, Any] | None] = field(default_factory=list)
    """Each run's privacy record (``run_privacy``: its mechanism, ε and δ), ``None`` for a run without one."""
    leaderboard_figure: str | None = None
    """The leaderboard's figure (the recipe's ``# Leaderboard`` line; ``None`` without one)."""
    leaderboard: str = ""
    """PFLlib's number for the recipe, as the line states it (``55.02 ± 0.33 (best round, ...)``)."""
    leaderboard_values: list[float] = field(default_factory=list)
    """Each run's value of :attr:`leaderboard_figure`."""

    @property
    def epsilons(self) -> list[float]:
        """The ε each run spent (runs that accounted one)."""
        return [p["epsilon"] for p in self.privacy if p and p.get("epsilon") is not None]

    @property
    def deltas(self) -> list[float]:
        """The distinct δ the runs' ε are at."""
        return sorted({p["delta"] for p in self.privacy if p and p.get("delta") is not None})

    @property
    def mean(self) -> float:
        return _mean(self.values)

    @property
    def std(self) -> float:
        """The sample standard deviation (ddof=1); NaN for fewer than 2 seeds."""
        return _std(self.values)

    @property
    def percent(self) -> bool:
        """Whether the figure is an accuracy (shown in %)."""
        return _is_accuracy(self.figure)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    """The sample standard deviation (ddof=1); NaN for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _is_accuracy(figure: str) -> bool:
    return "acc" in figure.rsplit("/", 1)[-1]


def run_folders(paths: Sequence[Path]) -> list[Path]:
    """Every run folder (holding ``summary.json``) among ``paths`` and below them, in path order."""
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; pass run folders or folders holding them.")
        candidates = [path] if (path / SUMMARY).is_file() else sorted(p.parent for p in path.rglob(SUMMARY))
        found.extend(c for c in candidates if c not in found)
    if not found:
        raise FileNotFoundError(
            f"no run folder ({SUMMARY}) in {', '.join(map(str, paths))}; run `lightning-fedrep fit` first."
        )
    return found


def recipe_header(run: Path, summary: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The run's recipe (path under ``recipes/``, else the file's name) and its ``Seeds table`` header line
    (``figure``, ``paper``, ``seeds``), with ``leaderboard_figure`` and ``leaderboard`` where the recipe has a
    ``# Leaderboard`` line."""
    files = [Path(str(f)) for f in ((summary.get("config") or {}).get("config") or [])]
    candidates = [run / RECIPE_COPY, *files, *(run / f for f in files if not f.is_absolute())]
    text = next((c.read_text() for c in candidates if c.is_file()), "")
    name = files[0].as_posix() if files else run.name
    recipe = name.split("recipes/", 1)[1] if "recipes/" in name else name
    lines = text.splitlines()
    board = next((m for m in map(LEADERBOARD.match, lines) if m), None)
    extra = {"leaderboard_figure": board["figure"], "leaderboard": board["number"].strip()} if board else {}
    for line in lines:
        match = HEADER.match(line)
        if match:
            return recipe, {**match.groupdict(), **extra}
    raise ValueError(
        f"{run}: its recipe ({name}) has no '# Seeds table: figure ...' header line naming the figure to read; "
        "run a recipe from recipes/ (python recipes/generate.py writes the line)."
    )


def _split_suffix(figure: str) -> tuple[str | None, str]:
    """A figure's ``results`` section named by its suffix (``None`` without one) and the metric's name."""
    for suffix, section in _SUFFIXES.items():
        if figure.endswith(suffix):
            return section, figure[: -len(suffix)]
    return None, figure


def figure_value(results: dict[str, dict[str, float]], figure: str) -> float:
    """``figure`` of a run's ``results``: ``X_last10`` the last-10 mean, ``X_best`` the best round,
    ``finetune/X`` the fine-tuning evaluation, any other name the last evaluated round."""
    section, name = _split_suffix(figure)
    if section is None:
        section = "finetune" if figure.startswith("finetune/") else "final"
    try:
        return float(results[section][name])
    except KeyError:
        raise KeyError(
            f"summary.json has no results[{section!r}][{name!r}] (the recipe's figure {figure})"
        ) from None


def curve_metric(figure: str) -> str:
    """The ``history.csv`` column of a figure: ``val/acc`` for ``val/acc_last10``, ``val/acc_best`` or
    ``finetune/val/acc``."""
    name = _split_suffix(figure)[1]
    return name[len("finetune/") :] if name.startswith("finetune/") else name


def _settings(config: dict[str, Any]) -> str:
    """The run's configuration without its seeds and its folders: runs that differ only there share a row."""
    config = json.loads(json.dumps(config or {}, default=str))
    for keys in (*_SEED_KEYS, *_RUN_KEYS):
        node = config
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(keys[-1], None)
    return json.dumps(config, sort_keys=True)


def seed_of(config: dict[str, Any]) -> Any:
    """The run's ``seed_everything``."""
    return (config or {}).get("seed_everything")


def collect(paths: Sequence[Path], paper: str | None = None) -> list[Row]:
    """The table's rows: the runs under ``paths`` grouped by recipe and settings (``paper``: only its recipes)."""
    keep = PAPERS[paper] if paper else (lambda recipe: True)
    rows: dict[tuple[str, str], Row] = {}
    for run in run_folders(paths):
        summary = json.loads((run / SUMMARY).read_text())
        recipe, header = recipe_header(run, summary)
        if not keep(recipe):
            continue
        config = summary.get("config") or {}
        key = (recipe, _settings(config))
        row = rows.setdefault(key, _row(recipe, header))
        row.runs.append(run)
        row.seeds.append(seed_of(config))
        row.values.append(figure_value(summary.get("results", {}), row.figure))
        if row.leaderboard_figure is not None:
            row.leaderboard_values.append(figure_value(summary.get("results", {}), row.leaderboard_figure))
        row.privacy.append(run_privacy(run))
    recipes = [row.recipe for row in rows.values()]
    for n, row in enumerate(rows.values(), 1):  # one recipe run with other settings: told apart by folder
        if recipes.count(row.recipe) > 1:
            row.recipe = f"{row.recipe} ({row.runs[0].parent.name}, #{n})"
    return sorted(rows.values(), key=lambda row: row.recipe)


def _row(recipe: str, header: dict[str, str]) -> Row:
    row = Row(recipe, header["figure"], header["paper"], header["seeds"])
    row.leaderboard_figure, row.leaderboard = header.get("leaderboard_figure"), header.get("leaderboard", "")
    return row


def _number(value: float, percent: bool) -> str:
    if math.isnan(value):
        return "—"
    return f"{100 * value:.2f}" if percent else f"{value:.4g}"


def cell(row: Row) -> str:
    """``mean ± std`` (in % for an accuracy)."""
    return _spread(row.values, row.percent)


def _spread(values: Sequence[float], percent: bool) -> str:
    unit = "%" if percent else ""
    mean, std = _mean(values), _std(values)
    if math.isnan(std):
        return f"{_number(mean, percent)}{unit} (one seed)"
    return f"{_number(mean, percent)} ± {_number(std, percent)}{unit}"


def ranked(rows: Sequence[Row]) -> bool:
    """Whether any recipe of ``rows`` names a leaderboard figure (the table then shows its columns)."""
    return any(row.leaderboard_figure is not None for row in rows)


def leaderboard_cells(row: Row) -> tuple[str, str, str]:
    """The leaderboard's figure, its mean ± std over the row's seeds and PFLlib's number (``—`` without)."""
    if row.leaderboard_figure is None:
        return "—", "—", "—"
    spread = _spread(row.leaderboard_values, _is_accuracy(row.leaderboard_figure))
    return f"`{row.leaderboard_figure}`", spread, row.leaderboard or "—"


def private(rows: Sequence[Row]) -> bool:
    """Whether any run of ``rows`` trained under a privacy mechanism (the table then shows ε)."""
    return any(p is not None for row in rows for p in row.privacy)


def epsilon_cell(row: Row) -> str:
    """The ε the row's runs spent at their δ (``2.31 (δ 1e-05)``; the range where seeds differ), ``not
    accounted`` for a mechanism without an accountant, ``—`` without a mechanism."""
    epsilons = row.epsilons
    if not epsilons:
        return "not accounted" if any(p is not None for p in row.privacy) else "—"
    low, high = min(epsilons), max(epsilons)
    text = f"{low:.3g}" if f"{low:.3g}" == f"{high:.3g}" else f"{low:.3g}–{high:.3g}"
    if len(epsilons) < len(row.privacy):
        text += f" ({len(epsilons)} of {len(row.privacy)} runs)"
    deltas = row.deltas
    return text + (f" (δ {', '.join(f'{d:g}' for d in deltas)})" if deltas else "")


def markdown(rows: Sequence[Row]) -> str:
    """The table in Markdown (with an ε column where a run trained under a privacy mechanism, and the
    leaderboard's figure, its mean ± std and PFLlib's number where a recipe names one)."""
    dp, board = private(rows), ranked(rows)
    lines = [
        "| recipe | figure | seeds | mean ± std (ddof=1) |"
        + (" ε |" if dp else "")
        + " paper | seeds the paper averaged |"
        + (" leaderboard figure | its mean ± std (best round, optimistic) | PFLlib |" if board else ""),
        "|---|---|---|---|" + ("---|" if dp else "") + "---|---|" + ("---|---|---|" if board else ""),
    ]
    for row in rows:
        seeds = ",".join(str(s) for s in row.seeds)
        epsilon = f" {epsilon_cell(row)} |" if dp else ""
        extra = "".join(f" {c} |" for c in leaderboard_cells(row)) if board else ""
        lines.append(
            f"| `{row.recipe}` | `{row.figure}` | {len(row.values)} ({seeds}) | {cell(row)} |{epsilon}"
            f" {row.paper} | {row.paper_seeds} |{extra}"
        )
    return "\n".join(lines) + "\n"


def csv_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The table as CSV rows (mean, std and values in the figure's own units: accuracies as fractions; with a
    privacy mechanism, each run's ``epsilons`` and the ``deltas``; with a leaderboard figure, its name, mean,
    std and values and PFLlib's number, ``leaderboard_*``)."""
    dp, board = private(rows), ranked(rows)
    return [
        {
            "recipe": row.recipe,
            "figure": row.figure,
            "seeds": " ".join(str(s) for s in row.seeds),
            "n": len(row.values),
            "mean": row.mean,
            "std": row.std,
            "values": " ".join(repr(v) for v in row.values),
            "paper": row.paper,
            "paper_seeds": row.paper_seeds,
            **(
                {
                    "epsilons": " ".join(repr(e) for e in row.epsilons),
                    "deltas": " ".join(repr(d) for d in row.deltas),
                }
                if dp
                else {}
            ),
            **(
                {
                    "leaderboard_figure": row.leaderboard_figure or "",
                    "leaderboard_mean": _mean(row.leaderboard_values),
                    "leaderboard_std": _std(row.leaderboard_values),
                    "leaderboard_values": " ".join(repr(v) for v in row.leaderboard_values),
                    "leaderboard_pfllib": row.leaderboard,
                }
                if board
                else {}
            ),
        }
        for row in rows
    ]


def seed_curves(row: Row) -> tuple[list[float], list[float], list[float]]:
    """The row's metric per round (``history.csv``): the rounds every seed evaluated, the mean over seeds
    and the sample std (0 for one seed)."""
    metric = curve_metric(row.figure)
    per_run = [{r["round"]: r[metric] for r in read_rows(run / HISTORY) if metric in r} for run in row.runs]
    rounds = sorted(set.intersection(*(set(values) for values in per_run))) if per_run else []
    means, stds = [], []
    for r in rounds:
        values = [values[r] for values in per_run]
        mean = sum(values) / len(values)
        means.append(mean)
        n = len(values)
        stds.append(math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0)
    return rounds, means, stds


def figure(rows: Sequence[Row]) -> Any:
    """Accuracy vs round: per row the mean over seeds and a band of ± one sample std (matplotlib Figure)."""
    from lightning_fedrep.callbacks.figures import axes, pyplot

    plt = pyplot()
    metrics = sorted({curve_metric(row.figure) for row in rows})
    fig, ax = axes(plt, f"{', '.join(metrics)}: mean over seeds ± std", "round", ", ".join(metrics))
    for row in rows:
        rounds, means, stds = seed_curves(row)
        (line,) = ax.plot(
            rounds, means, marker="o", markersize=3, label=f"{row.recipe} ({len(row.runs)} seeds)"
        )
        low = [m - s for m, s in zip(means, stds)]
        high = [m + s for m, s in zip(means, stds)]
        ax.fill_between(rounds, low, high, alpha=0.2, color=line.get_color())
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """``lightning-fedrep table RUN_FOLDER [RUN_FOLDER ...] [--paper NAME] [--out DIR]``."""
    paragraphs = [" ".join(p.replace("``", "").split()) for p in (__doc__ or "").split("\n\n")]
    parser = argparse.ArgumentParser(prog="lightning-fedrep table", description=paragraphs[2])
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run folders, or folders holding them (searched below)"
    )
    parser.add_argument(
        "--paper", choices=sorted(PAPERS), default=None, help="keep only this paper's recipes"
    )
    parser.add_argument("--out", type=Path, default=None, help="where table.md, table.csv and the figure go")
    args = parser.parse_args(argv)
    try:
        rows = collect(args.runs, args.paper)
    except (FileNotFoundError, ValueError, KeyError) as error:
        parser.error(str(error).strip("'\""))
    if not rows:
        parser.error(f"no run of a --paper {args.paper} recipe in {', '.join(map(str, args.runs))}")
    out = args.out or (args.runs[0] if len(args.runs) == 1 and args.runs[0].is_dir() else Path("table"))
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows)
    (out / "table.md").write_text(text)
    write_rows(out / "table.csv", csv_rows(rows))
    from lightning_fedrep.app.report import save

    paths = save({"accuracy_vs_round": figure(rows)}, out)
    print(text, end="")
    print(f"\n{out / 'table.md'}, {out / 'table.csv'}, {paths[0]}")
    return rows
