"""The rest of the family on 2 CPU processes (gloo): FedPer, LG-FedAvg and Local, a faulty client on rank
1, NeuralCollapse with its server step, FineTunedEvaluation, and validate/test/predict from a 2-process
checkpoint, each equal, bit for bit, to the same federation run on one process.

One launch of ``tests/scripts/family_run.py`` (a subprocess in its own session with a timeout, killed by its
process-group id if it hangs) runs every scenario in sequence inside the 2 worker processes, each rank
writing what it holds after each; the reference is the same scenarios run with ``devices=1`` in this
process (same seed, same data: 8 clients of 7 to 55 samples, so ranks idle). Sequential path: no
tolerance (``torch.equal``, ``==`` on every logged value).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.scripts.family_run import FAULTS, ROUNDS, FamilyNet, run_scenarios
from tests.scripts.federated_run import client_data
from tests.scripts.launcher import run_script

REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPT = REPOSITORY / "tests" / "scripts" / "family_run.py"
TIMEOUT = 600  # seconds for the whole launch; ~25 s on 2 idle cores


def launch(out: Path) -> list[dict]:
    """Every scenario on 2 processes: what each rank held after each (``{scenario: result}``, by rank)."""
    returncode, output = run_script(SCRIPT, ["--devices", "2", "--out", str(out)], out.parent, TIMEOUT)
    assert returncode == 0, output[-6000:]
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family")


@pytest.fixture(scope="module")
def ranks(runs) -> list[dict]:
    return launch(runs / "two")


@pytest.fixture(scope="module")
def reference(runs) -> dict:
    _, results = run_scenarios(1, str(runs / "one"))
    return results


def assert_identical(expected: dict, actual: dict) -> None:
    """The same global tensors, every client's tensors, history, per-client accuracy and faults: exactly."""
    assert actual["world_size"] == 2 and expected["world_size"] == 1
    assert actual["global"].keys() == expected["global"].keys()
    for name, tensor in expected["global"].items():
        assert torch.equal(actual["global"][name], tensor), name
    assert actual["clients"].keys() == expected["clients"].keys()
    for client, tensors in expected["clients"].items():
        assert actual["clients"][client].keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(actual["clients"][client][name], tensor), (client, name)
    assert actual["history"] == expected["history"]
    assert actual["val_acc"] == expected["val_acc"]
    assert actual["faults"] == expected["faults"]


def assert_both_ranks_trained(result: dict) -> None:
    for shares in result["shares"]:
        assert len(shares) == 2 and all(shares) and sorted(sum(shares, [])) == list(range(8))


@pytest.mark.parametrize("algorithm", ["fedper", "lg_fedavg", "local"])
def test_every_algorithm_on_two_processes_equals_one_process(ranks, reference, algorithm):
    """FedPer, LG-FedAvg and Local Only, each client's work on one of 2 ranks: every rank ends with the
    one-process federation. Fails if other ranks' clients are not received (``store.owner(client) in
    (None, me)`` -> ``== me`` in ``RankTransfer.gather_round``: all three); if ``gather_round`` returns at
    once when nothing is shared (``if not self.shared_names: return``: Local); if the sums are all-reduced
    only when the body is shared (``if self._average is not None and "body" in self.algorithm.shares``:
    LG-FedAvg)."""
    expected = reference[algorithm]
    shared = {"fedper": "body", "lg_fedavg": "classifier", "local": None}[algorithm]
    assert all(name.startswith(shared) for name in expected["global"]) and bool(expected["global"]) == bool(
        shared
    )
    for held in ranks:
        assert_both_ranks_trained(held[algorithm])
        assert_identical(expected, held[algorithm])


def test_a_faulty_client_on_rank_1_is_left_out_on_every_rank(ranks, reference):
    """Client 4 raises in round 1 and client 5 turns NaN in round 2 (``on_client_error="skip"``), both
    trained by rank 1: rank 0 records the same faults, the same history and the same federation as one
    process (where ``test_faults.py`` checks the run against a plain loop). Fails if the round's results
    are gathered without the faulty clients (``for r in self._finished`` -> ``for r in self._finished if
    not r.fault`` in ``RankTransfer.gather_round``)."""
    expected = reference["fault"]
    assert [(f["round"], f["client"]) for f in expected["faults"]] == sorted(FAULTS)
    assert "RuntimeError at local step 1: injected failure" in expected["faults"][0]["reason"]
    assert "non-finite values in" in expected["faults"][1]["reason"]
    for held in ranks:
        for round_index, client in FAULTS:
            assert client in held["fault"]["shares"][round_index][1]  # trained on rank 1
        assert [row.get("faults") for row in held["fault"]["history"]] == [None, 1.0, 1.0]
        assert_identical(expected, held["fault"])


