"""The files a run leaves in its folder, written from the strategy's state (``RunSummary`` calls this at
the end of every ``fit``/``validate``/``test``), and read back by ``lightning-fedrep report``.

- ``history.csv``: one row per evaluated round (the summaries over clients, ``sim/time``, ``faults``,
  NC metrics ... whatever the history holds);
- ``clients.csv``: one row per (evaluated round, client) with that client's validation metrics;
- ``participation.csv``: how many federated rounds each client was sampled for;
- ``partition.csv``: each client's training samples per label (when the data has integer labels);
- ``clients_<stage>.csv``: each client's metrics of the last ``<stage>`` evaluation (``val``, ``test``), one file
  per key of ``strategy.client_metrics``: ``clients_val.csv`` holds the last federated round's ``val/acc``
  ..., and after ``HeadFineTuning`` ``clients_finetune_val.csv`` the fine-tuned models' ``finetune/val/acc``
  ... (the per-client values of the summaries logged under the same names).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

HISTORY = "history.csv"
CLIENTS = "clients.csv"
PARTICIPATION = "participation.csv"
PARTITION = "partition.csv"


def write_rows(path: Path, rows: Iterable[dict[str, Any]], first: Iterable[str] = ()) -> None:
    """``rows`` as a CSV file with a header of every key (``first`` keys first, then in order of appearance)."""
    rows = list(rows)
    columns = list(first)
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def read_rows(path: Path) -> list[dict[str, float]]:
    """A CSV file written by :func:`write_rows`, numbers as floats (empty cells left out)."""
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return [
            {k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)
        ]


def partition_rows(datamodule: Any) -> list[dict[str, Any]]:
    """Each client's training samples per label, ``[{"client": c, "label": k, "samples": n}, ...]``;
    ``[]`` for data without integer labels or a data module that is not federated."""
    from lightning_fedrep.data.module import dataset_labels

    if datamodule is None or not hasattr(datamodule, "client_data"):
        return []
    rows, labels_of = [], {}
    try:
        for client in range(datamodule.num_clients):
            data = datamodule.client_data(client, "train")
            key = id(data.dataset)
            if key not in labels_of:
                labels_of[key] = dataset_labels(data.dataset)
            labels, counts = torch.unique(labels_of[key][data.indices], return_counts=True)
            rows.extend(
                {"client": client, "label": int(k), "samples": int(n)} for k, n in zip(labels, counts)
            )
    except (ValueError, RuntimeError, TypeError, AttributeError):  # regression targets, no set-up
        return []
    return rows


def stage_file(key: str) -> str:
    """The file name of the per-client metrics kept under ``key`` in ``strategy.client_metrics``:
    ``clients_val.csv``, ``clients_test.csv``, ``clients_finetune_val.csv`` (``finetune/val``)."""
    return f"clients_{key.replace('/', '_')}.csv"


def stage_files(folder: Path) -> list[Path]:
    """The ``clients_<stage>.csv`` files in a run folder (not ``clients.csv``), by name."""
    return sorted(p for p in folder.glob("clients_*.csv") if p.is_file())


def write_stage_files(folder: Path, strategy: Any) -> list[Path]:
    """``clients_<stage>.csv``: each client's metrics of the strategy's last evaluation of each stage (each key
    of ``strategy.client_metrics`` but the sanity check, :func:`stage_file`), columns named as the metrics."""
    written = []
    for key, metrics in strategy.client_metrics.items():
        if key == "sanity":
            continue
        rows: dict[int, dict[str, Any]] = {}
        for name in metrics.names:
            for client, value in metrics.per_client(name).items():
                row = rows.setdefault(client, {"client": client, "samples": metrics.samples.get(client)})
                row[name] = value
        path = folder / stage_file(key)
        write_rows(path, [rows[c] for c in sorted(rows)], first=["client", "samples"])
        written.append(path)
    return written


def write_run_files(folder: Path, strategy: Any, datamodule: Any = None) -> list[Path]:
    """Write the run's tables into ``folder`` (created if missing); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    history = strategy.federation.history if strategy.federation is not None else None
    written = []
    if history is not None:
        write_rows(folder / HISTORY, history.rows, first=["round"])
        write_rows(folder / CLIENTS, history.client_rows, first=["round", "client"])
        participation = [{"client": c, "rounds": n} for c, n in sorted(history.participation.items())]
        write_rows(folder / PARTICIPATION, participation, first=["client", "rounds"])
        written += [folder / HISTORY, folder / CLIENTS, folder / PARTICIPATION]
    written += write_stage_files(folder, strategy)
    partition = partition_rows(datamodule)
    if partition:
        write_rows(folder / PARTITION, partition, first=["client", "label", "samples"])
        written.append(folder / PARTITION)
    return written
