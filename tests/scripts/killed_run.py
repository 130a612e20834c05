"""A federated fit on the tiny federation that checkpoints like a careful user and can kill itself.

The run writes a checkpoint after every training step (``step=N.ckpt``) and after every round's
validation (``round-end-step=N.ckpt``). With ``--kill-at`` it sends itself SIGKILL at that point — no
exception, no hook, no exception checkpoint: what a pre-empted machine does. The kill-and-resume test
starts it as a subprocess, resumes from the newest checkpoint in its own process (``build`` below, the
same run) and compares with the run that was never killed.

    python tests/scripts/killed_run.py --root /tmp/k --runner sequential --kill-at validation:2:1

Kill points: ``step:N`` after training step N (its checkpoint not yet written), ``round-end:R`` just
after round R closed (its last step trained and aggregated), ``validation:R:B`` after validation batch B
of round R.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_fedrep import FedRepStrategy  # noqa: E402
from lightning_fedrep.lightning import internals  # noqa: E402
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule  # noqa: E402

ROUNDS = 4


class DeclaredLossNet(TinyNet):
    """The tiny net with its pure loss declared: the vectorized runner runs it."""

    fedrep_loss = "cross_entropy"


class KillAt(Callback):
    """SIGKILL this process at one point of the fit (see the module's docstring)."""

    def __init__(self, where: str) -> None:
        kind, *numbers = where.split(":")
        self.kind, self.numbers = kind, [int(n) for n in numbers]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.kind == "step" and trainer.global_step == self.numbers[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        if (
            self.kind == "round-end"
            and trainer.current_epoch == self.numbers[0]
            and internals.round_ends_now(trainer)
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if self.kind == "validation" and [trainer.current_epoch, batch_idx] == self.numbers:
            os.kill(os.getpid(), signal.SIGKILL)


def checkpoints(root: Path) -> list[Callback]:
    return [
        ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1),
        ModelCheckpoint(dirpath=root, filename="round-end-{step}", every_n_epochs=1, save_top_k=-1),
    ]


def newest_checkpoint(root: Path) -> Path:
    """The last checkpoint written: the highest step, and at equal steps the one after validation."""

    def order(path: Path) -> tuple[int, int]:
        return int(path.stem.rsplit("=", 1)[1]), path.stem.startswith("round-end")

    return max(root.glob("*.ckpt"), key=order)


def build(
    runner: str, root: Path, kill_at: str | None = None
) -> tuple[L.LightningModule, FedRepStrategy, L.Trainer]:
    """The run: dropout on the sequential runner (the resume must restore the RNG), 6 clients, 3 a round."""
    torch.manual_seed(0)
    model = TinyNet(dropout=0.2) if runner == "sequential" else DeclaredLossNet()
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=5, runner=runner
    )
    callbacks = checkpoints(root) + ([KillAt(kill_at)] if kill_at else [])
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=ROUNDS,
        callbacks=callbacks,
        enable_checkpointing=True,
        default_root_dir=root,
    )
    return model, strategy, trainer


def datamodule() -> Any:
    return tiny_datamodule(num_clients=6, seed=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--runner", choices=("sequential", "vectorized"), required=True)
    parser.add_argument("--kill-at", required=True)
    args = parser.parse_args()
    model, _, trainer = build(args.runner, args.root, args.kill_at)
    trainer.fit(model, datamodule=datamodule())
    sys.exit("the run was not killed: the kill point was never reached")


if __name__ == "__main__":
    main()
