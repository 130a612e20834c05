"""APFL (``lightning_fedrep.federation.algorithms.apfl``) against a plain PyTorch loop written from the official
FedRep code's ``LocalUpdateAPFL`` / ``main_apfl.py``: per batch, with ``w_0`` the global copy at the batch's
start, (a) the global copy takes its optimizer step (SGD, momentum 0.5) on ``L(w_0)``, (b) the personal model
moves ``v <- v - lr alpha grad L(mix)`` with ``mix = alpha v + (1 - alpha) w_0`` (paper) or ``alpha v + alpha
w_0`` (the official mixture); with ``mixture="paper"`` as plain SGD, with ``mixture="official"`` as the official
code's second ``optimizer.step()`` of the same optimizer (one momentum buffer, weight decay on the weights only),
restated literally (``_official_local``, on :class:`OfficialNet`, whose optimizer is the official one); the server
takes the sample-weighted mean of the ``w``; personal models start from the initial model. Full-batch clients; rows
in the loader's shuffle order (``tests.fixtures.client_batches``)."""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import APFL, DirichletPartitioner, FederatedDataModule, FederatedStrategy
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, ALPHA = 3, 2, 4, 2, 2, 3, 0.75
MOMENTUM, WEIGHT_DECAY = 0.5, 1e-3


def official_optimizer(net, lr):
    """``LocalUpdateAPFL.train``'s optimizer: SGD, momentum 0.5, weight decay on the tensors without "bias"."""
    weights = [p for n, p in net.named_parameters() if "bias" not in n]
    biases = [p for n, p in net.named_parameters() if "bias" in n]
    groups = [{"params": weights, "weight_decay": WEIGHT_DECAY}, {"params": biases, "weight_decay": 0}]
    return torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)


class OfficialNet(LossNet):
    """The tiny net trained with the official APFL optimizer (what ``APFL(mixture="official")`` assumes)."""

    def configure_optimizers(self):
        return official_optimizer(self, self.hparams.lr)


def official(**kwargs):
    return APFL(alpha=ALPHA, mixture="official", momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, **kwargs)


def algorithm_of(mixture):
    return official() if mixture == "official" else APFL(alpha=ALPHA, mixture=mixture)


def datamodule(batch_size=256):
    """Full-batch clients of unequal sizes (Dirichlet); ``batch_size=64`` gives them different step counts
    (lockstep lanes that idle) and each pass a padded last batch."""
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=1.0, min_samples_per_client=100)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _forward(p, x):
    """TinyNet's forward written out (dropout 0)."""
    h = F.relu(F.linear(x, p["body.0.weight"], p["body.0.bias"]))
    h = F.relu(F.linear(h, p["body.3.weight"], p["body.3.bias"]))
    return F.linear(h, p["classifier.weight"], p["classifier.bias"])


def _local(init, w, v, batches, beta):
    """The client's steps: the global copy through its own optimizer, the personal model by plain SGD."""
    model = copy.deepcopy(init)
    model.load_state_dict(w, strict=False)
    optimizer = model.configure_optimizers()
    lr = optimizer.param_groups[0]["lr"]
    v = {n: t.clone() for n, t in v.items()}
    for x, y in batches:
        w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        mix = {n: (ALPHA * v[n] + beta * w0[n]).requires_grad_() for n in v}
        grads = torch.autograd.grad(F.cross_entropy(_forward(mix, x), y), list(mix.values()))
        v = {n: v[n] - lr * ALPHA * g for n, g in zip(mix, grads)}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, v


