"""FedOpt (``lightning_fedrep.federation.algorithms.fedopt``): FedAdam, FedYogi and FedAdagrad as server optimizers,
against a plain PyTorch loop that restates Reddi et al.'s Algorithm 2 (and Flower's variant) on full-batch
clients, on both runners; composed with FedPer (only the shared body is stepped) and with client-level DP (the
step starts from the private mean); a failing client left out of Δ; a mid-round checkpoint resumed; the
planted bugs the golden test catches."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn import functional as F

from lightning_fedrep import (
    ALGORITHMS,
    CHECKPOINT_KEY,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FederatedStrategy,
    FedPer,
    FedRep,
    FedYogi,
    Local,
    ServerOptimizer,
)
from lightning_fedrep.federation.api.declared import ServerTensors
from lightning_fedrep.federation.api.exchange import ServerState
from lightning_fedrep.privacy import ClientLevelDP
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 6, 4, 4, 3, 2
BETA1, BETA2, TAU = 0.9, 0.99, 1e-3
OPTIMIZERS = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}
SERVER_LR = {"adam": 0.1, "yogi": 0.01, "adagrad": 0.1}  # Flower's η, the package's defaults
HEAD = ("classifier.weight", "classifier.bias")


def full_batch_datamodule():
    """Every client's training data is one batch (80 samples each), so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


# ----------------------------------------------------------------------------- the reference, restated


def reference_server_step(rule, variant, x, mean, m, v, server_round):
    """Reddi et al. Algorithm 2 on one tensor, written out: Δ = mean - x, m = β1 m + (1 - β1) Δ, v by the rule,
    x + η m / (√v + τ); Flower's FedAdam scales η by √(1 - β2^(r+1)) / (1 - β1^(r+1)), r = 1, 2, ..."""
    delta = mean - x
    m = BETA1 * m + (1 - BETA1) * delta
    if rule == "adagrad":
        v = v + delta * delta
    elif rule == "yogi":
        v = v - (1 - BETA2) * delta * delta * torch.sign(v - delta * delta)
    else:
        v = BETA2 * v + (1 - BETA2) * delta * delta
    eta = SERVER_LR[rule]
    if variant == "flower" and rule == "adam":
        eta = eta * math.sqrt(1 - BETA2 ** (server_round + 1)) / (1 - BETA1 ** (server_round + 1))
    return x + eta * m / (torch.sqrt(v) + TAU), m, v


def train_client(init, start, x, y):
    """``LOCAL_EPOCHS`` full-batch steps of the module's own optimizer (SGD, momentum, weight decay) from ``start``."""
    model = copy.deepcopy(init)
    model.load_state_dict(start)
    optimizer = model.configure_optimizers()
    for _ in range(LOCAL_EPOCHS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def clipped(delta, clip):
    """A client's update scaled to flat L2 norm at most ``clip`` (over every shared tensor together)."""
    norm = torch.sqrt(sum(d.double().square().sum() for d in delta.values()))
    scale = min(1.0, clip / float(norm))
    return {k: d.double() * scale for k, d in delta.items()}


def plain_fedopt(init, dm, rule, variant="paper", shared=None, left_out=(), clip=None, rounds=ROUNDS):
    """FedAvg's clients (or FedPer's: only ``shared`` is averaged, each client keeps the rest) with the server
    step of ``rule``; ``left_out`` clients (a fault) are not in Δ; ``clip``: Δ is client-level DP's mean without
    noise (each client's delta clipped, summed, divided by the planned cohort). Returns the global shared
    tensors, m and v."""
    state = {k: v.clone() for k, v in init.state_dict().items()}
    shared = list(state) if shared is None else list(shared)
    heads = {}
    m = {k: torch.zeros_like(state[k]) for k in shared}
    v = {k: torch.full_like(state[k], TAU**2 if variant == "paper" else 0.0) for k in shared}
    for r in range(rounds):
        total = {k: torch.zeros_like(state[k], dtype=torch.float64) for k in shared}
        weight = 0.0
        cohort = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)
        for client in cohort:
            if client in left_out:
                continue
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            start = {**state, **heads.get(client, {})}
            end = train_client(init, start, x, y)
            heads[client] = {k: end[k] for k in end if k not in shared}
            if clip is not None:
                for k, d in clipped({k: end[k] - state[k] for k in shared}, clip).items():
                    total[k] += d
                weight = float(len(cohort))
                continue
            for k in shared:
                total[k] += end[k].double() * len(x)
            weight += len(x)
        if clip is not None:
            mean = {k: (state[k].double() + total[k] / weight).float() for k in shared}
        else:
            mean = {k: (total[k] / weight).float() for k in shared}
        for k in shared:
            state[k], m[k], v[k] = reference_server_step(rule, variant, state[k], mean[k], m[k], v[k], r + 1)
    return {k: state[k] for k in shared}, m, v, heads


