"""Pins every Lightning behaviour the package relies on beyond its documented hooks.

Each test names one behaviour (see ``lightning_fedrep/lightning/internals.py`` and the strategy's hook
docstrings) and runs it on a plain ``SingleDeviceStrategy`` subclass and a sized iterable, without the
federated strategy, so a Lightning upgrade that changes it fails here, by name.
"""

from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    ModelCheckpoint,
    ProgressBar,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_fedrep.lightning import internals
from tests.fixtures import quiet_trainer


class SizedIterable:
    """A sized, non-DataLoader iterable like ``RoundLoader``: its length is the current epoch's (as the
    round loader's is the current round plan's); it records how many batches were pulled."""

    def __init__(self, lengths: list[int], epoch=lambda: 0):
        self.lengths = lengths
        self.epoch = epoch
        self.pulled = 0

    def __len__(self) -> int:
        return self.lengths[min(self.epoch(), len(self.lengths) - 1)]

    def __iter__(self):
        for _ in range(len(self)):
            self.pulled += 1
            yield torch.randn(2, 3)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Net(L.LightningModule):
    def __init__(self, lengths: list[int] | None = None, events: list | None = None):
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.lengths = lengths or [4]
        self.events = events if events is not None else []
        self.data = SizedIterable(self.lengths, lambda: self.trainer.current_epoch)

    def on_train_batch_start(self, batch, batch_idx):
        self.events.append(("module.on_train_batch_start", batch_idx))

    def training_step(self, batch, batch_idx):
        self.events.append(("module.training_step", batch_idx))
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def test_step(self, batch, batch_idx):
        pass

    def train_dataloader(self):
        return self.data

    def val_dataloader(self):
        return SizedIterable([3])

    def test_dataloader(self):
        return SizedIterable([3])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingStrategy(SingleDeviceStrategy):
    """Records when Lightning calls the hooks the federated strategy overrides, and what it sees there."""

    def __init__(self, events: list):
        super().__init__(device="cpu")
        self.events = events

    def on_train_batch_start(self, batch, batch_idx):
        module = self.lightning_module
        self.events.append(("strategy.on_train_batch_start", batch_idx, module.data.pulled))

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.events.append(
            ("strategy.optimizer_step", internals.round_ends_now(self.lightning_module.trainer))
        )
        return output

    def validation_step(self, *args, **kwargs):
        self.events.append(
            ("strategy.validation_step", internals.evaluation_ends_now(self.lightning_module.trainer))
        )
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        self.events.append(
            ("strategy.test_step", internals.evaluation_ends_now(self.lightning_module.trainer))
        )
        return super().test_step(*args, **kwargs)

    def setup(self, trainer):
        self.events.append(("strategy.setup",))
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        self.events.append(("strategy.load_checkpoint",))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict=True):
        self.events.append(("strategy.load_model_state_dict",))
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint):
        self.events.append(("strategy.load_optimizer_state_dict",))
        super().load_optimizer_state_dict(checkpoint)


class CallbackOrder(Callback):
    def __init__(self, events: list):
        self.events = events

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append(("callback.on_train_batch_start", batch_idx))


def _of(events: list, name: str) -> list:
    return [e for e in events if e[0] == name]


def test_round_ends_now_is_true_on_the_last_batch_only():
    """``round_ends_now``: ``batch_progress.is_last_batch`` is exact for a sized iterable (the round loader)."""
    events: list = []
    trainer = quiet_trainer(strategy=RecordingStrategy(events), max_epochs=2, limit_val_batches=0)
    internals.reload_data_every_round(trainer)
    trainer.fit(Net([3, 5], events))
    flags = [e[1] for e in _of(events, "strategy.optimizer_step")]
    assert flags == [False, False, True, False, False, False, False, True]


def test_a_sized_iterable_is_not_prefetched():
    """The round loader's batch is pulled only when Lightning is about to run it (no prefetch for sized
    iterables), so a plan computed lazily at the first ``next`` is the one its steps run."""
    events: list = []
    quiet_trainer(strategy=RecordingStrategy(events), max_epochs=1, limit_val_batches=0).fit(Net([4], events))
    assert [(e[1], e[2]) for e in _of(events, "strategy.on_train_batch_start")] == [
        (i, i + 1) for i in range(4)
    ]


