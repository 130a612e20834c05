"""FedAvg + fine-tuning names its per-client numbers as the summaries they belong to (issue 43, item 2).

The federated rounds' validation (for FedAvg: the global model) is ``val/acc`` everywhere; the validation of
the fine-tuned models after ``HeadFineTuning`` is ``finetune/val/acc`` everywhere: the logged summary,
``strategy.client_metrics["finetune/val"]``, ``clients_finetune_val.csv``, ``summary.json``'s
``per_client``, the printed table, the figures and ``lightning-fedrep report``. The per-client values are
checked against plain PyTorch: the global model and each client's fine-tuned model (fine-tuned here in a
plain loop on the strategy's batches) scored on the client's evaluation split.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy, RunSummary
from lightning_fedrep.callbacks import HeadFineTuning
from lightning_fedrep.federation.api.epochs import epoch_settings
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, tiny_datamodule

ROUNDS = 3
EPOCHS = 2
CLIENTS = 6


def fedavg_run(folder: Path, finetune: bool) -> dict:
    """FedAvg for ``ROUNDS`` rounds on ``TinyNet`` (then ``HeadFineTuning``), with ``RunSummary`` writing into
    ``folder``; what the run printed and its objects."""
    torch.manual_seed(0)
    model = TinyNet()
    dm = tiny_datamodule(num_clients=CLIENTS, seed=4)
    strategy = FedRepStrategy(
        head="classifier", algorithm="fedavg", clients_per_round=3, seed=2, **epoch_settings("fedavg")
    )
    callbacks = [HeadFineTuning(epochs=EPOCHS, mode="head")] if finetune else []
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=ROUNDS, callbacks=[*callbacks, RunSummary(str(folder))]
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(model, datamodule=dm)
    return {"folder": folder, "printed": printed.getvalue(), "strategy": strategy, "dm": dm, "model": model}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fedavg_run(tmp_path_factory.mktemp("fedavg_ft"), finetune=True)


def evaluation_split(dm) -> str:
    try:
        dm.client_data(0, "val")
    except ValueError:
        return "test"
    return "val"


def accuracy(state: dict[str, torch.Tensor], dm, client: int) -> float:
    """A ``TinyNet`` holding ``state`` scored on ``client``'s evaluation split, in plain PyTorch."""
    model = TinyNet()
    model.load_state_dict(state)
    data = dm.client_data(client, evaluation_split(dm))
    x, y = data.dataset.tensors
    with torch.no_grad():
        predicted = model(x[data.indices]).argmax(dim=1)
    return (predicted == y[data.indices]).double().mean().item()


