"""``Algorithm.configure_round(plan, server)``: an algorithm picks its clients with ``plan.generator`` and sets a
per-client ``lr_scale``; checked against a plain PyTorch loop (on both runners, SGD and Adam), across a mid-round
resume, and for a bad return value."""

import copy
import zlib

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import CHECKPOINT_KEY, FederatedStrategy
from lightning_fedrep.federation.api.algorithm import Algorithm
from tests.fixtures import quiet_trainer, reference_generator, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PICKED, SEED, ROUNDS, LOCAL_EPOCHS, SCALE = 6, 3, 4, 3, 2, 0.5


class Picky(Algorithm):
    """FedAvg that trains ``PICKED`` of the round's clients, drawn with ``plan.generator("pick")``, the first
    drawn at ``lr_scale=SCALE``; it records each plan it returns and the server view it saw."""

    def __init__(self) -> None:
        super().__init__("picky", ("body", "head"), "test algorithm")
        self.plans: dict[int, tuple] = {}
        self.servers: dict[int, dict[str, torch.Tensor]] = {}

    def configure_round(self, plan, server):
        order = torch.randperm(len(plan.clients), generator=plan.generator("pick"))[:PICKED].tolist()
        chosen = [plan.clients[i] for i in order]
        new = plan.replace(clients=sorted(chosen), settings={chosen[0]: {"lr_scale": SCALE}})
        self.plans[plan.round] = tuple((w.client, w.lr_scale) for w in new.work)
        self.servers[plan.round] = {k: v.clone() for k, v in server.shared.items()}
        return new


def reference_picks(round_index: int) -> tuple[list[int], int]:
    """The documented draw restated: a generator by the seeding rule with keys ``(round, 0x5EED,
    crc32(key))``, a permutation of the round's clients (here all of them), the first ``PICKED``."""
    g = reference_generator(SEED, round_index, 0x5EED, zlib.crc32(b"pick"))
    order = torch.randperm(NUM_CLIENTS, generator=g)[:PICKED].tolist()
    return sorted(order), order[0]


