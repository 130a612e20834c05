"""Writes the stored version-3 checkpoint that ``tests/test_algorithm_v2.py`` resumes.

It was written once by the code that defined version 3 of the federated checkpoint (declared server tensors
and client tensors), at the end of round 0 of ``counted_run``, so a later change of the format must keep
loading it, or refuse it with a message. Do not regenerate it to make a failing test pass: that would hide
exactly the incompatibility it exists to catch. Run from the repository root:

    python tests/data/write_version_3_checkpoints.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.test_algorithm_v2 import STORED_V3, counted_run  # noqa: E402


def main() -> None:
    _, trainer = counted_run(1)
    trainer.save_checkpoint(STORED_V3)
    print(STORED_V3, STORED_V3.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