# ----------------------------------------------------------------------------- the library's run


def fit(algorithm, runner="sequential", rounds=ROUNDS, init=None, dm=None, trainer_kwargs=None, **settings):
    torch.manual_seed(0)
    init = LossNet() if init is None else init
    dm = full_batch_datamodule() if dm is None else dm
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
        **settings,
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, **(trainer_kwargs or {})
    )
    trainer.fit(copy.deepcopy(init), datamodule=dm)
    return strategy, init, dm


def assert_matches(strategy, expected, m=None, v=None):
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    tensors = strategy.federation.server_tensors
    for prefix, reference in (("fedopt_m.", m or {}), ("fedopt_v.", v or {})):
        for name, value in reference.items():
            torch.testing.assert_close(tensors[prefix + name], value, rtol=1e-5, atol=1e-7, msg=prefix + name)


def optimizer(rule, variant):
    return OPTIMIZERS[rule](variant=variant)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
@pytest.mark.parametrize("variant", ["paper", "flower"])
@pytest.mark.parametrize("rule", ["adam", "yogi", "adagrad"])
def test_fedopt_equals_a_plain_loop(rule, variant, runner):
    """Golden test, both initializations, both runners: FedAvg's clients (4 of 6 a round, sample-weighted) with
    the server step of ``rule``; the global model, m and v equal the hand-written loop's after 3 rounds (and the
    step matters: plain FedAvg differs). The planted bugs below show which details it pins."""
    algorithm = FedAvg().with_server_optimizer(optimizer(rule, variant))
    strategy, init, dm = fit(algorithm, runner)
    assert strategy.runner_report.runner == runner
    dm.setup()
    expected, m, v, _ = plain_fedopt(init, dm, rule, variant)
    assert_matches(strategy, expected, m, v)
    assert int(strategy.federation.server_tensors["fedopt_steps"]) == ROUNDS
    fedavg, *_ = fit("fedavg", runner)
    assert any(not torch.allclose(fedavg.global_tensors()[k], t, atol=1e-3) for k, t in expected.items())


class NoBiasCorrection(FedAdam):
    bias_correction = False


class ZeroStart(FedAdam):
    def server_tensors(self):
        m, v, steps = super().server_tensors()
        return m, ServerTensors(v.name, like="shared"), steps


class YogiAsAdam(FedYogi):
    def second_moment(self, v, square):
        return self.beta2 * v + (1 - self.beta2) * square


class AdamOnAdagrad(FedAdagrad):
    def second_moment(self, v, square):
        return self.beta2 * v + (1 - self.beta2) * square