def datamodule():
    """Every client's training data is one batch, so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def plain_loop(init, dm):
    """FedAvg over the reference picks written out: the module's SGD on each picked client's whole data for
    ``LOCAL_EPOCHS`` steps (the scaled client with every param group's lr times ``SCALE``), then the
    sample-weighted mean (float64)."""
    global_state = {k: v.clone() for k, v in init.state_dict().items()}
    for r in range(ROUNDS):
        clients, scaled = reference_picks(r)
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}
        weight = 0.0
        for client in clients:
            model = copy.deepcopy(init)
            model.load_state_dict(global_state)
            optimizer = model.configure_optimizers()
            for group in optimizer.param_groups:
                group["lr"] *= SCALE if client == scaled else 1.0
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            for k, v in model.state_dict().items():
                total[k] += v.double() * len(x)
            weight += len(x)
        global_state = {k: (v / weight).float() for k, v in total.items()}
    return global_state


def fit(algorithm, runner="sequential", ckpt_path=None, callbacks=(), global_seed=0, optimizer="sgd"):
    torch.manual_seed(0)
    init = LossNet(optimizer=optimizer)
    dm = datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=NUM_CLIENTS,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
    )
    torch.manual_seed(global_seed)  # the plans must not depend on the global RNG
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=ROUNDS,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(copy.deepcopy(init), datamodule=dm, ckpt_path=ckpt_path)
    return strategy, init, dm


def test_configure_round_and_lr_scale_equal_a_plain_loop():
    """Golden test. Fails if ``Algorithm.configure_round`` is not called (all six clients train), if the
    sequential runner ignores ``lr_scale`` (``_ScaledLr`` factor 1), or if ``plan.generator`` draws from
    the global RNG or ignores its key (other picks than the restated seeding rule)."""
    algorithm = Picky()
    strategy, init, dm = fit(algorithm)
    assert strategy.runner_report.runner == "sequential"
    for r in range(ROUNDS):
        clients, scaled = reference_picks(r)
        assert algorithm.plans[r] == tuple((c, SCALE if c == scaled else 1.0) for c in clients)
        assert strategy.round_plan(r).clients == clients
    dm.setup()
    expected = plain_loop(init, dm)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the server view of round 1 is the global state after round 0 (a copy)
    assert set(algorithm.servers[1]) == set(strategy.global_tensors())


def test_resumed_run_repeats_the_plans(tmp_path):
    """A mid-round checkpoint resumed under another global seed repeats every plan and the result. Fails if
    ``plan.generator`` draws from the global RNG (``torch.default_generator``) or the algorithm's
    ``configure_round`` is skipped on resume."""
    full_algorithm = Picky()
    full, _, _ = fit(full_algorithm)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit(Picky(), callbacks=[saver])
    ckpt = tmp_path / "step=8.ckpt"  # round 1 (steps 6..11: three clients of two steps), mid-round
    assert torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]["round"]["open"]
    resumed_algorithm = Picky()
    resumed, _, _ = fit(resumed_algorithm, ckpt_path=ckpt, global_seed=123)
    assert 0 not in resumed_algorithm.plans  # round 0 is not planned again
    assert [resumed_algorithm.plans[r] for r in (1, 2)] == [full_algorithm.plans[r] for r in (1, 2)]
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(resumed.global_tensors()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_lockstep_applies_lr_scale_as_a_plain_loop(optimizer):
    """The lockstep runner trains a round whose clients have different ``lr_scale`` (one group: each client
    steps at its own learning rate) as the plain loop does, torch's SGD or Adam at the scaled lr, and as the
    sequential runner. Fails if the lockstep runner ignores ``lr_scale`` (or scales every client by one), or
    if ``runner="auto"`` still runs an algorithm with ``configure_round`` sequentially for it."""
    strategy, init, dm = fit(Picky(), runner="vectorized", optimizer=optimizer)
    assert strategy.runner_report.runner == "vectorized"
    sequential, _, _ = fit(Picky(), optimizer=optimizer)
    dm.setup()
    expected = plain_loop(init, dm)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(
            strategy.global_tensors()[name], sequential.global_tensors()[name], rtol=1e-6, atol=1e-7, msg=name
        )
    auto, _, _ = fit(Picky(), runner="auto", optimizer=optimizer)
    assert "lr_scale" not in auto.runner_report.reason


class Broken(Algorithm):
    def __init__(self) -> None:
        super().__init__("broken", ("body", "head"), "test algorithm")

    def configure_round(self, plan, server):
        return plan.clients  # a list, not a RoundPlan


def test_bad_return_is_refused_naming_the_algorithm():
    """Fails if the return value of ``Algorithm.configure_round`` is used unchecked."""
    with pytest.raises(TypeError, match=r"Broken\.configure_round must return a RoundPlan for round 0"):
        fit(Broken())


class LrReadingPicky(Picky):
    """Picky whose loss term records ``view.lr`` per client (and adds nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: dict[tuple[int, int], set[float]] = {}

    def objective(self, phase):
        from lightning_fedrep import LossTerm, Objective

        def record(view):
            self.lrs.setdefault((view.round, int(view.client)), set()).add(view.lr)
            return view.trained[next(iter(view.trained))].sum() * 0.0

        return Objective(terms=(LossTerm(record, "lr reader"),))


def test_step_view_lr_is_the_scaled_lr():
    """``view.lr`` is the client's scaled learning rate. Fails if the sequential runner's view scales the
    optimizer's lr again inside the step (seen: 0.0125 instead of 0.025) or not at all."""
    algorithm = LrReadingPicky()
    fit(algorithm)
    lr = LossNet().hparams.lr
    for r in range(ROUNDS):
        clients, scaled = reference_picks(r)
        for c in clients:
            assert algorithm.lrs[(r, c)] == {lr * SCALE if c == scaled else lr}
