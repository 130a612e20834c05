"""Personalized evaluation: per-client metric accumulators, one evaluation pass, the summary over clients."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

SUMMARY_SUFFIXES = ("", "_weighted", "_std", "_p10", "_min")


def summarize(values: Tensor, weights: Tensor) -> dict[str, float]:
    """Reduce one metric's per-client values: client mean, weighted mean, std, 10th percentile, min.

    ``weights`` are the clients' numbers of evaluation samples. The std is the population std over
    clients; the percentile interpolates linearly (``torch.quantile``).
    """
    values = values.double()
    weights = weights.double()
    return {
        "": values.mean().item(),
        "_weighted": ((values * weights).sum() / weights.sum()).item(),
        "_std": values.std(correction=0).item() if values.numel() > 1 else 0.0,
        "_p10": torch.quantile(values, 0.1).item(),
        "_min": values.min().item(),
    }


def headline_sums(output: Tensor, target: Tensor) -> dict[str, Tensor] | None:
    """Sums of the headline metrics of one batch: accuracy and cross-entropy for integer labels,
    mean squared error for real targets; ``None`` when the output does not fit the target."""
    if not isinstance(output, Tensor) or not isinstance(target, Tensor) or output.shape[0] != target.shape[0]:
        return None
    sums = headline_sums_per_client(output[None], target[None], output.new_ones(1, output.shape[0]))
    return None if sums is None else {name: value[0] for name, value in sums.items()}


def headline_sums_per_client(outputs: Tensor, targets: Tensor, mask: Tensor) -> dict[str, Tensor] | None:
    """:func:`headline_sums` of many clients at once: ``outputs[c, i]`` and ``targets[c, i]`` are
    client ``c``'s ``i``-th sample where ``mask[c, i]`` is 1 (padding elsewhere). Float64 sums per client."""
    outputs = outputs.detach().float()
    weights = mask.double()
    clients, samples = targets.shape[:2]
    if not targets.is_floating_point() and targets.dim() == 2 and outputs.dim() == 3:
        per_sample = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="none")
        # a sample whose logits hold a NaN or +inf (or are all -inf) has no class: its accuracy is NaN, not
        # argmax's class 0; a -inf logit alone rules its class out (a masked class, e.g. FedProto's class
        # without a prototype) and leaves the sample scored
        correct = (outputs.argmax(dim=2) == targets).double()
        correct[no_class(outputs)] = float("nan")
        return {
            "acc": (correct * weights).nansum(1) + _nan_where_any(correct, weights),
            "loss": (per_sample.view(clients, samples).double() * weights).nansum(1)
            + _nan_where_any(per_sample.view(clients, samples).double(), weights),
        }
    if targets.is_floating_point() and outputs.numel() == targets.numel():
        difference = outputs.reshape(targets.shape) - targets.float()
        per_sample = difference.pow(2).reshape(clients, samples, -1).mean(dim=2)
        return {"loss": (per_sample.double() * weights).sum(1)}
    return None


def no_class(outputs: Tensor) -> Tensor:
    """Per sample (the last dimension holds the class scores): whether the scores name no class, i.e. hold a
    NaN or +inf, or are -inf for every class."""
    return (
        torch.isnan(outputs).any(dim=-1)
        | torch.isposinf(outputs).any(dim=-1)
        | torch.isneginf(outputs).all(dim=-1)
    )


def _nan_where_any(values: Tensor, weights: Tensor) -> Tensor:
    """Per client: NaN if any of its (unmasked) values is NaN, else 0 (padding rows never count)."""
    bad = (torch.isnan(values) & (weights > 0)).any(dim=1)
    return torch.where(
        bad,
        torch.full_like(bad, float("nan"), dtype=torch.float64),
        torch.zeros_like(bad, dtype=torch.float64),
    )


