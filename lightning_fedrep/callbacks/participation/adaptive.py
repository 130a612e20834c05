"""``AdaptiveParticipation``: straggler-resilient participation (SRPFL / FLANP) with a simulated clock.

Each round the strategy samples its usual pool of clients (all of them under full participation).
The callback keeps only the ``n`` fastest of the pool, where ``n`` starts at ``initial_clients`` and
doubles every stage of ``rounds_per_stage`` rounds, capped at the pool size (Algorithm 1 of Tziotis et
al., "Straggler-Resilient Personalized Federated Learning", TMLR 2023; the schedule of its official
code). The participating set then trains as a normal round of the strategy's algorithm: FedRep gives
FedRep-SRPFL, LG-FedAvg gives LG-SRPFL, FedAvg gives FLANP.

"Fastest" comes from a latency estimate per client:

* **measured** (default): the strategy times every step of every client (wall clock, the device
  synchronised on GPU; the first step after a client was loaded, which pays for the swap, and the
  round's last step, which pays for the aggregation, are not timed; ``ClientResult.seconds``) and the
  callback keeps an exponential moving average of each client's seconds per step. A client's expected local time is its planned
  steps times that estimate; a client never measured counts as fastest, so it gets measured.
* **simulated**: a :class:`~lightning_fedrep.callbacks.participation.latency.LatencyModel` (fixed or dynamic
  exponential speeds, ...) gives each client's latency in the round; the selection uses the current
  round's draws (the server aggregates the first ``n`` models that come back, Remark 3.1).
* **both** (``latency=...`` and ``measure=True``): the simulated value multiplies the measured seconds
  per step, simulating heterogeneous devices on top of the real cost of the model.

A simulated clock advances every round by the slowest selected client's local time plus
``communication_cost``; it is logged as ``sim/time`` (and the round's participant count as
``sim/participants``) so metrics can be plotted against it, and recorded as the ``sim/time`` column of
every round's history row (``strategy.history``, hence the run summary). The schedule's decisions, the estimates and the clock are
saved with the checkpoint: a resumed run makes exactly the decisions the interrupted run made, even
when they came from wall-clock measurements that a rerun could not reproduce. In simulated mode
everything is a deterministic function of the seeds.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedrep.callbacks.participation.latency import LatencyModel
from lightning_fedrep.federation.api.arguments import check_bool, check_int, check_optional_int, check_real
from lightning_fedrep.federation.plan import RoundPlan, sample_clients
from lightning_fedrep.lightning.callback import FederatedCallback, RoundResult

__all__ = ["AdaptiveParticipation"]

_STATE_VERSION = 1


class AdaptiveParticipation(FederatedCallback):
    """Train each round with only the fastest clients of the pool, doubling their number every stage.

    Args:
        initial_clients: ``n0``, the participants of the first stage. ``None`` keeps the whole pool
            every round (the straggler-prone baselines FedRep / LG-FedAvg / FedAvg) and only runs the
            clock, so baselines and SRPFL are timed the same way.
        rounds_per_stage: rounds before ``n`` doubles (the code's ``double_freq``, 10). A list gives
            each stage's length; its last entry repeats.
        latency: a simulated latency model; ``None`` measures wall-clock step times.
        measure: time the steps. Defaults to ``latency is None``; with a latency model and
            ``measure=True`` the model's values multiply the measured seconds per step.
        communication_cost: added to the clock every round (the paper's C.T.), in the clock's units
            (seconds when measuring, the model's units when simulating).
        ema: weight of a round's measurement in a client's moving average of seconds per step
            (1 keeps only the latest round).
        log_metrics: log ``sim/time`` and ``sim/participants``.

    Attributes:
        time: the simulated clock after the last finished round.
        rounds: one record per finished round: ``round``, ``participants``, ``latency`` (the slowest
            selected client's local time), ``time`` (the clock after it).
        decisions: the participating clients of every planned round.
        estimates: every measured client's moving-average seconds per step.
    """

    def __init__(
        self,
        initial_clients: int | None = 10,
        rounds_per_stage: int | Sequence[int] = 10,
        latency: LatencyModel | None = None,
        measure: bool | None = None,
        communication_cost: float = 0.0,
        ema: float = 0.5,
        log_metrics: bool = True,
    ):
        owner = "AdaptiveParticipation"
        check_optional_int("initial_clients", initial_clients, minimum=1, owner=owner)
        stages = [rounds_per_stage] if not isinstance(rounds_per_stage, Sequence) else list(rounds_per_stage)
        if not stages:
            raise ValueError(
                f"{owner}(rounds_per_stage=...) must be a round count >= 1 or a non-empty list of them."
            )
        for stage in stages:
            check_int("rounds_per_stage", stage, minimum=1, owner=owner)
        if latency is not None and not isinstance(latency, LatencyModel):
            raise TypeError(
                f"{owner}(latency=...) must be a LatencyModel (or None to measure), got {type(latency).__name__}."
            )
        if measure is not None:
            check_bool("measure", measure, owner=owner)
        check_bool("log_metrics", log_metrics, owner=owner)
        check_real("communication_cost", communication_cost, low=0.0, owner=owner)
        check_real("ema", ema, low=0.0, high=1.0, low_open=True, owner=owner)
        self.initial_clients = initial_clients
        self.rounds_per_stage = rounds_per_stage
        self._stages = [int(s) for s in stages]
        self.latency = latency
        self.measure = latency is None if measure is None else bool(measure)
        if not self.measure and latency is None:
            raise ValueError("measure=False needs a simulated latency model (latency=...).")
        self.needs_client_timing = self.measure
        self.communication_cost = float(communication_cost)
        self.ema = float(ema)
        self.log_metrics = log_metrics

        self.time = 0.0
        self.rounds: list[dict[str, Any]] = []
        self.decisions: dict[int, list[int]] = {}
        self.estimates: dict[int, float] = {}
        self._round_sums: dict[int, list[float]] = {}  # client -> [seconds, timed steps] in the open round
        self._warned_unmeasured = False

    # ------------------------------------------------------------------ schedule
    def participants(self, round_index: int, pool_size: int) -> int:
        """How many of a pool of ``pool_size`` clients train in round ``round_index``."""
        if self.initial_clients is None:
            return pool_size
        n, start, stage = self.initial_clients, 0, 0
        while n < pool_size:
            length = self._stages[min(stage, len(self._stages) - 1)]
            if round_index < start + length:
                break
            start += length
            stage += 1
            n *= 2
        return min(n, pool_size)

    # ------------------------------------------------------------------ latencies
    def _local_times(
        self,
        round_index: int,
        clients: list[int],
        steps: list[int],
        seconds_per_step: list[float | None] | None,
        num_clients: int,
    ) -> list[float]:
        """Each client's local time in the round (``nan`` where measuring and nothing is known)."""
        draws = self.latency.sample(round_index, num_clients).tolist() if self.latency is not None else None
        if not self.measure:
            if self.latency.per == "step":
                return [draws[c] * k for c, k in zip(clients, steps)]
            return [draws[c] for c in clients]
        times = []
        for i, (client, count) in enumerate(zip(clients, steps)):
            spt = seconds_per_step[i]
            value = math.nan if spt is None else count * spt
            times.append(value * draws[client] if draws is not None else value)
        return times

    def _select(
        self, round_index: int, pool: list[int], steps: dict[int, int], num_clients: int
    ) -> list[int]:
        stored = self.decisions.get(round_index)
        if stored is not None:
            return list(stored)
        pool = sorted(pool)
        n = self.participants(round_index, len(pool))
        if n >= len(pool):
            chosen = pool
        else:
            times = self._local_times(
                round_index,
                pool,
                [steps.get(c, 1) for c in pool],
                [self.estimates.get(c) for c in pool] if self.measure else None,
                num_clients,
            )
            # never measured (nan): fastest, so it gets measured; ties go to the lower client id
            ranked = sorted(range(len(pool)), key=lambda i: -math.inf if math.isnan(times[i]) else times[i])
            chosen = sorted(pool[i] for i in ranked[:n])
        self.decisions[round_index] = list(chosen)
        return list(chosen)

    def _account(self, round_index: int, steps: dict[int, int], num_clients: int) -> None:
        """Fold the round's measurements into the estimates and advance the clock by the round."""
        clients = sorted(steps)
        measured = {c: s / n for c, (s, n) in self._round_sums.items() if n > 0}
        self._round_sums = {}
        seconds = [measured.get(c, self.estimates.get(c)) for c in clients] if self.measure else None
        times = self._local_times(round_index, clients, [steps[c] for c in clients], seconds, num_clients)
        unknown = [c for c, t in zip(clients, times) if math.isnan(t)]
        if unknown and not self._warned_unmeasured:
            rank_zero_warn(
                f"AdaptiveParticipation could not time clients {unknown[:10]} in round {round_index}: a client's "
                "first step after a switch and the round's last step are not timed, so a client needs at least "
                "two steps (three if it trains last) per round to be measured. They count as fastest."
            )
            self._warned_unmeasured = True
        latency = max((t for t in times if not math.isnan(t)), default=0.0)
        for client, value in measured.items():
            old = self.estimates.get(client)
            self.estimates[client] = value if old is None else (1.0 - self.ema) * old + self.ema * value
        self.time += latency + self.communication_cost
        self.rounds.append(
            {"round": round_index, "participants": len(clients), "latency": latency, "time": self.time}
        )

    # ------------------------------------------------------------------ without a Trainer
    def simulate(
        self,
        rounds: int,
        num_clients: int,
        clients_per_round: float | int = 1.0,
        seed: int = 0,
        steps: int | Sequence[int] = 1,
    ) -> AdaptiveParticipation:
        """Run the schedule and the clock alone for ``rounds`` rounds (simulated latency only).

        The pools are the strategy's (``sample_clients(num_clients, clients_per_round, seed, r)``) and
        every client does ``steps`` steps per round (or ``steps[c]``). Returns a fresh callback holding
        the resulting ``rounds``, ``decisions`` and ``time``: what a training run with this callback and a
        ``FederatedStrategy(clients_per_round=..., seed=...)`` would record.
        """
        if self.measure:
            raise ValueError("simulate() needs a simulated latency model with measure=False.")
        sim = copy.copy(self)
        sim.time, sim.rounds, sim.decisions, sim.estimates, sim._round_sums = 0.0, [], {}, {}, {}
        for r in range(rounds):
            pool = sample_clients(num_clients, clients_per_round, seed, r)
            counts = {c: steps if isinstance(steps, int) else steps[c] for c in pool}
            chosen = sim._select(r, pool, counts, num_clients)
            sim._account(r, {c: counts[c] for c in chosen}, num_clients)
        return sim

    # ------------------------------------------------------------------ federated hooks
    def configure_round(self, trainer: L.Trainer, plan: RoundPlan) -> RoundPlan:
        """Keep the fastest of the round's pool (a federated round's planned clients)."""
        if not plan.federated:
            return plan
        steps = {w.client: w.steps for w in plan.work}
        chosen = self._select(plan.round, list(plan.spec.clients), steps, plan.num_clients)
        return plan.replace(clients=chosen)

    def on_round_end(self, trainer: L.Trainer, pl_module: L.LightningModule, result: RoundResult) -> None:
        """Take the round's measured seconds and timed steps of every client (on several processes the
        result holds every rank's clients, so all ranks decide alike); account a federated round once
        (also one cut short: it costs its plan), advance the clock."""
        if not result.plan.federated:  # a fine-tuning round is not timed
            self._round_sums = {}
            return
        for client in result.clients:
            if self.measure and client.timed_steps:
                sums = self._round_sums.setdefault(client.client, [0.0, 0])
                sums[0] += client.seconds
                sums[1] += client.timed_steps
        if self.rounds and self.rounds[-1]["round"] >= result.round:
            return
        self._account(result.round, {w.client: w.steps for w in result.plan.work}, result.plan.num_clients)
        self.record(trainer, **{"sim/time": self.time})

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_metrics and self.rounds and self.rounds[-1]["round"] == trainer.current_epoch:
            _log_round_value(trainer, pl_module, "sim/time", self.time)
            _log_round_value(trainer, pl_module, "sim/participants", float(self.rounds[-1]["participants"]))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_metrics and trainer.state.fn == "fit" and not trainer.sanity_checking:
            _log_round_value(trainer, pl_module, "sim/time", self.time)

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict[str, Any]:
        return {
            "initial_clients": -1 if self.initial_clients is None else self.initial_clients,
            "rounds_per_stage": list(self._stages),
            "latency": "" if self.latency is None else repr(self.latency),
            "measure": self.measure,
            "communication_cost": self.communication_cost,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "time": self.time,
            "rounds": [dict(r) for r in self.rounds],
            "decisions": {r: list(c) for r, c in self.decisions.items()},
            "estimates": dict(self.estimates),
            "round_sums": {c: list(s) for c, s in self._round_sums.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, current = state_dict["config"], self._config()
        if saved != current:
            changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
            raise ValueError(
                f"The checkpoint's AdaptiveParticipation was configured differently ({changed}, as (saved, now)); "
                "resume with the same settings or the schedule and the clock would not continue the run."
            )
        self.time = float(state_dict["time"])
        self.rounds = [dict(r) for r in state_dict["rounds"]]
        self.decisions = {int(r): [int(c) for c in cs] for r, cs in state_dict["decisions"].items()}
        self.estimates = {int(c): float(v) for c, v in state_dict["estimates"].items()}
        self._round_sums = {int(c): [float(s[0]), int(s[1])] for c, s in state_dict["round_sums"].items()}


def _log_round_value(trainer: L.Trainer, pl_module: L.LightningModule, name: str, value: float) -> None:
    """Log a per-round value (the same on every process: synced only to spare Lightning's warning)."""
    pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=trainer.world_size > 1)
