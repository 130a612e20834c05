"""The figures of a run, drawn from the files in its folder (:mod:`lightning_fedrep.callbacks.run_files`):
what :class:`~lightning_fedrep.callbacks.RunSummary` saves under ``figures/`` and the ``lightning-fedrep
report`` command (:mod:`lightning_fedrep.app.report`) draws again or overlays for several runs.

One run (:func:`run_figures`): accuracy vs round (client mean, with the band down to the 10th percentile and
the worst client), accuracy vs simulated time (when ``sim/time`` was recorded), the per-client accuracy
histogram of the last evaluation, a client x round accuracy heatmap, participation per client, the
partition's labels per client, the neural-collapse metrics (when logged), and under a privacy mechanism with
an accountant the ε spent per round (``privacy/epsilon``) and accuracy against it. Several runs
(:func:`overlay_figures`): accuracy vs round (and vs simulated time) of each run in one figure, and the ε
figures of the runs that spent one. Needs matplotlib (``pip install lightning-fedrep[plots]``).

A run with fine-tuning rounds (``HeadFineTuning``) shows its fine-tuned models under their own names beside
the federated rounds': the fine-tuning round's ``finetune/val/acc`` as a marker of its own at its round, and
the histogram of ``clients_finetune_val.csv``'s ``finetune/val/acc`` beside that of ``clients_val.csv``'s
``val/acc`` (the last federated round's); its runs are named ``fedavg + head fine-tuning``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fedrep.callbacks.finetuning import FINETUNE_PREFIX
from lightning_fedrep.callbacks.privacy_record import EPSILON, run_privacy
from lightning_fedrep.callbacks.run_files import (
    CLIENTS,
    HISTORY,
    PARTICIPATION,
    PARTITION,
    read_rows,
    stage_files,
)

FIGURES = "figures"
COUNTS = ("clients", "rounds", "samples")
"""The y-axis labels of the figures that count things (their ticks are whole numbers)."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or an ImportError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "Figures need matplotlib: pip install 'lightning-fedrep[plots]' (or matplotlib)."
        ) from error
    return plt


def headline(columns: Sequence[str], stage: str = "val") -> str | None:
    """The metric the figures show: ``<stage>/acc`` if measured, else ``<stage>/loss``."""
    for name in (f"{stage}/acc", f"{stage}/loss"):
        if name in columns:
            return name
    return None


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better (accuracies; not losses or errors)."""
    words = set(metric.rsplit("/", 1)[-1].replace("-", "_").split("_"))
    return not words & {"loss", "error", "err", "mse", "mae", "ce", "nll", "rmse", "perplexity"}


def method(summary: dict[str, Any]) -> str | None:
    """What a run trained, from its ``summary.json``: the algorithm, with the fine-tuning that followed it
    (``"fedavg + head fine-tuning"``; ``"+ fine-tuning"`` for a summary that measured fine-tuning but does not
    describe it); ``None`` without an algorithm."""
    algorithm = summary.get("algorithm")
    if not algorithm:
        return None
    described = summary.get("fine_tuning")
    if isinstance(described, dict) and described.get("label"):
        return f"{algorithm} + {described['label']}"
    if (summary.get("results") or {}).get("finetune"):
        return f"{algorithm} + fine-tuning"
    return str(algorithm)


def read_summary(run: Path) -> dict[str, Any]:
    """A run folder's ``summary.json`` (``{}`` if it has none)."""
    summary = run / "summary.json"
    return json.loads(summary.read_text()) if summary.is_file() else {}


def run_label(run: Path, parents: int = 0) -> str:
    """A run's name in a legend: what it trained (:func:`method`: the algorithm and its fine-tuning, from
    ``summary.json``) and its folder, with ``parents`` of the folders above it (``exp1/fedrep``)."""
    trained = method(read_summary(run))
    parts = run.resolve().parts
    name = "/".join(parts[max(1, len(parts) - 1 - parents) :]) if len(parts) > 1 else str(run)
    return f"{trained} ({name})" if trained and trained not in name else name


def run_labels(runs: Sequence[Path]) -> list[str]:
    """Every run's legend name (:func:`run_label`), told apart where they coincide: by as many parent
    folders as it takes, then (the same folder given twice) by its position, ``#2``."""
    labels = [run_label(run) for run in runs]
    for parents in range(1, max(len(run.resolve().parts) for run in runs)):
        repeated = {label for label in labels if labels.count(label) > 1}
        if not repeated:
            return labels
        labels = [run_label(run, parents) if label in repeated else label for run, label in zip(runs, labels)]
    return [label if labels[:i].count(label) == 0 else f"{label} #{i + 1}" for i, label in enumerate(labels)]


