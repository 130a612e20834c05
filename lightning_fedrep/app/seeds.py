"""``lightning-fedrep fit --config R --seeds 1,2,3``: one recipe run over several seeds, into sibling folders.

    <trainer.default_root_dir>/<run name>/<sweep id>/seed-1/   (one run folder per seed, as a single run's)
                                                    seed-2/
                                                    ...

Each seed ``s`` sets, for its run, Lightning's ``seed_everything`` (the model's initial weights and every
draw not seeded otherwise), the strategy's ``seed`` (client sampling, the round plans) and the data
module's ``seed`` (the partition: which classes and samples each client holds; for the digits also the
train/test split). The papers' official code draws a new partition in every repeat (FedRep's and FLUTE's
``sampling.py`` use numpy's unseeded generator, SRPFL seeds numpy with the run's seed), so the partition
varies too. Seeds of other objects (e.g. ``FixedExponential``'s client speeds, which the SRPFL code keeps
fixed across repeats with ``np.random.seed(1)``) are left as the recipe sets them. The seeds run one
after another in this process; ``lightning-fedrep table`` then reads the folders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

FLAG = "--seeds"
SEED_FOLDER = "seed-{seed}"


@dataclass
class Sweep:
    """The seed the command now runs and the folder holding its siblings (``None`` before the first)."""

    seed: int
    group: Path | None = None


def parse_seeds(text: str) -> list[int]:
    """``"1,2,3"`` as ``[1, 2, 3]``; refuses anything but distinct non-negative integers."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"--seeds={text!r} is not a comma-separated list of non-negative integers; write e.g. --seeds 1,2,3."
        )
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={text!r} repeats a seed; each seed runs once, e.g. --seeds 1,2,3.")
    return seeds


def split_seeds(argv: Sequence[str]) -> tuple[list[str], list[int] | None]:
    """``argv`` without ``--seeds X`` (or ``--seeds=X``), and the seeds (``None`` when not given).
    Refuses ``--seeds`` outside ``fit`` and beside the settings it makes itself."""
    rest, value = [], None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == FLAG:
            if i + 1 >= len(args):
                raise ValueError("--seeds needs a value: --seeds 1,2,3.")
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, None
    seeds = parse_seeds(value)
    if not rest or rest[0] != "fit":
        raise ValueError(
            f"--seeds runs `fit` once per seed; it is not an option of {rest[0] if rest else 'no subcommand'!r}."
        )
    for own in ("--seed_everything", "--ckpt_path"):
        if any(a == own or a.startswith(own + "=") for a in rest):
            why = "sets it per seed" if own == "--seed_everything" else "starts new runs"
            raise ValueError(f"--seeds {why}: drop {own}.")
    return rest, seeds


def check_single_process(config: Any) -> None:
    """Refuse a sweep over several devices or nodes: the seeds run one after another in this process,
    which processes launched for several devices would repeat."""
    devices, nodes = config.trainer.get("devices"), config.trainer.get("num_nodes", 1)
    single = devices in (1, "1") or (isinstance(devices, list | tuple) and len(devices) == 1)
    if not single or nodes not in (1, "1", None):
        raise ValueError(
            f"--seeds runs the seeds one after another in one process, so it needs trainer.devices=1 and "
            f"trainer.num_nodes=1 (got devices={devices!r}, num_nodes={nodes!r}); for several devices run one "
            "command per seed with --seed_everything S --trainer.strategy.init_args.seed S --data.init_args.seed S."
        )


def apply_seed(config: Any, seed: int) -> list[str]:
    """Set the strategy's and the data module's ``seed`` in ``config`` (``seed_everything`` comes from the
    command line); returns the settings it set, and says which it could not."""
    applied = ["seed_everything"]
    for section, key in ((config.trainer.get("strategy"), "trainer.strategy"), (config.get("data"), "data")):
        args = section.get("init_args") if hasattr(section, "get") else None
        if hasattr(args, "get") and "seed" in args:
            args["seed"] = seed
            applied.append(f"{key}.init_args.seed")
        else:
            rank_zero_warn(
                f"--seeds: {key} has no init_args.seed in the configuration (give it as class_path with "
                f"init_args), so its seed is the same in every run of the sweep."
            )
    return applied


def seed_folder(group: Path, seed: int) -> Path:
    """The run folder of ``seed`` inside the sweep's folder ``group``."""
    folder = group / SEED_FOLDER.format(seed=seed)
    folder.mkdir(parents=True, exist_ok=False)
    return folder
