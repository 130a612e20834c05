"""Linear FLUTE (Algorithm 1 of Liu, Shen & Yang, ICML 2024): under-parameterized linear representation learning.

This is a small plain-torch algorithm, **not** a ``FederatedStrategy`` run: in linear FLUTE the clients
upload one full-batch *gradient* each (for ``U`` and for their head ``v_i``), and the *server* applies
the data step and then a data-free regularisation step jointly on ``U`` and **all** heads ``V`` (the
two penalties couple the heads through ``||V V^T||_F`` and ``||U V||_F``). The strategy's rounds (clients
train locally, the server averages the body, heads never leave the clients) do not express that, so
the algorithm lives here, on tensors.

Model and data (the paper's synthetic setting; [RECON] in ``shared/reference/flute.md`` §2): client
``i`` has ``M`` samples ``x ~ N(0, I_d)``, ``y = x^T θ_i* + σ ξ``; ``Θ* = [θ_1*..θ_N*] = P diag(s) Q^T`` has
rank ``r > k`` (under-parameterized), and the target is its best rank-``k`` approximation ``Θ_k``
(Eckart-Young). The model is ``θ_i = U v_i`` with ``U`` ``d x k`` and ``V = [v_1..v_N]`` ``k x N``.

One round (all clients participate)::

    client i:  g_U,i = -(1/M) X_i^T r_i v_i^T,   g_v,i = -(1/M) U^T X_i^T r_i,   r_i = y_i - X_i U v_i
    server:    U <- U - η AGG_i g_U,i;   v_i <- v_i - η g_v,i                      (data step, eq. 5)
               (U, V) <- (U, V) - η ∇R(U, V)                                      (regularisation step, eqs. 6-7)
    R(U, V) = -2cλ ||U V||_F^2 + cμ (||U^T U||_F^2 + ||V V^T||_F^2)                   (terms (I) and (II))
    ∇_U R = -4cλ U V V^T + 4cμ U U^T U,    ∇_V R = -4cλ U^T U V + 4cμ V V^T V

With ``λ = μ``, ``R = cμ ||U^T U - V V^T||_F^2`` (the balancing penalty). Initialisation: i.i.d.
``N(0, ε^2)`` entries (small, data-independent). No QR or projection anywhere.

The paper's formulas were lost in the available text; the unknowns are options with the digest's
working defaults: ``aggregate`` (``"sum"``, default: balanced steps for ``U`` and ``V``; ``"mean"`` makes
``U`` move ``N`` times slower), ``c`` (``1/8``, the literature's constant), ``lam`` and ``mu`` (``1, 1``).
In this normalisation ``λ > μ`` rewards growing ``UV``: it biases the singular values upwards and is
unbounded below (diverges) once ``λ - μ > 2`` (``c = 1/8``); the paper reports ``λ > μ`` "usually
diverges" and never uses it, and :func:`linear_flute` warns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "LinearFluteProblem",
    "LinearFluteResult",
    "empirical_rank_k_fit",
    "flute_regularizer",
    "flute_regularizer_grad",
    "linear_flute",
    "make_linear_flute_problem",
    "rank_k_error",
]


@dataclass
class LinearFluteProblem:
    """Clients' data of the synthetic linear problem (float64).

    Attributes:
        theta: ``Θ*`` ``(d, N)``, column ``i`` is client ``i``'s regressor.
        x: ``(N, M, d)`` inputs; ``y``: ``(N, M)`` labels; ``noise_std``: ``σ``.
    """

    theta: Tensor
    x: Tensor
    y: Tensor
    noise_std: float

    @property
    def dim(self) -> int:
        return self.theta.shape[0]

    @property
    def num_clients(self) -> int:
        return self.theta.shape[1]

    def statistics(self) -> tuple[Tensor, Tensor]:
        """Each client's ``Σ_i = X_i^T X_i / M`` ``(N, d, d)`` and ``X_i^T y_i / M`` ``(N, d)`` (computed once)."""
        cached = getattr(self, "_statistics", None)
        if cached is None:
            m = self.x.shape[1]
            cov = self.x.transpose(1, 2) @ self.x / m
            xty = (self.x.transpose(1, 2) @ self.y.unsqueeze(-1)).squeeze(-1) / m
            cached = self._statistics = (cov, xty)
        return cached

    def best_rank(self, rank: int) -> Tensor:
        """``Θ_k``: the truncated SVD of ``Θ*`` to its top ``rank`` singular triplets."""
        u, s, vh = torch.linalg.svd(self.theta, full_matrices=False)
        return (u[:, :rank] * s[:rank]) @ vh[:rank]