def _columns(rows: list[dict[str, float]]) -> list[str]:
    return sorted({k for row in rows for k in row})


def finetuned(metric: str) -> str:
    """The name of ``metric`` measured on the fine-tuned models: ``finetune/val/acc`` for ``val/acc``."""
    return FINETUNE_PREFIX + metric


def _finetuned_points(
    ax: Any, rows: list[dict[str, float]], x: str, metric: str, label: str, color: Any = None
) -> None:
    """The fine-tuning rounds' ``finetune/<metric>`` (history.csv rows of their own) as markers, if any."""
    name = finetuned(metric)
    points = [r for r in rows if name in r and x in r]
    if points:
        ax.plot(
            [r[x] for r in points],
            [r[name] for r in points],
            linestyle="none",
            marker="*",
            markersize=10,
            color=color,
            label=label,
        )


def _curve(ax: Any, rows: list[dict[str, float]], x: str, metric: str, label: str, band: bool) -> Any:
    """The client mean of ``metric`` against ``x`` (with the band below it); returns the line's colour."""
    points = [r for r in rows if metric in r and x in r]
    xs = [r[x] for r in points]
    (line,) = ax.plot(xs, [r[metric] for r in points], marker="o", markersize=3, label=label)
    low = f"{metric}_min"
    if band and all(low in r and f"{metric}_p10" in r for r in points) and points:
        # the summaries are the lowest client and the 10th percentile: the worst clients for an accuracy,
        # the best ones for a loss
        accuracy = higher_is_better(metric)
        lowest = "worst client" if accuracy else "lowest-loss client"
        ax.fill_between(
            xs, [r[low] for r in points], [r[metric] for r in points], alpha=0.15, label=f"{lowest} .. mean"
        )
        percentile = "10th percentile" if accuracy else "10th percentile (lowest losses)"
        ax.plot(xs, [r[f"{metric}_p10"] for r in points], linestyle="--", linewidth=1, label=percentile)
    return line.get_color()