def test_strategy_batch_start_runs_after_callbacks_and_module_and_before_the_step():
    """The strategy switches clients in ``on_train_batch_start``: it runs after the callbacks' and the
    module's hook (they see the previous client) and right before ``training_step``."""
    events: list = []
    trainer = quiet_trainer(
        strategy=RecordingStrategy(events),
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[CallbackOrder(events)],
    )
    trainer.fit(Net([2], events))
    order = [e[0] for e in events if e[0] != "strategy.setup"]
    step = [
        "callback.on_train_batch_start",
        "module.on_train_batch_start",
        "strategy.on_train_batch_start",
        "module.training_step",
        "strategy.optimizer_step",
    ]
    assert order == step * 2


def test_reload_data_every_round_rereads_the_length_each_epoch():
    """``reload_data_every_round``: with ``reload_dataloaders_every_n_epochs=1`` each epoch runs the
    iterable's current length (rounds of different lengths are not truncated to the first)."""
    events: list = []
    trainer = quiet_trainer(strategy=RecordingStrategy(events), max_epochs=3, limit_val_batches=0)
    internals.reload_data_every_round(trainer)
    trainer.fit(Net([2, 5, 3], events))
    flags = [e[1] for e in _of(events, "strategy.optimizer_step")]
    assert len(flags) == 10 and [i for i, f in enumerate(flags) if f] == [1, 6, 9]


def test_evaluation_ends_now_is_true_on_the_last_evaluation_batch_in_every_stage():
    """``evaluation_ends_now`` reads the right loop's ``is_last_batch`` in fit, validate and test."""
    events: list = []
    trainer = quiet_trainer(strategy=RecordingStrategy(events), max_epochs=1)
    model = Net([2], events)
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    trainer.test(model, verbose=False)
    assert [e[1] for e in _of(events, "strategy.validation_step")] == [False, False, True] * 2
    assert [e[1] for e in _of(events, "strategy.test_step")] == [False, False, True]


def test_checkpoint_restore_order(tmp_path):
    """The strategy restores clients in ``load_model_state_dict`` (every stage, before ``setup``) and the
    open round in ``load_optimizer_state_dict`` (fit only, after ``setup``)."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    quiet_trainer(max_epochs=1, limit_val_batches=0, enable_checkpointing=True, callbacks=[saver]).fit(
        Net([2])
    )
    events: list = []
    trainer = quiet_trainer(strategy=RecordingStrategy(events), max_epochs=2, limit_val_batches=0)
    trainer.fit(Net([2], events), ckpt_path=saver.last_model_path)
    names = [
        e[0] for e in events if e[0].startswith("strategy.") and "batch" not in e[0] and "step" not in e[0]
    ]
    assert names == [
        "strategy.load_checkpoint",
        "strategy.load_model_state_dict",
        "strategy.setup",
        "strategy.load_optimizer_state_dict",
    ]
    events.clear()
    quiet_trainer(strategy=RecordingStrategy(events)).test(
        Net([2], events), ckpt_path=saver.last_model_path, verbose=False
    )
    names = [
        e[0]
        for e in events
        if e[0] in ("strategy.load_model_state_dict", "strategy.setup", "strategy.load_optimizer_state_dict")
    ]
    assert names == ["strategy.load_model_state_dict", "strategy.setup"]


class EpochLengths(Callback):
    def __init__(self):
        self.batches: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.setdefault(trainer.current_epoch, []).append(batch_idx)


class RestartingStrategy(RecordingStrategy):
    def load_optimizer_state_dict(self, checkpoint):
        super().load_optimizer_state_dict(checkpoint)
        internals.start_next_round_after_restore(self.lightning_module.trainer)


def test_restored_end_of_epoch_checkpoint_starts_the_next_epoch_at_its_first_batch(tmp_path):
    """``start_next_round_after_restore``: a checkpoint written after an epoch's last batch, restored when
    the next epoch is longer, runs the whole next epoch from batch 0."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    first = quiet_trainer(max_epochs=1, limit_val_batches=0, enable_checkpointing=True, callbacks=[saver])
    internals.reload_data_every_round(first)
    first.fit(Net([2, 5, 3]))
    lengths = EpochLengths()
    trainer = quiet_trainer(
        strategy=RestartingStrategy([]), max_epochs=3, limit_val_batches=0, callbacks=[lengths]
    )
    internals.reload_data_every_round(trainer)
    model = Net([2, 5, 3])
    trainer.fit(model, ckpt_path=tmp_path / "step=2.ckpt")
    assert lengths.batches == {1: [0, 1, 2, 3, 4], 2: [0, 1, 2]}


class ExtendAtFitStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        internals.set_max_rounds(trainer, trainer.max_epochs + 2)


def test_max_epochs_set_at_fit_start_extends_the_fit():
    """``set_max_rounds``: ``fit_loop.max_epochs`` changed at ``on_fit_start`` is honoured."""
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, callbacks=[ExtendAtFitStart()])
    trainer.fit(Net([2]))
    assert trainer.current_epoch == 3 and trainer.global_step == 6


class Bar(TQDMProgressBar):
    pass


def test_default_progress_bar_is_replaced_keeping_its_settings():
    """``replace_default_progress_bar``: the default bar is a plain ``TQDMProgressBar`` in
    ``trainer.callbacks`` with ``refresh_rate`` and ``_leave``; a user's own bar is left alone."""
    trainer = L.Trainer(
        enable_progress_bar=True, logger=False, callbacks=[TQDMProgressBar(refresh_rate=7, leave=True)]
    )
    internals.replace_default_progress_bar(trainer, Bar)
    (bar,) = [c for c in trainer.callbacks if isinstance(c, TQDMProgressBar)]
    assert type(bar) is Bar and bar.refresh_rate == 7 and bar._leave is True
    custom = Bar(refresh_rate=3)
    trainer = L.Trainer(logger=False, callbacks=[custom])
    internals.replace_default_progress_bar(trainer, TQDMProgressBar)
    assert custom in trainer.callbacks


def test_lightnings_default_bar_is_replaced_whichever_it_picks():
    """Lightning's default bar is a ``RichProgressBar`` where ``rich`` is installed, else a ``TQDMProgressBar``:
    either is replaced (a run with ``rich`` installed shows the federated bar too)."""
    trainer = L.Trainer(enable_progress_bar=True, logger=False)
    internals.replace_default_progress_bar(trainer, Bar)
    assert [type(c) for c in trainer.callbacks if isinstance(c, ProgressBar)] == [Bar]


def test_a_plain_rich_progress_bar_is_replaced_keeping_its_settings():
    pytest.importorskip("rich")
    trainer = L.Trainer(logger=False, callbacks=[RichProgressBar(refresh_rate=7, leave=True)])
    internals.replace_default_progress_bar(trainer, Bar)
    (bar,) = [c for c in trainer.callbacks if isinstance(c, ProgressBar)]
    assert type(bar) is Bar and bar.refresh_rate == 7 and bar._leave is True


def test_module_log_signature_is_what_capture_logs_binds():
    """``captured_logs.capture_logs`` binds the user's ``self.log`` calls to ``LightningModule.log``'s
    signature and reads these arguments by name."""
    parameters = inspect.signature(L.LightningModule.log).parameters
    for name in ("name", "value", "prog_bar", "logger", "reduce_fx", "batch_size"):
        assert name in parameters, name


def test_strategy_optimizer_step_runs_after_the_closure_once_per_batch():
    """The round closes in ``Strategy.optimizer_step`` after ``super()``: by then the batch's
    ``training_step`` has run (automatic optimization runs the closure inside it), once per batch."""
    events: list = []
    trainer = quiet_trainer(strategy=RecordingStrategy(events), max_epochs=1, limit_val_batches=0)
    trainer.fit(Net([3], events))
    sequence = [e[0] for e in events if e[0] in ("module.training_step", "strategy.optimizer_step")]
    assert sequence == ["module.training_step", "strategy.optimizer_step"] * 3


