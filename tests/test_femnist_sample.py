"""FedRep's FEMNIST re-sampling (``scripts/femnist_sample.py``, the official ``my_sample.py``).

A small raw NIST tree is made in a temporary folder: the ten lowercase classes ``61`` ... ``6a`` with
``IMAGES`` 28x28 PNGs each, plus a digit class ``30`` and an uppercase class ``41`` that must be ignored.
Each image is white except its first three pixels, which encode its class and its index in the sorted
listing, so every written sample can be traced back to the file it came from.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from lightning_fedrep.data.leaf import LEAFDataModule  # noqa: E402
from scripts.femnist_sample import (  # noqa: E402
    CLASS_FOLDERS,
    load_nist_image,
    main,
    resample_femnist,
)

IMAGES = 400  # per raw class
USERS = 12
SEED = 1  # with USERS=12, each class's users need at most 361 images in all: disjoint slices fit in 400
OTHER_SEED = 3
IGNORED = {"30": 200, "41": 220}  # a digit and an uppercase class, with their class codes


def class_code(folder: str) -> int:
    return IGNORED.get(folder, 10 * (int(folder, 16) - 0x61 + 1))  # 'a' -> 10, ..., 'j' -> 100


def make_image(code: int, index: int) -> Image.Image:
    pixels = np.full((28, 28), 255, dtype=np.uint8)
    pixels[0, 0], pixels[0, 1], pixels[0, 2] = code, index % 200, index // 200
    return Image.fromarray(pixels, mode="L")


def decode(x: list[float]) -> tuple[int, int]:
    """``(label, image index)`` encoded in a written sample's pixels (label -1 for an ignored class)."""
    code, low, high = (round(v * 255) for v in x[:3])
    label = code // 10 - 1 if code <= 100 else -1
    return label, high * 200 + low


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw_data")
    for folder in (*CLASS_FOLDERS, *IGNORED):
        images = root / "by_class" / folder / f"train_{folder}"
        images.mkdir(parents=True)
        (root / "by_class" / folder / f"hsf_0_{folder}").mkdir()  # the tree's other folders: ignored
        for index in range(IMAGES):
            make_image(class_code(folder), index).save(images / f"train_{folder}_{index:05d}.png")
    return root


@pytest.fixture(scope="module")
def runs(raw_dir, tmp_path_factory):
    """Output folder and report of: the official rule (twice), another seed, disjoint slices."""
    out = {}
    for name, seed, shared in (
        ("shared", SEED, True),
        ("again", SEED, True),
        ("other", OTHER_SEED, True),
        ("disjoint", SEED, False),
    ):
        folder = tmp_path_factory.mktemp(name)
        out[name] = (
            folder,
            resample_femnist(raw_dir, folder, num_users=USERS, seed=seed, shared_images=shared),
        )
    return out


def read(folder) -> tuple[dict, dict]:
    with open(folder / "train" / "mytrain.json") as train, open(folder / "test" / "mytest.json") as test:
        return json.load(train), json.load(test)


def expected_per_class(seed: int, users: int) -> list[int]:
    draws = np.random.RandomState(seed).lognormal(4, 1, users) + 100
    return [max(2, int(draw / 3)) for draw in draws]


def user_samples(train: dict, test: dict, user: str) -> list[tuple[int, int]]:
    """Every sample of ``user`` (train then test) as ``(label, image index)``, labels checked on the way."""
    samples = []
    for split in (train, test):
        data = split["user_data"][user]
        assert len(data["x"]) == len(data["y"])
        for x, y in zip(data["x"], data["y"]):
            assert len(x) == 784 and isinstance(y, int)
            label, index = decode(x)
            assert label == y  # the image is of the class its label says; never an ignored class
            samples.append((label, index))
    return samples


def official_reference(by_class, seed: int, users: int, per_class: int = 4000) -> tuple[dict, dict]:
    """``my_sample.py``'s rules restated from the FedRep digest (not its code), with its randomness seeded
    and its listings sorted: every a-j class's files shuffled and cut to ``per_class`` (in folder order), then
    each user's samples shuffled (in user order) and split 90/10; labels as the official floats."""
    rng = random.Random(seed)
    pixels_of = {}
    for label in range(10):
        folder = f"{0x61 + label:x}"
        names = sorted(os.listdir(by_class / folder / f"train_{folder}"))
        rng.shuffle(names)
        pixels_of[label] = []
        for name in names[:per_class]:
            with Image.open(by_class / folder / f"train_{folder}" / name) as image:
                small = image.convert("L")
            small.thumbnail((28, 28), Image.LANCZOS)
            pixels_of[label].append((np.asarray(small, dtype=np.float64).reshape(-1) / 255).tolist())
    sizes = np.random.RandomState(seed).lognormal(4, 1, users) + 100
    read_from = [0] * 10
    per_user = []
    for user in range(users):
        count = max(2, int(sizes[user] / 3))
        pairs = []
        for label in ((user + j) % 10 for j in range(3)):
            if read_from[label] + count < len(pixels_of[label]):  # restart unless the slice ends the class
                read_from[label] = 0
            pairs += [
                (x, float(label)) for x in pixels_of[label][read_from[label] : read_from[label] + count]
            ]
            read_from[label] += count
        per_user.append(pairs)
    splits = [{"users": [], "user_data": {}, "num_samples": []} for _ in range(2)]
    for user, pairs in enumerate(per_user):
        rng.shuffle(pairs)
        cut = int(0.9 * len(pairs))
        for split, part in zip(splits, (pairs[:cut], pairs[cut:])):
            split["users"].append(f"f_{user:05d}")
            split["user_data"][f"f_{user:05d}"] = {"x": [x for x, _ in part], "y": [y for _, y in part]}
            split["num_samples"].append(len(part))
    return splits[0], splits[1]


