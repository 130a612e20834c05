"""FedProx (``lightning_fedrep.federation.algorithms.fedprox``) against a plain PyTorch loop of FedAvg plus
the proximal term, on both runners; by name through the Trainer; the lockstep runner under ``runner="auto"``."""

import copy
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy, FedProx, LossTerm, Objective
from lightning_fedrep.runners.lockstep import sizing
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 6, 4, 4, 3, 2


def full_batch_datamodule():
    """Every client's training data is one batch (80 samples each), so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def plain_fedprox(init, dm, mu):
    """FedAvg with ``mu/2 ||w - w_round_start||^2`` on every parameter, written out: SGD (the module's own
    momentum and weight decay) on each sampled client's whole data for ``LOCAL_EPOCHS`` steps, then the
    sample-weighted mean (float64)."""
    global_state = {k: v.clone() for k, v in init.state_dict().items()}
    for r in range(ROUNDS):
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}
        weight = 0.0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            model = copy.deepcopy(init)
            model.load_state_dict(global_state)
            optimizer = model.configure_optimizers()
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                prox = sum((p - global_state[n]).pow(2).sum() for n, p in model.named_parameters())
                (F.cross_entropy(model(x), y) + mu / 2 * prox).backward()
                optimizer.step()
            for k, v in model.state_dict().items():
                total[k] += v.double() * len(x)
            weight += len(x)
        global_state = {k: (v / weight).float() for k, v in total.items()}
    return global_state


def fit(runner, algorithm, **trainer_kwargs):
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    strategy = FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    model = copy.deepcopy(init)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0, **trainer_kwargs).fit(
        model, datamodule=dm
    )
    return strategy, init, dm


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_fedprox_equals_a_plain_loop_on_both_runners(runner):
    """Golden test. Fails if the term drops the 1/2 (``mu * distance``), pulls towards the live tensors
    instead of the round-start global ones (``view.trained[n].detach()``: no pull), or is not applied on
    one of the runners."""
    mu = 0.5
    strategy, init, dm = fit(runner, FedProx(mu=mu))
    assert strategy.runner_report.runner == runner
    dm.setup()
    expected = plain_fedprox(init, dm, mu)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    fedavg = plain_fedprox(init, dm, 0.0)  # the term matters at this mu
    assert any(not torch.allclose(expected[k], fedavg[k], atol=1e-4) for k in expected)


def test_fedprox_by_name_is_fedprox_with_the_official_mu():
    """``Trainer(strategy="fedprox")`` runs FedProx(mu=0.1), the official FedRep code's default."""
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    trainer = quiet_trainer(strategy="fedprox", max_epochs=1, limit_val_batches=0)
    trainer.fit(copy.deepcopy(init), datamodule=dm)
    assert isinstance(trainer.strategy.algorithm, FedProx) and trainer.strategy.algorithm.mu == 0.1
    assert "fedprox_ddp" in __import__("lightning").pytorch.strategies.StrategyRegistry


def _lockstep_wins(monkeypatch):
    """Make the auto timing say lockstep is faster (timings are not for tests)."""
    monkeypatch.setattr(
        sizing, "faster_lane_width", lambda wide, narrow, device, **kwargs: (True, 1e-3, 2e-3)
    )


def test_auto_runs_fedprox_on_the_lockstep_runner(monkeypatch):
    """Fails if the proximal term is marked ``vmappable=False`` (``runner="auto"`` would then run it
    sequentially), or if an algorithm's term again forces the sequential runner."""
    _lockstep_wins(monkeypatch)
    strategy, _, _ = fit("auto", FedProx(mu=0.5), max_steps=-1)
    assert strategy.runner_report.runner == "vectorized", strategy.runner_report


class SequentialFedProx(FedProx):
    def objective(self, phase):
        (term,) = super().objective(phase).terms
        return Objective(terms=(replace(term, vmappable=False),))


def test_a_term_that_cannot_be_vmapped_falls_back_naming_it(monkeypatch):
    """The fallback reason names the term (``runner="auto"``), and ``runner="vectorized"`` refuses it."""
    _lockstep_wins(monkeypatch)
    strategy, _, _ = fit("auto", SequentialFedProx(mu=0.5))
    report = strategy.runner_report
    assert report.runner == "sequential" and "FedProx proximal term" in report.reason, report
    with pytest.raises(ValueError, match="FedProx proximal term cannot run in lockstep"):
        fit("vectorized", SequentialFedProx(mu=0.5))


@pytest.mark.parametrize("mu", [-0.1, float("nan"), "0.1"])
def test_bad_mu_is_refused(mu):
    with pytest.raises((ValueError, TypeError), match="mu"):
        FedProx(mu=mu)


def test_loss_term_needs_features_of():
    with pytest.raises(ValueError, match="features_of"):
        Objective(terms=(LossTerm(lambda view: None, "t", needs_features=True),))


def test_fedprox_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedProx (``tests/scripts/algorithms_run.py``, mu=0.1), 2 rounds: the model and every client's tensors
    on 2 processes equal the 1-process run bit for bit (and differ from FedAvg's). Fails when the ranks'
    uploads are not summed across processes (``WeightedMean.reduce`` loading its own ``flat()`` instead of
    ``collective.all_reduce_sum(self.flat())``: each rank averages only its own clients)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch for this file and two others
    single, fedavg = singles["fedprox"], singles["fedavg"]
    assert any(not torch.equal(fedavg["global"][n], t) for n, t in single["global"].items())  # the term acts
    for held in (rank["fedprox"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
