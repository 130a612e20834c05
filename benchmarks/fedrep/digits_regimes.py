"""Where does each method win? FedRep, FedPer, FedAvg (+ FT) and Local Only on digits across data regimes.

The docs' "how to choose" rests on this table. The FedRep paper's gains come from clients that see few
classes and few samples each: the shared body then learns from everyone, and a small head per client is
enough. With many classes per client one global model is nearly as personal as a head, and with many
samples per client each client learns alone. Each regime below varies one of the two from the protocol of
``digits_family.py`` (whose settings, models and seeds it reuses, as ``run_seed`` runs them):

* classes per client: 2, 5 or all 10 (``ShardPartitioner``), at 50 clients (~18 training samples each);
* samples per client: 50 clients (~18 training samples each) or 10 clients (~90 each), at 2 classes.

Every run is the same ``FederatedStrategy`` fit as in ``digits_family.py`` (10 clients a round, or 2 of 10;
50 rounds); the figure is the final round's mean client test accuracy (%), mean +- std over seeds.

Usage (from the repository root)::

    .venv/bin/python benchmarks/fedrep/digits_regimes.py [--seeds 0 1 2] [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import Stopwatch, format_table, print_footer, quiet  # noqa: E402
from benchmarks.fedrep.digits_family import LABELS, Settings, run_seed  # noqa: E402

METHODS = ("fedrep", "fedper", "fedavg", "fedavg_ft", "local")
"""The methods compared in every regime."""
REGIMES = {
    "2 classes, ~18 samples": {"classes_per_client": 2, "num_clients": 50},
    "5 classes, ~18 samples": {"classes_per_client": 5, "num_clients": 50},
    "10 classes, ~18 samples": {"classes_per_client": 10, "num_clients": 50},
    "2 classes, ~90 samples": {"classes_per_client": 2, "num_clients": 10, "clients_per_round": 2},
}
"""Each regime's change to ``digits_family.Settings`` (training samples per client: 1,797 digits, half for
training, over the clients)."""
TIE = 0.5
"""Methods this close to the best mean (percentage points) are listed as best too."""
SHORT = {
    "fedrep": "FedRep",
    "fedper": "FedPer",
    "fedavg": "FedAvg",
    "fedavg_ft": "FedAvg + FT",
    "local": "Local Only",
}


def run_regime(
    settings: Settings, seeds: list[int], methods: tuple[str, ...] = METHODS
) -> dict[str, tuple[float, float]]:
    """Each method's final accuracy (%), mean and sample std over ``seeds``."""
    per_seed = [run_seed(seed, settings, methods) for seed in seeds]
    out = {}
    for method in methods:
        values = [result[method]["final"] for result in per_seed]
        out[method] = (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    quiet()
    watch = Stopwatch()
    rows = []
    for regime, change in REGIMES.items():
        result = run_regime(replace(Settings(rounds=args.rounds), **change), args.seeds)
        top = max(mean for mean, _ in result.values())
        best = [SHORT[m] for m in METHODS if result[m][0] >= top - TIE]
        cells = [f"{mean:.1f} ± {std:.1f}" for mean, std in (result[m] for m in METHODS)]
        rows.append([regime, *cells, ", ".join(best)])
        print(f"{regime} done after {watch.elapsed:.0f} s", flush=True)
    print(
        f"\nDigits, final mean client test accuracy (%), mean ± std over seeds {args.seeds}, "
        f"T={args.rounds} rounds:\n"
    )
    print(format_table(["regime", *(LABELS[m] for m in METHODS), f"best (within {TIE} points)"], rows))
    print_footer(watch)


if __name__ == "__main__":
    main()
