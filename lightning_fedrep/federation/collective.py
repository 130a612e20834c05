"""The processes a federation runs on, and the few collectives it needs (one per round and per pass).

A federation on one process talks to itself: :class:`Collective` returns its inputs. On several
processes (:class:`~lightning_fedrep.lightning.ddp.FederatedDDPStrategy`), :class:`ProcessGroupCollective`
runs them on ``torch.distributed``'s default group: an all-reduce of the round's weighted sums, an
all-gather of what each rank's clients did (their results and local state), of evaluation sums, and of
each rank's view of the round plan (ranks that disagree fail together, never hang).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Collective:
    """One process: every collective returns what it was given."""

    @property
    def rank(self) -> int:
        """This process's rank (0 on one process)."""
        return 0

    @property
    def world_size(self) -> int:
        """The number of processes (1 here)."""
        return 1

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """The element-wise sum of ``tensor`` over processes (in place where the backend allows)."""
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, by rank (picklable; put tensors on the CPU first)."""
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj``, by rank, on rank ``dst`` (``None`` on the others)."""
        return [obj]

    def agree(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value``; raises on every rank (together, so none waits) if they differ."""
        values = self.all_gather_object(value)
        if any(v != values[0] for v in values[1:]):
            raise RuntimeError(
                f"The {self.world_size} processes disagree on {what}: {values} (by rank). Every rank must compute "
                "the same round plans: give every process the same data, seed and callbacks, and make "
                "configure_round decide from state every rank shares (the federation's history and results)."
            )
        return values


class ProcessGroupCollective(Collective):
    """``torch.distributed``'s default process group (created by Lightning's launcher). Tensors are
    reduced on it; pickled objects (client states, metric tables) travel on a gloo group through host
    memory, so that on NCCL they never take GPU memory. Create it on every rank (it creates a group)."""

    def __init__(self) -> None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError(
                "ProcessGroupCollective needs an initialized torch.distributed process group; the "
                "FederatedDDPStrategy creates one when Lightning launches the processes."
            )
        gloo = torch.distributed.get_backend() == "gloo"
        self._objects = None if gloo else torch.distributed.new_group(backend="gloo")

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj, group=self._objects)
        return gathered

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst, group=self._objects)
        return gathered


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (nested in lists, tuples and dicts) detached on the CPU: what
    is sent to other ranks as a picklable object, so no rank receives tensors on another rank's GPU."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(v) for v in value)
    return value
