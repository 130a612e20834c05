"""The engine's head steps on cached features, eager against ``RunnerSettings(compile=True)``, inside real fits.

The workload of ``cifar_round.py`` (the official CIFAR CNN, 10 clients x 500 samples, 10 head epochs on cached
features then 1 body epoch, batch 10). Each fit runs ``--rounds`` rounds on the vectorized runner; a clock
around the engine's cached head segments (from the end of a segment's feature pass to its end: this script
wraps three ``LockstepEngine`` methods, the library is unchanged) times each round's head steps alone. Eager and
compiled fits alternate, ``--repeats`` of each. Printed: each variant's first round (compiling included) and the
median of its later rounds, their ratio, the largest relative gap between the two variants' heads, and whether
the compiled fits compiled (a failed compile warns and steps eagerly: then the row says so).

Usage (alone on the machine; on a CPU inductor needs a C++ compiler)::

    .venv/bin/python benchmarks/engine/compiled_head_phase.py                # full workload, 3 rounds, 2 repeats
    .venv/bin/python benchmarks/engine/compiled_head_phase.py --small        # a tiny run (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_device_argument, device_label, quiet, synchronize  # noqa: E402
from cifar_round import Workload, make_data, strategy_heads, strategy_round  # noqa: E402

from lightning_fedrep.runners.lockstep.engine import LockstepEngine  # noqa: E402


@contextmanager
def head_phase_clock() -> Iterator[list[float]]:
    """Seconds of every cached head segment run inside the block, after its feature pass (appended in order)."""
    seconds: list[float] = []
    started: list[float] = []
    cache, enter, finish = (
        LockstepEngine._cache_features,
        LockstepEngine._enter_segment,
        LockstepEngine.finish_group,
    )

    def stop() -> None:
        if started:
            synchronize()
            seconds.append(time.perf_counter() - started.pop())

    def timed_cache(self: LockstepEngine, segment) -> None:  # noqa: ANN001
        cache(self, segment)
        synchronize()
        started.append(time.perf_counter())

    def timed_enter(self: LockstepEngine, segment) -> None:  # noqa: ANN001
        stop()
        enter(self, segment)

    def timed_finish(self: LockstepEngine):  # noqa: ANN202
        stop()
        return finish(self)

    LockstepEngine._cache_features = timed_cache
    LockstepEngine._enter_segment = timed_enter
    LockstepEngine.finish_group = timed_finish
    try:
        yield seconds
    finally:
        LockstepEngine._cache_features, LockstepEngine._enter_segment, LockstepEngine.finish_group = (
            cache,
            enter,
            finish,
        )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="3 clients x 20 samples, 2 head epochs (tests)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    quiet(args.threads)
    w = (
        Workload(clients=3, samples=20, head_epochs=2, device=args.device)
        if args.small
        else Workload(device=args.device)
    )
    dm = make_data(w)
    print(
        f"Cached head steps of a FedRep round, CIFAR10CNN, {w.clients} clients x {w.samples} samples, "
        f"{w.head_epochs} head epochs, batch {w.batch_size}, on {device_label(args.device)} "
        f"({torch.get_num_threads()} threads), {args.rounds} rounds per fit, {args.repeats} fits each"
    )
    firsts: dict[str, list[float]] = {"eager": [], "compiled": []}
    laters: dict[str, list[float]] = {"eager": [], "compiled": []}
    heads: dict[str, torch.Tensor] = {}
    compiled_ran = True
    for _ in range(args.repeats):
        for name in ("eager", "compiled"):
            with head_phase_clock() as seconds:
                strategy = strategy_round(w, dm, "vectorized", rounds=args.rounds, compile=name == "compiled")
            firsts[name].append(seconds[0])
            laters[name].extend(seconds[1:])
            heads[name] = strategy_heads(strategy, w.clients).cpu()
            if name == "compiled":
                step = strategy.lockstep_engine._head_step
                compiled_ran = compiled_ran and step is not None and step.failure is None
    eager, compiled = (statistics.median(laters[n]) for n in ("eager", "compiled"))
    steps = w.head_epochs * -(-w.samples // w.batch_size)
    gap = ((heads["eager"] - heads["compiled"]).abs().max() / heads["eager"].abs().max()).item()
    for name, later in (("eager", eager), ("compiled", compiled)):
        first = " ".join(f"{t:.2f}" for t in firsts[name])
        print(
            f"  {name:<9} head steps of a later round {later:7.3f} s ({later / steps * 1e3:.3f} ms a step)   "
            f"first rounds {first} s"
        )
    print(f"  eager / compiled       : {eager / compiled:6.2f}x")
    print(f"  heads, largest relative gap: {gap:.1e}")
    print(f"  compiled fits compiled : {'yes' if compiled_ran else 'NO (a compile failed: eager steps)'}")
    return {"eager": eager, "compiled": compiled, "gap": gap, "compiled_ran": float(compiled_ran)}


if __name__ == "__main__":
    main()
