"""The federated entry of a checkpoint: what the strategy writes under ``checkpoint["lightning_fedrep"]``
(every client's state, the open round's, the history, each process's share) and how a process reads its
share back. Lightning-free: the strategy hands in what it read from the Trainer (whether the run was
interrupted, whether the round's validation is owed) and writes the returned entry.

The file, version and entry checks are in :mod:`lightning_fedrep.federation.checkpoint.reading`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.checkpoint.reading import CheckpointError, check_version
from lightning_fedrep.federation.collective import Collective, to_cpu

CHECKPOINT_KEY = "lightning_fedrep"
"""Where a checkpoint holds the federation's state (every client's, the open round's, the history)."""


class RunnerState(Protocol):
    """What a checkpoint keeps of the runner of a round's local work (``settings()`` is ``None`` for a
    runner that keeps nothing: the sequential one)."""

    def settings(self) -> dict[str, Any] | None: ...

    def state_dict(self) -> dict[str, Any] | None: ...


class OptimizerState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


def federated_entry(
    federation: Federation,
    collective: Collective,
    *,
    runner: RunnerState | None,
    optimizers: Sequence[OptimizerState],
    round_start_loops: dict[str, Any] | None,
    interrupted: bool,
    validation_owed: bool,
) -> dict[str, Any]:
    """The federated entry of a checkpoint written now (a collective on several processes, unless
    ``interrupted``: the other processes may be gone, so it records the writing rank alone)."""
    state = federation.state_dict()
    settings = runner.settings() if runner is not None else None
    if settings is not None:  # the lockstep runner's (the sequential runner keeps nothing)
        state["engine"] = settings
        if federation.round_open:
            state["round"]["engine"] = runner.state_dict()
    if federation.round_open and round_start_loops is not None:
        state["round"]["start_loops"] = round_start_loops
    if collective.distributed and interrupted:
        state["interrupted_on_rank"] = collective.rank
    elif collective.distributed:  # each process's open round, RNG, optimizer state, clients
        own = _rank_share(federation, state, optimizers)
        if federation.store.sharded:  # every rank's clients to rank 0, which writes
            state["clients"] = federation.gathered_store_state()
        state["ranks"] = collective.all_gather_object(to_cpu(own))
    if validation_owed:
        state["validation_owed"] = True
    return state


def _rank_share(
    federation: Federation, state: dict[str, Any], optimizers: Sequence[OptimizerState]
) -> dict[str, Any]:
    """Each process's own part: its open round, RNG, optimizer state and its clients' round records."""
    own = {
        "round": state["round"],
        "torch_rng": state["torch_rng"],
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        **federation.round_records(),
    }
    if "cuda_rng" in state:
        own["cuda_rng"] = state["cuda_rng"]
    return own


def read_federated_entry(checkpoint: dict[str, Any], path: Any) -> dict[str, Any] | None:
    """The checkpoint's federated entry (``None`` for a plain checkpoint), refused if of another version or
    written by one rank alone when a run on several processes stopped on an exception."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        return None
    check_version(state, path)
    if "interrupted_on_rank" in state:
        raise ValueError(
            f"{path} was written by rank {state['interrupted_on_rank']} alone when a run on "
            "several processes stopped on an exception: it does not hold the other processes' clients. Resume "
            "from a checkpoint written at the end of a round (or mid-round by ModelCheckpoint)."
        )
    return state


def this_rank_state(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The saved state with this process's open round and RNG (a checkpoint written by several processes
    holds one per rank); a round-end checkpoint resumes on any number of processes."""
    ranks = state.get("ranks")
    saved = len(ranks) if ranks else 1
    if state["round"]["open"] and saved != world_size:
        raise ValueError(
            f"The checkpoint was saved inside round {state['round']['index']} by {saved} process(es), but this "
            f"run has {world_size}. Resume it on {saved}, or resume from a checkpoint written at the end of a "
            "round (those resume on any number of processes)."
        )
    if ranks:
        return {**state, **ranks[min(rank, len(ranks) - 1)]}
    return state


def restore_rank_state(federation: Federation, state: dict[str, Any]) -> None:
    """Restore this process's open round, RNG and round records from its :func:`this_rank_state`."""
    federation.restore_round(state)
    federation.restore_round_records(
        {"records": state.get("records", []), "borrowed": state.get("borrowed", [])}
    )


def check_round_runner(state: dict[str, Any], vectorized: bool) -> None:
    """Refuse to resume inside a round with another runner than the one that saved it."""
    saved = "vectorized" if "engine" in state["round"] else "sequential"
    running = "vectorized" if vectorized else "sequential"
    if saved != running:
        raise ValueError(
            f"The checkpoint was saved inside round {state['round']['index']} by the {saved} runner, but "
            f"this run uses the {running} one. Resume with runner='{saved}', or from a checkpoint written "
            "at the end of a round."
        )


def round_evaluation_missing(federation: Federation | None, validated_round: int) -> bool:
    """Whether the last closed round has no evaluation yet (``validated_round``: the last round validated
    in this fit): a checkpoint written before its validation ends must make the resumed run validate it."""
    if federation is None or federation.round_open or federation.round_index < 0:
        return False
    return not (
        federation.round_index == validated_round or federation.history.is_evaluated(federation.round_index)
    )


def refuse_plain_checkpoint_in_fit(checkpoint: dict[str, Any], path: Any, in_fit: bool) -> None:
    """A checkpoint of a plain (non-federated) fit resumed into a federated fit would carry its epoch counter
    over as rounds already done (``max_epochs=3`` after 1 epoch: 2 rounds); refuse it, saying how to start
    from its weights. Evaluating it (``validate``/``test``, ``in_fit`` false) is fine: every client gets its
    model."""
    if not in_fit:
        return
    epochs = checkpoint.get("epoch", 0)
    raise CheckpointError(
        f"The checkpoint {path} has no federated state: it was written by a fit without a federated strategy "
        f"(after {epochs} epoch(s)), and resuming it would count those epochs as federated rounds already done. "
        "To start a federated training from its weights, load them into the module and fit without ckpt_path: "
        "model = MyModule.load_from_checkpoint(path) (or model.load_state_dict(torch.load(path)['state_dict'])), "
        "then trainer.fit(model, datamodule=...)."
    )