def int_labels(data: dict) -> dict:
    for record in data["user_data"].values():
        assert all(float(label).is_integer() for label in record["y"])
        record["y"] = [int(label) for label in record["y"]]
    return data


# ----------------------------------------------------------------------------- the official rule


def test_counts_splits_and_labels_follow_the_official_recipe(runs):
    folder, report = runs["shared"]
    train, test = read(folder)
    assert list(train) == list(test) == ["users", "user_data", "num_samples"]  # the official key order
    users = [f"f_{u:05d}" for u in range(USERS)]
    assert train["users"] == test["users"] == list(train["user_data"]) == users
    per_class = expected_per_class(SEED, USERS)
    totals = [3 * n for n in per_class]
    assert report["samples_per_user"] == totals
    assert train["num_samples"] == report["train_samples"] == [int(0.9 * n) for n in totals]
    assert test["num_samples"] == report["test_samples"] == [n - int(0.9 * n) for n in totals]
    assert report["num_users"] == USERS
    assert report["images_per_class"] == dict.fromkeys(range(10), IMAGES)
    assert report["wrapped_classes"] == []
    for u, user in enumerate(users):
        assert len(train["user_data"][user]["y"]) == train["num_samples"][u]
        assert len(test["user_data"][user]["y"]) == test["num_samples"][u]
        samples = user_samples(train, test, user)
        labels = [label for label, _ in samples]
        assert {label: labels.count(label) for label in labels} == {
            (u + j) % 10: per_class[u] for j in range(3)
        }
        assert len(set(samples)) == len(samples)  # no image twice within a user
        # the user's samples are shuffled together before the split, not class after class
        assert labels != sorted(labels)


def test_users_sharing_a_class_read_it_from_its_start(runs):
    folder, _ = runs["shared"]
    train, test = read(folder)
    per_class = expected_per_class(SEED, USERS)
    by_class: dict[int, list[set[int]]] = {c: [] for c in range(10)}
    for u in range(USERS):
        for label, index in user_samples(train, test, f"f_{u:05d}"):
            while len(by_class[label]) <= u:
                by_class[label].append(set())
            by_class[label][u].add(index)
    for label in range(10):
        readers = sorted((s for s in by_class[label] if s), key=len)
        # every user takes the first n images of the class's shuffled list: the sets are nested
        for smaller, larger in zip(readers, readers[1:]):
            assert smaller <= larger
    # users 0 and 1 share class 1: user 1's images are all among user 0's (it needs fewer)
    assert per_class[1] < per_class[0]
    assert by_class[1][1] <= by_class[1][0]
    # a class's list is shuffled: user 0 does not get the first files of the sorted listing
    assert by_class[0][0] != set(range(per_class[0]))


def test_output_equals_the_official_code_run_with_the_same_randomness(runs, raw_dir):
    folder, _ = runs["shared"]
    train, test = read(folder)
    official_train, official_test = official_reference(raw_dir / "by_class", SEED, USERS)
    assert train == int_labels(official_train)
    assert test == int_labels(official_test)
    # written exactly as json.dump writes the official dictionaries
    assert (folder / "train" / "mytrain.json").read_text() == json.dumps(train)
    assert (folder / "test" / "mytest.json").read_text() == json.dumps(test)


def test_an_exact_fit_does_not_reset_the_read_position_as_in_the_official_code(raw_dir, tmp_path):
    # user 0 reads 125 images of class 1 and user 1 needs 43 (seed 1): 125 + 43 == 168 images is not
    # "idx + n < len", so the official rule does not reset and user 1 gets images 125..167
    assert expected_per_class(SEED, 2) == [125, 43]
    for per_class, shared in ((168, 0), (169, 43)):
        resample_femnist(raw_dir, tmp_path / str(per_class), num_users=2, per_class=per_class, seed=SEED)
        train, test = read(tmp_path / str(per_class))
        first, second = (
            {i for label, i in user_samples(train, test, user) if label == 1}
            for user in ("f_00000", "f_00001")
        )
        assert len(first & second) == shared
        official = official_reference(raw_dir / "by_class", SEED, 2, per_class=per_class)
        assert (train, test) == tuple(int_labels(split) for split in official)