@pytest.mark.parametrize(
    "broken, rule, variant",
    [
        (NoBiasCorrection(variant="flower"), "adam", "flower"),  # Flower's η correction dropped
        (ZeroStart(), "adam", "paper"),  # v from 0 instead of τ² (Flower's start under the paper's name)
        (YogiAsAdam(), "yogi", "paper"),  # Yogi's additive sign rule replaced by Adam's decay
        (AdamOnAdagrad(), "adagrad", "paper"),  # Adagrad's sum replaced by Adam's average
    ],
    ids=["no-bias-correction", "v-from-zero", "yogi-as-adam", "adagrad-as-adam"],
)
def test_the_golden_test_catches_a_planted_bug(broken, rule, variant):
    """Each broken optimizer (one detail of the rule changed) runs through the library; the golden comparison
    with the plain loop of the right rule must fail."""
    strategy, init, dm = fit(FedAvg().with_server_optimizer(broken))
    dm.setup()
    expected, m, v, _ = plain_fedopt(init, dm, rule, variant)
    with pytest.raises(AssertionError):
        assert_matches(strategy, expected, m, v)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedper_with_fedadam_steps_only_the_shared_body(runner):
    """Composition: FedPer's clients keep their heads; FedAdam steps the averaged body; m and v exist for the
    body's tensors only. Fails if the optimizer touches a per-client tensor or declares state for one."""
    algorithm = FedPer().with_server_optimizer(FedAdam())
    assert algorithm.name == "fedper_fedadam" and isinstance(algorithm, FedPer)
    strategy, init, dm = fit(algorithm, runner, head="classifier")
    dm.setup()
    body = [k for k in init.state_dict() if k not in HEAD]
    expected, m, v, heads = plain_fedopt(init, dm, "adam", shared=body)
    assert_matches(strategy, expected, m, v)
    moments = {n for n in strategy.federation.server_tensors if n != "fedopt_steps"}
    assert moments == {f"fedopt_{s}.{k}" for s in "mv" for k in body}
    for client, head in heads.items():
        for name in HEAD:
            torch.testing.assert_close(
                strategy.client_state_dict(client)[name], head[name], rtol=1e-5, atol=1e-6, msg=name
            )


def test_a_failing_client_is_left_out_of_the_delta():
    """Δ is over the round's surviving clients: client 2's data is NaN (it is sampled in rounds 0 and 1),
    so it is left out, and the run equals the loop without it."""
    dm = full_batch_datamodule()
    dm.setup()
    bad = dm.client_data(2)
    bad.dataset.tensors[0][bad.indices] = float("nan")
    assert any(2 in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r) for r in range(ROUNDS))
    with pytest.warns(UserWarning):
        strategy, init, _ = fit(FedAvg().with_server_optimizer(FedYogi()), dm=dm)
    expected, m, v, _ = plain_fedopt(init, dm, "yogi", left_out=(2,))
    assert_matches(strategy, expected, m, v)


def test_fedadam_steps_from_client_level_dps_private_mean():
    """ClientLevelDP aggregates (clipped deltas over the planned cohort); FedAdam post-processes the private
    mean. Without noise, 3 rounds equal the loop; with noise, one round's FedAdam step is the reference step
    from the global model a noisy FedAvg round releases (the same noise: seeded by the seed and the round)."""
    dp = {"weighting": "uniform"}
    private = ClientLevelDP(clip=0.05, noise_multiplier=0.0, accountant=None)
    strategy, init, dm = fit(FedAvg().with_server_optimizer(FedAdam()), privacy=private, **dp)
    dm.setup()
    expected, m, v, _ = plain_fedopt(init, dm, "adam", clip=0.05)
    assert_matches(strategy, expected, m, v)
    noisy = dict(clip=0.05, noise_multiplier=1.0, accountant=None)
    released, _, _ = fit("fedavg", rounds=1, privacy=ClientLevelDP(**noisy), **dp)
    stepped, _, _ = fit("fedadam", rounds=1, privacy=ClientLevelDP(**noisy), **dp)
    start = init.state_dict()
    for name, mean in released.global_tensors().items():
        zero = torch.zeros_like(mean)
        value, _, _ = reference_server_step("adam", "paper", start[name], mean, zero, zero + TAU**2, 1)
        torch.testing.assert_close(stepped.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_mid_round_checkpoint_resumes_to_the_same_result(tmp_path):
    """Fit 3 rounds saving every 3 steps; resume from a checkpoint in the middle of round 1: the global model
    and m, v, the step count equal the uninterrupted run's exactly. Fails if the optimizer's state is not
    declared (not saved) or is rebuilt from τ² on resume."""
    full, _, _ = fit(FedAvg().with_server_optimizer(FedAdam(variant="flower")))
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(
        FedAvg().with_server_optimizer(FedAdam(variant="flower")),
        trainer_kwargs={"callbacks": [saver], "enable_checkpointing": True},
    )
    ckpt = tmp_path / "step=12.ckpt"  # round 1 (steps 8..15: four clients of two steps), mid-round
    saved = torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]
    assert saved["round"]["open"] and int(saved["server"]["fedopt_steps"]) == 1  # one step taken
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=FedAvg().with_server_optimizer(FedAdam(variant="flower")),
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        LossNet(), datamodule=full_batch_datamodule(), ckpt_path=ckpt
    )
    for name, value in full.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)


