"""Fed-MTL (``lightning_fedrep.federation.algorithms.fed_mtl``) against a plain PyTorch loop restating the official
FedRep code's ``main_mtl.py`` / ``LocalUpdateMTL``: every client keeps its full model; a sampled client trains
``loss + strength * (||W||^2 + sum over full 'chunk'-row blocks x of tr(x Omega x^T))``, ``W`` the sampled
clients' round-start flattened weights (``d x m``) with its own column replaced by its live weights,
``Omega = (I - 11^T/m) ** 2`` elementwise; nothing is averaged; evaluation scores each client's own model."""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy, FedMTL
from lightning_fedrep.runners.lockstep import sizing
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_ditto import _xy, assert_logged_scores
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 3, 2, 1, 2, 2
CHUNK, STRENGTH = 50, 0.05  # d = 224: 4 full blocks of 50 rows, 24 rows dropped; strong enough to matter


def full_batch_datamodule():
    """Every client's training data is one batch, so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def official_regularizer(W_glob, idx, live, omega, chunk, strength):
    """``LocalUpdateMTL.train``'s regularizer, restated line by line (the official ``k = 4000`` is ``chunk``)."""
    W = W_glob.clone()
    W[:, idx] = torch.cat([p.flatten() for p in live])
    reg = W.norm() ** 2
    for i in range(W.shape[0] // chunk):
        x = W[i * chunk : (i + 1) * chunk, :]
        reg = reg + x.mm(omega).mm(x.T).trace()
    f = int(math.log10(W.shape[0]) + 1) + 1
    return reg * (10 ** (-f) if strength is None else strength)


def plain_fed_mtl(init, dm, chunk=CHUNK, strength=STRENGTH):
    """``main_mtl.py`` written out: ``W`` built from the sampled clients' stored weights before any trains."""
    w = {c: {n: p.detach().clone() for n, p in init.named_parameters()} for c in range(NUM_CLIENTS)}
    m = PER_ROUND
    ones = torch.ones((m, 1))
    omega = (torch.eye(m) - 1 / m * ones.mm(ones.T)) ** 2
    for r in range(ROUNDS):
        users = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)
        W = torch.stack([torch.cat([t.flatten() for t in w[u].values()]) for u in users], dim=1)
        for idx, user in enumerate(users):
            model = copy.deepcopy(init)
            model.load_state_dict(w[user], strict=False)
            optimizer = model.configure_optimizers()
            x, y = _xy(dm, user)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                reg = official_regularizer(W, idx, list(model.parameters()), omega, chunk, strength)
                (F.cross_entropy(model(x), y) + reg).backward()
                optimizer.step()
            w[user] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return w


def fit(algorithm, ckpt_path=None, callbacks=(), runner="auto", rounds=ROUNDS):
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    model = copy.deepcopy(init)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm, trainer, model


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fed_mtl_equals_the_official_rule_restated(runner):
    """Golden test: every client's weights and the tested accuracy/loss (on its own model), on both runners.
    Fails if ``Omega`` is the matrix square (``diagonal, off = 1 - 1 / m, -1 / m``: the projection), the partial
    block is kept (``_rows`` returning ``d``), the own column is left out of the gradient (``w.detach()``), or a
    lockstep lane reads another client's row (``tables["index"][0]``)."""
    strategy, init, dm, trainer, model = fit(FedMTL(chunk=CHUNK, strength=STRENGTH), runner=runner)
    assert strategy.runner_report.runner == runner
    assert strategy.global_tensors() == {}  # nothing is averaged
    expected = plain_fed_mtl(init, dm)
    for client in range(NUM_CLIENTS):
        for name, value in strategy.client_model(client).named_parameters():
            torch.testing.assert_close(
                value, expected[client][name], rtol=1e-5, atol=1e-6, msg=(client, name)
            )
    plain = plain_fed_mtl(init, dm, strength=0.0)  # the regularizer matters at this strength
    assert any(not torch.allclose(plain[c][n], expected[c][n], atol=1e-4) for c in plain for n in plain[c])
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert_logged_scores(metrics, init, dm, {c: expected[c] for c in range(NUM_CLIENTS)})


def test_the_official_strength_and_block_size():
    """``Trainer(strategy="fed_mtl")`` is FedMTL(chunk=4000, strength=None): ``10^-f`` with ``f = 4`` for
    d = 224, and no trace term (d < 4000). Fails if ``f`` is ``floor(log10 d) + 1`` or the trace keeps the
    partial block."""
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy="fed_mtl", max_epochs=1, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=10, batch_size=256, seed=3))  # 1 per round
    algorithm = trainer.strategy.algorithm
    assert isinstance(algorithm, FedMTL) and (algorithm.chunk, algorithm.strength) == (4000, None)
    torch.manual_seed(0)
    strategy, init, dm, *_ = fit(FedMTL())
    expected = plain_fed_mtl(init, dm, chunk=4000, strength=None)
    for client in range(NUM_CLIENTS):
        for name, value in strategy.client_model(client).named_parameters():
            torch.testing.assert_close(
                value, expected[client][name], rtol=1e-6, atol=1e-7, msg=(client, name)
            )


