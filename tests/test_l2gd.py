"""L2GD (``lightning_fedrep.federation.algorithms.l2gd``) against a plain PyTorch loop written from the official
FedRep code's ``main_l2gd.py``: full participation; each iteration draws ``u``; if ``u > p`` every client runs
its local update (``local_epochs`` full-batch SGD steps on its own model), else the server averages the models
(plain mean) and each moves ``w_i <- (1 - lr lam) w_i + lr lam w_bar`` with ``lr = alpha / (n (1 - p))``,
one pull per iteration (no closed form). The coins are each round's stream (the seeding rule of docs/algorithms/adding.md restated,
key ``crc32("l2gd")``): a round is a run of local iterations (the first one implied) followed by the
aggregation iterations up to the next local coin. Evaluation scores each client's own model. The optimizer has
no momentum: its state restarts once per round here, once per local iteration in the official code (the
module's documented deviation)."""

import copy
import zlib

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import L2GD, DirichletPartitioner, FederatedDataModule, FederatedStrategy, Phase
from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome
from lightning_fedrep.federation.api.registry import ALGORITHMS
from tests.fixtures import (
    quiet_trainer,
    reference_clients,
    reference_generator,
    tiny_datamodule,
    tiny_datasets,
)
from tests.test_ditto import _xy, assert_logged_scores
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, SEED, ROUNDS, LOCAL_EPOCHS, P, LAM = 4, 5, 4, 2, 0.5, 3.0
LR = 0.05  # the module optimizer's lr, = alpha / (n (1 - p))
ALPHA = LR * NUM_CLIENTS * (1 - P)


def datamodule():
    """Full-batch clients of unequal sizes (a sample-weighted mean would differ from the plain one)."""
    train, test = tiny_datasets(seed=3)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=1.0, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=256, seed=3)


def coins(round_index):
    """The round's iterations, from its own stream: ``True`` for a local one, ``False`` for an aggregation."""
    generator = reference_generator(SEED, round_index, 0x5EED, zlib.crc32(b"l2gd"))
    out = [True]
    while True:
        local = torch.rand((), generator=generator, dtype=torch.float64).item() > P
        if local and not out[-1]:
            return out
        out.append(local)


def plain_l2gd(init, dm):
    """The official loop, one iteration at a time; returns the last average and every client's model."""
    w = {c: {n: p.detach().clone() for n, p in init.named_parameters()} for c in range(NUM_CLIENTS)}
    data = [_xy(dm, c) for c in range(NUM_CLIENTS)]
    w_bar = None
    for r in range(ROUNDS):
        for local in coins(r):
            if local:
                for c, (x, y) in enumerate(data):
                    model = copy.deepcopy(init)
                    model.load_state_dict(w[c], strict=False)
                    optimizer = model.configure_optimizers()
                    for _ in range(LOCAL_EPOCHS):
                        optimizer.zero_grad()
                        F.cross_entropy(model(x), y).backward()
                        optimizer.step()
                    w[c] = {n: p.detach().clone() for n, p in model.named_parameters()}
            else:
                w_bar = {n: sum(w[c][n] for c in w) / NUM_CLIENTS for n in w[0]}
                a = LR * LAM
                w = {c: {n: (1 - a) * t + a * w_bar[n] for n, t in w[c].items()} for c in w}
    return w_bar, w


def fit(algorithm=None, ckpt_path=None, callbacks=(), runner="sequential", rounds=ROUNDS):
    torch.manual_seed(0)
    init = LossNet(lr=LR, momentum=0.0)
    dm = datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm or L2GD(p=P, alpha=ALPHA, lam=LAM),
        clients_per_round=1.0,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
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


def test_l2gd_equals_the_official_loop():
    """Golden test: the average, every client's model and the tested accuracy/loss (own models). Fails if the
    k pulls of a round are applied as one (``** pulls`` dropped in ``aggregate``), if the mean is
    sample-weighted (``_Unweighted`` -> ``WeightedMean``), if the upload is the client's model before the
    round (``end.slots`` ignored), if the pull's lr is not ``alpha / (n (1 - p))``, or if evaluation scores
    the average (``evaluation_slot = None``)."""
    assert [len(coins(r)) for r in range(ROUNDS)] != [2] * ROUNDS  # some round pulls or trains twice
    strategy, init, dm, trainer, model = fit()
    assert strategy.runner_report.runner == "sequential"
    w_bar, w = plain_l2gd(init, dm)
    fed = strategy.federation
    for name, value in w_bar.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-4, atol=1e-5, msg=name)
        for client in range(NUM_CLIENTS):
            got = fed.store.client_state(client)[f"personal.{name}"]
            torch.testing.assert_close(got, w[client][name], rtol=1e-4, atol=1e-5, msg=(client, name))
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert_logged_scores(metrics, init, dm, {c: w[c] for c in range(NUM_CLIENTS)})


def test_a_mid_round_checkpoint_resumes_like_the_uninterrupted_run(tmp_path):
    """A checkpoint inside round 1 (its coins re-drawn from the seeded stream, the client models pulled by
    round 0 stored) resumes to the same models. Fails if the coins come from the global RNG."""
    whole, *_ = fit()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first, *_ = fit(callbacks=[saver])
    step = first.round_plan(0).length + LOCAL_EPOCHS + 1  # round 1: its second client's first step done
    resumed, *_ = fit(ckpt_path=tmp_path / f"step={step}.ckpt")
    for name, value in whole.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        for name, value in whole.federation.store.client_state(client).items():
            assert torch.equal(resumed.federation.store.client_state(client)[name], value), (client, name)


