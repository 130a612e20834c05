"""Low-rank linear model ``y_hat = w^T B^T x`` matching the FedRep synthetic problem (Algorithm 2).

The body is ``B`` (stored as ``body.weight = B^T``, shape ``(k, d)``) and is shared by all clients;
the head ``w`` (``head.weight = w^T``, shape ``(1, k)``) is personal. With ``exact_head=True`` a
head-only training step first sets the head to the exact least-squares solution on the batch, which is
Algorithm 2's ``w <- argmin_w f_hat(w, B)`` step.
"""

from __future__ import annotations

import lightning
import torch
from torch import Tensor, nn

from lightning_fedrep.data.subspace import principal_angle_distance

__all__ = ["LowRankLinear"]


def _half_squared_error(output: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (output.reshape(-1) - target.reshape(-1).to(output.dtype)) ** 2


class LowRankLinear(lightning.LightningModule):
    """Linear model ``y_hat = head(body(x)) = w^T B^T x`` for the low-rank linear regression problem.

    Args:
        dim: input dimension ``d``.
        rank: representation dimension ``k``.
        lr: SGD learning rate used by :meth:`configure_optimizers`.
        ground_truth_body: optional ``B*`` of shape ``(d, k)``; when given, the principal-angle distance
            of the learned body to it is logged as ``val/principal_angle`` / ``test/principal_angle``.
            Kept as a non-persistent buffer, so it is not part of the ``state_dict``.
        init_body: optional ``(d, k)`` initial representation (e.g. the method-of-moments init); its
            transpose is copied into ``body.weight``.
        exact_head: when the head is trainable and the body frozen (the strategy's head phase), set the
            head to the exact least-squares solution on each batch before computing the loss.
        init: ``"mom"`` takes the initial body from the data module's method-of-moments estimate
            (Algorithm 2) when fit starts; the data module must offer ``method_of_moments_init()``
            (:class:`~lightning_fedrep.data.low_rank.LowRankLinearDataModule`). Its ground truth is
            then also used for ``val/principal_angle`` if none was given.
    """

    fedrep_head = "head"
    """Marks ``self.head`` as the per-client head for the FedRep strategy."""

    @property
    def fedrep_loss(self):  # noqa: ANN201 (a callable or None)
        """What ``training_step`` computes per sample, ``(y_hat - y)^2 / 2``, for the strategy's vectorized
        engine; ``None`` with ``exact_head`` (a head phase then solves least squares, not a gradient step)."""
        return None if self.hparams.exact_head else _half_squared_error

    ground_truth_body: Tensor | None

    def __init__(
        self,
        dim: int = 20,
        rank: int = 2,
        lr: float = 0.1,
        ground_truth_body: Tensor | None = None,
        init_body: Tensor | None = None,
        exact_head: bool = True,
        init: str = "random",
    ) -> None:
        super().__init__()
        if init not in ("random", "mom"):
            raise ValueError(f"init must be 'random' or 'mom' (method of moments), got {init!r}.")
        self.save_hyperparameters(ignore=["ground_truth_body", "init_body"])
        self.body = nn.Linear(dim, rank, bias=False)
        self.head = nn.Linear(rank, 1, bias=False)
        if ground_truth_body is not None:
            if ground_truth_body.shape[0] != dim:
                raise ValueError(f"ground_truth_body has {ground_truth_body.shape[0]} rows, expected {dim}")
            self.register_buffer("ground_truth_body", ground_truth_body.detach().clone(), persistent=False)
        else:
            self.register_buffer("ground_truth_body", None, persistent=False)
        if init_body is not None:
            if tuple(init_body.shape) != (dim, rank):
                raise ValueError(f"init_body has shape {tuple(init_body.shape)}, expected {(dim, rank)}")
            with torch.no_grad():
                self.body.weight.copy_(init_body.T)

    def setup(self, stage: str) -> None:
        """Take the ground truth and (``init="mom"``) the initial body from a low-rank data module."""
        datamodule = getattr(self.trainer, "datamodule", None)
        problem = getattr(datamodule, "problem", None)
        if self.ground_truth_body is None and problem is not None:
            self.ground_truth_body = problem.ground_truth_body.detach().clone().to(self.device)
        if stage == "fit" and self.hparams.init == "mom":
            if not hasattr(datamodule, "method_of_moments_init"):
                raise ValueError(
                    "init='mom' needs a data module with method_of_moments_init() (LowRankLinearDataModule)."
                )
            with torch.no_grad():
                self.body.weight.copy_(datamodule.method_of_moments_init().T)

    def forward(self, x: Tensor) -> Tensor:
        """Predict ``y_hat`` of shape ``(batch, 1)`` from ``x`` of shape ``(batch, d)``."""
        return self.head(self.body(x))

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """``f_hat = (1/2m) sum_j (y_j - w^T B^T x_j)^2``, i.e. half the mean squared error."""
        return 0.5 * torch.mean((self(x) - y.reshape(-1, 1)) ** 2)

    @torch.no_grad()
    def fit_head_exactly(self, x: Tensor, y: Tensor) -> None:
        """Set the head to ``argmin_w ||y - B^T x w||^2`` on ``(x, y)`` (least squares on the features)."""
        features = self.body(x)
        target = y.reshape(-1, 1)
        if features.device.type in ("cpu", "cuda"):
            features, target = features.double(), target.double()
        solution = torch.linalg.lstsq(features, target).solution  # (k, 1)
        self.head.weight.copy_(solution.T.to(self.head.weight.dtype))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Return the loss; in the head-only phase with ``exact_head`` first solve the head exactly.

        After the exact solve the head's gradient is ~0, so the optimizer step (plain SGD) leaves the
        exact solution in place.
        """
        x, y = batch
        if self.hparams.exact_head and self.head.weight.requires_grad and not self.body.weight.requires_grad:
            self.fit_head_exactly(x, y)
        loss = self.loss(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Log ``val/mse`` (half the mean squared error, the paper's test-MSE convention)."""
        x, y = batch
        loss = self.loss(x, y)
        self.log("val/mse", loss, on_epoch=True, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Log ``test/mse`` (half the mean squared error)."""
        x, y = batch
        loss = self.loss(x, y)
        self.log("test/mse", loss, on_epoch=True)
        return loss

    def principal_angle(self) -> float | None:
        """Principal-angle distance of ``col(B)`` to ``col(B*)``, or ``None`` without a ground truth."""
        if self.ground_truth_body is None:
            return None
        return principal_angle_distance(self.body.weight.T, self.ground_truth_body)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/principal_angle`` when a ground truth is known."""
        distance = self.principal_angle()
        if distance is not None:
            self.log("val/principal_angle", distance)

    def on_test_epoch_end(self) -> None:
        """Log ``test/principal_angle`` when a ground truth is known."""
        distance = self.principal_angle()
        if distance is not None:
            self.log("test/principal_angle", distance)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD over all parameters with learning rate ``lr``."""
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
