"""Checkpoints written by an earlier version of the package still resume.

``tests/data/fedrep_v2_*.ckpt`` were written once by the code that defined version 2 of the federated
checkpoint (``tests/data/write_version_2_checkpoints.py``): one at the end of round 0, one inside round 0.
Resuming each must give the body, every head and the history of the run that never stopped, computed
now. A change of the checkpoint format that no longer reads them, or reads them into other state, fails
here (the redesign's version 3 must upgrade version 2 on load, or refuse it with a message).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fedrep import FedRepStrategy
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

DATA = Path(__file__).resolve().parent / "data"
STORED = {"round end": DATA / "fedrep_v2_round_end.ckpt", "mid-round": DATA / "fedrep_v2_mid_round.ckpt"}


def fedrep_run(rounds: int, ckpt_path: Path | None = None, **trainer_kw):
    """FedRep on 4 tiny clients, 2 per round, one head and one body epoch: the stored checkpoints' run."""
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=0.5, head_epochs=1, seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kw)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=ckpt_path)
    return strategy, trainer


@pytest.mark.parametrize("where", sorted(STORED))
def test_a_stored_version_2_checkpoint_resumes_like_the_uninterrupted_run(where):
    """Catches a format change that drops version 2 (``LOADABLE_VERSIONS`` without 2), renames a key it
    reads (``"global"``, ``"clients"``, ``"round"``) without upgrading stored files, or restores another
    state (the resumed run then ends elsewhere than the run that never stopped)."""
    stored = torch.load(STORED[where], weights_only=True)["lightning_fedrep"]
    assert stored["version"] == 2 and stored["round"]["open"] == (where == "mid-round")
    full, _ = fedrep_run(2)
    resumed, trainer = fedrep_run(2, ckpt_path=STORED[where])
    assert trainer.current_epoch == 2 and resumed.federation.round_index == 1
    for name, value in full.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(4):
        for name, value in full.client_tensors(client).items():
            assert torch.equal(resumed.client_tensors(client)[name], value), (client, name)
    assert resumed.history == full.history and [row["round"] for row in full.history] == [0, 1]
