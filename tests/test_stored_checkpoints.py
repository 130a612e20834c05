"""Checkpoints written by an earlier version of the package still load and resume.

``tests/data/fedrep_v2_*.ckpt`` were written once by the code that defined version 2 of the federated
checkpoint (``tests/data/write_version_2_checkpoints.py``): one at the end of round 0, one inside round 0.
Each test checks two things that do not depend on the CPU that wrote the file:

- what the format reads: right after the restore, the federation holds exactly the file's tensors (the
  global body, every stored head, the live client's tensors of an open round) and history;
- that it resumes into the same run: the resumed run ends close to the run that never stopped, computed
  now. Float kernels differ between CPUs in the last bits, so this is a tolerance, far below what restoring
  another state (another client's head, the round's start instead of its middle) changes. Bit-exact resume
  is tested on checkpoints written in the same run (``tests/test_resume.py``).

A change of the format that no longer reads the files, or reads them into other state, fails here (version
3 upgrades version 2 on load, or refuses it with a message).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_fedrep import FedRepStrategy
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

DATA = Path(__file__).resolve().parent / "data"
STORED = {"round end": DATA / "fedrep_v2_round_end.ckpt", "mid-round": DATA / "fedrep_v2_mid_round.ckpt"}
RESUME_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
"""How close a run resumed from a stored file ends to the run computed now: the two agree to float32's last
bits after the stored rounds on the same CPU, and the tests' training amplifies a CPU's rounding by far less
than this over one round; restoring any other state moves the tensors by 1e-3 or more."""


class RestoredState(L.Callback):
    """Keeps what the strategy holds when training starts after a restore: the global tensors, every
    client's tensors and declared state, the live module's parameters, and the history."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        federation = strategy.federation
        self.seen = {
            "global": strategy.global_tensors(),
            "clients": {c: strategy.client_tensors(c) for c in range(federation.num_clients)},
            "client_state": {
                c: {n: t.clone() for n, t in federation.store.client_state(c).items()}
                for c in range(federation.num_clients)
            },
            "server": {n: t.clone() for n, t in federation.server_tensors.items()},
            "live": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "history": [dict(row) for row in strategy.history],
        }


def fedrep_run(rounds: int, ckpt_path: Path | None = None, **trainer_kw):
    """FedRep on 4 tiny clients, 2 per round, one head and one body epoch: the stored checkpoints' run."""
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kw)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=ckpt_path)
    return strategy, trainer


def assert_tensors_equal(got: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], what: str) -> None:
    """Bit for bit: the restore copies the file's tensors, it computes nothing."""
    assert set(got) == set(stored), what
    for name, value in stored.items():
        assert torch.equal(got[name], value), (what, name)


def assert_history_close(got: list[dict[str, Any]], expected: list[dict[str, Any]], what: str) -> None:
    """The same rounds and columns; numbers within :data:`RESUME_TOLERANCE`."""
    assert [row.keys() for row in got] == [row.keys() for row in expected], what
    for row, reference in zip(got, expected):
        for key, value in reference.items():
            if isinstance(value, float):
                assert math.isclose(row[key], value, rel_tol=1e-4, abs_tol=1e-6), (what, key)
            else:
                assert row[key] == value, (what, key)


def assert_resumed_like(resumed: FedRepStrategy, full: FedRepStrategy) -> None:
    """The resumed run's body, every client's tensors and declared state, the server's tensors and the
    history agree with the run that never stopped, within :data:`RESUME_TOLERANCE`."""
    fed, ref = resumed.federation, full.federation
    for name, value in ref.global_tensors().items():
        torch.testing.assert_close(fed.global_tensors()[name], value, **RESUME_TOLERANCE, msg=name)
    for name, value in ref.server_tensors.items():
        torch.testing.assert_close(fed.server_tensors[name], value, **RESUME_TOLERANCE, msg=name)
    for client in range(ref.num_clients):
        for name, value in ref.client_tensors(client).items():
            torch.testing.assert_close(fed.client_tensors(client)[name], value, **RESUME_TOLERANCE, msg=name)
        for name, value in ref.store.client_state(client).items():
            torch.testing.assert_close(
                fed.store.client_state(client)[name], value, **RESUME_TOLERANCE, msg=f"{client} {name}"
            )
    assert_history_close(resumed.history, full.history, "history")


def stored_history_rows(stored: dict[str, Any]) -> list[dict[str, Any]]:
    """The validated rounds of a stored entry's history, as ``strategy.history`` lists them."""
    evaluations = stored.get("history", {}).get("evaluations", {})
    return [{"round": r, **evaluations[r]} for r in sorted(evaluations)]


@pytest.mark.parametrize("where", sorted(STORED))
def test_a_stored_version_2_checkpoint_restores_its_tensors_and_resumes_like_the_uninterrupted_run(where):
    """Catches a format change that drops version 2 (``LOADABLE_VERSIONS`` without 2), renames a key it
    reads (``"global"``, ``"clients"``, ``"round"``) without upgrading stored files, restores another state
    than the file holds (another client's head, the round's start instead of the live client's tensors),
    or resumes elsewhere than the run that never stopped."""
    stored = torch.load(STORED[where], weights_only=True)["lightning_fedrep"]
    assert stored["version"] == 2 and stored["round"]["open"] == (where == "mid-round")
    restored = RestoredState()
    resumed, trainer = fedrep_run(2, ckpt_path=STORED[where], callbacks=[restored])
    seen = restored.seen
    assert_tensors_equal(seen["global"], dict(zip(stored["shared_names"], stored["global"])), "global")
    for client, local in stored["clients"].get("local", {}).items():
        expected = dict(zip(stored["local_names"], local))
        assert_tensors_equal({n: seen["clients"][client][n] for n in expected}, expected, f"client {client}")
    if stored["round"]["open"]:  # the live client's body mid-round, not the round's start
        live = dict(zip(stored["shared_names"], stored["round"]["live_tensors"]))
        assert_tensors_equal({n: seen["live"][n] for n in live}, live, "live client")
        assert not all(torch.equal(live[n], seen["global"][n]) for n in live)
    assert_history_close(seen["history"], stored_history_rows(stored), "stored history")
    full, _ = fedrep_run(2)
    assert trainer.current_epoch == 2 and resumed.federation.round_index == 1
    assert_resumed_like(resumed, full)
    assert [row["round"] for row in full.history] == [0, 1]
