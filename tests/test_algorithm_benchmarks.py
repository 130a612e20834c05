"""``benchmarks/algorithms/digits_all.py`` (every registered algorithm on digits) at a reduced size: a smoke
check that each split's table has a row per registered algorithm (plus the "+ FT" rows and FedBN's reference),
each with a number, not of the accuracies; and FedBN's BatchNorm model against a closed form."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.algorithms import digits_all
from lightning_fedrep.federation.api.registry import ALGORITHMS


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: torch's intra-op thread pool only slows them down on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table_rows(out: str, caption: str) -> dict[str, list[str]]:
    """The cells of the markdown table printed after the line starting with ``caption``, by method label."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| method |"))
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_every_registered_algorithm_has_a_row_in_both_splits(capsys):
    results = digits_all.main(["--seeds", "0", "--rounds", "2"])
    out = capsys.readouterr().out
    expected = {digits_all.LABELS.get(row, row) for row in digits_all.methods()}
    assert all(digits_all.LABELS.get(name, name) in expected for name in ALGORITHMS)
    assert {"FedAvg + FT (head, 10 ep)", "FedAvg (BN MLP)", "FedBN (BN MLP)"} <= expected
    assert list(results) == ["shard", "dirichlet"]
    for split in results:
        rows = table_rows(out, f"digits, {split}:")
        assert set(rows) == expected, set(rows) ^ expected
        for label, (runner, final, *_rest) in rows.items():
            assert runner in ("vectorized", "sequential", "sequential/vectorized"), (label, runner)
            mean, std = (float(x) for x in final.split(" ± "))
            assert 0.0 <= mean <= 100.0 and std >= 0.0, (split, label, final)
        assert rows["FedBN (BN MLP)"][0] == "sequential"  # BatchNorm in train mode: not in lockstep
        assert rows["FedAvg (global model)"][3] == "—" and rows["Local Only"][4] == "—"
        for per_seed in results[split]:
            assert all(not math.isnan(r["final"]) for r in per_seed.values()), per_seed


def test_rows_option_runs_only_those_and_seeds_give_mean_and_std(capsys):
    argv = ["--splits", "shard", "--seeds", "0", "1", "--rounds", "1", "--rows", "fedavg", "local"]
    results = digits_all.main(argv)
    assert [list(r) for r in results["shard"]] == [["fedavg", "local"]] * 2
    rows = table_rows(capsys.readouterr().out, "digits, shard:")
    assert set(rows) == {"FedAvg (global model)", "Local Only"}
    diffs = [r["local"]["final"] - r["fedavg"]["final"] for r in results["shard"]]
    mean, std = (float(x) for x in rows["Local Only"][3].split(" ± "))  # the "vs FedAvg" cell
    assert mean == pytest.approx(sum(diffs) / 2, abs=0.01)
    assert std == pytest.approx(abs(diffs[0] - diffs[1]) / math.sqrt(2), abs=0.01)


def test_one_sample_batch_norm_uses_the_running_statistics_and_larger_batches_their_own():
    torch.manual_seed(0)
    norm = digits_all.OneSampleBatchNorm1d(3).train()
    norm.running_mean.fill_(0.5)
    norm.running_var.fill_(4.0)
    norm.weight.data = torch.tensor([1.0, 2.0, 3.0])
    norm.bias.data = torch.tensor([0.0, 1.0, -1.0])
    one = torch.randn(1, 3)
    expected = (one - 0.5) / math.sqrt(4.0 + norm.eps) * norm.weight + norm.bias
    torch.testing.assert_close(norm(one), expected)
    assert norm.running_mean.eq(0.5).all()  # a batch of one leaves the statistics alone
    batch = torch.randn(5, 3)
    plain = (batch - batch.mean(0)) / torch.sqrt(batch.var(0, unbiased=False) + norm.eps)
    torch.testing.assert_close(norm(batch), plain * norm.weight + norm.bias)


def test_split_settings_keep_the_client_trainings_of_the_full_participation_rows():
    shard, dirichlet = digits_all.split_settings("shard"), digits_all.split_settings("dirichlet")
    for s in (shard, dirichlet):
        assert s.rounds == 50 and s.local_only_rounds == 25
        assert s.l2gd_rounds * s.num_clients == s.rounds * s.clients_per_round
    assert (shard.num_clients, shard.classes_per_client, shard.dirichlet_alpha) == (50, 2, None)
    assert (dirichlet.num_clients, dirichlet.dirichlet_alpha) == (20, 0.1)
    with pytest.raises(ValueError, match="split must be one of"):
        digits_all.split_settings("iid")
