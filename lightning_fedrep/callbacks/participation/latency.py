"""Simulated client latency for straggler experiments (SRPFL, FLANP).

A latency model says, for a round, how long each client takes. The draws are a pure function of the
model's seed, the round and the number of clients (a local ``torch.Generator`` seeded from them, never
the global RNG), so a run is reproducible and a resumed run sees the same latencies without saving
any generator state.

Each model's value is the client's local time for the round (``per="round"``, the paper's ``T_i``:
the time of one round's local work, as its experiments charge it) or its time per optimizer step
(``per="step"``: the local time is then the client's step count times the value). Used *on top of*
measured step times (``AdaptiveParticipation(latency=..., measure=True)``) the value is instead a
dimensionless slowdown factor of the client's measured seconds per step.

Models of the SRPFL paper (Tziotis et al., TMLR 2023) and its official code:

* :class:`FixedExponential`: one ``Exp(rate)`` value per client, drawn once (Sec. 5, "fixed").
* :class:`DynamicExponential`: every client gets a rate ``lambda_i ~ U[low, high]`` once (the paper:
  ``U[1/M, 1]``) and draws a new ``Exp(lambda_i)`` value every round; ``parameter="mean"`` reads the
  uniform draw as the mean instead (the official code: mean ``~ U[1, 100]``); ``low == high`` gives
  i.i.d. ``Exp`` redrawn every round (the setting of Theorem 4.9).
* :class:`TwoClassExponential`: a fraction of typical stragglers (App. C), means ``fast_mean`` and
  ``slow_mean`` (the paper's "lambda = 0.1 / 10" read as means, the only reading that makes the slow
  class slower).

Communication cost is not part of a model: ``AdaptiveParticipation(communication_cost=C)`` adds it
to every round.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.arguments import check_bool, check_choice, check_int, check_real
from lightning_fedrep.federation.plan import round_generator

__all__ = [
    "DynamicExponential",
    "FixedExponential",
    "LatencyModel",
    "TwoClassExponential",
    "exponential_order_statistic_mean",
]

_ONCE = -1  # generator key of draws made once per run (per-client speeds or rates)


def exponential_order_statistic_mean(k: int, n: int, rate: float = 1.0) -> float:
    """``E[T_(k)]``, the mean of the ``k``-th smallest of ``n`` i.i.d. ``Exp(rate)`` draws:
    ``(H_n - H_{n-k}) / rate`` (SRPFL App. B). ``k = n`` is the expected maximum."""
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n], got k={k}, n={n}.")
    return sum(1.0 / i for i in range(n - k + 1, n + 1)) / rate


def _exponential(num: int, rate: Tensor | float, generator: torch.Generator) -> Tensor:
    """``num`` draws of ``Exp(rate)`` (``rate`` a scalar or one per draw), float64, by inversion."""
    uniform = torch.rand(num, generator=generator, dtype=torch.float64)
    return -torch.log1p(-uniform) / rate


class LatencyModel:
    """Base class: ``sample(round, num_clients)`` returns every client's latency in that round.

    Args:
        per: ``"round"``: a value is the client's local time for the whole round (the paper's and
            its code's accounting); ``"step"``: a value is the time of one optimizer step, so the
            client's local time is its planned step count times the value.
        seed: seeds every draw of the model (with the round and a fixed key).
    """

    def __init__(self, per: Literal["round", "step"] = "round", seed: int = 0):
        owner = type(self).__name__
        check_choice("per", per, ("round", "step"), owner=owner)
        self.per = per
        self.seed = check_int("seed", seed, owner=owner)

    def sample(self, round_index: int, num_clients: int) -> Tensor:
        """Every client's latency in round ``round_index`` (float64, shape ``(num_clients,)``, > 0)."""
        raise NotImplementedError

    def config(self) -> dict:
        """The model's settings (saved with the callback's state to check a resumed run)."""
        return {
            "class": type(self).__name__,
            **{k: v for k, v in vars(self).items() if not k.startswith("_")},
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "class")
        return f"{type(self).__name__}({args})"


class FixedExponential(LatencyModel):
    """Each client's latency is drawn once from ``Exp(rate)`` (mean ``1/rate``) and kept for the run:
    the paper's "fixed" computational speeds (Sec. 5, footnote 1: ``rate = 1``)."""

    def __init__(self, rate: float = 1.0, per: Literal["round", "step"] = "round", seed: int = 0):
        super().__init__(per, seed)
        self.rate = check_real("rate", rate, low=0.0, low_open=True, owner=type(self).__name__)
        self._cache: dict[int, Tensor] = {}

    def sample(self, round_index: int, num_clients: int) -> Tensor:
        if num_clients not in self._cache:
            self._cache[num_clients] = _exponential(
                num_clients, self.rate, round_generator(self.seed, _ONCE, num_clients)
            )
        return self._cache[num_clients].clone()