class ClientMetrics:
    """Sums of each metric per client over one evaluation pass, and their per-client means."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.counts: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.samples: dict[int, int] = defaultdict(int)
        self.options: dict[str, dict[str, Any]] = {}
        """Per user-logged key, the ``prog_bar``/``logger`` flags it was logged with."""

    @property
    def names(self) -> list[str]:
        """The metrics measured in this pass (e.g. ``val/acc``, ``val/loss``, the user's own keys)."""
        return list(self.sums)

    def add(self, name: str, client: int, total: float, count: float) -> None:
        self.sums[name][client] += total
        self.counts[name][client] += count

    def capture(self, name: str, value: Any, client: int, size: int, arguments: dict[str, Any]) -> bool:
        """Add ``value``, logged as ``name`` with the logging call's ``arguments`` (``reduce_fx``, ``batch_size``,
        ``prog_bar``, ``logger``), to ``client``'s sums when it is a mean-reduced scalar (weighted by the batch
        size, ``size`` where the call gives none), keeping its flags; whether it was taken (else the caller logs
        it unchanged: a torchmetrics ``Metric``, another ``reduce_fx``)."""
        scalar = value.detach() if isinstance(value, Tensor) and value.numel() == 1 else value
        mean_reduced = arguments.get("reduce_fx", "mean") in ("mean", torch.mean)
        if not mean_reduced or not isinstance(scalar, Tensor | float | int) or isinstance(scalar, bool):
            return False
        batch = arguments.get("batch_size") or size
        self.add(name, client, float(scalar) * batch, batch)
        flags = {"prog_bar": arguments.get("prog_bar", False), "logger": arguments.get("logger")}
        self.options.setdefault(name, flags)
        return True

    def per_client(self, name: str) -> dict[int, float]:
        """The metric ``name`` (one of :attr:`names`, e.g. ``"test/acc"``) of each client: a ``dict`` from
        client id (``int``, ascending) to the metric's mean over that client's evaluation samples (``float``),
        for every client the pass scored (the summaries ``test/acc``, ``test/acc_std``, ... are over these).

        Raises:
            KeyError: ``name`` is not a metric of this pass; the message lists the pass's metrics.
        """
        if name not in self.sums:
            raise KeyError(
                f"{name!r} is not a metric of this evaluation pass; its metrics are {self.names} (the headline "
                "metrics carry the pass's stage prefix, e.g. 'val/acc' or 'test/acc', and the module's own keys "
                "are as logged)."
            )
        return {
            c: s / self.counts[name][c]
            for c, s in sorted(self.sums[name].items())
            if self.counts[name][c] > 0
        }

    def state(self) -> dict[str, Any]:
        """The sums, counts and samples as plain dicts: what another process adds with :meth:`merge`."""
        return {
            "sums": {name: dict(values) for name, values in self.sums.items()},
            "counts": {name: dict(values) for name, values in self.counts.items()},
            "samples": dict(self.samples),
            "options": dict(self.options),
        }

    def merge(self, state: dict[str, Any]) -> None:
        """Add another process's :meth:`state` (its clients' sums and counts: exact, not a mean of means)."""
        for name, values in state["sums"].items():
            for client, total in values.items():
                self.add(name, client, total, state["counts"][name][client])
        for client, samples in state["samples"].items():
            self.samples[client] += samples
        for name, flags in state["options"].items():
            self.options.setdefault(name, flags)

    def prefixed(self, prefix: str) -> ClientMetrics:
        """A copy whose metrics are named ``prefix + name`` (``finetune/val/acc`` for a fine-tuning round's
        ``val/acc``), the same clients and samples."""
        renamed = ClientMetrics()
        for name in self.names:
            renamed.sums[prefix + name].update(self.sums[name])
            renamed.counts[prefix + name].update(self.counts[name])
        renamed.samples.update(self.samples)
        renamed.options = {prefix + name: dict(flags) for name, flags in self.options.items()}
        return renamed

    def summary(self, name: str) -> dict[str, float]:
        """The metric ``name`` reduced over the clients of :meth:`per_client` (``evaluation.summarize``):
        suffix (``""``, ``"_weighted"``, ``"_std"``, ``"_p10"``, ``"_min"``) -> value."""
        per_client = self.per_client(name)
        clients = list(per_client)
        values = torch.tensor([per_client[c] for c in clients])
        weights = torch.tensor([float(self.samples[c]) for c in clients])
        return summarize(values, weights)


CaptureLogs = Callable[[Any, ClientMetrics, int, int], AbstractContextManager[set[str]]]
"""``capture(module, metrics, client, size)``: a context in which the user's step logs into ``metrics`` for
``client`` (a batch of ``size`` samples); it yields the set of keys logged
(:func:`lightning_fedrep.lightning.capture.capture_logs`)."""


class EvaluationPass:
    """One personalized evaluation pass (a validation or test run over every client's batches).

    The strategy loads each batch's client, then :meth:`step` runs the user's step with its logging
    captured per client (``capture``) and adds the headline metrics from ``model(x)``; :meth:`summary`
    reduces every metric over clients at the end of the pass. ``batch_size`` counts a batch's samples.
    """

    def __init__(
        self, stage: str, capture: CaptureLogs, batch_size: Callable[[Any], int], headline: bool = True
    ):
        self.stage = stage
        self._capture = capture
        self._batch_size = batch_size
        self.headline = headline
        """Whether headline metrics are computed; turned off (with a warning) if ``model(x)`` fails, does not
        fit the labels, or the batches are not ``(x, y)`` pairs."""
        self.metrics = ClientMetrics()
        """The pass's per-client sums, under the stage's own names (``val/acc``), whatever :attr:`prefix`."""
        self.logged: set[str] = set()
        """Every key the user's step logged in this pass (also those that go to Lightning unchanged)."""
        self.prefix = ""
        """What the pass's names carry in front (``"finetune/"`` after a fine-tuning round), set with
        :meth:`name_under` when the pass is logged."""

    def name_under(self, prefix: str) -> None:
        """Name the pass's results ``prefix + name`` (``finetune/val/acc``): :attr:`key` and
        :meth:`named_metrics` (the logged summary takes the same prefix in
        :func:`~lightning_fedrep.evaluation.records.pass_values`)."""
        self.prefix = prefix

    @property
    def key(self) -> str:
        """The pass's key in ``strategy.client_metrics``: its stage under its prefix (``"val"``, ``"test"``,
        ``"finetune/val"``), so that ``client_metrics[key]`` holds the per-client values of the summary
        logged under the same names."""
        return self.prefix + self.stage

    def named_metrics(self) -> ClientMetrics:
        """The per-client metrics under the pass's names: :attr:`metrics` itself, or a copy named
        ``prefix + name`` (``finetune/val/acc``) after :meth:`name_under`."""
        return self.metrics.prefixed(self.prefix) if self.prefix else self.metrics

    def step(
        self,
        module: torch.nn.Module,
        run_step: Callable[[], Any],
        batch: Any,
        client: int,
        precision_context: Callable[[], AbstractContextManager],
    ) -> Any:
        """Run the user's evaluation step on ``client``'s batch and record its metrics."""
        size = self._batch_size(batch)
        self.metrics.samples[client] += size
        with self._capture(module, self.metrics, client, size) as user_keys:
            output = run_step()
        self.logged |= user_keys
        if self.headline and isinstance(batch, list | tuple) and len(batch) == 2:
            self._add_headline(module, batch, client, size, user_keys, precision_context)
        elif self.headline:
            self._turn_off_headline_without_pairs(batch, user_keys)
        return output

    def nothing_logged_note(self) -> str | None:
        """After the pass: what to say when it evaluated samples but recorded no metric at all (the user's
        step logged nothing and no headline metric was computed), else ``None``."""
        if not self.metrics.samples or self.metrics.names or self.logged:
            return None
        step = "validation_step" if self.stage == "val" else f"{self.stage}_step"
        return (
            f"The {self.stage} pass logged no metric, so it evaluated nothing: {step} logs nothing (self.log) "
            f"and the headline {self.stage}/acc and {self.stage}/loss are not computed (headline_metrics=False, "
            f"or turned off by an earlier warning). Log a metric in {step}, or give (x, y) batches and "
            "headline_metrics=True, for the pass to measure the clients' models."
        )

    def _add_headline(
        self,
        module: torch.nn.Module,
        batch: Any,
        client: int,
        size: int,
        user_keys: set[str],
        precision_context: Callable[[], AbstractContextManager],
    ) -> None:
        try:
            with torch.no_grad(), precision_context():
                output = module(batch[0])
                sums = headline_sums(output, batch[1])
        except Exception as error:  # the module's forward may not take ``x`` alone
            self.headline = False
            warnings.warn(
                f"Could not compute {self.stage}/acc and {self.stage}/loss from model(x) on (x, y) batches "
                f"({error!r}); they are turned off. Log your own metrics in validation_step/test_step, or "
                "pass headline_metrics=False to silence this.",
                UserWarning,
                stacklevel=2,
            )
            return
        if sums is None:
            self._turn_off_headline(output, batch[1], user_keys)
            return
        for name, total in sums.items():
            key = f"{self.stage}/{name}"
            if key not in user_keys:
                self.metrics.add(key, client, total.item(), size)

    def _turn_off_headline_without_pairs(self, batch: Any, user_keys: set[str]) -> None:
        """The batches are not ``(x, y)`` pairs (dicts, triples): the strategy cannot tell input from label
        to run ``model(x)``; say so, unless the user's step logs both headline keys itself, and stop."""
        self.headline = False
        missing = [f"{self.stage}/{n}" for n in ("acc", "loss") if f"{self.stage}/{n}" not in user_keys]
        if not missing:
            return
        shown = f"dicts with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else _describe(batch)
        warnings.warn(
            f"{' and '.join(missing)} are not computed: the {self.stage} batches are {shown}, not (x, y) pairs, "
            "so the strategy cannot run model(x) and compare it with the labels. Give (input, label) samples, "
            f"or log {self.stage}/acc (and {self.stage}/loss) in your evaluation step yourself (summarized over "
            "clients as the headline is), or pass headline_metrics=False to silence this.",
            UserWarning,
            stacklevel=3,
        )

    def _turn_off_headline(self, output: Any, target: Any, user_keys: set[str]) -> None:
        """``model(x)`` does not fit the target (a tuple, another shape): say so, unless the user's step
        logs both headline keys itself, and stop computing them."""
        self.headline = False
        missing = [f"{self.stage}/{n}" for n in ("acc", "loss") if f"{self.stage}/{n}" not in user_keys]
        if not missing:
            return
        warnings.warn(
            f"{' and '.join(missing)} are not computed: model(x) returned {_describe(output)}, which does not "
            f"fit the target ({_describe(target)}): they need a tensor of logits (batch, classes) for integer "
            "labels, or of the target's size for real targets. Return that from forward, log your own "
            "metrics in validation_step/test_step, or pass headline_metrics=False to silence this.",
            UserWarning,
            stacklevel=3,
        )

    def summary(self, prefix: str = "") -> dict[str, float]:
        """Every metric's summary over clients: ``prefix + name + suffix`` for each of ``SUMMARY_SUFFIXES``."""
        return {
            prefix + name + suffix: value
            for name in self.metrics.names
            for suffix, value in self.metrics.summary(name).items()
        }

    def logging_options(self, key: str) -> dict[str, Any]:
        """The ``prog_bar``/``logger`` flags the user logged ``key`` with (headline ``/acc``: progress bar)."""
        options = self.metrics.options.get(key, {})
        return {"prog_bar": options.get("prog_bar", key.endswith("/acc")), "logger": options.get("logger")}


def _describe(value: Any) -> str:
    """A short description of a model output or target, for messages."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def coverage_note(stage: str, samples: dict[int, int], expected: dict[int, int], cause: str) -> str | None:
    """What a pass evaluated when it is not every client's whole split, else ``None``.

    ``samples``: the samples each client was evaluated on; ``expected``: every client with evaluation
    data and its split's size; ``cause``: the setting that cut the pass (``"limit_val_batches=1"``).
    """
    evaluated = sorted(c for c in expected if samples.get(c, 0) > 0)
    cut = [c for c in evaluated if samples[c] < expected[c]]
    if len(evaluated) == len(expected) and not cut:
        return None
    shown = ", ".join(f"{c} ({samples[c]} of {expected[c]} samples)" for c in cut[:5])
    shown += " ..." if len(cut) > 5 else ""
    return (
        f"{stage}/acc and every {stage} summary over clients are over {len(evaluated)} of {len(expected)} "
        f"clients ({cause}): clients {_clients(evaluated)}"
        + (f"; cut short: {shown}" if cut else "")
        + f". They describe these clients, not the federation; evaluate every client's whole split "
        f"(remove {cause.split('=')[0]}) for the federation's figures."
    )


def _clients(clients: list[int]) -> str:
    return str(clients) if len(clients) <= 10 else f"{clients[:10]} ... ({len(clients)})"
