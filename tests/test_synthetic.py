"""Tests of the synthetic low-rank linear problem, its metric, the matching model and the reference."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.fedrep.reference_linear import fedrep_linear_reference, subspace_distance
from lightning_fedrep.data.low_rank import make_low_rank_problem
from lightning_fedrep.data.subspace import method_of_moments_init, principal_angle_distance
from lightning_fedrep.models.linear import LowRankLinear


def _residuals(problem, datasets) -> torch.Tensor:
    """y - w_i*^T B*^T x for all samples of all clients, in float64."""
    parts = []
    for client, dataset in enumerate(datasets):
        x, y = (t.double() for t in dataset.tensors)
        theta = problem.ground_truth_body.double() @ problem.client_heads[client].double()
        parts.append(y.squeeze(1) - x @ theta)
    return torch.cat(parts)


def _uniform_sampler(num_clients: int, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda round_index: torch.randperm(num_clients, generator=generator)[:count].tolist()


# ----------------------------------------------------------------------------- problem generation


def test_shapes_and_dtypes():
    problem = make_low_rank_problem(
        dim=7, rank=3, num_clients=4, samples_per_client=5, test_samples_per_client=6
    )
    assert problem.ground_truth_body.shape == (7, 3)
    assert problem.client_heads.shape == (4, 3)
    assert len(problem.train) == len(problem.test) == 4
    for train, test in zip(problem.train, problem.test, strict=True):
        assert train.tensors[0].shape == (5, 7) and train.tensors[1].shape == (5, 1)
        assert test.tensors[0].shape == (6, 7) and test.tensors[1].shape == (6, 1)
        assert all(t.dtype == torch.float32 for t in train.tensors + test.tensors)
    assert (problem.dim, problem.rank, problem.num_clients) == (7, 3, 4)


def test_ground_truth_body_is_orthonormal():
    body = make_low_rank_problem(seed=3).ground_truth_body.double()
    torch.testing.assert_close(body.T @ body, torch.eye(2, dtype=torch.float64), atol=1e-6, rtol=0)


def test_client_heads_have_norm_sqrt_k():
    for rank in (1, 2, 5):
        heads = make_low_rank_problem(rank=rank, num_clients=50).client_heads
        torch.testing.assert_close(heads.norm(dim=1), torch.full((50,), math.sqrt(rank)), atol=1e-5, rtol=0)
        # Not all identical: the heads really are random directions.
        assert heads.std(dim=0).min() > 0.1 or rank == 1


@pytest.mark.parametrize("noise_std", [0.0, 1e-3, 0.1])
def test_label_noise_matches_noise_std(noise_std):
    problem = make_low_rank_problem(noise_std=noise_std, seed=1)  # 100 clients x (10 + 50) samples
    residuals = torch.cat([_residuals(problem, problem.train), _residuals(problem, problem.test)])
    assert residuals.numel() == 6000
    if noise_std == 0.0:
        assert residuals.abs().max() < 1e-5  # float32 rounding only
    else:
        assert residuals.std().item() == pytest.approx(noise_std, rel=0.05)
        assert residuals.mean().abs().item() < 5 * noise_std / math.sqrt(6000)
    # E[y^2] = ||B* w_i*||^2 + noise^2 = k + noise^2 for x ~ N(0, I).
    y = torch.cat([d.tensors[1] for d in problem.train + problem.test]).double()
    assert y.square().mean().item() == pytest.approx(2 + noise_std**2, rel=0.1)


def test_same_seed_same_data_different_seed_different_data():
    def tensors(problem):
        yield problem.ground_truth_body
        yield problem.client_heads
        for dataset in problem.train + problem.test:
            yield from dataset.tensors

    a, b, c = (make_low_rank_problem(num_clients=5, seed=s) for s in (11, 11, 12))
    assert all(torch.equal(s, t) for s, t in zip(tensors(a), tensors(b), strict=True))
    assert not any(torch.equal(s, t) for s, t in zip(tensors(a), tensors(c), strict=True))


def test_generation_does_not_touch_global_rng():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    make_low_rank_problem(num_clients=3)
    assert torch.equal(state, torch.get_rng_state())


def test_test_split_size_leaves_training_data_unchanged():
    a = make_low_rank_problem(num_clients=3, test_samples_per_client=5)
    b = make_low_rank_problem(num_clients=3, test_samples_per_client=50)
    for s, t in zip(a.train, b.train, strict=True):
        assert torch.equal(s.tensors[0], t.tensors[0]) and torch.equal(s.tensors[1], t.tensors[1])


def test_draw_gives_fresh_samples_of_the_client_model():
    problem = make_low_rank_problem(num_clients=3, noise_std=0.0)
    generator = torch.Generator().manual_seed(5)
    x1, y1 = problem.draw(2, 8, generator)
    x2, y2 = problem.draw(2, 8, generator)
    assert x1.shape == (8, 20) and y1.shape == (8, 1)
    assert not torch.equal(x1, x2)
    theta = problem.ground_truth_body @ problem.client_heads[2]
    torch.testing.assert_close(y2.squeeze(1), x2 @ theta, atol=1e-5, rtol=0)
    with pytest.raises(IndexError):
        problem.draw(3, 1, generator)


# ----------------------------------------------------------------------------- principal angle distance


def test_distance_is_zero_for_the_same_subspace_under_mixing():
    generator = torch.Generator().manual_seed(0)
    basis = torch.randn(20, 3, generator=generator)
    mixing = torch.randn(3, 3, generator=generator) + 3 * torch.eye(3)  # invertible
    assert principal_angle_distance(basis, basis) < 1e-7
    assert principal_angle_distance(basis @ mixing, basis) < 1e-6
    assert principal_angle_distance(basis, basis @ mixing) < 1e-6


def test_distance_is_one_for_orthogonal_subspaces():
    eye = torch.eye(6)
    assert principal_angle_distance(eye[:, :2], eye[:, 2:4]) == pytest.approx(1.0, abs=1e-12)
    assert principal_angle_distance(eye[:, :2] * 5.0, eye[:, 3:5]) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("angle", [1e-4, 0.1, 0.7, math.pi / 2 - 1e-3])
def test_distance_is_sin_of_rotation_angle(angle):
    eye = torch.eye(5, dtype=torch.float64)
    truth = eye[:, :2]
    # Rotate the first basis vector by `angle` in the (e0, e3) plane; e1 stays.
    estimate = torch.stack([math.cos(angle) * eye[:, 0] + math.sin(angle) * eye[:, 3], eye[:, 1]], dim=1)
    assert principal_angle_distance(estimate, truth) == pytest.approx(math.sin(angle), rel=1e-9)
    assert principal_angle_distance(
        estimate @ torch.tensor([[2.0, 1.0], [0.5, -3.0]], dtype=torch.float64), truth
    ) == (pytest.approx(math.sin(angle), rel=1e-9))


def test_distance_symmetric_bounded_and_matches_singular_value_formula():
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        a, b = torch.randn(10, 3, generator=generator), torch.randn(10, 3, generator=generator)
        ab, ba = principal_angle_distance(a, b), principal_angle_distance(b, a)
        assert ab == pytest.approx(ba, abs=1e-12)
        assert 0.0 <= ab <= 1.0 + 1e-12
        assert ab == pytest.approx(subspace_distance(a, b), abs=1e-9)


def test_distance_argument_order_for_unequal_ranks():
    eye = torch.eye(4)
    # A rank-3 estimate containing the rank-2 truth recovers it; the reverse question does not hold.
    assert principal_angle_distance(eye[:, :3], eye[:, :2]) == pytest.approx(0.0, abs=1e-12)
    assert principal_angle_distance(eye[:, :2], eye[:, :3]) == pytest.approx(1.0, abs=1e-12)


# ----------------------------------------------------------------------------- method-of-moments init


def test_method_of_moments_init_is_orthonormal_and_close():
    # Measured dist(B^0, B*) for d=20, k=2, n=100, m=10, seeds 0..4: 0.492, 0.393, 0.394, 0.387, 0.428.
    distances = []
    for seed in range(5):
        problem = make_low_rank_problem(seed=seed)
        init = method_of_moments_init(problem.train, rank=2)
        assert init.shape == (20, 2) and init.dtype == torch.float32
        torch.testing.assert_close(init.T @ init, torch.eye(2), atol=1e-5, rtol=0)
        distances.append(principal_angle_distance(init, problem.ground_truth_body))
    assert max(distances) < 0.6
    assert statistics.median(distances) < 0.5
    # A random init is almost orthogonal to B* in d=20 (distance ~1), so MoM is far better than chance.
    random_init = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    assert principal_angle_distance(random_init, problem.ground_truth_body) > 0.9


def test_method_of_moments_init_improves_with_num_clients():
    # Measured medians over seeds 0..2: n=10 -> ~0.88, n=1000 -> ~0.13 (d=20, k=2, m=10).
    def median_distance(num_clients: int) -> float:
        distances = []
        for seed in range(3):
            problem = make_low_rank_problem(num_clients=num_clients, test_samples_per_client=1, seed=seed)
            init = method_of_moments_init(problem.train, rank=2)
            distances.append(principal_angle_distance(init, problem.ground_truth_body))
        return statistics.median(distances)

    few, many = median_distance(10), median_distance(1000)
    assert many < 0.25
    assert many < 0.5 * few


def test_method_of_moments_init_uses_all_clients_and_top_eigenvectors():
    # Two noiseless clients with heads sqrt(2) e_1 and sqrt(2) e_2: E[Z_i] = 2 I + 2 theta_i theta_i^T, so the
    # average is 2 I + 2 B* B*^T, whose top-2 eigenspace is col(B*) with an eigengap of 2. Measured
    # distances at 20000 samples per client, seeds 0..4: 0.054-0.086.
    problem = make_low_rank_problem(
        num_clients=2, samples_per_client=1, test_samples_per_client=1, noise_std=0.0
    )
    problem.client_heads = math.sqrt(2) * torch.eye(2)
    generator = torch.Generator().manual_seed(0)
    datasets = [TensorDataset(*problem.draw(client, 20000, generator)) for client in range(2)]
    both = method_of_moments_init(datasets, rank=2)
    assert principal_angle_distance(both, problem.ground_truth_body) < 0.15
    # Client 0 alone only sees theta_0 = sqrt(2) B*[:, 0]: its top eigenvector is that direction, and its
    # second one is arbitrary, so the rank-2 estimate misses col(B*).
    first = method_of_moments_init(datasets[:1], rank=2)
    assert principal_angle_distance(first[:, :1], problem.ground_truth_body[:, :1]) < 0.15
    assert principal_angle_distance(first, problem.ground_truth_body) > 0.5


# ----------------------------------------------------------------------------- model


def _batch(problem, client: int = 0):
    x, y = problem.train[client].tensors
    return x, y


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_exact_head_step_solves_least_squares_and_zeroes_head_gradient():
    problem = make_low_rank_problem(noise_std=0.1, seed=2)
    torch.manual_seed(0)
    model = LowRankLinear(dim=20, rank=2, init_body=torch.randn(20, 2))
    model.body.weight.requires_grad_(False)
    x, y = _batch(problem, 3)
    loss = model.training_step((x, y), 0)
    loss.backward()
    # Independent solution by the normal equations in float64.
    features = x.double() @ model.body.weight.double().T
    expected = torch.linalg.solve(features.T @ features, features.T @ y.double())
    torch.testing.assert_close(model.head.weight.double(), expected.T, atol=1e-5, rtol=1e-5)
    assert model.head.weight.grad.abs().max() < 1e-5
    assert loss.item() == pytest.approx(
        0.5 * (y.double() - features @ expected).square().mean().item(), rel=1e-4
    )


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_head_is_not_reset_outside_the_head_phase():
    problem = make_low_rank_problem(seed=2)
    for exact_head, body_trainable in [(True, True), (False, False)]:
        model = LowRankLinear(exact_head=exact_head)
        model.body.weight.requires_grad_(body_trainable)
        before = model.head.weight.detach().clone()
        model.training_step(_batch(problem), 0).backward()
        assert torch.equal(before, model.head.weight)
        assert model.head.weight.grad.abs().max() > 1e-3


def test_model_init_buffers_and_state_dict():
    problem = make_low_rank_problem(seed=4)
    init = method_of_moments_init(problem.train, rank=2)
    model = LowRankLinear(ground_truth_body=problem.ground_truth_body, init_body=init)
    assert model.fedrep_head == "head"
    torch.testing.assert_close(model.body.weight, init.T)
    x = problem.test[0].tensors[0]
    torch.testing.assert_close(model(x), x @ init @ model.head.weight.T)
    assert "ground_truth_body" not in model.state_dict()
    assert set(model.state_dict()) == {"body.weight", "head.weight"}
    assert "ground_truth_body" not in model.hparams and "init_body" not in model.hparams
    LowRankLinear(**model.hparams).load_state_dict(model.state_dict(), strict=True)
    assert model.principal_angle() == pytest.approx(principal_angle_distance(init, problem.ground_truth_body))
    assert LowRankLinear().principal_angle() is None
    with pytest.raises(ValueError):
        LowRankLinear(dim=20, rank=2, init_body=torch.zeros(2, 20))


def test_validate_logs_mse_and_principal_angle():
    import lightning

    problem = make_low_rank_problem(seed=4)
    init = method_of_moments_init(problem.train, rank=2)
    model = LowRankLinear(ground_truth_body=problem.ground_truth_body, init_body=init)
    trainer = lightning.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(model, DataLoader(problem.test[0], batch_size=50), verbose=False)
    x, y = problem.test[0].tensors
    assert metrics["val/mse"] == pytest.approx(model.loss(x, y).item(), rel=1e-5)
    assert metrics["val/principal_angle"] == pytest.approx(
        principal_angle_distance(init, problem.ground_truth_body)
    )


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_model_steps_match_reference_algorithm():
    """Algorithm 2 emulated with the model's own steps (exact head, then one SGD body step) = the oracle."""
    problem = make_low_rank_problem(seed=0)
    init = method_of_moments_init(problem.train, rank=2)
    lr, rounds, count = 0.1, 5, 10
    expected = fedrep_linear_reference(problem, init, rounds, count, lr, _uniform_sampler(100, count, seed=7))

    sampler = _uniform_sampler(100, count, seed=7)
    model = LowRankLinear(lr=lr, ground_truth_body=problem.ground_truth_body)
    optimizer = model.configure_optimizers()
    body = init.T.clone()
    got = []
    for round_index in range(rounds):
        new_bodies = []
        for client in sampler(round_index):
            batch = problem.train[client].tensors
            with torch.no_grad():
                model.body.weight.copy_(body)
            for head_phase in (True, False):
                model.head.weight.requires_grad_(head_phase)
                model.body.weight.requires_grad_(not head_phase)
                optimizer.zero_grad(set_to_none=True)
                model.training_step(batch, 0).backward()
                optimizer.step()
            new_bodies.append(model.body.weight.detach().clone())
        body = torch.stack(new_bodies).mean(0)
        got.append(principal_angle_distance(body.T, problem.ground_truth_body))
    assert got == pytest.approx(expected, rel=1e-3)


