"""``benchmarks/transformers/lora_round.py`` runs end to end at a reduced size (no timing assertions): the
vectorized runner takes the LoRA round (dropout off, and dropout on under ``--randomness per_client``), and the
store holds about the adapters' bytes per client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "transformers")]

import lora_round  # noqa: E402


def test_lora_round_runs_reduced_and_measures_the_store(capsys):
    result = lora_round.main(["--small"])
    out = capsys.readouterr().out
    assert "runner report: vectorized" in out
    assert set(result) == {"plain", "sequential", "vectorized", "store"}
    for row in result["store"]:
        assert row["adapters"] <= row["held"] <= 1.25 * row["adapters"], row  # pooled rows, nothing else
        assert row["held"] < row["full"] / 10


def test_lora_round_keeps_dropout_on_under_per_client_randomness(capsys):
    lora_round.main(["--small", "--randomness", "per_client"])
    out = capsys.readouterr().out
    assert "runner report: vectorized, randomness per_client (per_client:" in out
