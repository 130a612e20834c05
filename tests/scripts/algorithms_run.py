"""FedProx, SCAFFOLD, a median aggregator, Ditto, L2GD, APFL, FedRoD, Fed-MTL, FedCP, FedBABU, FedBN, FedDBE, an algorithm
with a ``start_client`` (``tests/test_start_client.py``), FedALA (whose start reads the client's training data), GPFL,
FedAS (whose start and finish read it; clients of 7, 9 and 13 samples align on no batch of 16, and the one of 7 has no
Fisher batch of 8: weight 0), FedProto, FedPAC (whose start and finish read it), FedRep under client-level and
sample-level DP, FedAdam under client-level DP, pFedMe and FedCAC, each fitted on 1 or N CPU processes
(gloo) in ONE launch.

The 2-process checks of ``tests/test_fedprox.py``, ``tests/test_algorithm_v2.py`` and ``tests/test_aggregation.py``
share this launch: Lightning's launcher re-runs this script for every extra rank once, at the first ``fit``; the
later Trainers reuse the processes and the process group. Every fit is ``federated_run.py``'s (its ``Net``, its
uneven clients, its settings), 2 rounds, sequential runner. Every rank writes ``{algorithm: what it holds}`` to
``<out>.rank<r>.pt``; :func:`run_algorithms` is also called in the pytest process with ``devices=1`` (the
reference the N-process run must equal). :func:`shared_runs` does both once per pytest session.

    python tests/scripts/algorithms_run.py --devices 2 --out /tmp/algorithms
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY))  # the repository, when run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_fedrep import GPFL, FedCAC, FedDBE, FederatedDDPStrategy, FederatedStrategy, FedMTL, PFedMe  # noqa: E402
from lightning_fedrep.federation.api.epochs import epoch_settings  # noqa: E402
from tests.scripts.federated_run import Net, client_data, holdings  # noqa: E402
from tests.scripts.launcher import run_script  # noqa: E402

ALGORITHMS = (
    "fedprox",
    "scaffold",
    "fedrep_median",
    "ditto",
    "l2gd",
    "apfl",
    "fedrod",
    "fed_mtl",
    "fedcp",
    "fedbabu",
    "fedbn",
    "feddbe",
    "blend_start",
    "fedala",
    "gpfl",
    "fedas",
    "fedproto",
    "fedpac",
    "fedrep_dp",
    "fedrep_sample_dp",
    "fedadam_dp",
    "pfedme",
    "fedcac",
)
"""Fitted on 2 processes; the 1-process reference also fits ``fedavg`` (FedProx must differ from it)."""


def _blend_start():  # tests/test_start_client.py's algorithm: Algorithm.start_client where the client is held
    from tests.test_start_client import BlendStart

    return BlendStart()


VARIANTS = {
    "fed_mtl": lambda: FedMTL(chunk=None, strength=0.05),
    "blend_start": _blend_start,
    "feddbe": lambda: FedDBE(momentum=0.5, kappa=5.0),
    "gpfl": lambda: GPFL(lamda=0.5, mu=0.1),
    "fedrep_dp": lambda: "fedrep",
    "fedrep_sample_dp": lambda: "fedrep",
    "fedadam_dp": lambda: "fedadam",
    "pfedme": lambda: PFedMe(lam=2.0, inner_steps=3, personal_lr=0.05, beta=0.7),
    "fedcac": lambda: FedCAC(tau=0.5, beta=2.0),
}
"""Names fitted with another algorithm than the name (``fedrep_dp``: FedRep, with :data:`SETTINGS`) or an algorithm
object: Fed-MTL's official strength (1e-5 here) moves the weights
by less than the comparison's tolerance, and its 4000-row blocks drop every row of this small model (the
trace, which reads the other clients' columns, would vanish): a regularizer reading the wrong columns would pass
unseen. pFedMe's and FedCAC's settings make the inner steps, the mixing and the customization groups matter within
2 rounds."""
ROUNDS = 2


class SplitNet(Net):
    """``Net`` with its feature split declared (FedCP gates the head's input)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(features)


def _client_level_dp() -> dict[
    str, Any
]:  # tests/test_privacy_client_level.py: the noise alike on 2 processes
    from lightning_fedrep.privacy import AdaptiveClipping, ClientLevelDP

    adaptive = AdaptiveClipping(count_noise_std=1.0)
    privacy = ClientLevelDP(clip=0.05, noise_multiplier=0.5, adaptive=adaptive, accountant=None)
    return {"weighting": "uniform", "privacy": privacy}


def _sample_level_dp() -> dict[str, Any]:  # tests/test_privacy_sample_level.py: DP-SGD alike on 2 processes
    from lightning_fedrep.privacy import SampleLevelDP

    return {"weighting": "uniform", "privacy": SampleLevelDP(clip=0.5, noise_multiplier=1.0, accountant=None)}


SETTINGS = {
    "fedrep_dp": _client_level_dp,
    "fedrep_sample_dp": _sample_level_dp,
    "fedadam_dp": _client_level_dp,
}
"""Names fitted with other strategy settings (FedRep under client-level DP, whose noise every rank must draw
alike after the all-reduce of the clipped sums; FedRep under sample-level DP, whose clients' DP-SGD noise must
not depend on the process that trains them; FedAdam stepping from that private mean, its m and v alike on every
rank)."""


class NormNet(Net):
    """``Net`` with a BatchNorm layer first (over 2 channels of 3 values: a batch of one sample still trains)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Sequential(nn.Unflatten(1, (2, 3)), nn.BatchNorm1d(2), nn.Flatten())

    def forward(self, x):
        return self.classifier(self.body(self.norm(x)))


MODELS = {
    "fedcp": SplitNet,
    "fedbn": NormNet,
    "feddbe": SplitNet,
    "gpfl": SplitNet,
    "fedproto": SplitNet,
    "fedpac": SplitNet,
}
"""Names fitted on another module than ``Net``."""
TIMEOUT = 600  # seconds for the whole 2-process launch; ~15 s on 2 idle cores


def fit(devices: int, algorithm: str) -> dict[str, Any]:
    """``federated_run.py --devices <devices> --algorithm <algorithm> --rounds 2``: what this process holds."""
    torch.manual_seed(0)  # the module's initialization (the data and the sampling have their own seeds)
    chosen = VARIANTS[algorithm]() if algorithm in VARIANTS else algorithm
    settings = dict(
        algorithm=chosen,
        clients_per_round=1.0,
        **epoch_settings(chosen, head_epochs=2, body_epochs=1, local_epochs=2),
        runner="sequential",
        seed=3,
    )
    if algorithm in SETTINGS:
        settings.update(SETTINGS[algorithm]())
    if devices > 1:
        strategy = FederatedDDPStrategy(timeout=120, **settings)
    else:
        strategy = FederatedStrategy(**settings)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=ROUNDS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(MODELS.get(algorithm, Net)(), datamodule=client_data())
    return holdings(strategy, trainer, ROUNDS)


def run_algorithms(devices: int, algorithms: Sequence[str] = ALGORITHMS) -> tuple[int, dict[str, dict]]:
    """Every algorithm on ``devices`` processes; this process's rank and what it held after each (the
    caller's torch RNG state and thread count are left as they were)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            results = {name: fit(devices, name) for name in algorithms}
    finally:
        torch.set_num_threads(threads)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return rank, results


def launch(out: Path, devices: int = 2) -> list[dict[str, dict]]:
    """This script on ``devices`` processes (its own session, killed by process group if it hangs): what
    each rank held after each algorithm."""
    returncode, output = run_script(
        __file__, ["--devices", str(devices), "--out", str(out)], out.parent, TIMEOUT
    )
    assert returncode == 0, output[-6000:]
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(devices)]


_RUNS: dict[str, Any] = {}


def shared_runs(tmp_path_factory: Any) -> tuple[dict[str, dict], list[dict[str, dict]]]:
    """``(one process, [rank 0, rank 1])``, each ``{algorithm: held}``: launched once per pytest session and
    shared by the test modules (``tmp_path_factory`` is pytest's)."""
    if not _RUNS:
        folder = tmp_path_factory.mktemp("algorithms")
        ranks = launch(folder / "two")
        _, single = run_algorithms(1, (*ALGORITHMS, "fedavg"))
        _RUNS.update(single=single, ranks=ranks)
    return _RUNS["single"], _RUNS["ranks"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, results = run_algorithms(args.devices)
    torch.save(results, f"{args.out}.rank{rank}.pt")
    if torch.distributed.is_initialized():  # gloo's threads left to interpreter exit can abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
