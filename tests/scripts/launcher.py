"""Start a test script as its own process group with a timeout: the one launcher of the multi-process tests.

The script may start more processes (Lightning's launcher starts the other ranks); on a timeout the whole group
is killed, so nothing the test started outlives it, and only what it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


def run_script(script: Path | str, args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``python script *args`` from ``cwd`` (the repository importable, W&B off): its return code and its
    output (every rank's); the test fails, with the output's tail, if it does not finish within ``timeout``."""
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "WANDB_MODE": "disabled"}
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(
            f"{Path(script).name} {' '.join(args)} did not finish within {timeout} s:\n{output[-4000:]}"
        )
    return process.returncode, output