# ----------------------------------------------------------------------------- reference FedRep


def test_reference_fedrep_converges_from_method_of_moments_init():
    # d=20, k=2, n=100, m=10, 10 clients/round, lr=0.1, seed 0. Measured: init 0.492, t=50 2.1e-2,
    # t=100 1.2e-3, t=200 1.85e-4 (first below 1e-3 at round 104); ~0.6 s.
    problem = make_low_rank_problem(seed=0)
    init = method_of_moments_init(problem.train, rank=2)
    distances = fedrep_linear_reference(problem, init, 200, 10, 0.1, _uniform_sampler(100, 10, seed=1234))
    assert len(distances) == 200
    assert distances[-1] < 1e-3
    assert distances[49] < 0.1 * principal_angle_distance(init, problem.ground_truth_body)
    # Roughly linear (exponential) convergence before the noise floor.
    assert distances[99] < 0.2 * distances[49]


def test_reference_is_invariant_to_orthogonal_gauge():
    problem = make_low_rank_problem(seed=0)
    init = method_of_moments_init(problem.train, rank=2)
    rotation = torch.tensor([[math.cos(0.9), -math.sin(0.9)], [math.sin(0.9), math.cos(0.9)]])
    plain = fedrep_linear_reference(problem, init, 20, 10, 0.1, _uniform_sampler(100, 10, seed=3))
    rotated = fedrep_linear_reference(
        problem, init @ rotation, 20, 10, 0.1, _uniform_sampler(100, 10, seed=3)
    )
    assert rotated == pytest.approx(plain, rel=1e-3)


def test_reference_rejects_wrong_participation_count():
    problem = make_low_rank_problem(num_clients=5, test_samples_per_client=1)
    with pytest.raises(ValueError):
        fedrep_linear_reference(problem, torch.eye(20, 2), 1, 3, 0.1, lambda t: [0, 1])


def test_reference_and_init_accept_flat_targets():
    # A TensorDataset built by hand with y of shape (m,) is accepted too.
    problem = make_low_rank_problem(num_clients=2, test_samples_per_client=1, seed=0)
    problem.train = [TensorDataset(d.tensors[0], d.tensors[1].squeeze(1)) for d in problem.train]
    init = method_of_moments_init(problem.train, rank=2)
    assert len(fedrep_linear_reference(problem, init, 2, 2, 0.1, lambda t: [0, 1])) == 2
