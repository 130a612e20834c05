"""``ValidateAtRounds``: validate after chosen rounds only, e.g. the official SRPFL code's evaluation points."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_fedrep.federation.api.arguments import check_int, check_optional_int

_NEVER = 2**62
"""A ``check_val_every_n_epoch`` no run reaches: Lightning validates when ``(epoch + 1) % n == 0``."""


class ValidateAtRounds(Callback):
    """Validate after round ``r`` (0-based, Lightning's ``current_epoch``) exactly when ``(r + 1) % every == 0``,
    or ``r`` is one of the run's ``last`` rounds (``r >= max_epochs - last``), or ``r`` is in ``rounds``.

    Lightning's ``check_val_every_n_epoch=n`` is the first rule alone. The official SRPFL code evaluates
    where ``iter % test_freq == test_freq - 1 or iter >= epochs - 3`` (its scripts: ``--test_freq 10``,
    150 rounds, so rounds 9, 19, ..., 139 and 147, 148, 149: 17 points): ``ValidateAtRounds(every=10, last=3)``.

    Before each round it sets ``trainer.check_val_every_n_epoch`` to 1 on a round it validates and to a
    number no run reaches on the others (Lightning reads it at the round's last batch), so it replaces the
    Trainer's own ``check_val_every_n_epoch`` (a log line says so), and whatever runs with each validation
    (``FineTunedEvaluation``, ``ModelCheckpoint`` saving on validation) runs at exactly these rounds. The
    sanity check is unchanged, and under ``fast_dev_run`` Lightning's own choice (validate every round) stands.
    List it before any ``EarlyStopping``, which decides at its set-up whether to check after every round.

    Args:
        every: validate after every ``every``-th round (rounds ``every - 1``, ``2 * every - 1``, ...);
            ``None``: no periodic validation.
        last: also validate after each of the run's last ``last`` rounds (needs ``max_epochs``).
        rounds: also validate after these rounds (0-based).
    """

    def __init__(self, every: int | None = None, last: int = 0, rounds: Sequence[int] = ()) -> None:
        owner = "ValidateAtRounds"
        self.every = check_optional_int("every", every, minimum=1, owner=owner)
        self.last = check_int("last", last, minimum=0, owner=owner)
        if isinstance(rounds, str | bytes) or not isinstance(rounds, Sequence):
            raise TypeError(f"{owner}(rounds=...) must be a list of 0-based round indices, got {rounds!r}.")
        self.rounds = tuple(sorted({check_int("rounds", r, minimum=0, owner=owner) for r in rounds}))
        if self.every is None and self.last == 0 and not self.rounds:
            raise ValueError(
                f"{owner}(every=None, last=0, rounds=[]) would never validate: give every=, last= or rounds= "
                "(to switch validation off, pass limit_val_batches=0 to the Trainer instead)."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every}, last={self.last}, rounds={list(self.rounds)})"

    def validates(self, round_index: int, max_epochs: int | None) -> bool:
        """Whether the run validates after round ``round_index`` (0-based) of ``max_epochs`` rounds."""
        periodic = self.every is not None and (round_index + 1) % self.every == 0
        final = self.last > 0 and max_epochs is not None and round_index >= max_epochs - self.last
        return periodic or final or round_index in self.rounds

    def validated_rounds(self, max_epochs: int) -> list[int]:
        """The rounds (0-based) a run of ``max_epochs`` rounds validates after."""
        return [r for r in range(max_epochs) if self.validates(r, max_epochs)]

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.fast_dev_run:
            return
        max_epochs = trainer.max_epochs
        if self.last and (max_epochs is None or max_epochs < 0):
            raise ValueError(
                f"{self!r}: last={self.last} needs the run's length, but the Trainer has max_epochs="
                f"{max_epochs}; set max_epochs (the number of rounds) or drop last=."
            )
        before = trainer.callbacks[: trainer.callbacks.index(self)] if self in trainer.callbacks else []
        if trainer.check_val_every_n_epoch == 1 and any(isinstance(c, EarlyStopping) for c in before):
            raise ValueError(
                f"{self!r} comes after an EarlyStopping in Trainer(callbacks=[...]), which has already decided "
                "to check after every round; list ValidateAtRounds before EarlyStopping."
            )
        chosen = self.validated_rounds(max_epochs) if max_epochs is not None and max_epochs >= 0 else None
        rank_zero_info(
            f"{self!r}: validating after rounds {chosen if chosen is not None else 'as chosen'}"
            f"{f' ({len(chosen)} of {max_epochs})' if chosen is not None else ''}; it replaces "
            f"Trainer(check_val_every_n_epoch={trainer.check_val_every_n_epoch})."
        )
        trainer.check_val_every_n_epoch = _NEVER  # EarlyStopping set up after this checks on validation end

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Set the round's choice once the loops are restored: a run resumed mid-round (or at its last
        batch) does not call ``on_train_epoch_start`` for the round it resumes."""
        self._set_for_round(trainer)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set_for_round(trainer)

    def _set_for_round(self, trainer: L.Trainer) -> None:
        if trainer.fast_dev_run:
            return
        due = self.validates(trainer.current_epoch, trainer.max_epochs)
        trainer.check_val_every_n_epoch = 1 if due else _NEVER
