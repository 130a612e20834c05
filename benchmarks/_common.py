"""Helpers shared by the paper-reproduction benchmarks (``fedrep/linear_fig1``, ``fedrep/linear_fig4``,
``fedavg_ft/linear``, ``fedrep/digits_family``) and by ``tests/test_reproductions.py``.

Everything here is plumbing around the library: a quiet Trainer, the linear model without its
per-step training log, fresh clients of a low-rank linear problem, a callback that records the
representation's principal-angle distance after every round, and table/timing printers.
"""

from __future__ import annotations

import logging
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_fedrep import FederatedDataModule
from lightning_fedrep.app.new_clients import evaluate_new_clients
from lightning_fedrep.data.low_rank import LowRankLinearProblem
from lightning_fedrep.data.subspace import principal_angle_distance
from lightning_fedrep.lightning.strategy import FederatedStrategy
from lightning_fedrep.models import LowRankLinear


def synchronize() -> None:
    """Wait for the GPU's queued work before a clock is read (nothing to wait for on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def trainer_device(device: str) -> dict[str, Any]:
    """``Trainer`` keywords that train on ``device`` (``"cpu"`` or ``"cuda"``: one GPU)."""
    return {"accelerator": "gpu", "devices": 1} if device.startswith("cuda") else {"accelerator": "cpu"}


def device_label(device: str | torch.device) -> str:
    """The GPU's name for a ``cuda`` device, else ``"cpu"`` (for a benchmark's header line)."""
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def add_device_argument(parser: Any) -> None:
    """``--device cpu|cuda`` (default ``cpu``) for a benchmark's ``argparse`` parser."""
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where to train (cuda: one GPU)"
    )


