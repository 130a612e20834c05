"""A run killed with SIGKILL and resumed from its newest checkpoint ends exactly as the run never killed.

The killed run is ``tests/scripts/killed_run.py`` in a subprocess (a checkpoint after every step and after
every round's validation); it kills itself at a training step drawn at random, just after a round closes,
or during a round's validation. The resume (in this process) starts from the newest checkpoint on disk;
its global body, every client's head and its history (every round's validation, in order) must equal
the uninterrupted run's, on both engines.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.scripts.killed_run import ROUNDS, build, datamodule, newest_checkpoint

REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPT = REPOSITORY / "tests" / "scripts" / "killed_run.py"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per engine: the strategy after a run that was never killed."""
    runs = {}

    def get(engine: str):
        if engine not in runs:
            model, strategy, trainer = build(engine, tmp_path_factory.mktemp(f"whole-{engine}"))
            trainer.fit(model, datamodule=datamodule())
            runs[engine] = strategy
        return runs[engine]

    return get


def kill_point(kind: str, engine: str, strategy) -> str:
    lengths = [strategy.round_plan(r).length for r in range(ROUNDS)]
    ends = [sum(lengths[: r + 1]) for r in range(ROUNDS)]
    if kind == "random-step":  # inside a round after the first, never at a round's end
        steps = [s for s in range(ends[0] + 1, ends[-2]) if s not in ends]
        return f"step:{random.Random(f'kill-{engine}').choice(steps)}"
    if kind == "round-end":
        return "round-end:1"
    return "validation:2:1"


def run_until_killed(root: Path, engine: str, where: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "WANDB_MODE": "disabled"}
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--root", str(root), "--runner", engine, "--kill-at", where],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the run to kill at {where} did not finish within 240 s:\n{output[-4000:]}")
    assert process.returncode == -signal.SIGKILL, f"not killed at {where}:\n{output[-4000:]}"


@pytest.mark.parametrize(
    "engine, kind",
    [
        ("sequential", "random-step"),
        ("sequential", "round-end"),
        ("sequential", "validation"),
        ("vectorized", "random-step"),
        ("vectorized", "validation"),
    ],
)
def test_a_killed_run_resumes_to_the_same_parameters_and_history(tmp_path, uninterrupted, engine, kind):
    whole = uninterrupted(engine)
    where = kill_point(kind, engine, whole)
    run_until_killed(tmp_path, engine, where)

    model, resumed, trainer = build(engine, tmp_path / "resumed")
    trainer.fit(model, datamodule=datamodule(), ckpt_path=newest_checkpoint(tmp_path))

    assert trainer.current_epoch == ROUNDS
    for expected, actual in zip(whole.federation.global_state, resumed.federation.global_state, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert resumed.federation.store.local.keys() == whole.federation.store.local.keys()
    for client, tensors in whole.federation.store.local.items():
        for expected, actual in zip(tensors, resumed.federation.store.local[client], strict=True):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert [row["round"] for row in resumed.history] == list(range(ROUNDS)), where
    assert resumed.history == whole.history, where
