"""Writes the stored version-2 checkpoints that ``tests/test_stored_checkpoints.py`` resumes.

They were written once by the code that defined version 2 of the federated checkpoint (commit eb49da7),
so a later change of the format (the algorithm-API redesign plans a version 3) must keep loading them,
or refuse them with a message. Do not regenerate them to make a failing test pass: that would hide
exactly the incompatibility they exist to catch. Run from the repository root:

    python tests/data/write_version_2_checkpoints.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.test_stored_checkpoints import STORED, fedrep_run  # noqa: E402


def main() -> None:
    steps = HERE / "_steps"
    saver = ModelCheckpoint(dirpath=steps, every_n_train_steps=20, save_top_k=-1, filename="{step}")
    _, trainer = fedrep_run(1, callbacks=[saver], enable_checkpointing=True)
    trainer.save_checkpoint(STORED["round end"])
    saved = sorted(steps.glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[-1]))
    opened = [p for p in saved if torch.load(p, weights_only=True)["lightning_fedrep"]["round"]["open"]]
    opened[0].replace(STORED["mid-round"])
    for path in steps.glob("*.ckpt"):
        path.unlink()
    steps.rmdir()
    for path in STORED.values():
        print(path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
