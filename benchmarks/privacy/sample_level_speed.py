"""Sample-level DP-SGD on a cohort: the vectorized runner against Opacus training the clients one after another.

Issue 40's target: a round of sample-level DP-SGD (``SampleLevelDP``) on the vectorized runner is at least 3x
faster than Opacus training the same clients one after another, at the same ε (same noise multiplier σ, same
Poisson sampling rate q, same number of steps), measured in the same run.

Two FedRep workloads, every client every round, batch 10, uniform weights, 4 rounds:

* ``digits MLP``: scikit-learn's digits split as ``benchmarks/privacy/digits_tradeoff.py`` splits it (a 50/50
  train/test split, 2 classes per client, its ``--small`` federation of 20 clients), each client's training
  samples cut to a multiple of the batch (~40 each: see below), ``MLPClassifier(hidden=32, features=16)``
  (2,608 parameters, digits_tradeoff's), 5 head epochs then 1 body epoch a round (digits_tradeoff's schedule):
  24 local steps per client and round.
* ``CIFAR CNN``: the official FedRep CNN (``CIFAR10CNN``, 307,842 parameters, no BatchNorm) on random tensors of
  CIFAR's shape (3x32x32, 10 classes, 2 per client), 10 clients of 50 samples, 1 head epoch then 1 body epoch
  (``benchmarks/privacy/client_level_overhead.py``'s workload): 10 local steps per client and round.

Variants, each timed per round:

* ``ours, vectorized``: ``FederatedStrategy(privacy=SampleLevelDP(clip=1.0, noise_multiplier=1.0,
  accountant="rdp"), weighting="uniform", runner="vectorized")``: every client's per-example gradients in one
  ``vmap`` over clients x examples;
* ``ours, sequential``: the same on ``runner="sequential"`` (one client after another, per-example gradients by
  ``torch.func``), for information;
* ``no DP, vectorized``: the same fit without ``privacy`` (what DP costs), for information;
* ``Opacus, one client after another`` (the baseline): a plain PyTorch loop, no Lightning. For each client of
  the round in turn, the model is loaded with the round's global body and the client's own head, and for each
  FedRep phase (head, then body: the other part frozen with ``requires_grad``) an SGD optimizer over the trained
  tensors (the models' recipe: momentum, weight decay on weights) goes through
  ``PrivacyEngine.make_private(module, optimizer, DataLoader(client's data, batch_size=10), noise_multiplier=1.0,
  max_grad_norm=1.0, poisson_sampling=True)`` (Opacus's default ``grad_sample_mode="hooks"``, flat clipping,
  loss reduction "mean"), then takes the steps the round plan gives that client in that phase (epochs x
  ``len(loader)``); the bodies are averaged at the round's end. Each client keeps its own ``PrivacyEngine``
  (its accountant) over the rounds. The table gives the round with the ``make_private`` calls (what an Opacus
  user pays: 2 per client and round) and without them.

Same ε: our steps use ``q = min(1, B / n)`` and divide by ``min(B, n)``; Opacus's ``make_private`` samples at
``1 / len(loader) = 1 / ceil(n / B)`` and divides by ``int(n / ceil(n / B))``. These agree when ``n`` is a
multiple of ``B``, which is why every client's training set is cut to one; then both take ``n / B`` steps an
epoch. The script prints every client's ε from our mechanism (``last_epsilons``) and from its Opacus
accountant (``get_epsilon(delta)``) after the last round, and their largest difference.

Timing: wall-clock per round (``time.perf_counter``, the GPU's queued work included): ours by a callback from a
round's start to its end (``RoundClock``), Opacus around the round's loop. One intra-op thread (``quiet()``). The
first round (the runner's first-round work, Opacus's first calls) is printed apart; "a round" is the mean of the
later rounds. Each repeat runs every variant once, in turn (a passing load slows all alike); the table gives each
variant's best repeat and the ratio of bests, and every repeat's own ratios are printed too.

Cost (the 2-core development machine, one thread): about 85 s for the full run (3 repeats x 2 workloads x 4
variants of 4 rounds), a few seconds with ``--small`` (5 digits clients with 1 head epoch, 3 CIFAR clients of 10
samples, 2 rounds, 1 repeat).

Usage (from the repository root)::

    .venv/bin/python benchmarks/privacy/sample_level_speed.py [--repeats 3] [--rounds 4] [--device cuda]
    .venv/bin/python benchmarks/privacy/sample_level_speed.py --small      # a fast smoke run (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RoundClock,
    Stopwatch,
    add_device_argument,
    device_label,
    format_table,
    make_trainer,
    print_footer,
    quiet,
    synchronize,
    trainer_device,
)
from lightning_fedrep import FederatedDataModule, FederatedStrategy  # noqa: E402
from lightning_fedrep.data.digits import load_digits_tensors  # noqa: E402
from lightning_fedrep.data.partition import ShardPartitioner  # noqa: E402
from lightning_fedrep.models import CIFAR10CNN, MLPClassifier  # noqa: E402
from lightning_fedrep.models.optim import weight_decay_groups  # noqa: E402
from lightning_fedrep.privacy import SampleLevelDP  # noqa: E402

CLIP = 1.0
NOISE_MULTIPLIER = 1.0
DELTA = 1e-5


@dataclass(frozen=True)
class Workload:
    """One federation, model and FedRep schedule that every variant trains."""

    data: str
    """``"digits"`` or ``"cifar"``."""
    clients: int
    samples: int
    """Per client, CIFAR only (the digits clients get what the split gives them, cut to a multiple of B)."""
    head_epochs: int
    body_epochs: int
    rounds: int = 4
    batch_size: int = 10
    seed: int = 0

    def describe(self) -> str:
        """The data, model and schedule in words (for the table's title)."""
        data = (
            "digits (50/50 split), MLPClassifier(32, 16)"
            if self.data == "digits"
            else "random CIFAR-shaped data, CIFAR10CNN"
        )
        return f"{data}, 2 classes per client, {self.head_epochs} head + {self.body_epochs} body epoch(s)"


WORKLOADS = {
    "digits MLP": Workload("digits", clients=20, samples=0, head_epochs=5, body_epochs=1),
    "CIFAR CNN": Workload("cifar", clients=10, samples=50, head_epochs=1, body_epochs=1),
}
SMALL = {
    "digits MLP": replace(WORKLOADS["digits MLP"], clients=5, head_epochs=1, rounds=2),
    "CIFAR CNN": replace(WORKLOADS["CIFAR CNN"], clients=3, samples=20, rounds=2),
}
"""``--small``: a smoke run of the whole script (tests)."""

OURS = "ours, vectorized"
OPACUS = "Opacus, one client after another"
OPACUS_BARE = "Opacus, without make_private"
VARIANTS: dict[str, tuple[str, bool]] = {
    OURS: ("vectorized", True),
    "ours, sequential": ("sequential", True),
    "no DP, vectorized": ("vectorized", False),
}
"""Our variants: ``(runner, with SampleLevelDP)``."""


# ---------------------------------------------------------------------------------------------- the data


def _cut(indices: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The first multiple of ``batch_size`` of a client's indices (so Opacus's sampling rate is ours)."""
    return indices[: max(batch_size, len(indices) // batch_size * batch_size)]


def client_datasets(w: Workload) -> list[TensorDataset]:
    """Every client's training set, each a multiple of the batch size."""
    if w.data == "digits":
        train, _ = load_digits_tensors(test_fraction=0.5, seed=w.seed)
        x, y = train.tensors
    else:
        g = torch.Generator().manual_seed(w.seed)
        n = w.clients * w.samples
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.arange(n) % 10
    split = ShardPartitioner(w.clients, 2).split(y, None, w.seed)
    return [TensorDataset(x[_cut(i, w.batch_size)], y[_cut(i, w.batch_size)]) for i in split.train]


def make_model(w: Workload) -> nn.Module:
    """The workload's model at the seed's initial weights."""
    torch.manual_seed(w.seed)
    return MLPClassifier(hidden=32, features=16) if w.data == "digits" else CIFAR10CNN()


# ---------------------------------------------------------------------------------------------- ours


def ours_fit(
    w: Workload, data: list[TensorDataset], variant: str, device: str
) -> tuple[list[float], dict[int, float]]:
    """One fit of our ``variant``; each round's seconds and every client's ε after the last round."""
    runner, private = VARIANTS[variant]
    mechanism = (
        SampleLevelDP(clip=CLIP, noise_multiplier=NOISE_MULTIPLIER, delta=DELTA, accountant="rdp")
        if private
        else None
    )
    strategy = FederatedStrategy(
        clients_per_round=1.0,
        head_epochs=w.head_epochs,
        body_epochs=w.body_epochs,
        weighting="uniform",
        seed=w.seed,
        runner=runner,
        privacy=mechanism,
    )
    clock = RoundClock()
    trainer = make_trainer(w.rounds, callbacks=[clock], strategy=strategy, **trainer_device(device))
    datamodule = FederatedDataModule.from_client_datasets(data, batch_size=w.batch_size, seed=w.seed)
    trainer.fit(make_model(w), datamodule=datamodule)
    return clock.seconds, dict(mechanism.last_epsilons) if mechanism is not None else {}


# ---------------------------------------------------------------------------------------------- Opacus


@dataclass
class OpacusRun:
    """An Opacus fit's round seconds, the same without the ``make_private`` calls, and every client's ε."""

    seconds: list[float]
    bare: list[float]
    epsilons: dict[int, float]


def _phase(
    engine, model: nn.Module, head: Callable[[str], bool], train_head: bool, loader: DataLoader, epochs: int
) -> float:
    """One FedRep phase of one client under Opacus; returns the seconds spent making it private (and undoing it)."""
    start = time.perf_counter()
    for name, p in model.named_parameters():
        p.requires_grad_(head(name) == train_head)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hp = model.hparams
    optimizer = torch.optim.SGD(weight_decay_groups(trained, hp.weight_decay), lr=hp.lr, momentum=hp.momentum)
    private, optimizer, batches = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=CLIP,
        poisson_sampling=True,
    )
    setup = time.perf_counter() - start
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(private(x), y).backward()
            optimizer.step()
    start = time.perf_counter()
    private.cleanup()  # the hooks off the model: the next phase wraps it again
    return setup + time.perf_counter() - start