# ----------------------------------------------------------------------------- seeds, disjoint slices


def test_the_same_seed_gives_identical_files_and_another_seed_other_counts(runs):
    (folder, _), (again, _), (_, other_report) = runs["shared"], runs["again"], runs["other"]
    for split in ("train/mytrain.json", "test/mytest.json"):
        assert (folder / split).read_bytes() == (again / split).read_bytes()
    assert other_report["samples_per_user"] == [3 * n for n in expected_per_class(OTHER_SEED, USERS)]
    assert other_report["samples_per_user"] != runs["shared"][1]["samples_per_user"]
    assert not list(folder.rglob("*.partial"))


def test_disjoint_slices_never_repeat_an_image(runs):
    folder, report = runs["disjoint"]
    train, test = read(folder)
    per_class = expected_per_class(SEED, USERS)
    assert report["samples_per_user"] == [3 * n for n in per_class]
    assert report["wrapped_classes"] == []
    seen = []
    for u in range(USERS):
        samples = user_samples(train, test, f"f_{u:05d}")
        labels = [label for label, _ in samples]
        assert {label: labels.count(label) for label in labels} == {
            (u + j) % 10: per_class[u] for j in range(3)
        }
        seen += samples
    assert len(seen) == len(set(seen)) == sum(report["samples_per_user"])


def test_disjoint_slices_wrap_around_when_a_class_is_used_up(raw_dir, tmp_path):
    report = resample_femnist(
        raw_dir, tmp_path, num_users=USERS, per_class=250, seed=SEED, shared_images=False
    )
    assert report["wrapped_classes"]  # some class's users need more than 250 images in all
    train, test = read(tmp_path)
    seen = [s for u in range(USERS) for s in user_samples(train, test, f"f_{u:05d}")]
    assert len(set(seen)) < len(seen)
    for u in range(USERS):  # but never twice within a user
        own = user_samples(train, test, f"f_{u:05d}")
        assert len(own) == len(set(own))


# ----------------------------------------------------------------------------- loading, command


def test_leaf_data_module_reads_the_output(runs):
    folder, report = runs["shared"]
    module = LEAFDataModule(
        train_dir=str(folder / "train"), test_dir=str(folder / "test"), max_clients=150, batch_size=10
    )
    module.setup("fit")
    assert module.num_clients == USERS
    assert module.users[0] == "f_00000"
    assert module.client_num_samples(0) == report["train_samples"][0]
    assert len(module.client_data(0, "test")) == report["test_samples"][0]
    assert module.train_set.tensors[0].shape == (sum(report["train_samples"]), 1, 28, 28)
    assert set(module.train_set.tensors[1].tolist()) == set(range(10))
    three = LEAFDataModule(str(folder / "train"), str(folder / "test"), max_clients=3)
    three.setup("fit")
    assert three.num_clients == 3


def test_command_line(raw_dir, tmp_path, capsys, runs):
    report = main([str(raw_dir / "by_class"), str(tmp_path), "--seed", str(SEED), "--num-users", str(USERS)])
    printed = capsys.readouterr().out
    assert str(tmp_path / "train" / "mytrain.json") in printed
    assert f"{sum(report['train_samples'])} train samples" in printed
    assert (tmp_path / "train" / "mytrain.json").read_bytes() == (
        runs["shared"][0] / "train" / "mytrain.json"
    ).read_bytes()
    disjoint = main(
        [str(raw_dir), str(tmp_path / "d"), "--seed", str(SEED), "--num-users", "3", "--disjoint"]
    )
    assert disjoint["num_users"] == 3
    with pytest.raises(SystemExit) as exit_code:
        main([str(tmp_path / "missing"), str(tmp_path / "out")])
    assert exit_code.value.code == 2 and "raw_dir" in capsys.readouterr().err


def test_the_srpfl_preset_gives_100_users_of_150_samples(raw_dir, tmp_path):
    """The SRPFL code's copy of my_sample.py: NUM_USER = 100, every user 150 samples (50 of each of its 3
    letters), split 135 / 15."""
    report = main([str(raw_dir), str(tmp_path), "--srpfl"])
    assert report["num_users"] == 100 and set(report["samples_per_user"]) == {150}
    assert set(report["train_samples"]) == {135} and set(report["test_samples"]) == {15}
    train = json.loads((tmp_path / "train" / "mytrain.json").read_text())
    test = json.loads((tmp_path / "test" / "mytest.json").read_text())
    for u, user in enumerate(train["users"]):
        labels = train["user_data"][user]["y"] + test["user_data"][user]["y"]
        assert {k: labels.count(k) for k in set(labels)} == {(u + j) % 10: 50 for j in range(3)}


