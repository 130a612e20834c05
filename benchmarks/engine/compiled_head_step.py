"""Would ``torch.compile`` speed up the engine's cached head steps? A stand-in step, eager against compiled.

The engine's own compiled steps (``RunnerSettings(compile=True)``) are timed in a real fit by ``cifar_round.py`` (g);
this script times the bare step (the whole update compiled, the optimizer included), the ceiling of that gain.

FedRep's head epochs on cached features are 500 lockstep steps per CIFAR round (10 clients, batch 10, a
64 -> 10 linear head with ``log_softmax``, SGD momentum 0.5, weight decay 1e-4): small steps whose cost is
per-op overhead. This script writes one such step as a pure function (``vmap`` of ``torch.func.grad`` over the
clients, then SGD with momentum) and times it eager and compiled (``torch.compile(fullgraph=True)``, inductor),
on the same batches, after checking that both train the same heads. It prints the compile time (the first
compiled run) and both steps' median time.

Usage (alone on the machine: timings; needs a C++ compiler for inductor on a CPU)::

    .venv/bin/python benchmarks/engine/compiled_head_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_device_argument, device_label, synchronize  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    clients, samples, batch, steps = 10, 500, 10, args.steps
    features = torch.randn(clients, samples, 64, device=device)
    labels = torch.randint(0, 10, (clients, samples), device=device)
    positions = [torch.randint(0, samples, (clients, batch), device=device) for _ in range(steps)]
    mask, lanes = torch.ones(clients, batch, device=device), torch.arange(clients, device=device)[:, None]

    def loss_of(w, b, f, y, m):  # noqa: ANN001, ANN202 (vmapped)
        per_sample = F.cross_entropy(F.log_softmax(F.linear(f, w, b), -1), y, reduction="none")
        return (per_sample * m).sum() / m.sum().clamp_min(1.0)

    grads = torch.func.vmap(torch.func.grad(loss_of, argnums=(0, 1)))

    def step(w, b, bw, bb, f, y, m):  # noqa: ANN001, ANN202
        gw, gb = grads(w, b, f, y, m)
        bw, bb = bw * 0.5 + (gw + 1e-4 * w), bb * 0.5 + gb
        return w - 0.01 * bw, b - 0.01 * bb, bw, bb

    def run(fn) -> torch.Tensor:  # noqa: ANN001
        w, b = torch.zeros(clients, 10, 64, device=device), torch.zeros(clients, 10, device=device)
        bw, bb = torch.zeros_like(w), torch.zeros_like(b)
        for s in range(steps):
            f, y = features[lanes, positions[s]], labels[lanes, positions[s]]
            w, b, bw, bb = fn(w, b, bw, bb, f, y, mask)
        synchronize()
        return w

    start = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True)
    trained = run(compiled)
    first = time.perf_counter() - start
    torch.testing.assert_close(trained, run(step), rtol=1e-4, atol=1e-6)  # the same heads
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for name, fn in (("eager", step), ("compiled", compiled)):
            start = time.perf_counter()
            run(fn)
            times[name].append(time.perf_counter() - start)
    eager, fast = (statistics.median(times[n]) / steps for n in ("eager", "compiled"))
    where = device_label(device)
    print(f"{steps} cached head steps of {clients} clients, {where} ({torch.get_num_threads()} threads)")
    print(f"  first compiled run (compiling included) {first:8.1f} s")
    print(f"  eager step      {eager * 1e3:8.3f} ms")
    print(f"  compiled step   {fast * 1e3:8.3f} ms   eager / compiled {eager / fast:5.2f}x")
    print(
        f"  compiling pays off after {first / max(1e-9, (eager - fast) * steps):6.1f} rounds of {steps} steps"
    )
    return {"first": first, "eager": eager, "compiled": fast}


if __name__ == "__main__":
    main()
