"""Neural-collapse geometry of personalized linear heads: FLUTE's regulariser and the NC1-NC3 metrics.

Pure functions on tensors (torch only), used by :class:`lightning_fedrep.callbacks.NeuralCollapse` and
usable on their own. Notation (FLUTE, Liu, Shen & Yang, ICML 2024; the exact forms are those of the
official code ``RenpuLiu/flute``, ``models/Update.py``):

* ``K`` classes, ``W_i`` the ``K x k`` weight of client ``i``'s linear head (row ``c`` = class ``c``, the
  ``nn.Linear`` convention; biases never enter), ``e_i`` in ``{0,1}^K`` the *multi-hot* mask of the
  classes present in client ``i``'s training data, ``S_i = |e_i|``.
* The target Gram matrix of a simplex ETF of ``S`` vertices, Frobenius-normalised and masked::

      T_S(e) = (1/sqrt(S-1)) (I_K - (1/S) 1 1^T) ⊙ e e^T

  ``T_K(e)`` is the *global* K-simplex ETF restricted to the present classes (pairwise cosine
  ``-1/(K-1)``); ``T_S(e)`` with ``S = |e|`` is the *local* S-simplex ETF (cosine ``-1/(S-1)``, unit norm).
* FLUTE's regulariser (eq. 52, **not squared**, scale-invariant in ``W``)::

      R(W_i) = || W_i W_i^T / ||W_i W_i^T||_F  -  T_K(e_i) ||_F

  Its minimum over ``W`` is ``1 - ||T_K(e_i)||_F`` (``0`` only when every class is present), reached by
  zero rows for absent classes and present rows with Gram ``∝ I_S - (1/K) 1 1^T``.
* **Global NC2** = ``(1/N) sum_i R(W_i)`` over *all* N clients (the code's ``fun_reg``); **Averaged
  Local NC2** = the same with ``T_S`` in place of ``T_K`` (the code uses the fixed ``S =
  shard_per_user``; here ``S`` defaults to each client's own ``|e_i|``, which is the same number unless
  a client drew a class twice).
* **NC1** (Papyan et al. 2020): ``tr(Σ_W Σ_B^+) / C`` over the features ``h`` of ``C`` classes, with
  ``Σ_W = (1/n) sum (h - μ_y)(h - μ_y)^T`` and ``Σ_B = (1/C) sum_c (μ_c - μ_G)(μ_c - μ_G)^T``,
  ``μ_G`` the mean of the class means.
* **NC3** (Papyan et al. 2020, per client): ``|| Ŵ_i / ||Ŵ_i||_F - M̂_i / ||M̂_i||_F ||_F^2`` where ``Ŵ_i``
  are the head rows of client ``i``'s present classes and ``M̂_i`` the matching rows of the globally
  centred class means ``μ_c - μ_G``; averaged over clients. ``0`` is perfect self-duality, ``4`` the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "class_masks",
    "etf_target",
    "global_nc2",
    "local_nc2",
    "nc1",
    "nc3",
    "nc_regularizer",
    "server_nc_step",
]

_EPS = 1e-12


def class_masks(labels: Sequence[Tensor], num_classes: int) -> Tensor:
    """``e_i`` for every client: a float ``(N, K)`` tensor, ``1`` where the class occurs in ``labels[i]``."""
    masks = torch.zeros(len(labels), num_classes)
    for i, y in enumerate(labels):
        y = torch.as_tensor(y).long().reshape(-1)
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ValueError(
                f"Client {i} has labels outside 0..{num_classes - 1} (min {int(y.min())}, max {int(y.max())}); "
                "the head has fewer rows than there are classes."
            )
        masks[i, y.unique()] = 1.0
    return masks


def etf_target(mask: Tensor, simplex_size: int | Tensor | None = None) -> Tensor:
    """``T_S(e) = (1/sqrt(S-1)) (I_K - 11^T/S) ⊙ e e^T``; ``mask`` is ``(K,)`` or batched ``(N, K)``.

    ``simplex_size`` is ``S``: ``None`` for the global ETF (``S = K``), an int, or a per-client tensor
    ``(N,)``. A client with ``S = 1`` (one class) gets ``e e^T``, the normalised Gram of a single row
    (the formula's ``0/0``).
    """
    mask = mask.to(torch.get_default_dtype()) if not mask.is_floating_point() else mask
    num_classes = mask.shape[-1]
    size = torch.as_tensor(num_classes if simplex_size is None else simplex_size, dtype=mask.dtype)
    size = size.to(mask.device).reshape(size.shape + (1, 1) if size.dim() else (1, 1))
    eye = torch.eye(num_classes, dtype=mask.dtype, device=mask.device)
    outer = mask.unsqueeze(-1) * mask.unsqueeze(-2)
    single = size <= 1
    scale = torch.where(single, torch.ones_like(size), (size - 1).clamp_min(1).rsqrt())
    inv_size = torch.where(single, torch.zeros_like(size), 1.0 / size)
    return scale * (eye - inv_size) * outer


def nc_regularizer(weight: Tensor, mask: Tensor, simplex_size: int | Tensor | None = None) -> Tensor:
    """FLUTE's ``R(W) = || W W^T / ||W W^T||_F - T_S(e) ||_F`` (``S = K`` by default).

    ``weight`` is ``(K, k)`` with ``mask`` ``(K,)`` (a scalar result), or batched ``(N, K, k)`` with
    ``(N, K)`` masks (one value per client). Differentiable; the Frobenius norm is not squared.
    """
    gram = weight @ weight.transpose(-1, -2)
    norm = torch.linalg.matrix_norm(gram, keepdim=True).clamp_min(_EPS)
    target = etf_target(mask.to(weight.dtype), simplex_size)
    return torch.linalg.matrix_norm(gram / norm - target)


def global_nc2(heads: Tensor, masks: Tensor) -> Tensor:
    """Global NC2: ``(1/N) sum_i R(W_i)`` with the K-simplex target (distance to the global optimum)."""
    return nc_regularizer(heads, masks).mean()


def local_nc2(heads: Tensor, masks: Tensor, classes_per_client: int | None = None) -> Tensor:
    """Averaged Local NC2: ``(1/N) sum_i ||W_iW_i^T/||W_iW_i^T||_F - T_S(e_i)||_F`` (distance to the local
    optimum). ``S`` is ``classes_per_client`` when given (the official code's ``shard_per_user``),
    otherwise each client's number of present classes."""
    size = masks.sum(-1) if classes_per_client is None else classes_per_client
    return nc_regularizer(heads, masks, size).mean()


def _class_means(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class means ``(K, k)`` (zero rows for absent classes) and the ``(K,)`` presence mask."""
    labels = labels.long()
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    present = counts > 0
    means = sums / counts.clamp_min(1).unsqueeze(1)
    return means, present


def nc1(features: Tensor, labels: Tensor) -> Tensor:
    """Papyan's NC1: ``tr(Σ_W Σ_B^+) / C`` over the classes present in ``labels`` (computed in float64)."""
    h = features.detach().double()
    labels = labels.long()
    num_classes = int(labels.max()) + 1
    means, present = _class_means(h, labels, num_classes)
    centred = h - means[labels]
    sigma_w = centred.T @ centred / h.shape[0]
    used = means[present]
    between = used - used.mean(0, keepdim=True)
    sigma_b = between.T @ between / used.shape[0]
    pinv = torch.linalg.pinv(sigma_b, hermitian=True, rtol=1e-10)
    return torch.trace(sigma_w @ pinv) / used.shape[0]


def nc3(heads: Tensor, masks: Tensor, features: Tensor, labels: Tensor) -> Tensor:
    """Self-duality of the heads and the class means, averaged over clients (``0`` = perfect, ``4`` = max).

    For client ``i``: ``|| Ŵ_i/||Ŵ_i||_F - M̂_i/||M̂_i||_F ||_F^2`` with ``Ŵ_i`` its head rows and ``M̂_i`` the
    globally centred class means (``μ_c - μ_G``, ``μ_G`` the mean of the class means), both restricted
    to the classes present for the client *and* in ``labels``. Clients with no such class are skipped.
    """
    h = features.detach().double()
    num_classes = heads.shape[1]
    means, present = _class_means(h, labels, num_classes)
    centred = means - means[present].mean(0, keepdim=True)
    values = []
    for weight, mask in zip(heads.detach().double(), masks):
        rows = (mask > 0) & present
        if not rows.any():
            continue
        w = weight[rows]
        m = centred[rows]
        w = w / torch.linalg.matrix_norm(w).clamp_min(_EPS)
        m = m / torch.linalg.matrix_norm(m).clamp_min(_EPS)
        values.append((w - m).square().sum())
    if not values:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return torch.stack(values).mean()


def server_nc_step(
    heads: Tensor,
    masks: Tensor,
    lr: float = 0.5,
    normalizer: int | None = None,
) -> Tensor:
    """FLUTE's server step: one plain gradient step on ``(1/n) sum_i R(W_i)`` (the code's ``ServerUpdateNC2``).

    ``heads`` ``(P, K, k)`` and ``masks`` ``(P, K)`` are the participating clients' head weights (no
    biases) and class masks; ``n`` is ``normalizer`` (the paper's ``N``) or ``P`` (the code's ``|S_t|``).
    Returns the updated heads (a new tensor). ``R`` is separable, so this is one step of size ``lr/n``
    on each head's own ``R``.
    """
    weights = heads.detach().clone().requires_grad_(True)
    n = heads.shape[0] if normalizer is None else normalizer
    loss = nc_regularizer(weights, masks.to(heads.dtype)).sum() / n
    (grad,) = torch.autograd.grad(loss, weights)
    return (weights - lr * grad).detach()
