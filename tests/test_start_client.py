"""``Algorithm.start_client``: a client's starting values changed before its first local step (FedALA-style).

The algorithm here keeps each client's last trained model (``kept``, a declared client tensor) and starts a
returning client from the fixed blend ``ALPHA * kept + (1 - ALPHA) * global`` (FedALA with constant weights);
``start_client`` also counts its visits (a declared tensor set at a first participation) and ``finish_client``
stores ``end - start`` (so ``ClientEnd.start`` must be the blended start). Compared with a plain PyTorch loop
that does the same by hand, on both runners, through a resumed mid-round checkpoint and with a client left out.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome, StartOutcome
from lightning_fedrep.federation.checkpoint.reading import CheckpointError
from lightning_fedrep.federation.round import ClientFaultWarning, RoundTransaction
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 6, 4, 4, 4, 3
ALPHA = 0.6


class BlendStart(Algorithm):
    """FedAvg whose returning clients start from ``ALPHA * kept + (1 - ALPHA) * global`` (a fixed FedALA blend)."""

    client_tensors = (
        ClientTensors("kept", like="shared", init="module"),
        ClientTensors("moved", like="shared"),
        ClientTensors("visits", shapes=()),
    )

    def __init__(self, poisoned: tuple[int, int] | None = None):
        super().__init__("blend_start", {"body", "head"}, "FedAvg starting from a fixed blend")
        self.poisoned = poisoned
        """``(round, client)`` whose start is made NaN (the client is then left out of the round)."""

    def start_client(self, start):
        visits = start.client_state["visits"]
        state = {"visits": visits + 1}
        if float(visits) == 0:  # a first participation: it starts from the global model
            return StartOutcome(client_state=state)
        blend = {
            n: ALPHA * start.client_state[f"kept.{n}"] + (1 - ALPHA) * g for n, g in start.shared().items()
        }
        if self.poisoned == (start.round, start.client):
            blend = {n: torch.full_like(t, float("nan")) for n, t in blend.items()}
        return StartOutcome(start=blend, client_state=state)

    def finish_client(self, end):
        state = {f"kept.{n}": end.end[n] for n in end.shared_names}
        state.update({f"moved.{n}": end.end[n] - end.start[n] for n in end.shared_names})
        return ClientOutcome(upload=end.shared(), client_state=state)


def datamodule():
    """Every client's training data is one batch, so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def plain_blend(init, dm, rounds=ROUNDS, poisoned=None):
    """The algorithm written out: per sampled client a copy of the module starting from the global model (first
    visit) or the blend of its kept model with it, the module's own SGD for LOCAL_EPOCHS full-batch steps; the
    server's sample-weighted mean of the clients' end models. A poisoned client is left out, its state kept."""
    w = {k: v.detach().clone() for k, v in init.named_parameters()}
    kept = {c: {k: v.clone() for k, v in w.items()} for c in range(NUM_CLIENTS)}
    moved = {c: {k: torch.zeros_like(v) for k, v in w.items()} for c in range(NUM_CLIENTS)}
    visits = [0] * NUM_CLIENTS
    for r in range(rounds):
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in w.items()}
        weight = 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            if poisoned == (r, client):
                continue
            start = w if visits[client] == 0 else {n: ALPHA * kept[client][n] + (1 - ALPHA) * w[n] for n in w}
            model = copy.deepcopy(init)
            model.load_state_dict(start, strict=False)
            optimizer = model.configure_optimizers()
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            end = {n: p.detach().clone() for n, p in model.named_parameters()}
            visits[client] += 1
            kept[client] = end
            moved[client] = {n: end[n] - start[n] for n in w}
            for n in w:
                total[n] += len(data.indices) * end[n].double()
            weight += len(data.indices)
        w = {n: (total[n] / weight).to(w[n].dtype) for n in w}
    return w, kept, moved, visits


