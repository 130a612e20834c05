"""The Lightning-free evaluation records and checkpoint payloads (issue 25, item 3), without a Trainer:
the logged values and last-10 means against numpy, the partial-pass note, and a process's share of a
checkpoint written by several processes."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

from lightning_fedrep.evaluation.metrics import EvaluationPass
from lightning_fedrep.evaluation.records import non_finite_note, partial_pass_note, pass_values
from lightning_fedrep.federation.checkpoint.entry import read_federated_entry, this_rank_state
from lightning_fedrep.federation.checkpoint.reading import CheckpointError
from lightning_fedrep.federation.history import History


def _pass(accs: dict[int, float], sizes: dict[int, int]) -> EvaluationPass:
    """A validation pass whose client ``c`` scored ``accs[c]`` on ``sizes[c]`` samples."""
    evaluation = EvaluationPass("val", lambda *a: nullcontext(set()), len)
    for client, acc in accs.items():
        evaluation.metrics.add("val/acc", client, acc * sizes[client], sizes[client])
        evaluation.metrics.samples[client] += sizes[client]
    return evaluation


def test_pass_values_record_the_round_and_the_last_ten_means():
    """Catches the last-10 means losing the weighted figure (``for key in (name,)`` in ``pass_values``) or
    averaging over the wrong rounds: 12 validated rounds against numpy's mean over the last 10."""
    rng = np.random.default_rng(0)
    sizes = {0: 3, 1: 5, 2: 8}
    history, means, weighted = History(), [], []
    for round_index in range(12):
        accs = {c: float(rng.random()) for c in sizes}
        values = pass_values(_pass(accs, sizes), history, round_index, prefix="", in_fit=True)
        acc = np.array([accs[c] for c in sizes])
        n = np.array([sizes[c] for c in sizes], dtype=float)
        means.append(acc.mean())
        weighted.append((acc * n).sum() / n.sum())
    assert values["val/acc_last10"] == pytest.approx(np.mean(means[-10:]))
    assert values["val/acc_weighted_last10"] == pytest.approx(np.mean(weighted[-10:]))
    assert values["val/last10_rounds"] == 10.0 and values["round"] == 11.0
    assert history.client_values(11)["val/acc"] == pytest.approx({c: accs[c] for c in sizes})
    finetune = pass_values(_pass(accs, sizes), history, 12, prefix="finetune/", in_fit=True)
    assert history.finetune == finetune and "finetune/val/acc" in finetune and history.evaluated_rounds == 12


def test_partial_pass_and_non_finite_notes_name_the_clients():
    """Catches a cut pass passing as whole (``partial_pass_note`` returning ``None`` when fewer batches ran)
    and a NaN client going unsaid."""
    evaluation = _pass({0: 0.5, 1: float("nan")}, {0: 2, 1: 4})
    note = partial_pass_note(
        evaluation, [2, 6, 3], batches_run=2, batches_in_pass=5, cause="limit_val_batches=2"
    )
    assert note is not None and "over 2 of 3 clients" in note and "1 (4 of 6 samples)" in note
    assert partial_pass_note(evaluation, [2, 6, 3], 5, 5, "limit_val_batches=5") is None
    assert "clients [1]" in non_finite_note(evaluation)


def test_each_process_reads_its_own_share_of_a_checkpoint():
    """Catches every process resuming rank 0's open round (``ranks[0]`` in ``this_rank_state``), and a
    mid-round checkpoint resumed on another number of processes."""
    state = {
        "round": {"open": True, "index": 3},
        "ranks": [{"torch_rng": "rng0", "round": {"open": True, "index": 3, "rank": r}} for r in (0, 1)],
    }
    state["ranks"][1]["torch_rng"] = "rng1"
    assert this_rank_state(state, rank=1, world_size=2)["torch_rng"] == "rng1"
    assert this_rank_state(state, rank=0, world_size=2)["round"]["rank"] == 0
    with pytest.raises(ValueError, match="inside round 3 by 2 process"):
        this_rank_state(state, rank=0, world_size=1)
    closed = {**state, "round": {"open": False, "index": 3}, "ranks": [{"x": 0}, {"x": 1}]}
    assert this_rank_state(closed, rank=2, world_size=3)["x"] == 1  # round-end: any number of processes


def test_federated_entry_refused_when_of_another_version_or_one_rank_alone():
    """Catches the version check or the one-rank refusal being dropped from ``read_federated_entry``."""
    assert read_federated_entry({}, "plain.ckpt") is None
    with pytest.raises(CheckpointError, match="version 99"):
        read_federated_entry({"lightning_fedrep": {"version": 99}}, "a.ckpt")
    from lightning_fedrep.federation import STATE_VERSION

    alone = {"lightning_fedrep": {"version": STATE_VERSION, "interrupted_on_rank": 1}}
    with pytest.raises(ValueError, match="rank 1 alone"):
        read_federated_entry(alone, "b.ckpt")
