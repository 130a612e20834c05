"""FedBN (Li et al., ICLR 2021): FedAvg whose BatchNorm layers stay on the client.

Every client trains the whole model for ``local_epochs``; the server averages everything but the BatchNorm
layers (sample-weighted, as FedAvg), whose affine parameters (``weight``, ``bias``) and running statistics
(``running_mean``, ``running_var``, ``num_batches_tracked``) never leave the client: each client trains, keeps
and is scored with its own (:meth:`~lightning_fedrep.Algorithm.keep_local`). A client's model is the global
non-BatchNorm tensors with its own BatchNorm layers; one that never trained has the module's initial ones.
"""

from __future__ import annotations

import re
import warnings

from torch import nn

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["FedBN"]

BATCH_NORM = nn.modules.batchnorm._BatchNorm
"""The module type FedBN keeps local: ``BatchNorm1d/2d/3d``, their lazy variants and ``SyncBatchNorm``."""


class FedBN(Algorithm):
    """FedAvg with every BatchNorm layer kept per client: parameters and running statistics.

    Args:
        pattern: ``None`` (the default) keeps local the tensors of every BatchNorm module, found by type
            (``nn.modules.batchnorm._BatchNorm``), whatever it is called: torchvision ResNet's downsample
            BatchNorm (``layer1.0.downsample.1``) included. A regular expression keeps local every parameter
            and buffer whose full name it matches (``re.search``) instead: ``pattern="bn"`` is the authors'
            (``med-air/FedBN``) and PFLlib's rule, ``'bn' in name``, which shares a BatchNorm not named so.

    The authors' code averages every state-dict key without ``bn`` (so other buffers are shared) with
    uniform weights; PFLlib averages parameters only (every buffer stays local) with sample weights. Here
    the BatchNorm tensors are local, other buffers follow the strategy's ``buffers=`` (``"shared"``, the
    authors'; ``"local"``, PFLlib's) and ``weighting=`` chooses the weights (``"samples"`` by default, PFLlib's;
    ``"uniform"``, the authors'). Official settings: SGD lr 1e-2, batch 32, 1 local epoch, 100 rounds, all
    clients every round. On a module without BatchNorm FedBN is FedAvg (a warning says so).

    Runners: the sequential one. The vectorized runner does not run BatchNorm in train mode (batch statistics
    per client), so ``runner="auto"`` runs FedBN sequentially, naming the layer, and ``runner="vectorized"``
    refuses it.

    ``Trainer(strategy="fedbn")`` (and ``"fedbn_ddp"``) uses ``FedBN()``.
    """

    def __init__(self, pattern: str | None = None):
        super().__init__(
            "fedbn",
            {"body", "head"},
            "FedBN: FedAvg whose BatchNorm layers (parameters and statistics) stay local.",
        )
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern:
                raise TypeError(
                    f"FedBN(pattern=...) must be a regular expression matched against tensor names (e.g. 'bn', "
                    f"PFLlib's rule) or None (BatchNorm modules by type), got {pattern!r}."
                )
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"FedBN(pattern={pattern!r}) is not a regular expression: {error}."
                ) from None
        self.pattern = pattern

    def keep_local(self, module: nn.Module) -> list[str]:
        """The BatchNorm tensors (by module type, or the names ``pattern`` matches), warning when there are none."""
        if self.pattern is None:
            names = [
                f"{prefix}.{name}" if prefix else name
                for prefix, sub in module.named_modules()
                if isinstance(sub, BATCH_NORM)
                for name, _ in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
            ]
        else:
            tensors = [*module.named_parameters(), *module.named_buffers()]
            names = [name for name, _ in tensors if re.search(self.pattern, name)]
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        buffers = {n for n, _ in module.named_buffers()} & set(module.state_dict())  # persistent ones
        names = [n for n in names if n in trainable or n in buffers]  # frozen ones are fixed anyway
        if not names:
            what = (
                "BatchNorm module" if self.pattern is None else f"tensor whose name matches {self.pattern!r}"
            )
            warnings.warn(
                f"FedBN: {type(module).__name__} has no {what}, so FedBN is FedAvg on it.", stacklevel=2
            )
        return names

    def __repr__(self) -> str:
        return f"FedBN(pattern={self.pattern!r})"


register_algorithm(FedBN())
