"""FedRep Fig. 3 (``benchmarks/fedrep/fig3.py``) at a reduced size, and its pieces against independent
references: numpy least squares and normal equations, autograd, the plain Algorithm-2 loop of
``benchmarks/fedrep/reference_linear.py`` and the library's ``FedRepStrategy``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.fedrep import fig3
from benchmarks.fedrep.reference_linear import fedrep_linear_reference
from lightning_fedrep.data.subspace import method_of_moments_init, principal_angle_distance
from tests.fixtures import reference_clients


def _random_clients(clients: int, samples: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(clients, samples, dim, generator=generator, dtype=torch.float64)
    y = torch.randn(clients, samples, generator=generator, dtype=torch.float64)
    return x, y


# ----------------------------------------------------------------------------- closed-form pieces


def test_exact_heads_equal_the_normal_equations_and_zero_the_head_gradient():
    x, y = _random_clients(clients=7, samples=5, dim=10)
    body = torch.randn(10, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    heads = fig3.exact_heads(x, y, body)
    assert heads.shape == (7, 2)
    for i in range(7):
        features = x[i].numpy() @ body.numpy()
        expected = np.linalg.solve(features.T @ features, features.T @ y[i].numpy())
        np.testing.assert_allclose(heads[i].numpy(), expected, rtol=1e-9, atol=1e-12)
    assert fig3.head_gradient(x, y, body, heads).abs().max() < 1e-12
    # a perturbed head is worse: the exact head is the minimiser, not just a stationary point
    worse = heads + 1e-3
    loss = lambda w: ((y - ((x @ body) @ w.unsqueeze(-1)).squeeze(-1)) ** 2).sum(dim=1)  # noqa: E731
    assert bool((loss(worse) > loss(heads)).all())


def test_gradients_match_autograd_and_head_gd_converges_to_the_exact_head():
    x, y = _random_clients(clients=4, samples=6, dim=10, seed=2)
    body = torch.randn(10, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    heads = torch.randn(4, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for i in range(4):
        b = body.clone().requires_grad_(True)
        w = heads[i].clone().requires_grad_(True)
        loss = 0.5 * ((y[i] - x[i] @ b @ w) ** 2).mean()  # f_i = (1/2m) sum_j (y_j - w^T B^T x_j)^2
        loss.backward()
        torch.testing.assert_close(fig3.body_gradients(x, y, body, heads)[i], b.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fig3.head_gradient(x, y, body, heads)[i], w.grad, rtol=1e-10, atol=1e-12)
    one = fig3.gd_heads(x, y, body, heads, step=0.05, steps=1)
    torch.testing.assert_close(one, heads - 0.05 * fig3.head_gradient(x, y, body, heads))
    many = fig3.gd_heads(x, y, body, heads, step=0.02, steps=3000)
    torch.testing.assert_close(many, fig3.exact_heads(x, y, body), rtol=1e-6, atol=1e-8)


def test_local_only_equals_the_normal_equations_when_m_at_least_d():
    x, y = _random_clients(clients=5, samples=15, dim=10, seed=5)
    theta = fig3.local_only_least_squares(x, y)
    assert theta.shape == (5, 10)
    for i in range(5):
        xi, yi = x[i].numpy(), y[i].numpy()
        np.testing.assert_allclose(
            theta[i].numpy(), np.linalg.solve(xi.T @ xi, xi.T @ yi), rtol=1e-8, atol=1e-10
        )
        lstsq = np.linalg.lstsq(xi, yi, rcond=None)[0]
        np.testing.assert_allclose(theta[i].numpy(), lstsq, rtol=1e-8, atol=1e-10)
    # one client as a (m, d) matrix gives the same fit
    torch.testing.assert_close(fig3.local_only_least_squares(x[2], y[2]), theta[2])


def test_local_only_is_the_minimum_norm_interpolant_when_m_below_d():
    x, y = _random_clients(clients=5, samples=5, dim=10, seed=6)
    theta = fig3.local_only_least_squares(x, y)
    generator = torch.Generator().manual_seed(7)
    for i in range(5):
        xi, yi = x[i].numpy(), y[i].numpy()
        min_norm = xi.T @ np.linalg.solve(xi @ xi.T, yi)  # X^T (X X^T)^{-1} y, in the row space of X
        np.testing.assert_allclose(theta[i].numpy(), min_norm, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(theta[i].numpy(), np.linalg.pinv(xi) @ yi, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(xi @ theta[i].numpy(), yi, atol=1e-10)  # it interpolates
        # every other interpolant theta + v (v in the null space of X) is longer
        null_basis = torch.linalg.svd(x[i], full_matrices=True).Vh[5:].T  # (d, d - m)
        v = null_basis @ torch.randn(5, generator=generator, dtype=torch.float64)
        np.testing.assert_allclose(x[i].numpy() @ v.numpy(), 0, atol=1e-10)
        assert (theta[i] + v).norm() > theta[i].norm() + 1e-6


def test_local_only_excess_risk_matches_its_closed_form():
    """Underdetermined (m=5 < d=10): the min-norm fit keeps only the projection of theta* on a random
    5-dim row space, so the mean excess risk is (1 - m/d) k / 2 = 0.5 (std over clients ~0.2)."""
    setting = fig3.Setting(dim=10, rank=2, samples=5)
    problem = fig3.make_problem(setting, clients=2000, seed=0)
    x, y = fig3.client_arrays(problem)
    risks = fig3.excess_risks(fig3.local_only_least_squares(x, y), fig3.true_regressors(problem))
    expected = fig3.local_only_expected_excess_risk(10, 5, 2, 1e-3)
    assert expected == pytest.approx(0.5, rel=1e-5)
    assert float(risks.mean()) == pytest.approx(expected, abs=0.03)
    # with m = 40 >= d the fit is unique and only the noise is left: sigma^2 d / (m - d - 1) / 2
    problem = fig3.make_problem(fig3.Setting(samples=40, noise_std=0.1), clients=500, seed=1)
    x, y = fig3.client_arrays(problem)
    risks = fig3.excess_risks(fig3.local_only_least_squares(x, y), fig3.true_regressors(problem))
    assert float(risks.mean()) == pytest.approx(fig3.local_only_expected_excess_risk(10, 40, 2, 0.1), rel=0.2)


# ----------------------------------------------------------------------------- the algorithms


def test_fedrep_loop_matches_the_independent_algorithm2_reference():
    setting = fig3.Setting(rounds=15)
    problem = fig3.make_problem(setting, clients=50, seed=3)
    init = method_of_moments_init(problem.train, 2)
    run = fig3.run_method("fedrep", problem, init, 15, body_lr=0.3, participation=5, seed=3)
    reference = fedrep_linear_reference(problem, init, 15, 5, 0.3, lambda t: reference_clients(50, 5, 3, t))
    assert len(run.distances) == 16
    assert run.distances[0] == pytest.approx(principal_angle_distance(init, problem.ground_truth_body))
    np.testing.assert_allclose(run.distances[1:], reference, rtol=2e-3)
    assert run.distances[-1] < 0.5 * run.distances[0]


def test_fedrep_loop_matches_the_library_strategy():
    setting = fig3.Setting(rounds=8)
    problem = fig3.make_problem(setting, clients=20, seed=4)  # 2 clients a round: averaging is exercised
    init = method_of_moments_init(problem.train, 2)
    library, loop = fig3.library_check(setting, 20, 4, init, problem)
    assert len(library) == len(loop) == 9
    np.testing.assert_allclose(library, loop, atol=1e-5)
    assert loop[-1] < loop[0]


def test_gd_variants_keep_client_heads_and_divergence_is_reported():
    setting = fig3.Setting(rounds=5)
    problem = fig3.make_problem(setting, clients=30, seed=5)
    init = method_of_moments_init(problem.train, 2)
    run = fig3.run_method("gd-gd", problem, init, 5, body_lr=0.3, head_lr=0.3, participation=3, seed=5)
    visited = sorted({c for t in range(5) for c in reference_clients(30, 3, 5, t)})
    untouched = [c for c in range(30) if c not in visited]
    assert bool((run.heads[visited].abs().sum(dim=1) > 0).all())
    assert bool((run.heads[untouched] == 0).all())  # heads start at zero and live on the clients
    with pytest.raises(ValueError, match="head step"):
        fig3.run_method("10gd-gd", problem, init, 5, body_lr=0.3)
    blown = fig3.run_method("10gd-gd", problem, init, 30, body_lr=30, head_lr=30, participation=3, seed=5)
    assert blown.diverged and math.isnan(blown.final)
    assert fig3._median([0.1, float("nan"), 0.2]) == 0.2
    assert fig3._median([0.1, float("nan"), float("nan")]) == math.inf


def test_reduced_fig3_orderings():
    """Fig. 3 at d=10, k=2, m=5, r=0.1 for 100 rounds, n in {100, 1000}, seed 0 (full run: 0.0064,
    3.8e-4 for FedRep; 0.057 for GD-GD at n=1000; MoM start 0.145): FedRep at the larger n ends far
    below GD-GD and below its MoM start, and below FedRep at the smaller n."""
    setting = fig3.Setting(rounds=100)
    cells, local, init = fig3.fig3((100, 1000), (0,), setting, methods=("fedrep", "gd-gd"))
    fedrep_small, fedrep, gd = (
        cells[key].median_curve() for key in [("fedrep", 100), ("fedrep", 1000), ("gd-gd", 1000)]
    )
    assert fedrep[0] == pytest.approx(init[1000]) and init[1000] < init[100]
    assert fedrep[-1] < 0.01 * fedrep[0]
    assert fedrep[-1] < 0.1 * gd[-1]
    assert fedrep[-1] < 0.2 * fedrep_small[-1]
    slope, r2, _ = fig3.log_rate(fedrep)
    assert slope < -0.03 and r2 > 0.95  # linear convergence (Theorem 1)
    # Local Only cannot use the shared structure at m < d; FedRep's personalised models can
    for n in (100, 1000):
        assert local[n][0] == pytest.approx(0.5, abs=0.1)
        assert cells[("fedrep", n)].risks[0] < 1e-3 * local[n][0]


# ----------------------------------------------------------------------------- claim checks and script


def test_check_claims_passes_and_fails_on_constructed_curves():
    clients = (10, 100)
    ts = range(41)

    def curve(rate: float, floor: float = 1e-6) -> list[float]:
        return [max(0.5 * math.exp(-rate * t), floor) for t in ts]

    good = {
        ("fedrep", 10): curve(0.10),
        ("fedrep", 100): curve(0.20, 1e-5),
        ("10gd-gd", 10): curve(0.05),
        ("10gd-gd", 100): curve(0.06),
        ("gd-gd", 10): curve(0.02),
        ("gd-gd", 100): curve(0.021),
    }
    claims = fig3.check_claims(good, clients, {10: 0.5, 100: 0.5}, {10: 1e-3, 100: 1e-6})
    assert len(claims) == 6 and all(c.passed for c in claims), [c.line() for c in claims]
    assert claims[0].line().startswith("[PASS]")

    bad = dict(good)
    bad[("fedrep", 100)] = curve(0.05)  # slower than at n=10, and no faster than 10GD-GD
    bad[("gd-gd", 10)] = [0.5 + 0.01 * t for t in ts]  # a method that gets worse
    failed = {
        c.name
        for c in fig3.check_claims(bad, clients, {10: 0.5, 100: 0.5}, {10: 1.0, 100: 1e-6})
        if not c.passed
    }
    assert any("faster with larger n" in name for name in failed)
    assert "final dist (t=T): FedRep < 10GD-GD < GD-GD at every n" in failed
    assert any("Local Only" in name for name in failed)
    rising = {("fedrep", 10): [0.1 * (1 + t) for t in ts]}
    assert not fig3.check_claims(rising, (10,))[0].passed

    with_floor = [max(0.5 * math.exp(-0.1 * t), 1e-4) for t in range(150)]
    slope, r2, end = fig3.log_rate(with_floor)
    assert slope == pytest.approx(-0.1, rel=1e-6) and r2 == pytest.approx(1.0)
    assert end == math.ceil(math.log(0.5 / 3e-4) / 0.1)  # stops where it reaches 3x its floor


def test_the_figure_draws_each_cells_median_and_min_max_band_per_panel():
    """One panel per ``n`` (log scale), one line per method holding the numpy median over seeds, and a band
    whose corners are the min and max over seeds. Catches an empty panel (``ax.semilogy`` dropped), the
    mean for the median (``median_curve``), a band to the median (``highs`` = the median curve), linear
    axes (``semilogy`` -> ``plot``) and a method drawn in the wrong panel."""
    import matplotlib.pyplot as plt

    def cell(method, n, *curves):
        runs = [fig3.Run(method, 0.1, None, list(c), torch.zeros(1), torch.zeros(1)) for c in curves]
        return fig3.Cell(method, n, 0.1, None, runs)

    curves = {
        ("fedrep", 10): ([1.0, 0.5, 0.25], [0.8, 0.4, 0.1], [0.9, 0.2, 0.05]),
        ("10gd-gd", 10): ([1.0, 0.7, 0.6], [0.9, 0.8, 0.5]),
        ("gd-gd", 10): ([1.0, 0.9, 0.85],),  # one seed: a line, no band
        ("fedrep", 40): ([0.6, 0.3, 0.01], [0.7, 0.2, 0.02], [0.5, 0.1, 0.03]),
        ("10gd-gd", 40): ([0.6, 0.5, 0.4], [0.7, 0.6, 0.35], [0.65, 0.55, 0.3]),
    }
    cells = {key: cell(*key, *runs) for key, runs in curves.items()}
    figure = fig3.figure(cells, (10, 40), fig3.Setting())
    try:
        assert [ax.get_title() for ax in figure.axes] == ["n = 10", "n = 40"]
        for ax, n in zip(figure.axes, (10, 40)):
            methods = [m for m in fig3.METHODS if (m, n) in curves]
            assert ax.get_yscale() == "log"
            assert [line.get_label() for line in ax.get_lines()] == [fig3.LABELS[m] for m in methods]
            bands = iter(ax.collections)
            for method, line in zip(methods, ax.get_lines()):
                runs = np.array(curves[(method, n)])
                assert list(line.get_xdata()) == [0, 1, 2]
                np.testing.assert_allclose(line.get_ydata(), np.median(runs, axis=0), rtol=1e-12)
                if len(runs) > 1:
                    corners = {(float(t), float(y)) for t, y in next(bands).get_paths()[0].vertices}
                    expected = set(enumerate(runs.min(0).tolist())) | set(enumerate(runs.max(0).tolist()))
                    assert corners == {(float(t), y) for t, y in expected}, (method, n)
            assert next(bands, None) is None
    finally:
        plt.close(figure)


def test_script_quick_run_prints_the_table_claims_and_figure(tmp_path, capsys):
    figure = tmp_path / "fig3.png"
    claims = fig3.main(["--quick", "--rounds", "16", "--clients", "10", "40", "--figure", str(figure)])
    out = capsys.readouterr().out
    assert "| n | method (eta body, beta head) | t=0 | t=2 | t=4 | t=8 | t=16 | wall s |" in out
    for label in ("FedRep (eta=1)", "10GD-GD (eta=3, beta=0.1)", "GD-GD (eta=0.3, beta=0.3)"):
        assert label in out
    assert "| n | dist(B_0,B*) (MoM) | Local Only | FedRep | 10GD-GD | GD-GD |" in out
    assert len(claims) == 6
    assert sum(line.strip().startswith(("[PASS]", "[FAIL]")) for line in out.splitlines()) == 6
    assert "elapsed:" in out
    assert figure.exists() and figure.stat().st_size > 10_000