class RoundStartSnapshot(Callback):
    """Takes the loops' state as epoch 1's first batch starts; at epoch 1's third batch writes a checkpoint
    holding that state instead of the current one."""

    def __init__(self, path):
        self.path, self.loops = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 0:
            self.loops = internals.loops_state_at_round_start(trainer, 1)
        if trainer.current_epoch == 1 and batch_idx == 2:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            assert checkpoint["loops"].keys() == self.loops.keys()
            checkpoint["loops"] = self.loops
            trainer.strategy.save_checkpoint(checkpoint, self.path)


def test_loops_state_at_round_start_resumes_at_the_epochs_first_batch(tmp_path):
    """``loops_state_at_round_start``: a checkpoint holding the loops' state taken as an epoch's first
    batch starts resumes that epoch from its first batch (the batch counters as before it)."""
    snapshot = RoundStartSnapshot(tmp_path / "start.ckpt")
    first = quiet_trainer(max_epochs=2, limit_val_batches=0, callbacks=[snapshot])
    internals.reload_data_every_round(first)
    first.fit(Net([3, 4]))
    progress = snapshot.loops["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"]["ready"] == progress["current"]["completed"] == 0
    assert progress["total"]["ready"] == progress["total"]["completed"] == 3
    lengths = EpochLengths()
    trainer = quiet_trainer(max_epochs=2, limit_val_batches=0, callbacks=[lengths])
    internals.reload_data_every_round(trainer)
    trainer.fit(Net([3, 4]), ckpt_path=tmp_path / "start.ckpt")
    assert lengths.batches == {1: [0, 1, 2, 3]}
    assert trainer.global_step == 7


class ValidationRecorder(Callback):
    """Records each training batch's ``round_validation_due`` and the epochs whose validation ran (batches)."""

    def __init__(self):
        self.due, self.validated = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.due.append((trainer.current_epoch, batch_idx, internals.round_validation_due(trainer)))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.validated.append((trainer.current_epoch, batch_idx))


def test_round_validation_due_is_true_at_the_last_batch_of_validated_epochs_only():
    for every, limit, validated_epochs in [(1, 1.0, {0, 1, 2}), (2, 1.0, {1}), (1, 0, set())]:
        recorder = ValidationRecorder()
        trainer = quiet_trainer(
            max_epochs=3, callbacks=[recorder], check_val_every_n_epoch=every, limit_val_batches=limit
        )
        internals.reload_data_every_round(trainer)
        trainer.fit(Net([3, 2, 4]))
        due = {(epoch, batch) for epoch, batch, is_due in recorder.due if is_due}
        assert due == {(e, [3, 2, 4][e] - 1) for e in validated_epochs}
        assert {epoch for epoch, _ in recorder.validated} == validated_epochs


class EveryNthSetter(Callback):
    """Sets ``trainer.check_val_every_n_epoch`` in ``on_train_epoch_start`` from a per-epoch table."""

    def __init__(self, values: dict[int, int]):
        self.values = values

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.check_val_every_n_epoch = self.values[trainer.current_epoch]


def test_check_val_every_n_epoch_set_at_epoch_start_decides_that_epochs_validation():
    """``ValidateAtRounds`` relies on it: the epoch loop reads ``trainer.check_val_every_n_epoch`` at the epoch's
    last batch (``_should_check_val_epoch``), so a value set in ``on_train_epoch_start`` decides whether that
    epoch validates (1: yes; a number the run never reaches: no), whatever the Trainer was built with."""
    recorder = ValidationRecorder()
    never = 2**62
    setter = EveryNthSetter({0: 1, 1: never, 2: 1, 3: never})  # built with 2: epochs 1 and 3 would validate
    trainer = quiet_trainer(max_epochs=4, callbacks=[setter, recorder], check_val_every_n_epoch=2)
    internals.reload_data_every_round(trainer)
    trainer.fit(Net([3, 2, 4, 2]))
    assert {epoch for epoch, _ in recorder.validated} == {0, 2}
    assert {(e, b) for e, b, is_due in recorder.due if is_due} == {(0, 2), (2, 3)}


