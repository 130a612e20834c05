"""The server side of the Algorithm API v2: declared client and server tensors, ``finish_client`` and
``aggregate(server, results, failures)``, checkpoint version 3. Each test compares with a plain PyTorch
loop written here (or with the run that never stopped), never with the library's own helper."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.federation import Federation, FederationConfig
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.declared import ClientTensors, ServerTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome
from lightning_fedrep.federation.module.split import resolve_layout
from lightning_fedrep.federation.store import ClientStore
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule
from tests.test_federation import Net, client_data, drive_round
from tests.test_stored_checkpoints import RestoredState, assert_resumed_like, assert_tensors_equal

DATA = Path(__file__).resolve().parent / "data"
STORED_V3 = DATA / "counted_v3_round_end.ckpt"
BETA = 0.9


class MomentumV2(Algorithm):
    """FedAvg with server momentum on the v2 API (a declared server tensor), and per client a declared
    running sum of its updates (``drift``) and a count of its rounds (``rounds``)."""

    client_tensors = (ClientTensors("drift", like="shared"), ClientTensors("rounds", shapes=()))
    server_tensors = (ServerTensors("velocity", like="shared"),)

    def __init__(self, name: str = "momentum_v2", shares=("body", "head"), beta: float = BETA):
        super().__init__(name, set(shares), "FedAvgM on the v2 API")
        self.beta = beta

    epochs = ("head_epochs", "body_epochs")

    def default_phases(self, head_epochs, body_epochs):
        return (Phase("head", epochs=head_epochs), Phase("body", epochs=body_epochs))

    def finish_client(self, end):
        drift = {
            f"drift.{n}": end.client_state[f"drift.{n}"] + end.end[n] - end.start[n] for n in end.shared_names
        }
        norm = sum(float((end.end[n] - end.start[n]).square().sum()) for n in end.shared_names) ** 0.5
        return ClientOutcome(
            upload=end.shared(),
            client_state={**drift, "rounds": end.client_state["rounds"] + 1},
            metrics={"update_norm": norm},
        )

    def aggregate(self, server, results, failures):
        velocity = {
            f"velocity.{n}": self.beta * server.tensors[f"velocity.{n}"] + (g - results.reduced[n])
            for n, g in server.shared.items()
        }
        shared = {n: g - velocity[f"velocity.{n}"] for n, g in server.shared.items()}
        return server.replace(shared=shared, tensors=velocity), {"clients_aggregated": len(results.clients)}


def federation(module):
    algorithm = MomentumV2()
    layout = resolve_layout(module, None, shares=algorithm.shares, needs_head=False)
    config = FederationConfig(phases=(Phase("all", steps=2),), clients_per_round=1.0, weighting="uniform")
    fed = Federation(algorithm, layout, config)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    fed.attach(module, [optimizer])
    fed.initialize(torch.device("cpu"))
    fed.bind_data((10, 10), batch_size=5)
    return fed, optimizer


def plain_rounds(rounds: int):
    """FedAvgM by hand: each client trains a copy of the global model (2 SGD steps, lr 0.1); the server
    keeps v = beta v + (g - mean) and sets g = g - v; each client's drift sums its end - start."""
    init = Net()
    state = {k: v.clone() for k, v in init.state_dict().items()}
    velocity = {k: torch.zeros_like(v) for k, v in state.items()}
    drift = {c: {k: torch.zeros_like(v) for k, v in state.items()} for c in (0, 1)}
    for r in range(rounds):
        ends = []
        for client in (0, 1):
            model = copy.deepcopy(init)
            model.load_state_dict(state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in client_data(client + 10 * r, 2):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            ends.append({k: v.detach() for k, v in model.state_dict().items()})
            drift[client] = {k: drift[client][k] + ends[-1][k] - state[k] for k in state}
        mean = {k: (ends[0][k] + ends[1][k]) / 2 for k in state}
        velocity = {k: BETA * velocity[k] + state[k] - mean[k] for k in state}
        state = {k: state[k] - velocity[k] for k in state}
    return state, velocity, drift


def assert_close_maps(actual, expected, prefix=""):
    for name, value in expected.items():
        torch.testing.assert_close(actual[prefix + name], value, rtol=1e-5, atol=1e-6)


def test_server_momentum_on_the_v2_api_equals_the_plain_loop():
    """Catches a server step whose new server tensors are dropped (``_server_step`` not storing
    ``new.tensors``: the velocity stays zero and round 2 is plain FedAvg) or whose shared result is ignored."""
    module = Net()
    fed, optimizer = federation(module)
    for r in range(3):
        drive_round(fed, module, optimizer, r)
    state, velocity, drift = plain_rounds(3)
    assert_close_maps(fed.global_tensors(), state)
    assert_close_maps(fed.server_tensors, velocity, "velocity.")
    row = fed.history.recorded(2)
    assert row["clients_aggregated"] == 2.0 and row["update_norm"] > 0


def test_declared_tensors_are_held_on_the_training_device():
    """``shapes=`` declarations (and callable inits) are made on the CPU; the federation holds every declared
    client and server tensor on the device it trains on (a GPU run otherwise mixes devices in the first step).
    The meta device stands in for a GPU here: the module stays on the CPU, so every tensor must be moved."""
    module = Net()
    algorithm = MomentumV2()
    layout = resolve_layout(module, None, shares=algorithm.shares, needs_head=False)
    config = FederationConfig(phases=(Phase("all", steps=2),), clients_per_round=1.0, weighting="uniform")
    fed = Federation(algorithm, layout, config)
    fed.attach(module, [torch.optim.SGD(module.parameters(), lr=0.1)])
    fed.initialize(torch.device("meta"))
    declared = dict(zip(fed.store.tensor_names, fed.store.tensor_template))
    assert "rounds" in declared and fed.server_tensors
    assert {n: t.device.type for n, t in declared.items()} == {n: "meta" for n in declared}
    assert {n: t.device.type for n, t in fed.server_tensors.items()} == {
        n: "meta" for n in fed.server_tensors
    }


def test_declared_client_tensors_follow_finish_client():
    """Catches ``finish_client``'s client_state not stored (``put_state`` skipped: drift stays zero) or
    computed from the wrong start (``ClientEnd.start`` after the store changed)."""
    module = Net()
    fed, optimizer = federation(module)
    for r in range(2):
        drive_round(fed, module, optimizer, r)
    _, _, drift = plain_rounds(2)
    for client in (0, 1):
        assert_close_maps(fed.store.client_state(client), drift[client], "drift.")
        assert float(fed.store.client_state(client)["rounds"]) == 2.0


def test_declared_tensors_resume_bit_exactly_from_a_saved_state():
    """Catches declared tensors missing from the checkpoint (``"server"`` or the store's ``"tensors"``
    not saved: the resumed run restarts them from zero)."""
    module = Net()
    fed, optimizer = federation(module)
    for r in range(3):
        drive_round(fed, module, optimizer, r)
    module2 = Net()
    fed2, optimizer2 = federation(module2)
    drive_round(fed2, module2, optimizer2, 0)
    drive_round(fed2, module2, optimizer2, 1)
    buffer = io.BytesIO()
    torch.save(fed2.state_dict(), buffer)
    buffer.seek(0)
    module3 = Net()
    fed3, optimizer3 = federation(module3)
    fed3.load_state_dict(torch.load(buffer, weights_only=True))
    fed3.restore_round(fed2.state_dict())
    drive_round(fed3, module3, optimizer3, 2)
    for name, value in fed.server_tensors.items():
        assert torch.equal(fed3.server_tensors[name], value), name
    for client in (0, 1):
        for name, value in fed.store.client_state(client).items():
            assert torch.equal(fed3.store.client_state(client)[name], value), (client, name)


def test_an_interrupted_round_rolls_the_declared_client_tensors_back():
    """Catches a round's rollback that forgets declared tensors (the before-round record without
    ``"tensors"``: client 0 would keep its update from the undone round), also after a mid-round save."""
    module = Net()
    fed, optimizer = federation(module)
    drive_round(fed, module, optimizer, 0)
    before = {c: {n: t.clone() for n, t in fed.store.client_state(c).items()} for c in (0, 1)}
    drive_round(fed, module, optimizer, 1, stop_after=3)  # client 0 finished, client 1 live
    assert not torch.equal(fed.store.client_state(0)["rounds"], before[0]["rounds"])
    saved = copy.deepcopy(fed.state_dict())
    module2 = Net()
    fed2, _ = federation(module2)
    fed2.load_state_dict(saved)
    fed2.restore_round(saved)
    for undo in (fed, fed2):
        assert undo.rollback_round()
        for client in (0, 1):
            for name, value in before[client].items():
                assert torch.equal(undo.store.client_state(client)[name], value), (client, name)


def test_a_client_record_carries_its_declared_tensors_between_processes():
    """Catches ``ClientStore.record``/``load_record`` without the declared tensors (a client lent to or
    gathered from another rank would arrive with the template)."""
    store = ClientStore([torch.zeros(2)])
    store.declare({"c.w": torch.zeros(3)})
    store.put(4, [torch.ones(2)])
    store.put_state(4, {"c.w": torch.tensor([1.0, 2.0, 3.0])})
    other = ClientStore([torch.zeros(2)])
    other.declare({"c.w": torch.zeros(3)})
    other.load_record(4, store.record(4))
    assert torch.equal(other.client_state(4)["c.w"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(other.client_state(7)["c.w"], torch.zeros(3))  # a client that never trained


def counted_run(rounds: int, ckpt_path: Path | None = None, **trainer_kw):
    """FedRep-shaped MomentumV2 (body shared) on 4 tiny clients, 2 per round: the stored v3 file's run."""
    torch.manual_seed(0)
    algorithm = MomentumV2("counted_fedrep", shares=("body",))
    strategy = FederatedStrategy(
        algorithm=algorithm, head="classifier", clients_per_round=0.5, head_epochs=1, seed=0
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, **trainer_kw)
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4), ckpt_path=ckpt_path)
    return strategy, trainer


def test_a_stored_version_3_checkpoint_restores_its_tensors_and_resumes_like_the_uninterrupted_run():
    """Catches a version-3 format change that no longer reads the stored file (``"server"`` or
    ``clients["tensors"]`` renamed), restores other declared tensors than the file holds, or resumes
    elsewhere than the run that never stopped (within the CPU-independent tolerance of
    ``tests/test_stored_checkpoints.py``)."""
    stored = torch.load(STORED_V3, weights_only=True)["lightning_fedrep"]
    assert stored["version"] == 3 and stored["server"] and stored["clients"]["tensors"]
    restored = RestoredState()
    resumed, trainer = counted_run(2, ckpt_path=STORED_V3, callbacks=[restored])
    seen = restored.seen
    assert_tensors_equal(seen["global"], dict(zip(stored["shared_names"], stored["global"])), "global")
    assert_tensors_equal(seen["server"], stored["server"], "server")
    names = stored["clients"]["tensor_names"]
    for client, tensors in stored["clients"]["tensors"].items():
        assert_tensors_equal(seen["client_state"][client], dict(zip(names, tensors)), f"client {client}")
    full, _ = counted_run(2)
    assert trainer.current_epoch == 2
    assert_resumed_like(resumed, full)


def test_a_version_2_checkpoint_is_refused_by_an_algorithm_declaring_state_it_lacks():
    """Catches a version-2 file silently loaded with zero-initialized declared tensors (``check_declared``
    not called), which would resume SCAFFOLD-like algorithms from wrong state."""
    with pytest.raises(
        ValueError,
        match=r"version-2 federated state, which holds no client tensors drift\.\* \(4\).*'fedrep'",
    ):
        counted_run(2, ckpt_path=DATA / "fedrep_v2_round_end.ckpt")


@pytest.mark.parametrize("lockstep", ["vectorized"])
def test_finish_client_and_the_server_step_run_alike_on_the_lockstep_runner(lockstep):
    """Catches a runner whose clients bypass ``finish_client`` (the lockstep runner's group finish not going
    through ``Federation.store_client``: its declared tensors would stay at the template)."""
    from tests.test_engine_equivalence import LossNet

    runs = {}
    for runner in ("sequential", lockstep):
        torch.manual_seed(0)
        strategy = FederatedStrategy(
            algorithm=MomentumV2("counted_fedrep", shares=("body",)),
            head="classifier",
            clients_per_round=0.5,
            head_epochs=1,
            seed=0,
            runner=runner,
        )
        trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
        trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=4))
        assert strategy.runner_report.runner == runner
        runs[runner] = strategy.federation
    seq, lock = runs["sequential"], runs[lockstep]
    assert float(lock.store.client_state(0)["rounds"]) + float(lock.store.client_state(1)["rounds"]) > 0
    for name, value in seq.server_tensors.items():
        torch.testing.assert_close(lock.server_tensors[name], value, rtol=1e-5, atol=1e-6)
    for client in range(4):
        for name, value in seq.store.client_state(client).items():
            torch.testing.assert_close(lock.store.client_state(client)[name], value, rtol=1e-5, atol=1e-6)


def test_declared_tensors_on_two_processes_equal_the_same_run_on_one(tmp_path_factory):
    """SCAFFOLD (``tests/scripts/algorithms_run.py``), 2 rounds: the model, the server's ``c`` and every
    client's ``c_i`` on 2 processes equal the 1-process run. Fails when a client's record travels between
    ranks without its declared tensors (``ClientStore.record`` without ``"tensors"``)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch for this file and two others
    single = singles["scaffold"]
    assert any(float(t.abs().sum()) > 0 for t in single["declared"][0].values())
    for held in (rank["scaffold"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=0, atol=0)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)


def test_a_declared_slot_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """Ditto (``tests/scripts/algorithms_run.py``), 2 rounds: the global model, every client's personal slot
    and the validation accuracy scored on the personal models on 2 processes equal the 1-process run. Fails
    when a client's record travels between ranks without its declared tensors, the slot among them
    (``ClientStore.record`` with ``"tensors": None``)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch for this file and two others
    single = singles["ditto"]
    assert len({float(t["personal.classifier.weight"].sum()) for t in single["declared"].values()}) > 1
    for held in (rank["ditto"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)