def _official_local(init, w, v, batches, beta):
    """``LocalUpdateAPFL.train`` of the official code: per batch, the optimizer steps the global copy, then (the
    same optimizer, its momentum buffer and weight decay) the mixture; ``v`` moves by the mixture's step."""
    net = copy.deepcopy(init)
    net.load_state_dict(w, strict=False)
    optimizer = official_optimizer(net, net.hparams.lr)
    w_local = {n: t.clone() for n, t in v.items()}
    for images, labels in batches:
        w_glob = {n: p.detach().clone() for n, p in net.named_parameters()}
        w_loc_new = {k: ALPHA * w_local[k] + beta * w_glob[k] for k in w_glob}
        loss = F.cross_entropy(net(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        wt = {n: p.detach().clone() for n, p in net.named_parameters()}
        net.load_state_dict(w_loc_new, strict=False)
        loss = ALPHA * F.cross_entropy(net(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        w_local_bar = {n: p.detach().clone() for n, p in net.named_parameters()}
        w_local = {k: w_local_bar[k] - w_loc_new[k] + w_local[k] for k in w_local_bar}
        net.load_state_dict(wt, strict=False)
    return {n: p.detach().clone() for n, p in net.named_parameters()}, w_local


def plain_apfl(init, dm, mixture, local=None):
    """The run written out; ``local``: the client's steps (``_official_local`` for the official mixture)."""
    beta = ALPHA if mixture == "official" else 1 - ALPHA
    local = local or (_official_local if mixture == "official" else _local)
    w = {n: p.detach().clone() for n, p in init.named_parameters()}
    v = {c: dict(w) for c in range(NUM_CLIENTS)}
    for r in range(ROUNDS):
        total, weight = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            steps = LOCAL_EPOCHS * math.ceil(len(dm.client_data(client)) / dm.batch_size)
            batches = list(client_batches(dm, DATA_SEED, r, client, steps))
            trained, v[client] = local(init, w, v[client], batches, beta)
            for n in w:
                total[n] += len(dm.client_data(client)) * trained[n]
            weight += len(dm.client_data(client))
        w = {n: t / weight for n, t in total.items()}
    return w, v


def fit(algorithm, runner="auto", batch_size=256, callbacks=(), ckpt_path=None, rounds=ROUNDS):
    torch.manual_seed(0)
    init = OfficialNet() if algorithm.mixture == "official" else LossNet()
    dm = datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(copy.deepcopy(init), datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm


@pytest.mark.parametrize("mixture", ["paper", "official"])
def test_apfl_equals_a_plain_loop(mixture):
    """Golden test: the global weights and every client's personal model (sampled or not). Fails if the
    personal step drops ``alpha`` (``lr * mixed[n]``), if ``"official"`` mixes with ``1 - alpha``, if its
    personal step does not share the optimizer's momentum buffer (either way) or weight decay, or if the
    client's personal model is never written (``store.put_state`` dropped from ``put_step_state``)."""
    strategy, init, dm = fit(algorithm_of(mixture), runner="sequential")
    _assert_equal(strategy, *plain_apfl(init, dm, mixture))


def test_the_official_step_is_not_the_plain_one():
    """Planted bug: the official run against the reference with the paper's plain SGD personal step (the
    strategy's step before issue 41) differs, in the personal and the global models."""
    strategy, init, dm = fit(official(), runner="sequential")
    w, v = plain_apfl(init, dm, "official", local=_local)
    gaps = [float((strategy.global_tensors()[n] - t).abs().max()) for n, t in w.items()]
    state = strategy.federation.store.client_state
    gaps += [float((state(c)[f"personal.{n}"] - t).abs().max()) for c in v for n, t in v[c].items()]
    assert max(gaps) > 1e-4


@pytest.mark.parametrize("mixture", ["paper", "official"])
def test_the_lockstep_runner_equals_the_plain_loop_and_the_sequential_runner(mixture):
    """The rule inside the lockstep runner's ``vmap`` on padded batches of 64, its ``client_state`` written into
    the store after each step; clients of unequal sizes, so some lanes idle. Fails if the engine skips writing
    it (``_write_rule_state`` returning at once)."""
    lockstep, init, dm = fit(algorithm_of(mixture), runner="vectorized", batch_size=64)
    assert lockstep.runner_report.runner == "vectorized"
    sequential, *_ = fit(algorithm_of(mixture), runner="sequential", batch_size=64)
    _assert_equal(lockstep, *plain_apfl(init, dm, mixture))
    w = sequential.global_tensors()
    v = {
        c: {n: sequential.federation.store.client_state(c)[f"personal.{n}"] for n in w}
        for c in range(NUM_CLIENTS)
    }
    _assert_equal(lockstep, w, v)


def _assert_equal(strategy, w, v):
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
        for client in range(NUM_CLIENTS):
            got = strategy.federation.store.client_state(client)[f"personal.{name}"]
            torch.testing.assert_close(got, v[client][name], rtol=1e-5, atol=1e-6, msg=(client, name))


def test_apfl_by_name_has_the_official_alpha():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["apfl"]
    assert isinstance(algorithm, APFL) and (algorithm.alpha, algorithm.mixture) == (0.75, "paper")
    assert [t.name for t in algorithm.client_tensors] == ["personal"]  # the paper's rule keeps no buffers
    assert (
        repr(APFL(mixture="official"))
        == "APFL(alpha=0.75, mixture='official', momentum=0.5, weight_decay=0.0001)"
    )


@pytest.mark.parametrize(
    "kwargs, argument",
    [({"alpha": 1.5}, "alpha"), ({"mixture": "typo"}, "mixture"), ({"momentum": -0.1}, "momentum")],
)
def test_bad_settings_name_the_argument(kwargs, argument):
    with pytest.raises((ValueError, TypeError), match=argument):
        APFL(**kwargs)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_mid_round_checkpoint_resumes_like_the_uninterrupted_run(tmp_path, runner):
    """The personal models a step rule writes during a round are in a mid-round checkpoint, and its rollback
    record (``before``) holds them as they were before the round. Fails if ``put_step_state`` keeps no rollback
    record."""
    whole, *_ = fit(APFL(alpha=ALPHA), runner=runner, batch_size=64)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first, *_ = fit(APFL(alpha=ALPHA), runner=runner, batch_size=64, callbacks=[saver])
    ckpt = next(path for path in sorted(tmp_path.glob("step=*.ckpt"), key=_step) if _inside_round_1(path))
    resumed, *_ = fit(APFL(alpha=ALPHA), runner=runner, batch_size=64, ckpt_path=ckpt)
    for name, value in whole.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        for name, value in whole.federation.store.client_state(client).items():
            assert torch.equal(resumed.federation.store.client_state(client)[name], value), (client, name)


def _step(path):
    return int(path.stem.split("=")[1])


def _inside_round_1(path):
    """A checkpoint written inside round 1 after its steps wrote a personal model (a rollback record exists)."""
    state = torch.load(path, weights_only=False)["lightning_fedrep"]["round"]
    return state["open"] and state["index"] == 1 and bool(state["before"]["clients"])


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise RuntimeError("stopped inside the round")


def test_a_round_stopped_by_an_error_rolls_the_personal_models_back():
    """A run stopped inside round 1 (after its first client's first step wrote that client's ``v``) rolls the
    round back: every personal model is as round 0 left it. Fails if ``put_step_state`` keeps no rollback
    record (``self._remember_before(client)`` dropped: the client keeps its half-round ``v``)."""
    one_round, *_ = fit(APFL(alpha=ALPHA), runner="sequential", batch_size=64, rounds=1)
    expected = {c: one_round.federation.store.client_state(c) for c in range(NUM_CLIENTS)}
    torch.manual_seed(0)
    init, dm = LossNet(), datamodule(64)
    strategy = FederatedStrategy(
        algorithm=APFL(alpha=ALPHA),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner="sequential",
    )
    length = one_round.round_plan(0).length
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0, callbacks=[StopAt(length + 1)]
    )
    with pytest.raises(RuntimeError, match="stopped inside the round"):
        trainer.fit(copy.deepcopy(init), datamodule=dm)
    for client in range(NUM_CLIENTS):
        for name, value in expected[client].items():
            assert torch.equal(strategy.federation.store.client_state(client)[name], value), (client, name)


def test_evaluation_scores_the_mixture_of_personal_and_global_models():
    """What APFL's evaluation scores (``main_apfl.py``: ``alpha v + (1 - alpha) w_glob``, whatever the training
    mixture), read from the plain loop's models: ``client_state_dict`` and the logged test accuracy. Fails if
    ``APFL.evaluation`` swaps ``alpha`` and ``1 - alpha`` or scores the personal models alone."""
    torch.manual_seed(0)
    init, dm = OfficialNet(), datamodule()
    strategy = FederatedStrategy(
        algorithm=official(),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    w, v = plain_apfl(init, dm, "official")
    accuracies = []
    for client in range(NUM_CLIENTS):
        mixed = {n: ALPHA * v[client][n] + (1 - ALPHA) * w[n] for n in w}
        got = strategy.client_state_dict(client)
        for name, value in mixed.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=(client, name))
        net = copy.deepcopy(init)
        net.load_state_dict(mixed, strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            accuracies.append((net(x).argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_apfl_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """APFL (``tests/scripts/algorithms_run.py``), 2 rounds, every client: the global model, every client's
    personal model (written by the step rule at every step) and the validation accuracy scored on the mixture
    on 2 processes equal the 1-process run. Fails when the personal models a step wrote stay on the rank that
    trained the client (a client's record moved without its declared tensors)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["apfl"]
    assert len({float(t["personal.classifier.weight"].sum()) for t in single["declared"].values()}) > 1
    for held in (rank["apfl"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)