class StartHooks(Callback):
    """Records ``(hook, current_epoch)`` for ``on_train_start`` and ``on_train_epoch_start``."""

    def __init__(self):
        self.calls = []

    def on_train_start(self, trainer, pl_module):
        self.calls.append(("on_train_start", trainer.current_epoch))

    def on_train_epoch_start(self, trainer, pl_module):
        self.calls.append(("on_train_epoch_start", trainer.current_epoch))


def test_a_run_resumed_mid_epoch_calls_on_train_start_with_the_restored_epoch_but_not_on_train_epoch_start(
    tmp_path,
):
    """``ValidateAtRounds`` relies on it: resuming inside epoch 1, ``on_train_start`` runs after the loops are
    restored (``current_epoch`` is 1) and ``on_train_epoch_start`` is not called for epoch 1, only for the
    next one; so the epoch's validation choice is set in ``on_train_start`` too."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first = quiet_trainer(max_epochs=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[saver])
    internals.reload_data_every_round(first)
    first.fit(Net([3, 3, 3]))
    hooks = StartHooks()
    trainer = quiet_trainer(max_epochs=3, limit_val_batches=0, callbacks=[hooks])
    internals.reload_data_every_round(trainer)
    trainer.fit(Net([3, 3, 3]), ckpt_path=tmp_path / "step=4.ckpt")  # epoch 1, after its batch 0
    assert hooks.calls == [("on_train_start", 1), ("on_train_epoch_start", 2)]


class LastBatchCheckpoint(Callback):
    """Writes a checkpoint at epoch 0's last batch end, its loops rewritten by ``rewrite`` (or as they are)."""

    def __init__(self, path, rewrite):
        self.path, self.rewrite = path, rewrite

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and internals.round_ends_now(trainer):
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            if self.rewrite:
                checkpoint["loops"] = internals.loops_state_before_round_validation(checkpoint["loops"])
            trainer.strategy.save_checkpoint(checkpoint, self.path)


def test_loops_state_before_round_validation_resumes_by_validating_the_epoch(tmp_path):
    """Lightning skips epoch 0's validation when resuming from a checkpoint written at its last batch's end
    (``start_next_round_after_restore`` then starts epoch 1 at batch 0); with ``loops_state_before_round_validation`` the resume runs all of it, then epoch 1 from its first batch."""
    for rewrite in (False, True):
        path = tmp_path / f"{rewrite}.ckpt"
        first = quiet_trainer(max_epochs=1, callbacks=[LastBatchCheckpoint(path, rewrite)])
        internals.reload_data_every_round(first)
        first.fit(Net([3, 4]))
        recorder, lengths = ValidationRecorder(), EpochLengths()
        # without the rewrite the federated strategy restarts the next epoch itself (as the test above)
        strategy = {} if rewrite else {"strategy": RestartingStrategy([])}
        trainer = quiet_trainer(max_epochs=2, callbacks=[recorder, lengths], **strategy)
        internals.reload_data_every_round(trainer)
        trainer.fit(Net([3, 4]), ckpt_path=path)
        expected = [(0, 0), (0, 1), (0, 2)] if rewrite else []
        assert recorder.validated == expected + [(1, 0), (1, 1), (1, 2)]
        assert lengths.batches == {1: [0, 1, 2, 3]}
        assert trainer.global_step == 7


def test_requested_num_nodes_is_the_trainer_flag_even_on_a_single_device_strategy():
    for nodes in (1, 3):
        trainer = quiet_trainer(strategy=SingleDeviceStrategy(device="cpu"), num_nodes=nodes)
        assert internals.requested_num_nodes(trainer) == nodes
        assert not hasattr(trainer.strategy, "num_nodes") or trainer.strategy.num_nodes in (1, nodes)
