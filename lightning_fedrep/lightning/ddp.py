"""``FederatedDDPStrategy``: the federated strategy on several processes (GPUs, nodes).

Lightning's DDP machinery launches the processes (``Trainer(devices=N, num_nodes=M)``, ``torchrun``,
SLURM) and creates the process group; the model is *not* wrapped in ``DistributedDataParallel``:
clients are independent, so nothing is reduced per step. Each round's clients are dealt to the ranks
(balanced by steps), every rank runs the same number of Lightning steps (idle steps pad the shorter
ranks), and the round ends with one all-reduce of the weighted sums and one all-gather of what each
rank's clients did. By default every rank then holds every client's state (``client_store=
"replicated"``), so callbacks and evaluation see the whole federation on every rank; with
``client_store="sharded"`` each rank holds only its own clients (client ``c`` on rank ``c % N``), lends
the ones another rank trains for the round, and rank 0 gathers them all for a checkpoint.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_fedrep.federation.collective import ProcessGroupCollective
from lightning_fedrep.federation.settings import (
    note_lost_peer,
    process_settings,
    refuse_callbacks_needing_every_client,
    refuse_lockstep_settings,
)
from lightning_fedrep.lightning import internals
from lightning_fedrep.lightning.strategy import FederatedStrategyMixin
from lightning_fedrep.session.session import takes_federated_settings


class FederatedDDPStrategy(FederatedStrategyMixin, DDPStrategy):
    """Personalized federated learning on several processes: one round's clients sharded over ranks.

    Takes the federated settings (:class:`~lightning_fedrep.session.session.FederatedSession`: ``head``,
    ``algorithm``, ...) and Lightning's DDP process settings:

    Args:
        client_store: ``"replicated"``: every rank holds every client's state (memory: the whole store per
            rank; every callback works as on one process). ``"sharded"``: each rank holds its own clients
            (client ``c`` on rank ``c % N``; memory: 1/N of the store); callbacks that read every client
            (``needs_every_client``, e.g. ``NeuralCollapse``) are refused, and after ``fit`` a client is
            read on the rank holding it, or everywhere after ``gather_clients()``.
        timeout: seconds (or a ``timedelta``) a collective waits for the other processes before failing:
            a process that died makes the others fail with an error after at most this long.
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs); by default Lightning's choice for
            the device.
        start_method: how Lightning starts the processes when it launches them itself (``"popen"``
            re-runs the script; ``"spawn"``/``"fork"``/``"forkserver"`` for notebooks and the like).

    Registered as ``"fedrep_ddp"``, ``"fedper_ddp"``, ``"lg_fedavg_ddp"``, ``"fedavg_ddp"``, ``"local_ddp"``.
    """

    strategy_name = "federated_ddp"
    _registered_as = ("{}_ddp", "{} (several processes)")

    @takes_federated_settings
    def __init__(
        self,
        *args: Any,
        client_store: Literal["replicated", "sharded"] = "replicated",
        timeout: float | timedelta = 1800.0,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ):
        timeout = process_settings(timeout, client_store)
        self.client_store = client_store
        super().__init__(
            *args,
            timeout=timeout,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **kwargs,
        )

    @override
    def setup_environment(self) -> None:
        """Called before the data and the module are set up: create the process group (Lightning), then
        the federation's collectives on it."""
        super().setup_environment()
        self.collective = ProcessGroupCollective()

    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Called after the module's and the data's ``setup``: refuse what needs every rank to step
        together (manual optimization, synchronized batch norm, model averaging), set up as on one
        process, then, with a sharded client store, keep only this rank's clients (refusing callbacks
        that read every client)."""
        manual_fit = trainer.state.fn == "fit" and not self.lightning_module.automatic_optimization
        averaging = self._ddp_comm_state is not None or self._model_averaging_period is not None
        refuse_lockstep_settings(type(self).__name__, manual_fit, self._layer_sync is not None, averaging)
        super().setup(trainer)
        if self.client_store == "sharded":
            refuse_callbacks_needing_every_client(self._callbacks)
            self.federation.shard_clients()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called when training fails: say so when the cause is another process (it died, or did not
        answer within ``timeout``), whose own log holds the reason."""
        super().on_exception(exception)
        note_lost_peer(exception, self._timeout)

    @override
    def configure_ddp(self) -> None:
        """Called in ``setup`` (fit): no ``DistributedDataParallel`` wrapper. Clients are independent; what
        they share is aggregated once per round, not reduced at every backward. What the wrapper would
        have done at its start is done here: every rank starts from rank 0's module (else an unseeded
        run would average bodies of different initializations and hand out rank-dependent heads)."""
        internals.broadcast_module_from_rank_zero(self.model)
