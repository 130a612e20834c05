"""SCAFFOLD (``lightning_fedrep.federation.algorithms.scaffold``) against a plain PyTorch loop written from the
official FedRep code's variant (design §6.1): the correction as the linear loss term <w, c - c_i>, the
gradient-norm clip after it, c_i+ = c_i - c + (w_glob - w_i)/(K lr), w += lr_g/m sum(w_i - w), c += sum dc/n."""

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy, LossTerm, Objective, Scaffold
from lightning_fedrep.runners.lockstep import sizing
from tests.fixtures import quiet_trainer, reference_clients, tiny_datamodule
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS = 6, 4, 4, 3, 3
LR_G, CLIP = 0.7, 0.05


def full_batch_datamodule():
    """Every client's training data is one batch, so batch order is irrelevant."""
    return tiny_datamodule(num_clients=NUM_CLIENTS, batch_size=256, seed=3)


def plain_scaffold(init, dm, clip=CLIP, lr_g=LR_G):
    """SCAFFOLD written out: per sampled client, the module's own SGD on CE + sum <w, c - c_i>, the gradient
    clipped with torch's clip_grad_norm_, LOCAL_EPOCHS full-batch steps; then the server step."""
    w = {k: v.detach().clone() for k, v in init.named_parameters()}
    c = {k: torch.zeros_like(v) for k, v in w.items()}
    c_i = {i: {k: torch.zeros_like(v) for k, v in w.items()} for i in range(NUM_CLIENTS)}
    for r in range(ROUNDS):
        clients = reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r)
        dy = {k: torch.zeros_like(v) for k, v in w.items()}
        dc = {k: torch.zeros_like(v) for k, v in w.items()}
        for client in clients:
            model = copy.deepcopy(init)
            model.load_state_dict(w, strict=False)
            optimizer = model.configure_optimizers()
            lr = optimizer.param_groups[0]["lr"]
            data = dm.client_data(client)
            x, y = (t[data.indices] for t in data.dataset.tensors)
            for _ in range(LOCAL_EPOCHS):
                optimizer.zero_grad()
                linear = sum((p * (c[n] - c_i[client][n])).sum() for n, p in model.named_parameters())
                (F.cross_entropy(model(x), y) + linear).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
            end = {n: p.detach() for n, p in model.named_parameters()}
            new = {n: c_i[client][n] - c[n] + (w[n] - end[n]) / (LOCAL_EPOCHS * lr) for n in w}
            for n in w:
                dy[n] += end[n] - w[n]
                dc[n] += new[n] - c_i[client][n]
            c_i[client] = new
        w = {n: w[n] + lr_g / len(clients) * dy[n] for n in w}
        c = {n: c[n] + dc[n] / NUM_CLIENTS for n in w}
    return w, c, c_i


def fit(algorithm, runner="sequential", strategy=None, **trainer_kwargs):
    torch.manual_seed(0)
    init = LossNet()
    dm = full_batch_datamodule()
    strategy = strategy or FederatedStrategy(
        algorithm=algorithm, clients_per_round=PER_ROUND, seed=SEED, local_epochs=LOCAL_EPOCHS, runner=runner
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0, **trainer_kwargs).fit(
        copy.deepcopy(init), datamodule=dm
    )
    dm.setup()
    return strategy, init, dm


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_scaffold_equals_a_plain_loop_on_both_runners(runner):
    """Golden test. Fails if the clip comes before the correction, the correction's sign is flipped
    (``c_i - c``), c_i+ drops ``- c``, or the server divides dc by m instead of n or ignores lr_g; in lockstep
    also if the clip is dropped or the group's gradients are clipped together (one norm over all clients'
    stacked gradients, the transform run outside the ``vmap``), or a client reads another's ``c_i``."""
    strategy, init, dm = fit(Scaffold(lr_g=LR_G, clip=CLIP), runner)
    assert strategy.runner_report.runner == runner
    w, c, c_i = plain_scaffold(init, dm)
    fed = strategy.federation
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(fed.server_tensors[f"c.{name}"], c[name], rtol=1e-4, atol=1e-5, msg=name)
        for client in range(NUM_CLIENTS):
            value = fed.store.client_state(client)[f"c_i.{name}"]
            torch.testing.assert_close(value, c_i[client][name], rtol=1e-4, atol=1e-5, msg=(client, name))
    unclipped, _, _ = plain_scaffold(init, dm, clip=1e9)  # the clip binds at this setting
    assert any(not torch.allclose(w[k], unclipped[k], atol=1e-4) for k in w)


def test_scaffold_by_name_has_the_official_defaults():
    """``Trainer(strategy="scaffold")`` is Scaffold(lr_g=0.1, clip=10): the official FedRep code's
    ``utils/options.py`` sets ``--lr_g`` default 0.1 and clips at 10. Fails with the old default lr_g=1."""
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy="scaffold", max_epochs=1, limit_val_batches=0)
    trainer.fit(LossNet(), datamodule=full_batch_datamodule())
    algorithm = trainer.strategy.algorithm
    assert isinstance(algorithm, Scaffold) and (algorithm.lr_g, algorithm.clip) == (0.1, 10.0)


def test_auto_runs_scaffold_on_the_lockstep_runner(monkeypatch):
    """Fails if the correction-and-clip transform is marked ``vmappable=False`` again (``runner="auto"``
    then runs SCAFFOLD sequentially). The timing is made to favour lockstep (timings are not for tests)."""
    monkeypatch.setattr(
        sizing, "faster_lane_width", lambda wide, narrow, device, **kwargs: (True, 1e-3, 2e-3)
    )
    strategy, _, _ = fit(Scaffold(lr_g=LR_G, clip=CLIP), "auto", max_steps=-1)
    assert strategy.runner_report.runner == "vectorized", strategy.runner_report


class LinearTermScaffold(Scaffold):
    """SCAFFOLD without the clip, its correction written as the loss term <w, c - c_i> (reads ``view.server``
    and ``view.client_state`` inside the lockstep runner's loss ``vmap``)."""

    def objective(self, phase):
        def linear(view):
            names = [n for n in view.trained if f"c.{n}" in view.server]
            return sum(
                (view.trained[n] * (view.server[f"c.{n}"] - view.client_state[f"c_i.{n}"])).sum()
                for n in names
            )

        return Objective(terms=(LossTerm(linear, "SCAFFOLD linear term"),))


def test_a_loss_term_reads_the_declared_tensors_in_lockstep_as_sequentially():
    """The lockstep loss ``vmap`` hands each client its own ``c_i`` row and the server's ``c``: the unclipped
    plain loop is matched. Fails if the loss path's StepView drops ``client_state`` (KeyError) or stacks the
    rows in another order than the segment's clients (``rows[::-1]``)."""
    strategy, init, dm = fit(LinearTermScaffold(lr_g=LR_G), "vectorized")
    assert strategy.runner_report.runner == "vectorized"
    w, _, c_i = plain_scaffold(init, dm, clip=1e9)
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-4, atol=1e-5, msg=name)
        for client in range(NUM_CLIENTS):
            value = strategy.federation.store.client_state(client)[f"c_i.{name}"]
            torch.testing.assert_close(value, c_i[client][name], rtol=1e-4, atol=1e-5, msg=(client, name))


@pytest.mark.parametrize("kwargs", [{"lr_g": -1.0}, {"clip": float("nan")}])
def test_bad_scaffold_settings_are_refused(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        Scaffold(**kwargs)
