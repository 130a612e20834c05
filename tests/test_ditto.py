"""Ditto (``lightning_fedrep.federation.algorithms.ditto``) against a plain PyTorch loop written from the
official FedRep code's ``main_ditto.py`` / ``LocalUpdateDitto`` (design §6.1): each sampled client trains the
global model FedAvg-style, then its personal model v on the same data, each step being an SGD step followed
by ``v <- v - lr lam (v_0 - w_glob)`` (v_0: v before the step, w_glob: the round-start global model);
personal models start as copies of the initial model; evaluation scores the personal models."""

import copy

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import Ditto, FederatedStrategy
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, LAM = 5, 3, 2, 3, 2, 0.5


def full_batch_datamodule():
    """Every client's training data is one batch, so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def _xy(dm, client, split="train"):
    data = dm.client_data(client, split)
    return tuple(t[data.indices] for t in data.dataset.tensors)


def assert_logged_scores(metrics, init, dm, models):
    """The logged ``test/acc`` and ``test/loss`` are the means over clients of plain PyTorch's accuracy and
    cross-entropy of ``models[c]`` (state dicts over ``init``) on client ``c``'s test split."""
    accuracy, loss = [], []
    for client, values in models.items():
        net = copy.deepcopy(init)
        net.load_state_dict(values, strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            out = net(x)
        accuracy.append((out.argmax(1) == y).double().mean().item())
        loss.append(F.cross_entropy(out, y).item())
    assert abs(metrics["test/acc"] - sum(accuracy) / len(models)) < 1e-6
    assert abs(metrics["test/loss"] - sum(loss) / len(models)) < 1e-4 * max(1.0, abs(metrics["test/loss"]))


def _train(init, values, x, y, pull_to=None, lam=LAM):
    """LOCAL_EPOCHS full-batch steps of the module's own optimizer from ``values``; with ``pull_to``, each
    step is followed by the pull computed from the pre-step weights (outside the optimizer)."""
    model = copy.deepcopy(init)
    model.load_state_dict(values, strict=False)
    optimizer = model.configure_optimizers()
    lr = optimizer.param_groups[0]["lr"]
    for _ in range(LOCAL_EPOCHS):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if pull_to is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p -= lr * lam * (before[n] - pull_to[n])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def plain_ditto(init, dm):
    """Ditto written out: the global model's sample-weighted FedAvg, each client's personal model v."""
    w = {n: p.detach().clone() for n, p in init.named_parameters()}
    v = {c: dict(w) for c in range(NUM_CLIENTS)}
    for r in range(ROUNDS):
        total, weight = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            x, y = _xy(dm, client)
            trained = _train(init, w, x, y)
            for n in w:
                total[n] += len(y) * trained[n]
            weight += len(y)
            v[client] = _train(init, v[client], x, y, pull_to=w)
        w = {n: t / weight for n, t in total.items()}
    return w, v


def fit(tmp_path=None, strategy=None, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    strategy = strategy or FederatedStrategy(
        algorithm=Ditto(lam=LAM), clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS
    )
    model = copy.deepcopy(init)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=ROUNDS,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    dm.setup()
    return strategy, init, dm, trainer, model


def test_ditto_equals_a_plain_loop():
    """Golden test: global weights, every client's personal weights, and the tested accuracy/loss (on the
    personal models). Fails if the pull reads the post-step weights (``before[n]`` -> ``v`` in ``Ditto.objective``), pulls
    towards the client's live global weights instead of the round-start ones, or evaluation (and
    ``client_model``) scores the global model (``evaluation_slot = None``)."""
    strategy, init, dm, trainer, model = fit()
    assert strategy.runner_report.runner == "sequential"
    w, v = plain_ditto(init, dm)
    fed = strategy.federation
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-4, atol=1e-5, msg=name)
        for client in range(NUM_CLIENTS):
            got = fed.store.client_state(client)[f"personal.{name}"]
            torch.testing.assert_close(got, v[client][name], rtol=1e-4, atol=1e-5, msg=(client, name))
    for client in range(NUM_CLIENTS):  # client_model is the model evaluation scores
        for name, value in strategy.client_model(client).named_parameters():
            torch.testing.assert_close(value, v[client][name], rtol=1e-4, atol=1e-5, msg=(client, name))
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert_logged_scores(metrics, init, dm, {c: v[c] for c in range(NUM_CLIENTS)})


def test_a_mid_round_checkpoint_in_the_personal_phase_resumes_like_the_uninterrupted_run(tmp_path):
    """Fails if the live slot is not checkpointed (the model slot's values kept aside while the personal
    slot is live, or the slot's name): the resumed run would train the wrong weights."""
    whole, *_ = fit()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first, *_ = fit(callbacks=[saver])
    # round 1's first client: 2 global steps, 1 personal step done, the personal phase still live
    step = first.round_plan(0).length + LOCAL_EPOCHS + 1
    ckpt = tmp_path / f"step={step}.ckpt"
    assert torch.load(ckpt, weights_only=True)["lightning_fedrep"]["round"]["live_slot"] == "personal"
    resumed, *_ = fit(ckpt_path=ckpt)
    for name, value in whole.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        for name, value in whole.federation.store.client_state(client).items():
            assert torch.equal(resumed.federation.store.client_state(client)[name], value), (client, name)


def test_ditto_by_name_has_the_official_lambda():
    """``Trainer(strategy="ditto")`` is Ditto(lam=1), the official ``--lam_ditto`` default, and trains."""
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy="ditto", max_epochs=1, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=full_batch_datamodule())
    algorithm = trainer.strategy.algorithm
    assert isinstance(algorithm, Ditto) and algorithm.lam == 1.0


def test_auto_runs_ditto_sequentially_naming_its_slot():
    """Fails if the lockstep runner could take a phase that trains a declared slot (its reason not listed):
    ``runner="auto"`` must say which slot keeps the run sequential."""
    strategy, *_ = fit(
        strategy=FederatedStrategy(
            algorithm=Ditto(lam=LAM),
            clients_per_round=PER_ROUND,
            seed=SEED,
            local_epochs=LOCAL_EPOCHS,
            runner="auto",
        )
    )
    assert strategy.runner_report.runner == "sequential"
    assert "per-client slot 'personal'" in strategy.runner_report.reason
