"""Round planning: which clients train in a round, in which order, and for how many steps per phase.

A plan is a pure function of the seed, the round index, the clients' sizes and what the federated
callbacks decide (their decisions are checkpointed), so a resumed run computes the same plan.
Lightning's ``batch_idx`` is an index into the plan: ``plan.locate(batch_idx)`` says which client and
phase a step belongs to.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from lightning_fedrep.federation.api.algorithm import Part, Phase, parse_phases
from lightning_fedrep.federation.api.arguments import check_clients_per_round


def round_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and a tuple of integer keys (round, client, pass ...)."""
    value = seed & 0xFFFFFFFF
    for key in keys:
        value = (value * 1_000_003 + key + 1) % (2**61 - 1)
    return torch.Generator().manual_seed(value)


def num_sampled_clients(num_clients: int, clients_per_round: float | int) -> int:
    """How many clients a round samples: a fraction in (0, 1] of ``num_clients`` (a float, rounded to the
    nearest count, at least one) or a count (an int); see :func:`~lightning_fedrep.federation.api.arguments.check_clients_per_round`."""
    clients_per_round = check_clients_per_round(clients_per_round)
    if isinstance(clients_per_round, float):
        share = clients_per_round * num_clients
        if share < 0.5:
            raise ValueError(
                f"clients_per_round={clients_per_round!r} of {num_clients} clients is {share:.3g} clients: less "
                f"than one. Give a count (clients_per_round=1) or a fraction >= {0.5 / num_clients:.3g}."
            )
        return max(1, int(round(share)))
    if clients_per_round > num_clients:
        raise ValueError(
            f"clients_per_round={clients_per_round} is more than the {num_clients} clients in the data."
        )
    return clients_per_round


def sample_clients(
    num_clients: int, clients_per_round: float | int, seed: int, round_index: int
) -> list[int]:
    """The clients of a round: uniformly without replacement, seeded by ``(seed, round)``, sorted."""
    k = num_sampled_clients(num_clients, clients_per_round)
    if k == num_clients:
        return list(range(num_clients))
    chosen = torch.randperm(num_clients, generator=round_generator(seed, round_index))[:k]
    return sorted(chosen.tolist())


CLIENT_SETTINGS = ("lr_scale",)
"""The per-client settings a round plan carries (``ClientWork.settings``): ``lr_scale`` multiplies the
client's learning rate (every param group of its optimizer) for the round."""

Settings = tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
"""Per-client settings, frozen: ``((client, ((name, value), ...)), ...)`` sorted by client and name."""