def fine_tuned(global_state: dict[str, torch.Tensor], dm, client: int) -> dict[str, torch.Tensor]:
    """The global model's head fine-tuned on ``client``'s training data (the fine-tuning round's batches),
    body frozen, with the module's own optimizer: written out in plain PyTorch."""
    model = TinyNet()
    model.load_state_dict(global_state)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in HEAD)
    optimizer = model.configure_optimizers()
    steps = EPOCHS * math.ceil(dm.client_num_samples(client) / dm.batch_size)
    for x, y in client_batches(dm, dm.seed, ROUNDS, client, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def reference(run: dict) -> dict[str, dict[int, float]]:
    """Each client's accuracy of the global model (``val/acc``) and of its fine-tuned model
    (``finetune/val/acc``), computed here."""
    dm, strategy = run["dm"], run["strategy"]
    global_state = {n: t.detach().clone() for n, t in strategy.global_tensors().items()}
    assert set(global_state) == set(TinyNet().state_dict())  # FedAvg shares the whole model
    return {
        "val/acc": {c: accuracy(global_state, dm, c) for c in range(CLIENTS)},
        "finetune/val/acc": {c: accuracy(fine_tuned(global_state, dm, c), dm, c) for c in range(CLIENTS)},
    }


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def csv_column(path: Path, name: str) -> dict[int, float]:
    return {int(r["client"]): float(r[name]) for r in csv_rows(path) if r.get(name)}


def mean(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values)


def test_client_metrics_keep_the_global_and_the_fine_tuned_values_under_their_summaries_names(run, reference):
    """``client_metrics["val"]`` holds the last federated round's per-client ``val/acc`` (the global model's),
    ``client_metrics["finetune/val"]`` the fine-tuned models' ``finetune/val/acc``; each mean is the summary of
    the same name. Catches the fine-tuning validation stored as ``client_metrics["val"]`` under ``val/acc``
    (the issue: ``evaluation.key`` -> ``evaluation.stage`` in ``evaluation/passes.py``)."""
    strategy = run["strategy"]
    results = strategy.results()
    assert set(strategy.client_metrics) == {"val", "finetune/val"}
    federated, tuned = strategy.client_metrics["val"], strategy.client_metrics["finetune/val"]
    assert "val/acc" in federated.names and not any(n.startswith("finetune/") for n in federated.names)
    assert "finetune/val/acc" in tuned.names and all(n.startswith("finetune/") for n in tuned.names)
    assert federated.per_client("val/acc") == pytest.approx(reference["val/acc"], abs=1e-6)
    assert tuned.per_client("finetune/val/acc") == pytest.approx(reference["finetune/val/acc"], abs=1e-6)
    assert mean(reference["val/acc"]) == pytest.approx(results["final"]["val/acc"], abs=1e-6)
    assert mean(reference["finetune/val/acc"]) == pytest.approx(
        results["finetune"]["finetune/val/acc"], abs=1e-6
    )
    # the check can fail: fine-tuning moved the clients' accuracies
    assert mean(reference["finetune/val/acc"]) != pytest.approx(mean(reference["val/acc"]), abs=1e-3)


def test_the_files_name_each_column_as_the_summary_whose_mean_it_is(run, reference):
    """``clients_val.csv``'s ``val/acc`` averages to ``summary.json``'s ``val/acc`` (the last federated round),
    ``clients_finetune_val.csv``'s ``finetune/val/acc`` to its ``finetune/val/acc``; ``per_client`` in the
    summary is keyed and named the same, and history.csv holds the fine-tuning round's summary in a row of its
    own. Catches ``clients_val.csv`` holding the fine-tuned accuracies as ``val/acc`` (the issue)."""
    folder = run["folder"]
    summary = json.loads((folder / "summary.json").read_text())
    final, finetune = summary["results"]["final"], summary["results"]["finetune"]
    federated = csv_column(folder / "clients_val.csv", "val/acc")
    tuned = csv_column(folder / "clients_finetune_val.csv", "finetune/val/acc")
    assert federated == pytest.approx(reference["val/acc"], abs=1e-6)
    assert tuned == pytest.approx(reference["finetune/val/acc"], abs=1e-6)
    assert mean(federated) == pytest.approx(final["val/acc"], abs=1e-6)
    assert mean(tuned) == pytest.approx(finetune["finetune/val/acc"], abs=1e-6)
    assert not any(c.startswith("finetune/") for c in csv_rows(folder / "clients_val.csv")[0])
    assert "val/acc" not in csv_rows(folder / "clients_finetune_val.csv")[0]

    assert set(summary["per_client"]) == {"val", "finetune/val"}
    for key, name in (("val", "val/acc"), ("finetune/val", "finetune/val/acc")):
        per_client = {int(c): v for c, v in summary["per_client"][key][name].items()}
        assert per_client == pytest.approx(reference[name], abs=1e-6)
    assert summary["fine_tuning"]["label"] == "head fine-tuning"
    assert summary["fine_tuning"]["epochs"] == EPOCHS and summary["fine_tuning"]["rounds"] == 1

    history = csv_rows(folder / "history.csv")
    assert [int(r["round"]) for r in history] == [*range(ROUNDS), ROUNDS]
    last = history[-1]
    assert not last["val/acc"] and float(last["finetune/val/acc"]) == pytest.approx(
        finetune["finetune/val/acc"]
    )
    assert all(not r.get("finetune/val/acc") for r in history[:-1])
    assert max(r["round"] for r in summary["history"]) == ROUNDS - 1  # the federated figures exclude it


def printed_table(printed: str, name: str) -> tuple[dict[int, float], str]:
    """The per-client values the table titled ``name`` printed, and its line of summaries."""
    block = [
        line.strip() for line in printed.split(f"Per-client {name} (", 1)[1].split("\n\n", 1)[0].splitlines()
    ]
    values = {int(c): float(v) for line in block[1:-1] for c, v in re.findall(r"#(\d+)\s+(\S+)", line)}
    return values, block[-1]


def test_the_printed_tables_name_the_global_and_the_fine_tuned_accuracies_apart(run, reference):
    """One table per name, each with its own clients' values and the summaries of its name. Catches the
    fine-tuned values printed under ``Per-client val/acc`` beside the global ``val/acc`` (the issue)."""
    results = run["strategy"].results()
    for name, figures in (("val/acc", results["final"]), ("finetune/val/acc", results["finetune"])):
        values, summaries = printed_table(run["printed"], name)
        assert values == {c: float(f"{v:.4g}") for c, v in reference[name].items()}, name
        assert summaries.startswith(f"{name} {figures[name]:.4g}   {name}_weighted "), summaries
        assert (name == "val/acc") == ("finetune/" not in summaries), summaries


def test_the_histogram_and_the_curve_show_the_fine_tuned_values_under_their_name(run):
    """``client_histogram`` draws ``val/acc`` of clients_val.csv and ``finetune/val/acc`` of
    clients_finetune_val.csv, each named; ``accuracy_vs_round`` marks the fine-tuning round's
    ``finetune/val/acc``. Catches a histogram of the fine-tuned values labelled ``val/acc`` (the issue) and a
    curve without the fine-tuned figure."""
    import matplotlib.pyplot as plt

    from lightning_fedrep.app.report import run_figures

    folder = run["folder"]
    finetune = run["strategy"].results()["finetune"]["finetune/val/acc"]
    figures = run_figures(folder)
    try:
        ax = figures["client_histogram"].axes[0]
        drawn = {container.patches[0].get_label(): container.patches for container in ax.containers}
        assert list(drawn) == ["val/acc", "finetune/val/acc"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["val/acc", "finetune/val/acc"]
        files = {"val/acc": "clients_val.csv", "finetune/val/acc": "clients_finetune_val.csv"}
        values = {name: list(csv_column(folder / file, name).values()) for name, file in files.items()}
        everything = values["val/acc"] + values["finetune/val/acc"]
        for name, bars in drawn.items():  # one set of bins for both
            counts, _ = np.histogram(values[name], bins=len(bars), range=(min(everything), max(everything)))
            assert [b.get_height() for b in bars] == counts.tolist(), name

        lines = {line.get_label(): line for line in figures["accuracy_vs_round"].axes[0].get_lines()}
        (marker,) = [line for label, line in lines.items() if label.startswith("finetune/val/acc")]
        assert list(marker.get_xdata()) == [ROUNDS]
        assert list(marker.get_ydata()) == pytest.approx([finetune])
        assert list(lines["client mean"].get_xdata()) == list(range(ROUNDS))
    finally:
        for figure in figures.values():
            plt.close(figure)


def test_report_names_the_fine_tuning_and_shows_both_figures(run, tmp_path, capsys):
    """``lightning-fedrep report`` names the run ``fedavg + head fine-tuning`` and prints the last federated
    round's ``val/acc`` beside the fine-tuned ``finetune/val/acc``; a FedAvg run without fine-tuning is plain
    ``fedavg`` with ``val/acc`` alone; the overlay marks the fine-tuned figure in the run's colour. Catches the
    label read from the algorithm alone (the issue: "labels the run fedavg and shows no fine-tuned number")."""
    import matplotlib.pyplot as plt

    from lightning_fedrep.app.report import main, overlay_figures

    plain = fedavg_run(tmp_path / "plain", finetune=False)
    results, plain_results = run["strategy"].results(), plain["strategy"].results()
    capsys.readouterr()
    main([str(run["folder"]), "--out", str(tmp_path / "one")])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if not x.endswith(".png")]
    assert line.startswith("fedavg + head fine-tuning (")
    assert f"val/acc {results['final']['val/acc']:.4g} (last federated round, round {ROUNDS - 1})" in line
    assert f"finetune/val/acc {results['finetune']['finetune/val/acc']:.4g} (fine-tuned models" in line

    main([str(run["folder"]), str(plain["folder"]), "--out", str(tmp_path / "two")])
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.endswith(".png")]
    assert lines[0].startswith("fedavg + head fine-tuning (") and lines[1].startswith("fedavg (")
    assert f"val/acc {plain_results['final']['val/acc']:.4g}" in lines[1] and "finetune/" not in lines[1]

    figure = overlay_figures([run["folder"], plain["folder"]])["accuracy_vs_round"]
    try:
        drawn = figure.axes[0].get_lines()
        labels = [line.get_label() for line in drawn]
        assert labels[0].startswith("fedavg + head fine-tuning (") and labels[2].startswith("fedavg (")
        assert labels[1] == f"{labels[0]}: finetune/val/acc"
        assert drawn[1].get_color() == drawn[0].get_color()
        assert list(drawn[1].get_ydata()) == pytest.approx([results["finetune"]["finetune/val/acc"]])
    finally:
        plt.close(figure)


