"""Personalized evaluation of many clients at once (the evaluation side of the vectorized runner).

Per :class:`~lightning_fedrep.data.loaders.ClientChunk` of clients: one forward pass of the global body
over all their samples (clients whose own tensors change the features, LG-FedAvg's local body or a
fine-tuned body, get their own pass), then every client's head on its own features in one
``torch.func.vmap``, and the headline metrics' sums per client, as the per-batch path computes them
(:func:`~lightning_fedrep.evaluation.metrics.headline_sums_per_client`).

It applies only where that is the whole evaluation: the module declares that its evaluation steps
log nothing beyond the headline metrics (``fedrep_evaluation = "headline"``) and its output is
``head(features(x))`` in evaluation mode (checked on a probe batch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.evaluation.metrics import ClientMetrics, headline_sums_per_client
from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.module.feature_split import FeatureSplit, evaluation_split
from lightning_fedrep.federation.module.untouched import untouched_random_state
from lightning_fedrep.runners.lockstep.loading import ClientChunkLike, EvaluationProbe

EVALUATION_CHUNK_SAMPLES = 4096
"""Samples per batched evaluation step (consecutive clients, a larger client alone)."""

HEADLINE_ONLY = "headline"
"""The value of ``fedrep_evaluation`` declaring that ``validation_step``/``test_step`` log nothing the
strategy's headline metrics (``acc``, ``loss``) do not."""


def declares_headline_only(module: nn.Module) -> bool:
    """Whether the module declares ``fedrep_evaluation = "headline"``."""
    return getattr(module, "fedrep_evaluation", None) == HEADLINE_ONLY


def batched_evaluation(
    module: nn.Module,
    federation: Federation,
    loader: EvaluationProbe,
    device: torch.device,
    convert_input: Callable[[Any], Any] | None = None,
) -> BatchedEvaluation | None:
    """The batched evaluation of ``module`` on ``loader``'s clients where it is the whole evaluation
    (the declaration, ``(x, y)`` tensor batches, a verified feature split), else ``None``.
    ``convert_input`` is what Lightning does to a batch before the step (the trainer's precision), applied
    to the probe batch as Lightning applies it to the evaluated chunks."""
    if not declares_headline_only(module) or not federation.has_state or not federation.split.head:
        return None
    with untouched_random_state():  # a data set's random transforms must not shift the run's generators
        probe = loader.first_batch()
    if not (isinstance(probe, list | tuple) and len(probe) == 2 and isinstance(probe[0], Tensor)):
        return None
    x = (convert_input or (lambda batch: batch))(probe[0])
    split = evaluation_split(module, federation.split.head, x.to(device))
    return BatchedEvaluation(split, federation.split.head) if split is not None else None


class BatchedEvaluation:
    """Adds a :class:`ClientChunk`'s per-client headline sums to an evaluation pass's metrics.

    Args:
        split: how to run the features and the head with any tensors.
        head_names: the parameter names the head consists of.
    """

    def __init__(self, split: FeatureSplit, head_names: tuple[str, ...]):
        self.split = split
        self.head_names = tuple(head_names)

    @torch.no_grad()
    def add(
        self,
        chunk: ClientChunkLike,
        module: nn.Module,
        federation: Federation,
        metrics: ClientMetrics,
        stage: str,
        precision_context: Callable[[], AbstractContextManager],
    ) -> None:
        """Evaluate every client of ``chunk`` on its own model and record its metric sums."""
        clients, sizes = chunk.clients.tolist(), chunk.sizes.tolist()
        fixed = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        base = {**fixed, **federation.global_view()}
        personal = [federation.evaluation_tensors(c) for c in clients]
        inputs = chunk.inputs.split(sizes)
        with precision_context():
            shared_features = None
            features: list[Tensor] = []
            for k, (own, x) in enumerate(zip(personal, inputs)):
                if any(n not in self.head_names for n in own):  # its own tensors change its features
                    features.append(self.split.features({**base, **own}, x))
                    continue
                if shared_features is None:
                    shared_features = self.split.features(base, chunk.inputs).split(sizes)
                features.append(shared_features[k])
            outputs = self._heads(base, personal, features)
        rows, columns = _padded_positions(chunk.sizes.to(chunk.targets.device))
        padded = chunk.targets.new_zeros((len(clients), max(sizes), *chunk.targets.shape[1:]))
        padded[rows, columns] = chunk.targets
        mask = torch.zeros(padded.shape[:2], device=padded.device)
        mask[rows, columns] = 1.0
        sums = {
            name: totals.tolist()
            for name, totals in (headline_sums_per_client(outputs, padded, mask) or {}).items()
        }
        for k, (client, size) in enumerate(zip(clients, sizes)):
            metrics.samples[client] += size
            for name, totals in sums.items():
                metrics.add(f"{stage}/{name}", client, totals[k], size)

    def _heads(
        self, base: dict[str, Tensor], personal: list[dict[str, Tensor]], features: list[Tensor]
    ) -> Tensor:
        """Every client's head on its features, in one ``vmap`` over the clients (padded)."""
        flat = torch.cat(features)
        rows, columns = _padded_positions(torch.tensor([len(f) for f in features], device=flat.device))
        stacked_features = flat.new_zeros((len(features), int(columns.max()) + 1, *flat.shape[1:]))
        stacked_features[rows, columns] = flat
        heads = {
            n: torch.stack([own.get(n, base[n]) for own in personal]) for n in self.head_names if n in base
        }
        rest = {n: t for n, t in base.items() if n not in heads}
        split = self.split

        def client_output(head: dict[str, Tensor], f: Tensor) -> Tensor:
            return split.head({**rest, **head}, f)

        return torch.func.vmap(client_output)(heads, stacked_features)


def _padded_positions(sizes: Tensor) -> tuple[Tensor, Tensor]:
    """Row (client) and column (its sample) of every sample when clients of ``sizes`` samples are
    laid out one per row, padded on the right."""
    rows = torch.repeat_interleave(torch.arange(len(sizes), device=sizes.device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    columns = torch.arange(int(sizes.sum()), device=sizes.device) - starts[rows]
    return rows, columns
