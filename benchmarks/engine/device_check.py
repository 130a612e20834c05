"""Does training on a GPU compute what training on the CPU computes? A check to run where a GPU is lent.

A reduced FedRep workload of ``cifar_round.py`` (the CIFAR CNN, 3 clients x 40 samples, 2 head + 1 body epochs,
2 rounds) fits on ``--device`` with each engine (``sequential``, ``vectorized``, ``auto``) and on the CPU with
the sequential runner; then ``trainer.test`` scores every client on both, with and without
``FineTunedEvaluation`` (on cached features: this CNN's body is a fixed function of its input). Printed: the largest difference of the global body,
the heads and the per-client test metrics against the CPU's, and a verdict per row (float32 arithmetic, TF32
turned off, so the devices agree to rounding: tolerance 1e-4 relative).

Usage::

    python3 benchmarks/engine/device_check.py --device cuda     # where a GPU is lent
    .venv/bin/python benchmarks/engine/device_check.py          # CPU against CPU (a smoke run of the script)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_device_argument, device_label, make_trainer, quiet, trainer_device  # noqa: E402
from cifar_round import HEAD, Workload, initial_model, make_data, strategy_heads, workload_strategy  # noqa: E402

from lightning_fedrep.callbacks import FineTunedEvaluation  # noqa: E402

TOLERANCE = 1e-4


def fit_and_test(w: Workload, engine: str, device: str, fine_tune: bool) -> dict[str, object]:
    """Two rounds on ``device``, then ``trainer.test``; the global body, the heads and per-client metrics."""
    strategy = workload_strategy(w, engine)
    callbacks = [FineTunedEvaluation(epochs=2, stages=("test",))] if fine_tune else []
    trainer = make_trainer(2, callbacks=callbacks, strategy=strategy, **trainer_device(device))
    model = initial_model(w)
    dm = make_data(w)
    trainer.fit(model, datamodule=dm)
    body = {n: t.detach().cpu() for n, t in strategy.global_tensors().items() if n not in HEAD}
    heads = strategy_heads(strategy, w.clients).detach().cpu()
    trainer.test(model, datamodule=dm, verbose=False)
    table = strategy.client_metrics["test"]
    metrics = {m: table.per_client(m) for m in ("test/loss", "test/acc")}
    return {"body": body, "heads": heads, "metrics": metrics, "engine": strategy.runner_report.runner}


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def compare(reference: dict[str, object], got: dict[str, object]) -> tuple[float, float, float]:
    body = max(relative_gap(got["body"][n], reference["body"][n]) for n in reference["body"])
    heads = relative_gap(got["heads"], reference["heads"])
    metrics = max(
        abs(got["metrics"][m][c] - value) / max(abs(value), 1e-12)
        for m, per_client in reference["metrics"].items()
        for c, value in per_client.items()
    )
    return body, heads, metrics


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = Workload(clients=3, samples=40, head_epochs=2)
    where = device_label(args.device)
    print(
        f"{where} against the CPU: CIFAR10CNN, {w.clients} clients x {w.samples}, 2 rounds, then trainer.test"
    )
    print(
        "  engine     | FineTunedEvaluation | ran as     | body gap | heads gap | test metrics gap | verdict"
    )
    all_ok = True
    for fine_tune in (False, True):
        reference = fit_and_test(w, "sequential", "cpu", fine_tune)
        for engine in ("sequential", "vectorized", "auto"):
            try:
                got = fit_and_test(w, engine, args.device, fine_tune)
            except Exception as error:  # noqa: BLE001 (a report, not a handler: the row says what broke)
                print(f"  {engine:10s} | {str(fine_tune):19s} | FAILED: {type(error).__name__}: {error}")
                all_ok = False
                continue
            gaps = compare(reference, got)
            ok = all(g <= TOLERANCE for g in gaps)
            all_ok &= ok
            print(
                f"  {engine:10s} | {str(fine_tune):19s} | {got['engine']:10s} | {gaps[0]:8.1e} | {gaps[1]:9.1e} | "
                f"{gaps[2]:16.1e} | {'ok' if ok else 'DIFFERS'}",
                flush=True,
            )
    print("all rows agree" if all_ok else "SOME ROWS DIFFER OR FAILED")
    return all_ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