def test_neural_collapse_with_its_server_step_on_two_processes_equals_one_process(ranks, reference):
    """FedRep with FLUTE's penalties, its server step on the round's clients' heads (every rank, on the
    gathered heads) and NC metrics over every client: the same heads, body and NC values as one process.
    Fails if the server step uses the clients this rank trained (``clients = plan.clients`` -> ``clients =
    list(self.strategy(trainer).round_shares(round_index)[trainer.global_rank].clients)`` in
    ``NeuralCollapse._apply_server_step``)."""
    expected = reference["collapse"]
    assert expected["server_round"] == ROUNDS - 1
    assert [row["round"] for row in expected["nc"]] == list(range(ROUNDS))
    for held in ranks:
        assert held["collapse"]["nc"] == expected["nc"]
        assert held["collapse"]["server_round"] == ROUNDS - 1
        assert_identical(expected, held["collapse"])


def test_fine_tuned_evaluation_on_two_processes_equals_one_process(ranks, reference):
    """FineTunedEvaluation before every validation, each rank fine-tuning the clients it evaluates from
    the average of the last round's heads: the per-client accuracies and their summaries equal one
    process's (and differ from the same run without fine-tuning). Fails if the starting head averages
    only the heads of the clients this rank evaluates (``takers = self.last_round_clients or ...`` ->
    ``takers = [c for c in self.last_round_clients if c in clients] or ...`` in ``_starting_heads``)."""
    expected = reference["finetuned"]
    plain = reference["checkpoint"]  # the same FedRep fit, validated without fine-tuning
    assert [row["val/acc"] for row in expected["history"]] != [row["val/acc"] for row in plain["history"]]
    for held in ranks:
        assert_identical(expected, held["finetuned"])


def test_validate_test_and_predict_from_a_two_process_checkpoint(runs, ranks, reference):
    """A checkpoint written after a 2-process fit holds the one-process federation; ``validate``, ``test``
    and ``predict`` (personalized) from it on 2 processes, by a fresh module initialized otherwise, log
    the fit's last validation exactly (each rank evaluating half of the clients, the summaries over all
    of them) and predict what each client's own model (global body, its head) computes in plain PyTorch.
    Fails if only rank 0 restores the federation from the checkpoint (``if self._pending is not None:`` ->
    ``if self._pending is not None and self.collective.rank == 0:`` in ``load_model_state_dict``)."""
    expected = reference["checkpoint"]
    one = torch.load(f"{runs / 'one'}.ckpt", weights_only=True)
    two = torch.load(f"{runs / 'two'}.ckpt", weights_only=True)
    for name, tensor in one["state_dict"].items():
        assert torch.equal(two["state_dict"][name], tensor), name
    for client, tensors in one["lightning_fedrep"]["clients"]["local"].items():
        for got, want in zip(two["lightning_fedrep"]["clients"]["local"][client], tensors):
            assert torch.equal(got, want), client
    fitted = expected["history"][-1]
    evaluated = [held["checkpoint"]["validate"]["evaluated"] for held in ranks]
    assert all(evaluated) and sorted(evaluated[0] + evaluated[1]) == list(range(8))
    for held in ranks:
        result = held["checkpoint"]
        assert_identical(expected, result)
        for stage, split in (("validate", "val"), ("test", "test")):
            (logged,) = result[stage]["logged"]
            assert logged == expected[stage]["logged"][0]
            assert result[stage]["per_client"] == expected[stage]["per_client"] == expected["val_acc"]
            assert logged[f"{split}/acc"] == pytest.approx(fitted["val/acc"], abs=1e-7)  # logged as float32
        assert result["predict"]["clients"] == expected["predict"]["clients"]
        for got, want in zip(result["predict"]["outputs"], expected["predict"]["outputs"], strict=True):
            assert torch.equal(got, want)
        assert_personalized_predictions(result)


def assert_personalized_predictions(result: dict) -> None:
    """Each client's predictions are its own model's outputs on its test samples, in order."""
    data = client_data()
    data.setup()
    outputs, clients = result["predict"]["outputs"], result["predict"]["clients"]
    assert sorted(set(clients)) == list(range(8))
    for client in range(8):
        model = FamilyNet()
        model.load_state_dict({**result["global"], **result["clients"][client]})
        test = data.client_data(client, "test")
        x = test.dataset.tensors[0][test.indices]
        predicted = torch.cat([out for out, c in zip(outputs, clients) if c == client])
        with torch.no_grad():
            torch.testing.assert_close(predicted, model(x), atol=1e-6, rtol=1e-5)