class DynamicExponential(LatencyModel):
    """Every round each client draws a new latency from ``Exp(lambda_i)``; ``lambda_i`` is drawn once
    (or, with ``resample``, again every round).

    Args:
        low, high: the per-client parameter is ``U[low, high]``; ``low=None`` means ``1/M`` for ``M``
            clients (the paper's ``lambda_i ~ U[1/M, 1]``). ``low == high`` draws i.i.d. ``Exp``
            every round (Theorem 4.9's setting).
        parameter: ``"rate"`` (the paper): the uniform draw is the rate ``lambda_i``, mean ``1/lambda_i``;
            ``"mean"`` (the official code, ``low=1, high=100``): the uniform draw is the mean.
        resample: draw every client's parameter again every round (the official code's ``--resample``
            with ``noniid-hyper``: a new mean ``U[low, high]``, then the latency); ``False`` (the paper)
            draws the parameters once.
    """

    def __init__(
        self,
        low: float | None = None,
        high: float = 1.0,
        parameter: Literal["rate", "mean"] = "rate",
        per: Literal["round", "step"] = "round",
        seed: int = 0,
        resample: bool = False,
    ):
        super().__init__(per, seed)
        owner = type(self).__name__
        check_choice("parameter", parameter, ("rate", "mean"), owner=owner)
        self.resample = check_bool("resample", resample, owner=owner)
        check_real("high", high, low=0.0, low_open=True, owner=owner)
        if low is not None:
            check_real("low", low, low=0.0, high=high, low_open=True, owner=owner)
        self.low = None if low is None else float(low)
        self.high = float(high)
        self.parameter = parameter
        self._rates: dict[int, Tensor] = {}

    def rates(self, num_clients: int, round_index: int | None = None) -> Tensor:
        """The ``num_clients`` clients' rates ``lambda_i``: drawn once from the seed, or with ``resample``
        drawn again for round ``round_index``."""
        if self.resample and round_index is not None:
            return self._draw_rates(num_clients, round_generator(self.seed, round_index, num_clients))
        if num_clients not in self._rates:
            self._rates[num_clients] = self._draw_rates(
                num_clients, round_generator(self.seed, _ONCE, num_clients)
            )
        return self._rates[num_clients]

    def _draw_rates(self, num_clients: int, generator: torch.Generator) -> Tensor:
        low = 1.0 / num_clients if self.low is None else self.low
        uniform = torch.rand(num_clients, generator=generator, dtype=torch.float64)
        drawn = low + (self.high - low) * uniform
        return drawn if self.parameter == "rate" else 1.0 / drawn

    def sample(self, round_index: int, num_clients: int) -> Tensor:
        generator = round_generator(self.seed, round_index, num_clients)
        rates = self._draw_rates(num_clients, generator) if self.resample else self.rates(num_clients)
        return _exponential(num_clients, rates, generator)


class TwoClassExponential(LatencyModel):
    """Typical stragglers (SRPFL App. C): a fixed random ``straggler_fraction`` of the clients draws
    latencies with mean ``slow_mean``, the others with mean ``fast_mean``; redrawn every round
    (``dynamic=True``) or drawn once."""

    def __init__(
        self,
        straggler_fraction: float = 0.1,
        fast_mean: float = 0.1,
        slow_mean: float = 10.0,
        dynamic: bool = True,
        per: Literal["round", "step"] = "round",
        seed: int = 0,
    ):
        super().__init__(per, seed)
        owner = type(self).__name__
        check_real("straggler_fraction", straggler_fraction, low=0.0, high=1.0, owner=owner)
        check_real("fast_mean", fast_mean, low=0.0, low_open=True, owner=owner)
        check_real("slow_mean", slow_mean, low=0.0, low_open=True, owner=owner)
        check_bool("dynamic", dynamic, owner=owner)
        self.straggler_fraction = float(straggler_fraction)
        self.fast_mean = float(fast_mean)
        self.slow_mean = float(slow_mean)
        self.dynamic = bool(dynamic)

    def stragglers(self, num_clients: int) -> list[int]:
        """The clients of the slow class among ``num_clients`` (a seeded random subset, fixed for the run)."""
        count = int(round(self.straggler_fraction * num_clients))
        perm = torch.randperm(num_clients, generator=round_generator(self.seed, _ONCE, num_clients))
        return sorted(perm[:count].tolist())

    def sample(self, round_index: int, num_clients: int) -> Tensor:
        means = torch.full((num_clients,), self.fast_mean, dtype=torch.float64)
        means[self.stragglers(num_clients)] = self.slow_mean
        key = round_index if self.dynamic else _ONCE - 1
        return _exponential(num_clients, 1.0 / means, round_generator(self.seed, key, num_clients))
