"""Checkpoints: exact resume at a round boundary and mid-round, fresh-process test, exports."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from lightning_fedrep import CHECKPOINT_KEY, FedRepStrategy, personalized_state_dict
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

ROUNDS = 4


def make_strategy(**kw):
    return FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=5, **kw)


def fit(tmp_path, ckpt_path=None, callbacks=(), keep="reset", max_epochs=ROUNDS):
    torch.manual_seed(0)
    model = TinyNet(dropout=0.2)  # dropout draws from the global RNG: resume must restore it
    strategy = make_strategy(client_optimizer_state=keep)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        default_root_dir=tmp_path,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=ckpt_path)
    return model, strategy, trainer


def assert_same_federation(a, b):
    for x, y in zip(a.federation.global_state, b.federation.global_state):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert a.federation.store.local.keys() == b.federation.store.local.keys()
    for cid in a.federation.store.local:
        for x, y in zip(a.federation.store.local[cid], b.federation.store.local[cid]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["round-boundary", "mid-round"])
@pytest.mark.parametrize("keep", ["reset", "keep"])
def test_resume_is_bit_exact(tmp_path, where, keep):
    _, full, _ = fit(tmp_path / "full", keep=keep)

    if where == "round-boundary":
        saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        _, first, _ = fit(tmp_path / "a", callbacks=[saver], keep=keep, max_epochs=2)
        ckpt = tmp_path / "ck" / "epoch=1.ckpt"
    else:
        saver = ModelCheckpoint(
            dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1, filename="{step}"
        )
        _, first, _ = fit(tmp_path / "a", callbacks=[saver], keep=keep)
        lengths = [first.round_plan(r).length for r in range(ROUNDS)]
        boundaries = set(torch.tensor(lengths).cumsum(0).tolist())
        steps = [int(p.stem.split("=")[1]) for p in (tmp_path / "ck").glob("step=*.ckpt")]
        mid = sorted(s for s in steps if s not in boundaries and s > lengths[0])
        assert mid, f"no mid-round checkpoint among {steps} (round ends {sorted(boundaries)})"
        ckpt = tmp_path / "ck" / f"step={mid[0]}.ckpt"
        assert torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]["round"]["open"]

    _, resumed, trainer = fit(tmp_path / "b", ckpt_path=ckpt, keep=keep)
    assert trainer.current_epoch == ROUNDS
    assert_same_federation(full, resumed)


def test_checkpoint_loads_safely_and_exports_clients(tmp_path):
    model, strategy, trainer = fit(tmp_path)
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # no pickled objects in the federated state
    # the user's own module still loads (strictly), with the global body
    loaded = TinyNet.load_from_checkpoint(path)
    for name, value in zip(strategy.federation.shared_names, strategy.federation.global_state):
        torch.testing.assert_close(loaded.state_dict()[name], value)
    # personalized models out: from the live strategy and from the file agree
    for cid in range(6):
        from_file = personalized_state_dict(ckpt, cid)
        live = strategy.client_state_dict(cid)
        assert from_file.keys() == live.keys()
        for k in live:
            torch.testing.assert_close(from_file[k], live[k])
        personal = strategy.client_model(cid)
        assert personal.classifier.weight.data_ptr() != model.classifier.weight.data_ptr()
        torch.testing.assert_close(personal.classifier.weight, live["classifier.weight"])
    trained = set(strategy.federation.store.local)
    assert trained and trained != set(range(6)) or len(trained) == 6


FRESH_PROCESS_TEST = textwrap.dedent(
    """
    import json, sys
    import torch
    from lightning_fedrep import FedRepStrategy
    from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule
    strategy = FedRepStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=5)
    trainer = quiet_trainer(strategy=strategy)
    out = trainer.test(TinyNet(dropout=0.2), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=sys.argv[1], verbose=False)
    print(json.dumps(out[0]))
    """
)


def test_test_from_checkpoint_in_fresh_process(tmp_path):
    model, strategy, trainer = fit(tmp_path)
    before = trainer.test(model, datamodule=tiny_datamodule(num_clients=6, seed=1), verbose=False)[0]
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS_TEST)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    after = json.loads(run.stdout.strip().splitlines()[-1])
    assert after["test/acc"] == pytest.approx(before["test/acc"], abs=1e-6)
    assert after["test/loss"] == pytest.approx(before["test/loss"], abs=1e-5)
    # the heads matter: with every client given the initial head, accuracy differs
    assert strategy.federation.store.local, "no client trained"


def test_resume_requires_same_split(tmp_path):
    _, _, trainer = fit(tmp_path)
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    other = FedRepStrategy(head="classifier", algorithm="lg_fedavg", clients_per_round=3)
    with pytest.raises(ValueError, match="same algorithm and head"):
        quiet_trainer(strategy=other).test(
            TinyNet(), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=path
        )


class SaveOrFailInValidation(Callback):
    """At round 1's second validation batch, write a checkpoint (``save``) or raise (``raise``)."""

    def __init__(self, what: str, path: Path) -> None:
        self.what, self.path = what, path

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.current_epoch == 1 and batch_idx == 1 and not trainer.sanity_checking:
            if self.what == "save":
                trainer.save_checkpoint(self.path)
            else:
                raise RuntimeError("injected failure in validation")