def fit(algorithm, runner="sequential", rounds=ROUNDS, ckpt_path=None, callbacks=(), root=None, **kwargs):
    torch.manual_seed(0)
    init = LossNet()
    dm = datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
        **kwargs,
    )
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        default_root_dir=root,
    )
    trainer.fit(copy.deepcopy(init), datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm


def assert_like_plain(strategy, reference, atol=1e-5):
    w, kept, moved, visits = reference
    fed = strategy.federation
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-4, atol=atol, msg=name)
    for client in range(NUM_CLIENTS):
        state = fed.store.client_state(client)
        assert float(state["visits"]) == visits[client], client
        for name in w:
            torch.testing.assert_close(state[f"kept.{name}"], kept[client][name], rtol=1e-4, atol=atol)
            torch.testing.assert_close(state[f"moved.{name}"], moved[client][name], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_start_client_equals_a_plain_loop_on_both_runners(runner):
    """Golden test. Fails if the hook is not called (no blend, visits stay 0), is called after the first step
    or twice (visits), its start values are not written into what the client trains from (the sequential
    runner's live module, the lockstep group's stacked rows), or ``ClientEnd.start`` is the unblended start
    (``moved``)."""
    strategy, init, dm = fit(BlendStart(), runner)
    assert strategy.runner_report.runner == runner
    reference = plain_blend(init, dm)
    assert max(reference[3]) > 1  # some client returned, so the blend ran
    assert_like_plain(strategy, reference)


def test_sequential_and_vectorized_runs_agree():
    runs = [fit(BlendStart(), runner)[0] for runner in ("sequential", "vectorized")]
    seq, lock = (s.federation for s in runs)
    for name, value in runs[0].global_tensors().items():
        torch.testing.assert_close(runs[1].global_tensors()[name], value, rtol=1e-5, atol=1e-6)
    for client in range(NUM_CLIENTS):
        for name, value in seq.store.client_state(client).items():
            torch.testing.assert_close(lock.store.client_state(client)[name], value, rtol=1e-5, atol=1e-6)


def test_the_default_start_client_is_never_called(monkeypatch):
    """An algorithm that does not override ``start_client`` pays nothing: the base method is never called and
    no started client is kept. Fails if the federation calls the hook unconditionally."""

    def refuse(self, start):
        raise AssertionError("the default start_client was called")

    monkeypatch.setattr(Algorithm, "start_client", refuse)
    seen = []
    real = RoundTransaction.begin_client

    def spy(self, client):
        changed = real(self, client)
        seen.append((client, dict(changed), dict(self._starts)))
        return changed

    monkeypatch.setattr(RoundTransaction, "begin_client", spy)
    for runner in ("sequential", "vectorized"):
        seen.clear()
        strategy, _, _ = fit(Algorithm("plain", {"body", "head"}, "FedAvg"), runner, rounds=2)
        assert strategy.runner_report.runner == runner
        assert seen and all(changed == {} and starts == {} for _, changed, starts in seen), runner


class BadStart(Algorithm):
    def __init__(self, outcome):
        super().__init__("bad_start", {"body", "head"}, "returns a bad StartOutcome")
        self.outcome = outcome

    client_tensors = (ClientTensors("visits", shapes=()),)

    def start_client(self, start):
        return self.outcome(start)


@pytest.mark.parametrize(
    "outcome, error, match",
    [
        (
            lambda s: StartOutcome(start={"body.9.weight": s.start["classifier.bias"]}),
            KeyError,
            r"'body\.9\.weight'",
        ),
        (
            lambda s: StartOutcome(start={"classifier.bias": torch.zeros(3)}),
            ValueError,
            r"'classifier\.bias'.*\(4,\)",
        ),
        (
            lambda s: StartOutcome(client_state={"visit": torch.tensor(1.0)}),
            KeyError,
            r"client_state.*'visit'",
        ),
        (
            lambda s: StartOutcome(client_state={"visits": torch.ones(2)}),
            ValueError,
            r"'visits'.*shape \(2,\)",
        ),
        (lambda s: {"classifier.bias": s.start["classifier.bias"]}, TypeError, r"must return a StartOutcome"),
    ],
    ids=["unknown-tensor", "wrong-shape", "unknown-client-tensor", "wrong-client-shape", "not-an-outcome"],
)
@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_bad_start_outcome_is_refused_naming_the_hook_and_the_name(outcome, error, match, runner):
    with pytest.raises(error, match=rf"BadStart\.start_client\(\).*{match}"):
        fit(BadStart(outcome), runner, rounds=1)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_resumed_mid_round_checkpoint_gives_the_uninterrupted_result(tmp_path, runner):
    """Saved while clients had started (the hook ran) but not finished: the resumed run does not call the hook
    again for them (visits would count twice) and keeps what it returned (``moved`` reads ``ClientEnd.start``;
    saved in the last round, so no later visit overwrites it)."""
    full, init, dm = fit(BlendStart(), runner)
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(BlendStart(), runner, callbacks=[saver], root=tmp_path / "a")
    chosen = None
    for path in sorted((tmp_path / "ck").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1])):
        state = torch.load(path, weights_only=True)["lightning_fedrep"]["round"]
        if state["open"] and state["index"] >= 1 and any(state.get("starts", {}).values()):
            chosen = path  # the last with a started client whose start the hook changed, not yet finished
    assert chosen is not None, "no mid-round checkpoint with a started client"
    resumed, _, _ = fit(BlendStart(), runner, ckpt_path=chosen, root=tmp_path / "b")
    assert_like_plain(resumed, plain_blend(init, dm))
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(resumed.global_tensors()[name], value, rtol=0, atol=0)
    damaged = torch.load(chosen, weights_only=True)
    starts = damaged["lightning_fedrep"]["round"]["starts"]
    client = next(c for c, values in starts.items() if values)
    starts[client]["classifier.bias"] = torch.zeros(3)
    torch.save(damaged, tmp_path / "damaged.ckpt")
    with pytest.raises(CheckpointError, match=r"\['starts'\].*'classifier\.bias'"):
        fit(BlendStart(), runner, ckpt_path=tmp_path / "damaged.ckpt", root=tmp_path / "c")