def test_load_nist_image_shrinks_a_raw_128x128_image_with_lanczos(tmp_path):
    pixels = np.random.RandomState(0).randint(0, 256, (128, 128, 3)).astype(np.uint8)
    Image.fromarray(pixels, mode="RGB").save(tmp_path / "raw.png")
    values = load_nist_image(tmp_path / "raw.png")
    expected = Image.fromarray(pixels, mode="RGB").convert("L")
    expected.thumbnail((28, 28), Image.LANCZOS)
    assert values.shape == (784,) and values.dtype == np.uint8
    assert np.array_equal(values, np.asarray(expected).reshape(-1))
    Image.fromarray(pixels[:, :64], mode="RGB").save(tmp_path / "narrow.png")
    with pytest.raises(ValueError, match="becomes 14x28 pixels, not 28x28"):
        load_nist_image(tmp_path / "narrow.png")


# ----------------------------------------------------------------------------- errors


def test_a_class_with_too_few_images_is_a_clear_error(raw_dir, tmp_path):
    # every user needs at least int(100 / 3) = 33 images of each of its classes
    for shared in (True, False):
        with pytest.raises(
            ValueError, match=r"Class 'a' \(label 0, folder 61\) has 30 images, but user 0 needs 125"
        ):
            resample_femnist(
                raw_dir, tmp_path, num_users=USERS, per_class=30, seed=SEED, shared_images=shared
            )
    # the official rule's slice from a non-zero position that runs past the class's end
    with pytest.raises(ValueError, match=r"has 150 images, but user 1 needs images 125 to 167") as error:
        resample_femnist(raw_dir, tmp_path, num_users=USERS, per_class=150, seed=SEED)
    assert "fewer users (num_users=12)" in str(error.value) and "per_class (now 150)" in str(error.value)
    assert not (tmp_path / "train").exists()  # nothing written


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"num_users": 0}, ValueError, r"resample_femnist\(num_users=...\) must be an integer >= 1"),
        ({"num_users": 2.0}, TypeError, r"num_users=...\) must be an integer"),
        ({"classes_per_user": 11}, ValueError, r"classes_per_user=...\) must be an integer in \[1, 10\]"),
        ({"per_class": 0}, ValueError, r"per_class=...\) must be an integer >= 1"),
        ({"lognormal_sigma": -1.0}, ValueError, r"lognormal_sigma=...\) must be a number >= 0"),
        ({"lognormal_mean": float("nan")}, ValueError, r"lognormal_mean=...\) must be a finite number"),
        ({"train_fraction": 1.0}, ValueError, r"train_fraction=...\) must be a number in \(0, 1\)"),
        ({"seed": -1}, ValueError, r"seed=...\) must be an integer in \[0, 4294967295\]"),
        ({"shared_images": 1}, TypeError, r"shared_images=...\) must be True or False"),
        ({"train_fraction": 0.001}, ValueError, r"empty train split; choose a train_fraction"),
    ],
)
def test_arguments_are_checked(raw_dir, tmp_path, arguments, error, message):
    with pytest.raises(error, match=message):
        resample_femnist(raw_dir, tmp_path, **{"num_users": 2, **arguments})


def test_missing_or_wrong_raw_folders_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="raw_dir .* does not exist"):
        resample_femnist(tmp_path / "missing", tmp_path / "out")
    digits_only = tmp_path / "digits" / "by_class" / "30" / "train_30"
    digits_only.mkdir(parents=True)
    make_image(200, 0).save(digits_only / "train_30_00000.png")
    with pytest.raises(FileNotFoundError, match="holds none of the lowercase classes a-j"):
        resample_femnist(tmp_path / "digits", tmp_path / "out")
    partial = tmp_path / "partial" / "by_class" / "61" / "train_61"
    partial.mkdir(parents=True)
    for index in range(40):
        make_image(10, index).save(partial / f"train_61_{index:05d}.png")
    with pytest.raises(
        FileNotFoundError,
        match=r"has no class 'b' \(folder 62/train_62\), which user 0 needs; found only a\.",
    ):
        resample_femnist(tmp_path / "partial", tmp_path / "out", num_users=1)
    # one user of one class needs only the class it has
    report = resample_femnist(
        tmp_path / "partial",
        tmp_path / "out",
        num_users=1,
        classes_per_user=1,
        lognormal_mean=3.0,  # exp(3) = 20.1 samples, no spread, no offset
        lognormal_sigma=0.0,
        sample_offset=0.0,
    )
    assert report["images_per_class"] == {0: 40}
    assert report["samples_per_user"] == [20] and report["train_samples"] == [18]