def test_by_name_fedavg_with_each_optimizer_and_its_defaults():
    """``Trainer(strategy="fedadam")`` (and ``_ddp``) is FedAvg with FedAdam(η 0.1); FedYogi's η is 0.01, FedAdagrad's
    0.1; β1 0.9, β2 0.99, τ 1e-3 and the paper's start everywhere."""
    for name, cls, lr in (
        ("fedadam", FedAdam, 0.1),
        ("fedyogi", FedYogi, 0.01),
        ("fedadagrad", FedAdagrad, 0.1),
    ):
        algorithm = ALGORITHMS[name]
        assert isinstance(algorithm, FedAvg) and algorithm.shares == {"body", "head"}
        opt = algorithm.server_optimizer
        assert type(opt) is cls
        assert (opt.lr, opt.beta1, opt.beta2, opt.tau, opt.variant) == (lr, 0.9, 0.99, 1e-3, "paper")
        assert f"{name}_ddp" in StrategyRegistry
    assert ALGORITHMS["fedavg"].server_optimizer is None  # the registered FedAvg is not changed


def test_with_server_optimizer_keeps_the_algorithm_and_refuses_bad_input():
    fedrep = FedRep()
    composed = fedrep.with_server_optimizer(FedYogi(lr=0.05), name="my_fedyogi_rep")
    assert composed.name == "my_fedyogi_rep" and type(composed) is FedRep and fedrep.server_optimizer is None
    assert fedrep.server_tensors == () and [s.name for s in composed.server_tensors][-1] == "fedopt_steps"
    with pytest.raises(TypeError, match="takes a ServerOptimizer"):
        fedrep.with_server_optimizer("fedadam")
    with pytest.raises(ValueError, match="already steps with FedYogi"):
        composed.with_server_optimizer(FedAdam())
    with pytest.raises(ValueError, match="shares nothing"):
        Local().with_server_optimizer(FedAdam())

    class Momentum(ServerOptimizer):
        def server_tensors(self):
            return (ServerTensors("fedopt_m", like="shared"),)

    colliding = FedAvg()
    colliding.server_tensors = (ServerTensors("fedopt_m", like="shared"),)
    with pytest.raises(ValueError, match=r"declares server tensors named \['fedopt_m'\]"):
        colliding.with_server_optimizer(Momentum())


class ForgetfulStep(ServerOptimizer):
    """A server optimizer whose step drops the shared tensors."""

    def step(self, server, new):
        return ServerState(shared={}, tensors=new.tensors, num_clients=new.num_clients), {}


def test_a_step_that_drops_tensors_is_refused_naming_it():
    """The round checks the optimizer's return as it checks ``aggregate``'s, naming the optimizer."""
    with pytest.raises(KeyError, match=r"ForgetfulStep\.step returned shared tensors \[\]"):
        fit(FedAvg().with_server_optimizer(ForgetfulStep()), rounds=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": 0.0}, r"FedAdam\(lr=...\) must be a number > 0"),
        ({"beta1": 1.0}, r"FedAdam\(beta1=...\)"),
        ({"beta2": -0.1}, r"FedAdam\(beta2=...\)"),
        ({"tau": 0.0}, r"FedAdam\(tau=...\)"),
        ({"variant": "pfllib"}, r"FedAdam\(variant=...\) must be one of 'paper', 'flower'"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FedAdam(**kwargs)


def test_fedadam_under_client_level_dp_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedAdam under client-level DP (``tests/scripts/algorithms_run.py``'s ``fedadam_dp``), 2 rounds: the model,
    every client and the optimizer's m, v and step count on 2 processes equal the 1-process run bit for bit. Fails
    if the step ran on one rank's partial sums or its state diverged between ranks."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    single = singles["fedadam_dp"]
    assert int(single["server"]["fedopt_steps"]) == 2
    for held in (rank["fedadam_dp"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        assert held["server"].keys() == single["server"].keys()
        for name, value in single["server"].items():
            assert torch.equal(held["server"][name], value), name