def test_a_client_left_out_gets_back_what_start_client_changed():
    """A client whose start is NaN trains to NaN and is left out of the round (``on_nonfinite="skip"``): the
    visit ``start_client`` counted is undone with the rest of its state. Fails if the hook's client tensors are
    stored without the before-round record the fault restores."""
    _, init, dm = fit(BlendStart(), rounds=2)
    returning = [
        c
        for c in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, 2)
        if c
        in set(reference_clients(NUM_CLIENTS, PER_ROUND, SEED, 0))
        | set(reference_clients(NUM_CLIENTS, PER_ROUND, SEED, 1))
    ]
    poisoned = (2, returning[0])
    with pytest.warns(ClientFaultWarning, match=f"Client {returning[0]} is left out of round 2"):
        strategy, _, _ = fit(BlendStart(poisoned=poisoned), rounds=3)
    assert_like_plain(strategy, plain_blend(init, dm, rounds=3, poisoned=poisoned))


def test_a_rolled_back_round_undoes_what_start_client_changed():
    """The run stops inside a round: ``rollback_round`` gives every started client back its declared tensors
    (the visit counted) and forgets the started clients."""
    strategy, _, _ = fit(BlendStart(), rounds=2)
    fed = strategy.federation
    before = {c: {n: t.clone() for n, t in fed.store.client_state(c).items()} for c in range(NUM_CLIENTS)}
    plan = fed.plan(2)
    fed.open_round(plan)
    for client in plan.clients:
        fed.begin_client(client)
    assert fed.rounds._starts and any(float(fed.store.client_state(c)["visits"]) > 0 for c in plan.clients)
    assert fed.rollback_round()
    assert fed.rounds._starts == {}
    for client, state in before.items():
        for name, value in state.items():
            assert torch.equal(fed.store.client_state(client)[name], value), (client, name)


def test_start_client_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """``BlendStart`` (``tests/scripts/algorithms_run.py``), 2 rounds, every client each round: the global model
    and every client's declared tensors on 2 processes equal the 1-process run. Fails when the hook runs on a
    process that does not hold the client, or its new declared tensors do not travel back with the client."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["blend_start"]
    assert all(float(t["visits"]) == 2 for t in single["declared"].values())
    for held in (rank["blend_start"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=0, atol=0)


class BufferNet(LossNet):
    """LossNet with a buffer (shared with the body): the lockstep runner holds it once for a whole group."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.zeros(6))

    def forward(self, x):
        return super().forward(x + self.offset)


def test_lockstep_refuses_start_client_with_buffers_it_holds_once():
    """An algorithm overriding ``start_client`` may give each client its own buffers, which the lockstep runner
    cannot: ``runner="vectorized"`` is refused naming the hook and the buffer, ``"auto"`` runs sequentially."""
    strategy = FederatedStrategy(
        algorithm=BlendStart(), clients_per_round=PER_ROUND, seed=SEED, runner="vectorized"
    )
    with pytest.raises(
        ValueError, match=r"BlendStart\.start_client may give a client its own starting buffers \(offset\)"
    ):
        quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
            BufferNet(), datamodule=datamodule()
        )
    strategy = FederatedStrategy(
        algorithm=BlendStart(), clients_per_round=PER_ROUND, seed=SEED, runner="auto"
    )
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
        BufferNet(), datamodule=datamodule()
    )
    assert strategy.runner_report.runner == "sequential"
    assert "start_client" in strategy.runner_report.reason
