"""FedRep's FEMNIST data: the official ``my_sample.py`` re-sampling of LEAF's raw NIST images, seeded.

The FedRep paper (Collins et al., 2021) does not use LEAF's own FEMNIST split: its code re-samples the raw
NIST images with ``my_sample.py`` (credited to Tian Li's FedDANE code) into 200 users of 3 lowercase
letters each (out of a-j), and trains on the first 150. :func:`resample_femnist` does the same and writes
the same two LEAF JSON files, ``train/mytrain.json`` and ``test/mytest.json``, which
:class:`~lightning_fedrep.data.leaf.LEAFDataModule` reads
(``LEAFDataModule(train_dir=OUT/train, test_dir=OUT/test, max_clients=150)``).

From the command line::

    python scripts/femnist_sample.py RAW_DIR OUT_DIR [--seed N] [--num-users N] [--disjoint]

where ``RAW_DIR`` is LEAF's ``data/femnist/data/raw_data`` (or its ``by_class`` folder), as LEAF's
``get_data.sh`` downloads and unpacks it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_fedrep.federation.api.arguments import check_bool, check_int, check_real

__all__ = ["CLASS_FOLDERS", "load_nist_image", "resample_femnist"]

#: Raw NIST ``by_class`` folder of each kept class, by label: hex ASCII codes of 'a' ... 'j' -> 0 ... 9.
CLASS_FOLDERS: tuple[str, ...] = tuple(f"{code:x}" for code in range(ord("a"), ord("j") + 1))

_OWNER = "resample_femnist"
_MIN_PER_CLASS = 2  # the official floor on a user's samples of one class
_IMAGE_SIDE = 28


def load_nist_image(path: str | os.PathLike) -> np.ndarray:
    """One raw NIST PNG as the official code reads it: 784 grey levels (``uint8``, 0 = black, 255 = white).

    The image is converted to greyscale and shrunk with ``thumbnail((28, 28))`` and Lanczos filtering
    (``Image.LANCZOS``, the filter Pillow's removed ``Image.ANTIALIAS`` named), row by row. The official
    code then divides by 255; so does :func:`resample_femnist`. An image that does not come out 28x28
    (not square, or smaller than 28x28: ``thumbnail`` never enlarges) is a ``ValueError``, where the
    official code would write a shorter vector.
    """
    Image = _pillow()
    with Image.open(path) as image:
        gray = image.convert("L")
    gray.thumbnail((_IMAGE_SIDE, _IMAGE_SIDE), Image.LANCZOS)
    if gray.size != (_IMAGE_SIDE, _IMAGE_SIDE):
        raise ValueError(
            f"{str(path)!r} becomes {gray.size[0]}x{gray.size[1]} pixels, not 28x28, when shrunk with "
            f"thumbnail((28, 28)); NIST's raw images are square 128x128 PNGs."
        )
    return np.asarray(gray, dtype=np.uint8).reshape(-1).copy()


def resample_femnist(
    raw_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    num_users: int = 200,
    classes_per_user: int = 3,
    per_class: int = 4000,
    lognormal_mean: float = 4.0,
    lognormal_sigma: float = 1.0,
    sample_offset: float = 100.0,
    train_fraction: float = 0.9,
    seed: int = 0,
    shared_images: bool = True,
    samples_per_user: int | None = None,
) -> dict[str, Any]:
    """Write FedRep's FEMNIST data (the official ``my_sample.py`` re-sampling) from LEAF's raw NIST images.

    Use it to make the FEMNIST data of the FedRep paper's experiments; read the result with
    ``LEAFDataModule(train_dir=out_dir/"train", test_dir=out_dir/"test", max_clients=150)`` (the official
    runs use the first 150 of the 200 users). For LEAF's own FEMNIST split, run LEAF's ``preprocess.sh``
    instead.

    What it does, step by step as the official code:

    1. Of ``raw_dir``'s classes it keeps the lowercase letters a-j (folders ``61`` ... ``6a``, labels
       0 ... 9; digits, uppercase letters and k-z are ignored). Each class's ``train_<hex>/*.png`` files
       are listed, shuffled, and the first ``per_class`` kept.
    2. User ``u`` draws ``num_samples[u]`` from ``np.random.RandomState(seed).lognormal(lognormal_mean,
       lognormal_sigma, num_users) + sample_offset`` (the official ``np.random.lognormal(4, 1, 200) +
       100`` after ``np.random.seed(seed)``), and gets ``n = max(2, int(num_samples[u] /
       classes_per_user))`` images of each of the classes ``(u + j) % 10``, ``j = 0 ...
       classes_per_user - 1``: ``classes_per_user * n`` samples.
    3. Each user's samples are shuffled together and split: the first ``int(train_fraction * total)``
       train, the rest test. Users are named ``f_00000``, ``f_00001``, ...

    ``samples_per_user=N`` replaces step 2's lognormal draw by ``N`` samples for every user: the SRPFL
    paper's FEMNIST (its code's copy of ``my_sample.py`` sets 100 users of 150 samples; the command's
    ``--srpfl`` preset).

    Each image is shrunk to 28x28 as :func:`load_nist_image` does and written as 784 floats (grey level /
    255, 1.0 = white background), a label as an ``int`` (the official code writes floats such as ``3.0``,
    which :class:`~lightning_fedrep.data.leaf.LEAFDataModule` refuses). The two files have the official
    structure (``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}, "num_samples": [...]}``,
    users in order, as ``json.dump`` writes it).

    **Which images a user gets.** ``shared_images=True`` follows the official index rule: a class's read
    position goes back to 0 whenever ``position + n < images of the class``, which is nearly always, so
    every user reads its classes from their first (shuffled) image: users that share a class share its
    first images, and a client's test image can be another client's training image (as in the paper's
    data). ``shared_images=False`` gives the users of a class consecutive, non-overlapping slices of it
    instead, in user order; when a class is used up its slices wrap around to its first image again
    (listed in the report's ``wrapped_classes``; images then repeat across users).

    **Randomness.** The official code seeds nothing and shuffles ``os.listdir``'s order with the global
    ``random``, so its output cannot be reproduced. Here the listing is sorted, and the file shuffles
    (class after class, a to j) and then the per-user shuffles (user after user) come from one
    ``random.Random(seed)``; the sample counts from ``np.random.RandomState(seed)``. The same arguments
    give byte-identical files.

    **Errors.** Where the official code would silently misalign images and labels (a class has fewer
    images than a user needs, so its slice comes out short), this raises a ``ValueError`` naming the class
    and the counts. Arguments are checked first (``TypeError``/``ValueError`` naming the argument); a
    missing ``raw_dir``, one without any of the ten classes, or without a class some user needs is a
    ``FileNotFoundError``. Only the images that end up in some user's data are read.

    Args:
        raw_dir: LEAF's ``raw_data`` folder or its ``by_class`` folder (``by_class/<hex>/train_<hex>/*.png``).
        out_dir: where ``train/mytrain.json`` and ``test/mytest.json`` are written (folders are created;
            existing files are replaced).
        num_users: number of users (official: 200).
        classes_per_user: classes per user, 1 to 10 (official: 3).
        per_class: images kept per class after the shuffle (official: 4000).
        lognormal_mean, lognormal_sigma: parameters of the per-user lognormal draw (official: 4, 1).
        sample_offset: added to every user's draw (official: 100), so every user has about that many
            samples at least.
        train_fraction: a user's train share, in (0, 1) (official: 0.9).
        seed: seed of all randomness, an integer in [0, 2**32 - 1].
        shared_images: ``True``: the official index rule (users share images); ``False``: disjoint slices.

    Returns:
        ``{"train_file", "test_file", "num_users", "samples_per_user", "train_samples", "test_samples",
        "images_per_class", "wrapped_classes"}``: the two paths, the user count, per-user sample counts
        (before the split; train and test after it, in user order), the images kept per class (by
        label) and the classes whose slices wrapped around (always ``[]`` with ``shared_images=True``).
    """
    num_users = check_int("num_users", num_users, 1, owner=_OWNER)
    classes_per_user = check_int("classes_per_user", classes_per_user, 1, len(CLASS_FOLDERS), owner=_OWNER)
    per_class = check_int("per_class", per_class, 1, owner=_OWNER)
    lognormal_mean = check_real("lognormal_mean", lognormal_mean, owner=_OWNER)
    lognormal_sigma = check_real("lognormal_sigma", lognormal_sigma, 0.0, owner=_OWNER)
    sample_offset = check_real("sample_offset", sample_offset, 0.0, owner=_OWNER)
    train_fraction = check_real(
        "train_fraction", train_fraction, 0.0, 1.0, low_open=True, high_open=True, owner=_OWNER
    )
    seed = check_int("seed", seed, 0, 2**32 - 1, owner=_OWNER)
    if samples_per_user is not None:
        check_int("samples_per_user", samples_per_user, classes_per_user, owner=_OWNER)
    shared_images = check_bool("shared_images", shared_images, owner=_OWNER)
    _pillow()  # fail early when Pillow is missing

    by_class = _by_class_folder(raw_dir)
    rng = random.Random(seed)
    files: dict[int, list[Path]] = {}
    for label, folder in enumerate(CLASS_FOLDERS):
        image_dir = by_class / folder / f"train_{folder}"
        if not image_dir.is_dir():
            continue
        listing = sorted(name for name in os.listdir(image_dir) if name.lower().endswith(".png"))
        rng.shuffle(listing)
        files[label] = [image_dir / name for name in listing[:per_class]]
    if not files:
        raise FileNotFoundError(
            f"{str(by_class)!r} holds none of the lowercase classes a-j (folders "
            f"{', '.join(CLASS_FOLDERS)}, each with a train_<hex> subfolder of PNGs); is it LEAF's "
            f"raw_data/by_class folder?"
        )

    for user in range(min(num_users, len(CLASS_FOLDERS))):  # later users repeat these users' classes
        for j in range(classes_per_user):
            label = (user + j) % len(CLASS_FOLDERS)
            if label not in files:
                folder = CLASS_FOLDERS[label]
                raise FileNotFoundError(
                    f"{str(by_class)!r} has no class {chr(ord('a') + label)!r} (folder {folder}/train_{folder}), "
                    f"which user {user} needs; found only {', '.join(chr(ord('a') + c) for c in files)}."
                )

    if samples_per_user is None:
        draws = (
            np.random.RandomState(seed).lognormal(lognormal_mean, lognormal_sigma, num_users) + sample_offset
        )
    else:  # the SRPFL code's version: the same count for every user
        draws = np.full(num_users, float(samples_per_user))
    per_user_class = [max(_MIN_PER_CLASS, int(draw / classes_per_user)) for draw in draws]

    # which (label, image position) pairs each user gets, by the official rule or disjoint slices
    position = [0] * len(CLASS_FOLDERS)
    wrapped: set[int] = set()
    picks: list[list[tuple[int, int]]] = []
    for user, n in enumerate(per_user_class):
        chosen: list[tuple[int, int]] = []
        for j in range(classes_per_user):
            label = (user + j) % len(CLASS_FOLDERS)
            size = len(files[label])
            if shared_images:
                if position[label] + n < size:  # the official (inverted) reset rule
                    position[label] = 0
                start = position[label]
                if start + n > size:
                    _too_few(label, size, user, n, start, per_class, num_users)
                chosen += [(label, k) for k in range(start, start + n)]
                position[label] = start + n
            else:
                if n > size:
                    _too_few(label, size, user, n, 0, per_class, num_users)
                if position[label] + n > size:
                    wrapped.add(label)
                chosen += [(label, (position[label] + k) % size) for k in range(n)]
                position[label] = (position[label] + n) % size
        rng.shuffle(chosen)
        train_len = int(train_fraction * len(chosen))
        if train_len == 0 or train_len == len(chosen):
            raise ValueError(
                f"train_fraction={train_fraction} leaves user {user}'s {len(chosen)} samples with an empty "
                f"{'train' if train_len == 0 else 'test'} split; choose a train_fraction nearer 0.5."
            )
        picks.append(chosen)

    cache: dict[tuple[int, int], list[float]] = {}

    def pixels(pick: tuple[int, int]) -> list[float]:
        if pick not in cache:
            label, index = pick
            cache[pick] = (load_nist_image(files[label][index]) / 255).tolist()
        return cache[pick]

    out = Path(out_dir)
    train_file, test_file = out / "train" / "mytrain.json", out / "test" / "mytest.json"
    users = [f"f_{user:05d}" for user in range(num_users)]
    train_counts = [int(train_fraction * len(chosen)) for chosen in picks]
    test_counts = [len(chosen) - count for chosen, count in zip(picks, train_counts)]
    partial = {path: path.with_name(path.name + ".partial") for path in (train_file, test_file)}
    for path in partial:
        path.parent.mkdir(parents=True, exist_ok=True)
    # written under a temporary name and renamed at the end: an unreadable image leaves no half file
    try:
        with open(partial[train_file], "w") as train_out, open(partial[test_file], "w") as test_out:
            for handle in (train_out, test_out):
                handle.write('{"users": ' + json.dumps(users) + ', "user_data": {')
            for user, (name, chosen, train_len) in enumerate(zip(users, picks, train_counts)):
                for handle, part in ((train_out, chosen[:train_len]), (test_out, chosen[train_len:])):
                    record = {"x": [pixels(pick) for pick in part], "y": [label for label, _ in part]}
                    handle.write((", " if user else "") + json.dumps(name) + ": " + json.dumps(record))
                if not shared_images:
                    cache.clear()  # disjoint slices: an image is (until a wrap) used once
            train_out.write('}, "num_samples": ' + json.dumps(train_counts) + "}")
            test_out.write('}, "num_samples": ' + json.dumps(test_counts) + "}")
    except BaseException:
        for temporary in partial.values():
            temporary.unlink(missing_ok=True)
        raise
    for path, temporary in partial.items():
        os.replace(temporary, path)

    return {
        "train_file": str(train_file),
        "test_file": str(test_file),
        "num_users": num_users,
        "samples_per_user": [len(chosen) for chosen in picks],
        "train_samples": train_counts,
        "test_samples": test_counts,
        "images_per_class": {label: len(files[label]) for label in sorted(files)},
        "wrapped_classes": sorted(wrapped),
    }


def _too_few(label: int, size: int, user: int, n: int, start: int, per_class: int, num_users: int) -> None:
    letter, folder = chr(ord("a") + label), CLASS_FOLDERS[label]
    where = f"images {start} to {start + n - 1}" if start else f"{n} of them"
    raise ValueError(
        f"Class {letter!r} (label {label}, folder {folder}) has {size} images, but user {user} needs {where}; "
        f"the official code would silently write {max(0, min(n, size - start))} images with {n} labels. "
        f"Use fewer users (num_users={num_users}), more images of the class in the raw folder, or a larger "
        f"per_class (now {per_class}) if the folder has more."
    )


def _by_class_folder(raw_dir: str | os.PathLike) -> Path:
    folder = Path(raw_dir)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"raw_dir {str(folder)!r} does not exist; pass LEAF's data/femnist/data/raw_data (or its by_class "
            f"folder), as LEAF's get_data.sh leaves it."
        )
    return folder / "by_class" if (folder / "by_class").is_dir() else folder


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as error:  # pragma: no cover - Pillow comes with torchvision
        raise ImportError(
            "Re-sampling FEMNIST reads PNGs with Pillow: pip install pillow (or lightning-fedrep[vision])."
        ) from error
    return Image


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line: ``python scripts/femnist_sample.py RAW_DIR OUT_DIR [...]``."""
    parser = argparse.ArgumentParser(
        prog="python scripts/femnist_sample.py",
        description="Write FedRep's FEMNIST data (the official my_sample.py re-sampling: 10 lowercase "
        "letters, 3 per user, lognormal sample counts), seeded, as OUT_DIR/train/mytrain.json and "
        "OUT_DIR/test/mytest.json.",
    )
    parser.add_argument("raw_dir", metavar="RAW_DIR", help="LEAF's raw_data folder (or its by_class folder)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of all randomness (default 0)")
    parser.add_argument("--num-users", type=int, default=200, help="number of users (default 200)")
    parser.add_argument(
        "--samples-per-user",
        type=int,
        default=None,
        help="the same count for every user (default: lognormal)",
    )
    parser.add_argument(
        "--srpfl",
        action="store_true",
        help="the SRPFL paper's version: 100 users of 150 samples (sets --num-users and --samples-per-user)",
    )
    parser.add_argument(
        "--disjoint",
        action="store_true",
        help="give users disjoint slices of each class (default: the official rule, users share images)",
    )
    args = parser.parse_args(argv)
    try:
        report = resample_femnist(
            args.raw_dir,
            args.out_dir,
            num_users=100 if args.srpfl else args.num_users,
            samples_per_user=150 if args.srpfl else args.samples_per_user,
            seed=args.seed,
            shared_images=not args.disjoint,
        )
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))  # exits with status 2
    counts = report["samples_per_user"]
    print(
        f"Wrote {report['num_users']} users ({sum(counts)} samples, {min(counts)} to {max(counts)} per user):\n"
        f"  {report['train_file']}: {sum(report['train_samples'])} train samples\n"
        f"  {report['test_file']}: {sum(report['test_samples'])} test samples"
    )
    if report["wrapped_classes"]:
        letters = ", ".join(chr(ord("a") + label) for label in report["wrapped_classes"])
        print(f"  classes used up and reused from their start: {letters}")
    return report


if __name__ == "__main__":
    main()
