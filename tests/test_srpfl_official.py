"""The official SRPFL code's evaluation points and EMNIST test sets (issue 27, "Minor"), each against the
official rule restated here:

* ``FEDREP-ray.py``: ``test_flag = iter % args.test_freq == args.test_freq - 1 or iter >= args.epochs - 3``
  (0-based ``iter``; the scripts pass ``--test_freq 10 --epochs 150``: 17 points);
* ``utils/sampling.py::noniid`` with fewer than 100 test samples per client: each class's test samples (in
  data set order) are cut into ``N S / C`` shards (``x[:-leftover].reshape(shards, -1)``, leftover sample
  ``i`` appended to shard ``i``), and each entry of a client's class row, repeated 50 times, takes one of its
  class's shards chosen uniformly, not popped (with replacement).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedrep import FedRepStrategy, FineTunedEvaluation, ShardPartitioner, ValidateAtRounds
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

# ----------------------------------------------------------------------------- evaluation points


def official_test_flags(epochs: int, test_freq: int, last: int = 3) -> list[int]:
    """The rounds at which the official SRPFL loop evaluates, restated."""
    return [i for i in range(epochs) if i % test_freq == test_freq - 1 or i >= epochs - last]


class LossNet(TinyNet):
    fedrep_loss = "cross_entropy"


class CountingFineTuning(FineTunedEvaluation):
    """``FineTunedEvaluation`` recording the round of each fine-tuning it runs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rounds: list[int] = []

    def _fine_tune(self, trainer, pl_module):
        self.rounds.append(trainer.current_epoch)
        return super()._fine_tune(trainer, pl_module)


def test_the_srpfl_recipes_rule_gives_the_official_17_points():
    """Catches ``validates`` dropping the final rounds (``last``) or shifting the period by one
    (``(round_index + 1) % every`` -> ``round_index % every``)."""
    points = ValidateAtRounds(every=10, last=3).validated_rounds(150)
    assert points == official_test_flags(150, 10) and len(points) == 17
    assert ValidateAtRounds(rounds=[0, 5]).validated_rounds(8) == [0, 5]


def test_validation_and_fine_tuned_evaluation_run_exactly_at_the_official_points():
    """A fit validates (history rows with ``val/acc``) and fine-tunes (``FineTunedEvaluation``) after exactly the
    rounds of the official rule, over the Trainer's ``check_val_every_n_epoch=5``. Catches
    ``on_train_epoch_start`` not setting ``check_val_every_n_epoch`` back to "never" on other rounds
    (``1 if due else _NEVER`` -> ``1``), or the last rounds left out (``>=`` -> ``>`` in ``validates``)."""
    rounds, every = 11, 4
    fine_tuning = CountingFineTuning(epochs=1, batch_size=10_000)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, seed=0, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=rounds,
        check_val_every_n_epoch=5,
        callbacks=[ValidateAtRounds(every=every, last=3), fine_tuning],
    )
    torch.manual_seed(0)
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=4))
    expected = official_test_flags(rounds, every)  # [3, 7, 8, 9, 10]
    assert [row["round"] for row in strategy.history if "val/acc" in row] == expected
    assert fine_tuning.rounds == expected


def fit_chosen(root, ckpt_path=None, callbacks=(), max_epochs=4):
    """4 rounds on 6 clients validated after rounds 1 and 3 only (``rounds=[1]``, ``last=1``)."""
    torch.manual_seed(0)
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, seed=5, head_epochs=1, body_epochs=1)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=[ValidateAtRounds(rounds=[1], last=1), *callbacks],
        enable_checkpointing=bool(callbacks),
        default_root_dir=root,
    )
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=ckpt_path)
    return strategy


@pytest.mark.parametrize("where", ["mid-round", "last step"])
def test_a_run_resumed_inside_a_validated_round_still_validates_it(tmp_path, where):
    """Lightning does not call ``on_train_epoch_start`` for the round a run resumes mid-round (or at its last
    step); round 1's validation must still run. Catches dropping ``on_train_start``'s setting (the resumed
    round then keeps the "never" that ``setup`` leaves)."""
    whole = fit_chosen(tmp_path / "whole")
    assert [row["round"] for row in whole.history] == [1, 3]
    ends = torch.tensor([whole.round_plan(r).length for r in range(2)]).cumsum(0).tolist()
    step = ends[1] if where == "last step" else ends[0] + 2
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit_chosen(tmp_path / "a", callbacks=[saver], max_epochs=2)
    resumed = fit_chosen(tmp_path / "b", ckpt_path=tmp_path / "ck" / f"step={step}.ckpt")
    assert [row["round"] for row in resumed.history] == [1, 3]
    assert resumed.history == whole.history


def test_validate_at_rounds_refuses_a_choice_it_cannot_honour():
    with pytest.raises(ValueError, match="would never validate"):
        ValidateAtRounds()
    with pytest.raises(ValueError, match="every"):
        ValidateAtRounds(every=0)
    trainer = quiet_trainer(strategy=FedRepStrategy(head="classifier"), max_epochs=-1, max_steps=2,
                            callbacks=[ValidateAtRounds(last=3)])  # fmt: skip
    with pytest.raises(ValueError, match="max_epochs"):
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())


# ----------------------------------------------------------------------------- EMNIST test sets