def test_a_mid_round_checkpoint_resumes_like_the_uninterrupted_run(tmp_path):
    """Fails if the kept weights are not saved with the federation (``state_dict`` returning ``{}``), or if the
    resumed round's tables read the client that finished before the checkpoint at its end weights instead of
    its round-start ones (``_start`` returning ``end``)."""
    algorithm, runner = FedMTL(chunk=CHUNK, strength=STRENGTH), "sequential"
    whole, *_ = fit(algorithm, runner=runner, rounds=3)  # round 2 reads what round 1's first client kept
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first, *_ = fit(algorithm, callbacks=[saver], runner=runner, rounds=3)
    # round 1: its first client done, the next one's first step done
    step = first.round_plan(0).length + LOCAL_EPOCHS + 1
    resumed, *_ = fit(
        FedMTL(chunk=CHUNK, strength=STRENGTH),
        ckpt_path=tmp_path / f"step={step}.ckpt",
        runner=runner,
        rounds=3,
    )
    for client in range(NUM_CLIENTS):
        for name, value in whole.client_tensors(client).items():
            torch.testing.assert_close(resumed.client_tensors(client)[name], value, msg=(client, name))


def test_auto_may_run_fed_mtl_on_the_lockstep_runner(monkeypatch):
    """Fails if the regularizer is ``vmappable=False`` or FedMTL's ``configure_round`` (which only records the
    round's clients) keeps ``runner="auto"`` sequential."""
    monkeypatch.setattr(
        sizing, "faster_lane_width", lambda wide, narrow, device, **kwargs: (True, 1e-3, 2e-3)
    )
    strategy, *_ = fit(FedMTL(chunk=CHUNK, strength=STRENGTH))
    assert strategy.runner_report.runner == "vectorized", strategy.runner_report


class ScaledFedMTL(FedMTL):
    """Halves the learning rate of each round's first client."""

    def configure_round(self, plan, server):
        plan = super().configure_round(plan, server)
        return plan.replace(settings={plan.clients[0]: {"lr_scale": 0.5}})


def test_a_round_that_scales_the_lr_trains_alike_on_both_runners():
    """The lockstep runner applies the ``lr_scale`` that FedMTL's ``configure_round`` sets beside recording the
    round's clients: every client's model as on the sequential runner. Fails if one runner ignores it."""
    lockstep, *_ = fit(ScaledFedMTL(chunk=CHUNK, strength=STRENGTH), runner="vectorized")
    assert lockstep.runner_report.runner == "vectorized"
    sequential, *_ = fit(ScaledFedMTL(chunk=CHUNK, strength=STRENGTH), runner="sequential")
    unscaled, *_ = fit(FedMTL(chunk=CHUNK, strength=STRENGTH), runner="sequential")
    first = sequential.round_plan(0).clients[0]
    assert not torch.allclose(
        unscaled.client_tensors(first)["classifier.weight"],
        sequential.client_tensors(first)["classifier.weight"],
    )
    for client in range(NUM_CLIENTS):
        for name, value in sequential.client_tensors(client).items():
            torch.testing.assert_close(lockstep.client_tensors(client)[name], value, msg=(client, name))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk": 0}, ValueError, "chunk"),
        ({"chunk": 2.5}, TypeError, "chunk"),
        ({"strength": -1.0}, ValueError, "strength"),
        ({"strength": float("nan")}, ValueError, "strength"),
        ({"strength": "0.1"}, TypeError, "strength"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=f"FedMTL.*{match}|{match}.*FedMTL"):
        FedMTL(**kwargs)


def test_a_second_fit_of_the_same_algorithm_starts_afresh():
    """The registered instance serves every ``Trainer(strategy="fed_mtl")``: fails if a new fit keeps the last
    fit's weights (no reset when round 0 is planned), whose clients' columns would not be the initial model."""
    algorithm = FedMTL(chunk=CHUNK, strength=STRENGTH)
    first, *_ = fit(algorithm, runner="sequential")
    second, *_ = fit(algorithm, runner="sequential")
    for client in range(NUM_CLIENTS):
        for name, value in first.client_tensors(client).items():
            torch.testing.assert_close(second.client_tensors(client)[name], value, msg=(client, name))


def test_fed_mtl_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """Fed-MTL (``tests/scripts/algorithms_run.py``, strength 0.05, no blocks), 2 rounds, every client: every client's
    model, the history and the validation accuracy on 2 processes equal the 1-process run, whose models the
    regularizer moved. Fails when a process's regularizer reads only the weights of the clients it trained
    (the others' columns left at the initial model: ``aggregate`` keeping only this rank's updates)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fed_mtl"]
    assert single["global"] == {}
    for held in (rank["fed_mtl"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