def opacus_fit(w: Workload, data: list[TensorDataset], device: str) -> OpacusRun:
    """FedRep with Opacus DP-SGD, one client after another (the module docstring's baseline)."""
    from opacus import PrivacyEngine

    model = make_model(w).to(device)
    head_name = model.fedrep_head

    def head(name: str) -> bool:
        return name.split(".")[0] == head_name

    start_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    body = {n: t for n, t in start_state.items() if not head(n)}
    heads = [{n: t.clone() for n, t in start_state.items() if head(n)} for _ in data]
    loaders = [
        DataLoader(TensorDataset(*(t.to(device) for t in d.tensors)), batch_size=w.batch_size) for d in data
    ]
    engines = [PrivacyEngine(accountant="rdp") for _ in data]
    run = OpacusRun([], [], {})
    for _ in range(w.rounds):
        synchronize()
        start, setup = time.perf_counter(), 0.0
        bodies = []
        for c, loader in enumerate(loaders):
            model.load_state_dict({**body, **heads[c]})
            setup += _phase(engines[c], model, head, True, loader, w.head_epochs)
            setup += _phase(engines[c], model, head, False, loader, w.body_epochs)
            state = model.state_dict()
            heads[c] = {n: t.detach().clone() for n, t in state.items() if head(n)}
            bodies.append({n: t.detach() for n, t in state.items() if not head(n)})
        body = {n: torch.stack([b[n] for b in bodies]).mean(0) for n in body}
        synchronize()
        elapsed = time.perf_counter() - start
        run.seconds.append(elapsed)
        run.bare.append(elapsed - setup)
    run.epsilons = {c: float(e.get_epsilon(DELTA)) for c, e in enumerate(engines)}
    return run