def test_validate_after_fine_tuning_names_its_per_client_values_finetune(run, reference):
    """A ``validate`` of the fine-tuned models logs ``finetune/val/acc``, keeps its per-client values under
    ``client_metrics["finetune/val"]`` and writes them as ``clients_finetune_val.csv``; their mean is the
    logged figure. Catches the end of the pass (``FederatedEvaluation.end``) storing them as ``client_metrics["val"]``."""
    strategy, dm, folder = run["strategy"], run["dm"], run["folder"]
    with contextlib.redirect_stdout(io.StringIO()):
        (validated,) = strategy.lightning_module.trainer.validate(run["model"], datamodule=dm, verbose=False)
    assert "val/acc" not in validated
    assert validated["finetune/val/acc"] == pytest.approx(mean(reference["finetune/val/acc"]), abs=1e-6)
    tuned = strategy.client_metrics["finetune/val"].per_client("finetune/val/acc")
    assert tuned == pytest.approx(reference["finetune/val/acc"], abs=1e-6)
    federated = strategy.client_metrics["val"].per_client("val/acc")
    assert federated == pytest.approx(reference["val/acc"], abs=1e-6)  # the federated round's, kept
    assert csv_column(folder / "clients_finetune_val.csv", "finetune/val/acc") == pytest.approx(
        reference["finetune/val/acc"], abs=1e-6
    )
    written = json.loads((folder / "summary.validate.json").read_text())
    assert mean(written["per_client"]["finetune/val"]["finetune/val/acc"]) == pytest.approx(
        written["metrics"]["finetune/val/acc"], abs=1e-6
    )
