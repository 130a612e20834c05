"""Round throughput on 1 vs N processes, and how evenly the ranks share each round's work.

The official CIFAR-10 CNN (``CIFAR10CNN``, 307,842 parameters) on synthetic CIFAR-shaped data: clients
of uneven sizes (``--min-samples`` .. ``--max-samples``, evenly spaced), FedRep with ``--head-epochs``
head epochs and 1 body epoch, batch 10, every client in every round, no validation. Each process
count runs as its own ``Trainer.fit`` in a subprocess (Lightning's launcher starts the other ranks:
``FederatedDDPStrategy``, gloo on CPUs, NCCL on GPUs; 1 process: ``FederatedStrategy``); rank 0 times
every round between two barriers and reports it. Printed, from one run:

  * seconds per round (the median of the rounds after the first, which pays for set-up) and the
    speed-up over 1 process, measured in the same run;
  * the work balance: each rank's client steps in a round, and the share of the padded round a rank
    spends training (mean over ranks of its steps / the busiest rank's steps).

On a CPU machine the processes share the same cores (``torch`` threads are split between them), so a
speed-up there says nothing about GPUs; run it where each rank has its own device.

Usage::

    .venv/bin/python benchmarks/distributed/throughput.py                       # 1 vs 2 CPU processes
    python3 benchmarks/distributed/throughput.py --accelerator gpu --devices 1 2 4 --clients 64
    .venv/bin/python benchmarks/distributed/throughput.py --small               # tests: tiny and quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="process counts to compare")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--min-samples", type=int, default=40)
    parser.add_argument("--max-samples", type=int, default=160)
    parser.add_argument("--head-epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--runner",
        default="vectorized",
        choices=["auto", "vectorized", "sequential"],
        help="vectorized (default): the same lockstep schedule on every process count; auto times its choice per run",
    )
    parser.add_argument("--small", action="store_true", help="4 clients of 10-30 samples, 2 rounds")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process count")
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        args.clients, args.min_samples, args.max_samples, args.head_epochs, args.rounds = 4, 10, 30, 1, 2
    return args


def client_sizes(args: argparse.Namespace) -> list[int]:
    if args.clients == 1:
        return [args.max_samples]
    step = (args.max_samples - args.min_samples) / (args.clients - 1)
    return [round(args.min_samples + i * step) for i in range(args.clients)]


def worker(args: argparse.Namespace, devices: int) -> None:
    """One ``Trainer.fit`` on ``devices`` processes; rank 0 writes the timings to ``args.worker``."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import TensorDataset

    from lightning_fedrep import FederatedDataModule, FederatedDDPStrategy, FederatedStrategy
    from lightning_fedrep.models import CIFAR10CNN

    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))

    class RoundClock(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.shares: list[list[int]] = []
            self.steps: list[int] = []
            self._started = 0.0

        def on_train_epoch_start(self, trainer, pl_module):
            trainer.strategy.barrier()
            self._started = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module):
            trainer.strategy.barrier()
            self.seconds.append(time.perf_counter() - self._started)
            self.shares.append([share.steps for share in trainer.strategy.round_shares()])
            self.steps.append(list(trainer.strategy.rank_steps()))

    generator = torch.Generator().manual_seed(0)
    train = []
    for n in client_sizes(args):
        train.append(
            TensorDataset(
                torch.randn(n, 3, 32, 32, generator=generator),
                torch.randint(0, 10, (n,), generator=generator),
            )
        )
    data = FederatedDataModule.from_client_datasets(train, batch_size=10)
    settings = dict(clients_per_round=1.0, head_epochs=args.head_epochs, body_epochs=1, runner=args.runner)
    strategy = FederatedDDPStrategy(**settings) if devices > 1 else FederatedStrategy(**settings)
    clock = RoundClock()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=args.rounds,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(CIFAR10CNN(), datamodule=data)
    if trainer.global_rank == 0:
        engine = strategy.runner_report.runner
        report = dict(seconds=clock.seconds, shares=clock.shares, steps=clock.steps, engine=engine)
        Path(args.worker).write_text(json.dumps(report))
    if torch.distributed.is_initialized():  # gloo's threads left to interpreter exit can abort the process
        torch.distributed.destroy_process_group()


def run_process_count(args: argparse.Namespace, devices: int, folder: Path) -> dict:
    result = folder / f"devices{devices}.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(result),
        "--devices",
        str(devices),
    ]
    command += [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("devices", "worker", "small", "timeout")
    ]
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    process = subprocess.Popen(
        command,
        env=env,
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        raise SystemExit(f"{devices} process(es) did not finish within {args.timeout} s") from None
    if process.returncode != 0 or not result.exists():
        raise SystemExit(f"{devices} process(es) failed:\n{output[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    args = parse()
    if args.worker:
        worker(args, args.devices[0])
        return
    sizes = client_sizes(args)
    print(
        f"CIFAR10CNN, {len(sizes)} clients of {min(sizes)}..{max(sizes)} samples, FedRep {args.head_epochs} head + 1 body "
        f"epochs, batch 10, {args.rounds} rounds, accelerator={args.accelerator}, runner={args.runner}"
    )
    with tempfile.TemporaryDirectory() as folder:
        reports = {n: run_process_count(args, n, Path(folder)) for n in args.devices}
    baseline = None
    print(
        f"\n{'processes':>9}  {'engine':>10}  {'s/round':>8}  {'rounds/s':>8}  {'speed-up':>8}  {'steps per rank':>14}  "
        f"{'balance':>7}  client steps per rank"
    )
    for devices, report in reports.items():
        timed = report["seconds"][1:] or report["seconds"]
        per_round = statistics.median(timed)
        baseline = baseline or (per_round if devices == args.devices[0] else None)
        shares, steps = report["shares"][-1], report["steps"][-1]
        balance = statistics.mean(steps) / max(steps) if max(steps) else 1.0
        speedup = f"{baseline / per_round:.2f}x" if baseline else "-"
        print(
            f"{devices:>9}  {report['engine']:>10}  {per_round:>8.3f}  {1 / per_round:>8.3f}  {speedup:>8}  "
            f"{str(steps):>14}  {balance:>7.3f}  {shares}"
        )
    print(
        "\nsteps per rank: the Lightning steps each rank trains in a round (every rank runs the largest, the others "
        "idle). balance: their mean / their largest (1.0 = no rank idles). client steps: each rank's clients' "
        "local steps (what the sharding balances)."
    )


if __name__ == "__main__":
    main()
