"""The repository's ``benchmarks`` package wins over any installed package of that name.

Opacus 1.6.0's wheel (the ``privacy`` extra) installs a top-level ``benchmarks`` package into site-packages. A
folder without ``__init__.py`` is a namespace package, which loses to a regular package of the same name anywhere
on ``sys.path``: with Opacus installed, every ``from benchmarks.fedrep ... import`` in the tests and scripts
failed. Here a foreign regular ``benchmarks`` package (a temporary folder, so Opacus need not be installed) is
put on the path of a fresh interpreter after the repository (where site-packages is) and before it (as
``PYTHONPATH`` would put it), and the repository's package must still be the one imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import find_packages
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A folder holding a regular package ``benchmarks`` that is not the repository's (like Opacus's)."""
    site = tmp_path / "site-packages"
    (site / "benchmarks").mkdir(parents=True)
    (site / "benchmarks" / "__init__.py").write_text("FOREIGN = True\n")
    (site / "benchmarks" / "layers.py").write_text("")
    return site


def run(args: list[str], path: list[Path | str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python args`` with ``PYTHONPATH`` = ``path`` then this process's own ``PYTHONPATH``."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), *inherited])}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_repository_benchmarks_wins_over_a_later_installed_one(foreign, tmp_path):
    """The repository before the foreign package (site-packages comes after the scripts' and pytest's
    insertions): the regular package found first wins. Catches ``benchmarks/__init__.py`` removed (the
    namespace package then loses to the foreign one wherever it is)."""
    code = "import benchmarks, benchmarks.fedrep; print(benchmarks.__file__)"
    result = run(["-c", code], [ROOT, foreign], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "benchmarks" / "__init__.py"


def test_pytest_collects_benchmark_imports_with_a_foreign_one_first(foreign):
    """The foreign package first on ``PYTHONPATH``: pytest still puts the repository first (``pythonpath`` in
    ``pyproject.toml``), so a test importing ``benchmarks.fedrep`` collects."""
    args = ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_linear.py"]
    result = run(args, [foreign], cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_linear.py::" in result.stdout


def test_benchmark_script_runs_with_a_foreign_one_first(foreign, tmp_path):
    """A benchmark script run by path from elsewhere inserts the repository at ``sys.path[0]`` and imports its
    own ``benchmarks.srpfl`` (``--help`` runs the imports and exits)."""
    result = run([str(ROOT / "benchmarks" / "srpfl" / "qr_effect.py"), "--help"], [foreign], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout


def test_the_wheel_installs_no_benchmarks_package():
    """This project must not do what Opacus did: its distribution holds ``lightning_fedrep`` only."""
    setting = read_configuration(ROOT / "pyproject.toml", expand=False)["tool"]["setuptools"]["packages"][
        "find"
    ]
    packages = find_packages(str(ROOT), include=setting["include"])
    assert packages and all(p.split(".")[0] == "lightning_fedrep" for p in packages), packages
