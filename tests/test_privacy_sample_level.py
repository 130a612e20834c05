"""Sample-level DP (``FederatedStrategy(privacy=SampleLevelDP(...))``): DP-SGD in every local step, against
independent references.

The step is ``(sum_i clip_C(grad_i) + N(0, (z C)^2 I)) / E[|batch|]`` on the trained tensors. Each test compares
with something computed apart from the mechanism: a per-example autograd loop and Opacus's own ``DPOptimizer``
for the clipped sum, the noise's std on a large layer, the sequential runner for the vectorized one, Opacus's
``RDPAccountant`` for every client's ε, the uninterrupted run for a resumed one, one process for two.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.federation.api.epochs import epoch_settings
from lightning_fedrep.federation.api.objective import LossTerm, Objective, StepView, pure_loss
from lightning_fedrep.privacy import SampleLevelDP
from lightning_fedrep.privacy.dp_sgd import dp_sgd_step
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

try:
    import opacus  # noqa: F401

    EXTRA = True
except ImportError:
    EXTRA = False
"""Whether the ``privacy`` extra is installed: the accounting tests and the Opacus references need it."""

needs_extra = pytest.mark.skipif(not EXTRA, reason="needs the privacy extra (opacus)")


class LossNet(TinyNet):
    """TinyNet declaring its per-sample loss (what DP-SGD differentiates per example)."""

    fedrep_loss = "cross_entropy"


def fit(model=None, privacy=None, rounds=2, runner="sequential", algorithm="fedrep", ckpt=None, **kw):
    strategy = FederatedStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=kw.pop("clients", 4),
        **epoch_settings(algorithm, head_epochs=1),
        weighting=kw.pop("weighting", "uniform"),
        privacy=privacy,
        seed=3,
        runner=runner,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **kw)
    torch.manual_seed(0)
    model = model if model is not None else LossNet(momentum=0.0, weight_decay=0.0)
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=8, seed=1, batch_size=8), ckpt_path=ckpt)
    return strategy


def dp(**kwargs) -> SampleLevelDP:
    return SampleLevelDP(**{"accountant": "rdp" if EXTRA else None, **kwargs})


# ---------------------------------------------------------------------------------------------- the step


def _view(model: nn.Module, client: int = 0, step: int = 0, mask=None) -> StepView:
    tensors = dict(model.named_parameters())
    detached = {n: t.detach() for n, t in tensors.items()}
    return StepView(
        tensors=detached,
        trained=detached,
        server={},
        client=torch.tensor(client),
        phase="all",
        round=0,
        step=step,
        client_step=step,
        mask=mask,
    )


def _batch(n: int = 9, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def test_the_noiseless_step_is_the_mean_of_per_example_clipped_gradients():
    """Without noise the step's gradient is ``sum_i clip_C(g_i) / E``: each example's gradient by autograd, one
    example at a time, clipped to the flat norm C over every trained tensor (some examples above the clip, some
    below), summed and divided by the client's expected batch size."""
    torch.manual_seed(0)
    model = LossNet()
    x, y = _batch()
    clip, expected = 1.15, torch.tensor([5.0, 12.0])
    outcome = dp_sgd_step(
        pure_loss(model, F.cross_entropy), _view(model, client=1), x, y,
        clip=clip, noise_multiplier=0.0, expected_batch=expected, seed=0,
    )  # fmt: skip
    reference = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        norms.append(norm.item())
        for n, g in grads.items():
            reference[n] += g * min(1.0, clip / (norm.item() + 1e-6))
    assert min(norms) < clip < max(norms)  # the clip bites on some examples only
    for n, g in outcome.grads.items():
        torch.testing.assert_close(g, reference[n] / 12.0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(outcome.loss, F.cross_entropy(model(x), y).detach(), rtol=1e-5, atol=1e-6)


@needs_extra
def test_the_noiseless_step_equals_opacus_dp_optimizer():
    """Opacus's own DP-SGD (``GradSampleModule`` + ``DPOptimizer``, noise multiplier 0, ``expected_batch_size``)
    leaves the same gradient on every parameter as the step rule."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(1)
    model = LossNet()
    x, y = _batch(12, seed=2)
    outcome = dp_sgd_step(
        pure_loss(model, F.cross_entropy), _view(model), x, y,
        clip=0.5, noise_multiplier=0.0, expected_batch=torch.tensor([8.0]), seed=0,
    )  # fmt: skip
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(
        torch.optim.SGD(wrapped.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        expected_batch_size=8,
    )
    F.cross_entropy(wrapped(x), y).backward()
    optimizer.pre_step()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(outcome.grads[name], parameter.grad, rtol=1e-5, atol=1e-7)


def test_the_noise_has_std_z_clip_over_the_expected_batch():
    """On a 40,000-weight layer, the step with noise minus the step without is Gaussian of std ``z C / E``
    (within 2%), mean 0; padding rows (mask 0) add nothing."""
    model = nn.Sequential(nn.Linear(200, 200))
    loss = pure_loss(model, F.cross_entropy)
    x, y = torch.randn(6, 200), torch.randint(0, 200, (6,))
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    kwargs = dict(clip=0.3, expected_batch=torch.tensor([4.0]), seed=9)
    noisy = dp_sgd_step(loss, _view(model, mask=mask), x, y, noise_multiplier=1.5, **kwargs).grads
    clean = dp_sgd_step(loss, _view(model, mask=mask), x, y, noise_multiplier=0.0, **kwargs).grads
    difference = noisy["0.weight"] - clean["0.weight"]
    assert difference.std().item() == pytest.approx(1.5 * 0.3 / 4.0, rel=0.02)
    assert abs(difference.mean().item()) < 4 * 1.5 * 0.3 / 4.0 / 200
    real = dp_sgd_step(loss, _view(model), x[:4], y[:4], noise_multiplier=0.0, **kwargs).grads
    torch.testing.assert_close(clean["0.weight"], real["0.weight"], rtol=1e-6, atol=1e-8)


def test_an_empty_poisson_batch_releases_noise_only():
    """A step whose Poisson batch drew no example still releases (the noise alone): its gradient is pure noise."""
    model = nn.Linear(6, 4)
    x, y = torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)
    outcome = dp_sgd_step(
        pure_loss(model, F.cross_entropy), _view(model), x, y,
        clip=1.0, noise_multiplier=1.0, expected_batch=torch.tensor([2.0]), seed=0,
    )  # fmt: skip
    assert outcome.grads["weight"].abs().sum() > 0 and outcome.loss.item() == 0.0


# ---------------------------------------------------------------------------------------------- the runners


def test_the_vectorized_runner_trains_what_the_sequential_runner_trains():
    """FedRep (head then body phases) under DP-SGD with noise: the vectorized runner (clients x examples in one
    ``vmap``) gives the sequential runner's body and heads, the same noise included (keyed by client and step)."""
    runs = {
        r: fit(privacy=dp(clip=0.5, noise_multiplier=1.0), runner=r) for r in ("sequential", "vectorized")
    }
    assert runs["vectorized"].runner_report.runner == "vectorized"
    ours, reference = (runs[r].federation for r in ("vectorized", "sequential"))
    for name, value in reference.global_tensors().items():
        torch.testing.assert_close(ours.global_tensors()[name], value, rtol=1e-5, atol=1e-6)
    for client in range(8):
        for name, value in reference.client_tensors(client).items():
            torch.testing.assert_close(ours.client_tensors(client)[name], value, rtol=1e-5, atol=1e-6)
    noiseless = fit(
        privacy=SampleLevelDP(clip=0.5, noise_multiplier=0.0, accountant=None), runner="sequential"
    )
    assert not torch.allclose(
        noiseless.federation.global_tensors()["body.0.weight"], reference.global_tensors()["body.0.weight"]
    )


def test_fedprox_proximal_term_is_added_after_the_noise_on_both_runners():
    """FedProx's proximal term reads only the parameters: its gradient joins the private one (unclipped); the
    runners agree, and the run differs from FedAvg's under the same noise."""
    runs = {
        r: fit(privacy=dp(clip=0.5, noise_multiplier=0.5), runner=r, algorithm="fedprox")
        for r in ("sequential", "vectorized")
    }
    for name, value in runs["sequential"].federation.global_tensors().items():
        torch.testing.assert_close(
            runs["vectorized"].federation.global_tensors()[name], value, rtol=1e-5, atol=1e-6
        )
    fedavg = fit(privacy=dp(clip=0.5, noise_multiplier=0.5), algorithm="fedavg")
    assert not torch.allclose(
        fedavg.federation.global_tensors()["body.0.weight"],
        runs["sequential"].federation.global_tensors()["body.0.weight"],
    )


# ---------------------------------------------------------------------------------------------- accounting


@needs_extra
def test_every_clients_epsilon_is_opacus_rdp_of_its_own_steps():
    """Each client's ε equals Opacus's ``RDPAccountant`` fed that client's history, ``(z, min(1, B / n_c), T_c)``
    with ``T_c`` the local steps of the rounds that planned it; the history's ``privacy/epsilon`` is the worst."""
    from opacus.accountants import RDPAccountant

    mechanism = dp(clip=0.5, noise_multiplier=1.1)
    strategy = fit(privacy=mechanism, rounds=3)
    sizes = strategy.federation.state.client_sizes
    steps = {c: 0 for c in range(8)}
    for r in range(3):
        for work in strategy.round_plan(r).work:
            steps[work.client] += work.steps
    expected = {}
    for client, count in steps.items():
        if count:
            accountant = RDPAccountant()
            accountant.history = [(1.1, min(1.0, 8 / sizes[client]), count)]
            expected[client] = accountant.get_epsilon(delta=1e-5)
    assert mechanism.last_epsilons == pytest.approx(expected, rel=1e-9)
    assert strategy.federation.history.rows[-1]["privacy/epsilon"] == pytest.approx(max(expected.values()))
    described = mechanism.describe()
    assert described["unit"] == "example" and described["worst_epsilon"] == pytest.approx(
        max(expected.values())
    )


@needs_extra
def test_target_epsilon_is_met_by_every_client_and_a_round_beyond_is_refused():
    """``target_epsilon=2`` over 2 rounds of every client: the solved noise keeps the worst client at most 2 and
    close to it (within 3%); a third round would spend more and is refused before it trains."""
    mechanism = dp(clip=0.5, target_epsilon=2.0, rounds=2)
    strategy = fit(privacy=mechanism, rounds=2, clients=8)
    worst = strategy.federation.history.rows[-1]["privacy/epsilon"]
    assert 0.97 * 2.0 <= worst <= 2.0
    with pytest.raises(RuntimeError, match="covers 2 rounds"):
        fit(privacy=dp(clip=0.5, target_epsilon=2.0, rounds=2), rounds=3, clients=8)


@needs_extra
def test_a_run_resumed_mid_round_equals_the_uninterrupted_run(tmp_path):
    """A mid-round checkpoint: the resumed run's body, heads and every round's ε equal the uninterrupted run's bit
    for bit (the noise is keyed, the clients' step counts are in the checkpoint)."""

    def run(root, ckpt=None, callbacks=()):
        return fit(
            privacy=dp(clip=0.5, noise_multiplier=1.0), rounds=3, ckpt=ckpt, callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks), default_root_dir=root,
        )  # fmt: skip

    full = run(tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=7, save_top_k=-1, filename="{step}")
    first = run(tmp_path / "a", callbacks=[saver])
    ends = set(torch.tensor([first.round_plan(r).length for r in range(3)]).cumsum(0).tolist())
    steps = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ck").glob("step=*.ckpt"))
    mid = [s for s in steps if s not in ends and s > min(ends)]
    assert mid, (steps, ends)
    resumed = run(tmp_path / "b", ckpt=tmp_path / "ck" / f"step={mid[0]}.ckpt")
    for x, y in zip(full.federation.global_state, resumed.federation.global_state):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    epsilons = [row["privacy/epsilon"] for row in full.federation.history.rows]
    assert epsilons == [row["privacy/epsilon"] for row in resumed.federation.history.rows]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0


