"""Every place the package relies on Lightning behaviour beyond its documented hooks, in one module.

Each function names the behaviour it relies on; ``tests/test_lightning_contract.py`` pins each one
with a named test, so a Lightning upgrade that changes one fails that test rather than a run.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

_UNREACHABLE_BATCH_COUNT = 2**62


def round_ends_now(trainer: L.Trainer) -> bool:
    """Whether the training batch being run is the epoch's (the round's) last.

    Relies on: the fit loop's ``batch_progress.is_last_batch`` is set before the batch runs, and for a
    sized iterable (the ``RoundLoader``) Lightning does not prefetch, so it is exact.
    """
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def evaluation_ends_now(trainer: L.Trainer) -> bool:
    """Whether the evaluation batch being run is the pass's last (validation inside fit, validate or test)."""
    if trainer.state.fn == "fit":
        loop = trainer.fit_loop.epoch_loop.val_loop
    else:
        loop = trainer.validate_loop if trainer.state.fn == "validate" else trainer.test_loop
    return loop.batch_progress.is_last_batch


def reload_data_every_round(trainer: L.Trainer) -> None:
    """Make Lightning ask the data module for the training iterable (and its length) every epoch.

    Relies on: the fit loop fixes the epoch length when it loads the training data, and re-loads it
    each epoch when ``reload_dataloaders_every_n_epochs == 1``. Rounds differ in length when clients
    differ in size, so the round loader must be re-read every round (it is cheap).
    """
    if trainer.reload_dataloaders_every_n_epochs != 1:
        trainer.reload_dataloaders_every_n_epochs = 1