def test_auto_runs_l2gd_sequentially_naming_its_slot():
    """The lockstep runner does not train declared slots: ``runner="auto"`` says so and runs sequentially."""
    strategy, *_ = fit(runner="auto", rounds=1)
    assert strategy.runner_report.runner == "sequential"
    assert "per-client slot 'personal'" in strategy.runner_report.reason


def test_l2gd_by_name_has_the_official_settings_and_says_what_it_ignores():
    """``Trainer(strategy="l2gd")`` is L2GD(p=0.9, alpha=1, lam=0.5); it trains every client and warns that
    ``clients_per_round`` is ignored and that the optimizer's lr is not the official ``alpha / (n (1 - p))``."""
    algorithm = ALGORITHMS["l2gd"]
    assert isinstance(algorithm, L2GD) and (algorithm.p, algorithm.alpha, algorithm.lam) == (0.9, 1.0, 0.5)
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy="l2gd", max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning) as caught:  # 10 clients: the default clients_per_round=0.1 samples one
        trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=10, batch_size=256))
    messages = " ".join(str(w.message) for w in caught)
    assert "clients_per_round is ignored" in messages and "alpha/(n(1-p))=1;" in messages
    assert trainer.strategy.round_plan(0).clients == list(range(10))


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"p": 1.0}, "p"),
        ({"p": 0.0}, "p"),
        ({"alpha": 0.0}, "alpha"),
        ({"lam": -1.0}, "lam"),
        ({"p": "x"}, "p"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, argument):
    with pytest.raises((ValueError, TypeError), match=f"L2GD.*{argument}"):
        L2GD(**kwargs)


def test_phases_that_do_not_train_the_clients_own_models_are_refused():
    """A phase on the ``"model"`` slot would train the average, reloaded every round: refused, naming phases."""
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=L2GD(p=P, alpha=ALPHA, lam=LAM), clients_per_round=1.0, phases=[Phase("all", epochs=1)]
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with pytest.raises(ValueError, match="L2GD trains each client's own model.*phases="):
        trainer.fit(LossNet(lr=LR, momentum=0.0), datamodule=datamodule())


def test_a_pull_past_the_average_is_refused():
    """``lr·lam > 1`` (here ``1/(4·0.5)·1 = 0.5·... > 1``) would move each model past the average: refused when the
    first round is planned, naming alpha and lam."""
    with pytest.raises(ValueError, match="lr·lam.*Lower alpha or lam"):
        fit(L2GD(p=P, alpha=ALPHA, lam=50.0), rounds=1)


# ----------------------------------------------------------------------------- the server step's client_map


class CountRounds(Algorithm):
    """FedAvg whose server step adds 1 to every client's ``seen`` (``client_map``); a client that trains adds 100."""

    client_tensors = (ClientTensors("seen", shapes=()),)

    def __init__(self, returned=None):
        super().__init__("count_rounds", {"body", "head"}, "test: client_map")
        self.returned = returned

    def finish_client(self, end):
        return ClientOutcome(upload=end.shared(), client_state={"seen": end.client_state["seen"] + 100})

    def aggregate(self, server, results, failures):
        def count(state):
            return self.returned or {"seen": state["seen"] + 1}

        return server.replace(shared=dict(results.reduced), client_map=count), {}


def _count_fit(algorithm, rounds=3):
    torch.manual_seed(0)
    strategy = FederatedStrategy(algorithm=algorithm, clients_per_round=2, seed=SEED, local_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=6, batch_size=256))
    return strategy


def test_client_map_changes_every_clients_declared_tensors_after_the_server_step():
    """After each round every client's ``seen`` grows by 1, trained or not (2 of 6 clients per round, sampling
    restated): ``seen = rounds + 100 * (rounds it trained)``. Fails if the map skips the template of the clients
    that never trained (``_map_clients``'s template update dropped) or the stored clients (its loop dropped)."""
    rounds = 3
    strategy = _count_fit(CountRounds(), rounds)
    trained = [c for r in range(rounds) for c in reference_clients(6, 2, SEED, r)]
    assert len(set(trained)) < 6  # some client never trains: it reads the mapped template
    for client in range(6):
        seen = strategy.federation.store.client_state(client)["seen"].item()
        assert seen == rounds + 100 * trained.count(client), client


def test_a_client_map_returning_an_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="CountRounds.aggregate returned a client_map.*'seen'"):
        _count_fit(CountRounds(returned={"other": torch.zeros(())}), rounds=1)


def test_l2gd_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """L2GD (``tests/scripts/algorithms_run.py``), 2 rounds, 8 clients trained on 2 processes: the average,
    every client's own model and the validation accuracy equal the 1-process run. Fails if the server step's
    ``client_map`` runs on one process only (``_map_clients``'s loop skipped unless
    ``torch.distributed.get_rank() == 0``: the other rank's clients keep their unpulled models)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["l2gd"]
    assert len({float(t["personal.classifier.weight"].sum()) for t in single["declared"].values()}) > 1
    for held in (rank["l2gd"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)