# ---------------------------------------------------------------------------------------------- measuring


def later_rounds(seconds: list[float]) -> float:
    """The mean round after the first (the first round alone when the fit has one)."""
    return statistics.fmean(seconds[1:] or seconds)


def measure(
    w: Workload, data: list[TensorDataset], repeats: int, device: str
) -> tuple[dict[str, list[list[float]]], dict[str, dict[int, float]]]:
    """``{variant: [round seconds of each repeat]}``, the variants interleaved within each repeat, and the ε
    per client of our DP fit and of Opacus (from the last repeat)."""
    times: dict[str, list[list[float]]] = {v: [] for v in (*VARIANTS, OPACUS, OPACUS_BARE)}
    epsilons: dict[str, dict[int, float]] = {}
    for _ in range(repeats):
        for variant in VARIANTS:
            seconds, spent = ours_fit(w, data, variant, device)
            times[variant].append(seconds)
            if variant == OURS:
                epsilons["ours"] = spent
        run = opacus_fit(w, data, device)
        times[OPACUS].append(run.seconds)
        times[OPACUS_BARE].append(run.bare)
        epsilons["opacus"] = run.epsilons
    return times, epsilons


def report(
    label: str,
    w: Workload,
    sizes: list[int],
    times: dict[str, list[list[float]]],
    epsilons: dict[str, dict[int, float]],
) -> list[list[str]]:
    """Print one workload's table, the per-repeat ratios and the ε check; returns the table's rows."""
    later = {v: [later_rounds(t) for t in runs] for v, runs in times.items()}
    best = {v: min(values) for v, values in later.items()}
    rows = [
        [
            variant,
            f"{best[variant] * 1e3:.1f}",
            f"{best[OPACUS] / best[variant]:.2f}x",
            f"{best[OPACUS_BARE] / best[variant]:.2f}x",
            f"{min(t[0] for t in runs) * 1e3:.1f}",
        ]
        for variant, runs in times.items()
    ]
    steps = [(w.head_epochs + w.body_epochs) * n // w.batch_size for n in sizes]
    print(
        f"\n{label}: {w.describe()}; {len(sizes)} clients of {_span(sizes)} samples, {_span(steps)} DP-SGD "
        "steps per client and round:\n"
    )
    headers = [
        "variant",
        "a round, best (ms)",
        "Opacus / this (best)",
        "Opacus w/o make_private / this",
        "first round, best (ms)",
    ]
    print(format_table(headers, rows))
    for variant in (OURS, "ours, sequential"):
        for baseline in (OPACUS, OPACUS_BARE):
            ratios = [b / o for b, o in zip(later[baseline], later[variant])]
            print(f"  {baseline} / {variant}: per-repeat " + ", ".join(f"{r:.2f}x" for r in ratios))
    check_epsilons(epsilons)
    return rows


def _span(values: list[int]) -> str:
    """``"a"`` when every value is ``a``, else ``"min-max"``."""
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def check_epsilons(epsilons: dict[str, dict[int, float]]) -> None:
    """Print every client's ε from our mechanism and from its Opacus accountant, and their largest gap."""
    ours, theirs = epsilons["ours"], epsilons["opacus"]
    gap = max(abs(ours[c] - theirs[c]) for c in theirs)
    values = sorted(theirs.values())
    print(
        f"  same ε (δ = {DELTA:g}, σ = {NOISE_MULTIPLIER:g}) after the last round: ours "
        f"{min(ours.values()):.4f}..{max(ours.values()):.4f}, Opacus's accountants {values[0]:.4f}..{values[-1]:.4f}"
        f" over {len(theirs)} clients; largest difference {gap:.2e}"
    )


def main(argv: list[str] | None = None) -> dict[str, list[list[str]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--small: 1)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per fit (default 4)")
    parser.add_argument("--small", action="store_true", help="a few clients, 2 rounds, 1 repeat (tests)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet()
    warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")  # Opacus's, on every PrivacyEngine
    warnings.filterwarnings(
        "ignore", message=".*Full backward hook is firing.*"
    )  # Opacus's hooks, head phase
    watch = Stopwatch()
    workloads = SMALL if args.small else WORKLOADS
    if args.rounds is not None:
        workloads = {k: replace(w, rounds=args.rounds) for k, w in workloads.items()}
    repeats = args.repeats or (1 if args.small else 3)
    rounds = next(iter(workloads.values())).rounds
    print(
        f"Sample-level DP-SGD speed on {device_label(args.device)} ({torch.get_num_threads()} thread(s)): FedRep, "
        f"every client every round, batch 10, clip {CLIP:g}, σ {NOISE_MULTIPLIER:g}, {rounds} rounds, best of "
        f"{repeats} interleaved repeats"
    )
    out = {}
    for label, w in workloads.items():
        data = client_datasets(w)
        times, epsilons = measure(w, data, repeats, args.device)
        out[label] = report(label, w, [len(d) for d in data], times, epsilons)
    print("\ntarget: Opacus one client after another / ours vectorized >= 3x (the same ε)")
    print_footer(watch)
    return out


if __name__ == "__main__":
    main()