def make_linear_flute_problem(
    dim: int = 30,
    num_clients: int = 50,
    samples_per_client: int = 300,
    noise_std: float = 0.1,
    top_singular_value: float = 10.0,
    decay: float = 0.8,
    seed: int = 0,
) -> LinearFluteProblem:
    """``Θ* = P diag(s) Q^T`` with ``s_j = top_singular_value · decay^(j-1)``, ``j = 1..min(d, N)``; ``P``,
    ``Q`` random orthonormal; ``X_i ~ N(0, I)``, ``y_i = X_i θ_i* + σ ξ`` (the digest's §9 generator)."""
    generator = torch.Generator().manual_seed(seed)
    rank = min(dim, num_clients)
    p, _ = torch.linalg.qr(torch.randn(dim, rank, generator=generator, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(num_clients, rank, generator=generator, dtype=torch.float64))
    s = top_singular_value * decay ** torch.arange(rank, dtype=torch.float64)
    theta = (p * s) @ q.T
    x = torch.randn(num_clients, samples_per_client, dim, generator=generator, dtype=torch.float64)
    noise = torch.randn(num_clients, samples_per_client, generator=generator, dtype=torch.float64)
    y = torch.einsum("nmd,dn->nm", x, theta) + noise_std * noise
    return LinearFluteProblem(theta, x, y, float(noise_std))


def rank_k_error(u: Tensor, v: Tensor, target: Tensor) -> float:
    """``||U V - target||_F^2 / N`` (the digest's error; ``target`` is usually ``Θ_k``)."""
    return float((u @ v - target).square().sum() / target.shape[1])


def flute_regularizer(u: Tensor, v: Tensor, lam: float = 1.0, mu: float = 1.0, c: float = 0.125) -> Tensor:
    """``R(U, V) = -2cλ ||U V||_F^2 + cμ (||U^T U||_F^2 + ||V V^T||_F^2)`` (terms (I) and (II))."""
    return -2 * c * lam * (u @ v).square().sum() + c * mu * (
        (u.T @ u).square().sum() + (v @ v.T).square().sum()
    )


def flute_regularizer_grad(
    u: Tensor, v: Tensor, lam: float = 1.0, mu: float = 1.0, c: float = 0.125
) -> tuple[Tensor, Tensor]:
    """Closed-form ``(∇_U R, ∇_V R)`` of :func:`flute_regularizer`."""
    utu, vvt = u.T @ u, v @ v.T
    grad_u = -4 * c * lam * u @ vvt + 4 * c * mu * u @ utu
    grad_v = -4 * c * lam * utu @ v + 4 * c * mu * vvt @ v
    return grad_u, grad_v


def client_gradients(problem: LinearFluteProblem, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Every client's full-batch gradients of ``L_i = (1/2M) ||y_i - X_i U v_i||^2``: ``(N, d, k)`` and ``(k, N)``.

    ``(1/M) X_i^T r_i = (1/M) X_i^T y_i - Σ_i U v_i`` with ``Σ_i = X_i^T X_i / M``: the same numbers as a
    pass over the samples, from the client's sufficient statistics (cached on the problem).
    """
    cov, xty = problem.statistics()
    theta = u @ v  # (d, N)
    xr = xty - (cov @ theta.T.unsqueeze(-1)).squeeze(-1)  # (1/M) X_i^T r_i, (N, d)
    grad_u = -xr.unsqueeze(-1) * v.T.unsqueeze(1)  # (N, d, k)
    grad_v = -(u.T @ xr.T)
    return grad_u, grad_v


@dataclass
class LinearFluteResult:
    """``u`` ``(d, k)``, ``v`` ``(k, N)``; ``errors[t]`` = :func:`rank_k_error` after ``t`` rounds (``t = 0`` is
    the init); ``diverged`` when an iterate became non-finite or exceeded ``1e6 · ||Θ_k||`` (then the
    run stopped early and the remaining errors are ``inf``)."""

    u: Tensor
    v: Tensor
    errors: list[float] = field(default_factory=list)
    diverged: bool = False

    def settled(self, window: int = 50, rtol: float = 1e-3) -> bool:
        """Whether the error stopped moving: over the last ``window`` rounds it varied by at most ``rtol``
        relative to its final value (``False`` after a divergence or an oscillation)."""
        tail = self.errors[-window:]
        if self.diverged or len(tail) < window or not all(math.isfinite(e) for e in tail):
            return False
        return max(tail) - min(tail) <= rtol * max(abs(tail[-1]), 1e-300)

    def rounds_to(self, threshold: float) -> int | None:
        """First round whose error is ``<= threshold`` (``None`` if never)."""
        return next((t for t, e in enumerate(self.errors) if e <= threshold), None)


def linear_flute(
    problem: LinearFluteProblem,
    rank: int,
    rounds: int,
    lr: float = 0.05,
    lam: float = 1.0,
    mu: float = 1.0,
    c: float = 0.125,
    aggregate: Literal["sum", "mean"] = "sum",
    init_scale: float = 1e-3,
    seed: int = 0,
    target: Tensor | None = None,
    num_threads: int | None = 1,
) -> LinearFluteResult:
    """Run ``rounds`` rounds of linear FLUTE (module docstring) from a ``N(0, init_scale^2)`` init.

    Args:
        problem: the clients' data.
        rank: ``k``, the representation dimension (under-parameterized when ``k < rank(Θ*)``).
        lr: ``η``, used for the data step and the regularisation step; needs ``η σ_1(Θ*) ≲ 1``.
        lam, mu: weights of terms (I) and (II); ``lam > mu`` warns (reported unstable).
        c: the constant in front of both terms (unknown in the paper; ``1/8`` makes ``λ = μ = 1`` the
            standard ``(1/8)||U^T U - V V^T||_F^2``).
        aggregate: ``"sum"`` or ``"mean"`` of the clients' ``U`` gradients.
        init_scale: ``ε``; must be non-zero.
        target: what :attr:`LinearFluteResult.errors` measure against; ``Θ_k`` by default.
        num_threads: torch intra-op threads during the run (restored afterwards); the matrices are tiny
            and one thread is the fastest; ``None`` leaves the setting alone.
    """
    if aggregate not in ("sum", "mean"):
        raise ValueError(f"aggregate must be 'sum' or 'mean', got {aggregate!r}.")
    if init_scale <= 0:
        raise ValueError("init_scale must be > 0: FLUTE needs a non-zero component in the top-k subspace.")
    if lam > mu:
        warnings.warn(
            f"lam={lam} > mu={mu}: the regulariser rewards growing UV and is unbounded below; the paper reports "
            "that UV usually diverges for lam > mu (here: biased for lam - mu < 2/(8c), divergent beyond).",
            stacklevel=2,
        )
    with _threads(num_threads):
        return _run(problem, rank, rounds, lr, lam, mu, c, aggregate, init_scale, seed, target)


@contextmanager
def _threads(num_threads: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op threads (tiny matrices run fastest on one thread)."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(problem, rank, rounds, lr, lam, mu, c, aggregate, init_scale, seed, target) -> LinearFluteResult:
    generator = torch.Generator().manual_seed(seed)
    dim, num_clients = problem.dim, problem.num_clients
    dtype = problem.x.dtype
    u = init_scale * torch.randn(dim, rank, generator=generator, dtype=dtype)
    v = init_scale * torch.randn(rank, num_clients, generator=generator, dtype=dtype)
    target = problem.best_rank(rank) if target is None else target
    limit = 1e6 * max(float(torch.linalg.matrix_norm(target)), 1.0)
    result = LinearFluteResult(u, v, [rank_k_error(u, v, target)])
    for _ in range(rounds):
        grad_u, grad_v = client_gradients(problem, u, v)
        agg = grad_u.sum(0) if aggregate == "sum" else grad_u.mean(0)
        u, v = u - lr * agg, v - lr * grad_v  # server data step
        reg_u, reg_v = flute_regularizer_grad(u, v, lam, mu, c)
        u, v = u - lr * reg_u, v - lr * reg_v  # server regularisation step, jointly on U and all heads
        size = float(torch.linalg.matrix_norm(u @ v))
        if not math.isfinite(size) or size > limit:
            result.diverged = True
            result.errors += [math.inf] * (rounds + 1 - len(result.errors))
            break
        result.errors.append(rank_k_error(u, v, target))
    result.u, result.v = u, v
    return result


def empirical_rank_k_fit(
    problem: LinearFluteProblem,
    rank: int,
    iterations: int = 300,
    tol: float = 1e-13,
    num_threads: int | None = 1,
) -> Tensor:
    """The minimiser ``Θ̂`` (``d x N``, rank ``k``) of the empirical loss ``sum_i (1/2M)||y_i - X_i θ_i||^2``
    over rank-``k`` matrices, by alternating least squares from the rank-``k`` truncation of the
    clients' own least-squares fits.

    This is the *statistical floor* of linear FLUTE with ``λ = μ``: the balancing penalty vanishes at
    balanced factorisations, so FLUTE's fixed points have ``UV = Θ̂``, and ``||Θ̂ - Θ_k||_F^2 / N`` is the
    error it converges to with finite ``M`` and noise. An independent algorithm (exact solves, no step
    size), used as the reference in the benchmark and the tests.
    """
    with _threads(num_threads):
        return _als(problem, rank, iterations, tol)


def _als(problem: LinearFluteProblem, rank: int, iterations: int, tol: float) -> Tensor:
    cov, xty = problem.statistics()
    theta_ls = torch.linalg.solve(cov, xty.unsqueeze(-1)).squeeze(-1).T  # (d, N)
    uu, s, vh = torch.linalg.svd(theta_ls, full_matrices=False)
    u = uu[:, :rank] * s[:rank]
    previous = None
    for _ in range(iterations):
        # heads: v_i = argmin (1/2M)||y_i - X_i U v||^2
        a = u.T @ cov @ u  # (N, k, k)
        b = u.T @ xty.T  # (k, N)
        v = torch.linalg.solve(a, b.T.unsqueeze(-1)).squeeze(-1).T
        # body: sum_i (v_i v_i^T ⊗ Σ_i) vec(U) = sum_i vec(Σ_i-weighted X_i^T y_i v_i^T / M)
        dim = u.shape[0]
        lhs = torch.einsum("kn,ln,nde->dkel", v, v, cov).reshape(dim * rank, dim * rank)
        rhs = (xty.T @ v.T).reshape(dim * rank)
        u = torch.linalg.solve(lhs, rhs).reshape(dim, rank)
        fit = u @ v
        if previous is not None and float((fit - previous).square().sum()) <= tol * float(fit.square().sum()):
            break
        previous = fit
    return u @ v
