"""What an evaluation pass leaves behind: the values logged, the history rows and last-10 means, notes.

Lightning-free: the strategy hands in the finished :class:`~lightning_fedrep.evaluation.metrics.EvaluationPass`
and what it read from the Trainer (the batches run, the setting that cut the pass), then logs the values
and warns with the notes returned here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_fedrep.evaluation.metrics import ClientMetrics, EvaluationPass, coverage_note
from lightning_fedrep.federation.history import LAST_ROUNDS, History


def gather_pass(evaluation: EvaluationPass, all_gather_object: Callable[[Any], list[Any]]) -> None:
    """Every process's per-client sums in one table on every process (one all-gather)."""
    states = all_gather_object((evaluation.headline, evaluation.metrics.state()))
    evaluation.metrics = ClientMetrics()
    for _, state in states:
        evaluation.metrics.merge(state)
    evaluation.headline = all(headline for headline, _ in states)


def non_finite_note(evaluation: EvaluationPass) -> str | None:
    """The clients whose metrics are NaN (non-finite model outputs), as a warning; ``None`` if none."""
    metrics = evaluation.metrics
    broken = sorted({c for name in metrics.names for c, v in metrics.per_client(name).items() if v != v})
    if not broken:
        return None
    return (
        f"{evaluation.stage}: the model's outputs are not finite for clients {broken[:20]}"
        f"{' ...' if len(broken) > 20 else ''}; their metrics (and the summaries over clients) are NaN."
    )


def partial_pass_note(
    evaluation: EvaluationPass,
    client_sizes: Sequence[int],
    batches_run: int | None,
    batches_in_pass: int,
    cause: str,
) -> str | None:
    """Which clients a pass cut short (``limit_val_batches``, ``fast_dev_run``) evaluated, when it ran fewer
    than ``batches_in_pass`` batches: its summaries describe them, not the federation; else ``None``.

    ``client_sizes``: each client's number of samples in the evaluated split.
    """
    if batches_run is None or batches_run >= batches_in_pass:
        return None
    expected = {c: size for c, size in enumerate(client_sizes) if size}
    return coverage_note(evaluation.stage, dict(evaluation.metrics.samples), expected, cause)


def pass_values(
    evaluation: EvaluationPass, history: History, round_index: int, prefix: str, in_fit: bool
) -> dict[str, float]:
    """The values to log for a finished pass: every metric's summary over clients (names prefixed with a
    fine-tuning round's ``prefix``). A validation in fit also records the round in ``history``: a federated
    round's summary and per-client values, with the last-10 means, their round count, the best round so far
    of the headline accuracies (``val/acc_best``, ``val/acc_weighted_best``: selected on the evaluated split,
    optimistic) and ``round`` added to the values; a fine-tuning round's summary as ``history.finetune`` and
    as recorded columns of its round (``history.csv``'s row of that round), outside the federated rounds'
    figures."""
    values = evaluation.summary(prefix)
    if not in_fit:
        return values
    if prefix:
        history.finetune = dict(values)
        history.record(round_index, values)
        return values
    names = evaluation.metrics.names
    history.add_evaluation(round_index, values)
    history.add_client_values(round_index, {name: evaluation.metrics.per_client(name) for name in names})
    means = history.last_rounds_mean()
    values.update(
        {f"{key}_last10": means[key] for name in names for key in (name, f"{name}_weighted") if key in means}
    )
    values[f"{evaluation.stage}/last10_rounds"] = float(min(LAST_ROUNDS, history.evaluated_rounds))
    best, _ = history.best_rounds()
    values.update({f"{key}_best": value for key, value in best.items()})
    values["round"] = float(round_index)  # W&B's step for validation metrics
    return values


def empty_clients_note(stage: str, client_sizes: Sequence[int]) -> str | None:
    """The clients without samples in an evaluation (or prediction, ``stage="predict"``) split, which are
    left out, as a warning; ``None`` if every client has samples."""
    empty = [c for c, size in enumerate(client_sizes) if not size]
    if not empty:
        return None
    shown = str(empty) if len(empty) <= 10 else f"{empty[:10]} ..."
    what = (
        "get no predictions"
        if stage == "predict"
        else f"are left out of {stage}/acc and every {stage} summary over clients"
    )
    return (
        f"{stage}: {len(empty)} of {len(client_sizes)} clients have no {stage} samples and {what}: "
        f"clients {shown}. Give every client evaluation data (more test samples, val_fraction, another "
        "partition) to evaluate the whole federation."
    )