def official_shards(labels: np.ndarray, num_shards: int) -> dict[int, list[np.ndarray]]:
    """``noniid``'s cut of each class's samples (data set order) into ``num_shards`` shards, restated."""
    shards = {}
    for c in np.unique(labels):
        x = np.flatnonzero(labels == c)
        leftover = len(x) % num_shards
        body = x[: len(x) - leftover].reshape(num_shards, -1)
        shards[int(c)] = [
            np.concatenate(
                [body[i], x[len(x) - leftover + i : len(x) - leftover + i + 1]] if i < leftover else [body[i]]
            )
            for i in range(num_shards)
        ]
    return shards


def shard_draws(test: np.ndarray, shards: list[np.ndarray]) -> np.ndarray:
    """How many times each whole shard is in ``test`` (a multiset of indices); fails if ``test`` holds a
    partial shard, i.e. is not a union of whole shards."""
    counts = np.bincount(test, minlength=max(int(s.max()) for s in shards) + 1)
    draws = []
    for shard in shards:
        times = counts[shard]
        assert (times == times[0]).all(), "the test set holds part of a shard: not drawn shard by shard"
        draws.append(int(times[0]))
    return np.array(draws)


@pytest.mark.parametrize("assignment", ["official", "distinct"])
def test_test_draws_deal_each_class_slot_50_whole_shards_drawn_uniformly_with_replacement(assignment):
    """Each client's test set is, per class slot, 50 whole shards of that class drawn with replacement
    (official cut), uniform over the class's shards. Catches drawing per distinct class instead of per slot
    (a class held twice then gets 50 draws, not 100), drawing single samples instead of shards, or a
    non-uniform draw (e.g. ``rng.integers(k)`` -> ``rng.integers(k - 1)``)."""
    num_clients, s, num_classes, per_class_test = 20, 5, 10, 160  # 10 holders a class: shards of 16
    train = torch.arange(num_clients * s * 20) % num_classes
    test = torch.from_numpy(
        np.random.default_rng(3).permutation(np.arange(num_classes * per_class_test) % num_classes)
    )
    partitioner = ShardPartitioner(num_clients, s, assignment, test_draws=50)
    split = partitioner.split(train, test, seed=7)
    rows = partitioner.assign_classes(num_classes, seed=7).numpy()
    holders = num_clients * s // num_classes
    labels = test.numpy()
    if assignment == "official":
        shards = official_shards(labels, holders)
    else:  # the distinct cut shuffles within a class: recover shards as the groups of co-drawn samples
        shards = None
    total = {c: np.zeros(holders, dtype=np.int64) for c in range(num_classes)}
    for client in range(num_clients):
        indices = split.test[client].numpy()
        assert (
            len(indices) == s * 50 * per_class_test // holders
        )  # 4,000 in the EMNIST recipe; here 4,000 too
        held = np.bincount(rows[client], minlength=num_classes)
        per_class = np.bincount(labels[indices], minlength=num_classes)
        assert (
            per_class == held * 50 * per_class_test // holders
        ).all()  # 50 shards per slot, own classes only
        if shards is not None:
            for c in np.flatnonzero(held):
                draws = shard_draws(indices[labels[indices] == c], shards[c])
                assert draws.sum() == 50 * held[c]
                total[c] += draws
    if shards is not None:  # uniform: chi-square over each class's 10 shards (9 d.o.f.), all classes pooled
        chi2 = sum(((t - t.mean()) ** 2 / t.mean()).sum() for t in total.values())
        assert chi2 < 150, chi2  # 90 d.o.f.: mean 90, p(> 150) < 1e-4
        assert all(t.min() > 0 for t in total.values())  # with replacement from all shards, not a few
    disjoint = ShardPartitioner(num_clients, s, assignment).split(train, test, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(split.train, disjoint.train))  # train shards unchanged


def test_test_draws_are_refused_when_not_positive_or_for_a_custom_partitioner():
    with pytest.raises(ValueError, match="test_draws"):
        ShardPartitioner(4, 2, test_draws=0)
    pytest.importorskip("torchvision")
    from lightning_fedrep.data.vision import EMNISTDataModule

    with pytest.raises(ValueError, match="test_draws"):
        EMNISTDataModule(partitioner=ShardPartitioner(4, 2), test_draws=50)


def test_the_srpfl_emnist_recipe_gives_every_client_4000_test_samples(tmp_path):
    """The EMNIST recipe's data arguments on generated EMNIST letters files of the real sizes for a-j (800 test
    images a letter): 4,000 test samples per client, 50 x 16-image shards of each class slot, as the official
    code; without ``test_draws`` the disjoint cut gives 80. Catches the recipe losing ``test_draws: 50``."""
    pytest.importorskip("torchvision")
    import yaml

    from lightning_fedrep.data.vision import EMNISTDataModule
    from tests.test_datasets import write_emnist

    letters = np.arange(1, 27)  # torchvision's letters labels
    write_emnist(tmp_path, "letters", 26 * 50, 26 * 800, letters)
    recipe = yaml.safe_load(open("recipes/srpfl/emnist_fedrep_srpfl.yaml"))
    args = {**recipe["data"]["init_args"], "root": str(tmp_path), "download": False}
    module = EMNISTDataModule(**args)
    module.setup()
    sizes = {len(module.client_data(c, "test")) for c in range(100)}
    assert sizes == {4000}
    disjoint = EMNISTDataModule(**{**args, "test_draws": None})
    disjoint.setup()
    assert {len(disjoint.client_data(c, "test")) for c in range(100)} == {80}