def start_next_round_after_restore(trainer: L.Trainer) -> None:
    """After restoring a checkpoint written right after a round's last step, start the next round at 0.

    Relies on: Lightning decides whether the restored epoch is over by comparing the restored batch
    count with the *next* epoch's length, which is wrong when rounds differ in length; a count no round
    can reach makes it finish the restored epoch and start the next one from its first batch.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.is_last_batch and progress.current.completed > 0:
        progress.current.completed = _UNREACHABLE_BATCH_COUNT


def set_max_rounds(trainer: L.Trainer, rounds: int) -> None:
    """Change how many epochs (rounds) ``fit`` runs, from a callback's ``on_fit_start``.

    Relies on: ``fit_loop.max_epochs`` is read each epoch, so changing it at ``on_fit_start`` extends
    the fit.
    """
    trainer.fit_loop.max_epochs = rounds


def replace_default_progress_bar(trainer: L.Trainer, bar_class: type[TQDMProgressBar]) -> None:
    """Put ``bar_class`` in place of Lightning's default progress bar (never a user's own bar class).

    Relies on: the default bar is a plain ``TQDMProgressBar``, or a plain ``RichProgressBar`` where the
    ``rich`` package is installed (Lightning picks it then), in ``trainer.callbacks`` at ``connect``, with
    its ``refresh_rate`` and private ``_leave`` settings.
    """
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in (TQDMProgressBar, RichProgressBar):
            trainer.callbacks[index] = bar_class(refresh_rate=callback.refresh_rate, leave=callback._leave)


def loops_state_at_round_start(trainer: L.Trainer, round_index: int) -> dict[str, Any]:
    """The loops' checkpoint state as it is before the round's first batch, taken while that batch starts:
    a checkpoint holding it resumes at the round's first batch (used for a round rolled back on an
    exception).

    Relies on: ``_CheckpointConnector._get_loops_state_dict()`` is what ``dump_checkpoint`` saves under
    ``"loops"``; the fit loop's ``epoch_loop.batch_progress`` has ``ready/started/processed/completed``
    counters (``total`` and ``current``; only ``ready`` has moved when the first batch starts) and
    ``is_last_batch``; the training iterable's state is the list ``state_dict["combined_loader"]`` (the
    ``RoundLoader``'s ``{"round", "position"}``).
    """
    state = copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict())
    fit = state["fit_loop"]
    progress = fit["epoch_loop.batch_progress"]
    for counters in (progress["total"], progress["current"]):
        done = counters["completed"]
        counters.update(ready=done, started=done, processed=done)
    progress["is_last_batch"] = False
    loaders = fit.get("state_dict", {}).get("combined_loader")
    if loaders:
        fit["state_dict"]["combined_loader"] = [{"round": round_index, "position": 0} for _ in loaders]
    return state


def requested_num_nodes(trainer: L.Trainer) -> int:
    """``Trainer(num_nodes=...)`` as the user gave it (a single-device strategy does not keep it).

    Relies on: the accelerator connector stores the flag as ``_num_nodes_flag``.
    """
    return int(trainer._accelerator_connector._num_nodes_flag)


def drop_wandb_anonymous_flag(logger: Any) -> None:
    """Stop a ``WandbLogger`` that has not started its run from passing ``anonymous=None`` to ``wandb.init``
    (W&B warns that the setting has no effect whenever it is passed).

    Relies on: ``WandbLogger`` keeps ``wandb.init``'s keyword arguments in ``_wandb_init`` until its
    ``experiment`` is first created (``_experiment`` is ``None`` until then).
    """
    init = getattr(logger, "_wandb_init", None)
    if (
        getattr(logger, "_experiment", None) is None
        and isinstance(init, dict)
        and init.get("anonymous") is None
    ):
        init.pop("anonymous", None)


def round_validation_due(trainer: L.Trainer) -> bool:
    """Whether Lightning runs validation after the training batch being run (or just run), because it is
    the epoch's (the round's) last and validation is due at the end of this epoch.

    Relies on: the training epoch loop's ``_should_check_val_epoch()`` (``check_val_every_n_epoch``) and
    its end-of-epoch rule in ``_should_check_val_fx``: the last batch validates when ``val_check_batch``
    divides its index + 1; validation by time interval or across epochs is not end-of-round validation.
    """
    loop = trainer.fit_loop.epoch_loop
    if not trainer.enable_validation or trainer.check_val_every_n_epoch is None:
        return False
    if trainer._val_check_time_interval is not None or not loop.batch_progress.is_last_batch:
        return False
    if not loop._should_check_val_epoch():
        return False
    every = trainer.val_check_batch
    return every == float("inf") or (loop.batch_idx + 1) % int(every) == 0


def loops_state_before_round_validation(loops: dict[str, Any]) -> dict[str, Any]:
    """The loops' checkpoint state ``loops`` rewritten as it is when the epoch's last batch has completed and
    validation has started its first batch: a checkpoint holding it resumes by running that validation from
    its first batch, then the next epoch. Lightning itself skips the validation when resuming from a
    checkpoint written at the last batch's end or during validation; a round's evaluation would be lost.

    Relies on: the checkpoint's ``fit_loop`` holds ``epoch_loop.batch_progress`` and
    ``epoch_loop.val_loop.batch_progress`` with ``total``/``current`` counters; a training batch progress
    with all counters equal and ``is_last_batch`` makes the epoch loop restart "on last", and a validation
    progress with ``ready == started == processed + 1 == completed + 1`` makes the validation loop restart
    "mid-evaluation", which the epoch loop finishes by running the validation (from ``completed``: 0).
    """
    state = copy.deepcopy(loops)
    fit = state["fit_loop"]
    training = fit["epoch_loop.batch_progress"]
    for counters in (training["total"], training["current"]):
        counters["completed"] = counters["processed"]
    training["is_last_batch"] = True
    validation = fit["epoch_loop.val_loop.batch_progress"]
    for counters in (validation["total"], validation["current"]):
        counters.update(ready=1, started=1, processed=0, completed=0)
    validation["is_last_batch"] = False
    return state


def broadcast_module_from_rank_zero(module: torch.nn.Module) -> None:
    """Give every process rank 0's parameters and buffers (what ``DistributedDataParallel`` does when it
    wraps a module; the federated DDP strategy does not wrap it).

    Relies on: ``lightning.pytorch.overrides.distributed._sync_module_states`` broadcasting a module's
    state from rank 0 over the default process group.
    """
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


def configured_optimizers(module: L.LightningModule) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns (in any of the forms Lightning accepts), for
    a call that configures none (validate, test)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    return list(optimizers)
