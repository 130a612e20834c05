"""FedPAC's classifier combination: each client's weights over the round's heads, a quadratic program over the
simplex solved with scipy (imported when first solved; ``FedPAC.setup`` refuses to run without it)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["head_weights", "require_scipy"]


def require_scipy() -> None:
    """Refuse FedPAC at set-up where scipy (its QP solver) is missing, saying how to install it."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError as error:
        raise ValueError(
            'FedPAC solves its head-combination QP with scipy: pip install "lightning-fedrep[baselines]" (or scipy).'
        ) from error


def head_weights(v: Tensor, h: Tensor, i: int, renormalize: bool = True) -> Tensor | None:
    """Client ``i``'s weights over the round's heads: ``argmin a^T (diag(v) + D_i) a`` over the simplex (``v``:
    ``[k]``, ``h``: ``[k, C, d]``), the matrix repaired to its eigenvalues >= 0.01 when not positive semi-definite,
    weights below 1e-3 zeroed (then renormalized); ``None`` where the solver fails."""
    from scipy.optimize import minimize

    gaps = (h[i][None] - h).reshape(h.shape[0], -1).to(torch.float64)
    p = (torch.diag(v.to(torch.float64)) + gaps @ gaps.T).numpy()
    values, vectors = np.linalg.eigh(p)
    if (values < 0).any():
        keep = values >= 0.01
        p = (vectors[:, keep] * values[keep]) @ vectors[:, keep].T
    k, scale = p.shape[0], max(float(np.abs(p).max()), 1e-300)
    q = p / scale
    result = minimize(
        lambda a: a @ q @ a,
        np.full(k, 1.0 / k),
        jac=lambda a: 2.0 * q @ a,
        bounds=[(0.0, None)] * k,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(k)}],
        method="SLSQP",
        options={"ftol": 1e-16, "maxiter": 1000},
    )
    if not result.success:
        return None
    alpha = np.where(result.x > 1e-3, result.x, 0.0)
    return torch.from_numpy(alpha / alpha.sum() if renormalize else alpha)