class RoundClock(L.Callback):
    """Wall-clock seconds of each training epoch (one round), the GPU's queued work included."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronize()
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def quiet(threads: int | None = 1) -> None:
    """Silence Lightning's info messages and the single-process data-loader warnings, and use
    ``threads`` intra-op threads (1 by default: these models are tiny, and on a shared 2-core machine
    torch's thread pool costs far more than it saves, about 2.5x per step measured here)."""
    if threads is not None:
        torch.set_num_threads(threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*TPU available but not used.*")


def make_trainer(rounds: int, callbacks: Sequence[Callback] = (), **kwargs: Any) -> L.Trainer:
    """A CPU Trainer for ``rounds`` federated rounds with no logger, checkpoints or progress bar.

    Validation runs only where ``check_val_every_n_epoch`` (a keyword) asks; by default never
    (``limit_val_batches=0``), and the benchmarks evaluate with ``trainer.test`` at the end.
    """
    settings: dict[str, Any] = dict(
        max_epochs=rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    if "check_val_every_n_epoch" not in kwargs:
        settings["limit_val_batches"] = 0
    settings.update(kwargs)
    return L.Trainer(**settings)


class QuietLowRankLinear(LowRankLinear):
    """:class:`~lightning_fedrep.models.LowRankLinear` without its per-step ``train/loss`` log.

    Lightning's ``self.log`` in ``training_step`` is about a third of a step's cost for this tiny
    model, and the benchmarks run tens of thousands of steps; nothing reads the training loss.
    Training, the exact head and all evaluation logging (``val/mse``, ``test/mse``) are unchanged.
    """

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name.startswith("train/"):
            return
        super().log(name, value, *args, **kwargs)


def least_squares_model(dim: int) -> QuietLowRankLinear:
    """Local Only's model: a full ``d``-dimensional linear regressor ``theta`` (no shared structure).

    It is a ``LowRankLinear`` of rank ``d`` whose body is the identity and never trains, so the head
    *is* ``theta``. Trained in a head-only phase with ``exact_head`` (one full-batch step), the head is
    the exact least-squares fit ``lstsq(X, y)``: with fewer samples than ``d`` that is the
    minimum-norm interpolant, i.e. where full-batch gradient descent from ``theta = 0`` converges, and
    what the FedRep code's ridge(1e-5) fit approximates.
    """
    return QuietLowRankLinear(dim=dim, rank=dim, lr=0.1, init_body=torch.eye(dim), exact_head=True)


def linear_datamodule(
    train: Sequence[TensorDataset], test: Sequence[TensorDataset], batch_size: int | None = None
) -> FederatedDataModule:
    """Per-client regression data; ``batch_size`` defaults to the largest client (one full batch)."""
    batch = batch_size or max(len(d) for d in train)
    eval_batch = max(len(d) for d in test)
    return FederatedDataModule.from_client_datasets(
        list(train), list(test), batch_size=batch, eval_batch_size=eval_batch
    )


def fresh_linear_clients(
    problem: LowRankLinearProblem,
    num_clients: int,
    train_samples: int,
    test_samples: int,
    seed: int,
    test_noise: bool = True,
) -> tuple[list[TensorDataset], list[TensorDataset], torch.Tensor]:
    """New clients of ``problem``: the same ``B*`` and noise, fresh heads drawn like the training
    clients' (Gaussian rows normalised to norm ``sqrt(k)``), fresh samples.

    Returns ``(train, test, heads)``. With ``test_noise=False`` the test labels are noiseless.
    """
    generator = torch.Generator().manual_seed(seed)
    heads = torch.randn(num_clients, problem.rank, generator=generator, dtype=torch.float64)
    heads = (heads / heads.norm(dim=1, keepdim=True) * problem.rank**0.5).float()
    new = LowRankLinearProblem(problem.ground_truth_body, heads, [], [], problem.noise_std)
    train = [TensorDataset(*new.draw(c, train_samples, generator)) for c in range(num_clients)]
    test = []
    for c in range(num_clients):
        x, y = new.draw(c, test_samples, generator)
        if not test_noise:
            y = x @ (problem.ground_truth_body @ heads[c]).unsqueeze(1)
        test.append(TensorDataset(x, y))
    return train, test, heads


def global_body(strategy: FederatedStrategy, name: str = "body.weight") -> torch.Tensor:
    """The global representation ``B`` (``d x k``) of a trained strategy (``body.weight`` is ``B^T``)."""
    return strategy.global_tensors()[name].T


class RepresentationDistance(Callback):
    """Records ``dist(B, B*)`` of the global body after every round (and before the first).

    Uses only the strategy's public surface (``global_tensors``) in ``on_train_epoch_end``, which runs
    after the round has been aggregated. ``self.distances[t]`` is the distance after ``t`` rounds.
    """

    def __init__(self, truth: torch.Tensor, name: str = "body.weight"):
        self.truth = truth
        self.name = name
        self.distances: list[float] = []

    def _record(self, trainer: L.Trainer) -> None:
        body = trainer.strategy.global_tensors()[self.name].T
        self.distances.append(principal_angle_distance(body, self.truth))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer)


class PerClientTest(Callback):
    """Keeps one metric's per-client values of a ``trainer.test`` run (``client_metrics["test"]``).

    Read in ``teardown``, which Lightning calls after the strategy has stored the test pass's
    per-client metrics.
    """

    def __init__(self, metric: str = "test/mse"):
        self.metric = metric
        self.values: dict[int, float] = {}

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "test":
            self.values = trainer.strategy.client_metrics["test"].per_client(self.metric)


def head_fit_errors(
    model: L.LightningModule,
    datamodule: FederatedDataModule,
    samples: int | None = None,
    seed: int = 0,
    metric: str = "test/mse",
) -> list[float]:
    """``evaluate_new_clients`` with one full-batch head step (the exact head of ``LowRankLinear``)
    on at most ``samples`` training samples per client; returns every client's ``metric``.

    ``datamodule``'s batch size must cover a client's training samples (one step = one full batch).
    """
    capture = PerClientTest(metric)
    evaluate_new_clients(
        model,
        datamodule,
        epochs=None,
        steps=1,
        samples=samples,
        seed=seed,
        accelerator="cpu",
        callbacks=[capture],
    )
    return [capture.values[c] for c in sorted(capture.values)]


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; floats in compact scientific/fixed notation."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if value != value:  # NaN
                return "nan"
            if value == 0 or 1e-3 <= abs(value) < 1e4:
                return f"{value:.4g}"
            return f"{value:.2e}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command that ran this script, as typed from the repository root."""
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])


class Stopwatch:
    """Wall-clock timer: ``Stopwatch().elapsed`` seconds since creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def print_footer(watch: Stopwatch) -> None:
    print(f"\ncommand: {command_line()}")
    print(f"elapsed: {watch.elapsed:.1f} s wall-clock")
