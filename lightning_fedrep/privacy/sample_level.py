"""Sample-level differential privacy: ``FederatedStrategy(privacy=SampleLevelDP(...))``, DP-SGD inside clients.

Each training example is the unit of privacy. Every local step of every client, in every phase (head, body,
a personal model), is a DP-SGD step (:mod:`~lightning_fedrep.privacy.dp_sgd`) on a Poisson batch of the
client's examples, so everything a client's training produces (the body it uploads, the head it keeps, the
personalized model) is (ε_c, δ)-DP with respect to each of its examples, and the server needs no trust. Each
client's ε is accounted from its own steps (:mod:`~lightning_fedrep.privacy.sample_budget`); the run reports
the worst client's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.api.algorithm import Algorithm
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.federation.api.objective import Objective, StepRule
from lightning_fedrep.federation.module.losses import declared_loss
from lightning_fedrep.federation.plan import RoundPlan, plan_round
from lightning_fedrep.privacy.dp_sgd import dp_sgd_step
from lightning_fedrep.privacy.sample_budget import SampleLevelBudget
from lightning_fedrep.privacy.settings import noise_settings

RULE_NAME = "dp_sgd"
"""The name of the DP-SGD step rule (in runner reports and errors)."""


class SampleLevelDP(PrivacyMechanism):
    """Sample-level DP (DP-SGD, Abadi et al. 2016, as Opacus defines it) in every client's local steps.

    At each local step the client's batch is a Poisson sample of its examples (each joins with probability
    ``q = min(1, batch_size / n)``; the strategy switches the ``RoundLoader`` to it); every example's gradient of
    the module's declared loss (``fedrep_loss``) on the tensors the phase trains is clipped to the flat L2 norm
    ``clip``, the clipped gradients are summed, Gaussian noise of std ``noise_multiplier * clip`` is added and
    the sum is divided by the expected batch size ``q n``; then the client's optimizer steps as usual
    (momentum, weight decay, the algorithm's gradient and parameter transforms act on the private gradient).
    The user's ``training_step`` does not run; both runners compute the same step (the vectorized one batches
    clients x examples).

    Accounting: client ``c``'s ε is that of its local steps so far, each a sampled Gaussian mechanism at rate
    ``q_c`` (Opacus's RDP), counted for every round that plans the client; the history gets ``privacy/epsilon``
    (the worst client's) every round, ``privacy/epsilon_median`` and the clip and noise multiplier. With
    ``target_epsilon`` the noise multiplier is solved when the training data is bound (before any step), so that
    every client stays within it after ``rounds`` rounds of the strategy's phases with every client training
    (conservative under partial participation); a round that would take a client beyond it is refused before it
    trains.

    Refused: at construction, nothing but bad values; when the federation is configured,
    ``weighting="samples"`` (a client's example count would move the aggregate without noise); at ``setup``, a
    module without ``fedrep_loss`` (the per-example loss is the declared one), BatchNorm (it mixes examples:
    replace it by GroupNorm, e.g. ``opacus.validators.ModuleValidator.fix(model)``) and instance norms that
    track running statistics; an algorithm or callback that sets its own step rule, or a loss term that reads
    the batch's features (its gradient would need per-example clipping too). Loss terms of the parameters only
    (FedProx's, Ditto's proximal terms) are added after the noise: they reveal nothing about the examples.

    Not covered (the trust model in the docs): the clients' dataset sizes (public: they set the sampling rate and
    the step counts, as in Opacus), metrics computed on training, validation or test data (``train/loss`` is the
    batch's plain mean loss), and evaluation-time fine-tuning (``FineTunedEvaluation`` trains heads without DP).

    Args:
        clip: ``C``, the flat L2 norm every example's gradient is clipped to (> 0).
        noise_multiplier: ``z``, the noise std in units of ``clip`` (> 0). Give this or ``target_epsilon``.
        target_epsilon: the ε no client may exceed over the run; ``z`` is solved for ``rounds`` rounds.
        delta: the δ of every client's (ε, δ)-DP, in (0, 1); usually below 1 / (a client's example count).
        rounds: the rounds the budget covers (the Trainer's ``max_epochs``, fine-tuning rounds included):
            required with ``target_epsilon``; with ``noise_multiplier``, optional (a round beyond it is refused).
        accountant: ``"rdp"`` (Opacus's RDP analysis) or ``None`` (no accounting, no ε: clipping and noise
            only).
    """

    batch_sampling = "poisson"

    def __init__(
        self,
        clip: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        rounds: int | None = None,
        accountant: str | None = "rdp",
    ):
        settings = noise_settings(
            "SampleLevelDP",
            "the ε no client may exceed",
            ("rdp",),
            clip=clip,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            rounds=rounds,
            accountant=accountant,
        )
        self.clip, self.delta, self.rounds = settings.clip, settings.delta, settings.rounds
        self.noise_multiplier, self.target_epsilon = settings.noise_multiplier, settings.target_epsilon
        self.accountant = settings.accountant
        self.budget = (
            None
            if self.accountant is None
            else SampleLevelBudget(self.delta, self.target_epsilon, self.rounds)
        )
        """Every client's ε (``None`` with ``accountant=None``)."""
        self.current_noise_multiplier = self.noise_multiplier
        """The noise multiplier the steps use: the given one, or the one solved for ``target_epsilon``."""
        self.seed = 0
        """The strategy's seed (the noise's key; set when the federation is configured)."""
        self.phases: tuple[Any, ...] = ()
        self.client_sizes: tuple[int, ...] = ()
        self.batch_size = 0
        self.expected_batch = torch.ones(0)
        """Each client's expected batch size ``min(batch_size, n)``, what a step's noisy sum is divided by."""
        self.last_epsilons: dict[int, float] = {}

    # ------------------------------------------------------------------ checks
    def check(self, algorithm: Algorithm, config: Any) -> None:
        """Refuse sample weighting; keep the seed and the phases (for the noise and the budget)."""
        if config.weighting != "uniform":
            raise ValueError(
                f"privacy=SampleLevelDP(...) needs weighting='uniform', got weighting={config.weighting!r}: "
                "sample weights are each client's example count, which one example moves without any noise. Pass "
                "weighting='uniform' to the strategy."
            )
        self.seed = int(config.seed)
        self.phases = tuple(config.phases)

    def check_module(self, module: Any) -> None:
        """Refuse a module without a declared loss, and layers that mix examples (BatchNorm)."""
        if declared_loss(module) is None:
            raise ValueError(
                f"SampleLevelDP clips each example's gradient of the module's declared per-sample loss, and "
                f"{type(module).__name__} declares none: set fedrep_loss on the module (e.g. fedrep_loss = "
                "'cross_entropy', or a callable (output, target) -> per-sample loss), the loss its training_step "
                "computes."
            )
        mixing = [
            f"{name} ({type(layer).__name__})"
            for name, layer in module.named_modules()
            if isinstance(layer, nn.modules.batchnorm._BatchNorm)
            or (isinstance(layer, nn.modules.instancenorm._InstanceNorm) and layer.track_running_stats)
        ]
        if mixing:
            raise ValueError(
                f"SampleLevelDP cannot make {type(module).__name__} private: {', '.join(mixing)} mix the examples "
                "of a batch (batch statistics, running statistics), so one example's gradient is not its own. "
                "Replace BatchNorm by GroupNorm (nn.GroupNorm(min(32, channels), channels)); "
                "opacus.validators.ModuleValidator.fix(model) does it for you."
            )

    def local_objective(self, objective: Objective, phase: str) -> Objective:
        """``objective`` with the DP-SGD step rule (its parameter-only loss terms folded in); refuses a step
        rule of its own and loss terms that read the batch."""
        if objective.step is not None:
            raise ValueError(
                f"SampleLevelDP computes every local step as DP-SGD, and the step rule {objective.step.name!r} (of "
                "the algorithm or a callback) computes the step otherwise: the two cannot be combined. Train this "
                "algorithm without privacy=, or with ClientLevelDP."
            )
        reading = [t.name for t in objective.terms if t.needs_features or not t.vmappable]
        if reading:
            raise ValueError(
                f"SampleLevelDP cannot privatize the loss terms {reading}: they read the batch (its features or the "
                "raw batch), so their gradients would need per-example clipping too. Drop them, or train without "
                "privacy=."
            )
        rule = StepRule(partial(self._step, terms=objective.terms), RULE_NAME, vmappable=True)
        return Objective((), objective.grad_transforms, objective.param_transforms, rule)

    def _step(self, loss: Any, view: Any, x: Tensor, y: Tensor, terms: Sequence[Any] = ()) -> Any:
        if self.current_noise_multiplier is None:
            raise RuntimeError(
                "SampleLevelDP: the noise multiplier is solved when the training data is bound."
            )
        return dp_sgd_step(
            loss,
            view,
            x,
            y,
            clip=self.clip,
            noise_multiplier=self.current_noise_multiplier,
            expected_batch=self._expected_on(view.client.device),
            seed=self.seed,
            terms=terms,
        )

    def _expected_on(self, device: torch.device) -> Tensor:
        """:attr:`expected_batch` on ``device``, copied there once (not at every step)."""
        if self.expected_batch.device != device:
            self.expected_batch = self.expected_batch.to(device)
        return self.expected_batch

    # ------------------------------------------------------------------ rounds
    def bind_data(self, client_sizes: Sequence[int], batch_size: int) -> None:
        """Each client's expected batch size and sampling rate from ``client_sizes`` (its examples) and
        ``batch_size``; the noise multiplier for ``target_epsilon``."""
        self.client_sizes, self.batch_size = tuple(int(n) for n in client_sizes), int(batch_size)
        self.expected_batch = torch.tensor(
            [float(max(1, min(batch_size, n))) for n in self.client_sizes], dtype=torch.float64
        )
        if self.budget is not None:
            self.budget.bind(self.client_sizes, self.batch_size)
            if self.current_noise_multiplier is None:
                self.current_noise_multiplier = self._solve(self.phases)

    def _solve(self, phases: Sequence[Any]) -> float:
        """The noise multiplier for ``target_epsilon``: every client training ``phases`` in each of ``rounds``."""
        clients = range(len(self.client_sizes))
        everyone = plan_round(0, clients, phases, self.client_sizes, self.batch_size)
        return self.budget.solve({work.client: work.steps for work in everyone.work})

    def open_round(self, plan: RoundPlan) -> None:
        """Refuse a round (``plan``: its clients' local steps) the budget does not cover (the noise was solved
        when the data was bound)."""
        if self.budget is None:
            return
        if self.current_noise_multiplier is None:
            self.current_noise_multiplier = self._solve(plan.spec.phases)
        self.budget.refuse_beyond(self.current_noise_multiplier, _planned_steps(plan))

    def close_round(self, plan: RoundPlan) -> dict[str, float]:
        """Account the round's local steps; the history gets ``privacy/epsilon`` (the worst client's so far),
        ``privacy/epsilon_median`` (over the clients that trained), ``privacy/clip`` and
        ``privacy/noise_multiplier``."""
        columns = {"privacy/clip": self.clip}
        if self.current_noise_multiplier is not None:
            columns["privacy/noise_multiplier"] = float(self.current_noise_multiplier)
        if self.budget is None:
            return columns
        self.last_epsilons = self.budget.spend(self.current_noise_multiplier, _planned_steps(plan))
        if self.last_epsilons:
            values = sorted(self.last_epsilons.values())
            columns["privacy/epsilon"] = values[-1]
            columns["privacy/epsilon_median"] = values[len(values) // 2]
        return columns

    # ------------------------------------------------------------------ state
    def describe(self) -> dict[str, Any]:
        """The mechanism as a run's summary records it: the settings, the noise multiplier in use, the clients'
        sampling (``batch_size``, the sampling rates' range), and the ε of the worst client
        (``worst_client``, ``worst_epsilon``) and the median client so far."""
        epsilons = self.last_epsilons or (
            {} if self.budget is None else self.budget.epsilons(self.current_noise_multiplier)
        )
        worst = max(epsilons, key=epsilons.get) if epsilons else None
        rates = self.budget.rates if self.budget is not None else ()
        values = sorted(epsilons.values())
        return {
            "mechanism": type(self).__name__,
            "unit": "example",
            "clip": self.clip,
            "noise_multiplier": self.current_noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "sampling": "poisson",
            "batch_size": self.batch_size,
            "sample_rate_min": min(rates) if rates else None,
            "sample_rate_max": max(rates) if rates else None,
            "rounds": self.rounds,
            "worst_client": worst,
            "worst_epsilon": None if worst is None else epsilons[worst],
            "median_epsilon": values[len(values) // 2] if values else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.current_noise_multiplier,
            "budget": None if self.budget is None else self.budget.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current_noise_multiplier = state.get("noise_multiplier", self.noise_multiplier)
        if self.budget is not None:
            self.budget.load_state_dict(state.get("budget") or {})
        self.last_epsilons = {}

    def __repr__(self) -> str:
        return (
            f"SampleLevelDP(clip={self.clip}, noise_multiplier={self.noise_multiplier}, "
            f"target_epsilon={self.target_epsilon}, delta={self.delta}, rounds={self.rounds}, "
            f"accountant={self.accountant!r})"
        )


def _planned_steps(plan: RoundPlan) -> dict[int, int]:
    """The local steps each client of ``plan`` takes."""
    return {work.client: work.steps for work in plan.work}