def fit_validated(root, ckpt_path=None, callbacks=(), max_epochs=ROUNDS, every_n_epochs=1):
    torch.manual_seed(0)
    strategy = make_strategy()
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        default_root_dir=root,
        check_val_every_n_epoch=every_n_epochs,
    )
    trainer.fit(TinyNet(dropout=0.2), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=ckpt_path)
    return strategy


@pytest.mark.parametrize("where", ["last step", "during validation", "exception in validation"])
def test_history_is_complete_after_resuming_between_a_round_and_its_validation(tmp_path, where):
    """Lightning skips an epoch's validation when it resumes from a checkpoint written after the epoch's last
    step; the federation makes it run, so round 1's evaluation is in the history (and equal)."""
    whole = fit_validated(tmp_path / "whole")
    ckpt = tmp_path / "ck" / "saved.ckpt"
    if where == "last step":
        ends = torch.tensor([whole.round_plan(r).length for r in range(2)]).cumsum(0).tolist()
        saver = ModelCheckpoint(
            dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}"
        )
        fit_validated(tmp_path / "a", callbacks=[saver], max_epochs=2)
        ckpt = tmp_path / "ck" / f"step={ends[1]}.ckpt"
    elif where == "during validation":
        fit_validated(tmp_path / "a", callbacks=[SaveOrFailInValidation("save", ckpt)], max_epochs=2)
    else:
        saver = OnExceptionCheckpoint(dirpath=tmp_path / "ck", filename="saved")
        with pytest.raises(RuntimeError, match="injected failure"):
            fit_validated(tmp_path / "a", callbacks=[SaveOrFailInValidation("raise", ckpt), saver])
    resumed = fit_validated(tmp_path / "b", ckpt_path=ckpt)
    assert [row["round"] for row in resumed.history] == list(range(ROUNDS))
    assert resumed.history == whole.history
    assert_same_federation(whole, resumed)


def test_a_round_whose_validation_is_not_due_is_not_validated_on_resume(tmp_path):
    """With validation every 2nd round, a checkpoint at round 0's last step resumes without validating it."""
    whole = fit_validated(tmp_path / "whole", every_n_epochs=2)
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit_validated(tmp_path / "a", callbacks=[saver], max_epochs=1, every_n_epochs=2)
    ckpt = tmp_path / "ck" / f"step={whole.round_plan(0).length}.ckpt"
    resumed = fit_validated(tmp_path / "b", ckpt_path=ckpt, every_n_epochs=2)
    assert [row["round"] for row in resumed.history] == [1, 3]
    assert resumed.history == whole.history
    assert_same_federation(whole, resumed)