def axes(plt: Any, title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    """A new figure and its axes, titled and labelled, with a light grid (whole-number ticks for rounds,
    clients and counts)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    if xlabel in ("round", "client"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylabel in COUNTS:  # no 0.5 of a client
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def run_figures(run: Path, stage: str | None = None) -> dict[str, Any]:
    """The figures of one run folder, by file stem (matplotlib ``Figure`` objects; close them after use).
    The per-client histogram shows the last evaluation of ``stage`` (``"val"``, ``"test"``), by default
    the stage whose ``clients_<stage>.csv`` was written last."""
    plt = pyplot()
    history = read_rows(run / HISTORY)
    clients = read_rows(run / CLIENTS)
    figures: dict[str, Any] = {}
    metric = headline(_columns(history))
    if metric:
        fig, ax = axes(plt, f"{metric} over clients, per round", "round", metric)
        _curve(ax, history, "round", metric, "client mean", band=True)
        _finetuned_points(ax, history, "round", metric, f"{finetuned(metric)} (fine-tuned, client mean)")
        ax.legend()
        figures["accuracy_vs_round"] = fig
        if any("sim/time" in r for r in history):
            fig, ax = axes(plt, f"{metric} vs simulated time", "simulated time", metric)
            _curve(ax, history, "sim/time", metric, "client mean", band=True)
            _finetuned_points(
                ax, history, "sim/time", metric, f"{finetuned(metric)} (fine-tuned, client mean)"
            )
            ax.legend()
            figures["accuracy_vs_time"] = fig
    per_client, stage = _last_per_client(run, clients, stage)
    if per_client:
        figures["client_histogram"] = _histogram(plt, per_client, stage)
    if clients and metric:
        rounds = sorted({int(r["round"]) for r in clients})
        ids = sorted({int(r["client"]) for r in clients})
        grid = [[float("nan")] * len(rounds) for _ in ids]
        for r in clients:
            if metric in r:
                grid[ids.index(int(r["client"]))][rounds.index(int(r["round"]))] = r[metric]
        fig, ax = axes(plt, f"{metric}: client x round", "round (evaluated)", "client")
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.grid(False)
        step = max(1, len(rounds) // 12)
        ax.set_xticks(range(0, len(rounds), step), [str(r) for r in rounds[::step]])
        step = max(1, len(ids) // 20)
        ax.set_yticks(range(0, len(ids), step), [str(c) for c in ids[::step]])
        fig.colorbar(image, ax=ax, label=metric)
        figures["client_round_heatmap"] = fig
    participation = read_rows(run / PARTICIPATION)
    if participation:
        fig, ax = axes(plt, "Rounds each client was sampled for", "client", "rounds")
        ax.bar([int(r["client"]) for r in participation], [r["rounds"] for r in participation])
        figures["participation"] = fig
    partition = read_rows(run / PARTITION)
    if partition:
        figures["partition"] = _partition_figure(plt, partition)
    collapse = sorted({k for r in history for k in r if k.startswith("nc/")})
    if collapse:
        fig, ax = axes(plt, "Neural collapse", "round", "value")
        for key in collapse:
            points = [r for r in history if key in r]
            ax.plot([r["round"] for r in points], [r[key] for r in points], marker=".", label=key)
        ax.legend(fontsize="small")
        figures["neural_collapse"] = fig
    figures.update(_privacy_figures(plt, run, history, metric))
    for fig in figures.values():
        fig.tight_layout()
    return figures


def _delta_words(runs: Sequence[Path]) -> str:
    """`` (δ 1e-05)`` when the runs' summaries name one δ, else nothing."""
    deltas = {(run_privacy(run) or {}).get("delta") for run in runs} - {None}
    return f" (δ {deltas.pop():g})" if len(deltas) == 1 else ""


def _epsilon_line(ax: Any, rows: list[dict[str, float]], label: str) -> None:
    """``privacy/epsilon`` against the round, for the rows that hold it."""
    points = [r for r in rows if EPSILON in r]
    ax.plot([r["round"] for r in points], [r[EPSILON] for r in points], marker="o", markersize=3, label=label)


def _privacy_figures(
    plt: Any, run: Path, history: list[dict[str, float]], metric: str | None
) -> dict[str, Any]:
    """Under a privacy mechanism with an accountant (``privacy/epsilon`` in the history): the ε spent per round
    (``epsilon_vs_round``) and, with an evaluation, ``<metric>`` against the ε spent (``accuracy_vs_epsilon``);
    nothing for a run without one."""
    if not any(EPSILON in r for r in history):
        return {}
    delta = _delta_words([run])
    figures = {}
    fig, ax = axes(plt, f"Privacy spent{delta}, per round", "round", "ε")
    _epsilon_line(ax, history, "ε")
    figures["epsilon_vs_round"] = fig
    if metric and any(metric in r and EPSILON in r for r in history):
        fig, ax = axes(plt, f"{metric} vs privacy spent{delta}", "ε", metric)
        _curve(ax, history, EPSILON, metric, "client mean", band=True)
        ax.legend()
        figures["accuracy_vs_epsilon"] = fig
    return figures


def _last_per_client(
    run: Path, clients: list[dict[str, float]], stage: str | None
) -> tuple[dict[str, list[float]], str]:
    """The per-client values the histogram shows, by metric name, and their stage: the headline metric of each
    ``clients_<key>.csv`` of ``stage`` (``val/acc`` of ``clients_val.csv``, then ``finetune/val/acc`` of
    ``clients_finetune_val.csv``), by default the stage of the file written last; else the last round of
    ``clients.csv``."""
    written: dict[str, list[tuple[str, Path]]] = {}
    for path in stage_files(run):
        key = path.stem.removeprefix("clients_").replace("_", "/")  # run_files.stage_file, read back
        written.setdefault(key.rpartition("/")[2], []).append((key, path))
    if stage is None and written:
        stage = max(written, key=lambda s: max(p.stat().st_mtime_ns for _, p in written[s]))
    stage = stage or "val"
    if stage in written:
        values = {}
        for key, path in sorted(written[stage], key=lambda kp: (kp[0] != stage, kp[0])):
            rows = read_rows(path)
            name = headline(_columns(rows), key)
            if name and any(name in r for r in rows):
                values[name] = [r[name] for r in rows if name in r]
        return values, stage
    if clients:
        last = [r for r in clients if r["round"] == max(r["round"] for r in clients)]
        name = headline(_columns(last), "val")
        return ({name: [r[name] for r in last if name in r]} if name else {}), "val"
    return {}, stage


def _histogram(plt: Any, per_client: dict[str, list[float]], stage: str) -> Any:
    """The per-client values of each metric as a histogram, several named in a legend (same bins)."""
    names = list(per_client)
    title = f"{names[0]} per client (last {stage} evaluation)"
    if len(names) > 1:
        title = f"{' and '.join(names)} per client (last {stage} evaluation of each)"
    fig, ax = axes(plt, title, ", ".join(names), "clients")
    clients = max(len(v) for v in per_client.values())
    bins = min(20, max(5, clients // 2))
    if len(names) == 1:
        ax.hist(per_client[names[0]], bins=bins)
        return fig
    values = [v for name in names for v in per_client[name] if math.isfinite(v)]
    span = (min(values), max(values)) if values else None
    for name in names:
        ax.hist(per_client[name], bins=bins, range=span, alpha=0.6, label=name)
    ax.legend()
    return fig


def _partition_figure(plt: Any, rows: list[dict[str, float]]) -> Any:
    ids = sorted({int(r["client"]) for r in rows})
    labels = sorted({int(r["label"]) for r in rows})
    fig, ax = axes(plt, "Training samples per label, per client", "client", "samples")
    bottom = [0.0] * len(ids)
    cmap = plt.get_cmap("tab20" if len(labels) > 10 else "tab10")
    for index, label in enumerate(labels):
        heights = [0.0] * len(ids)
        for r in rows:
            if int(r["label"]) == label:
                heights[ids.index(int(r["client"]))] = r["samples"]
        ax.bar(ids, heights, bottom=bottom, color=cmap(index % cmap.N), label=str(label))
        bottom = [b + h for b, h in zip(bottom, heights)]
    if len(labels) <= 20:
        ax.legend(title="label", fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def overlay_figures(runs: Sequence[Path]) -> dict[str, Any]:
    """Accuracy vs round (and vs simulated time, if every run has it) of several runs in one figure each; the ε
    spent per round and accuracy vs ε (``epsilon_vs_round``, ``accuracy_vs_epsilon``) of the runs that spent
    one, when any did."""
    plt = pyplot()
    histories = {run: read_rows(run / HISTORY) for run in runs}
    metric = headline(sorted({k for rows in histories.values() for r in rows for k in r}))
    if metric is None:
        return {}
    figures = {}
    for x, stem, xlabel in (
        ("round", "accuracy_vs_round", "round"),
        ("sim/time", "accuracy_vs_time", "simulated time"),
    ):
        if x == "sim/time" and not all(any(x in r for r in rows) for rows in histories.values()):
            continue
        fig, ax = axes(plt, f"{metric} (client mean)", xlabel, metric)
        for rows, label in zip(histories.values(), run_labels(list(histories))):
            color = _curve(ax, rows, x, metric, label, band=False)
            _finetuned_points(ax, rows, x, metric, f"{label}: {finetuned(metric)}", color)
        ax.legend()
        fig.tight_layout()
        figures[stem] = fig
    figures.update(_overlay_privacy(plt, histories, metric))
    return figures


def _overlay_privacy(plt: Any, histories: dict[Path, list[dict[str, float]]], metric: str) -> dict[str, Any]:
    """The ε per round and ``metric`` vs ε of each run of ``histories`` that spent an ε (none: ``{}``)."""
    labels = dict(zip(histories, run_labels(list(histories))))
    private = {run: rows for run, rows in histories.items() if any(EPSILON in r for r in rows)}
    if not private:
        return {}
    delta = _delta_words(list(private))
    figures = {}
    fig, ax = axes(plt, f"Privacy spent{delta}, per round", "round", "ε")
    for run, rows in private.items():
        _epsilon_line(ax, rows, labels[run])
    ax.legend()
    figures["epsilon_vs_round"] = fig
    measured = {run: rows for run, rows in private.items() if any(metric in r and EPSILON in r for r in rows)}
    if measured:
        fig, ax = axes(plt, f"{metric} (client mean) vs privacy spent{delta}", "ε", metric)
        for run, rows in measured.items():
            _curve(ax, rows, EPSILON, metric, labels[run], band=False)
        ax.legend()
        figures["accuracy_vs_epsilon"] = fig
    for fig in figures.values():
        fig.tight_layout()
    return figures


def save(figures: dict[str, Any], folder: Path) -> list[Path]:
    """Write each figure as ``<folder>/<stem>.png`` and close it."""
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, fig in figures.items():
        path = folder / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