def test_two_processes_train_what_one_trains(tmp_path_factory):
    """FedRep under sample-level DP (``tests/scripts/algorithms_run.py``'s ``fedrep_sample_dp``) on 2 gloo
    processes: the body and every head equal the 1-process run's (a client's noise does not depend on its rank)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)
    for held in (rank["fedrep_sample_dp"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(singles["fedrep_sample_dp"], held)


# ---------------------------------------------------------------------------------------------- refusals


def test_sample_weighting_is_refused():
    with pytest.raises(ValueError, match="needs weighting='uniform'.*example count"):
        FederatedStrategy(head="classifier", weighting="samples", privacy=dp(clip=1.0, noise_multiplier=1.0))


class NormNet(LossNet):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU()
        )


class UndeclaredNet(TinyNet):
    pass


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (NormNet, r"body\.1 \(BatchNorm1d\) mix the examples.*GroupNorm.*ModuleValidator\.fix"),
        (UndeclaredNet, "declares none: set fedrep_loss"),
    ],
)
def test_modules_it_cannot_privatize_are_refused_at_setup(model, match):
    with pytest.raises(ValueError, match=match):
        fit(model(), privacy=dp(clip=1.0, noise_multiplier=1.0), rounds=1)


def test_an_algorithm_with_its_own_step_rule_is_refused():
    with pytest.raises(ValueError, match="step rule 'Per-FedAvg maml step'.*cannot be combined"):
        fit(privacy=dp(clip=1.0, noise_multiplier=1.0), rounds=1, algorithm="per_fedavg")


def test_a_loss_term_reading_the_features_is_refused():
    mechanism = dp(clip=1.0, noise_multiplier=1.0)
    term = LossTerm(
        lambda view: view.features.sum(), "feature_penalty", needs_features=True, features_of="classifier"
    )
    with pytest.raises(ValueError, match=r"loss terms \['feature_penalty'\]: they read the batch"):
        mechanism.local_objective(Objective(terms=(term,)), "all")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, "clip"),
        ({"clip": 1.0}, "exactly one of noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "target_epsilon": 1.0}, "exactly one of noise_multiplier"),
        ({"clip": 1.0, "target_epsilon": 1.0, "accountant": None}, "rounds="),
        ({"clip": 1.0, "noise_multiplier": 0.0, "accountant": "rdp"}, "epsilon is infinite"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "accountant": "pld"}, "accountant"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SampleLevelDP(**kwargs)


def test_the_clients_batches_are_poisson_samples_under_the_mechanism():
    """The strategy switches the round loader to Poisson batches (what the accounting assumes): the loader
    Lightning iterated samples that way, at each client's rate ``min(1, B / n)``."""
    strategy = FederatedStrategy(
        head="classifier", head_epochs=1, weighting="uniform", privacy=dp(clip=1.0, noise_multiplier=1.0)
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    datamodule = tiny_datamodule(num_clients=8, seed=1, batch_size=8)
    trainer.fit(LossNet(), datamodule=datamodule)
    loader = trainer.train_dataloader
    assert loader.sampling == "poisson"
    sizes = loader.client_sizes()
    assert [loader.sample_rate(c) for c in range(8)] == [min(1.0, 8 / n) for n in sizes]