def check_settings(
    round_index: int, clients: Sequence[int], settings: Mapping[int, Mapping[str, float]]
) -> Settings:
    """``settings`` (``{client: {"lr_scale": 0.5}}``) checked against the round's ``clients`` and frozen."""
    frozen = []
    for client, values in settings.items():
        if int(client) not in clients:
            raise ValueError(
                f"Round {round_index}: settings name client {client}, which is not among the round's clients "
                f"{list(clients)[:10]}. Set per-client settings only for clients of the round."
            )
        items = []
        for name, value in values.items():
            if name not in CLIENT_SETTINGS:
                raise ValueError(
                    f"Round {round_index}: unknown per-client setting {name!r} for client {client}; "
                    f"known settings: {', '.join(CLIENT_SETTINGS)}."
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(
                    f"Round {round_index}: {name}={value!r} for client {client} must be a positive finite number."
                )
            items.append((name, float(value)))
        if items:
            frozen.append((int(client), tuple(sorted(items))))
    return tuple(sorted(frozen))


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Batches in one pass over a client's data (the last batch may be smaller)."""
    return math.ceil(num_samples / batch_size)


@dataclass(frozen=True)
class RoundSpec:
    """What a round does, before it is turned into step counts: the part callbacks may change.

    ``clients`` train in this order; ``phases`` is each client's local work. A round with
    ``aggregate=False`` changes no global state: each client keeps whatever it trained, including
    trained parts the algorithm normally shares (the fine-tuned models of FedAvg + fine-tuning); it is
    not a federated round (no history row, no participation accounting, no server step). ``prefix``
    is put before the names of the metrics validation logs after the round (``"finetune/"`` gives
    ``finetune/val/acc``).
    """

    clients: tuple[int, ...]
    phases: tuple[Phase, ...]
    aggregate: bool = True
    prefix: str = ""
    settings: Settings = ()
    """Per-client settings (``CLIENT_SETTINGS``), frozen; see :meth:`RoundPlan.replace`."""


@dataclass(frozen=True)
class ClientWork:
    """One client's work in a round: its id, ``(part, steps)`` for each local phase, in order, and its
    settings for the round (``(("lr_scale", 0.5),)``; empty: the defaults)."""

    client: int
    phases: tuple[tuple[Part, int], ...]
    """``(part, steps)`` for each local phase, in order (``part``: ``"head"``, ``"body"`` or ``"all"``)."""
    settings: tuple[tuple[str, float], ...] = ()

    @property
    def lr_scale(self) -> float:
        """The factor on the client's learning rate this round (1.0 unless the plan sets ``lr_scale``)."""
        return dict(self.settings).get("lr_scale", 1.0)

    @property
    def steps(self) -> int:
        return sum(steps for _, steps in self.phases)


@dataclass(frozen=True)
class StepLocation:
    """Where a step of the round falls: the client, its phase, and the client's step counter."""

    client: int
    work_index: int
    """The client's position in the round's plan (``plan.work[work_index]``)."""
    phase_index: int
    """The phase's position in the client's phases."""
    part: Part
    """The part the phase trains: ``"head"``, ``"body"`` or ``"all"``."""
    client_step: int
    """The client's step counter in the round (0 for its first step)."""
    first_of_client: bool
    """Whether this is the client's first step of the round (it was just loaded)."""
    last_of_round: bool
    """Whether this is the round's last step."""


@dataclass(frozen=True)
class RoundPlan:
    """The frozen schedule of one round: its spec, and each client's phases as step counts.

    Federated callbacks receive the plan before the round (``FederatedCallback.configure_round``) and
    return a changed one with :meth:`replace`, which re-derives the step counts.
    """

    round: int
    spec: RoundSpec
    work: tuple[ClientWork, ...]
    """Each planned client's :class:`ClientWork`, in the order the round trains them."""
    client_sizes: tuple[int, ...] = field(repr=False)
    """Every client's number of training samples (what epochs turn into steps with)."""
    batch_size: int = field(repr=False)
    """The training batch size (what epochs turn into steps with)."""
    seed: int = field(default=0, repr=False)
    """The strategy's seed (what :meth:`generator` draws from)."""
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts, total = [], 0
        for w in self.work:
            starts.append(total)
            total += w.steps
        object.__setattr__(self, "_starts", tuple(starts))

    @property
    def length(self) -> int:
        """Number of optimizer steps (Lightning batches) in the round."""
        return self._starts[-1] + self.work[-1].steps if self.work else 0

    @property
    def clients(self) -> list[int]:
        """The clients that train in the round (those with at least one step), in order."""
        return [w.client for w in self.work]

    @property
    def num_clients(self) -> int:
        """Number of clients in the federation (not only this round's)."""
        return len(self.client_sizes)

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self.spec.phases

    @property
    def aggregate(self) -> bool:
        return self.spec.aggregate

    @property
    def federated(self) -> bool:
        """Whether this is a federated round (it aggregates), not a fine-tuning or evaluation round."""
        return self.spec.aggregate

    @property
    def prefix(self) -> str:
        return self.spec.prefix

    def steps_of(self, client: int) -> int:
        """The planned steps of ``client`` in this round (0 if it does not train)."""
        return next((w.steps for w in self.work if w.client == client), 0)

    def generator(self, key: str | int = 0) -> torch.Generator:
        """A CPU generator for the round's draws (which clients, a coin), seeded from the strategy's seed,
        the round and ``key``: every process plans alike and a resumed run draws the same. Never the
        global RNG. Different keys give independent streams."""
        key = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
        return round_generator(self.seed, self.round, 0x5EED, key)

    def settings_of(self, client: int) -> dict[str, float]:
        """The per-client settings of ``client`` this round (``{}``: the defaults)."""
        return dict(dict(self.spec.settings).get(client, ()))

    def replace(
        self,
        *,
        clients: Iterable[int] | None = None,
        phases: Sequence[Phase | dict] | None = None,
        aggregate: bool | None = None,
        prefix: str | None = None,
        settings: Mapping[int, Mapping[str, float]] | None = None,
    ) -> RoundPlan:
        """This round with other clients, phases, aggregation, metric prefix or per-client settings (the
        rest unchanged). ``settings={client: {"lr_scale": 0.5}}`` updates those clients' settings; settings
        of clients that leave the round are dropped.

        Args:
            clients: the clients that train this round, in order.
            phases: each client's local phases (``Phase`` objects or their dicts).
            aggregate: whether the round ends with the server's aggregation (``False``: a local-only round).
            prefix: the prefix of the round's logged metrics.
            settings: per-client settings, ``{client: {"lr_scale": 0.5}}``.
        """
        spec = replace(
            self.spec,
            **{
                k: v
                for k, v in dict(
                    clients=None if clients is None else tuple(int(c) for c in clients),
                    phases=None if phases is None else parse_phases(phases),
                    aggregate=aggregate,
                    prefix=prefix,
                ).items()
                if v is not None
            },
        )
        merged = {c: dict(v) for c, v in spec.settings if c in spec.clients}
        for client, values in (settings or {}).items():
            merged.setdefault(int(client), {}).update(values)
        return plan_round(
            self.round,
            spec.clients,
            spec.phases,
            self.client_sizes,
            self.batch_size,
            aggregate=spec.aggregate,
            prefix=spec.prefix,
            settings=merged,
            seed=self.seed,
        )

    def locate(self, step: int) -> StepLocation:
        """Which client and phase the round's ``step``-th batch belongs to."""
        if not 0 <= step < self.length:
            raise IndexError(f"step {step} is outside round {self.round} of {self.length} steps.")
        index = bisect.bisect_right(self._starts, step) - 1
        work = self.work[index]
        client_step = step - self._starts[index]
        phase_index, remaining = 0, client_step
        while remaining >= work.phases[phase_index][1]:
            remaining -= work.phases[phase_index][1]
            phase_index += 1
        part = work.phases[phase_index][0]
        return StepLocation(
            client=work.client,
            work_index=index,
            phase_index=phase_index,
            part=part,
            client_step=client_step,
            first_of_client=client_step == 0,
            last_of_round=step == self.length - 1,
        )


def plan_round(
    round_index: int,
    clients: Sequence[int],
    phases: Sequence[Phase],
    client_sizes: Sequence[int],
    batch_size: int,
    *,
    aggregate: bool = True,
    prefix: str = "",
    settings: Mapping[int, Mapping[str, float]] | None = None,
    seed: int = 0,
) -> RoundPlan:
    """Turn the round's ``clients`` and ``phases`` into a step-exact round plan.

    Epoch budgets become ``epochs * ceil(n_i / batch_size)`` steps for client ``i``; phases with a
    zero budget are dropped; a client left with no steps is skipped. ``settings`` are per-client
    settings (``CLIENT_SETTINGS``); ``seed`` is the strategy's (for :meth:`RoundPlan.generator`).
    """
    clients = tuple(int(c) for c in clients)
    unknown = [c for c in clients if not 0 <= c < len(client_sizes)]
    if unknown:
        raise ValueError(
            f"Round {round_index} names clients {unknown[:10]}, but the federation has clients "
            f"0..{len(client_sizes) - 1}."
        )
    if len(set(clients)) != len(clients):
        raise ValueError(f"Round {round_index} names a client twice: {list(clients)}.")
    frozen = check_settings(round_index, clients, settings or {})
    by_client = dict(frozen)
    work = []
    for cid in clients:
        per_epoch = steps_per_epoch(client_sizes[cid], batch_size)
        steps = tuple((p.train, p.num_steps(per_epoch)) for p in phases)
        steps = tuple(s for s in steps if s[1] > 0)
        if steps:
            work.append(ClientWork(cid, steps, by_client.get(cid, ())))
    spec = RoundSpec(clients, tuple(phases), aggregate, prefix, frozen)
    return RoundPlan(round_index, spec, tuple(work), tuple(client_sizes), batch_size, seed)


@dataclass(frozen=True)
class RankShare:
    """The part of a round one process trains when the round is sharded over ranks."""

    rank: int
    """The process's rank."""
    clients: tuple[int, ...]
    """Its clients, in the round plan's order."""
    steps: int
    """Their local steps in the round (one client after another)."""


def shard_round(plan: RoundPlan, world_size: int) -> tuple[RankShare, ...]:
    """Deal a round's clients to ``world_size`` ranks, balanced by steps, not by count.

    Longest first: clients by decreasing step count (ties by id) each go to the rank with the fewest
    steps so far (ties to the lowest rank). A pure function of the plan, so every rank computes the
    same shares without a collective. Every rank must still run the same number of Lightning steps:
    a rank with fewer steps than the longest pads with idle steps.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a number of processes >= 1, got {world_size!r}.")
    loads = [0] * world_size
    owner: dict[int, int] = {}
    for work in sorted(plan.work, key=lambda w: (-w.steps, w.client)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[work.client] = rank
        loads[rank] += work.steps
    return tuple(
        RankShare(rank, tuple(w.client for w in plan.work if owner[w.client] == rank), loads[rank])
        for rank in range(world_size)
    )


def plan_fingerprint(plan: RoundPlan) -> int:
    """A number that differs between plans that differ in round, clients, phases or step counts
    (ranks compare theirs before training a round: a disagreement is an error, never a hang)."""
    value = plan.round + 1
    for work in plan.work:
        parts = (zlib.crc32(part.encode()) for part, _ in work.phases)  # stable across processes
        for key in (work.client, *(steps for _, steps in work.phases), *parts):
            value = (value * 1_000_003 + key + 1) % (2**61 - 1)
        for name, setting in work.settings:  # none by default: fingerprints without settings are unchanged
            key = zlib.crc32(f"{name}={setting!r}".encode())
            value = (value * 1_000_003 + key + 1) % (2**61 - 1)
    return (value * 1_000_003 + int(plan.aggregate)) % (2**61 - 1)


def refuse_empty_plan(plan: RoundPlan) -> None:
    """Refuse a round plan without a step (every phase's budget zero): the round could not train."""
    if plan.length == 0:
        raise ValueError(
            "The round plan is empty: every phase has a zero budget (head_epochs, body_epochs, "
            "local_epochs or phases=). Give at least one phase epochs or steps > 0."
        )
