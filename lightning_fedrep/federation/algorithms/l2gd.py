"""L2GD (Hanzely & Richtárik 2020), as the official FedRep repository runs it (``main_l2gd.py``).

Full participation. Each iteration, with probability ``1 - p`` every client runs its local update
(``local_epochs`` of SGD on its own model), otherwise the server averages the models (``w̄``) and each moves
``w_i <- (1 - lr lam) w_i + lr lam w̄``, ``lr = alpha / (n (1 - p))``. A round is a run of local iterations
and the aggregation iterations after it (so no round is empty); the pulls keep the mean, so a round's k pulls
are one closed form, ``w_i <- w̄ + (1 - lr lam)^k (w_i - w̄)``, applied by the server step to every client's
stored model (``ServerState.client_map``). Evaluation scores each client's own model.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import ClientUpdate, WeightedMean
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.arguments import check_real
from lightning_fedrep.federation.api.declared import ClientTensors
from lightning_fedrep.federation.api.exchange import ClientOutcome
from lightning_fedrep.federation.api.registry import register_algorithm

__all__ = ["L2GD"]

SLOT = "personal"


class _Unweighted(WeightedMean):
    """The plain mean of the uploads (``w̄ = Σ w_i / n``, whatever the strategy's weighting)."""

    def add(self, update: ClientUpdate) -> None:
        super().add(replace(update, weight=1.0))


class L2GD(Algorithm):
    """L2GD: every client keeps its whole model; randomly, the models are pulled towards their average.

    Args:
        p: the probability of an aggregation iteration, in ``(0, 1)`` (the official 0.9).
        alpha: ``α`` in ``lr = α / (n (1 - p))`` (``--alpha_l2gd``, default 1).
        lam: the pull's ``λ`` (``--lambda_l2gd``, default 0.5); ``lr·λ`` must be at most 1, else refused
            when the first round is planned.

    Each client's model is the declared slot ``"personal"`` (starting from the module's initial values, as
    the official ``w_locals``); a local iteration is the configured phases on it; the server's model is ``w̄``.
    The coins come from ``plan.generator("l2gd")`` (every process and a resumed run draw alike). Every client
    trains in every round (``clients_per_round`` is ignored, with a warning); phases that train another slot
    are refused.

    Where this differs from the official code: the pull's ``lr`` is ``α / (n (1 - p))`` but the local steps
    use the module optimizer's learning rate (the official code trains at the same ``lr``: set the
    optimizer's to it; a warning says when they differ); ``w̄`` is the plain mean (the official loop adds the
    first sampled client twice, its ``ind == 0`` branch, a typo we do not copy); the optimizer state
    restarts once per round rather than once per local iteration (the same unless a round holds several
    local iterations and the optimizer has momentum); the official script's last iteration is always local
    and its ``mask``/``w_glob_keys`` are undefined names (it does not run as released).

    Runner: sequential (the lockstep runner does not train declared slots; ``runner="auto"`` says so).
    """

    client_tensors = (ClientTensors(SLOT, like="model", init="module"),)
    evaluation_slot = SLOT

    def __init__(self, p: float = 0.9, alpha: float = 1.0, lam: float = 0.5):
        super().__init__(
            "l2gd", {"body", "head"}, "L2GD: local models, randomly pulled towards their average."
        )
        self.p = check_real("p", p, 0.0, 1.0, low_open=True, high_open=True, owner="L2GD")
        self.alpha = check_real("alpha", alpha, 0.0, low_open=True, owner="L2GD")
        self.lam = check_real("lam", lam, 0.0, owner="L2GD")
        self._num_clients = 0

    def lr(self, num_clients: int) -> float:
        """The official ``lr = α / (n (1 - p))`` for ``num_clients`` clients (``n``)."""
        return self.alpha / (num_clients * (1.0 - self.p))

    def default_phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """One local iteration: ``local_epochs`` of the client's own model."""
        return (Phase("all", epochs=local_epochs, slot=SLOT),)

    def coins(self, plan) -> tuple[int, int]:
        """The round's ``(local iterations, aggregation iterations)``: a run of local coins (at least one),
        then the aggregation coins up to the next local one (which opens the next round), drawn from the
        round ``plan``'s generator."""
        generator, local, pulls = plan.generator("l2gd"), 1, 0
        while True:
            aggregate = bool(torch.rand((), generator=generator, dtype=torch.float64) <= self.p)
            if aggregate:
                pulls += 1
            elif pulls:
                return local, pulls
            else:
                local += 1

    def configure_round(self, plan, server):
        """Every client, the configured phases once per local iteration."""
        n = self._num_clients = server.num_clients
        if self.lr(n) * self.lam > 1.0:
            raise ValueError(
                f"L2GD: lr·lam = alpha/(n(1-p))·lam = {self.lr(n) * self.lam:.3g} with n={n} clients, "
                f"alpha={self.alpha}, p={self.p}, lam={self.lam}: above 1 the pull overshoots the average. "
                "Lower alpha or lam."
            )
        wrong = [phase for phase in plan.spec.phases if phase.slot != SLOT]
        if wrong:
            raise ValueError(
                f"L2GD trains each client's own model, the slot {SLOT!r}: phases {wrong} train another; give "
                f"phases=[Phase(..., slot={SLOT!r})] or leave phases unset."
            )
        if len(plan.clients) < n:
            warnings.warn(
                "L2GD trains every client in every round: clients_per_round is ignored.", stacklevel=2
            )
        local, _ = self.coins(plan)
        return plan.replace(clients=range(n), phases=tuple(plan.spec.phases) * local)

    def aggregator(self, like: Mapping[str, Tensor]) -> WeightedMean:
        """``w̄``: the unweighted mean of the clients' models."""
        return _Unweighted(like)

    def finish_client(self, end) -> ClientOutcome:
        """Uploads the client's own model (the slot it trained)."""
        lr = self.lr(self._num_clients) if self._num_clients else end.lr
        if end.lr is not None and abs(end.lr - lr) > 1e-6 * lr:
            warnings.warn(
                f"L2GD: the clients train at the optimizer's lr={end.lr:g}, the pull uses lr=alpha/(n(1-p))={lr:g}; "
                "the official code trains at the latter (set the optimizer's lr to it).",
                stacklevel=2,
            )
        slot = {**end.client_state, **end.slots}
        return ClientOutcome(upload={n: slot[f"{SLOT}.{n}"] for n in end.shared_names})

    def aggregate(self, server, results, failures):
        """``w̄`` becomes the server's model; every client's model is pulled ``k`` times towards it."""
        _, pulls = self.coins(results.plan)
        keep = (1.0 - self.lr(server.num_clients) * self.lam) ** pulls
        mean = dict(results.reduced)

        def pull(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
            return {f"{SLOT}.{n}": m + keep * (state[f"{SLOT}.{n}"] - m) for n, m in mean.items()}

        return server.replace(shared=mean, client_map=pull), {"l2gd/pulls": float(pulls)}

    def __repr__(self) -> str:
        return f"L2GD(p={self.p}, alpha={self.alpha}, lam={self.lam})"


register_algorithm(L2GD())
