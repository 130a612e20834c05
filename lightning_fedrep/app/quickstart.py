"""The README's quickstart: FedRep on scikit-learn's digits, offline, on the CPU.

Run with ``make demo`` or ``python -m lightning_fedrep.app.quickstart``. It trains FedRep (20 clients,
2 classes each, half of them per round) and, for comparison, FedAvg's single global model on the same
data, then prints each client's personalized test accuracy and writes ``runs/quickstart/summary.json``, each
run's folder (``runs/quickstart/fedrep``, ``.../fedavg``: tables and figures) and both runs' accuracy
in one figure (``runs/quickstart/figures/accuracy_vs_round.png``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path

import lightning as L

from lightning_fedrep import FederatedStrategy, RunSummary
from lightning_fedrep.app import report
from lightning_fedrep.app.quiet import quiet_unactionable_messages
from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.federation.api.epochs import epoch_settings
from lightning_fedrep.models import MLPClassifier


def run(
    algorithm: str, rounds: int, seed: int, out: Path, figures: bool = True
) -> tuple[dict[str, float], FederatedStrategy, float]:
    """Train one algorithm on the digits federation (its run folder: ``out/<algorithm>``) and return its
    test summary."""
    L.seed_everything(seed, verbose=False)
    data = DigitsDataModule(num_clients=20, classes_per_client=2, batch_size=10, seed=seed)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=0.5,
        seed=seed,
        **epoch_settings(algorithm, head_epochs=5, body_epochs=1),
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=rounds,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(out, name=algorithm, version=""),
        callbacks=[RunSummary(dirpath=str(out / algorithm), print_table=False, figures=figures)],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        check_val_every_n_epoch=5,
        num_sanity_val_steps=0,
    )
    model = MLPClassifier()
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    metrics = trainer.test(model, datamodule=data, verbose=False)[0]
    return metrics, strategy, seconds


def _can_draw() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    parser.add_argument(
        "--figures",
        type=Path,
        default=None,
        help="also copy both runs' figures and their overlay here (the README's are docs/figures/quickstart)",
    )
    args = parser.parse_args(argv)
    quiet_unactionable_messages()
    args.out.mkdir(parents=True, exist_ok=True)
    drawing = _can_draw()

    results = {}
    for algorithm in ("fedrep", "fedavg"):
        metrics, strategy, seconds = run(algorithm, args.rounds, args.seed, args.out, figures=drawing)
        per_client = strategy.client_metrics["test"].per_client("test/acc")
        results[algorithm] = {"test": metrics, "per_client_acc": per_client, "fit_seconds": seconds}
        print(f"\n{algorithm}: {args.rounds} rounds in {seconds:.1f} s")
        print("  client " + " ".join(f"{c:>5d}" for c in per_client))
        print("  acc    " + " ".join(f"{a:5.2f}" for a in per_client.values()))
        print(
            f"  test/acc (client mean) {metrics['test/acc']:.4f}   weighted {metrics['test/acc_weighted']:.4f}   "
            f"p10 {metrics['test/acc_p10']:.4f}   min {metrics['test/acc_min']:.4f}"
        )
    summary = args.out / "summary.json"
    summary.write_text(json.dumps(results, indent=2))
    if drawing:
        runs = [args.out / "fedrep", args.out / "fedavg"]
        overlay = report.save(report.overlay_figures(runs), args.out / report.FIGURES)
        print(f"figures: {', '.join(str(p) for p in [*(r / report.FIGURES for r in runs), *overlay])}")
        if args.figures is not None:
            args.figures.mkdir(parents=True, exist_ok=True)
            for path in overlay[:1]:
                shutil.copy(path, args.figures / "fedrep_vs_fedavg.png")
            for name in ("accuracy_vs_round", "client_round_heatmap", "client_histogram", "partition"):
                path = args.out / "fedrep" / report.FIGURES / f"{name}.png"
                if path.is_file():
                    shutil.copy(path, args.figures / f"fedrep_{name}.png")
    print(
        f"\nFedRep - FedAvg mean client accuracy: "
        f"{results['fedrep']['test']['test/acc'] - results['fedavg']['test']['test/acc']:+.4f}  (summary: {summary})"
    )


if __name__ == "__main__":
    main()
